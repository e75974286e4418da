"""Quick GPU check: device speculative rounds equal plain greedy bitwise, and first timings.

    PYTHONPATH=. python -m benchmarks.spec_gpu_check [--shape llama-3.2-1b] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.run import SHAPES
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.generation.completion import CompletionRequest
from turbospark_jax.generation.driver import run_raw_completion
from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, init_params, unstack_layers
from turbospark_jax.speculative.drafters import DraftModelDrafter, NGramDrafter, OracleDrafter
from turbospark_jax.speculative.pair import SpeculativePair


def _producer(d: dict, dtype, seed: int, capacity: int, width: int) -> BlockProducer:
    config = DenseConfig.from_hf_dict(d)
    model = DenseModel(config, dtype, scan_layers=False)
    params = unstack_layers(init_params(config, jax.random.PRNGKey(seed), dtype))
    return BlockProducer(model, params, capacity=capacity, width=width, donate=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    shape = SHAPES[args.shape]
    cap = 1024 if gpu else 256
    target = _producer(shape.hf_dict(), dtype, 0, cap, 16)
    small = dict(shape.hf_dict(), hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=512)
    draft = _producer(small, dtype, 1, cap, 16)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, shape.vocab_size, 64)]
    prompt = prompt + prompt[:32]  # some repetition for the n-gram drafter
    req = CompletionRequest(prompt_ids=prompt, max_tokens=args.tokens, record_logits=True,
                            burst=32)

    def timed(fn):
        fn()  # compile
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    plain, t_plain = timed(lambda: run_raw_completion(target, req))
    ref = prompt + plain.token_ids + [0] * 16
    results = [{"config": "plain", "tok_s": len(plain.token_ids) / t_plain}]
    drafters = {
        "oracle0.7": OracleDrafter(shape.vocab_size, ref, 0.7),
        "oracle0.9": OracleDrafter(shape.vocab_size, ref, 0.9),
        "ngram": NGramDrafter(shape.vocab_size, 3),
        "draft_model": DraftModelDrafter(draft),
    }
    for name, drafter in drafters.items():
        for k in (2, 4, 8):
            for device in (True, False):
                if not device and name != "oracle0.7":
                    continue
                pair = SpeculativePair(target, drafter, device_rounds=device)
                r = CompletionRequest(**{**req.__dict__, "draft_len": k})
                spec, t = timed(lambda pair=pair, r=r: run_raw_completion_speculative(pair, r))
                same = spec.token_ids == plain.token_ids and np.array_equal(
                    spec.logits.view(np.uint32), plain.logits.view(np.uint32))
                n = min(len(spec.token_ids), len(plain.token_ids))
                diff = float(np.max(np.abs(spec.logits[:n] - plain.logits[:n])))
                results.append({
                    "config": name, "k": k, "device": device, "bitwise": same,
                    "max_diff": diff, "tok_s": len(spec.token_ids) / t,
                    "speedup": t_plain / t * len(spec.token_ids) / len(plain.token_ids),
                    "mean_len": spec.speculative.mean_acceptance_length,
                })
                print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"backend": jax.default_backend(), "plain_tok_s": results[0]["tok_s"],
                      "all_bitwise": all(r.get("bitwise", True) for r in results)}))


if __name__ == "__main__":
    main()
