"""Model FLOPs utilisation: how much of the device's arithmetic a training run turns into
model progress.

Tokens per second alone cannot say whether a recipe is fast for its model: a small model on a
big GPU can run at a high token rate and still leave most of the device idle. MFU divides the
FLOPs the model needs per token by what the device could do in that time:

* **FLOPs per trained token**: a forward and backward pass cost about three forward passes,
  and a forward pass two FLOPs per weight that multiplies an activation (every matrix but the
  input embedding's gather; a tied head multiplies by the table, so it counts; an MTP head's
  extra layer is left out, so a joint run's MFU is a slight underestimate), plus causal
  self-attention's scores and weighted sum, ``2 * 2 * layers * (seq_len / 2) * heads *
  head_dim`` per token (half the positions, on average, are attended). In all:
  ``6 * matmul_params + 6 * layers * seq_len * heads * head_dim``. Recomputation, the
  optimizer and elementwise work are not model FLOPs and do not count.
* **Peak**: the device's dense bfloat16 tensor-core rate from its data sheet (no sparsity),
  looked up by ``device_kind``; unknown devices (and CPUs) get no MFU rather than a guess.
"""

from __future__ import annotations

import math
from typing import Any

import jax

#: Dense bf16 peak FLOP/s by ``jax.Device.device_kind``, from the vendors' data sheets.
PEAK_BF16_FLOPS: dict[str, float] = {
    "NVIDIA H200": 989.4e12,
    "NVIDIA H100 80GB HBM3": 989.4e12,
    "NVIDIA H100": 989.4e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
}


def training_flops_per_token(config: Any, params: Any, seq_len: int) -> float:
    """Model FLOPs to train on one token (see the module docstring).

    The matrix products are counted from the params themselves (every leaf but the norms'
    scales, the input embedding and a DeltaNet layer's per-head decay parameters), so any
    family's shape is counted as it is. Attention is counted for the layers that attend over
    the sequence (every layer of a dense model; the ``full_attention`` ones of a hybrid): the
    gated delta rule's own products grow with the chunk, not the sequence, and are left out.

    Args:
      config: the model config (``num_hidden_layers``, ``num_attention_heads``, ``head_dim``,
        ``hidden_size``, ``vocab_size``, ``tie_word_embeddings``; ``layer_types`` when mixed).
      params: the params tree (arrays or shape structs).
      seq_len: tokens per training sequence.
    """
    matmul = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if any(word in name for word in SKIPPED_LEAVES):
            continue
        matmul += math.prod(leaf.shape)
    if config.tie_word_embeddings:
        matmul += config.vocab_size * config.hidden_size  # the head multiplies by the table
    types = getattr(config, "layer_types", None) or ("full_attention",) * config.num_hidden_layers
    attending = sum(t == "full_attention" for t in types)
    q = config.num_attention_heads * config.head_dim
    return 6.0 * matmul + 6.0 * attending * seq_len * q


#: Leaves that multiply no activation (norm scales, the embedding's gather, a DeltaNet layer's
#: per-head decay parameters and conv taps) or, for ``mtp``, are not part of the trunk's step.
SKIPPED_LEAVES = ("norm", "embed_tokens", "A_log", "dt_bias", "conv1d", "'mtp'")


def peak_flops(device_kind: str) -> float | None:
    """The device's dense bf16 peak, or ``None`` when it is not in the table."""
    return PEAK_BF16_FLOPS.get(device_kind)


def mfu(tokens_per_s: float, flops_per_token: float, device_kind: str) -> float | None:
    """Model FLOPs utilisation in ``[0, 1]``-ish, or ``None`` on an unknown device."""
    peak = peak_flops(device_kind)
    return None if peak is None else tokens_per_s * flops_per_token / peak
