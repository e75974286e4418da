"""The command line's words: the parser, its help, and every check that needs no model.

Parse errors and bad values raise :class:`CommandLineError` with a message in the flags' words
(``--max-tokens``, not ``max_tokens``); the command prints it as one line.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from turbospark_jax.errors import BadInputError

PROG = "turbospark-jax"

# The parser imports no JAX (``--help``, ``--version`` and a mistyped flag answer at once), so
# the speculative package's names it shows are repeated here; tests/cli checks they agree.
#: ``--drafter``'s automatic choice.
AUTO = "auto"
#: The drafters ``--drafter`` names (``turbospark_jax.speculative.figures.DRAFTERS``).
DRAFTERS = ("draft-model", "ngram", "mtp", "block", "assistant")
#: Proposals per round when nothing measured says otherwise.
DEFAULT_DRAFT_LEN = 4
#: ``--drafter ngram``'s longest n-gram.
DEFAULT_NGRAM = 3
#: The most alternatives ``--logprobs`` reports per token (the server's bound too).
MAX_LOGPROBS = 20

DESCRIPTION = (
    'turbospark-jax generate "def fibonacci(n):" streams a completion from the embedded '
    "default model; --model PATH takes any supported Hugging Face folder. --speculative drafts "
    "with the best drafter the model has (--drafter names one: draft-model, ngram, mtp, block, "
    "assistant); "
    "--chat keeps one session across turns read from standard input. The command line, the "
    "model's config.json and its tokenizer are checked before any weights load."
)

#: --exact's help.
_EXACT_HELP = (
    "keep every path bitwise equal to token-by-token decoding (the default): dense models run "
    "their row-invariant kernels, so every --width gives the same bits; --no-exact trades "
    "that for speed: a parallel prefill, and off a GPU XLA's own kernels for dense models"
)

#: The escapes --stop understands.
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|[ntr\\])")
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}

#: Sampling settings as the library names them, and as the command line does.
_SAMPLING_FLAGS = {
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "seed": "--seed",
}

#: Request and drafter names in library messages, as the command line spells them.
_REQUEST_WORDS = (
    (re.compile(r"\bmax_tokens=(\d+)"), r"--max-tokens \1"),
    (re.compile(r"\bmax_tokens\b"), "--max-tokens"),
    (re.compile(r"\bdraft_len=(\d+)"), r"--draft-len \1"),
    (re.compile(r"\bdraft_len\b"), "--draft-len"),
    (re.compile(r"\bmax_n\b"), "--ngram"),
    (re.compile(r"the producer holds (\d+)"), r"--context is \1"),
    (re.compile(r"\bexact=True\b"), "--exact"),
    (re.compile(r"\bprefill_width=(\d+)"), r"--prefill-width \1"),
    (re.compile(r"\bprefill_width\b"), "--prefill-width"),
    (re.compile(r"\bwidth=(\d+)"), r"--width \1"),
)


class CommandLineError(Exception):
    """A mistake on the command line, worded with the user's flags; printed as one line."""


class _Parser(argparse.ArgumentParser):
    """Every parse error is one ``turbospark-jax: error: ...`` line and status 1; a mistyped
    flag or command names the nearest known one."""

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(message + _suggestion(self, message))


def _known_words(parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(every flag, every command) of ``parser`` and the commands under it."""
    flags, commands = [], []
    for action in parser._actions:
        flags += [s for s in action.option_strings if s.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                commands.append(name)
                flags += _known_words(sub)[0]
    return flags, commands


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """``" (did you mean --max-tokens?)"`` for an unknown flag or command near a known one;
    ``""`` otherwise."""
    flags, commands = _known_words(parser)
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        words, known = [w.split("=")[0] for w in unknown.group(1).split()
                        if w.startswith("--")], flags
    else:
        choice = re.match(r"argument \S+: invalid choice: '([^']*)'", message)
        words, known = ([choice.group(1)], commands) if choice else ([], [])
    hints = [f"{w} -> {m}" if len(words) > 1 else m for w in words
             if (m := _nearest(w, known)) is not None]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _nearest(word: str, known: list[str]) -> str | None:
    """The known word nearest ``word``, compared without their leading dashes (which every
    flag shares); ``None`` when none is near."""
    names = {k.lstrip("-"): k for k in known}
    found = difflib.get_close_matches(word.lstrip("-"), sorted(names), n=1, cutoff=0.7)
    return names[found[0]] if found else None


class _HelpFormatter(argparse.HelpFormatter):
    """Help lines name their default, unless the default is nothing or the line says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or default == []
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Version(argparse.Action):
    """``--version``: the package, jax and the backend jax would run on."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        print(version_line())
        raise SystemExit(0)


def version_line() -> str:
    """``turbospark-jax 0.1.0, jax 0.10.2, jaxlib 0.10.2, python 3.11.9``, read from the
    installed packages' metadata without importing JAX (``--stats`` names the backend)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return (f"{PROG} {of('turbospark-jax')}, jax {of('jax')}, jaxlib {of('jaxlib')}, "
            f"python {sys.version.split()[0]}")


def unescape(text: str) -> str:
    """``\\n``, ``\\t``, ``\\r``, ``\\\\``, ``\\xNN`` and ``\\uNNNN`` as the characters they
    name (a shell passes ``"\\n"`` as two characters); any other backslash stays as it is."""

    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        return _SIMPLE_ESCAPES.get(code) or chr(int(code[1:], 16))

    return _ESCAPE.sub(one, text)


def parser() -> _Parser:
    """The ``turbospark-jax`` parser and its ``generate`` command."""
    top = _Parser(prog=PROG, description=DESCRIPTION, formatter_class=_HelpFormatter)
    top.add_argument("--version", action=_Version,
                     help="print the versions of the package, jax, jaxlib and python")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True,
                             parser_class=_Parser)
    gen = sub.add_parser(
        "generate", formatter_class=_HelpFormatter,
        help="stream a completion (or chat with --chat)",
        description="Stream a completion of PROMPT to stdout. Without PROMPT the prompt is "
                    "read from standard input (e.g. cat file.py | turbospark-jax generate); "
                    "with --chat and no PROMPT each line of standard input is a user turn. "
                    "Progress and --stats go to stderr.",
    )
    gen.add_argument("prompt", nargs="?", default=None, metavar="PROMPT",
                     help="the prompt text; read from standard input when omitted")
    gen.add_argument("--model", metavar="PATH",
                     help="a Hugging Face model folder (default: the embedded tsj-pycoder)")
    gen.add_argument("--max-tokens", type=int, default=128, metavar="N",
                     help="the most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="sampling temperature; 0 decodes greedily")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P",
                     help="nucleus sampling, in (0, 1]; 1 = off")
    gen.add_argument("--top-k", type=int, default=0, metavar="K",
                     help="keep the k likeliest tokens; 0 = off")
    gen.add_argument("--min-p", type=float, default=0.0, metavar="P",
                     help="drop tokens below min-p times the likeliest one, in [0, 1]; 0 = off")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                     help="divide the logits of tokens already seen; 1 = off")
    gen.add_argument("--seed", type=int, default=0, metavar="N",
                     help="sampling seed: the same seed gives the same output")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="end the output where TEXT appears (repeatable); \\n, \\t, \\r, "
                          "\\\\, \\xNN and \\uNNNN are read as escapes, so --stop '\\n\\n' "
                          "stops at a blank line")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image for the prompt (repeatable; a model with a vision tower). "
                          "Put one image token (<|image|> for Gemma 4) in the prompt where "
                          "each goes; without one they go first. With --chat and no PROMPT, "
                          "they go with the first turn")
    gen.add_argument("--prompt-file", metavar="PATH",
                     help="read the prompt from this file (UTF-8) instead of PROMPT")
    gen.add_argument("--prompts-file", metavar="PATH",
                     help="many prompts in one run: one per line, or JSON lines with a "
                          "\"prompt\" key (\"-\" reads standard input); writes one JSON line "
                          "per completion, in order, decoded together in batches on the device")
    gen.add_argument("--chat", action="store_true",
                     help="apply the model's chat template; without PROMPT, read one user turn "
                          "per line of stdin and keep the session across turns (/reset starts "
                          "over, /exit ends)")
    gen.add_argument("--system", metavar="TEXT",
                     help="a system prompt; applies the model's chat template (as --chat "
                          "does)")
    gen.add_argument("-n", "--num-completions", type=int, default=1, metavar="N",
                     help="completions of the prompt, decoded together in one batch; "
                          "completion k (from 0) samples with --seed + k")
    gen.add_argument("--json-schema", metavar="FILE", default=None,
                     help="the output must be one JSON value valid under the JSON schema in "
                          "FILE")
    gen.add_argument("--regex", metavar="REGEX", default=None,
                     help="the whole output must match REGEX")
    gen.add_argument("--grammar", metavar="FILE", default=None,
                     help="the output must derive from the Lark grammar in FILE (its start "
                          "rule)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per completion (text, finish reason, usage, "
                          "timings, log-probabilities) instead of the text")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help=f"report each generated token's log-probability and the N "
                          f"likeliest alternatives (0..{MAX_LOGPROBS}), under the model's raw "
                          "logits; implies --json")
    gen.add_argument("--drafter", choices=[AUTO, *DRAFTERS], default=None,
                     help="speculative decoding with this drafter: auto picks the one with the "
                          "best measured speedup on this backend (the model folder's "
                          "speculative.json; without figures, the first the model has of block, "
                          "mtp, assistant, then draft-model and ngram, in that order on a CPU, "
                          "reversed on a GPU); draft-model and block use the folder beside the "
                          "model (<model>-draft, <model>-block) unless --draft-model or "
                          "--block-drafter names one; --stats says which was picked and why; "
                          "with sampling, auto decodes plainly where its pick measured "
                          "sampling slower than plain (a note says so)")
    gen.add_argument("--speculative", action="store_true",
                     help="speculative decoding with the best drafter: --drafter auto")
    gen.add_argument("--draft-model", metavar="PATH",
                     help="--drafter draft-model with this draft model folder (same "
                          "vocabulary)")
    gen.add_argument("--block-drafter", metavar="PATH",
                     help="--drafter block with this block drafter folder (trained for the "
                          "model: it reads the model's layers and shares its embedding)")
    gen.add_argument("--ngram", type=int, default=None, metavar="N",
                     help="--drafter ngram: prompt lookup with n-grams up to N, >= 1 (default "
                          f"with --drafter ngram: {DEFAULT_NGRAM})")
    gen.add_argument("--draft-len", type=int, default=None, metavar="K",
                     help="proposals per speculative round, 1..8 (default: the draft length "
                          "that measured best for the drafter, else "
                          f"{DEFAULT_DRAFT_LEN}; a block drafter's block less one)")
    gen.add_argument("--context", type=int, default=None, metavar="N",
                     help="positions to allocate (default: the smallest power of two, at least "
                          "256, holding prompt and reply; 2048 for a --chat session)")
    gen.add_argument("--allow-long-context", action="store_true",
                     help="run a prompt plus --max-tokens beyond the model's "
                          "max_position_embeddings (with a warning) instead of refusing it")
    gen.add_argument("--width", type=int, default=None, metavar="W",
                     help="rows of the exact block program (default: 16 on a GPU; on a CPU 1, "
                          "or --draft-len + 1 when drafting; with a dense model under --exact "
                          "the CPU's rule on every backend)")
    gen.add_argument("--prefill-width", type=int, default=None, metavar="P",
                     help="the most rows one block of the exact prefill holds (default: "
                          "--width; with a dense model under --exact 2048 on a GPU, 256 on a "
                          "CPU: the same bits in fewer, wider blocks); another value than "
                          "--width needs a dense model under --exact")
    gen.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                     help=_EXACT_HELP)
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                     help="weights and activations (default: the model's own on a GPU, float32 "
                          "on a CPU, where XLA's bfloat16 matrix products are slow)")
    gen.add_argument("--parallel-prefill", action="store_true",
                     help="batched prefill: faster, equal to the exact path within tolerance")
    _quant_flags(gen)
    gen.add_argument("--block-end", action=argparse.BooleanOptionalAction, default=None,
                     help="when the prompt ends inside a def or class, stop where that block "
                          "ends (default: on for models whose folder asks for it, as the "
                          "embedded code models do)")
    gen.add_argument("--slots", type=int, default=1, metavar="N",
                     help="session slots of a --chat session pool")
    gen.add_argument("--progress", action="store_true",
                     help="show progress bars on stderr even when it is not a terminal "
                          "(default: only on a terminal; generation progress only when stdout "
                          "is not a terminal)")
    gen.add_argument("--stats", action="store_true",
                     help="print token counts and timings (load, compile, prefill, decode), "
                          "the backend and the compile cache to stderr")
    _cache_flags(gen)
    _serve_parser(sub)
    return top


def _serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve", formatter_class=_HelpFormatter,
        help="serve the OpenAI API (completions, chat, streaming) with batched decoding",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                    "/metrics. Requests in flight decode together, one device call per step "
                    "for all of them; each request's output is bitwise what it would be alone. "
                    "Needs the serve extra: pip install 'turbospark-jax[serve]'.",
    )
    serve.add_argument("--model", metavar="PATH",
                       help="a Hugging Face model folder (default: the embedded tsj-pycoder)")
    serve.add_argument("--session-slots", type=int, default=4, metavar="N",
                       help="session slots: states kept for prefix reuse, and the decode batch")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on")
    serve.add_argument("--context", type=int, default=2048, metavar="N",
                       help="positions each slot's state holds (prompt plus reply)")
    serve.add_argument("--width", type=int, default=16, metavar="W",
                       help="rows of a block of the exact prefill program: a prompt feeds W "
                            "tokens per block step (decode feeds one token a row)")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="weights and activations (default: the model's own on a GPU, "
                            "float32 on a CPU)")
    serve.add_argument("--prefill-chunk", type=int, default=64, metavar="N",
                       help="the most tokens of one prompt fed between two decode steps "
                            "(rounded up to a multiple of --width)")
    serve.add_argument("--prefill-rows", type=int, default=4, metavar="P",
                       help="prompts fed together between two decode steps, in one device call")
    serve.add_argument("--max-waiting", type=int, default=64, metavar="N",
                       help="requests that may wait for a slot; more get 429 with Retry-After")
    serve.add_argument("--speculative", action="store_true",
                       help="decode greedy requests speculatively with the model's best "
                            "drafter, chosen as generate --speculative chooses it "
                            "(unbatched, one at a time; same tokens)")
    serve.add_argument("--draft-model", metavar="PATH",
                       help="as --speculative, with this draft model folder")
    serve.add_argument("--ngram", type=int, default=None, metavar="N",
                       help="as --speculative, drafting by prompt lookup with n-grams up to N")
    serve.add_argument("--replicas", type=int, default=1, metavar="N",
                       help="data-parallel replicas, one per device, each with its own "
                            "--session-slots; a named session stays on its replica")
    serve.add_argument("--served-name", default=None, metavar="NAME",
                       help="the model id clients name (default: the folder's name)")
    serve.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, stop admitting (503) and give the requests in flight "
                            "this long to finish before cutting them off (Ctrl-C exits at once)")
    _quant_flags(serve)
    _cache_flags(serve)


def _quant_flags(command: argparse.ArgumentParser) -> None:
    command.add_argument("--quantize", metavar="SCHEME",
                         help="store the linear weights quantized: int8, int4 (int4-g32, "
                              "int4-g64 for smaller groups), fp8 or fp8-block")
    command.add_argument("--kv-dtype", choices=["int8", "fp8"], default=None,
                         help="store the attention caches in one byte a value, with a scale "
                              "per row and head: about twice the tokens in the same memory")


def quantization(args: argparse.Namespace) -> None:
    """``args.quantization``: ``--quantize`` parsed (None without it).

    Raises:
      CommandLineError: a scheme that is not one (the message names the schemes).
    """
    args.quantization = None
    if args.quantize is not None:
        from turbospark_jax.quant.weights import Quantization

        try:
            args.quantization = Quantization.parse(args.quantize)
        except BadInputError as exc:
            raise CommandLineError(f"--quantize {args.quantize}: {exc}") from exc


def _cache_flags(command: argparse.ArgumentParser) -> None:
    command.add_argument("--compile-cache", metavar="DIR", default=None,
                         help="keep compiled programs in DIR, so the next run skips their "
                              "compile (default: $TURBOSPARK_COMPILE_CACHE, else "
                              "$XDG_CACHE_HOME/turbospark_jax/jax or "
                              "~/.cache/turbospark_jax/jax)")
    command.add_argument("--no-compile-cache", action="store_true",
                         help="compile every program afresh and keep nothing")


def check_serve_arguments(args: argparse.Namespace) -> None:
    """Refuse serve flags out of range before anything loads."""
    for flag, value, low in (("--session-slots", args.session_slots, 1),
                             ("--context", args.context, 2), ("--port", args.port, 0),
                             ("--prefill-chunk", args.prefill_chunk, 1),
                             ("--prefill-rows", args.prefill_rows, 1),
                             ("--max-waiting", args.max_waiting, 0),
                             ("--replicas", args.replicas, 1),
                             ("--shutdown-grace", args.shutdown_grace, 0)):
        if value < low:
            raise CommandLineError(f"{flag} must be >= {low}, got {value}")
    if args.width < 1:
        raise CommandLineError(f"--width must be >= 1, got {args.width}")
    if args.ngram is not None and args.ngram < 1:
        raise CommandLineError(f"--ngram must be >= 1, got {args.ngram}")
    if sum(bool(x) for x in (args.speculative, args.draft_model, args.ngram)) > 1:
        raise CommandLineError("choose one drafter: --speculative, --draft-model or --ngram")
    if args.replicas > 1 and (args.speculative or args.draft_model or args.ngram):
        raise CommandLineError("speculative decoding is served by one replica only: drop the "
                               "drafter or --replicas")
    quantization(args)
    if args.port > 65535:
        raise CommandLineError(f"--port must be <= 65535, got {args.port}")
    check_port_free(args.host, args.port)


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on (or an address this host lacks) before the
    model loads, rather than after. Binds as uvicorn binds (address reuse on), then lets go."""
    import socket

    if port == 0:  # any free port
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CommandLineError(f"--host {host}: {exc.strerror}") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise CommandLineError(
                f"cannot listen on {host}:{port} ({exc.strerror}); another process may hold "
                f"it: pick another --port") from exc


def user_words(message: str, names: dict[str, str] | None = None) -> str:
    """A library message with request settings (and ``names``) spelled as flags."""
    for pattern, flag in _REQUEST_WORDS:
        message = pattern.sub(flag, message)
    for name, flag in (names or {}).items():
        message = re.sub(rf"\b{name}\b", flag, message)
    return message


def drafter_flags(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(the flag as given, the drafter it asks for)`` for every drafting flag given."""
    named = [(f"--drafter {args.drafter}", args.drafter)] if args.drafter else []
    for on, spelled, drafter in (
        (args.speculative, "--speculative", AUTO),
        (args.draft_model, f"--draft-model {args.draft_model}", "draft-model"),
        (args.block_drafter, f"--block-drafter {args.block_drafter}", "block"),
        (args.ngram is not None, f"--ngram {args.ngram}", "ngram"),
    ):
        if on:
            named.append((spelled, drafter))
    return named


def check_cache_flags(args: argparse.Namespace) -> None:
    """Refuse ``--compile-cache`` beside ``--no-compile-cache``, or naming a file."""
    if args.no_compile_cache and args.compile_cache is not None:
        raise CommandLineError("choose one: --compile-cache DIR or --no-compile-cache")
    if args.compile_cache is not None and _is_file(args.compile_cache):
        raise CommandLineError(f"--compile-cache {args.compile_cache}: a file, not a folder")


def _is_file(path: str) -> bool:
    import os

    return os.path.exists(path) and not os.path.isdir(path)


def check_arguments(args: argparse.Namespace) -> None:
    """Everything about the command line that needs no model; the checks that need no
    library module come first, so most mistakes are told before JAX is imported.

    Raises:
      CommandLineError: the first problem, in the flags' words.
    """
    if args.max_tokens < 1:
        raise CommandLineError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    for flag, value in (("--context", args.context), ("--width", args.width),
                        ("--prefill-width", args.prefill_width), ("--slots", args.slots),
                        ("--num-completions", args.num_completions)):
        if value is not None and value < 1:
            raise CommandLineError(f"{flag} must be >= 1, got {value}")
    if args.ngram is not None and args.ngram < 1:
        raise CommandLineError(
            f"--ngram must be >= 1 (the longest n-gram to look up), got {args.ngram}; leave it "
            "out to decode without drafting"
        )
    if args.logprobs is not None:
        if not 0 <= args.logprobs <= MAX_LOGPROBS:
            raise CommandLineError(f"--logprobs must be in 0..{MAX_LOGPROBS}, got "
                                   f"{args.logprobs}")
        args.json = True
    check_cache_flags(args)
    _check_prompt_sources(args)
    named = drafter_flags(args)
    args.batched = args.prompts_file is not None or args.num_completions > 1
    if args.batched:
        what = "--prompts-file" if args.prompts_file is not None else "--num-completions"
        for flag, given in ((named[0][0] if named else "", bool(named)),
                            ("--image", bool(args.image))):
            if given:
                raise CommandLineError(f"{what} decodes prompts together in batches, "
                                       f"without {flag}; drop one of them")
    if args.draft_len is not None and not named:
        raise CommandLineError(
            "--draft-len sets proposals per speculative round; it needs --drafter, "
            "--speculative, --draft-model, --block-drafter or --ngram"
        )
    if args.image and named:
        raise CommandLineError(
            f"--image decodes without drafting; drop {named[0][0]} to run a prompt with images"
        )
    args.stop = [unescape(s) for s in args.stop]
    if any(s == "" for s in args.stop):
        raise CommandLineError("--stop needs a non-empty text")
    if args.slots > 1 and not args.chat:
        raise CommandLineError("--slots sets the slots of a --chat session pool; add --chat")
    if args.json and chat_loop(args):
        raise CommandLineError("--json prints whole completions; a --chat session from "
                               "standard input prints its turns as text (drop --json)")
    _check_library_values(args, named)
    _check_constraint(args)


def _check_constraint(args: argparse.Namespace) -> None:
    """Read --json-schema, --regex or --grammar into ``args.constraint`` (``None`` when none is
    given); the engine refuses a bad one here, before any model is loaded."""
    from turbospark_jax.core.constraints import ConstraintSpec

    given = [(flag, value) for flag, value in (("--json-schema", args.json_schema),
                                               ("--regex", args.regex),
                                               ("--grammar", args.grammar)) if value is not None]
    args.constraint = None
    if not given:
        return
    if len(given) > 1:
        raise CommandLineError(f"choose one constraint: {' or '.join(f for f, _ in given)}")
    flag, value = given[0]
    # drafting keeps the constraint (its rounds emit what plain decoding emits); batches and
    # chat sessions do not take one
    for other, on in (("--chat", args.chat),
                      ("--prompts-file", args.prompts_file is not None),
                      ("--num-completions", args.num_completions > 1)):
        if on:
            raise CommandLineError(f"{flag} constrains one plain completion; drop {other}")
    if flag != "--regex":
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read()
        except OSError as exc:
            raise CommandLineError(f"{flag} {value}: {exc.strerror or exc}") from exc
    try:
        if flag == "--json-schema":
            args.constraint = ConstraintSpec.json_schema(value)
        elif flag == "--regex":
            args.constraint = ConstraintSpec.regex(value)
        else:
            args.constraint = ConstraintSpec.grammar(value)
    except BadInputError as exc:
        raise CommandLineError(f"{flag}: {exc}") from exc


def chat_loop(args: argparse.Namespace) -> bool:
    """Whether the run reads chat turns from standard input."""
    return (args.chat and args.prompt is None and args.prompt_file is None
            and args.prompts_file is None)


def _check_prompt_sources(args: argparse.Namespace) -> None:
    """At most one of PROMPT, --prompt-file and --prompts-file; a named file must exist."""
    given = [flag for flag, on in (("PROMPT", args.prompt is not None),
                                   ("--prompt-file", args.prompt_file is not None),
                                   ("--prompts-file", args.prompts_file is not None)) if on]
    if len(given) > 1:
        raise CommandLineError(f"choose one prompt: {' or '.join(given)}")
    for flag, path in (("--prompt-file", args.prompt_file), ("--prompts-file", args.prompts_file)):
        if path is not None and path != "-":
            import os

            if os.path.isdir(path):
                raise CommandLineError(f"{flag} {path}: a folder, not a file")
            if not os.path.isfile(path):
                raise CommandLineError(f"{flag} {path}: no such file")


def _check_library_values(args: argparse.Namespace, named: list[tuple[str, str]]) -> None:
    """The checks the library's own rules make (drafters, sampling, images, quantization)."""
    from turbospark_jax.core.sampling import SamplingConfig, request_key
    from turbospark_jax.speculative.choice import requested_drafter
    from turbospark_jax.speculative.drafters import MAX_DRAFT

    try:
        args.requested_drafter = requested_drafter(named)
    except BadInputError as exc:
        raise CommandLineError(str(exc)) from exc
    args.drafter_flag = named[0][0] if named else None
    args.drafting = bool(named)
    if args.draft_len is not None and not 1 <= args.draft_len <= MAX_DRAFT:
        raise CommandLineError(f"--draft-len must be in 1..{MAX_DRAFT}, got {args.draft_len}")
    from turbospark_jax.io.images import decode

    for path in args.image:
        try:
            decode(path)
        except BadInputError as exc:
            raise CommandLineError(f"--image: {exc}") from exc
    args.sampling = SamplingConfig(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
    )
    try:
        args.sampling.to_params()
        request_key(args.seed)
    except BadInputError as exc:
        raise CommandLineError(user_words(str(exc), _SAMPLING_FLAGS)) from exc
    quantization(args)
