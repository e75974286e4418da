"""Producers and wrappers that several test modules share."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.core.kv_prefix import common_prefix
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.io.loading import quantize_params
from turbospark_jax.kernels.plan import XLA_PLAN, KernelPlan, kernel_plan
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseCache, DenseModel, init_params
from turbospark_jax.models.family import Family
from turbospark_jax.quant.weights import Quantization
from turbospark_jax.testing.toy import toy_attention_producer, toy_recurrent_producer


def backend_plan(row_invariant: bool = True) -> KernelPlan:
    """The plan a dense model is served with on this backend (the compiled Pallas kernels on a
    GPU, the tiled XLA forms elsewhere) when ``row_invariant``; XLA's own kernels, the controls'
    plan, when not. Tests that check a row's bits across widths build their models with it, so
    the same test checks the GPU's own arithmetic when run with ``JAX_PLATFORMS=cuda``."""
    if row_invariant:
        return kernel_plan(jax.default_backend(), exact=True, row_invariant_family=True)
    return XLA_PLAN


def quantized(family: Family, config: Any, params: Any, spec: Quantization | str,
              dtype: Any) -> Any:
    """``params`` (in the family's native layout) with its linear weights quantized as
    loading a folder with ``quantize=spec`` would."""
    if family.split_params is not None:
        params = family.split_params(config, params)
    host = quantize_params(jax.tree.map(np.asarray, params), family.hf_tensors(config),
                           Quantization.parse(spec), dtype)
    if family.join_params is not None:
        host = family.join_params(config, host)
    return jax.tree.map(jnp.asarray, host)


@functools.partial(jax.jit, static_argnums=0)
def jitted_block(
    model: DenseModel,
    params: Any,
    cache: DenseCache,
    tokens: jax.Array,
    positions: jax.Array,
    live: jax.Array,
    need_head: jax.Array,
) -> tuple[jax.Array, DenseCache]:
    """``model.block_forward`` under one ``jit`` (the model is static)."""
    return model.block_forward(params, cache, tokens, positions, live, need_head)


def multi_turn_producers(vocab: int) -> dict[str, Any]:
    """A donating toy attention producer, a toy recurrent one and a donating tiny dense qwen3,
    each with 128 positions, W = 4 and 8 steps per call: the producers the multi-turn tests
    (session pool, chat) run their properties on."""
    config = DenseConfig(
        model_type="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )
    dense = BlockProducer(
        DenseModel(config), init_params(config, jax.random.PRNGKey(1)),
        capacity=128, width=4, steps_per_call=8, donate=True,
    )
    return {
        "attention_donating": toy_attention_producer(
            vocab=vocab, capacity=128, width=4, steps_per_call=8, donate=True
        ),
        "recurrent": toy_recurrent_producer(vocab=vocab, capacity=128, width=4, steps_per_call=8),
        "dense_donating": dense,
    }


def randomise_hf_norms_and_biases(model: Any, seed: int = 0) -> None:
    """Give a transformers model's norm weights (1 + noise) and biases (noise) random values,
    so parity tests exercise them rather than their ones and zeros."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)


class SnapshotReference:
    """What a state of a model that cannot rewind reuses, written plainly: its whole record
    when the prompt extends it, else the furthest prompt-end snapshot of its own history
    inside the common prefix (``BlockProducer`` keeps the newest ``MAX_SNAPSHOTS`` prompt
    ends), else nothing (and the state starts fresh, without snapshots)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.prompts: list[tuple[int, ...]] = []  # the prompts whose ends hold a snapshot

    def reuse(self, fed: Sequence[int], prompt: Sequence[int]) -> int:
        n = common_prefix(fed, None, prompt)
        if n == len(fed):
            return n
        ends = [len(p) for p in self.prompts if len(p) <= n and tuple(fed[: len(p)]) == p]
        return max(ends, default=0)

    def served(self, prompt: Sequence[int], reused: int) -> None:
        """Record a turn: a fresh start forgets the snapshots; the prompt's end gets one."""
        if reused == 0:
            self.prompts = []
        prompt = tuple(prompt)
        self.prompts = [p for p in self.prompts if len(p) != len(prompt)] + [prompt]
        self.prompts = self.prompts[-self.keep:]
