"""The Gemma 4 family on the block program: the conformance suite (with sliding windows
smaller than the prompts, so the ring wraps), the ring's rewind limit, its cache memory, the
parallel prefill against the exact path, and config parsing and refusals. Parity with
transformers lives in test_gemma4_parity.py."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.testing.test_conformance_toy import CHECKS
from turbospark_jax import CompletionRequest
from turbospark_jax.core.state import copy_state, live_equal
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.generation.driver import run_raw_completion
from turbospark_jax.kernels import layers as L
from turbospark_jax.models.gemma4 import config as GC
from turbospark_jax.models.gemma4 import model as G
from turbospark_jax.testing import conformance as C

VOCAB = 48
MARGIN = 8  # ring of window 3 + 8 slots: prompts of up to 22 tokens wrap it twice
S, F = GC.SLIDING, GC.FULL

TINY: dict[str, Any] = dict(
    model_type="gemma4_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
    num_hidden_layers=5, layer_types=[S, F, S, S, F], num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=3,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
    use_double_wide_mlp=True, attention_k_eq_v=True, num_global_key_value_heads=1,
    final_logit_softcapping=30.0, initializer_range=0.1,
)


def _producer(dtype: Any = jnp.float32, cls: type = BlockProducer,
              options: dict[str, Any] | None = None, **extra: Any) -> Any:
    config = GC.Gemma4Config.from_hf_dict({**TINY, **extra})
    model = G.Gemma4Model(config, dtype, **{"ring_margin": MARGIN, **(options or {})})
    params = model.init_params(jax.random.PRNGKey(3))
    return cls(model, params, capacity=48, width=4, steps_per_call=4, donate=True)


PRODUCERS = {"f32": _producer(), "bf16": _producer(jnp.bfloat16)}
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=22)


@pytest.fixture(params=sorted(PRODUCERS))
def producer(request: pytest.FixtureRequest) -> Any:
    return PRODUCERS[request.param]


@given(prompt=tokens, cuts=st.lists(st.integers(1, 21), max_size=4))
def test_chunked_equals_sequential(producer: Any, prompt: list[int], cuts: list[int]) -> None:
    C.check_chunked_matches_sequential(producer, prompt, cuts)


@given(prompt=tokens)
def test_prefill_advances_like_produce(producer: Any, prompt: list[int]) -> None:
    C.check_prefill_matches_produce(producer, prompt[:6])


@given(prefix=tokens, feed=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9))
def test_verify_rows_equal_decode(producer: Any, prefix: list[int], feed: list[int]) -> None:
    C.check_verify_matches_decode(producer, prefix, feed)


ops = st.lists(st.tuples(st.sampled_from(["produce", "prefill", "chunk", "verify"]),
                         st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)),
               max_size=4)


def _fed(op_list: list[tuple[str, list[int]]]) -> int:
    return sum(1 if kind in ("produce", "prefill") else len(t) for kind, t in op_list)


@given(before=ops, after=ops, probe=st.integers(0, VOCAB - 1))
def test_rollback_restores(before: Any, after: Any, probe: int) -> None:
    # A rollback moves the cursor back by what `after` fed: within the ring's limit.
    assume(_fed(after) <= MARGIN + 1)
    after = [(k, t[:1] if k in ("produce", "prefill") else t) for k, t in after]
    before = [(k, t[:1] if k in ("produce", "prefill") else t) for k, t in before]
    C.check_rollback_restores(PRODUCERS["f32"], before, after, probe)


@given(first=tokens, generated=st.lists(st.integers(0, VOCAB - 1), max_size=3),
       keep=st.integers(0, 24), tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5))
def test_reuse_equals_fresh(first: list[int], generated: list[int], keep: int,
                            tail: list[int]) -> None:
    C.check_reuse_matches_fresh(PRODUCERS["f32"], first, generated,
                                (first + generated)[:keep] + tail)


@pytest.mark.parametrize("control", sorted(C.CONTROLS))
def test_every_check_catches_its_control(control: str) -> None:
    p = PRODUCERS["f32"]
    CHECKS[control](p)
    with pytest.raises(C.ConformanceError):
        CHECKS[control](C.perturbed(p, control))


# -- the ring ---------------------------------------------------------------------------------

PROMPT = [int(t) for t in np.random.RandomState(5).randint(0, VOCAB, 30)]


class _BlindToTheRing(BlockProducer):
    """Control: a producer that ignores the ring's rewind floor."""

    def rewind_floor(self, state: Any) -> int:
        return 0


def _plain() -> BlockProducer:
    """The same model without the engine's refusal, to show what the limit protects."""
    p = PRODUCERS["f32"]
    return _BlindToTheRing(p.model, p.params, capacity=48, width=4, steps_per_call=4)


def test_rewind_limit_is_exact_and_needed() -> None:
    """30 positions fed, margin 8: reuse down to position 21 equals fresh, 20 does not."""
    plain = _plain()
    assert plain.model.oldest_rewind(30) == 21
    C.check_reuse_matches_fresh(plain, PROMPT, [], [*PROMPT[:21], 1, 2])
    with pytest.raises(C.ConformanceError):
        C.check_reuse_matches_fresh(plain, PROMPT, [], [*PROMPT[:20], 1, 2])
    C.check_reuse_matches_fresh(PRODUCERS["f32"], PROMPT, [], [*PROMPT[:20], 1, 2])  # refused


def test_limit_counts_from_reach_not_cursor() -> None:
    """After moving back to 22, the ring still holds rows up to 29 (its reach), which have
    overwritten the rows a further move back to 15 would need: the cursor alone would allow
    it (22 - 9 = 13), the reach does not (30 - 9 = 21)."""
    plain = _plain()
    _, state = plain.prefill_chunk(plain.init_state(), PROMPT, 0)
    n, state = plain.try_reuse_prefix(state, [*PROMPT[:22], 7])
    assert n == 22 and plain.model.reach(state.cache) == 30
    assert plain.model.oldest_rewind(plain.model.reach(state.cache)) == 21
    second = [*PROMPT[:15], 7, 8]
    n, state = plain.try_reuse_prefix(state, second)
    got, _ = C.sequential_prefill(plain, state, second[n:], n)
    want, _ = C.sequential_prefill(plain, plain.init_state(), second, 0)
    assert n == 15 and not np.array_equal(np.asarray(got), np.asarray(want))


def test_live_equal_sees_the_window_rows_of_the_ring_only() -> None:
    p = PRODUCERS["f32"]
    _, state = p.prefill_chunk(p.init_state(), PROMPT[:20], 0)
    slots = p.model.ring_slots
    kept = copy_state(state)

    def nudge(slot: int) -> Any:
        ring = list(kept.cache.k_ring)
        ring[0] = ring[0].at[slot].add(1.0)
        return kept.replace(cache=kept.cache.replace(k_ring=tuple(ring)))

    assert live_equal(kept, nudge((20 - 3) % slots))  # outside the window of the next row
    assert not live_equal(kept, nudge((20 - 2) % slots))  # inside it


def test_block_wider_than_margin_is_refused() -> None:
    p = PRODUCERS["f32"]
    wide = BlockProducer(p.model, p.params, capacity=48, width=MARGIN + 2, steps_per_call=1)
    with pytest.raises(BadInputError, match="ring_margin"):
        wide.prefill_chunk(wide.init_state(), PROMPT[:3], 0)


def test_cache_memory_at_32k_for_e2b_shape() -> None:
    """E2B's text shape (35 layers, 15 owning KV: 12 sliding with head_dim 256, 3 full with
    512; one KV head), bfloat16, 32k positions."""
    e2b = GC.Gemma4Config.from_hf_dict(dict(
        model_type="gemma4_text", hidden_size=1536, intermediate_size=6144,
        num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        global_head_dim=512, sliding_window=512, num_kv_shared_layers=20,
        use_double_wide_mlp=True, hidden_size_per_layer_input=256,
        layer_types=[F if (i + 1) % 5 == 0 else S for i in range(35)],
    ))
    model = G.Gemma4Model(e2b, jnp.bfloat16)
    context = 32 * 1024
    shapes = jax.eval_shape(lambda: model.init_cache(context))
    ours = sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes))

    def row_bytes(i: int) -> int:
        head_dim, kv = e2b.dims(i)
        return 2 * kv * head_dim * 2  # k and v, bfloat16

    owners = sum(row_bytes(i) for i in range(35) if e2b.owns_kv(i)) * context
    every_layer = sum(row_bytes(i) for i in range(35)) * context
    print(f"E2B cache at 32k: ours {ours / 1e6:.1f} MB, every row of the KV-owning layers "
          f"{owners / 1e6:.1f} MB, every row of every layer {every_layer / 1e6:.1f} MB")
    assert ours == 3 * context * 2048 + 12 * (512 + 256) * 1024 + (512 + 256) * 4
    assert ours < owners / 2.8 and ours < every_layer / 6.5



# -- parallel prefill ---------------------------------------------------------------------------

#: The parallel prefill against the exact path, float32: the last prompt row's logits and every
#: cache row it leaves (ring, full layers, hidden rows) within this absolute tolerance
#: (measured up to ~1e-5 on a CPU, with logits of order 1). Float32 products: the tests of the
#: parallel pass run at full precision, since a GPU's default rounds their inputs to TF32.
PARALLEL_ATOL = 1e-4

PARALLEL = {
    # PLE, k_eq_v, two KV-shared layers; the pass attends in one query block.
    "tiny": PRODUCERS["f32"],
    # Values of their own, the assistant's hidden rows kept, and query blocks of 4 rows, so
    # a pass's blocks read bands of the ones before them.
    "blocks": _producer(attention_k_eq_v=False,
                        options={"pass_block": 4, "keep_hidden_rows": True}),
}


def _gap(a: Any, b: Any) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max(initial=0))


def _check_parallel(exact_p: Any, prepare: Any, tokens: list[int], chunk: int,
                    fast_p: Any = None) -> float:
    """Feed ``tokens`` by exact prefill (``exact_p``) and by parallel prefill (``fast_p``,
    default the same producer) in passes of ``chunk``, each from the state ``prepare(producer)``
    makes; the logits after them and the caches they leave must agree within
    :data:`PARALLEL_ATOL`, the rings hold the same positions, the fed records agree, and greedy
    decoding go on alike. Returns the logits' gap; raises AssertionError."""
    fast_p = fast_p or exact_p
    state = prepare(exact_p)
    start = int(state.fed.count)
    want, exact = exact_p.prefill_chunk(state, tokens, start)
    got, fast = fast_p.prefill_parallel(prepare(fast_p), tokens, start, chunk=chunk)
    gap = _gap(got, want)
    assert gap < PARALLEL_ATOL, f"logits {gap:.2e} apart"
    assert np.array_equal(exact.cache.ring_positions, fast.cache.ring_positions)
    for name in ("k_ring", "v_ring", "k_full", "v_full"):
        for a, b in zip(getattr(exact.cache, name), getattr(fast.cache, name), strict=True):
            assert _gap(a, b) < PARALLEL_ATOL, name
    assert _gap(exact.cache.hidden_rows, fast.cache.hidden_rows) < PARALLEL_ATOL
    assert exact.fed.to_host().ids == fast.fed.to_host().ids
    tok_a, tok_b = int(np.argmax(want)), int(np.argmax(got))
    position = start + len(tokens)
    for _ in range(6):
        assert tok_a == tok_b
        la, exact = exact_p.produce(exact, tok_a, position)
        lb, fast = fast_p.produce(fast, tok_b, position)
        tok_a, tok_b, position = int(np.argmax(la)), int(np.argmax(lb)), position + 1
    assert tok_a == tok_b
    return gap


def _prefilled(p: Any, prefix: list[int] = ()) -> Any:
    return p.prefill_chunk(p.init_state(), prefix, 0)[1] if prefix else p.init_state()


@pytest.mark.usefixtures("full_precision_products")
@pytest.mark.parametrize("case", sorted(PARALLEL))
@pytest.mark.parametrize("start, chunk", [(0, 2048), (19, 5), (3, 16)])
def test_parallel_prefill_is_close_and_continues_alike(case: str, start: int,
                                                       chunk: int) -> None:
    """A fresh pass over 29 rows (window 3, ring of 11: it wraps) and continued passes after
    an exact prefix, narrower and wider than the ring, against the exact path."""
    p = PARALLEL[case]
    gap = _check_parallel(p, functools.partial(_prefilled, prefix=PROMPT[:start]),
                          PROMPT[start:], chunk)
    print(f"{case} start={start} chunk={chunk}: logits {gap:.1e} from the exact path's")


@pytest.mark.usefixtures("full_precision_products")
def test_parallel_prefill_after_moving_back() -> None:
    """The cursor moved back (a reused prefix) leaves ring rows past it; the pass reads none
    of them, and replaces them as the exact path does."""
    def moved_back(p: Any) -> Any:
        n, state = p.try_reuse_prefix(_prefilled(p, PROMPT), [*PROMPT[:24], 5, 6, 7])
        assert n == 24 and p.model.reach(state.cache) == 30
        return state

    _check_parallel(PARALLEL["blocks"], moved_back, [5, 6, 7, *PROMPT[:4]], 4)


@dataclasses.dataclass(frozen=True)
class _WiderPassWindow(G.Gemma4Model):
    """Control: the model's exact path, and a parallel pass whose sliding window is one row
    wider (its ring_margin one less, so it keeps the same ring)."""

    def pass_hidden(self, params: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
        c = self.config
        wider = G.Gemma4Model(dataclasses.replace(c, sliding_window=c.sliding_window + 1),
                              self.dtype, ring_margin=self.ring_margin - 1,
                              keep_hidden_rows=self.keep_hidden_rows, pass_block=self.pass_block)
        return wider.pass_hidden(params, cache, *args, **kwargs)


@pytest.mark.usefixtures("full_precision_products")
def test_parallel_check_catches_a_wrong_window() -> None:
    """Control: the check fires on a pass that is wrong in one row of its window (its logits
    were measured 1.6 apart, against logits of up to 1.6)."""
    p = PARALLEL["tiny"]
    wrong = BlockProducer(_WiderPassWindow(p.model.config, ring_margin=MARGIN), p.params,
                          capacity=48, width=4, steps_per_call=4)
    with pytest.raises(AssertionError, match="logits"):
        _check_parallel(p, _prefilled, PROMPT, 2048, fast_p=wrong)


@pytest.mark.usefixtures("full_precision_products")
def test_parallel_prefill_through_completions() -> None:
    """``run_raw_completion(..., parallel_prefill=True)``: a first turn (one fresh pass) and a
    second that reuses it (passes after the reused rows) give the exact path's tokens, their
    first logits within the tolerance."""
    p = PARALLEL["tiny"]

    def turns(parallel: bool) -> list[Any]:
        state, out = None, []
        for prompt in (PROMPT[:20], [*PROMPT[:20], *PROMPT[22:30]]):
            request = CompletionRequest(prompt_ids=prompt, max_tokens=6, record_logits=True,
                                        parallel_prefill=parallel, prefill_chunk_size=5)
            done = run_raw_completion(p, request, state=state)
            out.append(done)
            state = done.state
        return out

    for exact, fast in zip(turns(False), turns(True), strict=True):
        assert fast.token_ids == exact.token_ids and fast.fed_ids == exact.fed_ids
        assert _gap(fast.logits[0], exact.logits[0]) < PARALLEL_ATOL


def test_benchmark_prefill_figures_include_the_parallel_path() -> None:
    """The prefill benchmark (benchmarks.prefill) times the parallel path of
    every producer that declares one: for Gemma 4 now too."""
    from benchmarks.prefill import prefill_rates

    rates = prefill_rates(PARALLEL["tiny"], 24, 24, VOCAB)
    assert rates["exact_tokens_per_s"] > 0 and rates["parallel_tokens_per_s"] > 0


def test_wide_attend_blocks_equal_one_attend() -> None:
    """:func:`wide_attend` in blocks of 4 (a padded last block, bands over earlier blocks,
    fixed keys some of which it must not see) against one :func:`attend` over every key."""
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(13, 4, 8), jnp.float32)
    own = [jnp.asarray(rng.randn(13, 2, 8), jnp.float32) for _ in range(2)]
    cached = [jnp.asarray(rng.randn(6, 2, 8), jnp.float32) for _ in range(2)]
    positions = jnp.arange(13, dtype=jnp.int32) + 10
    cached_positions = jnp.asarray([4, 9, 8, L.NO_KEY, 7, 6], jnp.int32)
    for window in (3, 6, None):
        want = L.attend(q, jnp.concatenate([cached[0], own[0]]),
                        jnp.concatenate([cached[1], own[1]]), positions,
                        jnp.concatenate([cached_positions, positions]), window)
        if window is None:
            fixed = tuple(jnp.concatenate([c, o]) for c, o in zip(cached, own, strict=True))
            got = L.wide_attend(q, positions, (*fixed, jnp.concatenate(
                [cached_positions, positions])), None, None, block=4)
        else:
            got = L.wide_attend(q, positions, (*cached, cached_positions),
                                (*own, positions), window, block=4)
        assert _gap(got, want) < 1e-5, window
    with pytest.raises(BadInputError, match="window"):
        L.wide_attend(q, positions, None, (*own, positions), None)


# -- config ------------------------------------------------------------------------------------


def test_absent_keys_take_the_reference_defaults() -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.Gemma4TextConfig()
    ours = GC.Gemma4Config.from_hf_dict({"model_type": "gemma4_text"})
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "sliding_window",
                "hidden_size_per_layer_input", "final_logit_softcapping", "tie_word_embeddings",
                "rms_norm_eps", "eos_token_id", "bos_token_id", "pad_token_id"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert list(ours.layer_types) == ref.layer_types
    per_layer = getattr(ref, "per_layer_config", None)  # transformers >= 5.24 only
    if per_layer is not None:
        for i in (0, 5):  # a sliding and a full layer
            assert ours.dims(i) == (per_layer[i].head_dim, per_layer[i].num_key_value_heads)
    else:
        assert (ours.head_dim, ours.global_head_dim) == (ref.head_dim, ref.global_head_dim)
    assert ours.full_rope.to_hf_dict() == ref.rope_parameters[F]


@pytest.mark.parametrize("wrapped", [False, True])
def test_config_round_trips_through_transformers(wrapped: bool) -> None:
    transformers = pytest.importorskip("transformers")
    ours = GC.Gemma4Config.from_hf_dict({**TINY, "eos_token_id": [1, 5]})
    if wrapped:
        ours = GC.Gemma4Config.from_hf_dict({"model_type": "gemma4", "dtype": "bfloat16",
                                             "text_config": TINY})
    d = ours.to_hf_dict()
    assert GC.Gemma4Config.from_hf_dict(d) == ours
    text = transformers.Gemma4TextConfig(**(d["text_config"] if wrapped else d))
    assert GC.Gemma4Config.from_hf_dict({**text.to_dict(), "model_type": ours.model_type,
                                         **({"text_config": text.to_dict()} if wrapped else {}),
                                         "dtype": ours.dtype}) == ours


def test_hub_spelling_of_full_layer_heads() -> None:
    """``num_global_key_value_heads`` counts only with ``attention_k_eq_v``, as in transformers."""
    base = {**TINY, "attention_k_eq_v": False, "num_global_key_value_heads": 1}
    assert GC.Gemma4Config.from_hf_dict(base).dims(1) == (16, 2)
    assert GC.Gemma4Config.from_hf_dict({**base, "attention_k_eq_v": True}).dims(1) == (16, 1)


REFUSED = {
    "enable_moe_block": {"enable_moe_block": "yes"},  # its MoE form loads (test_moe_gemma4.py)
    "use_bidirectional_attention": {"use_bidirectional_attention": "all"},
    "hidden_activation": {"hidden_activation": "silu"},
    "hidden_size": {"hidden_size": "32"},
    "intermediate_size": {"intermediate_size": True},
    "num_kv_shared_layers": {"num_kv_shared_layers": 6},
    "num_kv_shared_layers ": {"layer_types": [S, F, S, S, F], "num_kv_shared_layers": 4},
    "rope_type": {"rope_parameters": {S: {"rope_type": "yarn", "rope_theta": 1e4},
                                      F: {"rope_type": "default", "rope_theta": 1e4}}},
    "rope_parameters": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    "rope_theta": {"rope_parameters": {S: {"rope_type": "default"},
                                       F: {"rope_type": "default", "rope_theta": 1e4}}},
    "num_key_value_heads": {"num_key_value_heads": 3},
    "num_global_key_value_heads": {"num_global_key_value_heads": 0},
    "head_dim": {"head_dim": 7},
    "layer_types": {"layer_types": [S, "mamba", S, S, F]},
    "layer_types ": {"layer_types": [S, F]},
    "vocab_size_per_layer_input": {"vocab_size_per_layer_input": 10},
    "per_layer_config": {"per_layer_config": {"1": {"head_dim": 16}, "4": {"head_dim": 32}}},
    "per_layer_config ": {"per_layer_config": {"0": {"sliding_window": 3}}},
    "final_logit_softcapping": {"final_logit_softcapping": "x"},
    "eos_token_id": {"eos_token_id": ["x"]},
    "model_type": {"model_type": "gemma3_text"},
    "text_config": {"model_type": "gemma4", "text_config": 5},
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_malformed_config_is_refused_naming_the_key(key: str) -> None:
    with pytest.raises(ModelLoadError, match=key.strip()):
        GC.Gemma4Config.from_hf_dict({**TINY, **REFUSED[key]})


def test_only_the_list_layout_and_runnable_configs_build() -> None:
    config = GC.Gemma4Config.from_hf_dict(TINY)
    assert G.FAMILY.list_layout_only
    with pytest.raises(ModelLoadError, match="list"):
        G.FAMILY.build(config, jnp.float32, "stacked")
    drafter_text = GC.Gemma4Config.from_hf_dict({**TINY, "num_kv_shared_layers": 5})
    with pytest.raises(ModelLoadError, match="num_kv_shared_layers"):
        G.FAMILY.build(drafter_text, jnp.float32, "list")


def test_tolerated_names() -> None:
    assert G.FAMILY.tolerated("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight")
    assert G.FAMILY.tolerated("model.embed_audio.embedding_projection.weight")
    assert G.FAMILY.tolerated("model.language_model.layers.30.self_attn.k_proj.weight")
    assert not G.FAMILY.tolerated("model.language_model.layers.3.self_attn.q_proj.weight")
    assert not G.FAMILY.tolerated("model.layers.0.mlp.up_proj.weight")
