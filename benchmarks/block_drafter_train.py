"""The block drafter's training loop over a Qwen3.5 target at the recipe's shape (hidden 384,
8 layers, three DeltaNet layers to one full-attention layer, vocabulary 8192, random weights):
throughput of ``train_block_drafter`` in bfloat16, and on the same GPU the tap rows'
chunked == token-by-token bitwise check (with its control) and greedy losslessness of the
trained drafter through the host and the device rounds.

    JAX_PLATFORMS=cuda python3 -m benchmarks.block_drafter_train --out OUT [--steps 40]

Writes ``OUT/block_drafter_train.json`` (and prints it). Random weights and rows: the figures
are speed and exactness, not acceptance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax import CompletionRequest, run_raw_completion
from turbospark_jax.core.state import live_equal
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.generation.speculative_loop import run_raw_completion_speculative
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.speculative.drafters import BlockDrafter
from turbospark_jax.speculative.drafters.block import tapped_target
from turbospark_jax.speculative.pair import SpeculativePair
from turbospark_recipe import block_drafter_training as T


def target_config(vocab: int) -> QC.Qwen35Config:
    kinds = [QC.LINEAR] * 3 + [QC.FULL]
    return QC.Qwen35Config.from_hf_dict(dict(
        model_type="qwen3_5_text", vocab_size=vocab, hidden_size=384, intermediate_size=1152,
        num_attention_heads=6, num_key_value_heads=2, head_dim=64, linear_num_key_heads=3,
        linear_num_value_heads=6, linear_key_head_dim=64, linear_value_head_dim=64,
        num_hidden_layers=8, layer_types=[kinds[i % 4] for i in range(8)],
        mtp_num_hidden_layers=1, tie_word_embeddings=True, pad_token_id=2,
        partial_rotary_factor=0.25, max_position_embeddings=2048,
    ))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    out: dict[str, object] = {"device": str(jax.devices()[0])}

    config = target_config(8192)
    params = Q.Qwen35Model(config, jnp.bfloat16).init_params(jax.random.PRNGKey(0))
    drafter_config = T.default_drafter_config(config)
    out["drafter_config"] = drafter_config.to_hf_dict()
    rng = np.random.default_rng(0)
    rows = rng.integers(0, config.vocab_size, size=(args.batch_size * 8, args.seq_len))
    t0 = time.monotonic()
    result = T.train_block_drafter(
        config, params, rows, rows[: args.batch_size], drafter_config, steps=args.steps,
        batch_size=args.batch_size, lr=1e-3, warmup_steps=5, compute_dtype="bfloat16",
        progress=False)
    out["train_wall_s"] = time.monotonic() - t0
    out["timings"] = result.timings
    out["last_eval"] = result.last_eval
    losses = [h["loss"] for h in result.history if h["kind"] == "train"]
    out["loss_first_last"] = [losses[0], losses[-1]]

    # Exactness on this GPU: tap rows, chunked vs token by token, bfloat16.
    model = tapped_target(Q.Qwen35Model(config, jnp.bfloat16), drafter_config)
    producer = BlockProducer(model, params, capacity=256, width=drafter_config.block_size,
                             steps_per_call=8)
    prompt = [int(t) for t in rng.integers(0, config.vocab_size, 40)]
    chunked = producer.prefill_chunk(producer.init_state(), prompt, 0)[1]
    stepped = producer.init_state()
    for i, tok in enumerate(prompt):
        stepped = producer.produce_prefill(stepped, tok, i)
    out["taps_chunked_equal_token_by_token"] = bool(live_equal(chunked, stepped))
    other = producer.prefill_chunk(producer.init_state(), [*prompt[:20], (prompt[20] + 1) %
                                                           config.vocab_size, *prompt[21:]], 0)[1]
    out["control_changed_token_differs"] = not bool(live_equal(other, chunked))

    # Greedy losslessness of the trained drafter (exported and loaded in bfloat16).
    folder = Path(args.out) / "drafter"
    T.export_block_drafter(folder, result.config, result.params)
    from turbospark_jax.io.loading import load_block_drafter

    loaded = load_block_drafter(folder, dtype="bfloat16")
    request = CompletionRequest(prompt_ids=prompt, max_tokens=48, record_logits=True)
    plain = run_raw_completion(producer, request)
    for device in (True, False):
        pair = SpeculativePair(producer, BlockDrafter(producer, *loaded), device_rounds=device)
        got = run_raw_completion_speculative(
            pair, dataclasses.replace(request, draft_len=drafter_config.block_size - 1))
        out[f"lossless_{'device' if device else 'host'}"] = bool(
            got.token_ids == plain.token_ids
            and np.array_equal(got.logits.view(np.uint32), plain.logits.view(np.uint32)))
    text = json.dumps(out, indent=1, default=str)
    (Path(args.out) / "block_drafter_train.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
