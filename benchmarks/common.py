"""What every suite shares: the model shapes, building a random-weight model, the exactness
adapter, the results file, timing, the weight-read roofline and transformers' side.

Results: each suite writes ``<out>/<suite>_<preset>.json`` after every case (a run cut short
keeps what it measured)::

    {"suite": "decode", "preset": "cpu",
     "meta": {"device_kind", "backend", "jax", "jaxlib", "python", "date", "command",
              "settings" (the preset's values), "xla_flags", ...},
     "cases": [{...labels and figures of one measurement...}, ...],
     "errors": [{...labels, "error"}], "skipped": [{...labels, "reason"}]}

A case that raises is recorded under ``errors`` and the suite goes on; a case a preset's time
budget leaves no room for is listed under ``skipped``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"

# -- exactness: the one place the suites name the option ------------------------------------


def has_choice(model: Any) -> bool:
    """Whether ``model``'s family offers both paths (:func:`with_exactness`)."""
    return bool(getattr(model, "row_invariant_kernels", False))


def with_exactness(model: Any, exact: bool) -> Any:
    """``model`` on the plan ``tsj.load(exact=exact)`` gives it on this backend: the exact
    path (programs of every width give a row the same bits) or the path that trades bits for
    speed. A family without the choice runs its one path, on the backend's kernels where it
    has some (Qwen3.5's delta-rule walk, grouped experts)."""
    own = bool(getattr(model, "backend_kernels", False))
    if not (has_choice(model) or own):
        return model
    import jax

    from turbospark_jax.kernels.plan import kernel_plan

    # the plan tsj.load resolves for this choice on this backend
    plan = kernel_plan(jax.default_backend(), exact, has_choice(model), backend_kernels=own)
    return dataclasses.replace(model, plan=plan)


def widths(model: Any) -> tuple[int, int]:
    """``(width, prefill_width)`` of plain decoding, as ``tsj.load`` picks them
    (:func:`turbospark_jax.api.default_width`, :func:`turbospark_jax.api.default_prefill_width`)."""
    from turbospark_jax.api import default_prefill_width, default_width

    width = default_width(False, widths_agree=model.widths_agree)
    return width, default_prefill_width(width, model.widths_agree)


# -- shapes ---------------------------------------------------------------------------------

LIN, FULL, SLIDING = "linear_attention", "full_attention", "sliding_attention"


def _dense(model_type: str, hidden: int, layers: int, heads: int, kv: int, head_dim: int,
           mlp: int, vocab: int, tied: bool) -> dict[str, Any]:
    return dict(model_type=model_type, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                intermediate_size=mlp, vocab_size=vocab, tie_word_embeddings=tied,
                rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=32768)


#: Published models' shapes (random weights: speed only) and tiny ones for a CPU, each as the
#: ``config.json`` keys this runtime reads.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": _dense("llama", 2048, 16, 32, 8, 64, 8192, 128256, True),
    "qwen3-0.6b": _dense("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True),
    "llama-3.1-8b": _dense("llama", 4096, 32, 32, 8, 128, 14336, 128256, False),
    "llama-3.1-70b": _dense("llama", 8192, 80, 64, 8, 128, 28672, 128256, False),
    "qwen3.5-0.8b": dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584,
        num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=16, tie_word_embeddings=True,
        layer_types=[LIN, LIN, LIN, FULL] * 6, mtp_num_hidden_layers=1),
    "qwen3.5-4b": dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=2560, intermediate_size=9216,
        num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, tie_word_embeddings=True,
        layer_types=[LIN, LIN, LIN, FULL] * 8, mtp_num_hidden_layers=1),
    "qwen3-30b-a3b": dict(
        _dense("qwen3_moe", 2048, 48, 32, 4, 128, 6144, 151936, False), rms_norm_eps=1e-6,
        rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[]),
    "gemma4-e2b": dict(
        model_type="gemma4_text", vocab_size=262144, hidden_size=1536, intermediate_size=6144,
        num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        global_head_dim=512, sliding_window=512, num_kv_shared_layers=20,
        use_double_wide_mlp=True, hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144, final_logit_softcapping=30.0,
        layer_types=[FULL if (i + 1) % 5 == 0 else SLIDING for i in range(35)]),
    "tiny": _dense("qwen3", 64, 2, 4, 2, 16, 128, 256, True),
    # small, untied, and wide enough for int4 groups of 128 inputs (the quant suite's smoke)
    "tiny-llama": _dense("llama", 128, 2, 4, 2, 32, 256, 256, False),
    "small-60m": _dense("qwen3", 512, 8, 8, 4, 64, 1536, 32000, True),
    "qwen3.5-tiny": dict(
        model_type="qwen3_5_text", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=[LIN, LIN, LIN, FULL]),
    "gemma4-tiny": dict(
        model_type="gemma4_text", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        global_head_dim=32, sliding_window=8, num_kv_shared_layers=1,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
        layer_types=[SLIDING, FULL, SLIDING, FULL]),
}


@dataclasses.dataclass
class Built:
    """A random-weight model of a shape and the producer plain decoding runs on it."""

    shape: str
    config: Any
    model: Any
    params: Any
    producer: Any
    exact: bool


def model_of(shape: str, dtype: str = "bfloat16", exact: bool = True) -> tuple[Any, Any, Any]:
    """``(family, config, model)`` of ``shape`` in its family's per-layer layout (no weights)."""
    import jax.numpy as jnp

    from turbospark_jax.models.registry import family_of

    family = family_of(SHAPES[shape]["model_type"])
    config = family.parse_config(dict(SHAPES[shape]))
    return family, config, with_exactness(family.build(config, jnp.dtype(dtype), "list"), exact)


def random_model(shape: str, dtype: str = "bfloat16", exact: bool = True
                 ) -> tuple[Any, Any, Any]:
    """``(config, model, params)``: random weights of ``shape`` (normal, scale 0.02) in its
    family's per-layer layout."""
    import jax

    family, config, model = model_of(shape, dtype, exact)
    params = random_params(jax.eval_shape(model.init_params, jax.random.PRNGKey(0)))
    if family.to_layer_layout is not None:
        params = family.to_layer_layout(params, "list")
    return config, model, params


def build(shape: str, *, capacity: int, exact: bool = True, burst: int = 64,
          dtype: str = "bfloat16") -> Built:
    """A producer over :func:`random_model`'s weights at the widths :func:`widths` picks,
    donating its state as the CLI does."""
    config, model, params = random_model(shape, dtype, exact)
    return built_from(shape, config, model, params, capacity=capacity, exact=exact,
                      burst=burst)


def built_from(shape: str, config: Any, model: Any, params: Any, *, capacity: int,
               exact: bool, burst: int = 64) -> Built:
    """:func:`build`'s producer over weights made elsewhere (quantized ones, say)."""
    from turbospark_jax.engine.producer import BlockProducer

    width, prefill_width = widths(model)
    producer = BlockProducer(model, params, capacity=capacity, width=width,
                             steps_per_call=burst, donate=True,
                             prefill_width=max(width, min(prefill_width, capacity)))
    return Built(shape, config, model, params, producer, exact)


#: Leaves up to this many elements are drawn on the host (no program to compile).
HOST_DRAW = 1 << 20


def random_params(shapes: Any) -> Any:
    """Random leaves with the shapes and dtypes of ``shapes`` (normal, scale 0.02; integer
    leaves zero), drawn leaf by leaf: small ones on the host, large ones by one small program
    per leaf shape (compiling a whole large model's initialiser takes minutes)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(shapes)
    key = jax.random.PRNGKey(0)
    rng = np.random.default_rng(0)
    out = []
    for i, s in enumerate(leaves):
        if not jnp.issubdtype(s.dtype, jnp.floating):
            out.append(jnp.zeros(s.shape, s.dtype))
        elif s.size <= HOST_DRAW:
            x = rng.standard_normal(s.shape, np.float32) * np.float32(0.02)
            out.append(jnp.asarray(x.astype(s.dtype)))
        else:
            out.append(_draw()(jax.random.fold_in(key, i), tuple(s.shape), s.dtype))
    return jax.tree.unflatten(treedef, out)


@functools.cache
def _draw() -> Any:
    import jax
    import jax.numpy as jnp

    def draw(k: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        return (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(dtype)

    return jax.jit(draw, static_argnums=(1, 2))


def prompt_ids(length: int, vocab: int, seed: int = 0) -> list[int]:
    """Random token ids past the first few (which tokenizers keep for special tokens)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, vocab, length)]


# -- the roofline ---------------------------------------------------------------------------


def step_bytes(config: Any, params: Any, context: int) -> int:
    """Bytes one decode step must read at ``context``: every weight but the input embedding
    table (one row of it is gathered; a tied head reads it whole) and Gemma 4's per-layer
    input table, of a mixture of experts the router and the ``k`` of ``E`` experts a token
    runs (the active parameters), the cache rows attended, and a recurrent layer's float32
    state read and written. A quantized weight counts as stored (its values, scales and zero
    points). ``params`` may hold ``jax.ShapeDtypeStruct`` leaves: only shapes and dtypes are
    read."""
    import jax

    # expert stacks (Qwen's and Gemma 4's keys): a token reads k of their E experts
    stacks = ("expert_gate", "expert_up", "expert_down", "experts_gate_up", "experts_down")

    def nbytes(path: Any, x: Any) -> float:
        size = x.size * x.dtype.itemsize
        if any(getattr(p, "key", None) in stacks for p in path):
            routing = config.routing
            return size * routing.top_k / routing.num_experts
        return size

    total = sum(nbytes(path, x) for path, x in jax.tree_util.tree_leaves_with_path(params))
    top = params if isinstance(params, dict) else {}
    embed = top.get("embed_tokens")
    if embed is not None and not config.tie_word_embeddings:
        total -= embed.size * embed.dtype.itemsize
    per_layer = top.get("embed_tokens_per_layer")
    if per_layer is not None:
        total -= (per_layer.shape[0] - 1) * per_layer.shape[1] * per_layer.dtype.itemsize
    item = embed.dtype.itemsize if embed is not None else 2
    if hasattr(config, "linear_num_value_heads"):  # Qwen3.5: attention and delta-rule layers
        for kind in config.layer_types:
            if kind == FULL:
                total += 2 * context * config.num_key_value_heads * config.head_dim * item
            else:
                total += 2 * 4 * config.linear_num_value_heads * (
                    config.linear_key_head_dim * config.linear_value_head_dim)
    elif hasattr(config, "owns_kv"):  # Gemma 4: shared and sliding caches
        for i in range(config.num_hidden_layers):
            if config.owns_kv(i):
                head_dim, kv = config.dims(i)
                window = config.window(i)
                rows = context if window is None else min(context, window)
                total += 2 * rows * kv * head_dim * item
    else:
        total += (2 * config.num_hidden_layers * context * config.num_key_value_heads
                  * config.head_dim * item)
    return int(total)


def copy_bandwidth(nbytes: int) -> float:
    """Device memory bandwidth in bytes/s (read + written): the better of a copy of a buffer
    and an elementwise pass over it, the best of a few runs."""
    import jax
    import jax.numpy as jnp

    n = nbytes // 2
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.bfloat16)
    best = float("inf")
    for f in (jax.jit(lambda a: a + jnp.bfloat16(1)), lambda a: jnp.array(a, copy=True)):
        jax.block_until_ready(f(x))
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            best = min(best, time.perf_counter() - t0)
    return 2 * n * 2 / best


def best_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    """``fn`` once to compile, then ``repeats`` timed runs (each waited for): the best and all
    of them."""
    import jax

    jax.block_until_ready(fn())
    runs = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        runs.append(time.perf_counter() - t0)
    return min(runs), runs


# -- the results file -----------------------------------------------------------------------


def meta(preset: str, settings: Any, command: str) -> dict[str, Any]:
    """Where and how a suite ran."""
    import jax
    import jaxlib

    device = jax.devices()[0]
    return {
        "device_kind": getattr(device, "device_kind", str(device)),
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "preset": preset,
        "settings": dataclasses.asdict(settings),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


class Results:
    """One suite's results file, rewritten after every case."""

    def __init__(self, suite: str, preset: str, settings: Any, out: Path, command: str,
                 budget_s: float | None = None, only_shapes: tuple[str, ...] | None = None
                 ) -> None:
        """``only_shapes``: this run measures those shapes alone, so an earlier file's entries
        for other shapes stay (a preset too long for one sitting runs in parts)."""
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"{suite}_{preset}.json"
        self.started = time.perf_counter()
        self.budget_s = budget_s
        self.data: dict[str, Any] = {"suite": suite, "preset": preset,
                                     "meta": meta(preset, settings, command),
                                     "cases": [], "errors": [], "skipped": []}
        if only_shapes is not None and self.path.is_file():
            old = json.loads(self.path.read_text())
            for key in ("cases", "errors", "skipped"):
                self.data[key] = [r for r in old.get(key, [])
                                  if r.get("shape", only_shapes[0]) not in only_shapes]
            self.data["meta"]["earlier_commands"] = [
                *old["meta"].get("earlier_commands", []), old["meta"]["command"]]
        self.write()

    @property
    def cases(self) -> list[dict[str, Any]]:
        return self.data["cases"]

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=_plain) + "\n")

    def add(self, record: dict[str, Any]) -> dict[str, Any]:
        self.cases.append(record)
        print(json.dumps(record, default=_plain), flush=True)
        self.write()
        return record

    def skip(self, reason: str, **label: Any) -> None:
        self.data["skipped"].append({**label, "reason": reason})
        self.write()

    def out_of_time(self) -> bool:
        """Whether the preset's time budget is spent."""
        return self.budget_s is not None and time.perf_counter() - self.started > self.budget_s

    def case(self, label: dict[str, Any], fn: Callable[[], dict[str, Any]]
             ) -> dict[str, Any] | None:
        """``label`` with ``fn()``'s figures, as a case; an exception is recorded as an error,
        and past the budget the case is skipped."""
        if self.out_of_time():
            self.skip("out of the preset's time budget", **label)
            return None
        try:
            figures = fn()
        except Exception as exc:  # one case's failure is a result; the suite goes on
            tail = traceback.format_exc().strip().splitlines()[-3:]
            self.data["errors"].append({**label, "error": f"{type(exc).__name__}: {exc}"[:600],
                                        "where": tail})
            print(f"error in {label}: {exc!r}", flush=True)
            self.write()
            return None
        return self.add({**label, **figures})


def _plain(x: Any) -> Any:
    """JSON for numpy scalars and arrays."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


# -- transformers ---------------------------------------------------------------------------


def torch_device() -> tuple[str, Callable[[], None]]:
    """transformers' device beside JAX's backend, and a function that waits for it."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    return device, sync


def release_torch(device: str) -> None:
    """Hand transformers' cached device memory back (JAX runs the next model)."""
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def hf_model(shape: str, device: str, dtype: str = "bfloat16") -> Any:
    """transformers' model of ``shape`` with random weights and sdpa attention."""
    import torch
    import transformers

    d = dict(SHAPES[shape])
    model_type = d.pop("model_type")
    d.pop("mtp_num_hidden_layers", None)
    classes = {"llama": (transformers.LlamaConfig, transformers.AutoModelForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.AutoModelForCausalLM),
               "qwen3_5_text": (transformers.Qwen3_5TextConfig,
                                transformers.Qwen3_5ForCausalLM),
               "gemma4_text": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM)}
    config_cls, model_cls = classes[model_type]
    config = config_cls(**d)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        if model_cls is transformers.AutoModelForCausalLM:
            model = model_cls.from_config(config, dtype=getattr(torch, dtype))
        else:
            model = model_cls(config).to(getattr(torch, dtype))
    return model.eval()


def hf_decode_seconds(model: Any, ids: Any, new_tokens: int, sync: Callable[[], None]) -> float:
    """Seconds of ``new_tokens`` greedy steps of a bare loop of forward calls with a dynamic
    cache after the prompt ``ids``: the least overhead eager transformers has."""
    import torch

    with torch.inference_mode():
        out = model(ids, use_cache=True)
        tok, cache = out.logits[:, -1:].argmax(-1), out.past_key_values
        for _ in range(3):  # warm the one-token path
            model(tok, past_key_values=cache, use_cache=True)
        out = model(ids, use_cache=True)
        tok, cache = out.logits[:, -1:].argmax(-1), out.past_key_values
        sync()
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok, cache = out.logits[:, -1:].argmax(-1), out.past_key_values
        sync()
        return time.perf_counter() - t0


def hf_compiled_decode_seconds(model: Any, ids: Any, new_tokens: int,
                               sync: Callable[[], None]) -> float:
    """Seconds of ``new_tokens`` greedy steps through transformers' fast path: a static cache
    and the one-token forward under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs),
    in a bare loop; the prompt goes through the eager model first, untimed."""
    import torch
    import transformers

    ctx = ids.shape[1]
    device = ids.device
    cache = transformers.StaticCache(config=model.config, max_cache_len=ctx + new_tokens + 8)
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def run() -> float:
        with torch.inference_mode():
            cache.reset()
            out = model(ids, past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(ctx, device=device))
            tok = out.logits[:, -1:].argmax(-1)
            sync()
            t0 = time.perf_counter()
            for i in range(new_tokens):
                pos = torch.tensor([ctx + i], device=device)
                torch.compiler.cudagraph_mark_step_begin()
                logits = step(tok, past_key_values=cache, cache_position=pos,
                              position_ids=pos[None], use_cache=True).logits
                tok = logits[:, -1:].argmax(-1)
            sync()
            return time.perf_counter() - t0

    for _ in range(2):  # compile, record the graphs
        run()
    return run()
