"""Prefix reuse on states that cannot rewind: prompt-end snapshots, restored only while the
state's lineage passes through them, give bitwise the output of serving fresh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark_jax import CompletionRequest, SamplingConfig, run_raw_completion
from turbospark_jax.engine.producer import MAX_SNAPSHOTS, BlockProducer
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.testing.fixtures import SnapshotReference
from turbospark_jax.testing.toy import toy_recurrent_producer

V = 32


def _qwen35() -> BlockProducer:
    config = QC.Qwen35Config.from_hf_dict(dict(
        model_type="qwen3_5_text", vocab_size=V, hidden_size=32, intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_hidden_layers=3, layer_types=[QC.LINEAR, QC.FULL, QC.LINEAR],
        initializer_range=0.1,
    ))
    model = Q.FAMILY.build(config, jnp.float32, "list")
    return BlockProducer(model, model.init_params(jax.random.PRNGKey(0)), capacity=128,
                         width=4, steps_per_call=8, donate=True)


PRODUCERS = {
    "toy_recurrent": toy_recurrent_producer(vocab=V, capacity=128, width=4, steps_per_call=8),
    "qwen3_5": _qwen35(),
}
SAMPLED = SamplingConfig(temperature=0.9, top_k=12)


def _turn(producer, prompt, state, seed):
    request = CompletionRequest(prompt_ids=list(prompt), max_tokens=5, sampling=SAMPLED,
                                seed=seed, record_logits=True)
    return run_raw_completion(producer, request, state=state)


def _same(a, b) -> bool:
    return a.token_ids == b.token_ids and np.array_equal(a.logits.view(np.uint32),
                                                         b.logits.view(np.uint32))


@pytest.mark.parametrize("name", sorted(PRODUCERS))
def test_a_changed_reply_reuses_the_previous_prompt_end(name):
    p = PRODUCERS[name]
    first = [3, 1, 4, 1, 5, 9, 2, 6]
    one = _turn(p, first, None, 0)
    # the reply comes back changed (re-tokenized differently, say): the record's tail is lost
    second = first + [(t + 1) % V for t in one.token_ids] + [7, 7]
    two = _turn(p, second, one.state, 1)
    assert two.usage.reused_tokens == len(first)  # restored from the prompt-end snapshot
    assert _same(two, _turn(p, second, None, 1))


class _NoLineage(BlockProducer):
    """Control: restores any snapshot inside the common prefix, of whatever history."""

    def _reuse_snapshot(self, state, record, prompt_ids, injected):
        from turbospark_jax.core.kv_prefix import common_prefix

        common = common_prefix(record.ids, record.injected, prompt_ids, injected)
        fits = [s for s in state.snapshots if 0 < int(s.count) <= common]
        if not fits:
            return 0, self.init_state()
        best = max(fits, key=lambda s: int(s.count))
        from turbospark_jax.core.state import restore_durable

        restored = state.replace(cache=restore_durable(state.cache, best.values))
        return int(best.count), self._with_count(restored, int(best.count))


def _branching_conversation(p):
    """Four turns where a snapshot of another branch lies inside the last common prefix."""
    base = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    t1 = _turn(p, base, None, 0)                                       # snapshot at 10
    branch_a = base + [8] * 9 + [2]                                    # 20 tokens
    t2 = _turn(p, branch_a, t1.state, 1)                               # snapshot at 20 (a)
    branch_b = [*base, 7, 7, 7, 7, 7, 7, 4]                            # diverges at 10
    t3 = _turn(p, branch_b, t2.state, 2)                               # restores 10, snap 17
    fed = t3.fed_ids                                                   # 21 positions
    last = [*fed[:20], (fed[20] + 1) % V, 1]                           # parts from it at 20
    t4 = _turn(p, last, t3.state, 3)
    return t4, _turn(p, last, None, 3)


def test_a_snapshot_of_another_branch_is_never_restored():
    p = PRODUCERS["toy_recurrent"]
    got, fresh = _branching_conversation(p)
    assert got.usage.reused_tokens == 17 and _same(got, fresh)
    blind = _NoLineage(p.model, p.params, capacity=128, width=4, steps_per_call=8)
    got, fresh = _branching_conversation(blind)
    assert got.usage.reused_tokens == 20 and not _same(got, fresh)  # the control is caught


@pytest.mark.parametrize("name", sorted(PRODUCERS))
@settings(max_examples=6)
@given(turns=st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(0, V - 1), min_size=1,
                                                             max_size=4)),
                      min_size=3, max_size=5))
def test_multi_turn_reuse_equals_fresh(name, turns):
    """Each turn cuts the conversation at a random point of its reply and appends a message;
    reuse follows the snapshot rule and every turn is bitwise what serving fresh gives."""
    p = PRODUCERS[name]
    prompt, state = [2, 7, 1, 8], None
    reference, fed = SnapshotReference(keep=MAX_SNAPSHOTS), ()
    for i, (cut, message) in enumerate(turns):
        got = _turn(p, prompt, state, i)
        expected = reference.reuse(fed, prompt) if state is not None else 0
        assert got.usage.reused_tokens == expected
        reference.served(prompt, got.usage.reused_tokens)
        assert _same(got, _turn(p, prompt, None, i))
        state, fed = got.state, got.fed_ids
        prompt = list(prompt) + got.token_ids[:cut] + message


def test_snapshots_are_not_part_of_what_a_state_means():
    p = PRODUCERS["toy_recurrent"]
    one = _turn(p, [1, 2, 3], None, 0)
    assert len(one.state.snapshots) == 1
    bare = dataclasses.replace(one.state, snapshots=())
    from turbospark_jax.core.state import live_equal

    assert live_equal(one.state, bare)
