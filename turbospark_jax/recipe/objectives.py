"""Training objectives beyond next-token prediction: the Qwen3.5 target with its MTP head.

The seed's flagship configuration drafts with the target's own multi-token-prediction head,
and a head trained beside the trunk predicts the token after next far better than one fitted
afterwards. So the target and the head train together, on one loss:

``loss = CE(trunk logits at t, token t + 1) + mtp_weight * CE(head logits at t, token t + 2)``

where the head at ``t`` reads the trunk's normed hidden state at ``t`` and the true token at
``t + 1`` (teacher forcing, as at inference the head reads the committed token). The trunk
runs the chunked delta rule (:meth:`~turbospark_jax.models.qwen3_5.Qwen35Model.train_forward`)
so a training sequence costs matrix products, not a scan over its positions. Gradients of the
head's loss reach the trunk through the hidden states it reads: the trunk learns to keep what
the head needs, as in the published recipes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from turbospark_jax.models.family import Params
from turbospark_jax.models.qwen3_5 import Qwen35Model


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of ``targets`` (int32 ``[..., T]``) under float32
    ``logits [..., T, V]``."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def qwen35_mtp_loss(model: Qwen35Model, params: Params, rows: jax.Array,
                    mtp_weight: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The joint objective over packed rows (int32 ``[B, T + 1]``).

    Args:
      model: a Qwen3.5 model whose config has an MTP head; its ``dtype`` is the compute dtype.
      params: float32 params (cast to the compute dtype here).
      rows: packed rows; inputs ``rows[:, :-1]``, targets ``rows[:, 1:]``.
      mtp_weight: the head's share of the loss.

    Returns:
      ``(total, {"loss": trunk CE, "mtp_loss": head CE})``.
    """
    inputs, targets = rows[:, :-1], rows[:, 1:]
    compute = jax.tree.map(lambda p: p.astype(model.dtype), params)
    logits, hidden = model.train_forward(compute, inputs)
    main = cross_entropy(logits, targets)
    head = cross_entropy(model.mtp_train_logits(compute, hidden, inputs), targets[:, 1:])
    return main + mtp_weight * head, {"loss": main, "mtp_loss": head}
