"""The speculative loop: greedy is token-for-token (and logit-for-logit) plain greedy, sampled
preserves the target distribution, rollback by value, stops inside accepted blocks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax import CompletionRequest, SamplingConfig, run_raw_completion, stream_completion
from turbospark_jax.core import sampling
from turbospark_jax.core.state import FedRecord
from turbospark_jax.engine.program import BlockState
from turbospark_jax.errors import BadInputError
from turbospark_jax.generation.speculative_loop import MAX_DRAFT, run_raw_completion_speculative
from turbospark_jax.speculative.drafters import DraftModelDrafter, NGramDrafter, OracleDrafter
from turbospark_jax.speculative.drafters.ngram import NGramDevice, propose
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_jax.speculative.rounds import (
    DraftSampler,
    history_rows,
    point_masses,
    proposal_distributions,
)
from turbospark_jax.speculative.rounds import judge as _judge
from turbospark_jax.testing.toy import toy_attention_producer, toy_recurrent_producer

V = 32
TARGET = toy_attention_producer(vocab=V, capacity=160, width=16, steps_per_call=8)
RNN = toy_recurrent_producer(vocab=V, capacity=160, width=16, steps_per_call=8)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]


def drafters_for(target_factory):
    return {
        "same_model": DraftModelDrafter(target_factory(vocab=V, capacity=160, width=16)),
        "other_model": DraftModelDrafter(target_factory(vocab=V, capacity=160, width=16, seed=5)),
        "ngram": NGramDrafter(V, max_n=3),
    }


ATT_DRAFTERS = drafters_for(toy_attention_producer)
RNN_DRAFTERS = drafters_for(toy_recurrent_producer)
GREEDY = CompletionRequest(prompt_ids=PROMPT, max_tokens=40, record_logits=True)
PLAIN = {"attention": run_raw_completion(TARGET, GREEDY),
         "recurrent": run_raw_completion(RNN, GREEDY)}


def pair(target, drafter, loop):
    return SpeculativePair(target, drafter, device_rounds=loop == "device")


def spec(producer, request, draft_len, **kwargs):
    return run_raw_completion_speculative(
        producer, dataclasses.replace(request, draft_len=draft_len), **kwargs
    )


LOOPS = ["device", "host"]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("draft_len", range(1, MAX_DRAFT + 1))
@pytest.mark.parametrize("drafter", sorted(ATT_DRAFTERS))
def test_greedy_is_plain_greedy_token_for_token_and_bit_for_bit(draft_len, drafter, loop):
    got = spec(pair(TARGET, ATT_DRAFTERS[drafter], loop), GREEDY, draft_len)
    plain = PLAIN["attention"]
    assert got.speculative.on_device == (loop == "device")
    assert got.token_ids == plain.token_ids
    # the target logits behind every emitted token equal plain decoding's, bitwise
    assert np.array_equal(got.logits.view(np.uint32), plain.logits.view(np.uint32))
    assert got.fed_ids == plain.fed_ids
    assert got.speculative.rounds >= 1


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("draft_len", [1, 4, 8])
@pytest.mark.parametrize("drafter", sorted(RNN_DRAFTERS))
def test_greedy_lossless_on_a_recurrent_target_rolled_back_by_value(draft_len, drafter, loop):
    got = spec(pair(RNN, RNN_DRAFTERS[drafter], loop), GREEDY, draft_len)
    plain = PLAIN["recurrent"]
    assert got.token_ids == plain.token_ids
    assert np.array_equal(got.logits.view(np.uint32), plain.logits.view(np.uint32))
    assert got.fed_ids == plain.fed_ids


def test_control_a_lossy_judgement_is_caught():
    """The bitwise check can fail: a target whose verify rows are one bit off (and so differ
    from its decode rows) breaks spec == plain."""
    from turbospark_jax.testing.conformance import perturbed

    lossy = perturbed(TARGET, "verify_row_bit")
    got = spec(pair(lossy, ATT_DRAFTERS["ngram"], "host"), GREEDY, 4)
    plain = PLAIN["attention"]
    assert not np.array_equal(got.logits.view(np.uint32), plain.logits.view(np.uint32))


@pytest.mark.parametrize("target", ["attention", "recurrent"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("drafter", ["other_model", "ngram", "oracle"])
def test_device_rounds_equal_host_rounds_on_the_same_seed(drafter, temperature, target):
    t = TARGET if target == "attention" else RNN
    # A rewinding draft model has a device form; a recurrent one does not (tested below).
    d = ATT_DRAFTERS.get(drafter) or OracleDrafter(V, PROMPT + PLAIN[target].token_ids, 0.7)
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=30, record_logits=True, seed=4,
                            sampling=SamplingConfig(temperature=temperature, top_k=16,
                                                    repetition_penalty=1.1))
    device = spec(pair(t, d, "device"), req, 4)
    host = spec(pair(t, d, "host"), req, 4)
    assert device.speculative.on_device and not host.speculative.on_device
    assert device.token_ids == host.token_ids
    assert np.array_equal(device.logits.view(np.uint32), host.logits.view(np.uint32))
    assert device.fed_ids == host.fed_ids
    assert device.speculative.drafted_by_position == host.speculative.drafted_by_position
    assert device.speculative.accepted_by_position == host.speculative.accepted_by_position


def test_a_drafter_without_a_device_form_runs_the_host_loop():
    p = SpeculativePair(TARGET, RNN_DRAFTERS["other_model"])  # a recurrent draft model
    assert p.device_draft_limit() == 0
    got = spec(p, GREEDY, 4)
    assert not got.speculative.on_device
    assert got.token_ids == PLAIN["attention"].token_ids


def test_draft_model_equal_to_target_accepts_nearly_everything():
    got = spec(SpeculativePair(TARGET, ATT_DRAFTERS["same_model"]), GREEDY, 4)
    stats = got.speculative
    assert stats.acceptance_rate >= 0.98
    assert stats.mean_acceptance_length > 4.0
    assert stats.acceptance_by_position == [1.0] * 4
    assert stats.drafted == sum(stats.drafted_by_position)


def test_oracle_acceptance_follows_alpha():
    """The oracle drafter is right with probability alpha per position: the mean
    acceptance length approaches the geometric expectation."""
    long = CompletionRequest(prompt_ids=PROMPT, max_tokens=140)
    ref = run_raw_completion(TARGET, long)
    oracle = OracleDrafter(V, PROMPT + ref.token_ids, 0.8, seed=1)
    got = spec(SpeculativePair(TARGET, oracle), long, 4)
    expected = sum(0.8**i for i in range(5))  # 1 + a + a^2 + a^3 + a^4
    assert got.token_ids == ref.token_ids
    assert abs(got.speculative.mean_acceptance_length - expected) < 0.5
    assert OracleDrafter(V, PROMPT, 1.0).block((), PROMPT[:3], 2)[0] == PROMPT[3:5]


class _NoRetain(SpeculativePair):
    def supports_retaining_rollback(self):
        return False


@pytest.mark.parametrize("target", ["attention", "recurrent"])
def test_retaining_rollback_equals_rollback_plus_reverify(target):
    t, drafters = (TARGET, ATT_DRAFTERS) if target == "attention" else (RNN, RNN_DRAFTERS)
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=30, record_logits=True,
                            sampling=SamplingConfig(temperature=0.8), seed=4)
    fast = spec(pair(t, drafters["other_model"], "host"), req, 5)
    slow = spec(_NoRetain(t, drafters["other_model"], device_rounds=False), req, 5)
    assert fast.token_ids == slow.token_ids
    assert np.array_equal(fast.logits, slow.logits)
    assert fast.fed_ids == slow.fed_ids


class _NoBursts(SpeculativePair):
    def supports_draft_bursts(self):
        return False


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_device_draft_bursts_equal_step_by_step_drafting(temperature):
    """One decode call for the draft block proposes exactly what draft_step calls would."""
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=30, record_logits=True, seed=2,
                            sampling=SamplingConfig(temperature=temperature, top_k=16))
    fast = spec(pair(TARGET, ATT_DRAFTERS["other_model"], "host"), req, 4)
    slow = spec(_NoBursts(TARGET, ATT_DRAFTERS["other_model"], device_rounds=False), req, 4)
    assert fast.token_ids == slow.token_ids
    assert np.array_equal(fast.logits, slow.logits)
    assert fast.speculative == slow.speculative


def test_draft_burst_longer_than_the_drafters_burst_cap():
    short = DraftModelDrafter(toy_attention_producer(vocab=V, capacity=160, width=16,
                                                     steps_per_call=2, seed=5))
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=30, record_logits=True, seed=2,
                            sampling=SamplingConfig(temperature=0.9))
    capped = spec(pair(TARGET, short, "host"), req, 5)
    stepwise = spec(_NoBursts(TARGET, short, device_rounds=False), req, 5)
    assert capped.token_ids == stepwise.token_ids
    assert np.array_equal(capped.logits, stepwise.logits)


@pytest.mark.parametrize("loop", LOOPS)
def test_stop_token_inside_an_accepted_block_matches_plain(loop):
    plain = PLAIN["attention"]
    stop = plain.token_ids[6]
    k = plain.token_ids.index(stop)
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=40, stop_token_ids=[stop])
    want = run_raw_completion(TARGET, req)
    got = spec(pair(TARGET, ATT_DRAFTERS["same_model"], loop), req, 8)
    assert got.token_ids == want.token_ids == plain.token_ids[: k + 1]
    assert got.fed_ids == want.fed_ids == tuple(PROMPT + plain.token_ids[:k])
    assert got.finish_reason is want.finish_reason


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("max_tokens", [1, 2, 7, 9])
def test_max_tokens_and_fed_record_match_plain(max_tokens, loop):
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=max_tokens)
    want = run_raw_completion(TARGET, req)
    got = spec(pair(TARGET, ATT_DRAFTERS["same_model"], loop), req, 4)
    assert got.token_ids == want.token_ids and got.fed_ids == want.fed_ids
    assert got.usage == want.usage


@pytest.mark.parametrize("burst", [1, 3, 16])
def test_device_bursts_of_any_length_give_the_same_output(burst):
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=30, record_logits=True, seed=6,
                            burst=burst, sampling=SamplingConfig(temperature=1.0))
    ref = spec(pair(TARGET, ATT_DRAFTERS["other_model"], "host"), req, 3)
    got = spec(pair(TARGET, ATT_DRAFTERS["other_model"], "device"), req, 3)
    assert got.token_ids == ref.token_ids and got.fed_ids == ref.fed_ids


def test_sampled_runs_reproduce_exactly_with_a_seed():
    req = CompletionRequest(prompt_ids=PROMPT, max_tokens=24, seed=9,
                            sampling=SamplingConfig(temperature=1.0, top_k=12, top_p=0.9,
                                                    repetition_penalty=1.2))
    p = SpeculativePair(TARGET, ATT_DRAFTERS["other_model"])
    a, b = spec(p, req, 3), spec(p, req, 3)
    assert a.token_ids == b.token_ids
    assert a.speculative == b.speculative


def test_streaming_tokens_equal_the_completion():
    stream = stream_completion(SpeculativePair(TARGET, NGramDrafter(V)),
                               CompletionRequest(prompt_ids=PROMPT, max_tokens=12))
    seen = [t for e in stream for t in e.token_ids]
    assert seen == stream.result.token_ids
    assert stream.result.speculative is not None


@pytest.mark.parametrize("loop", LOOPS)
def test_reuse_across_speculative_turns(loop):
    p = pair(TARGET, ATT_DRAFTERS["other_model"], loop)
    first = spec(p, CompletionRequest(prompt_ids=PROMPT, max_tokens=8), 4)
    prompt2 = PROMPT + first.token_ids[:5] + [7, 7]
    again = spec(p, CompletionRequest(prompt_ids=prompt2, max_tokens=8), 4, state=first.state)
    fresh = run_raw_completion(TARGET, CompletionRequest(prompt_ids=prompt2, max_tokens=8))
    assert again.usage.reused_tokens == len(PROMPT) + 5
    assert again.token_ids == fresh.token_ids


def test_bad_input():
    other_vocab = toy_attention_producer(vocab=V + 1)
    with pytest.raises(BadInputError, match="vocabulary"):
        SpeculativePair(TARGET, DraftModelDrafter(other_vocab))
    with pytest.raises(BadInputError, match="draft_len"):
        spec(SpeculativePair(TARGET, NGramDrafter(V)), GREEDY, MAX_DRAFT + 1)
    with pytest.raises(BadInputError, match="draft_len"):
        spec(SpeculativePair(TARGET, NGramDrafter(V)), GREEDY, -1)
    with pytest.raises(BadInputError, match="not a SpeculativeProducer"):
        run_raw_completion_speculative(TARGET, GREEDY)
    with pytest.raises(BadInputError, match="cannot draft"):
        stream_completion(TARGET, dataclasses.replace(GREEDY, draft_len=2))
    with pytest.raises(BadInputError, match="min_n"):
        NGramDrafter(V, max_n=1, min_n=2)
    with pytest.raises(BadInputError, match="alpha"):
        OracleDrafter(V, PROMPT, 1.5)


def test_plain_decoding_through_a_pair_with_draft_len_zero():
    got = stream_completion(SpeculativePair(TARGET, NGramDrafter(V)),
                            dataclasses.replace(GREEDY, draft_len=0)).drain()
    assert got.speculative is None and got.token_ids == PLAIN["attention"].token_ids


@pytest.mark.parametrize("seed", range(6))
def test_device_ngram_lookup_equals_the_host_lookup(seed):
    rng = np.random.default_rng(seed)
    known = [int(t) for t in rng.integers(0, 4, rng.integers(1, 40))]
    fed = FedRecord.from_ids(known[:-1], capacity=48)
    for max_n, min_n in ((3, 1), (2, 2), (4, 1)):
        device = NGramDevice(max_n=max_n, min_n=min_n)
        for m in (1, 3, 8):
            target = BlockState(cache=(), fed=fed)
            proposals, _, count, _ = jax.jit(device.propose)(
                (), (), target, jnp.int32(known[-1]), jnp.int32(m), None)
            got = [int(t) for t in np.asarray(proposals)[: int(count)]]
            assert got == propose(known, m, max_n, min_n), (known, max_n, min_n, m)


def test_ngram_proposes_the_latest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, max_n=3) == [7, 5, 1]
    assert propose([1, 2, 3, 4], 2, max_n=2) == []
    assert propose([5, 6, 5], 4, max_n=2) == [6, 5]


# -- the judgement reads only the rows it needs, and keeps the drafter's q ---------------------


def _judge_every_row(rows, q, proposals, m, params, history, key, index):
    """The judgement written the plain way: ``p`` for every row at once, the bonus sampled
    from the raw row. :func:`judge` stops at the first rejection and reuses the shaped row;
    it must emit exactly this."""
    accept_key, resample_key = jax.random.fold_in(key, 2), jax.random.fold_in(key, 3)
    draft = proposals.shape[0]
    hist = history_rows(history, proposals)
    p = jax.vmap(sampling.probabilities, in_axes=(0, None, 0))(rows, params, hist)
    i = jnp.arange(draft, dtype=jnp.int32)
    u = jax.vmap(lambda j: jax.random.uniform(sampling.token_key(accept_key, index + j)))(i)
    keep = (i < m) & (u * q[i, proposals] < p[i, proposals])
    accepted = jnp.sum(jnp.cumprod(keep.astype(jnp.int32)))
    at = jax.tree.map(lambda a: a[accepted], hist)
    bonus = sampling.sample(rows[accepted], params, at, sampling.token_key(key, index + accepted))
    q_at = jnp.where(accepted < draft, q[jnp.minimum(accepted, draft - 1)], 0.0)
    residual = jnp.maximum(p[accepted] - q_at, 0.0)
    resampled = jax.random.categorical(
        sampling.token_key(resample_key, index + accepted),
        jnp.where(residual > 0, jnp.log(jnp.where(residual > 0, residual, 1.0)), -jnp.inf),
    ).astype(jnp.int32)
    rejected = (params.temperature > 0) & (jnp.sum(residual) > 0) & (accepted < m)
    final = jnp.where(rejected, resampled, bonus).astype(jnp.int32)
    out = jnp.concatenate([proposals, jnp.full((1,), -1, jnp.int32)])
    out = jnp.where(jnp.arange(draft + 1) < accepted, out, -1).at[accepted].set(final)
    return out, accepted + 1, at.add(final)


JUDGE_V = 64
JUDGE_SETTINGS = [
    SamplingConfig(),
    SamplingConfig(temperature=0.8, top_p=0.9),
    SamplingConfig(temperature=1.0, top_k=12),
    SamplingConfig(temperature=0.7, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3,
                   frequency_penalty=0.1),
    SamplingConfig(temperature=1.3, top_k=20, top_p=0.8, min_p=0.02),
]
_judge_jit = jax.jit(_judge)
_every_row_jit = jax.jit(_judge_every_row)


def _judge_case(seed: int, config: SamplingConfig, point_mass: bool):
    """Random target rows, proposals drawn from nearby drafter rows, their q, and ``m``."""
    rng = np.random.default_rng(seed)
    params = config.to_params()
    target = rng.standard_normal((MAX_DRAFT + 1, JUDGE_V)).astype(np.float32) * 2.0
    target[::3] = np.round(target[::3])  # ties
    drafter = jnp.asarray(target[:MAX_DRAFT] + rng.standard_normal(
        (MAX_DRAFT, JUDGE_V)).astype(np.float32) * 0.7)
    history = sampling.History.from_prompt(rng.integers(0, JUDGE_V, 5), JUDGE_V).add(
        jnp.int32(3))
    key = sampling.request_key(seed)
    hist, proposals = history, []
    for i in range(MAX_DRAFT):
        proposals.append(int(sampling.sample(drafter[i], params, hist,
                                             sampling.token_key(key, 50 + i))))
        hist = hist.add(jnp.int32(proposals[-1]))
    proposals = jnp.asarray(proposals, jnp.int32)
    m = jnp.int32(rng.integers(0, MAX_DRAFT + 1))
    q = (point_masses(proposals, m, JUDGE_V) if point_mass
         else proposal_distributions(drafter, proposals, m, params, history))
    return jnp.asarray(target), q, proposals, m, params, history, key, jnp.int32(seed % 7)


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("config", JUDGE_SETTINGS, ids=range(len(JUDGE_SETTINGS)))
def test_judge_equals_the_judgement_over_every_row_bitwise(config, point_mass):
    counts = set()
    for seed in range(12):
        case = _judge_case(seed, config, point_mass)
        got = _judge_jit(*case)
        want = _every_row_jit(*case)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), (seed, config)
        counts.add(int(got[1]))
        # The rows after the first rejection are never read: NaN there changes nothing.
        rows = case[0].at[int(got[1]):].set(jnp.nan)
        again = _judge_jit(rows, *case[1:])
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(got), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), (seed, config)
    assert len(counts) > 1  # the cases reject at different rows


def test_control_the_judge_comparison_sees_a_changed_bonus_key():
    """The comparison above can fail: a bonus drawn with the next token's key differs."""
    config = JUDGE_SETTINGS[1]
    differ = 0
    for seed in range(12):
        case = _judge_case(seed, config, False)
        shifted = _every_row_jit(*case[:-1], case[-1] + 1)
        differ += not np.array_equal(np.asarray(_judge_jit(*case)[0]), np.asarray(shifted[0]))
    assert differ > 0


@pytest.mark.parametrize("config", JUDGE_SETTINGS[1:], ids=range(1, len(JUDGE_SETTINGS)))
def test_device_draft_loop_keeps_the_q_the_host_loop_recomputes(config):
    """The draft model's device loop keeps each row's q as it samples; the host loop
    recomputes q from the drafter's logits. Bitwise the same."""
    drafter = ATT_DRAFTERS["other_model"]
    device, params = drafter.on_device()
    params_s, m, start = config.to_params(), 6, len(PROMPT) - 1
    state = drafter.prime(drafter.init_state(), PROMPT[:-1], 0)
    target = BlockState(cache=(), fed=FedRecord.from_ids(PROMPT[:-1], capacity=160))
    history = sampling.History.from_prompt(PROMPT, V)
    sampler = DraftSampler(params=params_s, history=history, key=sampling.request_key(8),
                           index=jnp.int32(2))
    proposals, q, count, _ = jax.jit(device.propose)(
        params, state, target, jnp.int32(PROMPT[-1]), jnp.int32(m), sampler)
    assert int(count) == m
    rows, tok = [], PROMPT[-1]
    for i in range(m):
        logits, state = drafter.step(state, tok, start + i)
        rows.append(logits)
        tok = int(proposals[i])
    rows = jnp.zeros((MAX_DRAFT, V), jnp.float32).at[:m].set(jnp.stack(rows))
    want = proposal_distributions(rows, proposals, count, params_s, history)
    assert np.array_equal(np.asarray(q).view(np.uint32), np.asarray(want).view(np.uint32))


# -- the rejection sampler preserves the target distribution ---------------------------------

SMALL_V = 8


def _first_token_histogram(p_logits, q_probs, proposals_fn, n, seed):
    """Run the judgement ``n`` times with fresh keys; histogram of the first emitted token."""
    params = sampling.SamplingParams.make(temperature=1.0)
    hist = sampling.History.empty(SMALL_V)
    rows = jnp.zeros((MAX_DRAFT + 1, SMALL_V)).at[: p_logits.shape[0]].set(p_logits)
    q = jnp.zeros((MAX_DRAFT, SMALL_V)).at[: q_probs.shape[0]].set(q_probs)
    m = q_probs.shape[0]

    def one(key):
        k_draft, k_judge = jax.random.split(key)
        proposals = proposals_fn(k_draft)
        padded = jnp.zeros((MAX_DRAFT,), jnp.int32).at[:m].set(proposals)
        toks, count, _ = _judge(rows, q, padded, jnp.int32(m), params, hist, k_judge,
                                jnp.int32(0))
        return toks[0], toks[1], count

    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    first, second, count = jax.jit(jax.vmap(one))(keys)
    return np.asarray(first), np.asarray(second), np.asarray(count)


def _tv(a, b):
    return 0.5 * float(np.abs(np.asarray(a) - np.asarray(b)).sum())


def test_rejection_sampling_matches_the_target_distribution():
    rng = np.random.RandomState(0)
    p_logits = jnp.asarray(rng.randn(3, SMALL_V).astype(np.float32) * 1.5)
    q_probs = jax.nn.softmax(jnp.asarray(rng.randn(2, SMALL_V).astype(np.float32) * 1.5))
    p0 = np.asarray(jax.nn.softmax(p_logits[0]))

    def draft(key):
        ks = jax.random.split(key, 2)
        return jnp.stack([jax.random.categorical(ks[i], jnp.log(q_probs[i])) for i in range(2)])

    distances = []
    for n in (500, 5000, 50000):
        first, _, _ = _first_token_histogram(p_logits, q_probs, draft, n, seed=n)
        emp = np.bincount(first, minlength=SMALL_V) / n
        distances.append(_tv(emp, p0))
    assert distances[0] > distances[2], distances
    assert distances[2] < 0.02, distances
    # beats random reference distributions by a wide margin
    refs = [np.asarray(jax.nn.softmax(jnp.asarray(rng.randn(SMALL_V) * 1.5))) for _ in range(20)]
    emp = np.bincount(first, minlength=SMALL_V) / len(first)
    assert all(_tv(emp, r) > 3 * distances[2] for r in refs)


def test_second_token_after_acceptance_follows_the_next_row():
    rng = np.random.RandomState(1)
    p_logits = jnp.asarray(rng.randn(2, SMALL_V).astype(np.float32))
    q_probs = jax.nn.softmax(jnp.asarray(rng.randn(1, SMALL_V).astype(np.float32)))

    def draft(key):
        return jax.random.categorical(key, jnp.log(q_probs[0]))[None]

    _, second, count = _first_token_histogram(p_logits, q_probs, draft, 60000, seed=3)
    bonus = second[count == 2]
    emp = np.bincount(bonus, minlength=SMALL_V) / len(bonus)
    assert _tv(emp, np.asarray(jax.nn.softmax(p_logits[1]))) < 0.03


def test_point_mass_proposals_are_lossless_too():
    """A deterministic drafter (n-gram): accept with p(x), else resample from p without x."""
    rng = np.random.RandomState(2)
    p_logits = jnp.asarray(rng.randn(2, SMALL_V).astype(np.float32))
    q_probs = jax.nn.one_hot(jnp.array([3]), SMALL_V)
    first, _, _ = _first_token_histogram(p_logits, q_probs, lambda key: jnp.array([3]), 40000, 5)
    emp = np.bincount(first, minlength=SMALL_V) / len(first)
    assert _tv(emp, np.asarray(jax.nn.softmax(p_logits[0]))) < 0.02


def test_control_a_biased_acceptance_rule_is_caught():
    """The statistical check can fail: always accepting the proposal yields q, not p."""
    rng = np.random.RandomState(0)
    p0 = np.asarray(jax.nn.softmax(jnp.asarray(rng.randn(SMALL_V) * 1.5)))
    q0 = np.asarray(jax.nn.softmax(jnp.asarray(rng.randn(SMALL_V) * 1.5)))
    draws = np.asarray(jax.random.categorical(jax.random.PRNGKey(0), jnp.log(q0), shape=(50000,)))
    emp = np.bincount(draws, minlength=SMALL_V) / len(draws)
    assert _tv(emp, p0) > 0.1


@pytest.mark.parametrize("seed", range(6))
def test_the_greedy_judge_is_the_judge_at_temperature_zero(seed):
    """The rounds' greedy variant judges as the general judge does at temperature 0: same
    tokens, count and history, with penalties on and ties in the rows (lowest id wins)."""
    from turbospark_jax.core import sampling
    from turbospark_jax.speculative.rounds import history_rows, judge_greedy, point_masses

    rng = np.random.default_rng(seed)
    vocab = 12
    rows = np.round(rng.normal(size=(MAX_DRAFT + 1, vocab)), 1).astype(np.float32)  # ties
    rows[:, 3] = rows[:, 5] = rows.max(axis=1) + 1.0  # an exact tie for the top every row
    history = sampling.History.from_prompt([int(t) for t in rng.integers(0, vocab, 5)], vocab)
    params = sampling.SamplingConfig(temperature=0.0, repetition_penalty=1.3,
                                     presence_penalty=0.2).to_params()
    # Proposals that follow the greedy tokens for a random prefix, then go wrong.
    greedy = [int(t) for t in jax.vmap(sampling.greedy_token, in_axes=(0, None, 0))(
        jnp.asarray(rows), params, history_rows(history, jnp.zeros((MAX_DRAFT,), jnp.int32)))]
    proposals = np.array(greedy[:MAX_DRAFT], np.int32)
    right = int(rng.integers(0, MAX_DRAFT + 1))
    proposals[right:] = (proposals[right:] + 1) % vocab
    for m in (0, right, MAX_DRAFT):
        args = (jnp.asarray(rows), jnp.asarray(proposals), jnp.int32(m))
        q = point_masses(args[1], args[2], vocab)
        want = _judge(args[0], q, args[1], args[2], params, history,
                      sampling.request_key(seed), jnp.int32(3))
        got = judge_greedy(*args, params, history)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    # Control: the general judge at a temperature is not what the greedy one gives.
    hot = sampling.SamplingConfig(temperature=5.0).to_params()
    args = (jnp.asarray(rows), jnp.asarray(proposals), jnp.int32(MAX_DRAFT))
    outs = {tuple(np.asarray(_judge(args[0], point_masses(args[1], args[2], vocab), *args[1:],
                                    hot, history, sampling.request_key(k), jnp.int32(0))[0]))
            for k in range(8)}
    assert outs != {tuple(np.asarray(judge_greedy(*args, hot, history)[0]))}
