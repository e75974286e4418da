"""Prefix reuse keyed on the fed record: the rules of kv_prefix, checked against their
definition with hypothesis, each with a control that breaks one rule; the same rules through
a BlockProducer's try_reuse_prefix (injected embeddings included)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from turbospark_jax.core.kv_prefix import NOT_INJECTED, common_prefix, reusable_prefix
from turbospark_jax.errors import BadInputError
from turbospark_jax.testing.toy import toy_attention_producer, toy_recurrent_producer

PrefixFn = Callable[[Sequence[int], Sequence[int] | None, Sequence[int], Mapping[int, int]], int]

# Small alphabets so that random records and prompts share long prefixes often.
ids = st.lists(st.integers(0, 3), max_size=12)
identities = st.integers(0, 2)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], dict[int, int]]:
    """A fed record (ids + injection identities), a prompt that often extends it, injections."""
    fed = draw(ids)
    fed_injected = draw(st.lists(identities, min_size=len(fed), max_size=len(fed)))
    keep = draw(st.integers(0, len(fed)))
    prompt = fed[:keep] + draw(ids)
    injected = draw(st.dictionaries(st.integers(0, 12), st.integers(1, 2), max_size=3))
    return fed, fed_injected, prompt, injected


def violations(
    fn: PrefixFn,
    fed: list[int],
    fed_injected: list[int],
    prompt: list[int],
    injected: dict[int, int],
) -> list[str]:
    """Which rules ``fn`` breaks on one case (empty: none)."""
    n = fn(fed, fed_injected, prompt, injected)

    def matches(i: int) -> bool:
        return fed[i] == prompt[i] and fed_injected[i] == injected.get(i, NOT_INJECTED)

    broken = []
    if not 0 <= n <= max(0, min(len(fed), len(prompt) - 1)):
        broken.append(f"n={n} out of range (must leave one prompt token, stay in the record)")
        return broken
    if not all(matches(i) for i in range(n)):
        broken.append(f"n={n} reuses a position whose id or injected identity differs")
    if n < min(len(fed), len(prompt) - 1) and matches(n):
        broken.append(f"n={n} stops before a matching position")
    return broken


def _claims_one_more(fed, fed_injected, prompt, injected):
    return common_prefix(fed, fed_injected, prompt, injected) + 1


def _ignores_injections(fed, fed_injected, prompt, injected):
    del fed_injected, injected
    return common_prefix(fed, None, prompt)


def _reuses_whole_prompt(fed, fed_injected, prompt, injected):
    n = common_prefix(fed, fed_injected, prompt, injected)
    return n + 1 if n == len(prompt) - 1 and n < len(fed) and fed[n] == prompt[n] else n


def _stops_early(fed, fed_injected, prompt, injected):
    return max(0, common_prefix(fed, fed_injected, prompt, injected) - 1)


@given(cases())
def test_common_prefix_follows_every_rule(case):
    assert violations(common_prefix, *case) == []


@pytest.mark.parametrize(
    ("broken", "case"),
    [
        (_claims_one_more, ([1, 2, 3], [0, 0, 0], [1, 2, 0, 0], {})),
        (_ignores_injections, ([1, 2, 3], [0, 7, 0], [1, 2, 3, 4], {})),
        (_ignores_injections, ([1, 2, 3], [0, 0, 0], [1, 2, 3, 4], {1: 7})),
        (_reuses_whole_prompt, ([1, 2, 3], [0, 0, 0], [1, 2, 3], {})),
        (_stops_early, ([1, 2, 3], [0, 0, 0], [1, 2, 3, 4], {})),
    ],
    ids=["claims_one_more", "ignores_fed_injection", "ignores_prompt_injection",
         "reuses_whole_prompt", "stops_early"],
)
def test_controls_each_break_a_rule(broken, case):
    """The rule check can fail: each broken variant is caught on a case it gets wrong."""
    assert violations(broken, *case)
    assert violations(common_prefix, *case) == []


def test_injected_identities_stop_the_prefix():
    fed, ids_only = [5, 6, 7, 8], [5, 6, 7, 8, 9]
    assert common_prefix(fed, [0, 0, 3, 0], ids_only) == 2  # an image the prompt lacks
    assert common_prefix(fed, [0, 0, 3, 0], ids_only, {2: 3}) == 4  # the same image
    assert common_prefix(fed, [0, 0, 3, 0], ids_only, {2: 4}) == 2  # another image
    assert common_prefix(fed, [0, 0, 0, 0], ids_only, {1: 3}) == 1  # the prompt injects anew
    assert common_prefix(fed, None, ids_only) == 4


def test_a_full_hit_still_leaves_one_token_and_empty_inputs_reuse_nothing():
    assert common_prefix([1, 2, 3], None, [1, 2, 3]) == 2
    assert common_prefix([1, 2, 3], None, [1, 2]) == 1
    assert common_prefix([1, 2, 3], None, [1]) == 0
    assert common_prefix([1, 2, 3], None, []) == 0
    assert common_prefix([], None, [1, 2]) == 0


def test_mismatched_record_lengths_are_refused():
    with pytest.raises(BadInputError, match="equally long"):
        common_prefix([1, 2, 3], [0, 0], [1, 2, 3, 4])


@given(cases())
def test_non_rewindable_states_reuse_only_their_whole_record(case):
    fed, fed_injected, prompt, injected = case
    n = reusable_prefix(fed, fed_injected, prompt, injected, rewindable=False)
    full = common_prefix(fed, fed_injected, prompt, injected)
    assert n == (full if full == len(fed) else 0)
    assert reusable_prefix(fed, fed_injected, prompt, injected) == full


ATT = toy_attention_producer(vocab=32, capacity=32, width=4, steps_per_call=8)
RNN = toy_recurrent_producer(vocab=32, capacity=32, width=4, steps_per_call=8)


def _fed_state(producer, tokens, injected_at=None):
    """A producer state that fed ``tokens``, with an injection identity marked where asked
    (the toys embed ids only; marking the record is what an image-injecting model does)."""
    _, state = producer.prefill_chunk(producer.init_state(), tokens, 0)
    if injected_at is not None:
        pos, identity = injected_at
        state = state.replace(fed=state.fed.replace(
            injected=state.fed.injected.at[pos].set(jnp.int32(identity))))
    return state


def test_block_producer_reuse_stops_at_an_injected_position():
    tokens = [3, 1, 4, 1, 5, 9]
    prompt = [*tokens, 2, 6]
    assert ATT.try_reuse_prefix(_fed_state(ATT, tokens), prompt)[0] == 6
    marked = _fed_state(ATT, tokens, injected_at=(3, 11))
    assert ATT.try_reuse_prefix(marked, prompt)[0] == 3
    n, state = ATT.try_reuse_prefix(marked, prompt, injected={3: 11})
    assert n == 6 and int(state.fed.count) == 6
    assert ATT.try_reuse_prefix(marked, prompt, injected={3: 12})[0] == 3


def test_recurrent_producer_reuses_only_a_whole_record():
    tokens = [3, 1, 4, 1, 5, 9]
    assert RNN.try_reuse_prefix(_fed_state(RNN, tokens), [*tokens, 2])[0] == 6
    n, state = RNN.try_reuse_prefix(_fed_state(RNN, tokens), [3, 1, 4, 7, 7])
    assert n == 0 and int(state.fed.count) == 0
