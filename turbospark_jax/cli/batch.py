"""Many completions in one run (``--prompts-file``, ``-n``), decoded together on the device.

The run drives the server's scheduler (:class:`~turbospark_jax.server.engine.Engine`) in this
thread: up to :data:`MAX_ROWS` completions share each batched decode step, and prompts are fed
several to a prefill call. Each completion's tokens are what it would get alone (the engine's
guarantee), so batching changes the time a run takes, not its text. Records are printed in the
order of the prompts (and, for each, of ``-n``), each as soon as it and those before it are done.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, TextIO

from turbospark_jax.cli.arguments import PROG
from turbospark_jax.cli.output import completion_record, write_record
from turbospark_jax.cli.progress import CompileClock, Spinner

#: The most completions one decode step advances together.
MAX_ROWS = 8

#: The line between completions of ``-n`` printed as text.
SEPARATOR = "-" * 8


@dataclasses.dataclass
class _Job:
    index: int  # the prompt's place in the file
    sample: int  # which of -n
    text: str
    ids: list[int]
    result: Any = None  # Done or Failed


def run_batch(args: argparse.Namespace, target: Any, tok: Any,
              prompts: list[tuple[str, list[int]]], cache: Any, stdout: TextIO,
              stderr: TextIO) -> int:
    """Decode every prompt ``args.num_completions`` times, in batches; returns the exit
    status (1 when any completion failed)."""
    from turbospark_jax import cli
    from turbospark_jax.server.engine import Engine
    from turbospark_jax.server.requests import Done, ServeRequest

    jobs = [_Job(i, k, text, ids) for i, (text, ids) in enumerate(prompts)
            for k in range(args.num_completions)]
    longest = max(len(job.ids) for job in jobs)
    spinner = Spinner(stderr)
    clock = cli._Clock()
    try:
        with CompileClock() as setup:
            started = time.perf_counter()
            spinner.set(f"loading {target.path}")
            loaded = cli._load(target.path, args)
            producer = cli._block_producer(loaded, args, cli._capacity(args, longest))
            clock.load_s = time.perf_counter() - started
            stops = cli._stop_ids(loaded)
            rows = min(len(jobs), MAX_ROWS)
            engine = Engine(producer, slots=rows, tokenizer=tok, max_waiting=len(jobs),
                            prefill_rows=min(4, rows), prefill_chunk=max(64, args.width))
            spinner.set("compiling")
            started = time.perf_counter()
            # The prefill and decode programs (with log-probabilities when asked for), on a
            # two-token prompt.
            warm = dataclasses.replace(cli._request(args, jobs[0].ids[:2], []), max_tokens=2,
                                       stop_strings=(), logprobs=None)
            _drain(engine, [ServeRequest(warm, top_logprobs=args.logprobs)])
            clock.compile_s = time.perf_counter() - started
        spinner.done()
        if args.stats:
            print(cli._setup_line(cache, setup), file=stderr, flush=True)
        requests = [ServeRequest(dataclasses.replace(
            cli._request(args, job.ids, stops), seed=args.seed + job.sample, logprobs=None),
            top_logprobs=args.logprobs) for job in jobs]
        started = time.perf_counter()
        failed = 0
        written = 0

        def keep(job: _Job, event: Any) -> None:
            job.result = event

        for job, request in zip(jobs, requests, strict=True):
            engine.submit(request, lambda e, job=job: _end(job, e, keep))
        while written < len(jobs):
            if engine.idle and jobs[written].result is None:
                raise RuntimeError("the scheduler went idle with completions outstanding")
            engine.run_once()
            while written < len(jobs) and jobs[written].result is not None:
                job = jobs[written]
                failed += not isinstance(job.result, Done)
                _write(args, job, tok, clock, stdout, first=written == 0)
                written += 1
        seconds = time.perf_counter() - started
    finally:
        spinner.done()
    if args.stats:
        generated = sum(j.result.completion.usage.generated_tokens for j in jobs
                        if isinstance(j.result, Done))
        print(f"[batch] {len(jobs)} completion{'s' if len(jobs) != 1 else ''} of "
              f"{len(prompts)} prompt{'s' if len(prompts) != 1 else ''}, up to {rows} decoded "
              f"together: {generated} tokens in {seconds:.2f}s "
              f"({generated / seconds if seconds > 0 else 0.0:.1f} tok/s); load "
              f"{clock.load_s:.2f}s, compile {clock.compile_s:.2f}s", file=stderr, flush=True)
    if failed:
        print(f"{PROG}: error: {failed} of {len(jobs)} completions failed (see their "
              "records)", file=stderr, flush=True)
    return 1 if failed else 0


def _end(job: _Job, event: Any, keep: Any) -> None:
    from turbospark_jax.server.requests import Delta

    if not isinstance(event, Delta):
        keep(job, event)


def _drain(engine: Any, requests: list[Any]) -> None:
    """Run ``requests`` to the end (the warm-up)."""
    for request in requests:
        engine.submit(request, lambda _e: None)
    while not engine.idle:
        engine.run_once()


def _write(args: argparse.Namespace, job: _Job, tok: Any, clock: Any, stdout: TextIO, *,
           first: bool) -> None:
    from turbospark_jax.server.requests import Done

    head: dict[str, Any] = {}
    if args.prompts_file is not None:
        head = {"index": job.index, "prompt": job.text}
    if args.num_completions > 1:
        head["sample"] = job.sample
    if not isinstance(job.result, Done):
        write_record(stdout, {**head, "error": job.result.message})
        return
    if args.json or args.prompts_file is not None:
        record = completion_record(job.result.completion, tok,
                                   logprobs=job.result.logprobs if args.logprobs is not None
                                   else None, **head)
        write_record(stdout, record)
        return
    stdout.write(("" if first else f"{SEPARATOR}\n") + job.result.completion.text + "\n")
    stdout.flush()
