"""Shipping folders in parts small enough to travel: ``pack`` and ``unpack``.

A trained model comes back from the GPU machine as files of at most 16 MiB, so ``pack``
writes folders as one gzipped tar split into parts of at most :data:`PART_BYTES` plus a
manifest holding the archive's SHA-256; ``unpack`` checks the whole archive against it before
extracting anything. The parts are a plain split of a plain ``.tar.gz``, so no tool of ours is
needed to read them: ``cat NAME.tar.gz.part-* | tar xz -C DEST``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from turbospark_jax.errors import BadInputError

#: The largest file :func:`pack_folders` writes by default, below the 16 MiB a GPU run returns.
PART_BYTES = 15 * 2**20

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
