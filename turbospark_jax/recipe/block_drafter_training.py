"""Training a block drafter against a frozen dense target.

A batch is token rows the target reads once (:func:`target_batch`): its tap rows at every
position, and at every position ``t >= 1`` the token it would emit there greedily after the
tokens before it (for data the target generated itself, those are the data). Each step draws
random anchors per row (:func:`sample_anchors`); for an anchor ``a`` the drafter sees the
target's rows before ``a`` and the block ``[tokens[a], mask x (B - 1)]``, and row ``i`` is
scored against the target's token at ``a + i``. Early block positions matter most (a
proposal counts only when every one before it was accepted), so row ``i``'s cross-entropy is
weighted by ``exp(-(i - 1) / decay)``, the weights summing to one.

The target never changes: its params are not an argument of the gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from turbospark_jax.errors import BadInputError
from turbospark_jax.models.block_drafter import BlockDrafterModel, Params, shared_weights
from turbospark_jax.models.dense import DenseModel


@struct.dataclass(kw_only=True)
class TargetBatch:
    """What the frozen target gives one batch.

    Fields:
      tokens: int32 ``[N, T]`` the rows.
      taps: ``[N, T, K, D]`` the target's tap rows.
      greedy: int32 ``[N, T]``: ``greedy[:, t]`` is the target's argmax after ``tokens[:, :t]``
        (column 0, which nothing predicts, repeats ``tokens[:, 0]``).
    """

    tokens: jax.Array
    taps: jax.Array
    greedy: jax.Array


def target_batch(target: DenseModel, target_params: Params, tokens: jax.Array) -> TargetBatch:
    """Run the frozen target over ``tokens`` (int32 ``[N, T]``).

    Raises:
      BadInputError: the target has no tap layers.
    """
    logits, taps = _target_forward(target, target_params, tokens)
    greedy = jnp.concatenate(
        [tokens[:, :1], jnp.argmax(logits[:, :-1], axis=-1).astype(jnp.int32)], axis=1)
    return TargetBatch(tokens=tokens, taps=jax.lax.stop_gradient(taps), greedy=greedy)


@functools.partial(jax.jit, static_argnums=0)
def _target_forward(target: DenseModel, params: Params, tokens: jax.Array) -> Any:
    return target.forward_taps(params, tokens)


def sample_anchors(key: jax.Array, rows: int, length: int, count: int,
                   block_size: int) -> jax.Array:
    """int32 ``[rows, count]`` anchors drawn uniformly from ``0 .. length - block_size`` (the
    whole block must lie inside the row).

    Raises:
      BadInputError: rows shorter than one block.
    """
    if length < block_size:
        raise BadInputError(f"rows of {length} tokens cannot hold a block of {block_size}")
    return jax.random.randint(key, (rows, count), 0, length - block_size + 1, jnp.int32)


def position_weights(block_size: int, decay: float) -> jax.Array:
    """float32 ``[B - 1]`` weights of block rows ``1 .. B - 1``, decaying, summing to one."""
    w = jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / decay)
    return w / jnp.sum(w)


def block_drafter_loss(model: BlockDrafterModel, params: Params, shared: Params,
                       batch: TargetBatch, anchors: jax.Array, decay: float = 4.0) -> jax.Array:
    """The weighted cross-entropy of the drafter's proposals at ``anchors`` (int32
    ``[N, A]``) against the target's greedy tokens; a float32 scalar."""
    b = model.config.block_size
    rows = jnp.arange(1, b, dtype=jnp.int32)
    weights = position_weights(b, decay)

    def one_row(taps: jax.Array, tokens: jax.Array, greedy: jax.Array,
                row_anchors: jax.Array) -> jax.Array:
        k, v = model.context_kv(params, taps, jnp.arange(taps.shape[0], dtype=jnp.int32))

        def one_anchor(a: jax.Array) -> jax.Array:
            logits = model.block_logits(params, shared, k, v, a, tokens[a])[1:]  # [B - 1, V]
            labels = jnp.take(greedy, a + rows)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return jnp.sum(ce * weights)

        return jnp.mean(jax.vmap(one_anchor)(row_anchors))

    return jnp.mean(jax.vmap(one_row)(batch.taps, batch.tokens, batch.greedy, anchors))


def make_train_step(model: BlockDrafterModel, optimizer: optax.GradientTransformation,
                    tied: bool, decay: float = 4.0) -> Any:
    """A jitted ``step(params, opt_state, target_params, batch, anchors) -> (params,
    opt_state, loss)``: one optimizer update of the drafter's params (the target's only lend
    the embedding and head; ``tied`` says whether its head is its embedding)."""

    def step(params: Params, opt_state: Any, target_params: Params, batch: TargetBatch,
             anchors: jax.Array) -> tuple[Params, Any, jax.Array]:
        shared = jax.lax.stop_gradient(shared_weights(target_params, tied))
        loss, grads = jax.value_and_grad(
            lambda p: block_drafter_loss(model, p, shared, batch, anchors, decay))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step)
