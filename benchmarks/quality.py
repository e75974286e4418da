"""What quantizing the weights costs in quality: perplexity and greedy agreement of each format
against the unquantized model, on real models over text they were not trained on.

The models are the embedded ones (``models/tsj-pycoder``, the default ``tsj.load()`` target,
and ``models/tsj-pycoder-draft``, a second, dense model; there is no real checkpoint of a
published shape here). Each loads as ``tsj.load(quantize=...)`` loads it
(:func:`~turbospark_jax.io.loading.load_folder`): the linear matrices a scheme fits stored
quantized, those it does not fit (a projection with fewer inputs than one group) and the
tied embedding left as they are; each case counts both.

The text is the recipe's held-out split (:func:`turbospark_recipe.corpus.is_heldout`, by the
hash of each file's path) of the running interpreter's standard library, tokenized as the
recipe packs it (``<|bos|> file <|eos|>`` in path order). The embedded models were trained on
another interpreter's library, split by the same rule, so a held-out path here was held out
there too; its text is this interpreter's version of that file. Windows of ``window`` tokens,
evenly spaced over the stream, each run from an empty state (teacher forcing: every position
predicts the next token of the text).

Figures per format, all over the same positions: perplexity (``exp`` of the mean negative
log-likelihood of the text's next token) and its ratio to the reference's; greedy agreement,
the share of positions whose most likely next token equals the reference's; the mean
KL divergence from the reference's next-token distribution to the format's. The reference is
the unquantized model computing in float32 (the stored bfloat16 weights, widened exactly);
quantized formats compute in float32 too, so their figures are the quantization's alone. The
``bfloat16`` row is the unquantized model computing in bfloat16: the size of a difference
that rounding alone makes.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common

#: The reference computes in this dtype; quantized formats dequantize to it.
REFERENCE = "float32"
#: A format that computes the unquantized model in bfloat16 (no quantization).
HALF = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Preset:
    #: folders under the repository's ``models/``
    models: tuple[str, ...]
    #: ``tsj.load``'s ``quantize`` names, or :data:`HALF`
    formats: tuple[str, ...]
    #: windows of text, evenly spaced over the held-out stream
    windows: int
    #: tokens each window predicts (the models' trained context is 1024)
    window: int
    #: windows in one forward call
    batch: int


_FORMATS = (HALF, "int8", "int4", "int4-g64", "int4-g32", "fp8", "fp8-block")
_FULL = Preset(("tsj-pycoder", "tsj-pycoder-draft"), _FORMATS, 64, 1024, 4)
PRESETS = {
    "smoke": Preset(("tsj-pycoder-draft",), ("int8", "int4-g32"), 2, 64, 2),
    "cpu": _FULL,
    "h100": _FULL,
    "h200": _FULL,
}
MODELS = Path(__file__).resolve().parent.parent / "models"


def heldout_text() -> tuple[list[Any], dict[str, Any]]:
    """The held-out documents and what they are."""
    import platform

    from turbospark_recipe.corpus import load_corpus

    corpus = load_corpus()
    about = {"text": "the recipe's held-out split of the running interpreter's standard "
                     f"library (CPython {platform.python_version()})",
             "heldout_fraction": corpus.heldout_fraction,
             "files": len(corpus.heldout),
             "characters": sum(len(d.text) for d in corpus.heldout)}
    return list(corpus.heldout), about


def windows_of(ids: np.ndarray, count: int, window: int) -> np.ndarray:
    """``count`` windows of ``window + 1`` tokens, evenly spaced over ``ids`` and never
    overlapping (fewer when the stream is short): int32 ``[n, window + 1]``."""
    span = window + 1
    count = min(count, len(ids) // span)
    if count == 0:
        from turbospark_jax.errors import BadInputError

        raise BadInputError(f"{len(ids)} tokens hold no window of {span}")
    stride = (len(ids) - span) // max(1, count - 1) if count > 1 else 0
    return np.stack([ids[i * stride:i * stride + span] for i in range(count)]).astype(np.int32)


def load(folder: Path, fmt: str | None) -> Any:
    """The model as ``tsj.load`` would hold it: ``fmt`` None for the reference."""
    from turbospark_jax.io.loading import load_folder

    dtype = HALF if fmt == HALF else REFERENCE
    return load_folder(folder, dtype=dtype, layer_layout="list",
                       quantize=None if fmt in (None, HALF) else fmt)


def matrix_counts(loaded: Any) -> dict[str, Any]:
    """How many of the family's linear matrices the load stored quantized, how many it kept,
    and the bits a quantized weight takes as stored (values, scales, zero points)."""
    import jax

    from turbospark_jax.models.registry import family_of_config
    from turbospark_jax.quant.weights import is_quantized

    family = family_of_config(loaded.config)
    linear = sum(1 for t in family.hf_tensors(loaded.config)
                 if t.linear and t.key[-1] != "lm_head")
    quantized = [w for w in jax.tree.leaves(loaded.params, is_leaf=is_quantized)
                 if is_quantized(w)]
    per_layer = sum(int(np.prod(w.lead or (1,))) for w in quantized)
    elements = sum(w.k * w.n * int(np.prod(w.lead or (1,))) for w in quantized)
    bits = 8 * sum(w.stored_bytes for w in quantized) / elements if elements else None
    return {"quantized_matrices": per_layer, "kept_matrices": linear - per_layer,
            "bits_per_quantized_weight": None if bits is None else round(bits, 3)}


def forward(loaded: Any) -> Any:
    """The jitted teacher-forced pass: int32 ``[B, T]`` -> float32 logits ``[B, T, V]``."""
    import jax

    return jax.jit(loaded.model.forward)


@dataclasses.dataclass
class Tally:
    """Sums over positions of one format's figures."""

    nll: float = 0.0
    agree: int = 0
    kl: float = 0.0
    positions: int = 0

    def add(self, logits: Any, targets: Any, ref_logp: Any, ref_top: Any) -> None:
        import jax.numpy as jnp

        logp = _log_softmax(logits)
        self.nll -= float(jnp.take_along_axis(logp, targets[..., None], -1).sum())
        self.agree += int((jnp.argmax(logits, -1) == ref_top).sum())
        self.kl += float((jnp.exp(ref_logp) * (ref_logp - logp)).sum())
        self.positions += int(targets.size)

    def figures(self, reference: Tally | None) -> dict[str, Any]:
        ppl = math.exp(self.nll / self.positions)
        out: dict[str, Any] = {"positions": self.positions, "perplexity": round(ppl, 5)}
        if reference is not None:
            ref = math.exp(reference.nll / reference.positions)
            out.update(perplexity_ratio=round(ppl / ref, 5),
                       greedy_agreement=round(self.agree / self.positions, 5),
                       mean_kl=float(f"{self.kl / self.positions:.4g}"))
        return out


def _log_softmax(logits: Any) -> Any:
    import jax

    return jax.nn.log_softmax(logits.astype("float32"), axis=-1)


def run(preset: Preset, results: common.Results) -> None:
    import jax

    from turbospark_recipe.corpus import encode_documents

    docs, about = heldout_text()
    results.data["meta"]["text"] = about
    for name in preset.models:
        folder = MODELS / name
        try:
            reference = load(folder, None)
        except Exception as exc:  # a missing model folder is a result, not a crash
            results.data["errors"].append({"model": name,
                                           "error": f"{type(exc).__name__}: {exc}"[:600]})
            results.write()
            continue
        rows = windows_of(encode_documents(reference.tokenizer, docs), preset.windows,
                          preset.window)
        formats: dict[str, tuple[Any, Any, dict[str, Any]]] = {}
        for fmt in preset.formats:
            try:
                loaded = load(folder, fmt)
                counts = {} if fmt == HALF else matrix_counts(loaded)
                formats[fmt] = (loaded.params, forward(loaded), counts)
            except Exception as exc:  # a scheme the model cannot take: recorded, next
                results.data["errors"].append({"model": name, "format": fmt,
                                               "error": f"{type(exc).__name__}: {exc}"[:600]})
                results.write()
        ref_fn = forward(reference)
        ref_tally = Tally()
        tallies = {fmt: Tally() for fmt in formats}
        for i in range(0, len(rows), preset.batch):
            block = jax.numpy.asarray(rows[i:i + preset.batch])
            inputs, targets = block[:, :-1], block[:, 1:]
            ref_logits = ref_fn(reference.params, inputs)
            ref_logp = _log_softmax(ref_logits)
            ref_top = jax.numpy.argmax(ref_logits, -1)
            ref_tally.add(ref_logits, targets, ref_logp, ref_top)
            for fmt, (params, fn, _) in formats.items():
                tallies[fmt].add(fn(params, inputs), targets, ref_logp, ref_top)
        label = {"model": name, "windows": len(rows), "window": preset.window}
        results.add({**label, "format": REFERENCE, "quantized": False,
                     **ref_tally.figures(None)})
        for fmt, tally in tallies.items():
            results.add({**label, "format": fmt, "quantized": fmt != HALF,
                         **formats[fmt][2], **tally.figures(ref_tally)})
        jax.clear_caches()
