"""The Gemma 4 assistant drafter's speculative speedup, measured by the oracle method.

    PYTHONPATH=. python -m benchmarks.assistant_oracle --out benchmarks/results
    PYTHONPATH=. python -m benchmarks.assistant_oracle --preset smoke --out /tmp/ao   # CPU

The target is the E2B-shaped Gemma 4 of :mod:`benchmarks.families` (random bf16 weights,
batch 1, greedy); the assistant has the size of the published ``gemma-4-E2B-it-assistant``
(``ASSISTANT_E2B``, its ``config.json``: 4 layers, three sliding and one full, hidden 256, MLP
2048, 4 query heads over 1 KV head of 256 / 512 dims, window 512, the centroid head with 2048
centroids keeping the best 32, tied embeddings; about 78M parameters, 67M of them the
embedding table). A random assistant's proposals would all be rejected, so it drafts through
:class:`~turbospark_jax.speculative.drafters.oracle.CostedOracleDrafter`: its whole proposal runs
every
round, then each proposal is set right with probability ``alpha`` (a wrong one otherwise).

After a 128-token prompt, 128 new tokens; per (alpha, draft length ``k``) a record holds

* ``tokens_per_s`` and ``speedup`` over plain greedy decoding on the same producer (decode
  tokens per second after the first token);
* ``ideal_speedup``: a loop with no overhead at the measured mean tokens per round ``L``,
  ``L * t_decode / (t_verify(k + 1) + t_draft(k))``, and ``fraction_of_ideal``.
  ``t_decode`` and ``t_verify`` are one step of the block program with 1 and ``k + 1`` live
  rows (:func:`benchmarks.speculative.step_seconds`); ``t_draft(k)`` is the assistant's ``k``
  proposals, timed alone as many proposals in one device loop. ``ideal_speedup_free_draft``
  leaves ``t_draft`` out (the dense oracle benchmark's ideal);
* ``equal_to_plain``: the speculative tokens are the plain ones (greedy speculation is
  lossless).

Alpha and the draft length are data to the rounds program, so every configuration runs one
compiled program, and one warm-up run compiles it. Records print as JSON lines and go to
``<out>/assistant_oracle.json`` with the run's meta (device, jax version, date).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.families import SHAPES, build, random_params
from benchmarks.run import Recorder, _meta
from benchmarks.speculative import step_seconds

SLIDING, FULL = "sliding_attention", "full_attention"

#: ``google/gemma-4-E2B-it-assistant``'s config.json, the keys this runtime reads (RoPE and
#: norms at their defaults, which are the published values).
ASSISTANT_E2B: dict[str, Any] = {
    "model_type": "gemma4_assistant", "backbone_hidden_size": 1536,
    "use_ordered_embeddings": True, "num_centroids": 2048, "centroid_intermediate_top_k": 32,
    "tie_word_embeddings": True,
    "text_config": dict(
        vocab_size=262144, hidden_size=256, intermediate_size=2048, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, num_kv_shared_layers=4, head_dim=256,
        global_head_dim=512, sliding_window=512, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, layer_types=[SLIDING, SLIDING, SLIDING, FULL]),
}

#: An assistant for ``SHAPES["gemma4-tiny"]`` (its head dims and KV heads), for the CPU. As
#: wide as that target, so its leaves have the target's shapes and drawing them compiles
#: almost nothing new.
ASSISTANT_TINY: dict[str, Any] = {
    "model_type": "gemma4_assistant", "backbone_hidden_size": 64,
    "use_ordered_embeddings": True, "num_centroids": 8, "centroid_intermediate_top_k": 2,
    "tie_word_embeddings": True,
    "text_config": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        sliding_window=8, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        layer_types=[SLIDING, FULL]),
}


@dataclasses.dataclass(frozen=True)
class Preset:
    """target: a :data:`benchmarks.families.SHAPES` name; assistant: a gemma4_assistant
    config.json; timed_steps: block-program steps, and assistant proposals, per timed device
    call (the step costs)."""

    target: str
    assistant: dict[str, Any]
    prompt_length: int
    new_tokens: int
    width: int
    burst: int
    alphas: tuple[float, ...]
    draft_lens: tuple[int, ...]
    timed_steps: int


PRESETS = {
    "h200": Preset("gemma4-e2b", ASSISTANT_E2B, prompt_length=128, new_tokens=128, width=16,
                   burst=32, alphas=(0.5, 0.7, 0.9), draft_lens=(2, 4, 8), timed_steps=16),
    "smoke": Preset("gemma4-tiny", ASSISTANT_TINY, prompt_length=16, new_tokens=16, width=5,
                    burst=8, alphas=(0.0, 0.5, 1.0), draft_lens=(2, 4), timed_steps=4),
}


def assistant(config_dict: dict[str, Any], producer: Any) -> Any:
    """A :class:`~turbospark_jax.speculative.drafters.gemma4_assistant.Gemma4AssistantDrafter` of
    random
    weights in the target's dtype, drawn leaf by leaf (:func:`benchmarks.families.random_params`;
    its token order a random permutation)."""
    import jax
    import jax.numpy as jnp

    from turbospark_jax.speculative.drafters import gemma4_assistant as A

    config = A.AssistantConfig.from_hf_dict(config_dict)
    dtype = producer.model.dtype
    params = random_params(jax.eval_shape(
        lambda key: A.init_params(config, key, dtype), jax.random.PRNGKey(1)))
    if config.use_ordered_embeddings:
        params["token_ordering"] = jax.random.permutation(
            jax.random.PRNGKey(2), config.text.vocab_size).astype(jnp.int32)
    return A.Gemma4AssistantDrafter(producer, config, params)


def _draft_loop(device: Any, steps: int, params: Any, target: Any, pending: Any,
                m: Any) -> Any:
    """``steps`` proposals of ``m`` tokens in one loop, each from the last token the one before
    proposed (so none can be hoisted out of the loop or dropped)."""
    import jax
    import jax.numpy as jnp

    def body(_: Any, token: Any) -> Any:
        proposals, _, _, _ = device.propose(params, (), target, token, m, None)
        return proposals[jnp.maximum(m - 1, 0)]

    return jax.lax.fori_loop(0, steps, body, pending)


def draft_seconds(drafter: Any, producer: Any, prompt: list[int], pending: int,
                  draft_lens: tuple[int, ...], steps: int) -> dict[int, float]:
    """Device seconds of the assistant's ``k`` proposals after ``prompt``, for each ``k``:
    ``steps`` proposals in one call (``k`` is data: one program), after a warm-up, per call."""
    import jax
    import jax.numpy as jnp

    device, params = drafter.on_device()
    _, state = producer.prefill_chunk(producer.init_state(), prompt, 0)
    loop = jax.jit(functools.partial(_draft_loop, device, steps))
    out = {}
    for k in draft_lens:
        def once(k: int = k) -> float:
            t0 = time.perf_counter()
            jax.block_until_ready(loop(params, state, jnp.int32(pending), jnp.int32(k)))
            return time.perf_counter() - t0

        once()
        out[k] = min(once() for _ in range(3)) / steps
    return out


def run(preset: Preset, rec: Recorder) -> None:
    """Plain decoding and its step costs, then every (alpha, draft length): see the module
    docstring."""
    from turbospark_jax import CompletionRequest, run_raw_completion
    from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
    from turbospark_jax.speculative.drafters import CostedOracleDrafter
    from turbospark_jax.speculative.pair import SpeculativePair
    from turbospark_jax.speculative.rounds import MAX_BURST

    capacity = preset.prompt_length + preset.new_tokens + MAX_BURST + 2 * preset.width
    config, producer, _ = build(preset.target, capacity, preset.width, preset.burst,
                                model_options={"keep_hidden_rows": True})
    drafter = assistant(preset.assistant, producer)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, config.vocab_size, preset.prompt_length)]
    request = CompletionRequest(prompt_ids=prompt, max_tokens=preset.new_tokens,
                                burst=preset.burst)
    run_raw_completion(producer, request)  # compiles
    plain = run_raw_completion(producer, request)
    plain_tps = plain.timings.decode_tokens_per_s(len(plain.token_ids))
    t_decode = step_seconds(producer, 1, preset.timed_steps)
    t_verify = {k: step_seconds(producer, k + 1, preset.timed_steps) for k in preset.draft_lens}
    t_draft = draft_seconds(drafter, producer, prompt, plain.token_ids[0], preset.draft_lens,
                            preset.timed_steps)
    base = {"target": preset.target, "width": preset.width, "prompt_length": len(prompt),
            "new_tokens": len(plain.token_ids)}
    rec.add(**base, workload="plain", tokens_per_s=plain_tps, t_decode_s=t_decode,
            t_verify_s=t_verify, t_draft_s=t_draft)
    reference = prompt + plain.token_ids
    warm = False
    for alpha in preset.alphas:
        pair = SpeculativePair(producer, CostedOracleDrafter(drafter, reference, alpha))
        for k in preset.draft_lens:
            r = dataclasses.replace(request, draft_len=k)
            if not warm:  # one compile serves every alpha and draft length
                run_raw_completion_speculative(pair, r)
                warm = True
            spec = run_raw_completion_speculative(pair, r)
            s = spec.speculative
            tps = spec.timings.decode_tokens_per_s(len(spec.token_ids))
            length = s.mean_acceptance_length
            ideal = length * t_decode / (t_verify[k] + t_draft[k])
            rec.add(**base, workload="speculative", alpha=alpha, draft_len=k,
                    rounds=s.rounds, drafted=s.drafted, accepted=s.accepted,
                    mean_acceptance_length=length, tokens_per_s=tps, speedup=tps / plain_tps,
                    t_decode_s=t_decode, t_verify_s=t_verify[k], t_draft_s=t_draft[k],
                    ideal_speedup=ideal, ideal_speedup_free_draft=length * t_decode / t_verify[k],
                    fraction_of_ideal=tps / plain_tps / ideal,
                    equal_to_plain=spec.token_ids == plain.token_ids, on_device=s.on_device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="h200")
    ap.add_argument("--alphas", default=None, help="comma-separated, e.g. 0.5,0.7,0.9")
    ap.add_argument("--draft-lens", default=None, help="comma-separated, e.g. 2,4,8")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.alphas is not None:
        preset = dataclasses.replace(
            preset, alphas=tuple(float(a) for a in args.alphas.split(",")))
    if args.draft_lens is not None:
        preset = dataclasses.replace(
            preset, draft_lens=tuple(int(k) for k in args.draft_lens.split(",")))
    from turbospark_jax.speculative.drafters import MAX_DRAFT

    limit = min(MAX_DRAFT, preset.width - 1)  # past it the rounds would run on the host
    if not all(1 <= k <= limit for k in preset.draft_lens):
        ap.error(f"draft lengths must be in 1..{limit}")
    meta = {**_meta(), "preset": args.preset, "target": SHAPES[preset.target],
            "assistant": preset.assistant}
    run(preset, Recorder(args.out, "assistant_oracle", meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
