"""The protocol surface: every seed method has a counterpart with the seed's defaults."""

import jax.numpy as jnp
import pytest

from turbospark_jax import errors
from turbospark_jax.core.protocols import (
    ChunkedPrefillRunner,
    LogitProducer,
    SpeculativeProducer,
    VerifyingTarget,
)
from turbospark_jax.core.state import FedRecord


class _Minimal(SpeculativeProducer):
    """Implements only what is abstract, so every default is visible."""

    vocab_size = 4

    def init_state(self):
        return ()

    def produce(self, state, token, position):
        return jnp.zeros(4), (*state, token)

    def prime_drafter(self, state, next_token, position):
        return state

    def draft_step(self, state, token, position):
        return jnp.zeros(4), state

    def rewind_drafter(self, state, position):
        return state

    def drafter_position(self, state):
        return len(state)

    def fed_record(self, state):
        return FedRecord.empty(4)

    def checkpoint(self, state):
        return state

    def rollback(self, state, point):
        return point

    def verify(self, state, feed, base):
        return jnp.zeros((len(feed), 4)), state


def test_seed_capability_defaults():
    p = _Minimal()
    assert p.supports_chunked_drafter_prefill() is False
    assert p.drafts_block_passes() is False
    assert p.supports_headless_prefill() is False
    assert p.supports_retaining_rollback() is False
    assert p.supports_draft_bursts() is False
    assert p.device_draft_limit() == 0
    assert p.can_rewind is False
    assert p.max_positions is None


def test_default_reuse_is_zero_and_fresh():
    p = _Minimal()
    n, state = p.try_reuse_prefix((1, 2, 3), [1, 2, 3, 0])
    assert n == 0 and state == ()


def test_reuse_of_an_empty_prompt_is_refused():
    """The answer must be strictly shorter than the prompt, so an empty one has none."""
    with pytest.raises(errors.BadInputError, match="empty"):
        _Minimal().try_reuse_prefix((1,), [])


def test_default_prefill_advances_like_produce():
    p = _Minimal()
    assert p.produce_prefill((), 3, 0) == p.produce((), 3, 0)[1]


def test_reset_is_a_fresh_state():
    assert _Minimal().reset((1, 2)) == ()


def test_record_committed_default_is_identity():
    assert _Minimal().record_committed((1,), [2, 3], 1) == (1,)


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.prefill_chunk_priming_drafter((), [1], 0, None),
        lambda p: p.draft_block((), 1, 0, 3),
        lambda p: p.rollback_retaining((), (), 1),
        lambda p: p.rewind((1, 2), 1),
        lambda p: p.draft_burst((), 1, 0, 2, params=None, history=None, key=None, index=0),
        lambda p: p.device_rounds((), 1, draft_len=2, budget=4, params=None, history=None,
                                  key=None, gen_index=0, remaining=4),
        lambda p: p.launch_rounds((), 1, draft_len=2, budget=4, params=None, history=None,
                                  key=None, gen_index=0, remaining=4),
        lambda p: p.continue_rounds((), None, 4),
        lambda p: p.collect_rounds(None),
    ],
    ids=["prefill_chunk_priming_drafter", "draft_block", "rollback_retaining", "rewind",
         "draft_burst", "device_rounds", "launch_rounds", "continue_rounds", "collect_rounds"],
)
def test_refusing_defaults_raise_our_error(call):
    with pytest.raises(errors.UnsupportedCapabilityError) as info:
        call(_Minimal())
    assert "_Minimal" in str(info.value)


def test_every_seed_method_has_a_counterpart():
    seed_methods = {
        LogitProducer: ["reset", "try_reuse_prefix", "produce", "produce_prefill"],
        ChunkedPrefillRunner: ["prefill_chunk", "prefill_chunk_with_status"],
        SpeculativeProducer: [
            "prime_drafter", "supports_chunked_drafter_prefill", "prefill_chunk_priming_drafter",
            "draft_step", "drafts_block_passes", "draft_block", "rewind_drafter", "checkpoint",
            "rollback", "supports_headless_prefill", "record_committed",
            "supports_retaining_rollback", "rollback_retaining", "verify",
        ],
    }
    for cls, names in seed_methods.items():
        for name in names:
            method = getattr(cls, name)
            assert method.__doc__ and len(method.__doc__) > 40, f"{cls.__name__}.{name} docstring"
    assert issubclass(SpeculativeProducer, VerifyingTarget)


def test_error_hierarchy():
    for cls in (errors.BadInputError, errors.UnsupportedCapabilityError,
                errors.ProducerExhaustedError, errors.ModelLoadError, errors.SessionError,
                errors.ContextOverflowError, errors.ProducerFailedError):
        assert issubclass(cls, errors.TurbosparkError)
    assert issubclass(errors.BadInputError, ValueError)
    assert issubclass(errors.ContextOverflowError, errors.BadInputError)
