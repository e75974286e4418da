"""Model FLOPs utilisation: how much of the device's arithmetic a training run turns into
model progress.

Tokens per second alone cannot say whether a recipe is fast for its model: a small model on a
big GPU can run at a high token rate and still leave most of the device idle. MFU divides the
FLOPs the model needs per token by what the device could do in that time:

* **FLOPs per trained token**: a forward and backward pass cost about three forward passes,
  and a forward pass two FLOPs per weight that multiplies an activation (every matrix but the
  input embedding's gather; a tied head multiplies by the table, so it counts), plus causal
  self-attention's scores and weighted sum, ``2 * 2 * layers * (seq_len / 2) * heads *
  head_dim`` per token (half the positions, on average, are attended). In all:
  ``6 * matmul_params + 6 * layers * seq_len * heads * head_dim``. Recomputation, the
  optimizer and elementwise work are not model FLOPs and do not count.
* **Peak**: the device's dense bfloat16 tensor-core rate from its data sheet (no sparsity),
  looked up by ``device_kind``; unknown devices (and CPUs) get no MFU rather than a guess.
"""

from __future__ import annotations

from typing import Any

#: Dense bf16 peak FLOP/s by ``jax.Device.device_kind``, from the vendors' data sheets.
PEAK_BF16_FLOPS: dict[str, float] = {
    "NVIDIA H200": 989.4e12,
    "NVIDIA H100 80GB HBM3": 989.4e12,
    "NVIDIA H100": 989.4e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
}


def training_flops_per_token(config: Any, seq_len: int) -> float:
    """Model FLOPs to train on one token of a dense decoder (see the module docstring).

    Args:
      config: a dense config (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``vocab_size``).
      seq_len: tokens per training sequence.
    """
    d, layers = config.hidden_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * config.intermediate_size
    matmul_params = layers * per_layer + config.vocab_size * d  # the head
    return 6.0 * matmul_params + 6.0 * layers * seq_len * q


def peak_flops(device_kind: str) -> float | None:
    """The device's dense bf16 peak, or ``None`` when it is not in the table."""
    return PEAK_BF16_FLOPS.get(device_kind)


def mfu(tokens_per_s: float, flops_per_token: float, device_kind: str) -> float | None:
    """Model FLOPs utilisation in ``[0, 1]``-ish, or ``None`` on an unknown device."""
    peak = peak_flops(device_kind)
    return None if peak is None else tokens_per_s * flops_per_token / peak
