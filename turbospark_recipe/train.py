"""Training one model of the recipe: its shape, the optimizer and step, checkpoints, the loop.

**Shapes.** :data:`PRESETS` name the recipe's qwen3 shapes (tied embedding, RoPE base 10000);
:func:`model_config` fills in the vocabulary and special ids from the tokenizer.

**Training.** Length is given in epochs (the data is small, so passes over it, not tokens,
decide between under- and overfitting); the command line resolves them into the step count
that :class:`TrainConfig` holds and the checkpoint records. AdamW (``b2`` 0.95) with linear
warmup and cosine decay to ``min_lr_ratio`` of the peak, global-norm clipping, float32 master
weights cast to bfloat16 inside the loss, and a float32 softmax cross-entropy. Weight decay
applies to every matrix, the tied embedding included (it is also the output head, so it is
decayed like any projection), and not to the RMSNorm scales: decaying those pulls them toward
zero, which fights the normalisation.

**Checkpoints.** ``state.safetensors`` (params, optimizer state, step, keyed by tree path)
plus ``meta.json`` (step, data position, configs, data fingerprint, history), written
atomically; never pickle. Resuming runs the same compiled step on the same batches (see
:class:`~turbospark_recipe.corpus.DataOrder`), so on the CPU a resumed run is bitwise
equal to an uninterrupted one.

**Continuing a trained model** (:class:`WarmStart`): a run may start from the weights of a
model of the same shape instead of a fresh init (an exported folder, say the embedded model),
with fresh optimizer moments and a schedule of its own, so a model can keep training across
GPU sessions even when its optimizer state could not be kept.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from turbospark_jax.errors import BadInputError
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_jax.models.base import BlockModel
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.models.dense.model import DenseModel, Params
from turbospark_jax.models.qwen3_5.config import Qwen35Config
from turbospark_jax.models.qwen3_5.model import Qwen35Model
from turbospark_recipe.corpus import DataOrder, fingerprint
from turbospark_recipe.flops import mfu, training_flops_per_token
from turbospark_recipe.objectives import (
    compute_params,
    cross_entropy,
    output_head,
    qwen35_mtp_loss,
)

CHECKPOINT_STATE = "state.safetensors"
CHECKPOINT_META = "meta.json"
#: Steps a run of ``TrainConfig.seconds`` times, after the compile, to set its schedule.
TRIAL_STEPS = 20


# -- models --------------------------------------------------------------------------------

#: Model shapes for the recipe (``config.json`` keys). Parameter counts at vocab 8192, with the
#: tied embedding: target 23.1M, draft 3.2M, target35 19.3M (the embedded target's shape;
#: printed by every run).
PRESETS: dict[str, dict[str, Any]] = {
    "target": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1024,
    },
    "draft": {
        "hidden_size": 192,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 48,
        "intermediate_size": 768,
    },
    # The embedded target's shape: Qwen3.5 (gated DeltaNet layers, one full-attention layer
    # in four) with its MTP head, trained jointly (objectives.py). 19.3M parameters at
    # vocab 8192, the head's 2.0M included: with the draft model and a block drafter beside it,
    # all the embedded weights stay within the repository's 55 MB of bf16 safetensors.
    "target35": {
        "model_type": "qwen3_5_text",
        "hidden_size": 384,
        "num_hidden_layers": 8,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 1024,
        "linear_num_key_heads": 3,
        "linear_num_value_heads": 6,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "mtp_num_hidden_layers": 1,
    },
    "tiny35": {
        "model_type": "qwen3_5_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "mtp_num_hidden_layers": 1,
    },
    # For tests and CPU smoke runs.
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
    },
}


def model_config(
    preset: str | Sequence[tuple[str, int]],
    tokenizer: Tokenizer,
    max_position_embeddings: int = 2048,
) -> DenseConfig | Qwen35Config:
    """A config for one of :data:`PRESETS` (or explicit shape keys) and a tokenizer: qwen3 by
    default, ``qwen3_5_text`` where the shape says so (three DeltaNet layers to one
    full-attention layer, a quarter of each head rotated).

    Args:
      preset: a :data:`PRESETS` name, or ``(key, value)`` pairs of the same keys.
      tokenizer: supplies the vocabulary size and the special token ids.
      max_position_embeddings: the context the config advertises (RoPE needs no table).

    Returns:
      The config, with tied embeddings and RoPE base 10000 (ample for short contexts).

    Raises:
      BadInputError: an unknown preset name.
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise BadInputError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        shape = dict(PRESETS[preset])
    else:
        shape = dict(preset)
    model_type = shape.pop("model_type", "qwen3")
    fields = {
        "model_type": model_type,
        "vocab_size": tokenizer.vocab_size,
        **shape,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if model_type == "qwen3":
        return DenseConfig.from_hf_dict(fields)
    if model_type != "qwen3_5_text":
        raise BadInputError(f"the recipe trains qwen3 and qwen3_5_text models, not {model_type!r}")
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    fields["layer_types"] = [kinds[i % 4] for i in range(shape["num_hidden_layers"])]
    fields["partial_rotary_factor"] = 0.25
    return Qwen35Config.from_hf_dict(fields)


def count_params(params: Params) -> int:
    """Number of parameters (a tied embedding counts once)."""
    return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params)))


# -- the train step ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping settings of one training run.

    Attributes:
      steps: total optimizer steps (the schedule's length).
      batch_size: sequences per step.
      seq_len: tokens per sequence.
      peak_lr: learning rate at the end of warmup.
      min_lr_ratio: final learning rate as a fraction of ``peak_lr``.
      warmup_steps: linear warmup length.
      weight_decay: decoupled AdamW decay on matrices (not on norms).
      b1, b2, eps: AdamW moments.
      clip_norm: global gradient-norm clip.
      seed: parameter init and data order.
      compute_dtype: the dtype params are cast to inside the loss.
      eval_every: steps between held-out evaluations (and one at the end); 0 for the end only.
      eval_rows: at most this many held-out rows per evaluation (the first ones); 0 for all.
      log_every: steps between loss/throughput readouts (each one syncs with the device).
      checkpoint_every: steps between checkpoints (and one at the end); 0 for the end only.
      mtp_weight: the MTP head's share of a Qwen3.5 target's loss (recipe/objectives.py).
      head_rows: a Qwen3.5 target's output head runs this many rows at a time, each slice's
        logits recomputed in the backward pass (``objectives.head_cross_entropy``); 0 for the
        whole batch's logits at once.
      seconds: train for about this long instead of a fixed number of steps: ``steps`` is then
        a ceiling, and the run sets its schedule's length from its own step time, timed over
        the :data:`TRIAL_STEPS` steps after the compile (inside the warmup, whose learning
        rates do not depend on the length; ``warmup_steps`` must cover them). The length it
        sets is kept in the state, so a resumed run follows it.
    """

    steps: int = 1000
    batch_size: int = 64
    seq_len: int = 512
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    seed: int = 0
    compute_dtype: str = "bfloat16"
    eval_every: int = 200
    eval_rows: int = 0
    log_every: int = 10
    checkpoint_every: int = 0
    #: the MTP head's share of the loss (models with an MTP head only)
    mtp_weight: float = 0.3
    #: rows per slice of the output head's loss (Qwen3.5 targets; 0: all at once)
    head_rows: int = 0
    seconds: float | None = None

    @property
    def effective_warmup(self) -> int:
        """``warmup_steps``, shortened to leave at least one decay step in short runs."""
        return min(self.warmup_steps, max(self.steps - 1, 0))

    def schedule(self) -> optax.Schedule:
        """Linear warmup from 0 to ``peak_lr``, then cosine decay to ``min_lr_ratio * peak``
        over ``steps``: :meth:`learning_rate` as an optax schedule of the step count."""
        return lambda count: self.learning_rate(count, self.steps)

    def learning_rate(self, step: jax.Array | int, total: jax.Array | int) -> jax.Array:
        """The warmup-cosine learning rate at ``step`` for a run of ``total`` steps, either
        possibly traced (the recipe's own step reads ``total`` from the state)."""
        step = jnp.asarray(step, jnp.float32)
        total = jnp.maximum(jnp.asarray(total, jnp.float32), 1.0)
        warmup = jnp.minimum(float(self.warmup_steps), jnp.maximum(total - 1.0, 0.0))
        rising = self.peak_lr * step / jnp.maximum(warmup, 1.0)
        progress = jnp.clip((step - warmup) / jnp.maximum(total - warmup, 1.0), 0.0, 1.0)
        end = self.peak_lr * self.min_lr_ratio
        falling = end + (self.peak_lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup, rising, falling)

    # Settings that change the arithmetic; a resume must match them exactly.
    def math_dict(self) -> dict[str, Any]:
        """The fields that determine the trained weights (all but the bookkeeping ones)."""
        skip = {"eval_every", "eval_rows", "log_every", "checkpoint_every"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}


@struct.dataclass
class TrainState:
    """Everything a training step reads and writes.

    Fields:
      step: int32 ``[]`` optimizer steps taken.
      params: float32 master weights (layout in :mod:`turbospark_jax.models.dense.model`).
      opt_state: the optax state (AdamW moments in float32, counters).
      total_steps: int32 ``[]`` the schedule's length (``TrainConfig.steps``, or what a run
        of ``TrainConfig.seconds`` set from its step time).
    """

    step: jax.Array
    params: Params
    opt_state: Any
    total_steps: jax.Array


#: Leaves never decayed: norm scales (decay pulls them toward zero, fighting the
#: normalisation), and a DeltaNet layer's decay rates and their bias (decaying those changes
#: how fast the recurrence forgets, not the size of a projection).
NO_DECAY_SUFFIXES = ("norm", "A_log", "dt_bias")


def _decay_mask(params: Params) -> Params:
    # Norm scales are stacked per layer ([L, D]), so ndim cannot tell them from matrices: the
    # name can.
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not str(getattr(path[-1], "key", "")).endswith(NO_DECAY_SUFFIXES),
        params,
    )


def make_optimizer(config: TrainConfig, learning_rate: bool = True
                   ) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the warmup-cosine schedule (decay masked off
    norms). With ``learning_rate=False`` the chain stops before the learning rate: the
    recipe's own step multiplies in :meth:`TrainConfig.learning_rate` of the state's step and
    schedule length (AdamW is ``scale_by_adam``, the decoupled decay, then the rate)."""
    if not learning_rate:
        return optax.chain(
            optax.clip_by_global_norm(config.clip_norm),
            optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps),
            optax.add_decayed_weights(config.weight_decay, mask=_decay_mask),
        )
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            learning_rate=config.schedule(),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=_decay_mask,
        ),
    )


def next_token_loss(model: DenseModel, params: Params, rows: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of packed rows.

    Args:
      model: the model; its ``dtype`` is the compute dtype the float32 params are cast to.
      params: float32 params.
      rows: int32 ``[B, T + 1]`` packed rows.

    Returns:
      float32 ``[]`` mean negative log-likelihood per target token.
    """
    inputs, targets = rows[:, :-1], rows[:, 1:]
    compute = jax.tree.map(lambda p: p.astype(model.dtype), params)
    logits = model.forward(compute, inputs).astype(jnp.float32)  # [B, T, V]
    log_z = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
    return jnp.mean(log_z - picked)


def training_loss(
    model: BlockModel, mtp_weight: float, params: Params, rows: jax.Array, head_rows: int = 0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The objective a model trains on: next-token cross-entropy, plus the MTP head's for a
    Qwen3.5 model that has one. Returns ``(loss to minimise, {"loss": next-token CE, ...})``."""
    if isinstance(model, Qwen35Model) and model.config.mtp_num_hidden_layers:
        return qwen35_mtp_loss(model, params, rows, mtp_weight, head_rows)
    if isinstance(model, Qwen35Model):
        inputs, targets = rows[:, :-1], rows[:, 1:]
        compute = compute_params(model, params)
        _, hidden = model.train_forward(compute, inputs)
        loss = cross_entropy(output_head(model, compute)(hidden), targets)
        return loss, {"loss": loss}
    loss = next_token_loss(model, params, rows)
    return loss, {"loss": loss}


def make_train_step(
    model: BlockModel, train_config: TrainConfig,
) -> Callable[[TrainState, jax.Array, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted step ``(state, data, indices) -> (state, metrics)``.

    ``data`` is the whole int32 ``[N, T + 1]`` training set on the device and ``indices`` the
    int32 ``[B]`` rows of this batch, so only the indices travel each step. The learning rate
    is the schedule's at the state's step for the state's ``total_steps``, so one compiled
    step serves any schedule length. The incoming state is donated (its buffers are reused for
    the new one). Metrics: ``loss``, ``grad_norm`` (before clipping) and ``lr``.
    """
    tc = train_config
    optimizer = make_optimizer(tc, learning_rate=False)

    def step(
        state: TrainState, data: jax.Array, indices: jax.Array
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        rows = jnp.take(data, indices, axis=0)  # [B, T + 1]
        (_, parts), grads = jax.value_and_grad(
            functools.partial(training_loss, model, tc.mtp_weight, head_rows=tc.head_rows),
            has_aux=True
        )(state.params, rows)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        lr = tc.learning_rate(state.step, state.total_steps)
        params = optax.apply_updates(state.params, jax.tree.map(lambda u: -lr * u, updates))
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        return new, {**parts, "grad_norm": grad_norm, "lr": lr}

    return jax.jit(step, donate_argnums=0)


def make_eval_step(model: BlockModel) -> Callable[[Params, jax.Array], jax.Array]:
    """The jitted ``(params, rows) -> mean next-token loss`` over one batch of held-out rows."""
    return jax.jit(lambda params, rows: training_loss(model, 0.0, params, rows)[1]["loss"])


def build_model(config: DenseConfig | Qwen35Config, compute_dtype: str) -> BlockModel:
    """The model a config trains as: the dense family's stacked layout (one scanned layer
    program), Qwen3.5's list of mixed layers."""
    if isinstance(config, DenseConfig):
        return DenseModel(config, jnp.dtype(compute_dtype))
    return Qwen35Model(config, jnp.dtype(compute_dtype))


@functools.lru_cache(maxsize=8)
def _programs(model: BlockModel, train_config: TrainConfig) -> tuple[Any, Any]:
    # jit caches compiled code per function object: handing out the same step functions for
    # the same model and settings lets a resumed or repeated run in one process skip the
    # compile (and run the very same executable).
    return make_train_step(model, train_config), make_eval_step(model)


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """Weights a run starts from instead of a fresh init.

    Attributes:
      source: where they came from (the model card names it, and a resumed run must name the
        same).
      params: float32 params in the layout :func:`build_model`'s model trains in.
    """

    source: str
    params: Params


#: Keys of a folder's ``config.json`` that say how its weights are stored, not the model.
_STORAGE_KEYS = ("dtype", "torch_dtype")


def load_warm_start(folder: str | os.PathLike[str],
                    config: DenseConfig | Qwen35Config) -> WarmStart:
    """The weights of a Hugging Face folder as a :class:`WarmStart` for a run of ``config``.

    Raises:
      BadInputError: the folder's model differs from ``config`` (the differing keys are
        named) or its params do not have the shapes the training layout expects.
      ModelLoadError: the folder cannot be read (as :func:`~turbospark_jax.io.loading.
        load_folder` raises).
    """
    from turbospark_jax.io.loading import load_folder
    from turbospark_jax.models.registry import family_of_config

    # build_model's models train in their family's native layout, which the template checks
    loaded = load_folder(folder, dtype="float32",
                         layer_layout=family_of_config(config).native_layout)
    theirs, ours = loaded.config.to_hf_dict(), config.to_hf_dict()
    differing = sorted(k for k in set(theirs) | set(ours)
                       if k not in _STORAGE_KEYS and theirs.get(k) != ours.get(k))
    if differing:
        shown = ", ".join(f"{k} ({theirs.get(k)!r} there, {ours.get(k)!r} here)"
                          for k in differing[:4])
        raise BadInputError(
            f"cannot start from {folder}: its model differs from the one this run trains in "
            f"{shown}; start from a folder of the same preset and tokenizer")
    template = jax.eval_shape(
        lambda: build_model(config, "float32").init_params(jax.random.PRNGKey(0)))
    same = jax.tree.structure(template) == jax.tree.structure(loaded.params) and all(
        a.shape == b.shape for a, b in zip(jax.tree.leaves(template),
                                           jax.tree.leaves(loaded.params), strict=True))
    if not same:
        raise BadInputError(f"cannot start from {folder}: its params are not laid out as "
                            "this run's model trains them")
    return WarmStart(source=str(folder), params=loaded.params)


def init_state(config: DenseConfig | Qwen35Config, train_config: TrainConfig,
               warm_start: WarmStart | None = None) -> TrainState:
    """float32 params (fresh from ``train_config.seed``, or ``warm_start``'s), a zeroed
    optimizer state (the chain :func:`make_train_step` runs) and a schedule of
    ``train_config.steps``."""
    if warm_start is None:
        params = build_model(config, "float32").init_params(
            jax.random.PRNGKey(train_config.seed))
    else:
        params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), warm_start.params)
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params,
        opt_state=make_optimizer(train_config, learning_rate=False).init(params),
        total_steps=jnp.int32(train_config.steps),
    )


# -- checkpoints -------------------------------------------------------------------------------


def save_checkpoint(folder: Path, state: TrainState, meta: dict[str, Any]) -> None:
    """Write ``state`` and ``meta`` to ``folder`` atomically.

    Each file is written beside its final name and renamed into place; ``meta.json`` goes
    last, and it names the step the state file holds, so a crash mid-save leaves either the
    old pair or a state newer than its meta, which :func:`load_checkpoint` refuses.

    Args:
      folder: the checkpoint directory (created if needed).
      state: the train state.
      meta: JSON-able bookkeeping; ``step`` is added.
    """
    folder.mkdir(parents=True, exist_ok=True)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    step = int(jax.device_get(state.step))
    arrays = {jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf)) for path, leaf in leaves}
    tmp = folder / (CHECKPOINT_STATE + ".tmp")
    save_file(arrays, str(tmp), metadata={"step": str(step)})
    os.replace(tmp, folder / CHECKPOINT_STATE)
    tmp_meta = folder / (CHECKPOINT_META + ".tmp")
    tmp_meta.write_text(json.dumps({**meta, "step": step}, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp_meta, folder / CHECKPOINT_META)


def load_checkpoint(folder: Path, template: TrainState) -> tuple[TrainState, dict[str, Any]]:
    """Read a checkpoint written by :func:`save_checkpoint` into ``template``'s structure.

    Args:
      folder: the checkpoint directory.
      template: a state (or ``jax.eval_shape`` of one) with the expected tree, shapes, dtypes.

    Returns:
      ``(state, meta)``.

    Raises:
      BadInputError: files missing, a leaf missing or of the wrong shape or dtype, or the
        state and meta from different saves.
    """
    state_path, meta_path = folder / CHECKPOINT_STATE, folder / CHECKPOINT_META
    if not state_path.is_file() or not meta_path.is_file():
        raise BadInputError(f"no complete checkpoint in {folder}")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    restored = []
    with safe_open(str(state_path), framework="np") as f:
        if f.metadata().get("step") != str(meta.get("step")):
            raise BadInputError(
                f"checkpoint {folder}: state is from step {f.metadata().get('step')} but "
                f"meta.json from step {meta.get('step')} (interrupted save?)"
            )
        names = set(f.keys())
        for path, leaf in leaves:
            name = jax.tree_util.keystr(path)
            if name not in names:
                raise BadInputError(f"checkpoint {folder} has no leaf {name}")
            array = f.get_tensor(name)
            if array.shape != tuple(leaf.shape) or array.dtype != np.dtype(leaf.dtype):
                raise BadInputError(
                    f"checkpoint leaf {name} is {array.dtype}{list(array.shape)}, expected "
                    f"{np.dtype(leaf.dtype)}{list(leaf.shape)}"
                )
            restored.append(jnp.asarray(array))
    return jax.tree_util.tree_unflatten(treedef, restored), meta


# -- the training loop -------------------------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
    """What :func:`train_model` returns.

    Attributes:
      config: the model config.
      params: the float32 params at the end of the run.
      steps_done: optimizer steps taken in total (across resumes).
      scheduled_steps: the schedule's length (``TrainConfig.steps``, or what a run of
        ``TrainConfig.seconds`` set).
      finished: whether the schedule ran to its last step.
      tokens_seen: training tokens consumed in total.
      eval_loss: the last held-out loss (mean nats per token), or ``None`` if never measured.
      history: log records (``kind`` "train" or "eval") across resumes.
      timings: seconds and rates of this invocation (``compile_s``, ``train_s``,
        ``tokens_per_s`` ...).
      init_source: the :class:`WarmStart` the run started from, or ``None`` (a fresh init);
        the steps and tokens above are this run's alone.
    """

    config: DenseConfig | Qwen35Config
    params: Params
    steps_done: int
    finished: bool
    tokens_seen: int
    eval_loss: float | None
    history: list[dict[str, Any]]
    timings: dict[str, float]
    scheduled_steps: int = 0
    init_source: str | None = None


def evaluate(
    eval_step: Callable[[Params, jax.Array], jax.Array], params: Params, rows: np.ndarray,
    batch_size: int,
) -> float:
    """Mean held-out loss over whole batches of ``rows`` (the partial tail is dropped).

    Raises:
      BadInputError: ``rows`` is empty.
    """
    if len(rows) == 0:
        raise BadInputError("no held-out rows to evaluate on")
    batch = min(batch_size, len(rows))
    losses = [
        eval_step(params, jnp.asarray(rows[i : i + batch]))
        for i in range(0, len(rows) - batch + 1, batch)
    ]
    return float(np.mean(jax.device_get(losses)))


def train_model(
    config: DenseConfig | Qwen35Config,
    train_config: TrainConfig,
    train_rows: np.ndarray,
    heldout_rows: np.ndarray,
    *,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    deadline: float | None = None,
    stop_at_step: int | None = None,
    progress: bool = True,
    name: str = "model",
    warm_start: WarmStart | None = None,
) -> TrainResult:
    """Train (or resume training) one model.

    Args:
      config: the model config.
      train_config: the run's settings.
      train_rows: int32 ``[N, seq_len + 1]`` packed training rows.
      heldout_rows: int32 ``[M, seq_len + 1]`` packed held-out rows.
      checkpoint_dir: where checkpoints go; ``None`` for none.
      resume: continue from the checkpoint in ``checkpoint_dir`` when there is one.
      deadline: a ``time.monotonic()`` value; the run stops (and checkpoints) before the
        first step that would start after it.
      stop_at_step: stop (and checkpoint) once this many steps are done, schedule unchanged.
      progress: show a tqdm bar.
      name: label for the bar and log lines.
      warm_start: start from these weights instead of a fresh init (a resume continues from
        its checkpoint, which must come from a run with the same warm start).

    Returns:
      The :class:`TrainResult`.

    Raises:
      BadInputError: rows of the wrong length, too few rows for a batch, or a checkpoint from
        a different model, settings or data.
    """
    tc = train_config
    for what, rows in (("training", train_rows), ("held-out", heldout_rows)):
        if rows.ndim != 2 or rows.shape[1] != tc.seq_len + 1:
            raise BadInputError(
                f"{what} rows must be [N, {tc.seq_len + 1}], got {list(rows.shape)}"
            )
    if tc.seconds is not None and tc.warmup_steps < TRIAL_STEPS + 1:
        raise BadInputError(
            f"a run of train_config.seconds times its first {TRIAL_STEPS} steps inside the "
            f"warmup; warmup_steps must be at least {TRIAL_STEPS + 1}, got {tc.warmup_steps}")
    model = build_model(config, tc.compute_dtype)
    order = DataOrder(len(train_rows), tc.batch_size, tc.seed)
    if tc.eval_rows:
        heldout_rows = heldout_rows[: tc.eval_rows]
    identity = {
        "model_config": config.to_hf_dict(),
        "train_config": tc.math_dict(),
        "data": fingerprint(train_rows),
    }
    if warm_start is not None:
        identity["init"] = warm_start.source

    t0 = time.monotonic()
    history: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    resumed = checkpoint_dir is not None and resume and (checkpoint_dir / CHECKPOINT_META).is_file()
    if resumed:
        assert checkpoint_dir is not None
        template = jax.eval_shape(lambda: init_state(config, tc))
        state, meta = load_checkpoint(checkpoint_dir, template)
        for key in (*identity, "init"):
            if meta.get(key) != identity.get(key):
                raise BadInputError(
                    f"checkpoint {checkpoint_dir} was made with a different {key}; resume "
                    "with the settings and data it was made with, or start a new run"
                )
        history = list(meta.get("history", []))
    else:
        state = init_state(config, tc, warm_start)
    start = int(jax.device_get(state.step))
    total = int(jax.device_get(state.total_steps))
    # A run of tc.seconds sets its schedule once, from its own step time; a resumed one keeps it.
    to_set = tc.seconds is not None and not (resumed and meta.get("schedule_set"))
    n_params = count_params(state.params)

    train_step, eval_step = _programs(model, tc)
    data = jax.device_put(train_rows)
    tokens_per_step = tc.batch_size * tc.seq_len
    flops_per_token = training_flops_per_token(config, state.params, tc.seq_len)
    device_kind = getattr(jax.devices()[0], "device_kind", "?")
    last_eval = next((h["loss"] for h in reversed(history) if h["kind"] == "eval"), None)

    def meta_now(step: int) -> dict[str, Any]:
        return {
            **identity,
            "samples_seen": step * tc.batch_size,
            "tokens_seen": step * tokens_per_step,
            "epoch": step / order.batches_per_epoch,
            "total_steps": total,
            "schedule_set": tc.seconds is not None and not to_set,
            "history": history,
        }

    def checkpoint() -> None:
        if checkpoint_dir is not None:
            save_checkpoint(checkpoint_dir, state, meta_now(int(jax.device_get(state.step))))

    def run_eval(step: int) -> float:
        loss = evaluate(eval_step, state.params, heldout_rows, tc.batch_size)
        history.append({"kind": "eval", "step": step, "loss": loss, "ppl": math.exp(loss)})
        tqdm.write(f"[{name}] step {step}: held-out loss {loss:.4f} ppl {math.exp(loss):.2f}")
        return loss

    def last_step() -> int:
        return total if stop_at_step is None else min(total, stop_at_step)

    tqdm.write(
        f"[{name}] {n_params / 1e6:.2f}M params, {len(train_rows)} rows x {tc.seq_len} tokens "
        f"({order.batches_per_epoch} steps/epoch), steps {start}->"
        + (f"at most {total}, for about {tc.seconds:.0f} s" if to_set else f"{total}")
        + (" (resumed)" if resumed else "")
        + (f", from the weights of {warm_start.source}" if warm_start is not None else "")
    )
    end = last_step()
    bar = tqdm(total=total, initial=start, desc=name, unit="step", disable=not progress,
               mininterval=1.0, dynamic_ncols=True)
    compile_s = 0.0
    window_t, window_steps = time.monotonic(), 0
    t_loop = time.monotonic()
    step = start
    while step < end:
        if deadline is not None and time.monotonic() >= deadline:
            tqdm.write(f"[{name}] time budget reached at step {step}; saving")
            break
        state, metrics = train_step(state, data, jnp.asarray(order.indices(step)))
        step += 1
        bar.update(1)
        if step == start + 1:
            # The first step carries the compile: time it apart so throughput is honest.
            jax.block_until_ready(metrics)
            compile_s = time.monotonic() - t_loop
            window_t, window_steps = time.monotonic(), 0
            trial_t = time.monotonic()
        else:
            window_steps += 1
        if to_set and step == start + 1 + TRIAL_STEPS:
            jax.block_until_ready(metrics)
            per_step = (time.monotonic() - trial_t) / TRIAL_STEPS
            left = t0 + float(tc.seconds) - time.monotonic()  # type: ignore[arg-type]
            # 8% kept back for the evaluations, the last checkpoint and the export.
            total = max(step + 1, min(tc.steps, step + int(0.92 * left / per_step)))
            state = state.replace(total_steps=jnp.int32(total))
            to_set = False
            end = last_step()
            bar.total = total
            tqdm.write(f"[{name}] {TRIAL_STEPS} steps timed at {per_step * 1e3:.1f} ms: the "
                       f"schedule runs {total} steps in the {tc.seconds:.0f} s budget")
        if step % tc.log_every == 0 or step == end:
            m = jax.device_get(metrics)
            now = time.monotonic()
            rate = window_steps * tokens_per_step / max(now - window_t, 1e-9)
            window_t, window_steps = now, 0
            record = {"kind": "train", "step": step, "loss": float(m["loss"]),
                      "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
                      "tokens_per_s": rate}
            if "mtp_loss" in m:
                record["mtp_loss"] = float(m["mtp_loss"])
            utilisation = mfu(rate, flops_per_token, device_kind)
            if utilisation is not None:
                record["mfu"] = utilisation
            history.append(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{rate:,.0f}",
                            lr=f"{record['lr']:.2e}")
        paused = False
        if tc.eval_every and step % tc.eval_every == 0 and step != end:
            last_eval = run_eval(step)
            paused = True
        if tc.checkpoint_every and step % tc.checkpoint_every == 0 and step != end:
            checkpoint()
            paused = True
        if paused:  # keep evaluation and checkpoint time out of the throughput window
            jax.block_until_ready(state)
            window_t, window_steps = time.monotonic(), 0
    bar.close()
    jax.block_until_ready(state)
    train_s = time.monotonic() - t_loop
    if step > start:
        last_eval = run_eval(step)
    checkpoint()
    steps_run = step - start
    timed_steps = max(steps_run - 1, 0)
    timings = {
        "compile_s": compile_s,
        "train_s": train_s,
        "total_s": time.monotonic() - t0,
        "steps_run": float(steps_run),
        "tokens_per_s": timed_steps * tokens_per_step / max(train_s - compile_s, 1e-9),
        "flops_per_token": flops_per_token,
    }
    utilisation = mfu(timings["tokens_per_s"], flops_per_token, device_kind)
    if utilisation is not None and timed_steps:
        timings["mfu"] = utilisation
    tqdm.write(
        f"[{name}] {steps_run} steps in {train_s:.1f}s (first step incl. compile "
        f"{compile_s:.1f}s), {timings['tokens_per_s']:,.0f} tokens/s"
        + (f", MFU {timings['mfu']:.1%} of {device_kind}" if "mfu" in timings else "")
    )
    return TrainResult(
        config=config,
        params=state.params,
        steps_done=step,
        scheduled_steps=total,
        finished=step >= total,
        tokens_seen=step * tokens_per_step,
        eval_loss=last_eval,
        history=history,
        timings=timings,
        init_source=None if warm_start is None else warm_start.source,
    )
