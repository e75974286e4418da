"""The ``turbospark-jax`` command.

``turbospark-jax generate "def fibonacci(n):"`` streams a completion from the embedded default
model; ``--model PATH`` takes any supported Hugging Face folder. ``--speculative`` drafts with
the embedded draft model (or ``--draft-model PATH``, or ``--ngram N`` prompt lookup);
``--chat`` keeps one session across turns read from standard input and reports prefix reuse.
Errors print one line and exit with status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from turbospark_jax.errors import TurbosparkError
from turbospark_jax.loading import DEFAULT_DRAFT, DEFAULT_TARGET, embedded_model_path


class _Spinner:
    """A progress line on stderr while loading and compiling (silent when not a terminal)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._label = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.perf_counter()

    def set(self, label: str) -> None:
        self._label = label
        if not self._stream.isatty():
            print(f"[turbospark-jax] {label}", file=self._stream, flush=True)
        elif self._thread is None:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()

    def _spin(self) -> None:
        frames = "|/-\\"
        i = 0
        while not self._stop.wait(0.1):
            elapsed = time.perf_counter() - self._t0
            self._stream.write(f"\r{frames[i % 4]} {self._label} ({elapsed:.1f}s)\x1b[K")
            self._stream.flush()
            i += 1

    def done(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._stream.write("\r\x1b[K")
            self._stream.flush()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turbospark-jax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion (or chat with --chat)")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt text")
    gen.add_argument("--model", help="a Hugging Face model folder (default: embedded model)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="apply the chat template; read turns "
                     "from stdin when no prompt is given")
    gen.add_argument("--speculative", action="store_true",
                     help="speculative decoding with the embedded draft model")
    gen.add_argument("--draft-model", help="a draft model folder for speculative decoding")
    gen.add_argument("--ngram", type=int, default=0, help="prompt-lookup drafting with n-grams "
                     "up to N")
    gen.add_argument("--draft-len", type=int, default=4, help="proposals per speculative round")
    gen.add_argument("--context", type=int, default=None,
                     help="positions to allocate (default: what prompt and reply need, at "
                          "least 256; 2048 for --chat)")
    gen.add_argument("--width", type=int, default=None,
                     help="rows of the exact block program (default: 16 on a GPU, 1 on a CPU)")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                     help="default: the model's own on a GPU, float32 on a CPU (XLA's CPU "
                          "bfloat16 matmuls are slow)")
    gen.add_argument("--parallel-prefill", action="store_true",
                     help="batched prefill (faster; equal to the exact path within tolerance)")
    gen.add_argument("--slots", type=int, default=1, help="session slots (chat)")
    gen.add_argument("--stats", action="store_true", help="print usage and timings to stderr")
    return parser


def _load(path: Path, args: argparse.Namespace, spinner: _Spinner) -> Any:
    import jax

    from turbospark_jax.loading import load_folder

    on_cpu = jax.default_backend() == "cpu"
    if args.dtype is None and on_cpu:
        args.dtype = "float32"
    if args.width is None:
        # A CPU is compute-bound: every padding row costs; a GPU reads the weights once. A
        # speculative verify of block + 1 rows should still be one call.
        drafting = args.speculative or args.draft_model or args.ngram
        args.width = (args.draft_len + 1 if drafting else 1) if on_cpu else 16
    spinner.set(f"loading {path}")
    # One dict per layer: inside the block program's loop XLA copies slices of stacked
    # weights, which measured 2.2x slower decode on the H200.
    return load_folder(path, dtype=args.dtype, layer_layout="list")


def _block_producer(loaded: Any, args: argparse.Namespace, capacity: int) -> Any:
    from turbospark_jax.block_producer import BlockProducer

    return BlockProducer(loaded.model, loaded.params, capacity=capacity, width=args.width,
                         steps_per_call=32, donate=True)


def _capacity(args: argparse.Namespace, prompt_tokens: int | None) -> int:
    """``--context``, or the smallest power of two (>= 256) holding prompt and reply: decode
    attends over the whole preallocated context, so a tight one is faster."""
    if args.context is not None:
        return args.context
    if prompt_tokens is None:
        return 2048  # a chat grows turn by turn
    need = prompt_tokens + args.max_tokens + args.width
    return max(256, 1 << (need - 1).bit_length())


def _assemble(loaded: Any, args: argparse.Namespace, spinner: _Spinner,
              capacity: int) -> tuple[Any, list[int]]:
    """(producer to drive, stop ids) for the loaded target and the drafting options."""
    from turbospark_jax.drafters import DraftModelDrafter, NGramDrafter, SpeculativePair

    producer = _block_producer(loaded, args, capacity)
    if args.speculative or args.draft_model:
        draft_path = Path(args.draft_model) if args.draft_model else embedded_model_path(
            DEFAULT_DRAFT)
        draft = _block_producer(_load(draft_path, args, spinner), args, capacity)
        producer = SpeculativePair(producer, DraftModelDrafter(draft))
    elif args.ngram:
        producer = SpeculativePair(producer, NGramDrafter(producer.vocab_size, max_n=args.ngram))
    stops = set(loaded.generation_config.eos_token_ids)
    if loaded.tokenizer.eos_token_id is not None:
        stops.add(loaded.tokenizer.eos_token_id)
    return producer, sorted(stops)


def _request(args: argparse.Namespace, prompt_ids: Sequence[int], stops: Sequence[int],
             speculative: bool) -> Any:
    from turbospark_jax.completion import CompletionRequest
    from turbospark_jax.sampling import SamplingConfig

    return CompletionRequest(
        prompt_ids=list(prompt_ids),
        max_tokens=args.max_tokens,
        stop_token_ids=list(stops),
        stop_strings=list(args.stop),
        sampling=SamplingConfig(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
        ),
        seed=args.seed,
        parallel_prefill=args.parallel_prefill,
        draft_len=args.draft_len if speculative else None,
    )


def _report(completion: Any, out: TextIO) -> None:
    u, t = completion.usage, completion.timings
    line = (
        f"[{completion.finish_reason.value}] prompt {u.prompt_tokens} (reused {u.reused_tokens}, "
        f"prefilled {u.prefilled_tokens}), generated {u.generated_tokens}; prefill "
        f"{t.prefill_s:.2f}s, decode {t.decode_tokens_per_s(u.generated_tokens):.1f} tok/s"
    )
    if completion.error:
        line += f"; error: {completion.error}"
    print(line, file=out, flush=True)
    if completion.speculative is not None:
        print(completion.speculative.summary(), file=out, flush=True)


def _generate(args: argparse.Namespace, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    from turbospark_jax.errors import BadInputError
    from turbospark_jax.generate import stream_completion

    spinner = _Spinner(stderr)
    try:
        if sum(bool(x) for x in (args.speculative, args.draft_model, args.ngram)) > 1:
            raise BadInputError("choose one of --speculative, --draft-model and --ngram")
        target_path = Path(args.model) if args.model else embedded_model_path(DEFAULT_TARGET)
        loaded = _load(target_path, args, spinner)
        tok = loaded.tokenizer
        if tok is None:
            raise BadInputError(f"{target_path} has no tokenizer.json; the CLI needs text")
        if args.chat and args.prompt is None:
            producer, stops = _assemble(loaded, args, spinner, _capacity(args, None))
            spinner.done()
            return _chat_loop(args, producer, tok, stops, stdin, stdout, stderr)
        text = args.prompt if args.prompt is not None else stdin.read()
        if args.chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        producer, stops = _assemble(loaded, args, spinner, _capacity(args, len(ids)))
        request = _request(args, ids, stops, _is_pair(producer))
        stream = stream_completion(producer, request, tokenizer=tok)
        spinner.set("compiling and prefilling")
        first = True
        for event in stream:
            if first:
                spinner.done()
                first = False
            stdout.write(event.text)
            stdout.flush()
        spinner.done()
        stdout.write("\n")
        if args.stats or stream.result.error:
            _report(stream.result, stderr)
        return 1 if stream.result.error else 0
    finally:
        spinner.done()


def _chat_loop(args, producer, tok, stops, stdin, stdout, stderr) -> int:
    """One session across turns: each line of stdin is a user turn."""
    import dataclasses

    from turbospark_jax.chat import ChatSession, default_stop_ids
    from turbospark_jax.session_pool import SessionPool

    pool = SessionPool(producer, slots=args.slots)
    request = _request(args, [0], stops, _is_pair(producer))
    settings = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)
                if f.name != "prompt_ids"}
    settings["stop_token_ids"] = sorted({*stops, *default_stop_ids(tok)})
    session = ChatSession(pool, tok, session_id="cli", **settings)
    for line in _lines(stdin):
        stream = session.stream(line)
        for event in stream:
            stdout.write(event.text)
            stdout.flush()
        stdout.write("\n")
        stdout.flush()
        print(f"[turn] {stream.result.summary()}", file=stderr, flush=True)
    return 0


def _is_pair(producer: Any) -> bool:
    from turbospark_jax.drafters import SpeculativePair

    return isinstance(producer, SpeculativePair)


def _lines(stdin: TextIO) -> Iterator[str]:
    for line in stdin:
        line = line.rstrip("\n")
        if line.strip():
            yield line


def main(argv: Sequence[str] | None = None, *, stdin: TextIO | None = None,
         stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Entry point; returns the exit status."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        return _generate(args, stdin, stdout, stderr)
    except TurbosparkError as exc:
        print(f"turbospark-jax: error: {exc}", file=stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"turbospark-jax: error: {exc}", file=stderr)
        return 1
    except KeyboardInterrupt:
        print("turbospark-jax: interrupted", file=stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
