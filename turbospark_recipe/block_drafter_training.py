"""Training a block drafter against a frozen target (any family that records tap rows: dense,
Qwen3.5), and writing it out.

A batch is token rows the target reads once (:func:`target_batch`): its tap rows at every
position, and at every position ``t >= 1`` the token it would emit there greedily after the
tokens before it (for data the target generated itself, those are the data). Each step draws
random anchors per row (:func:`sample_anchors`); for an anchor ``a`` the drafter sees the
target's rows before ``a`` and the block ``[tokens[a], mask x (B - 1)]``, and row ``i`` is
scored against the target's token at ``a + i``. Early block positions matter most (a
proposal counts only when every one before it was accepted), so row ``i``'s cross-entropy is
weighted by ``exp(-(i - 1) / decay)``, the weights summing to one.

The target never changes: its params are not an argument of the gradient.

:func:`train_block_drafter` is the loop (AdamW on the recipe's warmup-cosine schedule, fresh
anchors every step, a held-out evaluation: the weighted cross-entropy and the greedy top-1
acceptance by block position); :func:`export_block_drafter` writes the folder
:func:`~turbospark_jax.io.drafter_folders.load_block_drafter` reads;
:func:`default_drafter_config` is the shape the recipe trains for a target.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from tqdm import tqdm

from turbospark_jax.errors import BadInputError
from turbospark_jax.io import drafter_folders
from turbospark_jax.models.base import BlockModel
from turbospark_jax.models.block_drafter import (
    BlockDrafterConfig,
    BlockDrafterModel,
    Params,
    evenly_spaced_layers,
    init_params,
    shared_weights,
)
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.qwen3_5.config import Qwen35Config
from turbospark_jax.speculative.drafters.block import tapped_target
from turbospark_recipe.train import TrainConfig, build_model, make_optimizer


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


def target_batch(target: BlockModel, target_params: Params, tokens: jax.Array) -> TargetBatch:
    """Run the frozen target (a tapped model: :func:`~turbospark_jax.speculative.drafters.block.
    tapped_target`) over ``tokens`` (int32 ``[N, T]``).

    Raises:
      BadInputError: the target has no tap layers.
    """
    return _target_batch(target, target_params, tokens)


@functools.partial(jax.jit, static_argnums=0)
def _target_batch(target: BlockModel, params: Params, tokens: jax.Array) -> TargetBatch:
    logits, taps = target.forward_taps(params, tokens)
    greedy = jnp.concatenate(
        [tokens[:, :1], jnp.argmax(logits[:, :-1], axis=-1).astype(jnp.int32)], axis=1)
    return TargetBatch(tokens=tokens, taps=jax.lax.stop_gradient(taps),
                       greedy=jax.lax.stop_gradient(greedy))


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


def _proposal_scores(model: BlockDrafterModel, params: Params, shared: Params,
                     batch: TargetBatch, anchors: jax.Array) -> tuple[jax.Array, jax.Array]:
    """At every anchor (int32 ``[N, A]``): the cross-entropy of block rows ``1 .. B - 1``
    against the target's greedy tokens, float32 ``[N, A, B - 1]``, and whether each row's
    argmax is that token, bool ``[N, A, B - 1]``. Params are cast to the model's dtype."""
    params = jax.tree.map(lambda a: a.astype(model.dtype), params)
    rows = jnp.arange(1, model.config.block_size, dtype=jnp.int32)

    def one_row(taps: jax.Array, tokens: jax.Array, greedy: jax.Array,
                row_anchors: jax.Array) -> tuple[jax.Array, jax.Array]:
        k, v = model.context_kv(params, taps, jnp.arange(taps.shape[0], dtype=jnp.int32))

        def one_anchor(a: jax.Array) -> tuple[jax.Array, jax.Array]:
            logits = model.block_logits(params, shared, k, v, a, tokens[a])[1:]  # [B - 1, V]
            labels = jnp.take(greedy, a + rows)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return ce, jnp.argmax(logits, axis=-1) == labels

        return jax.vmap(one_anchor)(row_anchors)

    return jax.vmap(one_row)(batch.taps, batch.tokens, batch.greedy, anchors)


def block_drafter_loss(model: BlockDrafterModel, params: Params, shared: Params,
                       batch: TargetBatch, anchors: jax.Array, decay: float = 4.0) -> jax.Array:
    """The weighted cross-entropy of the drafter's proposals at ``anchors`` (int32
    ``[N, A]``) against the target's greedy tokens; a float32 scalar."""
    ce, _ = _proposal_scores(model, params, shared, batch, anchors)
    return jnp.mean(jnp.sum(ce * position_weights(model.config.block_size, decay), axis=-1))


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


# -- the training loop ---------------------------------------------------------------------------


def default_drafter_config(target_config: DenseConfig | Qwen35Config, *, block_size: int = 8,
                           mask_token_id: int | None = None) -> BlockDrafterConfig:
    """The drafter shape the recipe trains for a target: two layers at the target's width
    (heads of 64, two KV heads, an MLP twice as wide), reading four evenly spaced target
    layers (fewer when the target has fewer). For a hidden-384, 8-layer target that is
    3.2M parameters (the embedding and head are the target's, not counted).

    Args:
      target_config: the target's config.
      block_size: ``B`` (the anchor and ``B - 1`` proposals).
      mask_token_id: the id filling the masked rows; default the target's ``pad_token_id``
        (a token it never emits), else the last id.
    """
    d, n = target_config.hidden_size, target_config.num_hidden_layers
    heads = max(1, d // 64)
    if mask_token_id is None:
        pad = getattr(target_config, "pad_token_id", None)
        mask_token_id = pad if pad is not None else target_config.vocab_size - 1
    return BlockDrafterConfig(
        hidden_size=d, vocab_size=target_config.vocab_size,
        target_layer_ids=evenly_spaced_layers(n, min(4, n)), target_num_hidden_layers=n,
        num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=2 if heads % 2 == 0 else 1, head_dim=d // heads,
        intermediate_size=2 * d, block_size=block_size, mask_token_id=mask_token_id,
        rms_norm_eps=target_config.rms_norm_eps,
    )


@dataclasses.dataclass
class BlockDrafterTrainResult:
    """What :func:`train_block_drafter` returns.

    Attributes:
      config: the drafter's config.
      params: its float32 params at the end of the run.
      steps_done: optimizer steps taken.
      finished: whether every asked-for step ran (not stopped by the deadline).
      history: records, ``kind`` "train" (``step``, ``loss``) or "eval" (``step``, ``loss``
        the weighted cross-entropy, ``acceptance`` the share of anchors whose proposals
        ``1 .. i`` all equal the target's greedy tokens, for ``i = 1 .. B - 1``, and
        ``accepted_length``, their sum: the expected greedy proposals kept per pass).
      timings: ``compile_s``, ``train_s``, ``tokens_per_s`` (target tokens read per second of
        training), ``anchors_per_s``, ``eval_s``.
    """

    config: BlockDrafterConfig
    params: Params
    steps_done: int
    finished: bool
    history: list[dict[str, Any]]
    timings: dict[str, float]

    @property
    def last_eval(self) -> dict[str, Any] | None:
        """The last held-out evaluation, or ``None``."""
        evals = [h for h in self.history if h["kind"] == "eval"]
        return evals[-1] if evals else None


@functools.lru_cache(maxsize=4)
def _eval_step(model: BlockDrafterModel, tied: bool, decay: float) -> Any:
    """The jitted held-out step: ``(params, target_params, batch, anchors) -> (weighted CE,
    acceptance [B - 1])``."""
    b = model.config.block_size

    def step(params: Params, target_params: Params, batch: TargetBatch,
             anchors: jax.Array) -> tuple[jax.Array, jax.Array]:
        ce, hit = _proposal_scores(model, params, shared_weights(target_params, tied), batch,
                                   anchors)
        weighted = jnp.sum(ce * position_weights(b, decay), axis=-1)  # [N, A]
        kept = jnp.cumprod(hit.astype(jnp.int32), axis=-1)  # proposals 1..i all right
        return jnp.mean(weighted), jnp.mean(kept.reshape(-1, b - 1), axis=0)

    return jax.jit(step)


def train_block_drafter(
    target_config: DenseConfig | Qwen35Config,
    target_params: Params,
    train_rows: np.ndarray,
    heldout_rows: np.ndarray,
    drafter_config: BlockDrafterConfig,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    deadline: float | None = None,
    progress: bool = True,
    anchors_per_row: int = 16,
    warmup_steps: int = 100,
    eval_every: int = 0,
    eval_rows: int = 256,
    compute_dtype: str = "float32",
    decay: float = 4.0,
) -> BlockDrafterTrainResult:
    """Train a block drafter against a frozen target.

    Each step takes ``batch_size`` rows (a shuffled pass over ``train_rows``, reshuffled each
    epoch), runs the target over them (its tap rows and greedy tokens; one compiled program
    that the evaluation shares when its batches have the same shape), draws
    ``anchors_per_row`` random anchors per row and takes one AdamW step on the weighted
    cross-entropy (the recipe's optimizer: :func:`~turbospark_recipe.train.
    make_optimizer`, warmup then cosine decay to a tenth of ``lr``, clipping, no decay on
    norms). The held-out evaluation (fixed anchors; every ``eval_every`` steps and at the
    end) reports the weighted cross-entropy and the greedy acceptance by block position
    (exact for rows the target generated greedily itself; for other text, teacher-forced:
    the target's greedy token after the text before it).

    Args:
      target_config, target_params: the frozen target (its float32 or bfloat16 params; it
        is built tapped with ``drafter_config.target_layer_ids``).
      train_rows, heldout_rows: int ``[N, T]`` token rows (``T >= block_size``).
      drafter_config: e.g. :func:`default_drafter_config`.
      steps: optimizer steps; batch_size: rows per step; lr: the peak learning rate.
      seed: the drafter's init, the row order and the anchors.
      deadline: a ``time.monotonic()`` value; the loop stops before a step past it.
      progress: show a progress bar.
      anchors_per_row: anchors drawn per row per step.
      warmup_steps: linear warmup (shortened for short runs).
      eval_every: steps between held-out evaluations (0: only at the end).
      eval_rows: at most this many held-out rows per evaluation (the first ones).
      compute_dtype: the dtype of the target's pass and the drafter's activations (master
        weights stay float32).
      decay: the block-position weighting (:func:`position_weights`).

    Returns:
      A :class:`BlockDrafterTrainResult`.

    Raises:
      BadInputError: a bad argument (named): rows of the wrong shape or too short, a drafter
        made for another target, non-positive counts.
    """
    for name, value in (("steps", steps), ("batch_size", batch_size),
                        ("anchors_per_row", anchors_per_row), ("eval_rows", eval_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadInputError(f"{name} must be an integer >= 1, got {value!r}")
    if not (isinstance(lr, float | int) and lr > 0):
        raise BadInputError(f"lr must be a positive number, got {lr!r}")
    if not isinstance(drafter_config, BlockDrafterConfig):
        raise BadInputError(f"drafter_config must be a BlockDrafterConfig, got "
                            f"{type(drafter_config).__name__}")
    for name, mine, theirs in (
        ("hidden_size", drafter_config.hidden_size, target_config.hidden_size),
        ("vocab_size", drafter_config.vocab_size, target_config.vocab_size),
        ("target_num_hidden_layers", drafter_config.target_num_hidden_layers,
         target_config.num_hidden_layers),
    ):
        if mine != theirs:
            raise BadInputError(f"the drafter's {name} is {mine} but the target's is {theirs}")
    b = drafter_config.block_size
    rows = {}
    for name, data in (("train_rows", train_rows), ("heldout_rows", heldout_rows)):
        data = np.asarray(data)
        if data.ndim != 2 or data.shape[0] < 1 or data.shape[1] < b or \
                not np.issubdtype(data.dtype, np.integer):
            raise BadInputError(f"{name} must be integer token rows [N, T] with N >= 1 and "
                                f"T >= block_size ({b}), got {data.dtype} {list(data.shape)}")
        if data.min() < 0 or data.max() >= target_config.vocab_size:
            raise BadInputError(f"{name} holds ids outside the target's vocabulary of "
                                f"{target_config.vocab_size}")
        rows[name] = data.astype(np.int32)
    train, heldout = rows["train_rows"], rows["heldout_rows"][:eval_rows]

    dtype = jnp.dtype(compute_dtype)
    target = tapped_target(build_model(target_config, compute_dtype), drafter_config)
    model = BlockDrafterModel(drafter_config, dtype)
    train_config = TrainConfig(steps=steps, batch_size=batch_size, seq_len=train.shape[1],
                               peak_lr=float(lr), warmup_steps=warmup_steps, seed=seed,
                               compute_dtype=compute_dtype)
    optimizer = make_optimizer(train_config)
    tied = target_config.tie_word_embeddings
    train_step = make_train_step(model, optimizer, tied, float(decay))
    eval_step = _eval_step(model, tied, float(decay))
    frozen = jax.tree.map(lambda a: jnp.asarray(a, dtype), target_params)
    key = jax.random.PRNGKey(seed)
    key, init_key, eval_key = jax.random.split(key, 3)
    params = init_params(drafter_config, init_key, jnp.float32)
    opt_state = optimizer.init(params)

    history: list[dict[str, Any]] = []
    eval_batch = min(batch_size, len(heldout))
    eval_s = 0.0

    def run_eval(step: int) -> None:
        nonlocal eval_s
        t0 = time.monotonic()
        parts = []
        for i in range(0, len(heldout) - eval_batch + 1, eval_batch):
            batch = target_batch(target, frozen, jnp.asarray(heldout[i : i + eval_batch]))
            anchors = sample_anchors(jax.random.fold_in(eval_key, i), eval_batch,
                                     heldout.shape[1], anchors_per_row, b)
            parts.append(eval_step(params, frozen, batch, anchors))
        losses, accept = jax.device_get(([p[0] for p in parts], [p[1] for p in parts]))
        acceptance = [float(x) for x in np.mean(np.stack(accept), axis=0)]
        history.append({"kind": "eval", "step": step, "loss": float(np.mean(losses)),
                        "acceptance": acceptance, "accepted_length": float(sum(acceptance))})
        eval_s += time.monotonic() - t0

    order = np.random.default_rng(seed)
    perm, cursor = order.permutation(len(train)), 0
    bar = tqdm(total=steps, desc="block drafter", unit="step", disable=not progress,
               mininterval=1.0, dynamic_ncols=True)
    compile_s, train_s, step = 0.0, 0.0, 0
    while step < steps:
        if deadline is not None and time.monotonic() >= deadline:
            break
        picked = []
        while len(picked) < batch_size:  # a shuffled pass, reshuffled at each epoch's end
            take = perm[cursor : cursor + batch_size - len(picked)]
            picked.extend(take.tolist())
            cursor += len(take)
            if cursor >= len(perm):
                perm, cursor = order.permutation(len(train)), 0
        t0 = time.monotonic()
        batch = target_batch(target, frozen, jnp.asarray(train[picked]))
        anchors = sample_anchors(jax.random.fold_in(key, step), batch_size, train.shape[1],
                                 anchors_per_row, b)
        params, opt_state, loss = train_step(params, opt_state, frozen, batch, anchors)
        loss = float(loss)
        elapsed = time.monotonic() - t0
        if step == 0:
            compile_s = elapsed  # the first step compiles (and runs once)
        else:
            train_s += elapsed
        step += 1
        history.append({"kind": "train", "step": step, "loss": loss})
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if eval_every and step % eval_every == 0 and step < steps:
            run_eval(step)
    bar.close()
    run_eval(step)
    timed = max(step - 1, 0)
    timings = {
        "compile_s": compile_s, "train_s": train_s, "eval_s": eval_s,
        "tokens_per_s": timed * batch_size * train.shape[1] / train_s if train_s else math.nan,
        "anchors_per_s": timed * batch_size * anchors_per_row / train_s if train_s else math.nan,
    }
    return BlockDrafterTrainResult(config=drafter_config, params=params, steps_done=step,
                                   finished=step == steps, history=history, timings=timings)


def export_block_drafter(folder: str | os.PathLike[str], config: BlockDrafterConfig,
                         params: Params, dtype: str = "bfloat16") -> None:
    """Write a drafter folder (``config.json``, ``model.safetensors`` in ``dtype``) that
    :func:`~turbospark_jax.io.drafter_folders.load_block_drafter` and ``--block-drafter`` read.

    Raises:
      BadInputError: ``dtype`` is not float32, bfloat16 or float16, or ``config`` not a
        block drafter config.
      ModelLoadError: the params do not have the shapes ``config`` implies.
    """
    if dtype not in ("float32", "bfloat16", "float16"):
        raise BadInputError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    host = jax.tree.map(lambda a: np.asarray(jax.device_get(a)).astype(jnp.dtype(dtype)),
                        params)
    drafter_folders.save_block_drafter(folder, config, host)
