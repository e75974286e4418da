"""Does recording tap rows change a target's plain greedy decoding on this backend?

    PYTHONPATH=. python -m benchmarks.tap_check TARGET BLOCK_DRAFTER [TOKENS] [--barrier]

Decodes the same prompts greedily with the target as loaded and with the target set to tap the
layers the block drafter reads, and reports whether the tokens and logits are bitwise equal
(they are one model; the tapped one is a different compiled program). ``--barrier`` runs both
with every layer's output behind an optimization barrier (materialised as it is in either
program), to tell whether fusion across the tapped rows is what makes the two differ.
"""

from __future__ import annotations

import sys

import numpy as np

from turbospark_jax import CompletionRequest, run_raw_completion
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.io.loading import load_block_drafter, load_folder
from turbospark_jax.speculative.drafters.block import tapped_target


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    target, block = args[0], args[1]
    tokens = int(args[2]) if len(args) > 2 else 64
    if "--barrier" in sys.argv:
        import jax

        from turbospark_jax.models.qwen3_5.model import Qwen35Model

        mlp = Qwen35Model._mlp
        Qwen35Model._mlp = lambda self, lp, x: jax.lax.optimization_barrier(mlp(self, lp, x))
    loaded = load_folder(target, layer_layout="list")
    config, _ = load_block_drafter(block)
    models = {"plain": loaded.model, "tapped": tapped_target(loaded.model, config)}
    prompts = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\n"]
    same = True
    for prompt in prompts:
        ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
        out = {}
        for name, model in models.items():
            producer = BlockProducer(model, loaded.params, capacity=512, width=16)
            out[name] = run_raw_completion(
                producer, CompletionRequest(prompt_ids=ids, max_tokens=tokens,
                                            record_logits=True))
        a, b = out["plain"], out["tapped"]
        equal_tokens = a.token_ids == b.token_ids
        n = min(len(a.token_ids), len(b.token_ids))
        first = next((i for i in range(n) if a.token_ids[i] != b.token_ids[i]), None)
        la, lb = np.asarray(a.logits), np.asarray(b.logits)
        rows = min(len(la), len(lb))
        diff = float(np.abs(la[:rows] - lb[:rows]).max()) if rows else 0.0
        print(f"{prompt!r}: tokens equal {equal_tokens} (first difference at {first}), "
              f"logits max abs diff {diff:.3g}", flush=True)
        same = same and equal_tokens and diff == 0.0
    print("bitwise equal" if same else "NOT bitwise equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
