"""The recipe's data: which files it reads, how they split, and how they become batches.

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

**Installed packages** (``packages=True``, ``--packages``): the Python sources of the
permissively licensed distributions installed beside the interpreter join the standard
library, under keys ``site-packages/<distribution>/<path>`` (the split hashes those keys like
any path). :mod:`turbospark_recipe.sources` decides what qualifies (licence, vendored
copies, generated files, data literals). In this mode every source, the standard library
included, is deduplicated by content: the first copy in key order stays (without it the
corpus is the standard library's files as they are, as the embedded models were trained).
:meth:`Corpus.describe` lists each distribution that went in with its version, licence, files
and characters, and what was left out and why.

**Data.** Each document becomes ``<|bos|> text <|eos|>``; documents are concatenated in file
order and cut into rows of ``seq_len + 1`` tokens that overlap by one (inputs ``row[:-1]``,
targets ``row[1:]``), so no token is wasted and no padding is needed. Attention runs across
document boundaries, as in GPT-2 style packing. Each epoch visits the rows in a permutation
drawn from ``(seed, epoch)``; batch ``s`` is a pure function of ``s``, so the data position in
a checkpoint is just the step. :func:`fingerprint` names the exact rows a run saw, so a resume
on other data is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from turbospark_jax.errors import BadInputError
from turbospark_jax.io.tokenizer import Tokenizer

#: Path components that exclude a file from the corpus (see the module docstring for why).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "pydoc_data"})
#: Relative path prefixes that exclude a file: Python 2 fixtures that are not valid Python 3.
EXCLUDED_PREFIXES = ("lib2to3/tests/data/",)


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
    #: per distribution read: version, licence, files, chars (empty without ``packages``)
    packages: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: files left out, by reason (``not_utf8`` is ``skipped``; see the sources module)
    left_out: dict[str, int] = dataclasses.field(default_factory=dict)
    #: distributions not read because their licence is not permissive: name -> licence
    refused_licences: dict[str, str] = dataclasses.field(default_factory=dict)

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
            "packages": self.packages,
            "left_out": self.left_out,
            "refused_licences": self.refused_licences,
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
    packages: bool | Sequence[str] = False,
) -> Corpus:
    """Read and split the corpus.

    Args:
      root: the directory to read; the standard library by default.
      heldout_fraction: the share of files (by path hash) held out for evaluation.
      max_files: keep only this many files, evenly spaced over the sorted list so the subset
        spans the whole library (for quick runs and tests); all files when ``None``.
      name: what the files are, for the model card; by default the running interpreter's
        standard library, or the root's path for another root.
      packages: add the installed packages' permissively licensed sources
        (:mod:`turbospark_recipe.sources`): ``True`` for what the interpreter imports
        (``sys.path``), or the site directories to read.

    Returns:
      The :class:`Corpus`.

    Raises:
      BadInputError: ``root`` is not a directory, ``heldout_fraction`` is outside ``(0, 1)``,
        or either split comes out empty.
    """
    from turbospark_recipe import sources

    if not 0.0 < heldout_fraction < 1.0:
        raise BadInputError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if name is None:
        name = (
            f"the standard library of the running interpreter (CPython "
            f"{platform.python_version()})" if root is None else f"the directory {root}"
        )
    root = stdlib_root() if root is None else root
    # (corpus key, file, distribution or None for the root's own files)
    entries = [(rel, root / rel, None) for rel in list_corpus_files(root)]
    left_out: dict[str, int] = {}
    refused: dict[str, str] = {}
    found: dict[str, sources.Distribution] = {}
    if packages:
        where = None if packages is True else [str(p) for p in packages]
        distributions = sources.installed_distributions(where)
        found = {d.name: d for d in distributions}
        refused = {d.name: d.licence for d in distributions if not d.permissive}
        files, left_out = sources.package_files(distributions, where)
        entries += [(f.key, f.path, f.distribution) for f in files]
        name += ", and the permissively licensed Python sources of the installed packages"
    if max_files is not None and len(entries) > max_files:
        stride = len(entries) / max_files
        entries = [entries[int(i * stride)] for i in range(max_files)]
    train: list[Document] = []
    heldout: list[Document] = []
    skipped: list[str] = []
    seen: set[bytes] = set()
    read: dict[str, dict[str, Any]] = {}
    for key, path, dist in entries:
        try:
            data = path.read_bytes()
        except OSError:
            left_out["unreadable"] = left_out.get("unreadable", 0) + 1
            continue
        reason = None if dist is None else sources.reject_reason(path.name, data)
        digest = hashlib.sha256(data).digest()
        if reason is None and packages and digest in seen:
            reason = "duplicate"
        if reason is not None:
            left_out[reason] = left_out.get(reason, 0) + 1
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(key)
            continue
        seen.add(digest)
        (heldout if is_heldout(key, heldout_fraction) else train).append(Document(key, text))
        if dist is not None:
            info = read.setdefault(dist, {"version": found[dist].version,
                                          "licence": found[dist].licence, "files": 0,
                                          "chars": 0})
            info["files"] += 1
            info["chars"] += len(text)
    if not train or not heldout:
        raise BadInputError(
            f"the split of {len(entries)} files under {root} left "
            f"{len(train)} training and {len(heldout)} held-out files; both must be non-empty"
        )
    return Corpus(str(root), tuple(train), tuple(heldout), tuple(skipped), heldout_fraction,
                  max_files, name, read, left_out, refused)


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
