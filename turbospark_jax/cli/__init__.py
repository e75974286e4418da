"""The turbospark-jax command: ``main`` and the run (modules: ``arguments`` for the parser and
the checks that need no model, ``progress`` for what stderr shows while it works, ``interrupt``
for Ctrl-C, ``output`` for JSON records, ``batch`` for many completions decoded together).

turbospark-jax generate "def fibonacci(n):" streams a completion from the embedded default
model; --model PATH takes any supported Hugging Face folder. --speculative drafts with the best
drafter the model has (``turbospark_jax.speculative.choice``), --drafter names one (--draft-model
PATH, --block-drafter PATH and --ngram N name theirs); --chat keeps one session across turns
read from standard input and reports prefix reuse; --prompts-file and -n decode many
completions together and print JSON lines.

The whole command line, the model's config.json and tokenizer are checked before any weights
load, so a mistake costs no load time; ``--help``, ``--version`` and a mistyped flag import no
JAX. Errors print one line and exit with status 1, never a traceback; Ctrl-C prints one line and
exits with 130 at any moment. Compiled programs persist in a per-user cache
(:mod:`turbospark_jax.core.compile_cache`), so a second run skips most of its compile.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from turbospark_jax.cli.arguments import (
    AUTO,
    PROG,
    CommandLineError,
    check_arguments,
    check_cache_flags,
    check_serve_arguments,
    parser,
    user_words,
)
from turbospark_jax.cli.arguments import chat_loop as is_chat_loop
from turbospark_jax.cli.interrupt import INTERRUPTED, exit_on_interrupt
from turbospark_jax.cli.progress import Bar, CompileClock, Spinner
from turbospark_jax.errors import BadInputError, ModelLoadError, TurbosparkError

__all__ = ["DEFAULT_DRAFT", "DEFAULT_TARGET", "embedded_model_path", "main"]


def __getattr__(name: str) -> Any:
    # The loader's names, re-exported without importing it (it imports JAX).
    if name in ("DEFAULT_DRAFT", "DEFAULT_TARGET", "embedded_model_path"):
        from turbospark_jax.io import loading

        return getattr(loading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _plural(count: int, noun: str) -> str:
    """``1 token``, ``2 tokens``, ``1,193 tokens``."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


@dataclasses.dataclass(frozen=True)
class _Folder:
    """What a model folder says before its weights are read."""

    path: Path
    config: dict[str, Any]

    @property
    def max_positions(self) -> int | None:
        value = self.config.get("max_position_embeddings")
        return value if isinstance(value, int) and value > 0 else None


def _read_folder(path: Path, flag: str) -> _Folder:
    """``config.json`` of ``path`` (the loader checks the rest of it, before any weights).

    Raises:
      CommandLineError: the folder does not exist.
      ModelLoadError: no config.json, or not a JSON object.
    """
    if path.is_file():
        raise CommandLineError(f"{flag} {path}: a file, not a folder (a model is a folder "
                               "holding config.json)")
    if not path.is_dir():
        raise CommandLineError(f"{flag} {path}: no such folder")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"no config.json in {path}; {flag} needs a Hugging Face folder")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path} must hold a JSON object")
    return _Folder(path, config)


def _read_tokenizer(folder: _Folder) -> Any:
    from turbospark_jax.io.tokenizer import TOKENIZER_FILE, Tokenizer

    if not (folder.path / TOKENIZER_FILE).is_file():
        raise ModelLoadError(
            f"{folder.path} has no {TOKENIZER_FILE}; the command line needs a tokenizer to "
            "read text (use the Python API with token ids instead)"
        )
    return Tokenizer.from_folder(folder.path)


def _check_length(args: argparse.Namespace, folder: _Folder, prompt_tokens: int,
                  stderr: TextIO, context: int | None = None) -> None:
    """Refuse (or, with --allow-long-context, warn about) a prompt plus --max-tokens beyond the
    model's positions, and anything beyond --context. With ``context`` (a chat session's
    allocation) the prompt is the session's first turn, of at least one token."""
    need = prompt_tokens + args.max_tokens
    limit = folder.max_positions
    prompt = (f"the prompt ({_plural(prompt_tokens, 'token')})" if context is None else
              "a chat turn (at least 1 token)")
    if limit is not None and need > limit:
        what = (f"{prompt} plus --max-tokens {args.max_tokens:,} "
                f"needs {need:,} positions, beyond the {limit:,} the model was made for "
                "(max_position_embeddings in its config.json)")
        if not args.allow_long_context:
            raise CommandLineError(
                f"{what}; shorten the prompt, lower --max-tokens, or pass --allow-long-context"
            )
        print(f"{PROG}: warning: {what}; output past {limit:,} positions may be garbage, and "
              "a long prompt takes a while on a CPU", file=stderr, flush=True)
    context = args.context if context is None else context
    if context is not None and need > context:
        raise CommandLineError(
            f"--context {context:,} is too small: {prompt} plus --max-tokens "
            f"{args.max_tokens:,} needs {need:,} positions"
        )


def _speculative_note(args: argparse.Namespace, on_cpu: bool, choice: Any) -> str | None:
    """One line when the drafter chosen may be slower than plain decoding on a CPU: it runs as
    asked, but the user hears why. The figures are the model folder's ``speculative.json``
    (what :func:`~turbospark_jax.speculative.choice.choose_drafter` read); a drafter without
    figures there gets the general reason (its wider programs compile longer)."""
    if not on_cpu or choice is None:
        return None
    drafter, flag = choice.drafter, args.drafter_flag
    if choice.measured is not None:
        if choice.measured.speedup >= 1.0:
            return None
        return (f"on a CPU, {flag} ({drafter}) measured {choice.measured.speedup:.2f}x plain "
                f"decoding for this model at draft length {choice.measured.draft_len} "
                "(speculative.json); it runs as asked; --draft-len sets the proposals per round")
    if drafter not in ("draft-model", "ngram"):
        return None  # a drafter trained for its target: no reason to doubt it unmeasured
    return (
        f"on a CPU, {flag} ({drafter}) may be slower than plain decoding: this model's "
        "speculative.json has no figures for it on a CPU, and a drafting run compiles wider "
        "programs than plain decoding; it runs as asked; --draft-len sets the proposals per "
        "round"
    )


#: Prompt tokens from which a CPU's exact prefill earns a hint about --parallel-prefill.
LONG_PREFILL_TOKENS = 512


def _prefill_note(args: argparse.Namespace, on_cpu: bool, prompt_tokens: int) -> str | None:
    """One line when a long prompt will take the slow exact prefill on a CPU."""
    if (not on_cpu or args.parallel_prefill or not args.exact
            or prompt_tokens < LONG_PREFILL_TOKENS
            or args.prefill_width != args.width):
        return None
    return (
        f"a {prompt_tokens:,}-token prompt prefills exactly, {args.width} row(s) per step on a "
        "CPU; --parallel-prefill is several times faster, equal to the exact path within "
        "tolerance"
    )


@dataclasses.dataclass
class _Clock:
    """The command's own timings, for --stats and --json."""

    load_s: float = 0.0
    compile_s: float = 0.0


def _load(path: Path, args: argparse.Namespace) -> Any:
    from turbospark_jax.io.loading import load_folder

    # One dict per layer: inside the block program's loop XLA copies slices of stacked
    # weights (docs/decisions/0011-listed-layers.md).
    return load_folder(path, dtype=args.dtype, layer_layout="list", plan=args.plan,
                       quantize=args.quantization, kv_dtype=args.kv_dtype)


def _block_producer(loaded: Any, args: argparse.Namespace, capacity: int) -> Any:
    from turbospark_jax.engine.producer import BlockProducer

    # A draft model runs XLA's kernels: its prefill stays at --width.
    wide = args.prefill_width if loaded.model.widths_agree else args.width
    return BlockProducer(loaded.model, loaded.params, capacity=capacity, width=args.width,
                         donate=True, prefill_width=wide)


def _capacity(args: argparse.Namespace, prompt_tokens: int | None) -> int:
    """``--context``, or the smallest power of two (>= 256) holding prompt and reply: decode
    attends over the whole preallocated context, so a tight one is faster."""
    if args.context is not None:
        return args.context
    if prompt_tokens is None:
        return 2048  # a chat grows turn by turn
    need = prompt_tokens + args.max_tokens + args.width
    return max(256, 1 << (need - 1).bit_length())


def _assemble(args: argparse.Namespace, target: _Folder, choice: Any,
              spinner: Spinner, capacity: int) -> tuple[Any, list[int], Any]:
    """(producer to drive, stop ids, vision tower or None): the target loaded, paired with
    the drafter chosen."""
    from turbospark_jax.speculative.choice import pair_with_drafter

    spinner.set(f"loading {target.path}")
    loaded = _load(target.path, args)
    if choice is None:
        return _block_producer(loaded, args, capacity), _stop_ids(loaded), loaded.vision
    spinner.set(f"loading the {choice.drafter} drafter")
    pair = pair_with_drafter(loaded, choice, lambda m: _block_producer(m, args, capacity),
                             dtype=args.dtype)
    return pair, _stop_ids(loaded), loaded.vision


def _stop_ids(loaded: Any) -> list[int]:
    stops = set(loaded.generation_config.eos_token_ids)
    if loaded.tokenizer is not None and loaded.tokenizer.eos_token_id is not None:
        stops.add(loaded.tokenizer.eos_token_id)
    return sorted(stops)


def _request(args: argparse.Namespace, prompt_ids: Sequence[int], stops: Sequence[int],
             **fields: Any) -> Any:
    from turbospark_jax.generation.completion import CompletionRequest

    return CompletionRequest(
        prompt_ids=list(prompt_ids),
        max_tokens=args.max_tokens,
        stop_token_ids=list(stops),
        stop_strings=list(args.stop),
        sampling=args.sampling,
        seed=args.seed,
        # Progress is told per chunk: 16 blocks of the program keep it moving on a CPU; a
        # chunk holds at least one block of the widest prefill program.
        prefill_chunk_size=max(64, 16 * args.width, args.prefill_width),
        parallel_prefill=args.parallel_prefill or not args.exact,
        draft_len=args.draft_len if args.drafting else None,
        logprobs=args.logprobs,
        stop_at_block_end=bool(args.block_end),
        constraint=getattr(args, "constraint", None),
        **fields,
    )


def _warm_up(producer: Any, request: Any) -> None:
    """Compile every program the run will call, on a scratch state, so that the run's
    prefill and decode timings are not compile time: a two-token prompt (a drafter is primed
    on all but the last prompt token) for the exact prefill, whose programs do not depend on
    the prompt's length; the whole prompt for the parallel prefill, whose pass is as wide as
    the prompt (rounded up to a power of two); enough tokens for a second decode burst."""
    from turbospark_jax.generation.completion import BurstSizer
    from turbospark_jax.generation.driver import stream_completion

    ids = request.prompt_ids if request.parallel_prefill else request.prompt_ids[:2]
    # Past the first burst, so that a second one is chained to it as in a longer run.
    most = BurstSizer.FIRST + 2 + (request.draft_len or 0)
    tiny = dataclasses.replace(request, prompt_ids=list(ids),
                               max_tokens=min(request.max_tokens, most),
                               stop_token_ids=[], stop_strings=[], injection=None,
                               stop_at_block_end=False, constraint=None)
    stream_completion(producer, tiny).drain()


def _stats_line(completion: Any, clock: _Clock, run_compile_s: float) -> str:
    """One line: counts, then load, compile (the warm-up), prefill and decode apart."""
    u, t = completion.usage, completion.timings
    prefill_rate = u.prefilled_tokens / t.prefill_s if t.prefill_s > 0 else 0.0
    line = (
        f"[{completion.finish_reason.value}] prompt {_plural(u.prompt_tokens, 'token')} "
        f"(reused {u.reused_tokens}, prefilled {u.prefilled_tokens}), generated "
        f"{u.generated_tokens}; load {clock.load_s:.2f}s, compile {clock.compile_s:.2f}s, "
        f"prefill {t.prefill_s:.2f}s ({prefill_rate:.1f} tok/s), first token "
        f"{t.first_token_s:.2f}s, decode {t.decode_s:.2f}s "
        f"({t.decode_tokens_per_s(u.generated_tokens):.1f} tok/s)"
    )
    if run_compile_s >= 0.01:
        line += f"; {run_compile_s:.2f}s of the run went to compiling"
    if completion.error:
        line += f"; error: {completion.error}"
    return line


def _setup_line(cache: Any, compiling: CompileClock) -> str:
    """``[setup] backend cpu (1 x cpu); compile cache DIR: 9 programs read back, 2
    compiled and written``."""
    import jax

    devices = jax.devices()
    line = (f"[setup] backend {jax.default_backend()} ({len(devices)} x "
            f"{devices[0].device_kind if devices else 'none'}); {cache.describe()}")
    if cache.folder is not None:
        line += (f": {_plural(compiling.cache_hits, 'program')} read back, "
                 f"{compiling.cache_writes} compiled and written")
    return line


def _vision_settings(target: _Folder) -> tuple[dict[str, Any], int] | None:
    """The folder's ``vision_config`` and per-image soft-token budget (``None``: no tower)."""
    vision = target.config.get("vision_config")
    if target.config.get("model_type") != "gemma4" or not isinstance(vision, dict):
        return None
    budget = 280
    with contextlib.suppress(OSError, ValueError, AttributeError), open(
            target.path / "processor_config.json", encoding="utf-8") as f:
        budget = json.load(f).get("image_processor", {}).get("max_soft_tokens", budget)
    return vision, budget


def _image_tokens(args: argparse.Namespace, target: _Folder) -> int:
    """Prompt positions the images will fill (each span and its two frame tokens), from the
    folder's settings alone, so a prompt that will not fit is refused before loading.

    Raises:
      CommandLineError: images for a folder without a vision tower.
    """
    if not args.image:
        return 0
    settings = _vision_settings(target)
    if settings is None:
        raise CommandLineError(f"--image needs a model with a vision tower; {target.path} is a "
                               "text-only model")
    from turbospark_jax.io.images import prepare

    vision, budget = settings
    return sum(prepare(path, patch_size=vision.get("patch_size", 16),
                       pooling_kernel_size=vision.get("pooling_kernel_size", 3),
                       max_soft_tokens=budget).soft_tokens + 2 for path in args.image)


def _check_image_markers(args: argparse.Namespace, target: _Folder, tok: Any,
                         text: str) -> None:
    """Refuse a prompt whose image tokens do not match the --image count, before loading."""
    if not args.image:
        return
    marker = tok.id_to_token(int(target.config.get("image_token_id", 258_880)))
    placed = text.count(marker) if marker else 0
    if placed and placed != len(args.image):
        raise CommandLineError(
            f"the prompt places {_plural(placed, 'image')} ({marker}) but "
            f"{_plural(len(args.image), '--image')} {'was' if len(args.image) == 1 else 'were'} "
            "given; give one --image per image token, or leave the tokens out to put every "
            "image first")


def _with_markers(text: str, args: argparse.Namespace, target: _Folder, tok: Any) -> str:
    """A --chat message with one image token per --image before the text, unless the text
    already places them."""
    if not args.image:
        return text
    marker = tok.id_to_token(int(target.config.get("image_token_id", 258_880)))
    if marker is None or text.count(marker) == len(args.image):
        return text
    return marker * len(args.image) + "\n" + text


def _prompt_text(args: argparse.Namespace, stdin: TextIO, stderr: TextIO) -> str:
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file is not None:
        text = _read_text(args.prompt_file, "--prompt-file", stdin)
    else:
        if stdin.isatty():
            print(f"[{PROG}] reading the prompt from standard input (end it with Ctrl-D)",
                  file=stderr, flush=True)
        text = stdin.read()
    if not text:
        raise CommandLineError("the prompt is empty")
    return text


def _read_text(path: str, flag: str, stdin: TextIO) -> str:
    if path == "-":
        return stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CommandLineError(f"{flag} {path}: not UTF-8 text ({exc.reason} at byte "
                               f"{exc.start})") from exc


def _templated(args: argparse.Namespace, target: _Folder, tok: Any, text: str) -> str:
    """The prompt through the model's chat template when --chat or --system asks for it."""
    if not (args.chat or args.system is not None):
        return text
    head = [] if args.system is None else [{"role": "system", "content": args.system}]
    try:
        return tok.apply_chat_template(
            [*head, {"role": "user", "content": _with_markers(text, args, target, tok)}],
            add_generation_prompt=True)
    except BadInputError as exc:
        flag = "--system" if args.system is not None else "--chat"
        raise CommandLineError(f"{flag}: {exc}") from exc


def _use_cache(args: argparse.Namespace) -> Any:
    """The compile cache the flags (or the environment) ask for, and beside it the store of
    whole block programs (its ``programs`` folder), which a warm run reads back untraced."""
    from turbospark_jax.core.compile_cache import (
        program_store,
        use_compile_cache,
        use_program_store,
    )

    args.previous_store = program_store()  # given back when the command ends
    if args.no_compile_cache:
        setting = use_compile_cache(False)
    else:
        try:
            setting = use_compile_cache(args.compile_cache if args.compile_cache else True)
        except BadInputError as exc:
            raise CommandLineError(f"--compile-cache: {exc}") from exc
    use_program_store(None if setting.folder is None else setting.folder / "programs")
    return setting


def _note(message: str, stderr: TextIO, kind: str = "note") -> None:
    """``turbospark-jax: note: ...``, wrapped to the terminal's width on a terminal."""
    line = f"{PROG}: {kind}: {message}"
    if stderr.isatty():
        import shutil

        line = textwrap.fill(line, width=max(40, shutil.get_terminal_size().columns - 1),
                             subsequent_indent="  ")
    print(line, file=stderr, flush=True)


def _generate(args: argparse.Namespace, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    check_arguments(args)
    target = _read_folder(Path(args.model) if args.model else _embedded(), "--model")
    if args.block_end is None:
        args.block_end = _folder_stops_at_block_end(target)
    cache = _use_cache(args)
    import jax

    from turbospark_jax.io.loading import serving_plan

    args.plan = serving_plan(target.path, args.exact)  # the kernels, before any weights
    on_cpu = jax.default_backend() == "cpu"
    asked_len = args.draft_len
    choice = _choose(args, target, jax.default_backend())
    if (choice is not None and asked_len is None and args.sampling.temperature > 0
            and choice.plain_when_sampling):
        # auto's drafter measured sampled decoding slower than plain: decode plainly
        _note(f"{args.drafter_flag}: {choice.plain_when_sampling}", stderr)
        choice, args.drafting, args.draft_len = None, False, None
    tok = _read_tokenizer(target)
    if args.dtype is None and on_cpu:
        args.dtype = "float32"
    if args.width is None:
        from turbospark_jax.api import default_width

        args.width = default_width(args.drafting, args.draft_len or 4, args.plan.widths_agree)
    _set_prefill_width(args)
    if args.batched:
        from turbospark_jax.cli.batch import run_batch

        prompts = _batch_prompts(args, target, tok, stdin, stderr)
        return run_batch(args, target, tok, prompts, cache, stdout, stderr)
    chat_loop = is_chat_loop(args)
    image_tokens = _image_tokens(args, target)
    ids: list[int] = []
    if not chat_loop:
        text = _prompt_text(args, stdin, stderr)
        _check_image_markers(args, target, tok, text)
        text = _templated(args, target, tok, text)
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            raise CommandLineError("the prompt is empty")
        _check_length(args, target, len(ids) + image_tokens, stderr)
    else:
        # A session's first turn needs at least one prompt token beside the reply.
        _check_length(args, target, 1, stderr, _capacity(args, None))
    for note in (_speculative_note(args, on_cpu, choice),
                 _prefill_note(args, on_cpu, len(ids))):
        if note is not None:
            _note(note, stderr)
    if choice is not None and choice.warning is not None:
        _note(choice.warning, stderr, "warning")

    spinner = Spinner(stderr)
    clock = _Clock()
    try:
        with CompileClock() as setup:
            started = time.perf_counter()
            producer, stops, vision = _assemble(
                args, target, choice, spinner,
                _capacity(args, None if chat_loop else len(ids) + image_tokens))
            clock.load_s = time.perf_counter() - started
            injection = None
            if args.image and not chat_loop:
                spinner.set("encoding images")
                ids, injection = vision.prompt(ids, args.image)
            request = _request(args, ids or [tok.bos_token_id or 0] * 2, stops,
                               injection=injection)
            spinner.set("compiling")
            started = time.perf_counter()
            _warm_up(producer, request)
            clock.compile_s = time.perf_counter() - started
        spinner.done()
        if args.stats:
            print(_setup_line(cache, setup), file=stderr, flush=True)
        if chat_loop:
            return _chat_loop(args, producer, tok, stops, stdin, stdout, stderr, vision)
        return _complete(args, producer, request, tok, clock, stdout, stderr, choice)
    finally:
        spinner.done()


def _embedded() -> Path:
    from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path

    return embedded_model_path(DEFAULT_TARGET)


#: The key of a folder's ``generation_config.json`` that turns --block-end on by default.
BLOCK_END_KEY = "stop_at_block_end"


def _folder_stops_at_block_end(target: _Folder) -> bool:
    """Whether the folder's ``generation_config.json`` asks code completions to stop at the
    end of the block they open (the embedded code models do)."""
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((target.path / "generation_config.json").read_text("utf-8"))
        return isinstance(config, dict) and config.get(BLOCK_END_KEY) is True
    return False


def _batch_prompts(args: argparse.Namespace, target: _Folder, tok: Any, stdin: TextIO,
                   stderr: TextIO) -> list[tuple[str, list[int]]]:
    """(text as given, token ids) of every prompt of a batched run, each checked against the
    model's positions before anything loads."""
    from turbospark_jax.cli.output import read_prompts

    if args.prompts_file is not None:
        texts = read_prompts(_read_text(args.prompts_file, "--prompts-file", stdin),
                             args.prompts_file)
    else:
        texts = [_prompt_text(args, stdin, stderr)]
    prompts = []
    for i, text in enumerate(texts):
        ids = tok.encode(_templated(args, target, tok, text), add_special_tokens=False)
        if not ids:
            raise CommandLineError(f"--prompts-file: prompt {i + 1} is empty")
        _check_length(args, target, len(ids), stderr)
        prompts.append((text, ids))
    return prompts


def _set_prefill_width(args: argparse.Namespace) -> None:
    """Set ``args.prefill_width``: ``--prefill-width``, or its default for ``--width`` and
    the model's kernel plan.

    Raises:
      CommandLineError: a value below ``--width``, or other than it where the plan's widths
        do not agree.
    """
    from turbospark_jax.api import default_prefill_width
    from turbospark_jax.engine.sizing import check_prefill_width

    if args.prefill_width is None:
        args.prefill_width = default_prefill_width(args.width, args.plan.widths_agree)
    try:
        check_prefill_width(args.prefill_width, args.width, args.plan.widths_agree)
    except BadInputError as exc:
        raise CommandLineError(user_words(str(exc))) from exc


def _choose(args: argparse.Namespace, target: _Folder, backend: str) -> Any:
    """The drafter for the run (``None``: no drafting asked for), from the model folder's
    configs alone; sets ``args.draft_len`` to its draft length.

    Raises:
      CommandLineError: a folder named on the command line is not there, or the drafter
        asked for is not available for the model (why, in one line).
    """
    from turbospark_jax.speculative.choice import choose_drafter

    if args.requested_drafter is None:
        return None
    folders = {}
    for flag, drafter, path in (("--draft-model", "draft-model", args.draft_model),
                                ("--block-drafter", "block", args.block_drafter)):
        if path:
            _read_folder(Path(path), flag)
            folders[drafter] = Path(path)
    try:
        choice = choose_drafter(target.path, args.requested_drafter, backend,
                                folders=folders, draft_len=args.draft_len, ngram=args.ngram)
    except BadInputError as exc:
        raise CommandLineError(f"{args.drafter_flag}: {exc}") from exc
    args.draft_len = choice.draft_len
    return choice


def _complete(args: argparse.Namespace, producer: Any, request: Any, tok: Any, clock: _Clock,
              stdout: TextIO, stderr: TextIO, choice: Any = None) -> int:
    """One completion streamed to stdout (or, with --json, printed as one record), progress
    on stderr, --stats after it."""
    from turbospark_jax.cli.output import completion_record, write_record
    from turbospark_jax.generation.driver import stream_completion

    show = args.progress or stderr.isatty()
    prefill_bar = Bar(show, stderr, "prefill", len(request.prompt_ids))
    generate_bar = None
    with CompileClock() as compiling:
        stream = stream_completion(producer, request, tokenizer=tok,
                                   progress=lambda done, _total: prefill_bar.to(done))
        generated = 0
        try:
            for event in stream:
                if generate_bar is None:
                    prefill_bar.close()
                    # Text on a terminal is its own progress; a redirected stdout gets a bar.
                    generate_bar = Bar(show and (args.json or not stdout.isatty()), stderr,
                                       "generate", request.max_tokens)
                generated += len(event.token_ids)
                generate_bar.to(generated)
                if not args.json:
                    stdout.write(event.text)
                    stdout.flush()
        finally:
            prefill_bar.close()
            if generate_bar is not None:
                generate_bar.close()
    result = stream.result
    if args.json:
        write_record(stdout, completion_record(result, tok, load_s=clock.load_s,
                                               compile_s=clock.compile_s))
    else:
        stdout.write("\n")
        stdout.flush()
    if args.stats or result.error:
        print(_stats_line(result, clock, compiling.seconds), file=stderr, flush=True)
        if choice is not None:
            print(f"[drafter] {choice.why}", file=stderr, flush=True)
        if result.speculative is not None:
            print(result.speculative.summary(), file=stderr, flush=True)
    return 1 if result.error else 0


#: What a --chat session from a terminal prints before each turn (on stderr).
CHAT_PROMPT = ">>> "
#: The line after each reply of a --chat session read from a pipe or file.
CHAT_SEPARATOR = "-" * 8


def _chat_loop(args, producer, tok, stops, stdin, stdout, stderr, vision=None) -> int:
    """One session across turns: each line of stdin is a user turn. On a terminal each turn
    is asked for with a prompt marker; from a pipe or file each reply is followed by a
    separator line. ``/reset`` starts the conversation over, ``/exit`` ends it."""
    from turbospark_jax.sessions.chat import ChatSession, default_stop_ids
    from turbospark_jax.sessions.session_pool import SessionPool

    pool = SessionPool(producer, slots=args.slots)
    request = _request(args, [0], stops)
    settings = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)
                if f.name not in ("prompt_ids", "injection")}
    settings["stop_token_ids"] = sorted({*stops, *default_stop_ids(tok)})
    session = ChatSession(pool, tok, session_id="cli", vision=vision, system=args.system,
                          **settings)
    interactive = stdin.isatty()
    if interactive:
        print(f"[{PROG}] chat: one message a line; /reset starts over, /exit or Ctrl-D ends",
              file=stderr, flush=True)
    images = list(args.image)  # shown with the first turn
    for line in _turns(stdin, stderr, interactive):
        command = line.strip()
        if command == "/exit":
            break
        if command == "/reset":
            session.reset()
            print("[turn] the conversation starts over", file=stderr, flush=True)
            continue
        stream = session.stream(line, images)
        images = []
        for event in stream:
            stdout.write(event.text)
            stdout.flush()
        stdout.write("\n" if interactive else f"\n{CHAT_SEPARATOR}\n")
        stdout.flush()
        print(f"[turn] {stream.result.summary()}", file=stderr, flush=True)
    return 0


def _turns(stdin: TextIO, stderr: TextIO, interactive: bool) -> Iterator[str]:
    """The user's non-blank lines; on a terminal each asked for with :data:`CHAT_PROMPT`
    (with line editing and history where ``readline`` is available)."""
    if not interactive:
        yield from _lines(stdin)
        return
    if stdin is sys.stdin:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (input() then edits lines and keeps history)
    while True:
        stderr.write(CHAT_PROMPT)
        stderr.flush()
        line = stdin.readline() if stdin is not sys.stdin else _input()
        if line is None or line == "":
            stderr.write("\n")
            return
        line = line.rstrip("\n")
        if line.strip():
            yield line


def _input() -> str | None:
    try:
        return input() + "\n"
    except EOFError:
        return None


def _serve(args: argparse.Namespace, stderr: TextIO) -> int:
    """``turbospark-jax serve``: load the model, then serve until interrupted."""
    check_serve_arguments(args)
    check_cache_flags(args)
    try:
        from turbospark_jax.server.build import load_server
    except ImportError as exc:
        raise CommandLineError(
            f"serve needs the serve extra ({exc.name} is missing): "
            "pip install 'turbospark-jax[serve]'"
        ) from exc
    cache = _use_cache(args)
    import jax

    devices = jax.local_devices()
    if args.replicas > len(devices):
        raise CommandLineError(
            f"--replicas {args.replicas} needs {args.replicas} devices, one a replica; this "
            f"machine has {_plural(len(devices), jax.default_backend() + ' device')}")
    dtype = args.dtype if args.dtype is not None or jax.default_backend() != "cpu" else "float32"
    print(f"{PROG}: loading {args.model or 'the embedded model'} ({cache.describe()})",
          file=stderr, flush=True)
    server = load_server(args.model, slots=args.session_slots, context=args.context,
                         width=args.width, dtype=dtype, draft=args.draft_model,
                         ngram=args.ngram or 0, drafter=AUTO if args.speculative else None,
                         model_name=args.served_name, max_waiting=args.max_waiting,
                         prefill_chunk=args.prefill_chunk, prefill_rows=args.prefill_rows,
                         replicas=args.replicas, quantize=args.quantization,
                         kv_dtype=args.kv_dtype)
    if server.drafter is not None:
        print(f"[drafter] {server.drafter.why}", file=stderr, flush=True)
    replicas = f" x {args.replicas} replicas" if args.replicas > 1 else ""
    url = f"http://{args.host}:{args.port}"
    print(f"{PROG}: compiling every program before serving ({url}/health answers 503 "
          f"'starting' until then)", file=stderr, flush=True)

    def ready() -> None:
        print(f"{PROG}: serving {server.config.model_name!r} with {args.session_slots} slots"
              f"{replicas} on {url}/v1", file=stderr, flush=True)

    server.run(host=args.host, port=args.port, on_ready=ready,
               shutdown_grace=args.shutdown_grace)
    return 0


def _lines(stdin: TextIO) -> Iterator[str]:
    for line in stdin:
        line = line.rstrip("\n")
        if line.strip():
            yield line


def main(argv: Sequence[str] | None = None, *, stdin: TextIO | None = None,
         stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Entry point; returns the exit status (0, 1 for any error; Ctrl-C ends the process with
    130 at once, see :mod:`~turbospark_jax.cli.interrupt`)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with exit_on_interrupt(PROG, stderr):
        try:
            with contextlib.redirect_stdout(stdout):  # --help and --version
                args = parser().parse_args(argv)
            try:
                if args.command == "serve":
                    return _serve(args, stderr)
                return _generate(args, stdin, stdout, stderr)
            finally:
                if "previous_store" in args:  # a caller's own store (or none) again
                    from turbospark_jax.core.compile_cache import use_program_store

                    use_program_store(args.previous_store)
        except SystemExit as exc:  # --help, --version
            return exc.code if isinstance(exc.code, int) else 0
        except CommandLineError as exc:
            print(f"{PROG}: error: {exc}", file=stderr, flush=True)
            return 1
        except (TurbosparkError, OSError, ValueError) as exc:
            print(f"{PROG}: error: {user_words(str(exc))}", file=stderr, flush=True)
            return 1
        except KeyboardInterrupt:  # outside the main thread, where no handler was set
            print(f"{PROG}: interrupted", file=stderr, flush=True)
            return INTERRUPTED
