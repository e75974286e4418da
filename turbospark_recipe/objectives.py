"""Training objectives beyond next-token prediction: the Qwen3.5 target with its MTP head.

The seed's flagship configuration drafts with the target's own multi-token-prediction head,
and a head trained beside the trunk predicts the token after next far better than one fitted
afterwards. So the target and the head train together, on one loss:

``loss = CE(trunk logits at t, token t + 1) + mtp_weight * CE(head logits at t, token t + 2)``

where the head at ``t`` reads the trunk's normed hidden state at ``t`` and the true token at
``t + 1`` (teacher forcing, as at inference the head reads the committed token). The trunk
runs the chunked delta rule (:meth:`~turbospark_jax.models.qwen3_5.model.Qwen35Model.train_forward`)
so a training sequence costs matrix products, not a scan over its positions. Gradients of the
head's loss reach the trunk through the hidden states it reads: the trunk learns to keep what
the head needs, as in the published recipes.

**The head, a slice of rows at a time** (``head_rows``, off by default): both
cross-entropies run through :func:`head_cross_entropy`, which applies the output head to
``head_rows`` rows at a time under ``jax.checkpoint``, so the float32 ``[rows, vocabulary]``
logits of a whole batch never exist at once, forward or backward (the backward pass recomputes
each slice's logits). It trades the head's products once more for memory; whether that pays on
a given device is for the train suite of the benchmarks to say.

**Mixed precision where it matters** (:func:`compute_params`, :func:`output_head`): the
params are cast to the compute dtype inside the loss, but the embedding rows are gathered from
the float32 table, so the lookup's gradient (a scatter-add of every position's row gradient)
sums in float32: in bfloat16 the sum for a frequent token stalls once it outgrows the addends
(10,000 additions of 1e-4 come to 0.031, not 1). The output head keeps float32 logits for the
loss but takes its backward products in the compute dtype (the logits' cotangent rounded to
it), as every mixed-precision trainer does; a float32 cotangent turned both of its products
into float32 matrix products over the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from turbospark_jax.models.family import Params
from turbospark_jax.models.qwen3_5.model import Qwen35Model


def compute_params(model: Qwen35Model, params: Params) -> Params:
    """float32 ``params`` cast to ``model.dtype`` for the forward pass, except the embedding
    table, which stays float32 so its lookup's gradient sums in float32 (the model casts the
    gathered rows, and :func:`output_head` the table it multiplies by)."""
    compute = jax.tree.map(lambda p: p.astype(model.dtype), params)
    return {**compute, "embed_tokens": params["embed_tokens"]}


@jax.custom_vjp
def _head_product(hidden: jax.Array, matrix: jax.Array) -> jax.Array:
    """``hidden [N, D] @ matrix[V, D].T`` -> float32 logits ``[N, V]``; the backward pass
    rounds the logits' cotangent to the operands' dtype before its two products."""
    return jnp.einsum("nd,vd->nv", hidden, matrix, preferred_element_type=jnp.float32)


def _head_product_fwd(hidden: jax.Array, matrix: jax.Array
                      ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _head_product(hidden, matrix), (hidden, matrix)


def _head_product_bwd(saved: tuple[jax.Array, jax.Array], g: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
    hidden, matrix = saved
    g = g.astype(matrix.dtype)
    d_hidden = jnp.einsum("nv,vd->nd", g, matrix, preferred_element_type=jnp.float32)
    d_matrix = jnp.einsum("nv,nd->vd", g, hidden, preferred_element_type=jnp.float32)
    return d_hidden.astype(hidden.dtype), d_matrix.astype(matrix.dtype)


_head_product.defvjp(_head_product_fwd, _head_product_bwd)


def output_head(model: Qwen35Model, compute: Params) -> Callable[[jax.Array], jax.Array]:
    """The model's output head for training, over :func:`compute_params`: normed hidden
    ``[..., D]`` -> float32 logits ``[..., V]``, the same values as
    :meth:`~turbospark_jax.models.qwen3_5.model.Qwen35Model.head_logits`, with its backward
    products in the compute dtype."""
    if model.config.tie_word_embeddings:
        matrix = compute["embed_tokens"].astype(model.dtype)  # [V, D]
    else:
        matrix = compute["lm_head"].astype(model.dtype).T  # [V, D]

    def head(hidden: jax.Array) -> jax.Array:
        flat = hidden.reshape(-1, hidden.shape[-1]).astype(model.dtype)
        return _head_product(flat, matrix).reshape(*hidden.shape[:-1], -1)

    return head


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of ``targets`` (int32 ``[..., T]``) under float32
    ``logits [..., T, V]``."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def head_cross_entropy(head: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                       targets: jax.Array, rows: int) -> jax.Array:
    """Mean negative log-likelihood of ``targets`` (int32 ``[...]``) under ``head(hidden)``
    (``hidden [..., D]`` -> float32 logits ``[..., V]``), ``rows`` rows at a time, each slice's
    logits recomputed in the backward pass rather than kept."""
    d = hidden.shape[-1]
    flat_h = hidden.reshape(-1, d)
    flat_t = targets.reshape(-1)
    n = flat_t.shape[0]
    rows = max(1, min(rows, n))
    slices = -(-n // rows)
    pad = slices * rows - n
    flat_h = jnp.pad(flat_h, ((0, pad), (0, 0))).reshape(slices, rows, d)
    flat_t = jnp.pad(flat_t, (0, pad)).reshape(slices, rows)
    live = (jnp.arange(slices * rows) < n).reshape(slices, rows)

    @jax.checkpoint
    def one(h: jax.Array, t: jax.Array, keep: jax.Array) -> jax.Array:
        logits = head(h).astype(jnp.float32)
        picked = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        return jnp.sum(jnp.where(keep, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0))

    def step(total: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        return total + one(*xs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (flat_h, flat_t, live))
    return total / n


def qwen35_mtp_loss(model: Qwen35Model, params: Params, rows: jax.Array,
                    mtp_weight: float, head_rows: int = 0
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The joint objective over packed rows (int32 ``[B, T + 1]``).

    Args:
      model: a Qwen3.5 model whose config has an MTP head; its ``dtype`` is the compute dtype.
      params: float32 params (cast to the compute dtype here).
      rows: packed rows; inputs ``rows[:, :-1]``, targets ``rows[:, 1:]``.
      mtp_weight: the head's share of the loss.
      head_rows: apply the output head this many rows at a time (:func:`head_cross_entropy`);
        0 for the whole batch at once.

    Returns:
      ``(total, {"loss": trunk CE, "mtp_loss": head CE})``.
    """
    inputs, targets = rows[:, :-1], rows[:, 1:]
    compute = compute_params(model, params)
    _, hidden = model.train_forward(compute, inputs)  # the logits are left unused (pruned)
    head = output_head(model, compute)
    mtp_hidden = model.mtp_train_hidden(compute, hidden, inputs)
    if head_rows:
        main = head_cross_entropy(head, hidden, targets, head_rows)
        mtp = head_cross_entropy(head, mtp_hidden, targets[:, 1:], head_rows)
    else:
        d = hidden.shape[-1]
        main = cross_entropy(head(hidden.reshape(-1, d)), targets.reshape(-1))
        mtp = cross_entropy(head(mtp_hidden.reshape(-1, d)), targets[:, 1:].reshape(-1))
    return main + mtp_weight * mtp, {"loss": main, "mtp_loss": mtp}
