"""Small pure-JAX models with real state, for exercising the protocols before real weights.

* :class:`ToyAttentionModel`: a two-layer causal attention model with a KV cache (append-only
  buffers that roll back by cursor).
* :class:`ToyRecurrentModel`: a tanh RNN whose hidden state cannot be rewound by any cursor;
  it rolls back by value and keeps a per-row tape so ``rollback_retaining`` can replay.

Both implement :class:`~turbospark_jax.engine.program.BlockModel`, so they run on the same
compiled block program as the real models and pass the same conformance suite.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from turbospark_jax.core.state import append_only, scratch
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.models.base import BlockModel


@struct.dataclass(kw_only=True)
class ToyKVCache:
    """Fields: k, v: float32[L, T, D] keys and values per layer and position."""

    k: jax.Array = append_only(axis=1)
    v: jax.Array = append_only(axis=1)


@dataclasses.dataclass(frozen=True)
class ToyAttentionModel(BlockModel):
    """A tiny causal transformer: single-head attention and a ReLU MLP per layer."""

    vocab: int = 32
    dim: int = 16
    layers: int = 2

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def init_params(self, key: jax.Array) -> dict[str, Any]:
        d, v, n = self.dim, self.vocab, self.layers
        ks = jax.random.split(key, 8)
        g = lambda k, shape, scale: jax.random.normal(k, shape, jnp.float32) * scale  # noqa: E731
        return {
            "embed": g(ks[0], (v, d), 1.0),
            "wq": g(ks[1], (n, d, d), d**-0.5),
            "wk": g(ks[2], (n, d, d), d**-0.5),
            "wv": g(ks[3], (n, d, d), d**-0.5),
            "wo": g(ks[4], (n, d, d), d**-0.5),
            "w1": g(ks[5], (n, d, 2 * d), d**-0.5),
            "w2": g(ks[6], (n, 2 * d, d), (2 * d) ** -0.5),
            "head": g(ks[7], (d, v), d**-0.5),
        }

    def init_cache(self, capacity: int) -> ToyKVCache:
        shape = (self.layers, capacity, self.dim)
        return ToyKVCache(k=jnp.zeros(shape, jnp.float32), v=jnp.zeros(shape, jnp.float32))

    def block_forward(self, params, cache, tokens, positions, live, need_head, *,
                      key_limit=None, fresh=False):
        del key_limit, fresh  # no parallel prefill: hints are ignored
        width, capacity = tokens.shape[0], cache.k.shape[1]
        freqs = jnp.arange(1, self.dim + 1, dtype=jnp.float32) / self.dim
        x = params["embed"][tokens] + jnp.sin(positions[:, None].astype(jnp.float32) * freqs)
        write = jnp.where(jnp.arange(width) < live, positions, capacity)  # padding: dropped
        mask = jnp.arange(capacity)[None, :] <= positions[:, None]  # [W, T]
        k_all, v_all = cache.k, cache.v
        for layer in range(self.layers):
            q = x @ params["wq"][layer]
            k_all = k_all.at[layer, write].set(x @ params["wk"][layer], mode="drop")
            v_all = v_all.at[layer, write].set(x @ params["wv"][layer], mode="drop")
            scores = jnp.einsum("wd,td->wt", q, k_all[layer]) * self.dim**-0.5
            attn = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
            x = x + jnp.einsum("wt,td->wd", attn, v_all[layer]) @ params["wo"][layer]
            x = x + jax.nn.relu(x @ params["w1"][layer]) @ params["w2"][layer]
        logits = jax.lax.cond(
            need_head,
            lambda: x @ params["head"],
            lambda: jnp.zeros((width, self.vocab), jnp.float32),
        )
        return logits, ToyKVCache(k=k_all, v=v_all)


@struct.dataclass(kw_only=True)
class ToyRecurrentState:
    """Fields: h: float32[D] hidden state; tape: float32[max_width, D] h after each row of
    the last block (what ``rollback_retaining`` replays from)."""

    h: jax.Array
    tape: jax.Array = scratch()


@dataclasses.dataclass(frozen=True)
class ToyRecurrentModel(BlockModel):
    """A tanh RNN: the state after a token depends on every earlier token, with no cursor."""

    rewindable = False
    records_tape = True

    vocab: int = 32
    dim: int = 16
    max_width: int = 16

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def init_params(self, key: jax.Array) -> dict[str, Any]:
        k1, k2, k3 = jax.random.split(key, 3)
        d = self.dim
        return {
            "embed": jax.random.normal(k1, (self.vocab, d), jnp.float32),
            "w": jax.random.normal(k2, (d, d), jnp.float32) * d**-0.5,
            "head": jax.random.normal(k3, (d, self.vocab), jnp.float32) * d**-0.5,
        }

    def init_cache(self, capacity: int) -> ToyRecurrentState:
        del capacity
        return ToyRecurrentState(
            h=jnp.zeros((self.dim,), jnp.float32),
            tape=jnp.zeros((self.max_width, self.dim), jnp.float32),
        )

    def block_forward(self, params, cache, tokens, positions, live, need_head, *,
                      key_limit=None, fresh=False):
        del positions, key_limit, fresh
        width = tokens.shape[0]
        if width > self.max_width:
            raise ValueError(f"block width {width} exceeds the tape of {self.max_width} rows")

        def row(h, inputs):
            token, r = inputs
            h_new = jnp.tanh(h @ params["w"] + params["embed"][token])
            h = jnp.where(r < live, h_new, h)
            return h, (h_new, h)

        h, (per_row, tape) = jax.lax.scan(row, cache.h, (tokens, jnp.arange(width)))
        logits = jax.lax.cond(
            need_head,
            lambda: per_row @ params["head"],
            lambda: jnp.zeros((width, self.vocab), jnp.float32),
        )
        tape = cache.tape.at[:width].set(tape)
        return logits, ToyRecurrentState(h=h, tape=tape)

    def retain_rows(
        self, restored: ToyRecurrentState, current: ToyRecurrentState, keep_rows: int
    ) -> ToyRecurrentState:
        """The hidden state after the first ``keep_rows`` rows of the last block (traced or
        not): the restored one for none, else the tape's row."""
        row = current.tape[jnp.maximum(keep_rows - 1, 0)]
        return restored.replace(h=jnp.where(keep_rows > 0, row, restored.h))


def toy_attention_producer(
    *, vocab: int = 32, dim: int = 16, capacity: int = 64, width: int = 4,
    steps_per_call: int = 8, seed: int = 0, donate: bool = False,
) -> BlockProducer:
    """A ready :class:`BlockProducer` over a seeded :class:`ToyAttentionModel`."""
    model = ToyAttentionModel(vocab=vocab, dim=dim)
    return BlockProducer(
        model, model.init_params(jax.random.PRNGKey(seed)), capacity=capacity, width=width,
        steps_per_call=steps_per_call, donate=donate,
    )


def toy_recurrent_producer(
    *, vocab: int = 32, dim: int = 16, capacity: int = 64, width: int = 4,
    steps_per_call: int = 8, seed: int = 0, donate: bool = False,
) -> BlockProducer:
    """A ready :class:`BlockProducer` over a seeded :class:`ToyRecurrentModel`."""
    model = ToyRecurrentModel(vocab=vocab, dim=dim)
    return BlockProducer(
        model, model.init_params(jax.random.PRNGKey(seed)), capacity=capacity, width=width,
        steps_per_call=steps_per_call, donate=donate,
    )
