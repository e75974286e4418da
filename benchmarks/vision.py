"""Images in the prompt: vision-tower time per image, and time to first token with and
without a reused image prefix.

    PYTHONPATH=. python -m benchmarks.vision            # E2B shape, random weights (a GPU)
    PYTHONPATH=. python -m benchmarks.vision --tiny     # the tiny test model (any CPU)

Random weights at Gemma 4 E2B's shape: the text decoder (35 layers, 1536 wide, PLE, KV
sharing) and the vision tower (16 layers, 768 wide, 16-pixel patches, 3x3 pooling, clamped
linears), bfloat16 on an accelerator, float32 on a CPU. One random 768x768 picture fills 280
soft tokens. Figures (medians over ``--repeats``, after a warm-up that compiles everything):

* ``preprocess_ms``: decode, resize and patchify on the host;
* ``tower_ms``: the tower and ``embed_vision`` for one image, on the device;
* ``ttft_fresh_ms``: a first turn (text, the image, a question) from an empty state, tower
  included: what a user waits for before the first token;
* ``ttft_reused_ms``: the next turn (the same history plus a new question) from the state the
  first turn left, so the image's rows are reused and the tower is not run again (its output
  is cached by identity);
* ``reused_tokens`` / ``prompt_tokens`` of that second turn.

Prints one JSON object; ``--out FILE`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def _e2b(dtype: Any) -> tuple[Any, Any, Any]:
    """(model, params, vision encoder) at E2B's shape with random weights."""
    import jax

    from turbospark_jax.io.vision import ImageTokens, VisionEncoder
    from turbospark_jax.models.gemma4 import config as gemma4_config
    from turbospark_jax.models.gemma4 import model as gemma4
    from turbospark_jax.models.gemma4 import vision as gemma4_vision

    full, sliding = gemma4_config.FULL, gemma4_config.SLIDING
    config = gemma4_config.Gemma4Config.from_hf_dict(dict(
        model_type="gemma4_text", hidden_size=1536, intermediate_size=6144,
        num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        global_head_dim=512, sliding_window=512, num_kv_shared_layers=20,
        use_double_wide_mlp=True, hidden_size_per_layer_input=256,
        final_logit_softcapping=30.0,
        layer_types=[full if (i + 1) % 5 == 0 else sliding for i in range(35)],
    ))
    text_key, vision_key = jax.random.split(jax.random.key(0))
    model = gemma4.Gemma4Model(config, dtype)
    tower_config = gemma4_vision.Gemma4VisionConfig(use_clipped_linears=True,
                                                    text_hidden_size=1536)
    tower = gemma4_vision.Gemma4Vision(tower_config, dtype)
    vision = VisionEncoder(tower=tower, params=tower.init_params(vision_key),
                           tokens=ImageTokens.from_hf_dict({}), max_soft_tokens=280)
    return model, model.init_params(text_key), vision


def _tiny() -> tuple[Any, Any, Any]:
    from turbospark_jax.models.gemma4 import model as gemma4
    from turbospark_jax.testing.vision import tiny_vision_model

    config, params, vision, _ = tiny_vision_model()
    return gemma4.Gemma4Model(config), params, vision


def _median_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def run(tiny: bool, repeats: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from PIL import Image

    from turbospark_jax.core.state import copy_state
    from turbospark_jax.engine.producer import BlockProducer
    from turbospark_jax.generation.completion import CompletionRequest
    from turbospark_jax.generation.driver import stream_completion

    on_gpu = jax.default_backend() != "cpu"
    model, params, vision = _tiny() if tiny else _e2b(jnp.bfloat16 if on_gpu else jnp.float32)
    width = 16 if on_gpu else 4
    producer = BlockProducer(model, params, capacity=1024 if tiny else 2048, width=width,
                             steps_per_call=32, donate=False)
    side = 64 if tiny else 768
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "picture.png"
        pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
        preprocess_ms = _median_ms(lambda: vision.prepare(path), repeats)
        image = vision.prepare(path)

    def tower() -> None:
        out = vision.tower.compiled_encode(vision.params, jnp.asarray(image.patches),
                                           jnp.asarray(image.positions))
        jax.block_until_ready(out)

    tower()  # compile
    tower_ms = _median_ms(tower, repeats)

    question = list(range(40, 56))
    first = [2, 30, 31, vision.tokens.image, *question]

    def turn(prompt: list[int], state: Any) -> Any:
        ids, injection = vision.prompt(prompt, [image])
        request = CompletionRequest(prompt_ids=ids, max_tokens=1, injection=injection,
                                    prefill_chunk_size=512)
        done = stream_completion(producer, request, state=state).drain()
        jax.block_until_ready(done.state)
        return done

    def fresh() -> Any:
        vision.forget()  # the tower runs, as for a picture never seen
        return turn(first, None)

    warm = fresh()
    second = [*first, *warm.token_ids, *range(60, 76)]
    turn(second, copy_state(warm.state))  # compile the reuse path's shapes
    ttft_fresh_ms = _median_ms(fresh, repeats)
    base = fresh().state
    states = [copy_state(base) for _ in range(repeats)]  # copied outside the timed calls
    reused: list[Any] = []
    ttft_reused_ms = _median_ms(lambda: reused.append(turn(second, states.pop())), repeats)
    usage = reused[-1].usage
    return {
        "shape": "tiny" if tiny else "gemma4-e2b (random weights)",
        "backend": jax.default_backend(), "device": str(jax.devices()[0]),
        "dtype": str(vision.tower.dtype), "width": width,
        "soft_tokens_per_image": image.soft_tokens, "image_size": list(image.size),
        "preprocess_ms": preprocess_ms, "tower_ms": tower_ms,
        "ttft_fresh_ms": ttft_fresh_ms, "ttft_reused_ms": ttft_reused_ms,
        "prompt_tokens": usage.prompt_tokens, "reused_tokens": usage.reused_tokens,
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny test model (runs on a CPU)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per figure")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    result = run(args.tiny, max(1, args.repeats))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
