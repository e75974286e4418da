"""What ``--json`` and ``--prompts-file`` print, and how a prompts file is read.

One JSON object a completion, written whole under the interrupt's lock
(:data:`~turbospark_jax.cli.interrupt.OUTPUT_LOCK`), so Ctrl-C never leaves half a line.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from turbospark_jax.cli.arguments import CommandLineError
from turbospark_jax.cli.interrupt import OUTPUT_LOCK


def read_prompts(text: str, path: str) -> list[str]:
    """The prompts of a ``--prompts-file``: JSON lines with a ``"prompt"`` string when every
    non-blank line is a JSON object, else one prompt per non-blank line (``\\n`` and other
    escapes stay as written: a prompt spanning lines needs JSON).

    Raises:
      CommandLineError: no prompt at all; a JSON line without a ``"prompt"`` string.
    """
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise CommandLineError(f"--prompts-file {path}: no prompts in it")
    if not all(line.lstrip().startswith("{") for _, line in lines):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CommandLineError(f"--prompts-file {path}, line {n}: not JSON ({exc.msg})") \
                from exc
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str):
            raise CommandLineError(f"--prompts-file {path}, line {n}: a JSON line needs a "
                                   '"prompt" string')
        prompts.append(prompt)
    return prompts


def logprob_records(entries: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """Each generated token's log-probability entry as JSON: its id, text, log-probability
    and the alternatives'."""

    def text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    return [{"token": e.token, "text": text(e.token), "logprob": e.logprob,
             "top": [{"token": t, "text": text(t), "logprob": lp} for t, lp in e.top]}
            for e in entries]


def completion_record(completion: Any, tokenizer: Any, *, load_s: float | None = None,
                      compile_s: float | None = None, logprobs: Any = None,
                      **head: Any) -> dict[str, Any]:
    """One completion as a JSON object: ``head`` (a batch's ``index`` and ``prompt``), the
    text, finish reason, usage, timings (the run's load and compile when given) and, when
    asked for, log-probabilities."""
    u, t = completion.usage, completion.timings
    timings = {"prefill_s": t.prefill_s, "first_token_s": t.first_token_s,
               "decode_s": t.decode_s, "total_s": t.total_s,
               "decode_tokens_per_s": t.decode_tokens_per_s(u.generated_tokens)}
    if compile_s is not None:
        timings = {"compile_s": compile_s, **timings}
    if load_s is not None:
        timings = {"load_s": load_s, **timings}
    record = {
        **head,
        "text": completion.text,
        "finish_reason": completion.finish_reason.value,
        "stop_string": completion.stop_string,
        "usage": {"prompt_tokens": u.prompt_tokens, "reused_tokens": u.reused_tokens,
                  "prefilled_tokens": u.prefilled_tokens,
                  "generated_tokens": u.generated_tokens},
        "timings": timings,
    }
    entries = logprobs if logprobs is not None else completion.logprobs
    if entries is not None:
        record["logprobs"] = logprob_records(entries, tokenizer)
    if completion.error:
        record["error"] = completion.error
    return record


def write_record(stdout: TextIO, record: dict[str, Any]) -> None:
    """``record`` as one JSON line, whole or not at all."""
    line = json.dumps(record, ensure_ascii=False) + "\n"
    with OUTPUT_LOCK:
        stdout.write(line)
        stdout.flush()
