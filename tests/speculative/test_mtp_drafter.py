"""The MTP head as a drafter: lossless through the device and the host rounds, its first
proposals what the head computes from the trunk's rows directly, and bad pairings refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax import CompletionRequest, SamplingConfig, run_raw_completion
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.speculative.drafters import MTPDrafter
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_jax.testing.toy import toy_attention_producer

V = 48


def _config(mtp_layers: int) -> QC.Qwen35Config:
    return QC.Qwen35Config.from_hf_dict(dict(
        model_type="qwen3_5_text", vocab_size=V, hidden_size=32, intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_hidden_layers=3, layer_types=[QC.LINEAR, QC.FULL, QC.LINEAR],
        mtp_num_hidden_layers=mtp_layers, initializer_range=0.1,
    ))


def _target(mtp_layers: int = 1, width: int = 6) -> BlockProducer:
    model = Q.FAMILY.build(_config(mtp_layers), jnp.float32, "list")
    params = model.init_params(jax.random.PRNGKey(0))
    return BlockProducer(model, params, capacity=128, width=width, steps_per_call=8)


TARGET = _target()
PROMPT = [5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]
GREEDY = CompletionRequest(prompt_ids=PROMPT, max_tokens=36, record_logits=True)
PLAIN = run_raw_completion(TARGET, GREEDY)


@pytest.mark.parametrize("device", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("draft_len", [1, 3, 5])
def test_greedy_with_the_mtp_head_is_plain_greedy_bit_for_bit(draft_len, device):
    pair = SpeculativePair(TARGET, MTPDrafter(TARGET), device_rounds=device)
    got = run_raw_completion_speculative(pair, dataclasses.replace(GREEDY, draft_len=draft_len))
    assert got.speculative.on_device == device
    assert got.token_ids == PLAIN.token_ids
    assert np.array_equal(got.logits.view(np.uint32), PLAIN.logits.view(np.uint32))
    assert got.fed_ids == PLAIN.fed_ids


def test_device_and_host_rounds_agree_when_sampling():
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=30, record_logits=True, seed=3,
                            sampling=SamplingConfig(temperature=0.8, top_k=20), draft_len=4)
    a = run_raw_completion_speculative(SpeculativePair(TARGET, MTPDrafter(TARGET)), req)
    b = run_raw_completion_speculative(
        SpeculativePair(TARGET, MTPDrafter(TARGET), device_rounds=False), req)
    assert a.token_ids == b.token_ids and a.fed_ids == b.fed_ids
    assert a.speculative.accepted_by_position == b.speculative.accepted_by_position


def test_first_proposals_are_the_heads_own_chain_over_the_trunk_rows():
    """Reference written apart from the drafter: run the head over every prompt row in one
    call (trunk hidden at p, token at p + 1; the pending token after the last), then chain."""
    model, params = TARGET.model, TARGET.params
    state = TARGET.prefill_chunk(TARGET.init_state(), PROMPT, 0)[1]
    pending = 11
    n = len(PROMPT)
    hidden = state.cache.hidden_rows[:n]
    nxt = jnp.asarray([*PROMPT[1:], pending], jnp.int32)
    cache = model.mtp_init_cache(128)
    logits, h, cache = model.mtp_block_forward(params, cache, hidden, nxt,
                                               jnp.arange(n, dtype=jnp.int32), jnp.int32(n))
    want = [int(jnp.argmax(logits[-1]))]
    last = h[-1]
    for i in range(2):
        logits, h, cache = model.mtp_block_forward(
            params, cache, last[None], jnp.asarray([want[-1]], jnp.int32),
            jnp.asarray([n + i], jnp.int32), jnp.int32(1))
        want.append(int(jnp.argmax(logits[0])))
        last = h[0]
    drafter = MTPDrafter(TARGET)
    got, _ = drafter.block(drafter.init_state(), [*PROMPT, pending], 3, target=state)
    assert got == want


def test_pairings_the_head_cannot_serve_are_refused():
    with pytest.raises(BadInputError, match="MTP head"):
        MTPDrafter(_target(mtp_layers=0))
    with pytest.raises(BadInputError, match="MTP head"):
        MTPDrafter(toy_attention_producer(vocab=V))
    with pytest.raises(BadInputError, match="target="):
        drafter = MTPDrafter(TARGET)
        drafter.block(drafter.init_state(), PROMPT, 2)


@pytest.mark.parametrize("draft_len", [2, 5])
def test_unrecorded_greedy_device_rounds_run_fixed_and_are_plain_greedy(draft_len):
    """Without the rows recorded the device rounds run as a loop of known trip count: the
    pair catches the head up before the chain's first call (the 20-token prompt is more than
    three of the target's 6-row blocks behind), and each round then catches up one block."""
    from turbospark_jax.speculative.rounds import runs_fixed_rounds

    pair = SpeculativePair(TARGET, MTPDrafter(TARGET))
    device = MTPDrafter(TARGET).on_device()[0]
    assert runs_fixed_rounds(device, True, False) and device.caught_up
    assert not MTPDrafter(TARGET)._device.loop_free  # the host loop's form: no bound (control)
    req = dataclasses.replace(GREEDY, draft_len=draft_len, record_logits=False)
    got = run_raw_completion_speculative(pair, req)
    assert got.speculative.on_device
    assert got.token_ids == PLAIN.token_ids and got.fed_ids == PLAIN.fed_ids


def test_control_without_the_catch_up_the_bounded_rounds_leave_the_head_behind(monkeypatch):
    """The bound holds only because the pair catches the head up first: skipped, a round
    catches up one 6-row block of the 20-token prompt and the head stays behind the target
    (the tokens would still be plain greedy: the target judges them). One round: budget 1."""
    from turbospark_jax.core import sampling
    from turbospark_jax.speculative import pair as pair_module

    def behind_after_one_call():
        pair = SpeculativePair(TARGET, MTPDrafter(TARGET))
        logits, state = pair.prefill_chunk_priming_drafter(pair.init_state(), PROMPT, 0, None)
        _, state = pair.device_rounds(
            state, int(np.argmax(np.asarray(logits))), draft_len=3, budget=1,
            params=sampling.SamplingParams.greedy(), history=sampling.History.empty(V),
            key=sampling.request_key(0), gen_index=1, remaining=30, record_logits=False)
        return int(pair.fed_record(state).count) - int(state.drafter.fed.count)

    assert behind_after_one_call() <= 4  # at most what the last round committed
    monkeypatch.setattr(pair_module, "catch_up_compiled", lambda device, p, state, t: state)
    assert behind_after_one_call() > 6
