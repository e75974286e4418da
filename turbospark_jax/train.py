"""Train small real models on the Python standard library: tokenizer, target and draft.

This is the recipe behind the embedded default models. Everything runs from one command on
one GPU in a few minutes (``recipe``), and every piece is usable alone (``tokenizer``,
``train``, ``pack``, ``unpack``)::

    python -m turbospark_jax.train recipe --out runs/stdlib --max-seconds 480 --pack-out parts/
    python -m turbospark_jax.train unpack parts/ --to models/

The pieces, in the order the recipe runs them:

**Corpus.** The ``*.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), in sorted order. The test suites are *kept*: they are
about two thirds of the code there, and with so little data every file counts. Left out are
third-party code (``site-packages``, ``dist-packages``), bytecode caches, the build helper
(``config-*``), ``pydoc_data`` (generated prose, not code), ``lib2to3``'s Python 2 fixtures,
and any file that is not valid UTF-8 (a handful of test files in other encodings, on purpose).
A file is held out for evaluation when the SHA-256 of its relative path falls below
``heldout_fraction``: the split is by file, needs no state, and does not move when other files
come or go. How much there is depends on the interpreter: a full CPython 3.11 ``Lib/`` gives
about 8.2M training tokens, a Debian/Ubuntu system Python (tests packaged apart) about 2.5M.
``--corpus-root`` reads another directory, such as a full ``Lib/`` carried to a machine whose
Python lacks the tests.

**Tokenizer.** Byte-level BPE (``tokenizers``), trained on the training split only; any text
round-trips because every byte is in the base alphabet and nothing is normalised. Ids 0, 1, 2
are ``<|bos|>``, ``<|eos|>``, ``<|pad|>``; ``encode`` prepends ``<|bos|>`` like the training
documents start. The chat template concatenates message contents after ``<|bos|>``: these are
base code models, so a chat request becomes a plain completion.

**Data.** Each document becomes ``<|bos|> text <|eos|>``; documents are concatenated in file
order and cut into rows of ``seq_len + 1`` tokens that overlap by one (inputs ``row[:-1]``,
targets ``row[1:]``), so no token is wasted and no padding is needed. Attention runs across
document boundaries, as in GPT-2 style packing. Each epoch visits the rows in a permutation
drawn from ``(seed, epoch)``; batch ``s`` is a pure function of ``s``, so the data position in
a checkpoint is just the step.

**Training.** Length is given in epochs (the data is small, so passes over it, not tokens,
decide between under- and overfitting); the resolved step count is recorded. AdamW (``b2``
0.95) with linear warmup and cosine decay to ``min_lr_ratio`` of the peak, global-norm
clipping, float32 master weights cast to bfloat16 inside the loss, and a float32 softmax
cross-entropy. Weight decay applies to every matrix, the tied embedding
included (it is also the output head, so it is decayed like any projection), and not to the
RMSNorm scales: decaying those pulls them toward zero, which fights the normalisation.

**Checkpoints.** ``state.safetensors`` (params, optimizer state, step, keyed by tree path)
plus ``meta.json`` (step, data position, configs, data fingerprint, history), written
atomically; never pickle. Resuming runs the same compiled step on the same batches, so on the
CPU a resumed run is bitwise equal to an uninterrupted one.

**Output.** A Hugging Face folder (``model_type`` ``qwen3``, tied embeddings, safetensors
shards of at most 15 MiB, the tokenizer) that our loader and ``transformers`` both load, and
a model card generated from the run.

**Packing.** ``pack`` writes folders as a gzipped tar split into parts of at most 15 MiB plus
a manifest with the archive's SHA-256; ``unpack`` checks and extracts them. By hand:
``cat NAME.tar.gz.part-* | tar xz -C DEST``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import hashlib
import io
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import tarfile
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
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from turbospark_jax import loading
from turbospark_jax.errors import BadInputError
from turbospark_jax.models.dense import DenseModel, Params, init_params
from turbospark_jax.models.dense_config import DenseConfig
from turbospark_jax.tokenizer import Tokenizer

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
#: In id order: the trainer puts special tokens first, so these are ids 0, 1, 2.
SPECIAL_TOKENS = (BOS, EOS, PAD)

#: Base models: a "chat" is the concatenated message texts, completed as code.
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"

#: Path components that exclude a file from the corpus (see the module docstring for why).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "pydoc_data"})
#: Relative path prefixes that exclude a file: Python 2 fixtures that are not valid Python 3.
EXCLUDED_PREFIXES = ("lib2to3/tests/data/",)

#: The largest file :func:`pack_folders` writes by default, below the 16 MiB a GPU run returns.
PART_BYTES = 15 * 2**20
#: Shard limit for the saved weights (kept below :data:`PART_BYTES` for the same reason).
SHARD_BYTES = 15 * 2**20

#: Prompts the model card completes greedily.
CARD_PROMPTS = ("def ", "class ", "import ")

CHECKPOINT_STATE = "state.safetensors"
CHECKPOINT_META = "meta.json"


# -- corpus ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Document:
    """One corpus file: its path relative to the corpus root (POSIX form) and its text."""

    path: str
    text: str


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The training and held-out documents and where they came from.

    Attributes:
      root: the directory the files were read from.
      train: training documents, sorted by path.
      heldout: held-out documents, sorted by path.
      skipped: relative paths left out because they are not valid UTF-8.
      heldout_fraction: the split parameter (see :func:`is_heldout`).
      max_files: the subset size asked for, or ``None`` for every file.
      name: what the files are, for people (the model card).
    """

    root: str
    train: tuple[Document, ...]
    heldout: tuple[Document, ...]
    skipped: tuple[str, ...]
    heldout_fraction: float
    max_files: int | None = None
    name: str = ""

    def describe(self) -> dict[str, Any]:
        """Counts and provenance for logs and the model card."""
        return {
            "name": self.name,
            "root": self.root,
            "python": platform.python_version(),
            "train_files": len(self.train),
            "heldout_files": len(self.heldout),
            "train_chars": sum(len(d.text) for d in self.train),
            "heldout_chars": sum(len(d.text) for d in self.heldout),
            "skipped_not_utf8": len(self.skipped),
            "heldout_fraction": self.heldout_fraction,
            "max_files": self.max_files,
        }


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path) -> list[str]:
    """Relative POSIX paths of the corpus ``*.py`` files under ``root``, sorted.

    Args:
      root: the directory to walk.

    Returns:
      The paths, excluding :data:`EXCLUDED_DIRS`, ``config-*`` and :data:`EXCLUDED_PREFIXES`.

    Raises:
      BadInputError: ``root`` is not a directory.
    """
    if not root.is_dir():
        raise BadInputError(f"corpus root {root} is not a directory")
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so excluded trees (site-packages can be huge) are never walked.
        dirnames[:] = [
            d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-")
        ]
        for name in filenames:
            if name.endswith(".py"):
                rel = Path(dirpath, name).relative_to(root).as_posix()
                if not rel.startswith(EXCLUDED_PREFIXES):
                    found.append(rel)
    return sorted(found)


def is_heldout(rel_path: str, fraction: float) -> bool:
    """Whether a file belongs to the held-out split.

    The first 8 bytes of ``sha256(rel_path)`` read as a number in ``[0, 1)``; the file is held
    out when that number is below ``fraction``. Stateless and stable: adding or removing other
    files never moves a file between splits.
    """
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def load_corpus(
    root: Path | None = None,
    heldout_fraction: float = 0.03,
    max_files: int | None = None,
    name: str | None = None,
) -> Corpus:
    """Read and split the corpus.

    Args:
      root: the directory to read; the standard library by default.
      heldout_fraction: the share of files (by path hash) held out for evaluation.
      max_files: keep only this many files, evenly spaced over the sorted list so the subset
        spans the whole library (for quick runs and tests); all files when ``None``.
      name: what the files are, for the model card; by default the running interpreter's
        standard library, or the root's path for another root.

    Returns:
      The :class:`Corpus`.

    Raises:
      BadInputError: ``root`` is not a directory, ``heldout_fraction`` is outside ``(0, 1)``,
        or either split comes out empty.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise BadInputError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if name is None:
        name = (
            f"the standard library of the running interpreter (CPython "
            f"{platform.python_version()})" if root is None else f"the directory {root}"
        )
    root = stdlib_root() if root is None else root
    paths = list_corpus_files(root)
    if max_files is not None and len(paths) > max_files:
        stride = len(paths) / max_files
        paths = [paths[int(i * stride)] for i in range(max_files)]
    train: list[Document] = []
    heldout: list[Document] = []
    skipped: list[str] = []
    for rel in paths:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        (heldout if is_heldout(rel, heldout_fraction) else train).append(Document(rel, text))
    if not train or not heldout:
        raise BadInputError(
            f"the split of {len(paths)} files under {root} left "
            f"{len(train)} training and {len(heldout)} held-out files; both must be non-empty"
        )
    return Corpus(str(root), tuple(train), tuple(heldout), tuple(skipped), heldout_fraction,
                  max_files, name)


# -- tokenizer ---------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int = 8192) -> Tokenizer:
    """Train a byte-level BPE tokenizer with the recipe's special tokens.

    Args:
      texts: the training texts.
      vocab_size: the target vocabulary size, special tokens included (a small corpus may
        yield fewer merges, hence a smaller vocabulary).

    Returns:
      The tokenizer; ``encode`` prepends ``<|bos|>``.

    Raises:
      BadInputError: ``vocab_size`` is too small to hold the 256 byte tokens and specials.
    """
    base = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size <= base:
        raise BadInputError(f"vocab_size must exceed {base} (bytes plus specials)")
    backend = BackendTokenizer(models.BPE())
    # No normaliser and no prefix space: the bytes of the text are the text, so decode(encode)
    # is the identity. The GPT-2 split regex keeps runs of indentation together.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer, length=len(texts))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, backend.token_to_id(BOS))],
    )
    return Tokenizer(
        backend,
        special_tokens={"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
        chat_template=CHAT_TEMPLATE,
        # add_bos_token makes transformers rebuild the same BOS post-processor; no clean-up so
        # decoding keeps spaces before punctuation, which code is full of.
        config={
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 2048,
        },
    )


def encode_documents(tokenizer: Tokenizer, docs: Sequence[Document]) -> np.ndarray:
    """Tokenize documents into one stream: ``<|bos|> doc <|eos|>`` for each, in order.

    Args:
      tokenizer: the tokenizer (its ``<|bos|>`` / ``<|eos|>`` ids frame each document).
      docs: the documents.

    Returns:
      int32 ``[N]`` token ids.
    """
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    backend = tokenizer.backend
    texts = [d.text for d in docs]
    # encode_batch_fast skips offset tracking, which we never read (about twice as fast).
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    pieces: list[np.ndarray] = []
    for enc in encode(texts, add_special_tokens=False):
        pieces.append(np.asarray([bos, *enc.ids, eos], dtype=np.int32))
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def pack_rows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut a token stream into rows of ``seq_len + 1`` tokens overlapping by one.

    Row ``i`` is ``stream[i * seq_len : i * seq_len + seq_len + 1]``: its first ``seq_len``
    tokens are inputs and its last ``seq_len`` the targets. The tail that does not fill a row
    is dropped.

    Args:
      stream: int32 ``[N]``.
      seq_len: tokens per training sequence.

    Returns:
      int32 ``[(N - 1) // seq_len, seq_len + 1]``.
    """
    rows = max((len(stream) - 1) // seq_len, 0)
    index = np.arange(rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return np.ascontiguousarray(stream[index].astype(np.int32))


class DataOrder:
    """Which rows batch ``step`` holds: epoch ``e`` visits all rows in a permutation seeded by
    ``(seed, e)``; the tail of an epoch that does not fill a batch is skipped.

    A pure function of ``step``, so the checkpoint's step is the whole data position.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int) -> None:
        """Set up the order.

        Raises:
          BadInputError: fewer rows than one batch.
        """
        if num_rows < batch_size:
            raise BadInputError(
                f"{num_rows} packed rows cannot fill a batch of {batch_size}; use a smaller "
                "batch, a shorter seq_len or more data"
            )
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.seed = seed
        self.batches_per_epoch = num_rows // batch_size
        self._cached: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        # Consecutive steps share an epoch: keep the last permutation rather than redraw it.
        if self._cached is None or self._cached[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            self._cached = (epoch, perm)
        return self._cached[1]

    def epoch_of(self, step: int) -> int:
        """The epoch that batch ``step`` belongs to."""
        return step // self.batches_per_epoch

    def indices(self, step: int) -> np.ndarray:
        """int32 ``[batch_size]`` row indices of batch ``step``."""
        epoch, j = divmod(step, self.batches_per_epoch)
        perm = self._permutation(epoch)
        return perm[j * self.batch_size : (j + 1) * self.batch_size].astype(np.int32)


def fingerprint(*arrays: np.ndarray) -> str:
    """SHA-256 over arrays (shape, dtype and bytes): names the exact data a run saw."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(repr((a.shape, a.dtype.str)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# -- models --------------------------------------------------------------------------------

#: Model shapes for the recipe (``config.json`` keys). Parameter counts at vocab 8192, with the
#: tied embedding: target 23.1M, draft 3.2M (printed by every run).
PRESETS: dict[str, dict[str, int]] = {
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
) -> DenseConfig:
    """A qwen3 config for one of :data:`PRESETS` (or explicit shape keys) and a tokenizer.

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
        shape = PRESETS[preset]
    else:
        shape = dict(preset)
    return DenseConfig.from_hf_dict(
        {
            "model_type": "qwen3",
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
    )


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

    @property
    def effective_warmup(self) -> int:
        """``warmup_steps``, shortened to leave at least one decay step in short runs."""
        return min(self.warmup_steps, max(self.steps - 1, 0))

    def schedule(self) -> optax.Schedule:
        """Linear warmup from 0 to ``peak_lr``, then cosine decay to ``min_lr_ratio * peak``."""
        warmup = self.effective_warmup
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.peak_lr,
            warmup_steps=warmup,
            decay_steps=max(self.steps, warmup + 1),
            end_value=self.peak_lr * self.min_lr_ratio,
        )

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
      params: float32 master weights (layout in :mod:`turbospark_jax.models.dense`).
      opt_state: the optax state (AdamW moments in float32, counters).
    """

    step: jax.Array
    params: Params
    opt_state: Any


def _decay_mask(params: Params) -> Params:
    # Norm scales are stacked per layer ([L, D]), so ndim cannot tell them from matrices: the
    # name can.
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not str(path[-1].key).endswith("norm"), params
    )


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the warmup-cosine schedule (decay masked off
    norms)."""
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


def make_train_step(
    model: DenseModel, optimizer: optax.GradientTransformation
) -> Callable[[TrainState, jax.Array, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted step ``(state, data, indices) -> (state, metrics)``.

    ``data`` is the whole int32 ``[N, T + 1]`` training set on the device and ``indices`` the
    int32 ``[B]`` rows of this batch, so only the indices travel each step. The incoming state
    is donated (its buffers are reused for the new one). Metrics: ``loss`` and ``grad_norm``
    (before clipping).
    """

    def step(
        state: TrainState, data: jax.Array, indices: jax.Array
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        rows = jnp.take(data, indices, axis=0)  # [B, T + 1]
        loss, grads = jax.value_and_grad(functools.partial(next_token_loss, model))(
            state.params, rows
        )
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        return new, {"loss": loss, "grad_norm": grad_norm}

    return jax.jit(step, donate_argnums=0)


def make_eval_step(model: DenseModel) -> Callable[[Params, jax.Array], jax.Array]:
    """The jitted ``(params, rows) -> mean loss`` over one batch of held-out rows."""
    return jax.jit(functools.partial(next_token_loss, model))


@functools.lru_cache(maxsize=8)
def _programs(model: DenseModel, train_config: TrainConfig) -> tuple[Any, Any]:
    # jit caches compiled code per function object: handing out the same step functions for
    # the same model and settings lets a resumed or repeated run in one process skip the
    # compile (and run the very same executable).
    return make_train_step(model, make_optimizer(train_config)), make_eval_step(model)


def init_state(
    config: DenseConfig, train_config: TrainConfig, optimizer: optax.GradientTransformation
) -> TrainState:
    """Fresh float32 params from ``train_config.seed`` and a zeroed optimizer state."""
    params = init_params(config, jax.random.PRNGKey(train_config.seed), jnp.float32)
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
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
      finished: whether the schedule ran to its last step.
      tokens_seen: training tokens consumed in total.
      eval_loss: the last held-out loss (mean nats per token), or ``None`` if never measured.
      history: log records (``kind`` "train" or "eval") across resumes.
      timings: seconds and rates of this invocation (``compile_s``, ``train_s``,
        ``tokens_per_s`` ...).
    """

    config: DenseConfig
    params: Params
    steps_done: int
    finished: bool
    tokens_seen: int
    eval_loss: float | None
    history: list[dict[str, Any]]
    timings: dict[str, float]


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
    config: DenseConfig,
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
    model = DenseModel(config, jnp.dtype(tc.compute_dtype))
    optimizer = make_optimizer(tc)
    order = DataOrder(len(train_rows), tc.batch_size, tc.seed)
    if tc.eval_rows:
        heldout_rows = heldout_rows[: tc.eval_rows]
    identity = {
        "model_config": config.to_hf_dict(),
        "train_config": tc.math_dict(),
        "data": fingerprint(train_rows),
    }

    t0 = time.monotonic()
    history: list[dict[str, Any]] = []
    resumed = checkpoint_dir is not None and resume and (checkpoint_dir / CHECKPOINT_META).is_file()
    if resumed:
        assert checkpoint_dir is not None
        template = jax.eval_shape(lambda: init_state(config, tc, optimizer))
        state, meta = load_checkpoint(checkpoint_dir, template)
        for key, value in identity.items():
            if meta.get(key) != value:
                raise BadInputError(
                    f"checkpoint {checkpoint_dir} was made with a different {key}; resume "
                    "with the settings and data it was made with, or start a new run"
                )
        history = list(meta.get("history", []))
    else:
        state = init_state(config, tc, optimizer)
    start = int(jax.device_get(state.step))
    n_params = count_params(state.params)

    train_step, eval_step = _programs(model, tc)
    data = jax.device_put(train_rows)
    tokens_per_step = tc.batch_size * tc.seq_len
    schedule = tc.schedule()
    last_eval = next((h["loss"] for h in reversed(history) if h["kind"] == "eval"), None)

    def meta_now(step: int) -> dict[str, Any]:
        return {
            **identity,
            "samples_seen": step * tc.batch_size,
            "tokens_seen": step * tokens_per_step,
            "epoch": step / order.batches_per_epoch,
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

    tqdm.write(
        f"[{name}] {n_params / 1e6:.2f}M params, {len(train_rows)} rows x {tc.seq_len} tokens "
        f"({order.batches_per_epoch} steps/epoch), steps {start}->{tc.steps}"
        + (" (resumed)" if resumed else "")
    )
    end = tc.steps if stop_at_step is None else min(tc.steps, stop_at_step)
    bar = tqdm(total=tc.steps, initial=start, desc=name, unit="step", disable=not progress,
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
        else:
            window_steps += 1
        if step % tc.log_every == 0 or step == end:
            m = jax.device_get(metrics)
            now = time.monotonic()
            rate = window_steps * tokens_per_step / max(now - window_t, 1e-9)
            window_t, window_steps = now, 0
            record = {"kind": "train", "step": step, "loss": float(m["loss"]),
                      "grad_norm": float(m["grad_norm"]), "lr": float(schedule(step - 1)),
                      "tokens_per_s": rate}
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
    }
    tqdm.write(
        f"[{name}] {steps_run} steps in {train_s:.1f}s (first step incl. compile "
        f"{compile_s:.1f}s), {timings['tokens_per_s']:,.0f} tokens/s"
    )
    return TrainResult(
        config=config,
        params=state.params,
        steps_done=step,
        finished=step >= tc.steps,
        tokens_seen=step * tokens_per_step,
        eval_loss=last_eval,
        history=history,
        timings=timings,
    )


# -- generation for the model card -------------------------------------------------------------


def greedy_complete(
    config: DenseConfig,
    params: Params,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int = 48,
    dtype: Any = jnp.float32,
) -> list[str]:
    """Greedy completions by re-running the plain forward over a fixed-width window.

    Slow but simple and independent of the runtime's cached paths, which makes it a fair
    witness in a model card. Stops at ``<|eos|>``.

    The prompt's last token is healed: it is dropped, and the first generated token is the
    model's greedy pick among the tokens whose text starts with the dropped token's text. A
    prompt such as ``"def "`` otherwise ends on a lone space token, a boundary training text
    almost never has (the space belongs to the next word's token), and the model's
    continuation of it says little about the model.

    Args:
      config: the model config.
      params: the params (cast to ``dtype``).
      tokenizer: encodes prompts (with ``<|bos|>``) and decodes completions.
      prompts: the prompts.
      max_new_tokens: the most tokens generated per prompt (the healed token included).
      dtype: the compute dtype.

    Returns:
      Prompt plus completion text, one per prompt.
    """
    model = DenseModel(config, jnp.dtype(dtype))
    cast = jax.tree.map(lambda p: jnp.asarray(p, model.dtype), params)
    encoded = [tokenizer.encode(p) for p in prompts]
    width = max(len(e) for e in encoded) + max_new_tokens
    # One compiled program for every step: the window is fixed and padded with <|pad|>; causal
    # attention means the padding after position `last` never affects its logits.
    forward = jax.jit(lambda p, t: model.forward(p, t))
    pad = tokenizer.pad_token_id or 0
    special = set(tokenizer.all_special_ids)
    # Ids past the tokenizer's vocabulary (a padded embedding) are never allowed to heal.
    texts = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    texts += [""] * (config.vocab_size - len(texts))
    outputs = []
    for ids in encoded:
        ids = list(ids)
        allowed: np.ndarray | None = None
        if len(ids) > 1 and ids[-1] not in special:
            tail = texts[ids.pop()]
            allowed = np.array(
                [bool(t) and t.startswith(tail) and i not in special for i, t in enumerate(texts)]
            )
        for _ in range(max_new_tokens):
            window = np.full((1, width), pad, np.int32)
            window[0, : len(ids)] = ids
            row = np.asarray(forward(cast, jnp.asarray(window))[0, len(ids) - 1], np.float32)
            if allowed is not None:
                row = np.where(allowed, row, -np.inf)
                allowed = None
            token = int(np.argmax(row))
            if token == tokenizer.eos_token_id:
                break
            ids.append(token)
        outputs.append(tokenizer.decode(ids, skip_special_tokens=True))
    return outputs


# -- export ------------------------------------------------------------------------------------


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran this process, as a shell line (module form)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", "-m", "turbospark_jax.train", *args])


def model_card(
    *,
    name: str,
    result: TrainResult,
    train_config: TrainConfig,
    corpus: dict[str, Any],
    tokens: dict[str, int],
    samples: Sequence[str],
    command: str,
    save_dtype: str,
    role: str,
) -> str:
    """The ``README.md`` of an exported model, filled in from the run."""
    c = result.config
    tc = train_config
    n_params = count_params(result.params)
    evals = [h for h in result.history if h["kind"] == "eval"]
    final = f"{result.eval_loss:.4f}" if result.eval_loss is not None else "n/a"
    ppl = f"{math.exp(result.eval_loss):.2f}" if result.eval_loss is not None else "n/a"
    epochs = result.tokens_seen / max(tokens["train"], 1)
    rates = [h["tokens_per_s"] for h in result.history if h["kind"] == "train"
             and h.get("tokens_per_s")]
    device = jax.devices()[0]
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [code, python, turbospark-jax, from-scratch]",
        "---",
        "",
        f"# {name}",
        "",
        f"A {n_params / 1e6:.1f}M-parameter Qwen3-architecture base model of Python code, "
        f"trained from scratch by `turbospark_jax.train` on the Python sources of "
        f"{corpus['name']}. {role}",
        "",
        "It is a small demonstration model: it completes Python in the style of the standard "
        "library, often plausibly and often wrongly, and it has never seen instructions or "
        "chat. Its chat template only concatenates message texts, so a chat request is a "
        "plain completion.",
        "",
        "## Model",
        "",
        "| | |",
        "| --- | --- |",
        "| architecture | `qwen3` (`Qwen3ForCausalLM`), tied input/output embedding |",
        f"| parameters | {n_params:,} |",
        f"| layers / hidden / intermediate | {c.num_hidden_layers} / {c.hidden_size} / "
        f"{c.intermediate_size} |",
        f"| heads / kv heads / head dim | {c.num_attention_heads} / {c.num_key_value_heads} / "
        f"{c.head_dim} |",
        f"| vocabulary | {c.vocab_size} (byte-level BPE; `<|bos|>` {c.bos_token_id}, "
        f"`<|eos|>` {c.eos_token_id}, `<|pad|>` {c.pad_token_id}) |",
        f"| trained context | {tc.seq_len} tokens (config advertises "
        f"{c.max_position_embeddings}) |",
        f"| weights | {save_dtype} safetensors |",
        "",
        "## Data",
        "",
        f"The `*.py` files of {corpus['name']}, read from `{corpus['root']}` (test suites "
        "included where present), except "
        "third-party packages (`site-packages`), `pydoc_data`, lib2to3's Python 2 fixtures "
        f"and {corpus['skipped_not_utf8']} files that are not UTF-8"
        + (f"; a subset of {corpus['max_files']} files, evenly spaced in path order"
           if corpus.get("max_files") else "")
        + ". Files are split by the SHA-256 of their relative path: "
        f"{corpus['heldout_fraction']:.0%} held out.",
        "",
        "| split | files | characters | tokens |",
        "| --- | --- | --- | --- |",
        f"| train | {corpus['train_files']} | {corpus['train_chars']:,} | {tokens['train']:,} |",
        f"| held-out | {corpus['heldout_files']} | {corpus['heldout_chars']:,} | "
        f"{tokens['heldout']:,} |",
        "",
        "Each file is one document, `<|bos|> text <|eos|>`, packed back to back into rows of "
        f"{tc.seq_len} tokens.",
        "",
        "## Training",
        "",
        "| | |",
        "| --- | --- |",
        f"| steps | {result.steps_done} of {tc.steps}"
        + ("" if result.finished else " (stopped early by the time budget)") + " |",
        f"| batch | {tc.batch_size} x {tc.seq_len} = {tc.batch_size * tc.seq_len:,} tokens |",
        f"| tokens seen | {result.tokens_seen:,} ({epochs:.1f} epochs) |",
        f"| optimizer | AdamW b1 {tc.b1}, b2 {tc.b2}, eps {tc.eps}, weight decay "
        f"{tc.weight_decay} (not on norms), clip {tc.clip_norm} |",
        f"| schedule | warmup {tc.effective_warmup} steps to {tc.peak_lr}, cosine to "
        f"{tc.peak_lr * tc.min_lr_ratio:.2g} |",
        f"| precision | float32 master weights, {tc.compute_dtype} compute, float32 loss |",
        f"| seed | {tc.seed} |",
        f"| device | {device.platform} ({getattr(device, 'device_kind', '?')}), jax "
        f"{jax.__version__} |",
        f"| throughput | {np.median(rates) if rates else 0:,.0f} tokens/s (median) |",
        "",
        "## Results",
        "",
        f"Held-out loss **{final}** nats/token, perplexity **{ppl}**.",
        "",
        "| step | held-out loss | perplexity |",
        "| --- | --- | --- |",
        *[f"| {h['step']} | {h['loss']:.4f} | {h['ppl']:.2f} |" for h in evals],
        "",
        "Greedy completions (the prompt, then the model's continuation; the prompt's last "
        "token is healed: the model re-picks it among the tokens that start with its text, "
        "since a prompt ending in a space splits a boundary that training text never has):",
        "",
    ]
    for text in samples:
        lines += ["```python", text.replace("```", "` ` `"), "```", ""]
    commit = _git_commit()
    lines += [
        "## Reproduce",
        "",
        "From a checkout of turbospark_jax"
        + (f" at commit `{commit}`" if commit else "") + ":",
        "",
        "```sh",
        f"PYTHONPATH=. {command}",
        "```",
        "",
        "Without `--corpus-root` the corpus is whatever standard library the running "
        "interpreter ships (another Python version or distribution trains on other files); "
        "the steps follow from `--*-epochs` and the corpus size unless `--*-steps` is given."
        + ("" if result.finished else
           f" This run was cut short by `--max-seconds` at step {result.steps_done}; a machine "
           "of another speed stops elsewhere.")
        + " On the CPU a rerun is bitwise identical; on a GPU XLA's reductions may differ in "
        "the last bits.",
        "",
    ]
    return "\n".join(lines)


def export_model(
    folder: Path,
    result: TrainResult,
    tokenizer: Tokenizer,
    card: str,
    save_dtype: str = "bfloat16",
) -> None:
    """Write the trained model as a Hugging Face folder plus its ``README.md``.

    Args:
      folder: the destination.
      result: the training result.
      tokenizer: saved alongside.
      card: the model card text.
      save_dtype: the weights' dtype on disk (``"bfloat16"`` or ``"float32"``).
    """
    dtype = jnp.dtype(save_dtype)
    params = jax.tree.map(lambda p: np.asarray(jax.device_get(p)).astype(dtype), result.params)
    generation = loading.GenerationConfig(
        eos_token_ids=(tokenizer.eos_token_id,),
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        extra={"do_sample": False},
    )
    loading.save_folder(folder, result.config, params, tokenizer=tokenizer,
                        generation_config=generation, max_shard_bytes=SHARD_BYTES)
    (folder / "README.md").write_text(card, encoding="utf-8")


# -- packing -----------------------------------------------------------------------------------


class _PartWriter(io.RawIOBase):
    """A write-only stream that rolls over to a new ``<base>.part-NNN`` file every
    ``part_bytes``, hashing everything it writes."""

    def __init__(self, base: Path, part_bytes: int) -> None:
        self.base, self.part_bytes = base, part_bytes
        self.paths: list[Path] = []
        self.sha = hashlib.sha256()
        self.total = 0
        self._file: io.BufferedWriter | None = None
        self._left = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.total += len(view)
        done = 0
        while done < len(view):
            if self._file is None or self._left == 0:
                if self._file is not None:
                    self._file.close()
                path = self.base.with_name(f"{self.base.name}.part-{len(self.paths):03d}")
                self.paths.append(path)
                self._file = open(path, "wb")  # noqa: SIM115 - closed on rollover / close
                self._left = self.part_bytes
            n = min(self._left, len(view) - done)
            self._file.write(view[done : done + n])
            self._left -= n
            done += n
        return len(view)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


def pack_folders(
    folders: Sequence[Path], out_dir: Path, name: str = "models", part_bytes: int = PART_BYTES
) -> list[Path]:
    """Archive folders as ``NAME.tar.gz`` split into parts, plus ``NAME.manifest.json``.

    Each folder is stored under its own name. The manifest lists the parts and the SHA-256 of
    the whole archive. ``cat NAME.tar.gz.part-* | tar xz`` also unpacks them.

    Args:
      folders: the folders to pack.
      out_dir: where the parts go (created if needed).
      name: the archive's base name.
      part_bytes: the largest part.

    Returns:
      The part paths and the manifest path.

    Raises:
      BadInputError: a folder is missing or two share a name.
    """
    names = [f.name for f in folders]
    if len(set(names)) != len(names):
        raise BadInputError(f"folders to pack must have distinct names, got {names}")
    for f in folders:
        if not f.is_dir():
            raise BadInputError(f"{f} is not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(f"{name}.tar.gz.part-*"):
        stale.unlink()
    writer = _PartWriter(out_dir / f"{name}.tar.gz", part_bytes)
    # mtime=0 keeps the gzip header free of the packing time.
    with gzip.GzipFile(fileobj=writer, mode="wb", compresslevel=6, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w|") as tar:
        for f in folders:
            tar.add(f, arcname=f.name)
    writer.close()
    manifest = {
        "archive": f"{name}.tar.gz",
        "parts": [p.name for p in writer.paths],
        "bytes": writer.total,
        "sha256": writer.sha.hexdigest(),
        "folders": names,
        "unpack": f"cat {name}.tar.gz.part-* | tar xz -C DEST",
    }
    manifest_path = out_dir / f"{name}.manifest.json"
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return [*writer.paths, manifest_path]


def unpack_parts(parts_dir: Path, dest: Path, name: str = "models") -> list[Path]:
    """Check and extract an archive written by :func:`pack_folders`.

    Args:
      parts_dir: the folder holding the parts and the manifest.
      dest: where to extract (created if needed).
      name: the archive's base name.

    Returns:
      The extracted top-level folders.

    Raises:
      BadInputError: the manifest or a part is missing, or the checksum does not match.
    """
    manifest_path = parts_dir / f"{name}.manifest.json"
    if not manifest_path.is_file():
        raise BadInputError(f"no {manifest_path.name} in {parts_dir}")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    buf = io.BytesIO()
    for part in manifest["parts"]:
        path = parts_dir / part
        if not path.is_file():
            raise BadInputError(f"archive part {path} is missing")
        buf.write(path.read_bytes())
    digest = hashlib.sha256(buf.getbuffer()).hexdigest()
    if digest != manifest["sha256"]:
        raise BadInputError(f"archive {name} is corrupt: sha256 {digest}, expected "
                            f"{manifest['sha256']}")
    buf.seek(0)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=buf, mode="r:gz") as tar:
        tar.extractall(dest, filter="data")
    return [dest / f for f in manifest["folders"]]


# -- the command line --------------------------------------------------------------------------


def _add_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus-root", type=Path, default=None,
                   help="directory of .py files (default: this interpreter's stdlib)")
    p.add_argument("--heldout-fraction", type=float, default=0.03,
                   help="share of files held out by path hash (default 0.03)")
    p.add_argument("--max-files", type=int, default=None,
                   help="use only this many files, evenly spaced (quick runs)")
    p.add_argument("--corpus-name", default=None,
                   help="what --corpus-root holds, for the model card (e.g. 'the CPython "
                   "3.11.7 standard library')")


def _add_train_args(
    p: argparse.ArgumentParser, prefix: str = "", *, epochs: float, batch_size: int, lr: float
) -> None:
    flag = f"--{prefix}" if prefix else "--"
    p.add_argument(f"{flag}epochs", type=float, default=epochs,
                   help=f"passes over the training rows (default {epochs}); sets the steps")
    p.add_argument(f"{flag}steps", type=int, default=None,
                   help="optimizer steps (overrides the epochs)")
    p.add_argument(f"{flag}batch-size", type=int, default=batch_size,
                   help=f"sequences per step (default {batch_size})")
    p.add_argument(f"{flag}lr", type=float, default=lr, help=f"peak learning rate (default {lr})")
    p.add_argument(f"{flag}warmup", type=int, default=None,
                   help="warmup steps (default: 8%% of the steps)")
    p.add_argument(f"{flag}eval-every", type=int, default=None,
                   help="steps between held-out evaluations (default: 10 per run; 0: at the end)")


def _train_config(args: argparse.Namespace, num_rows: int, prefix: str = "") -> TrainConfig:
    # Training length is set in epochs by default because the corpus is whatever the
    # interpreter ships: 2.5M tokens on one machine, 8.6M on another. The resolved steps go in
    # the model card (and the checkpoint), so a run is still pinned down exactly.
    def get(key: str) -> Any:
        return getattr(args, prefix.replace("-", "_") + key)

    batch_size = get("batch_size")
    steps = get("steps")
    if steps is None:
        steps = max(1, math.ceil(get("epochs") * (num_rows // max(batch_size, 1))))
    warmup = get("warmup")
    eval_every = get("eval_every")
    return TrainConfig(
        steps=steps,
        batch_size=batch_size,
        seq_len=args.seq_len,
        peak_lr=get("lr"),
        warmup_steps=max(1, round(0.08 * steps)) if warmup is None else warmup,
        weight_decay=args.weight_decay,
        seed=args.seed,
        eval_every=max(1, steps // 10) if eval_every is None else eval_every,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every,
    )


def _add_common_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0, help="init and data-order seed")
    p.add_argument("--log-every", type=int, default=20, help="steps between loss readouts")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints (0: only at the end)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="wall-clock budget: stop, checkpoint and export before it runs out")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoints under --out (bitwise on the CPU)")
    p.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the exported weights")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m turbospark_jax.train",
        description="Train byte-level BPE tokenizers and small qwen3 models on the Python "
        "standard library, and ship them as Hugging Face folders.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    tok = sub.add_parser("tokenizer", help="train the tokenizer on the corpus' training split")
    tok.add_argument("--out", type=Path, required=True, help="folder for the tokenizer files")
    tok.add_argument("--vocab-size", type=int, default=8192)
    _add_corpus_args(tok)

    tr = sub.add_parser("train", help="train one model with a saved tokenizer")
    tr.add_argument("--tokenizer", type=Path, required=True, help="folder of tokenizer.json")
    tr.add_argument("--out", type=Path, required=True,
                    help="run folder: checkpoint in OUT/ckpt, model in OUT/model")
    tr.add_argument("--preset", choices=tuple(PRESETS), default="target", help="model shape")
    _add_corpus_args(tr)
    _add_common_train_args(tr)
    _add_train_args(tr, epochs=8.0, batch_size=32, lr=2e-3)

    rec = sub.add_parser("recipe", help="tokenizer, draft and target end to end")
    rec.add_argument("--out", type=Path, required=True,
                     help="run folder: OUT/tokenizer, OUT/target, OUT/draft, OUT/ckpt/*")
    rec.add_argument("--vocab-size", type=int, default=8192)
    rec.add_argument("--target-preset", choices=tuple(PRESETS), default="target")
    rec.add_argument("--draft-preset", choices=tuple(PRESETS), default="draft")
    rec.add_argument("--draft-share", type=float, default=0.35,
                     help="most of the training budget the draft may use (default 0.35)")
    rec.add_argument("--pack-out", type=Path, default=None,
                     help="also pack OUT/target and OUT/draft into 15 MiB parts here")
    _add_corpus_args(rec)
    _add_common_train_args(rec)
    _add_train_args(rec, "target-", epochs=8.0, batch_size=32, lr=2e-3)
    _add_train_args(rec, "draft-", epochs=8.0, batch_size=32, lr=3e-3)

    pk = sub.add_parser("pack", help="tar.gz folders into parts of at most --part-mib MiB")
    pk.add_argument("folders", type=Path, nargs="+")
    pk.add_argument("--out", type=Path, required=True)
    pk.add_argument("--name", default="models")
    pk.add_argument("--part-mib", type=float, default=PART_BYTES / 2**20)

    up = sub.add_parser("unpack", help="check and extract parts written by pack")
    up.add_argument("parts", type=Path, help="folder with NAME.tar.gz.part-* and the manifest")
    up.add_argument("--to", type=Path, required=True, help="destination folder")
    up.add_argument("--name", default="models")
    return parser


def _timed(timings: dict[str, float], key: str, t0: float) -> float:
    now = time.monotonic()
    timings[key] = round(now - t0, 2)
    print(f"[time] {key}: {now - t0:.1f}s", flush=True)
    return now


def _encode_splits(
    tokenizer: Tokenizer, corpus: Corpus, seq_len: int
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    train_stream = encode_documents(tokenizer, corpus.train)
    heldout_stream = encode_documents(tokenizer, corpus.heldout)
    tokens = {"train": len(train_stream), "heldout": len(heldout_stream)}
    print(f"[data] {tokens['train']:,} training tokens, {tokens['heldout']:,} held-out tokens",
          flush=True)
    return pack_rows(train_stream, seq_len), pack_rows(heldout_stream, seq_len), tokens


def _train_and_export(
    *,
    args: argparse.Namespace,
    name: str,
    role: str,
    preset: str,
    tc: TrainConfig,
    tokenizer: Tokenizer,
    corpus: Corpus,
    data: tuple[np.ndarray, np.ndarray, dict[str, int]],
    run_dir: Path,
    model_dir: Path,
    deadline: float | None,
    export_reserve: float,
) -> TrainResult:
    train_rows, heldout_rows, tokens = data
    config = model_config(preset, tokenizer)
    result = train_model(
        config, tc, train_rows, heldout_rows,
        checkpoint_dir=run_dir / "ckpt" / name, resume=args.resume,
        deadline=None if deadline is None else deadline - export_reserve,
        progress=not args.no_progress, name=name,
    )
    t0 = time.monotonic()
    samples = greedy_complete(config, result.params, tokenizer, CARD_PROMPTS,
                              dtype=args.save_dtype)
    for s in samples:
        print(f"[{name}] sample: {s!r}", flush=True)
    card = model_card(name=name, result=result, train_config=tc, corpus=corpus.describe(),
                      tokens=tokens, samples=samples, command=command_line(args.argv),
                      save_dtype=args.save_dtype, role=role)
    export_model(model_dir, result, tokenizer, card, args.save_dtype)
    result.timings["export_s"] = time.monotonic() - t0
    with open(run_dir / f"{name}_history.jsonl", "w", encoding="utf-8") as f:
        for record in result.history:
            f.write(json.dumps(record) + "\n")
    return result


def _summary(result: TrainResult) -> dict[str, Any]:
    return {
        "params": count_params(result.params),
        "steps_done": result.steps_done,
        "finished": result.finished,
        "tokens_seen": result.tokens_seen,
        "eval_loss": result.eval_loss,
        "eval_ppl": math.exp(result.eval_loss) if result.eval_loss is not None else None,
        "timings": {k: round(v, 2) for k, v in result.timings.items()},
    }


def _run_recipe(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    deadline = None if args.max_seconds is None else t_start + args.max_seconds
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    print(f"[recipe] jax {jax.__version__} on {jax.devices()}", flush=True)

    t = time.monotonic()
    corpus = load_corpus(args.corpus_root, args.heldout_fraction, args.max_files,
                         args.corpus_name)
    print(f"[corpus] {json.dumps(corpus.describe())}", flush=True)
    t = _timed(timings, "corpus_s", t)

    tok_dir = out / "tokenizer"
    if args.resume and (tok_dir / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_folder(tok_dir)
    else:
        tokenizer = train_tokenizer([d.text for d in corpus.train], args.vocab_size)
        tokenizer.save(tok_dir)
    t = _timed(timings, "tokenizer_s", t)
    data = _encode_splits(tokenizer, corpus, args.seq_len)
    t = _timed(timings, "encode_s", t)

    # The draft trains first: it is small and its time predictable, and the target then gets
    # whatever budget is left. 40 s are kept back per model for samples, card and export.
    reserve = 40.0
    draft_deadline = None
    if deadline is not None:
        left = deadline - time.monotonic() - 2 * reserve
        draft_deadline = time.monotonic() + reserve + max(left, 0.0) * args.draft_share
    rows = len(data[0])
    draft = _train_and_export(
        args=args, name="draft", role="It is the draft model for speculative decoding with "
        "the target model trained in the same run (same tokenizer).",
        preset=args.draft_preset, tc=_train_config(args, rows, "draft-"), tokenizer=tokenizer,
        corpus=corpus, data=data, run_dir=out, model_dir=out / "draft",
        deadline=draft_deadline, export_reserve=reserve,
    )
    t = _timed(timings, "draft_s", t)
    target = _train_and_export(
        args=args, name="target", role="It is the target model; a draft model for "
        "speculative decoding was trained in the same run with the same tokenizer.",
        preset=args.target_preset, tc=_train_config(args, rows, "target-"), tokenizer=tokenizer,
        corpus=corpus, data=data, run_dir=out, model_dir=out / "target",
        deadline=deadline, export_reserve=reserve,
    )
    t = _timed(timings, "target_s", t)
    summary: dict[str, Any] = {
        "command": command_line(args.argv),
        "corpus": corpus.describe(),
        "tokens": data[2],
        "vocab_size": tokenizer.vocab_size,
        "draft": _summary(draft),
        "target": _summary(target),
    }
    if args.pack_out is not None:
        parts = pack_folders([out / "target", out / "draft"], args.pack_out)
        summary["parts"] = [p.name for p in parts]
        t = _timed(timings, "pack_s", t)
    timings["total_s"] = round(time.monotonic() - t_start, 2)
    summary["timings"] = timings
    text = json.dumps(summary, indent=2)
    (out / "summary.json").write_text(text + "\n", encoding="utf-8")
    if args.pack_out is not None:
        (args.pack_out / "summary.json").write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m turbospark_jax.train``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser().parse_args(argv)
    args.argv = argv  # for the model card's reproduce line
    if args.command == "tokenizer":
        corpus = load_corpus(args.corpus_root, args.heldout_fraction, args.max_files,
                         args.corpus_name)
        tokenizer = train_tokenizer([d.text for d in corpus.train], args.vocab_size)
        tokenizer.save(args.out)
        print(f"tokenizer with {tokenizer.vocab_size} tokens written to {args.out}")
    elif args.command == "train":
        deadline = None if args.max_seconds is None else time.monotonic() + args.max_seconds
        tokenizer = Tokenizer.from_folder(args.tokenizer)
        corpus = load_corpus(args.corpus_root, args.heldout_fraction, args.max_files,
                         args.corpus_name)
        data = _encode_splits(tokenizer, corpus, args.seq_len)
        result = _train_and_export(
            args=args, name=args.preset, role="", preset=args.preset,
            tc=_train_config(args, len(data[0])), tokenizer=tokenizer, corpus=corpus, data=data,
            run_dir=args.out, model_dir=args.out / "model", deadline=deadline,
            export_reserve=20.0,
        )
        print(json.dumps(_summary(result), indent=2))
    elif args.command == "recipe":
        _run_recipe(args)
    elif args.command == "pack":
        for path in pack_folders(args.folders, args.out, args.name, int(args.part_mib * 2**20)):
            print(path)
    elif args.command == "unpack":
        for path in unpack_parts(args.parts, args.to, args.name):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
