"""Draw plans: a decode program that draws with no branch on the sampling settings.

* :func:`~turbospark_jax.core.sampling.draw_plan` classifies settings (greedy, sampled with
  top-k and top-p off, top-k of at most 64, other truncation), and
  :func:`~turbospark_jax.core.sampling.draw_as` under that plan draws bitwise what
  :func:`~turbospark_jax.core.sampling.draw` draws, over random logits, penalties and keys; the
  ``"top_k"`` plan's draw among the 64 candidates over 120 settings with ties, in the CPU's
  and the GPU's (blocked) form. The control: the plan for untruncated settings, given
  truncating ones, draws ids that top-k removes.
* ``BlockProducer.decode`` of a model whose widths agree (a row-invariant plan) compiles its
  decode loop by the plan, running its steps in chunks of ``DECODE_CHUNK`` (idle past the
  count or a stop); its tokens, logits, history and the state it leaves equal those of the
  loop that branches and checks its condition every step (``"any"``), stops inside a chunk
  included (control: one more fed step shows in the state); a model with XLA's kernels
  keeps the one program.
* Refusals: an unknown plan, settings that are not ``SamplingParams``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbospark_jax.core import sampling
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel
from turbospark_jax.testing.fixtures import backend_plan

VOCAB = 96

SETTINGS = {
    "greedy": dict(),
    "greedy, penalised": dict(repetition_penalty=1.3, presence_penalty=0.5),
    "sampled": dict(temperature=0.9),
    "sampled, min-p": dict(temperature=1.2, min_p=0.05, frequency_penalty=0.2),
    "top-k": dict(temperature=0.8, top_k=5),
    "top-p": dict(temperature=0.7, top_p=0.8),
    "both": dict(temperature=1.0, top_k=40, top_p=0.9, repetition_penalty=1.1),
    "wide top-k": dict(temperature=1.0, top_k=70, top_p=0.95),
}
PLANS = {
    "greedy": "greedy", "greedy, penalised": "greedy", "sampled": "sampled",
    "sampled, min-p": "sampled", "top-k": "top_k", "top-p": "truncated",
    "both": "top_k", "wide top-k": "truncated",
}


def test_draw_plan_classifies_settings() -> None:
    for name, kw in SETTINGS.items():
        assert sampling.draw_plan(sampling.SamplingParams.make(**kw), VOCAB) == PLANS[name]
    # top-k at or past the vocabulary and top-p of 1 are off.
    off = sampling.SamplingParams.make(temperature=0.5, top_k=VOCAB, top_p=1.0)
    assert sampling.draw_plan(off, VOCAB) == "sampled"
    assert sampling.draw_plan(off, VOCAB + 1) == "truncated"  # 96 ids kept: above 64
    at_most = sampling.SamplingParams.make(temperature=0.5, top_k=sampling.CANDIDATES)
    assert sampling.draw_plan(at_most, 1000) == "top_k"


def _history(rng: np.random.Generator, vocab: int) -> sampling.History:
    counts = rng.integers(0, 3, vocab) * (rng.random(vocab) < 0.2)
    return sampling.History(counts=jnp.asarray(counts, jnp.int32),
                            seen=jnp.asarray((counts > 0) | (rng.random(vocab) < 0.1)))


@pytest.mark.parametrize("vocab", [VOCAB, 1000])
def test_draw_as_is_draw_for_its_plan(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    branching = jax.jit(sampling.draw)
    planned = jax.jit(sampling.draw_as, static_argnums=0)
    for name, kw in SETTINGS.items():
        params = sampling.SamplingParams.make(**kw)
        plan = sampling.draw_plan(params, vocab)
        for trial in range(12):
            logits = jnp.asarray(rng.normal(0, 3, vocab).astype(np.float32))
            history = _history(rng, vocab)
            key = sampling.token_key(sampling.request_key(trial), trial)
            want = int(branching(logits, params, history, key))
            assert int(planned(plan, logits, params, history, key)) == want, (name, trial)
            assert int(planned("any", logits, params, history, key)) == want, (name, trial)


def test_control_a_plan_of_other_settings_draws_otherwise() -> None:
    """Truncating settings drawn under the untruncated plan land outside their top-k: the
    comparison above would see a plan that skipped the filters."""
    params = sampling.SamplingParams.make(temperature=2.0, top_k=2)
    logits = jnp.asarray(np.linspace(0.0, 1.0, VOCAB, dtype=np.float32))
    history = sampling.History.empty(VOCAB)
    planned = jax.jit(sampling.draw_as, static_argnums=0)
    top2 = {VOCAB - 1, VOCAB - 2}
    keys = [sampling.token_key(sampling.request_key(7), i) for i in range(40)]
    right = {int(planned("truncated", logits, params, history, k)) for k in keys}
    wrong = {int(planned("sampled", logits, params, history, k)) for k in keys}
    assert right <= top2
    assert wrong - top2


def test_refusals() -> None:
    params = sampling.SamplingParams.greedy()
    history = sampling.History.empty(VOCAB)
    with pytest.raises(BadInputError, match="plan must be one of"):
        sampling.draw_as("nucleus", jnp.zeros(VOCAB), params, history, sampling.request_key(0))
    with pytest.raises(BadInputError, match="params must be SamplingParams"):
        sampling.draw_plan({"temperature": 0.5}, VOCAB)
    with pytest.raises(BadInputError, match="vocab_size"):
        sampling.draw_plan(params, 0)


# -- the decode loop ---------------------------------------------------------------------------

def _model(kernels: str) -> tuple[DenseModel, Any]:
    config = DenseConfig(
        model_type="qwen3", vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        tie_word_embeddings=True,
    )
    model = DenseModel(config, jnp.float32, plan=backend_plan(kernels == "rowinv"))
    return model, model.init_params(jax.random.PRNGKey(3))


def _decode(producer: BlockProducer, params: sampling.SamplingParams) -> tuple:
    prompt = [5, 17, 33, 2, 80, 41, 9]
    _, state = producer.prefill_chunk(producer.init_state(), prompt[:-1], 0)
    history = sampling.History.from_prompt(prompt, VOCAB)
    burst, _ = producer.decode(state, prompt[-1], 12, params=params, history=history,
                               key=sampling.request_key(11), gen_index=1)
    return burst.tokens, np.asarray(burst.logits), burst.history


@pytest.fixture()
def traced_plans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The plans :func:`sampling.draw_as` is traced with."""
    seen: list[str] = []
    original = sampling.draw_as

    def spy(plan: str, *args: Any) -> jax.Array:
        seen.append(plan)
        return original(plan, *args)

    monkeypatch.setattr(sampling, "draw_as", spy)
    return seen


def test_rowinv_decode_draws_by_plan_and_equals_the_branching_loop(
    monkeypatch: pytest.MonkeyPatch, traced_plans: list[str]
) -> None:
    model, params = _model("rowinv")
    producer = BlockProducer(model, params, capacity=64, width=1, steps_per_call=12,
                             donate=False)
    for name, kw in SETTINGS.items():
        settings = sampling.SamplingParams.make(**kw)
        planned = _decode(producer, settings)
        with monkeypatch.context() as m:
            m.setattr(sampling, "draw_plan", lambda *_: "any")
            branching = _decode(producer, settings)
        assert planned[0] == branching[0], name
        assert np.array_equal(planned[1].view(np.uint32), branching[1].view(np.uint32)), name
        for a, b in zip(jax.tree.leaves(planned[2]), jax.tree.leaves(branching[2]), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), name
    assert set(traced_plans) == {"greedy", "sampled", "top_k", "truncated"}


def test_xla_kernels_decode_in_the_one_program(traced_plans: list[str]) -> None:
    model, params = _model("xla")
    producer = BlockProducer(model, params, capacity=64, width=4, steps_per_call=12,
                             donate=False)
    tokens, _, _ = _decode(producer, sampling.SamplingParams.make(temperature=0.8, top_k=5))
    assert len(tokens) == 12
    assert traced_plans == []


def _same_tree(a: Any, b: Any) -> bool:
    """Every leaf bitwise equal, the producers' identities (``fed.owner``) aside."""
    a = a.replace(fed=a.fed.replace(owner=b.fed.owner))
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    def bits(x: Any) -> tuple:
        x = np.asarray(x)
        return x.shape, x.dtype, x.tobytes()

    return len(la) == len(lb) and all(bits(x) == bits(y) for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize("steps, stop_at", [(3, None), (12, 2), (12, 9), (16, 15)])
def test_chunked_decode_stops_and_leaves_the_state_as_the_branching_loop(
    monkeypatch: pytest.MonkeyPatch, steps: int, stop_at: int | None
) -> None:
    """A decode program runs its steps in chunks (block_program.DECODE_CHUNK) and idles the
    rest of a chunk past the call's count or a stop: the tokens, logits and the whole state
    it leaves are bitwise the branching loop's, which stops at once."""
    model, params = _model("rowinv")
    settings = sampling.SamplingParams.make(temperature=0.9, top_k=20)
    prompt = [5, 17, 33, 2, 80, 41, 9]

    def decode(stop_ids: list[int]) -> tuple:
        producer = BlockProducer(model, params, capacity=64, width=1, steps_per_call=16,
                                 donate=False)
        _, state = producer.prefill_chunk(producer.init_state(), prompt[:-1], 0)
        burst, state = producer.decode(
            state, prompt[-1], steps, params=settings,
            history=sampling.History.from_prompt(prompt, VOCAB),
            key=sampling.request_key(4), gen_index=1, stop_ids=stop_ids)
        return burst, state

    free, _ = decode([])
    stop = [] if stop_at is None else [free.tokens[stop_at]]
    planned, planned_state = decode(stop)
    with monkeypatch.context() as m:
        m.setattr(sampling, "draw_plan", lambda *_: "any")
        branching, branching_state = decode(stop)
    want = steps if stop_at is None else free.tokens.index(stop[0]) + 1
    assert planned.tokens == branching.tokens and len(planned.tokens) == want
    assert planned.finish == branching.finish
    assert np.array_equal(planned.logits.view(np.uint32), branching.logits.view(np.uint32))
    assert _same_tree(planned_state, branching_state)


def test_control_one_step_more_shows_in_the_state() -> None:
    """The state comparison above sees a single extra fed row (what an idle step that fed
    its row would leave)."""
    model, params = _model("rowinv")
    producer = BlockProducer(model, params, capacity=64, width=1, steps_per_call=16,
                             donate=False)
    _, state = producer.prefill_chunk(producer.init_state(), [5, 17, 33], 0)
    states = [producer.decode(state, 2, n, params=sampling.SamplingParams.greedy(),
                              history=sampling.History.empty(VOCAB),
                              key=sampling.request_key(0), gen_index=1)[1] for n in (3, 4)]
    assert not _same_tree(states[0], states[1])
    assert _same_tree(states[0], states[0])


@pytest.mark.parametrize("backend, vocab", [("cpu", 700), ("gpu", 3000)])
def test_top_k_plan_draws_the_branching_token_over_many_settings_and_ties(
    monkeypatch: pytest.MonkeyPatch, backend: str, vocab: int
) -> None:
    """The ``"top_k"`` plan ranks the vocabulary once and filters and draws among the 64
    candidates; it must draw ``draw``'s token for every such setting, with ties (rounded
    logits), min-p, penalties and top-p cuts anywhere in the run; in the GPU's form too
    (the candidates from 1,024-id blocks)."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    rng = np.random.default_rng(21)
    branching = jax.jit(sampling.draw)
    planned = jax.jit(sampling.draw_as, static_argnums=0)
    drawn = set()
    for trial in range(120):
        kw = dict(temperature=float(rng.choice([0.3, 1.0, 2.5])),
                  top_k=int(rng.integers(1, sampling.CANDIDATES + 1)),
                  top_p=float(rng.choice([1.0, 0.95, 0.6, 0.2])),
                  min_p=float(rng.choice([0.0, 0.05, 0.3])),
                  repetition_penalty=float(rng.choice([1.0, 1.3])))
        params = sampling.SamplingParams.make(**kw)
        assert sampling.draw_plan(params, vocab) == "top_k"
        logits = np.round(rng.normal(0, 2, vocab) * 2) / 2
        logits = jnp.asarray(logits.astype(np.float32))
        history = _history(rng, vocab)
        key = sampling.token_key(sampling.request_key(trial), 3)
        want = int(branching(logits, params, history, key))
        assert int(planned("top_k", logits, params, history, key)) == want, (trial, kw)
        drawn.add(want)
    assert len(drawn) > 20  # the draws are spread, not one id
