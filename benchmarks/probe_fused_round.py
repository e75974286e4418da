"""Probe: does a target block inside a fused speculative-round loop keep plain decoding's bits?

Plain greedy decoding runs the target through the block program (one executable). A fused
speculative loop runs the same ``block_forward`` inside another ``while_loop`` whose body also
runs a drafter and a judgement. This probe decodes greedily both ways on a random bf16 model
and reports whether the target logits behind every emitted token are bitwise equal.

    PYTHONPATH=. python -m benchmarks.probe_fused_round [--shape llama-3.2-1b] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.run import SHAPES
from turbospark_jax import sampling
from turbospark_jax.block_program import BlockState
from turbospark_jax.block_producer import BlockProducer
from turbospark_jax.models.dense import DenseConfig, DenseModel, init_params, unstack_layers


def _model(d: dict, dtype, seed: int):
    config = DenseConfig.from_hf_dict(d)
    model = DenseModel(config, dtype, scan_layers=False)
    return model, unstack_layers(init_params(config, jax.random.PRNGKey(seed), dtype))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=0.7)
    args = ap.parse_args()
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    shape = SHAPES[args.shape]
    target, tparams = _model(shape.hf_dict(), dtype, 0)
    small = dict(shape.hf_dict(), hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=512)
    drafter, dparams = _model(small, dtype, 1)
    cap, W = 1024, args.width
    tp = BlockProducer(target, tparams, capacity=cap, width=W, steps_per_call=64, donate=False)
    dp = BlockProducer(drafter, dparams, capacity=cap, width=W, steps_per_call=64, donate=False)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, shape.vocab_size, 64)]

    # Plain greedy through the block program.
    s = tp.init_state()
    logits, s = tp.prefill_chunk(s, prompt, 0)
    first = int(jnp.argmax(logits))
    hist = sampling.History.from_prompt(prompt, shape.vocab_size)
    burst, _ = tp.decode(s, first, args.tokens, params=sampling.SamplingParams.greedy(),
                         history=hist, key=sampling.request_key(0), gen_index=1)
    plain_tokens = [first, *burst.tokens]
    plain_rows = np.asarray(burst.logits)  # row i: what plain_tokens[i + 1] was drawn from

    # Fused greedy speculative loop: oracle proposals (the plain continuation, wrong with
    # probability 1 - alpha), a drafter forward in the body, verify, accept, commit.
    K = 4
    oracle = jnp.asarray(plain_tokens + [0] * (2 * K + 2), jnp.int32)
    wrong = jnp.asarray(rng.random(len(plain_tokens) + 2 * K + 2) > args.alpha)
    n_out = args.tokens

    def run(tstate: BlockState, dstate: BlockState, pending):
        rows_w = jnp.arange(W, dtype=jnp.int32)

        def cond(c):
            return c[3] < n_out

        def body(c):
            ts, ds, pend, done, out_rows, out_toks = c
            # drafter: one row, its argmax only perturbs wrong proposals
            dtok = jnp.zeros((W,), jnp.int32).at[0].set(pend)
            dlog, dcache = drafter.block_forward(dparams, ds.cache, dtok, ds.fed.count + rows_w,
                                                 jnp.int32(1), jnp.bool_(True))
            dguess = jnp.argmax(dlog[0]).astype(jnp.int32)
            idx = done + 1 + jnp.arange(K)
            prop = jnp.where(wrong[idx], (oracle[idx] + 1 + dguess) % shape.vocab_size,
                             oracle[idx])
            feed = jnp.zeros((W,), jnp.int32).at[0].set(pend).at[1:K + 1].set(prop)
            logits, tcache = target.block_forward(tparams, ts.cache, feed,
                                                  ts.fed.count + rows_w, jnp.int32(K + 1),
                                                  jnp.bool_(True))
            greedy = jnp.argmax(logits[: K + 1], axis=-1).astype(jnp.int32)
            ok = jnp.cumprod((greedy[:K] == prop).astype(jnp.int32))
            acc = jnp.sum(ok)
            count = acc + 1
            ts = ts.replace(cache=tcache, fed=ts.fed.append(feed, count))
            ds = ds.replace(cache=dcache, fed=ds.fed.append(dtok, jnp.int32(1)))
            take = jnp.arange(K + 1) < count
            pos = jnp.where(take, done + jnp.arange(K + 1), n_out + K + 2)
            out_rows = out_rows.at[pos].set(logits[: K + 1], mode="drop")
            out_toks = out_toks.at[pos].set(greedy, mode="drop")
            new_pend = greedy[acc]
            return ts, ds, new_pend, done + count, out_rows, out_toks

        init = (tstate, dstate, pending, jnp.int32(0),
                jnp.zeros((n_out + K + 2, shape.vocab_size), jnp.float32),
                jnp.zeros((n_out + K + 2,), jnp.int32))
        return jax.lax.while_loop(cond, body, init)

    s2 = tp.init_state()
    _, s2 = tp.prefill_chunk(s2, prompt, 0)
    d2 = dp.init_state()
    _, d2 = dp.prefill_chunk(d2, prompt, 0)
    out = jax.jit(run)(s2, d2, jnp.int32(first))
    fused_rows = np.asarray(out[4])[:n_out]
    fused_toks = [first, *[int(t) for t in np.asarray(out[5])[:n_out]]]
    n = min(len(plain_rows), n_out)
    same_rows = [bool(np.array_equal(fused_rows[i].view(np.uint32),
                                     plain_rows[i].view(np.uint32))) for i in range(n)]
    diff = float(np.max(np.abs(fused_rows[:n] - plain_rows[:n])))
    print(json.dumps({"probe": "fused_round", "backend": jax.default_backend(),
                      "shape": args.shape, "tokens_equal": fused_toks[: n + 1] == plain_tokens[: n + 1],
                      "rows_bitwise_equal": sum(same_rows), "rows": n,
                      "max_abs_diff": diff}))


if __name__ == "__main__":
    main()
