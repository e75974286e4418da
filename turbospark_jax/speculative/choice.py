"""Which drafter a model has, which one to use, and the speculative pair built from it.

A model folder may come with up to five drafters (:data:`DRAFTERS`):

=============  =================================================================================
drafter        available when
=============  =================================================================================
``ngram``      always (prompt lookup needs no weights)
``draft-model``  a model folder with the target's vocabulary: named, or ``<model>-draft`` beside
               the target (or where ``speculative.json``'s ``folders`` says)
``mtp``        the target is a Qwen3.5 / Qwen3-Next model with one MTP layer
               (``mtp_num_hidden_layers`` 1)
``block``      a block drafter folder made for this target: named, or ``<model>-block``
``assistant``  the target is Gemma 4 and a ``gemma4_assistant`` folder made for it is named, or
               ``<model>-assistant``
=============  =================================================================================

Everything here reads ``config.json`` files only, so a drafter that is not there, or not made
for the target, is refused before any weights load.

**auto** (``--drafter auto``, ``--speculative``) picks among the available drafters the one
whose figures in the folder's ``speculative.json``
(:mod:`~turbospark_jax.speculative.figures`) show the highest speedup on this backend, at the
draft length that measured best; a drafter with figures beats one without. With no figures
for the backend it takes the first available drafter in :data:`FALLBACK_ORDER`. A drafter
whose figures say its greedy output differed from plain greedy decoding on the backend
(``lossless: false``) is never picked there, by figures or fallback. The fallback takes those
trained for the target (block, MTP head, assistant) first, then, on a CPU, the draft model before
n-gram lookup, and on an accelerator n-gram lookup before the draft model (the order the
embedded pair's figures gave on each).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError, ModelLoadError
from turbospark_jax.io.drafter_folders import load_assistant, load_block_drafter
from turbospark_jax.io.loading import LoadedModel, folder_config, load_folder
from turbospark_jax.models.block_drafter import MODEL_TYPE as BLOCK_DRAFTER_TYPE
from turbospark_jax.models.gemma4.config import Gemma4Config
from turbospark_jax.models.gemma4.model import Gemma4Model
from turbospark_jax.models.qwen3_5.config import Qwen35Config
from turbospark_jax.models.registry import family_of
from turbospark_jax.speculative.drafters import (
    MAX_DRAFT,
    BlockDrafter,
    DraftModelDrafter,
    MTPDrafter,
    NGramDrafter,
)
from turbospark_jax.speculative.drafters.base import DEFAULT_DRAFT_LEN
from turbospark_jax.speculative.drafters.block import tapped_target
from turbospark_jax.speculative.drafters.gemma4_assistant import Gemma4AssistantDrafter
from turbospark_jax.speculative.figures import DRAFTERS, Figures, Measurement, read_figures
from turbospark_jax.speculative.pair import SpeculativePair

__all__ = ["AUTO", "DEFAULT_DRAFT_LEN", "DRAFTERS", "FALLBACK_ORDER", "Availability",
           "DrafterChoice", "available_drafters", "choose_drafter", "pair_with_drafter",
           "requested_drafter"]

#: What ``--drafter`` takes besides a drafter's name: pick the best one.
AUTO = "auto"
#: The longest n-gram prompt lookup matches unless told otherwise.
DEFAULT_NGRAM = 3
#: auto's order when ``speculative.json`` has no figures for the backend (module docstring).
FALLBACK_ORDER: Mapping[str, tuple[str, ...]] = {
    "cpu": ("block", "mtp", "assistant", "draft-model", "ngram"),
    "gpu": ("block", "mtp", "assistant", "ngram", "draft-model"),
}
#: Where a folder drafter sits by convention: ``<model folder name><suffix>`` beside it.
SIBLING_SUFFIX = {"draft-model": "-draft", "block": "-block", "assistant": "-assistant"}


@dataclasses.dataclass(frozen=True)
class Availability:
    """Whether a drafter is there for a target, and why (or why not).

    Fields:
      drafter: its name (one of :data:`DRAFTERS`).
      available: whether it can draft for the target.
      reason: what was found, or what is missing, in a few words.
      folder: its own folder (folder drafters that have one).
      draft_len: proposals per round when nothing better is known (:data:`DEFAULT_DRAFT_LEN`;
        a block drafter's block less one).
    """

    drafter: str
    available: bool
    reason: str
    folder: Path | None = None
    draft_len: int = DEFAULT_DRAFT_LEN


@dataclasses.dataclass(frozen=True)
class DrafterChoice:
    """The drafter picked for a run.

    Fields:
      drafter: its name.
      folder: its folder (``draft-model``, ``block``, ``assistant``), else ``None``.
      draft_len: proposals per round.
      ngram: the longest n-gram (``ngram`` only).
      why: one line: how it was picked, and from what.
      measured: the figures it was picked on (``None``: none).
      warning: what a user should hear even unasked (a drafter asked for by name that was
        measured not lossless on this backend), else ``None``.
      auto: picked by ``auto`` (not asked for by name).
    """

    drafter: str
    folder: Path | None
    draft_len: int
    ngram: int
    why: str
    measured: Measurement | None = None
    warning: str | None = None
    auto: bool = False

    @property
    def plain_when_sampling(self) -> str | None:
        """Why a sampled request decodes without the drafter, or ``None`` when it drafts: a
        drafter ``auto`` picked whose figures on this backend measured sampled decoding
        slower than plain sampled decoding (a drafter asked for by name always drafts)."""
        m = self.measured
        if not self.auto or m is None or m.sampled_speedup is None or m.sampled_speedup >= 1:
            return None
        return (f"sampled requests decode without drafting: {self.drafter} measured "
                f"{m.sampled_speedup:.2f}x plain sampled decoding at draft length "
                f"{m.draft_len} on this backend (greedy requests draft)")


def requested_drafter(named: Sequence[tuple[str, str]]) -> str | None:
    """The one drafter a set of options asks for.

    Args:
      named: ``(how the caller spelled it, drafter or "auto")`` for each option given, e.g.
        ``[("--ngram 3", "ngram"), ("--drafter ngram", "ngram")]``.

    Returns:
      The drafter (or ``"auto"``), ``None`` when none was asked for.

    Raises:
      BadInputError: two options name different drafters (both named, in the caller's words).
    """
    for spelled, drafter in named:
        if drafter != AUTO and drafter not in DRAFTERS:
            raise BadInputError(f"{spelled}: no drafter {drafter!r}; the drafters are "
                                f"{AUTO}, {', '.join(DRAFTERS)}")
    for (a, first), (b, second) in itertools.pairwise(named):
        if first != second:
            raise BadInputError(
                f"choose one drafter: {a} asks for {first} and {b} for {second}")
    return named[0][1] if named else None


def available_drafters(
    target: str | os.PathLike[str],
    folders: Mapping[str, str | os.PathLike[str]] | None = None,
) -> tuple[dict[str, Availability], Figures | None]:
    """Every drafter and whether ``target`` has it (see the module docstring).

    Args:
      target: the model folder.
      folders: drafter -> a folder given by the caller (``--draft-model PATH``...), which
        takes the place of the one ``speculative.json`` names or the convention finds.

    Returns:
      ``({drafter: Availability}, the folder's figures or None)``.

    Raises:
      ModelLoadError: the model folder or its ``config.json`` is missing or names no family we
        load, or its ``speculative.json`` is malformed.
    """
    _, _, parsed, _ = folder_config(target, None, "list")
    target = Path(target)
    figures = read_figures(target)
    found = {"ngram": Availability("ngram", True, "prompt lookup, always there")}
    found["mtp"] = _mtp(parsed)
    for drafter, check in (("draft-model", _draft_model), ("block", _block),
                           ("assistant", _assistant)):
        given = (folders or {}).get(drafter)
        folder = Path(given) if given is not None else (
            figures.folders.get(drafter) if figures and drafter in figures.folders else
            target.parent / f"{target.name}{SIBLING_SUFFIX[drafter]}")
        found[drafter] = _folder_drafter(drafter, folder, parsed, check)
    return {d: found[d] for d in DRAFTERS}, figures


def _mtp(parsed: Any) -> Availability:
    if not isinstance(parsed, Qwen35Config):
        return Availability("mtp", False, "not a Qwen3.5 / Qwen3-Next model")
    layers = parsed.mtp_num_hidden_layers
    if layers != 1:
        what = "no MTP head" if layers == 0 else f"{layers} MTP layers; the drafter chains one"
        return Availability("mtp", False, f"{what} (mtp_num_hidden_layers {layers})")
    return Availability("mtp", True, "the model's own MTP head")


def _folder_drafter(drafter: str, folder: Path, target: Any,
                    check: Callable[[dict[str, Any], Any], tuple[str | None, int]]
                    ) -> Availability:
    config_path = folder / "config.json"
    if not config_path.is_file():
        return Availability(drafter, False, f"no folder {folder}" if not folder.is_dir() else
                            f"no config.json in {folder}", folder)
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return Availability(drafter, False, f"{config_path} is not valid JSON: {exc}", folder)
    if not isinstance(config, dict):
        return Availability(drafter, False, f"{config_path} must hold a JSON object", folder)
    problem, draft_len = check(config, target)
    if problem is not None:
        return Availability(drafter, False, f"{folder}: {problem}", folder)
    return Availability(drafter, True, str(folder), folder, draft_len)


def _draft_model(config: dict[str, Any], target: Any) -> tuple[str | None, int]:
    try:
        family_of(config.get("model_type"))
    except ModelLoadError as exc:
        return str(exc), DEFAULT_DRAFT_LEN
    theirs = config.get("vocab_size")
    if theirs != target.vocab_size:
        return (f"the draft model's vocabulary has {theirs} ids but the model's has "
                f"{target.vocab_size}; a draft model needs the same tokenizer"), DEFAULT_DRAFT_LEN
    return None, DEFAULT_DRAFT_LEN


def _block(config: dict[str, Any], target: Any) -> tuple[str | None, int]:
    if config.get("model_type") != BLOCK_DRAFTER_TYPE:
        return f"not a block drafter (model_type {config.get('model_type')!r})", DEFAULT_DRAFT_LEN
    for theirs_key, mine, what in (
        ("vocab_size", target.vocab_size, "vocabulary size"),
        ("hidden_size", target.hidden_size, "hidden size"),
        ("target_num_hidden_layers", target.num_hidden_layers, "number of layers"),
    ):
        if config.get(theirs_key) != mine:
            return (f"the block drafter was made for a model whose {what} is "
                    f"{config.get(theirs_key)}; this model's is {mine}"), DEFAULT_DRAFT_LEN
    block = config.get("block_size", 4)
    return None, max(1, min(MAX_DRAFT, block - 1)) if isinstance(block, int) else 1


def _assistant(config: dict[str, Any], target: Any) -> tuple[str | None, int]:
    if config.get("model_type") != "gemma4_assistant":
        return (f"not a Gemma 4 assistant (model_type {config.get('model_type')!r})",
                DEFAULT_DRAFT_LEN)
    if not isinstance(target, Gemma4Config):
        return "an assistant drafts for a Gemma 4 model; this one is not", DEFAULT_DRAFT_LEN
    if config.get("backbone_hidden_size") != target.hidden_size:
        return (f"the assistant was made for a model of hidden size "
                f"{config.get('backbone_hidden_size')}; this model's is {target.hidden_size}",
                DEFAULT_DRAFT_LEN)
    return None, DEFAULT_DRAFT_LEN


def choose_drafter(
    target: str | os.PathLike[str], requested: str, backend: str, *,
    folders: Mapping[str, str | os.PathLike[str]] | None = None,
    draft_len: int | None = None, ngram: int | None = None,
) -> DrafterChoice:
    """The drafter for a run.

    Args:
      target, folders: as for :func:`available_drafters`.
      requested: a drafter's name, or ``"auto"``.
      backend: jax's backend name (``cpu``, ``gpu``...): whose figures count.
      draft_len: proposals per round, when the caller sets them.
      ngram: the longest n-gram for ``ngram`` (default :data:`DEFAULT_NGRAM`).

    Raises:
      BadInputError: the drafter asked for by name is not available (the reason named).
      ModelLoadError: a folder in ``folders`` does not exist; as :func:`available_drafters`.
    """
    for drafter, folder in (folders or {}).items():
        if not Path(folder).is_dir():
            raise ModelLoadError(f"the {drafter} drafter's folder {folder} does not exist")
    table, figures = available_drafters(target, folders)
    n = DEFAULT_NGRAM if ngram is None else ngram
    source = (f"{figures.path}" if figures is not None else
              f"no speculative.json in {Path(target)}")
    if requested != AUTO:
        if requested not in table:
            requested_drafter([(requested, requested)])  # raises, naming the drafters
        found = table[requested]
        if not found.available:
            raise BadInputError(f"the {requested} drafter is not available for {target}: "
                                f"{found.reason}")
        best = figures.best(requested, backend) if figures is not None else None
        k = draft_len or (best.draft_len if best else found.draft_len)
        why = f"{requested} as asked, draft length {k}" + (
            f" ({best.speedup:.2f}x over plain on {backend} at draft length {best.draft_len} "
            f"in {source})" if best else "")
        warning = None
        if figures is not None and requested in figures.not_lossless(backend):
            warning = (f"the {requested} drafter's greedy output differed from plain greedy "
                       f"decoding on {backend} when it was measured ({source})")
            why += f"; warning: {warning}"
        return DrafterChoice(requested, found.folder, k, n, why, best, warning)
    lossy = figures.not_lossless(backend) if figures is not None else set()
    available = [d for d in _order(backend) if table[d].available and d not in lossy]
    reasons = [f"{d}: {table[d].reason}" for d in DRAFTERS if not table[d].available]
    reasons += [f"{d}: measured not lossless on {backend}" for d in sorted(lossy)
                if table[d].available]
    unavailable = f"; not available: {'; '.join(reasons)}" if reasons else ""
    measured = {d: figures.best(d, backend) for d in available} if figures else {}
    measured = {d: m for d, m in measured.items() if m is not None}
    if measured:
        pick = max(measured, key=lambda d: (measured[d].speedup, -available.index(d)))
        best = measured[pick]
        k = draft_len or best.draft_len
        others = ", ".join(f"{d} {m.speedup:.2f}x" for d, m in measured.items() if d != pick)
        why = (f"auto picked {pick} at draft length {k}: {best.speedup:.2f}x over plain "
               f"decoding on {backend} at draft length {best.draft_len}, the best measured"
               f"{f' (against {others})' if others else ''} in {source}, measured by: "
               f"{best.command}{unavailable}")
        if best.speedup < 1.0:
            why += f"; it measured slower than plain decoding on {backend}"
        choice = DrafterChoice(pick, table[pick].folder, k, n, why, best, auto=True)
        if choice.plain_when_sampling:
            choice = dataclasses.replace(choice, why=f"{why}; {choice.plain_when_sampling}")
        return choice
    pick = available[0]  # ngram is always there
    k = draft_len or table[pick].draft_len
    lack = source if figures is None else f"{source} has no figures for {backend}"
    why = (f"auto picked {pick} at draft length {k}: {lack}, so the first available in the "
           f"fallback order {', '.join(_order(backend))}{unavailable}")
    return DrafterChoice(pick, table[pick].folder, k, n, why, auto=True)


def _order(backend: str) -> tuple[str, ...]:
    return FALLBACK_ORDER.get(backend, FALLBACK_ORDER["gpu"])


def pair_with_drafter(loaded: LoadedModel, choice: DrafterChoice,
                      producer_for: Callable[[LoadedModel], BlockProducer],
                      dtype: Any = None) -> SpeculativePair:
    """The loaded target paired with the chosen drafter.

    Args:
      loaded: the target as loaded (:func:`~turbospark_jax.io.loading.load_folder`).
      choice: from :func:`choose_drafter`.
      producer_for: builds a producer for a loaded model (the caller's capacity and width);
        a draft model gets one too.
      dtype: the drafter's weights' dtype (as the target's).

    Raises:
      ModelLoadError: the drafter's folder cannot be loaded.
      BadInputError: the drafter cannot pair with this target (named).
    """
    kind = choice.drafter
    if kind == "ngram":
        target = producer_for(loaded)
        return SpeculativePair(target, NGramDrafter(target.vocab_size, max_n=choice.ngram))
    if kind == "mtp":
        target = producer_for(loaded)
        return SpeculativePair(target, MTPDrafter(target))
    if choice.folder is None:
        raise BadInputError(f"the {kind} drafter needs its folder")
    if kind == "draft-model":
        small = load_folder(choice.folder, dtype=dtype, layer_layout="list")
        return SpeculativePair(producer_for(loaded), DraftModelDrafter(producer_for(small)))
    if kind == "block":
        config, params = load_block_drafter(choice.folder, dtype=dtype)
        target = producer_for(dataclasses.replace(
            loaded, model=tapped_target(loaded.model, config)))
        return SpeculativePair(target, BlockDrafter(target, config, params))
    config, params = load_assistant(choice.folder, dtype=dtype)
    if not isinstance(loaded.model, Gemma4Model):
        raise BadInputError("a Gemma 4 assistant drafts for a Gemma 4 model only")
    target = producer_for(dataclasses.replace(
        loaded, model=dataclasses.replace(loaded.model, keep_hidden_rows=True)))
    return SpeculativePair(target, Gemma4AssistantDrafter(target, config, params))
