"""The short way in: load a model folder as a ready producer, then generate or stream text.

::

    import turbospark_jax as tsj

    model = tsj.load()                                   # the embedded default model
    print(tsj.generate(model, "def fibonacci(n):", max_tokens=64).text)
    for event in tsj.stream(model, "import os", max_tokens=32):
        print(event.text, end="")

    fast = tsj.load(drafter="auto")                      # with its best measured drafter
    quick = tsj.load(exact=False)                        # speed over bitwise identity
    vlm = tsj.load("path/to/gemma4")                     # a folder with a vision tower
    tsj.generate(vlm, "<|image|> What is in the picture?", images=["cat.png"])

Everything here is built from the layers below it (loading, the block producer, drafters,
:func:`~turbospark_jax.generation.driver.stream_completion`); reach for those when you need a state,
a session pool or a custom drafter.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax

from turbospark_jax.core.checks import as_bool, as_int, as_token_ids
from turbospark_jax.core.compile_cache import ensure_compile_cache
from turbospark_jax.core.constraints import ConstraintSpec
from turbospark_jax.core.protocols import LogitProducer
from turbospark_jax.core.sampling import SamplingConfig, is_greedy
from turbospark_jax.core.streams import Stream
from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.engine.sizing import check_prefill_width
from turbospark_jax.errors import BadInputError
from turbospark_jax.generation.completion import Completion, CompletionRequest
from turbospark_jax.generation.driver import stream_completion
from turbospark_jax.io.images import as_list as as_image_list
from turbospark_jax.io.loading import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    LoadedModel,
    embedded_model_path,
    load_folder,
    serving_plan,
)
from turbospark_jax.io.vision import VisionEncoder, require_vision
from turbospark_jax.quant.kv import check_kv_dtype
from turbospark_jax.quant.weights import Quantization
from turbospark_jax.speculative.choice import (
    DrafterChoice,
    choose_drafter,
    pair_with_drafter,
    requested_drafter,
)
from turbospark_jax.speculative.drafters import MAX_DRAFT

__all__ = ["Model", "generate", "load", "stream"]

#: Sampling settings :func:`generate` and :func:`stream` accept as keywords.
_SAMPLING = tuple(f.name for f in dataclasses.fields(SamplingConfig))


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model, ready to generate.

    Fields:
      producer: the producer to drive (a :class:`~turbospark_jax.speculative.pair.SpeculativePair`
        when a drafter was asked for).
      tokenizer: the folder's tokenizer (``None`` when it has none: pass token ids then).
      stop_token_ids: the ids that end a reply (end of sequence, from the folder).
      loaded: the target as loaded (config, params, generation config, path).
      drafter: the drafter paired with it, its draft length (:func:`stream`'s default) and
        why it was picked (``None``: no drafter).
      prefill_width: the most rows one block of the target's exact prefill holds; a
        request's default prefill chunk is at least this long, so a chunk fills its blocks
        (``None``: the request's own default).
      exact: whether the model was loaded exact (:func:`load`); when not, a request
        prefills in parallel passes unless it says otherwise.
    """

    producer: LogitProducer
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    loaded: LoadedModel
    drafter: DrafterChoice | None = None
    prefill_width: int | None = None
    exact: bool = True

    @property
    def vision(self) -> VisionEncoder | None:
        """The vision tower (``None``: a text-only model, or no folder behind the model)."""
        return None if self.loaded is None else self.loaded.vision


def default_width(drafting: bool, draft_len: int = 4, widths_agree: bool = False) -> int:
    """Rows of the block program. Where programs of different widths disagree (XLA's
    kernels) every path must run the one program, so 16 on an accelerator, where a step
    reads the weights once whatever the width, and on a CPU, where every row costs compute,
    1, or room for one verify. Where they agree (a row-invariant plan), decode's own width
    on every backend: 1, or room for one verify."""
    if jax.default_backend() != "cpu" and not widths_agree:
        return 16
    return draft_len + 1 if drafting else 1


def default_prefill_width(width: int, widths_agree: bool = False) -> int:
    """The most rows one block of the exact prefill holds. Where programs of different widths
    disagree, ``width``: a program of another width would round differently. Where they
    agree a row gets the same bits in a block of any width, so wide blocks, which read the
    weights once for all their rows (and on a CPU fill the row-invariant forms' fixed-shape
    row tiles, which a narrow block pays for in full): 2048 rows on an accelerator, where a
    matrix product of that many rows costs little more than its weight reads, and 256 on a
    CPU, where every row costs its own compute; never below ``width``."""
    if not widths_agree:
        return width
    return max(width, 256 if jax.default_backend() == "cpu" else 2048)


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    drafter: str | None = None,
    draft: str | os.PathLike[str] | bool | None = None,
    block_drafter: str | os.PathLike[str] | None = None,
    ngram: int = 0,
    dtype: str | None = None,
    context: int | None = None,
    width: int | None = None,
    draft_len: int | None = None,
    exact: bool = True,
    prefill_width: int | None = None,
    quantize: str | Quantization | None = None,
    kv_dtype: str | None = None,
) -> Model:
    """Load a Hugging Face folder (default: the embedded model) as a ready producer.

    Args:
      path: the model folder; ``None`` for the embedded default model.
      drafter: ``"auto"`` for the drafter the folder's figures measured fastest on this
        backend (:mod:`~turbospark_jax.speculative.choice`), or one by name: ``"draft-model"``,
        ``"ngram"``, ``"mtp"``, ``"block"``, ``"assistant"``; ``None``: no drafter unless one
        of the next three asks for one.
      draft: a draft model folder for speculative decoding, or ``True`` for the embedded
        draft model (``drafter="draft-model"`` with that folder).
      block_drafter: a block drafter folder trained for this model
        (:func:`~turbospark_jax.io.drafter_folders.save_block_drafter`): the target then records the
        layers it reads, and it proposes a block per pass (``drafter="block"``).
      ngram: draft by prompt lookup with n-grams up to this length (0: off; with
        ``drafter="ngram"`` the default is 3).
      dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``; default: the folder's own on an
        accelerator, float32 on a CPU (XLA's CPU bfloat16 matrix products are slow).
      context: positions a state holds; default: the model's ``max_position_embeddings``,
        at most 4096.
      width: rows of the block program (:func:`default_width`).
      draft_len: proposals per round: :func:`stream`'s default and what the width leaves room
        for on a CPU (default: the drafter's best measured, else 4).
      exact: keep every path bitwise equal to token-by-token decoding (the default): a
        dense model then runs the row-invariant kernels, so any ``width`` gives the same
        tokens and logits and the prefill runs in wide blocks; a family without them runs
        at one program width (on the backend's kernels where it has some: Qwen3.5's
        delta-rule walk, grouped experts). ``False`` trades that identity for speed: a
        request prefills in parallel passes (its logits equal the exact path's to rounding,
        not bitwise; a request may still ask for the exact prefill), and off a GPU a dense
        model decodes on XLA's own kernels, faster there than the row-invariant forms (on a
        GPU the row-invariant kernels are the faster ones either way, except that a
        quantized model's decode products run on the CUDA cores, which no wide block sums
        alike; :func:`~turbospark_jax.kernels.plan.kernel_plan`).
      prefill_width: the most rows one block of the target's exact prefill holds
        (:class:`~turbospark_jax.engine.producer.BlockProducer`); default
        :func:`default_prefill_width`: wide blocks (the same bits, faster) where the
        target's widths agree, else ``width``. :func:`stream` then prefills in chunks of at
        least this many tokens. Another value than ``width`` needs widths that agree; a
        draft model, whose kernels are XLA's, prefills at ``width``.
      quantize: store the target's linear weights quantized: ``"int8"`` (per output
        channel), ``"int4"`` (groups of 128 rows with zero points; ``"int4-g32"``,
        ``"int4-g64"`` for smaller groups), ``"fp8"`` (e4m3 per output channel) or
        ``"fp8-block"`` (e4m3, 128 x 128 blocks), or a
        :class:`~turbospark_jax.quant.weights.Quantization`; see the quantization guide.
        Every exactness guarantee holds within the quantized model.
      kv_dtype: store the target's KV cache quantized: ``"int8"`` or ``"fp8"`` (e4m3), one
        byte a value with a float32 scale a row and KV head, so a context takes about half
        the cache memory of a 16-bit one (:mod:`~turbospark_jax.quant.kv`); ``None``: the
        model dtype. Every exactness guarantee holds within the model loaded so; its logits
        differ from the unquantized cache's by the rounding of the stored rows.

    Compiled programs persist in a per-user cache folder, so the next process that builds the
    same programs reads them back (:mod:`~turbospark_jax.core.compile_cache`;
    ``TURBOSPARK_COMPILE_CACHE=off`` or :func:`turbospark_jax.use_compile_cache` turns it
    off or moves it).

    Raises:
      ModelLoadError: the folder (or a drafter's folder) cannot be loaded (named, with the
        reason).
      BadInputError: options that ask for two different drafters, a drafter the model does
        not have (why), or a value of the wrong kind (checked before any weights are read); a
        block drafter made for another target; ``exact`` not a bool; a ``prefill_width``
        below ``width``, or other than ``width`` where the target's widths do not agree.
      ContextOverflowError: a state of ``context`` positions does not fit the device.
    """
    if not (draft is None or isinstance(draft, bool | str | os.PathLike)):
        raise BadInputError(
            f"draft must be a folder path, True (the embedded draft model) or None, got "
            f"{type(draft).__name__}"
        )
    if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 0:
        raise BadInputError(f"ngram must be an integer >= 0 (0 = off), got {ngram!r}")
    if not (block_drafter is None or isinstance(block_drafter, str | os.PathLike)):
        raise BadInputError(f"block_drafter must be a folder path or None, got "
                            f"{type(block_drafter).__name__}")
    if not (drafter is None or isinstance(drafter, str)):
        raise BadInputError(f"drafter must be a drafter's name or 'auto', got {drafter!r}")
    asked = (
        (drafter is not None, f"drafter={drafter!r}", drafter),
        (bool(draft), "draft=...", "draft-model"),
        (block_drafter is not None, "block_drafter=...", "block"),
        (bool(ngram), f"ngram={ngram}", "ngram"),
    )
    requested = requested_drafter([(spelled, kind) for on, spelled, kind in asked if on])
    if dtype is not None and not isinstance(dtype, str):
        raise BadInputError(f"dtype must be a str such as 'bfloat16', got {dtype!r}")
    if context is not None:
        as_int("context", context, low=1)
    if width is not None:
        as_int("width", width, low=1)
    if draft_len is not None:
        as_int("draft_len", draft_len, low=1, high=MAX_DRAFT)
    if prefill_width is not None:
        as_int("prefill_width", prefill_width, low=1)
    exact = as_bool("exact", exact)
    quantization = Quantization.parse(quantize)
    ensure_compile_cache()  # compiled programs persist (core.compile_cache; off by choice)
    kv_dtype = check_kv_dtype(kv_dtype)
    on_cpu = jax.default_backend() == "cpu"
    dtype = dtype if dtype is not None or not on_cpu else "float32"
    target_path = embedded_model_path(DEFAULT_TARGET) if path is None else path
    plan = serving_plan(target_path, exact)
    choice = None
    if requested is not None:
        folders: dict[str, Any] = {}
        if draft:
            folders["draft-model"] = embedded_model_path(DEFAULT_DRAFT) if draft is True else draft
        if block_drafter is not None:
            folders["block"] = block_drafter
        choice = choose_drafter(target_path, requested, jax.default_backend(), folders=folders,
                                draft_len=draft_len, ngram=ngram or None)
    width = width if width is not None else default_width(
        choice is not None, choice.draft_len if choice is not None else 4, plan.widths_agree)
    if prefill_width is None:
        prefill_width = default_prefill_width(width, plan.widths_agree)
    check_prefill_width(prefill_width, width, plan.widths_agree)
    loaded = load_folder(target_path, dtype=dtype, layer_layout="list", plan=plan,
                         quantize=quantization, kv_dtype=kv_dtype)
    capacity = context if context is not None else min(
        loaded.config.max_position_embeddings, 4096
    )

    def producer_for(m: LoadedModel) -> BlockProducer:
        wide = prefill_width if m.model.widths_agree else width  # a draft model: XLA's
        return BlockProducer(m.model, m.params, capacity=capacity, width=width, donate=True,
                             prefill_width=wide)

    producer: LogitProducer = (producer_for(loaded) if choice is None else
                               pair_with_drafter(loaded, choice, producer_for, dtype))
    stops = set(loaded.generation_config.eos_token_ids)
    if loaded.tokenizer is not None and loaded.tokenizer.eos_token_id is not None:
        stops.add(loaded.tokenizer.eos_token_id)
    return Model(producer=producer, tokenizer=loaded.tokenizer,
                 stop_token_ids=tuple(sorted(stops)), loaded=loaded, drafter=choice,
                 prefill_width=prefill_width, exact=exact)


def stream(
    model: Model,
    prompt: str | Sequence[int],
    *,
    max_tokens: int = 128,
    stop: Sequence[str] = (),
    seed: int = 0,
    draft_len: int | None = None,
    images: Sequence[Any] = (),
    json_schema: Any = None,
    regex: str | None = None,
    grammar: str | None = None,
    **settings: Any,
) -> Stream[Completion]:
    """Start generating; iterate for text events, then read ``.result``.

    Args:
      model: from :func:`load`.
      prompt: text (encoded with the model's tokenizer) or token ids. With ``images``, put
        one image token (``<|image|>`` for Gemma 4) where each image goes, in order; a
        prompt with none gets them all at its start. Each grows into the image's span.
      images: image files, bytes or Pillow images (a model with a vision tower only;
        decoded without drafting).
      json_schema, regex, grammar: at most one, what the generated text must match: a JSON
        schema (a dict or its JSON text), a regular expression over the whole text, or a
        Lark grammar (``docs/guides/structured-output.md``). A constrained request ends
        with ``constraint_end`` once the text is complete; with a drafter it runs host
        rounds that emit the tokens plain constrained decoding emits.
      max_tokens: the most tokens to generate.
      stop: stop strings (a single str is one stop string).
      seed: the sampling seed (same seed, same output).
      draft_len: proposals per speculative round (0: decode plainly; default: the draft
        length the model's drafter was loaded with, or 0 for a sampled request when
        ``auto`` picked a drafter whose figures measured sampled decoding slower than plain:
        ``model.drafter.plain_when_sampling`` says so).
      **settings: sampling settings (``temperature``, ``top_k``, ``top_p``, ``min_p``,
        ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``) or other
        :class:`~turbospark_jax.generation.completion.CompletionRequest` fields
        (``parallel_prefill`` defaults to on for a model loaded with ``exact=False``).

    Raises:
      BadInputError: an unknown setting, text for a model without a tokenizer, images for a
        model without a vision tower, an unreadable image, image spans that do not match the
        images, a schema, regex or grammar the engine refuses (named), or any invalid request
        value.
    """
    if not isinstance(model, Model):
        raise BadInputError(f"model must come from turbospark_jax.load(), got "
                            f"{type(model).__name__}")
    if isinstance(stop, str):
        stop = (stop,)  # one stop string, not one per character
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise BadInputError("this model has no tokenizer; pass the prompt as token ids")
        ids = model.tokenizer.encode(prompt, add_special_tokens=False)
    else:
        ids = as_token_ids("prompt", prompt, model.producer.vocab_size)
    constraint = ConstraintSpec.of(json_schema=json_schema, regex=regex, grammar=grammar)
    if constraint is not None:
        settings["constraint"] = constraint
    images = as_image_list(images)
    require_vision(model.vision, len(images))
    injection = None
    if images:
        assert model.vision is not None
        ids, injection = model.vision.prompt(ids, images)
    sampling = {k: settings.pop(k) for k in list(settings) if k in _SAMPLING}
    fields = {f.name for f in dataclasses.fields(CompletionRequest)} - {"injection"}
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise BadInputError(
            f"unknown setting(s) {unknown}; sampling settings are {list(_SAMPLING)}, request "
            f"fields {sorted(fields - {'prompt_ids', 'sampling'})}"
        )
    settings.setdefault("stop_token_ids", model.stop_token_ids)
    if not model.exact:
        settings.setdefault("parallel_prefill", True)
    if model.prefill_width is not None:
        settings.setdefault("prefill_chunk_size",
                            max(CompletionRequest.prefill_chunk_size, model.prefill_width))
    config = SamplingConfig(**sampling)
    if draft_len is None and model.drafter is not None:
        # to_params validates the settings (a BadInputError naming a bad one) before reading them
        plain = model.drafter.plain_when_sampling and not is_greedy(config.to_params())
        draft_len = 0 if plain else model.drafter.draft_len
    request = CompletionRequest(
        prompt_ids=ids, max_tokens=max_tokens, stop_strings=stop, seed=seed,
        sampling=config, draft_len=draft_len, injection=injection, **settings,
    )
    return stream_completion(model.producer, request, tokenizer=model.tokenizer)


def generate(model: Model, prompt: str | Sequence[int], **settings: Any) -> Completion:
    """Generate to the end and return the completion (arguments as for :func:`stream`)."""
    return stream(model, prompt, **settings).drain()
