"""The Qwen3.5 family's bitwise guarantees at a bfloat16 shape wider than the tests' (for a GPU:
CPU tests alone cannot show them), and what a decode step and a chunk cost there.

    JAX_PLATFORMS=cuda python3 -m benchmarks.qwen35_exactness

Prints one JSON object per check: token by token == chunked (several splits), verify rows ==
decode, rollback_retaining from the tape == decoding the kept rows, the MTP head's rows in one
block == one row at a time, and the control that must fail; then timings.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.core import sampling
from turbospark_jax.core.state import copy_state, live_equal
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.models.qwen3_5 import config as QC
from turbospark_jax.models.qwen3_5 import model as Q
from turbospark_jax.testing import conformance as C


def report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def check(name: str, fn) -> None:
    try:
        fn()
        report(check=name, ok=True)
    except C.ConformanceError as err:
        report(check=name, ok=False, error=str(err))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=96)
    args = ap.parse_args()
    w = args.width
    lin, full = QC.LINEAR, QC.FULL
    config = QC.Qwen35Config(
        vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
        layer_types=(lin, lin, lin, full) * 2, mtp_num_hidden_layers=1)
    model = Q.Qwen35Model(config, dtype=jnp.bfloat16, max_width=w)
    params = model.init_params(jax.random.PRNGKey(0))
    producer = BlockProducer(model, params, capacity=1024, width=w, steps_per_call=8)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, config.vocab_size, args.prompt)]
    report(device=str(jax.devices()[0]), jax=jax.__version__, width=w, prompt=len(prompt))

    for cuts in ([], [1, 17, 40], [w, 2 * w + 3, 70]):
        check(f"chunked == token by token, cuts {cuts}",
              lambda cuts=cuts: C.check_chunked_matches_sequential(producer, prompt, cuts))
    h = len(prompt) // 2  # the verify and retaining checks continue from here
    for k in (1, 5, w):
        check(f"verify {k} rows == decode",
              lambda k=k: C.check_verify_matches_decode(producer, prompt[:h], prompt[h:h + k]))

    def retaining() -> None:
        _, state = producer.prefill_chunk(producer.init_state(), prompt[:h], 0)
        point, decoded, keep = producer.checkpoint(state), copy_state(state), w // 2
        feed = prompt[h:h + w]
        for i, tok in enumerate(feed[:keep]):
            _, decoded = producer.produce(decoded, tok, h + i)
        _, verified = producer.verify(copy_state(state), feed, h)
        if not live_equal(producer.rollback_retaining(verified, point, keep), decoded):
            raise C.ConformanceError(f"rollback_retaining({keep}) != decoding {keep} rows")

    check("rollback_retaining == decoding the kept rows", retaining)
    control = C.perturbed(producer, "chunk_logits_bit")
    try:
        C.check_chunked_matches_sequential(control, prompt[:20], [7])
        report(check="control (must fail)", ok=False, error="the control passed")
    except C.ConformanceError:
        report(check="control (must fail)", ok=True)

    # MTP: the rows of one block == the same rows one at a time, on one W-row program.
    step = jax.jit(Q.Qwen35Model.mtp_block_forward, static_argnums=0)
    hidden = jax.random.normal(jax.random.PRNGKey(2), (w, config.hidden_size), jnp.bfloat16)
    toks = jnp.asarray(prompt[1:w + 1], jnp.int32)
    rows = jnp.arange(w, dtype=jnp.int32)
    block, _, _ = step(model, params, model.mtp_init_cache(64), hidden, toks, rows, jnp.int32(w))
    cache, single = model.mtp_init_cache(64), []
    for i in range(w):
        roll = lambda a, i=i: jnp.roll(a, -i, axis=0)  # noqa: E731
        lg, _, cache = step(model, params, cache, roll(hidden), roll(toks), rows + i, jnp.int32(1))
        single.append(np.asarray(lg[0]))
    same = np.array_equal(np.asarray(block).view(np.uint32), np.stack(single).view(np.uint32))
    report(check="mtp block == row by row", ok=bool(same),
           max_abs=float(np.abs(np.asarray(block) - np.stack(single)).max()))

    # Timings: one decode burst (8 steps of 1 live row) and a prefill of 512 tokens.
    state = producer.prefill_chunk(producer.init_state(), prompt, 0)[1]
    greedy, hist = sampling.SamplingParams.greedy(), sampling.History.empty(config.vocab_size)
    for label in ("compile", "run"):
        t = time.perf_counter()
        burst, _ = producer.decode(copy_state(state), 1, 8, params=greedy, history=hist,
                                   key=sampling.request_key(0), gen_index=0)
        jax.block_until_ready(burst.logits)
        report(timing=f"decode burst of 8 ({label})", ms_per_step=(time.perf_counter() - t) * 125)
    chunk = [int(t) for t in rng.integers(0, config.vocab_size, 512)]
    for label in ("compile", "run"):
        t = time.perf_counter()
        logits, _ = producer.prefill_chunk(producer.init_state(), chunk, 0)
        jax.block_until_ready(logits)
        report(timing=f"prefill_chunk 512 ({label})", tokens_per_s=512 / (time.perf_counter() - t))


if __name__ == "__main__":
    main()
