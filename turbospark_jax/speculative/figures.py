"""``speculative.json``: what each drafter measured for a model, kept in the model's folder.

The file is how ``--drafter auto`` (and ``--speculative``) knows which drafter pays on which
backend: ``python -m benchmarks --suite speculative`` writes it from its runs, one entry per
drafter and backend at the draft length that measured best. Hand-editing is fine; the file
is checked when read and a bad one is refused by name, never half-used.

::

    {
      "format": 1,
      "measurements": [
        {"drafter": "mtp", "backend": "gpu", "draft_len": 3, "speedup": <float>,
         "mean_acceptance_length": <float>, "acceptance_rate": <float>,
         "command": "python -m benchmarks --suite speculative --preset h100",
         "device": "<the device's name>", "date": "<YYYY-MM-DD>", "sampled_speedup": <float>}
      ],
      "folders": {"draft-model": "../tsj-pycoder-draft", "block": "../tsj-pycoder-block"}
    }

``drafter`` is one of :data:`DRAFTERS`; ``backend`` is jax's name for it (``cpu``, ``gpu``,
``tpu``); ``speedup`` is wall-clock decode tokens/s over plain decoding through the same loop;
``device``, ``date``, ``sampled_speedup`` and ``lossless`` are optional. ``lossless: false``
records that the drafter's greedy output differed from plain greedy decoding on that backend
when it was measured: ``--drafter auto`` never picks it there. ``folders`` (optional) names,
relative to the model folder, where a drafter's own folder is when it is not the sibling the
naming convention gives (``<model>-draft``, ``<model>-block``, ``<model>-assistant``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.speculative.drafters.base import MAX_DRAFT

#: The file's name inside a model folder.
SPECULATIVE_FILE = "speculative.json"
#: The format this module reads and writes.
FORMAT = 1
#: Every drafter a model may have, as the command line names them.
DRAFTERS = ("draft-model", "ngram", "mtp", "block", "assistant")
#: Drafters that live in a folder of their own beside the model.
FOLDER_DRAFTERS = ("draft-model", "block", "assistant")

_REQUIRED = {"drafter": str, "backend": str, "draft_len": int, "speedup": float,
             "mean_acceptance_length": float, "acceptance_rate": float, "command": str}
_OPTIONAL = {"device": str, "date": str, "sampled_speedup": float, "lossless": bool}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One drafter's figures on one backend at one draft length (fields as in the file)."""

    drafter: str
    backend: str
    draft_len: int
    speedup: float
    mean_acceptance_length: float
    acceptance_rate: float
    command: str
    device: str | None = None
    date: str | None = None
    sampled_speedup: float | None = None
    #: False: its greedy run differed from plain greedy decoding when measured
    lossless: bool | None = None

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise BadInputError(f"drafter must be one of {', '.join(DRAFTERS)}, got "
                                f"{self.drafter!r}")
        if not self.backend:
            raise BadInputError("backend must name a jax backend (cpu, gpu, tpu)")
        if not 1 <= self.draft_len <= MAX_DRAFT:
            raise BadInputError(f"draft_len must be in 1..{MAX_DRAFT}, got {self.draft_len}")
        for name in ("speedup", "mean_acceptance_length"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise BadInputError(f"{name} must be a positive number, got {value}")
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise BadInputError(f"acceptance_rate must be in [0, 1], got {self.acceptance_rate}")
        if not self.command.strip():
            raise BadInputError("command must say how the figures were measured")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Figures:
    """A model folder's ``speculative.json``, checked.

    Fields:
      path: the file.
      measurements: every entry, in the file's order.
      folders: drafter -> its folder, resolved against the model folder.
    """

    path: Path
    measurements: tuple[Measurement, ...]
    folders: Mapping[str, Path]

    def best(self, drafter: str, backend: str) -> Measurement | None:
        """The entry with the highest speedup for ``drafter`` on ``backend`` (``None``: no
        figures for that pair)."""
        mine = [m for m in self.measurements if m.drafter == drafter and m.backend == backend]
        return max(mine, key=lambda m: m.speedup) if mine else None

    def not_lossless(self, backend: str) -> set[str]:
        """The drafters whose greedy output was measured to differ from plain greedy
        decoding on ``backend``."""
        return {m.drafter for m in self.measurements
                if m.backend == backend and m.lossless is False}


def read_figures(folder: str | os.PathLike[str]) -> Figures | None:
    """The folder's ``speculative.json``, or ``None`` when it has none.

    Raises:
      ModelLoadError: the file is not valid JSON, or an entry or field is wrong (named, with
        the entry's index and what was expected).
    """
    folder = Path(folder)
    path = folder / SPECULATIVE_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    unknown = sorted(set(raw) - {"format", "measurements", "folders"})
    if unknown:
        raise ModelLoadError(f"{path}: unknown key(s) {unknown}; the keys are format, "
                             "measurements and folders")
    if raw.get("format") != FORMAT:
        raise ModelLoadError(f"{path}: 'format' must be {FORMAT}, got {raw.get('format')!r}")
    entries = raw.get("measurements", [])
    if not isinstance(entries, list):
        raise ModelLoadError(f"{path}: 'measurements' must be a list of objects")
    measurements = tuple(_measurement(path, i, e) for i, e in enumerate(entries))
    folders = raw.get("folders", {})
    if not isinstance(folders, dict):
        raise ModelLoadError(f"{path}: 'folders' must map a drafter to a folder")
    resolved: dict[str, Path] = {}
    for drafter, where in folders.items():
        if drafter not in FOLDER_DRAFTERS or not isinstance(where, str) or not where:
            raise ModelLoadError(
                f"{path}: folders[{drafter!r}] must be a folder path and the drafter one of "
                f"{', '.join(FOLDER_DRAFTERS)}, got {where!r}"
            )
        resolved[drafter] = (folder / where).resolve()
    return Figures(path, measurements, resolved)


def _measurement(path: Path, index: int, entry: Any) -> Measurement:
    where = f"{path}: measurements[{index}]"
    if not isinstance(entry, dict):
        raise ModelLoadError(f"{where} must be an object")
    missing = [k for k in _REQUIRED if k not in entry]
    if missing:
        raise ModelLoadError(f"{where} has no {missing[0]!r} (each entry needs "
                             f"{', '.join(_REQUIRED)})")
    unknown = sorted(set(entry) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise ModelLoadError(f"{where}: unknown key(s) {unknown}")
    values: dict[str, Any] = {}
    for key, value in entry.items():
        kind = {**_REQUIRED, **_OPTIONAL}[key]
        allowed = (int, float) if kind is float else (kind,)
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, allowed):
            what = {float: "a number", int: "an integer", str: "a string",
                    bool: "true or false"}[kind]
            raise ModelLoadError(f"{where}.{key} must be {what}, got {value!r}")
        values[key] = float(value) if kind is float else value
    try:
        return Measurement(**values)
    except BadInputError as exc:
        raise ModelLoadError(f"{where}: {exc}") from exc


def write_figures(folder: str | os.PathLike[str], measurements: Sequence[Measurement]) -> Path:
    """Write ``speculative.json`` in ``folder``: ``measurements`` replace the file's entries
    for the same (drafter, backend); entries for other pairs and ``folders`` stay.

    Raises:
      ModelLoadError: the existing file is malformed (it is not overwritten then).
    """
    folder = Path(folder)
    old = read_figures(folder)
    fresh = {(m.drafter, m.backend) for m in measurements}
    kept = [m for m in (old.measurements if old else ()) if (m.drafter, m.backend) not in fresh]
    data: dict[str, Any] = {"format": FORMAT,
                            "measurements": [m.to_dict() for m in [*kept, *measurements]]}
    if old is not None and old.folders:
        data["folders"] = {k: os.path.relpath(v, folder.resolve())
                           for k, v in old.folders.items()}
    path = folder / SPECULATIVE_FILE
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path
