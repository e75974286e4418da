"""The recipe's command line: ``python -m turbospark_recipe COMMAND``.

``recipe`` runs everything; ``tokenizer``, ``train``, ``pack`` and ``unpack`` run one piece.
Training length is given in epochs and resolved here into steps (see :func:`_train_config`).
Errors a user can cause (bad arguments, a missing folder, a checkpoint from other settings)
print one line, ``turbospark-jax recipe: error: ...``, and exit with status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import jax
import numpy as np

from turbospark_jax.errors import BadInputError, TurbosparkError
from turbospark_jax.io.tokenizer import Tokenizer
from turbospark_recipe.card import (
    block_drafter_card,
    card_samples,
    command_line,
    model_card,
)
from turbospark_recipe.corpus import Corpus, encode_documents, load_corpus, pack_rows
from turbospark_recipe.export import export_model
from turbospark_recipe.pack import PART_BYTES, pack_folders, unpack_parts
from turbospark_recipe.tokenizer_training import train_tokenizer
from turbospark_recipe.train import (
    PRESETS,
    TrainConfig,
    TrainResult,
    count_params,
    load_warm_start,
    model_config,
    train_model,
)

#: How every error line starts.
ERROR_PREFIX = "turbospark-jax recipe: error:"
#: Warmup steps and steps between evaluations of a run given in seconds (--*-seconds).
TIMED_WARMUP = 200
TIMED_EVAL_EVERY = 500


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors raise, so :func:`main` reports them like any
    other error (one line, status 1) instead of argparse's usage block and status 2."""

    def error(self, message: str) -> NoReturn:
        raise BadInputError(message)


def _add_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus-root", type=Path, default=None,
                   help="directory of .py files (default: this interpreter's stdlib)")
    p.add_argument("--heldout-fraction", type=float, default=0.03,
                   help="share of files held out by path hash (default 0.03)")
    p.add_argument("--max-files", type=int, default=None,
                   help="use only this many files, evenly spaced (quick runs)")
    p.add_argument("--corpus-name", default=None,
                   help="what --corpus-root holds, for the model card (e.g. 'the CPython "
                   "3.11.7 standard library')")
    p.add_argument("--packages", action="store_true",
                   help="add the permissively licensed Python sources of the installed "
                   "packages (deduplicated, vendored/generated/data files left out)")


def _add_train_args(
    p: argparse.ArgumentParser, prefix: str = "", *, epochs: float, batch_size: int, lr: float
) -> None:
    flag = f"--{prefix}" if prefix else "--"
    p.add_argument(f"{flag}epochs", type=float, default=epochs,
                   help=f"passes over the training rows (default {epochs}); sets the steps")
    p.add_argument(f"{flag}steps", type=int, default=None,
                   help="optimizer steps (overrides the epochs; with --*seconds, the most)")
    p.add_argument(f"{flag}seconds", type=float, default=None,
                   help="train for about this long: the schedule's length is set from the "
                   f"step time of the first steps (warmup default {TIMED_WARMUP} steps, "
                   f"evaluations every {TIMED_EVAL_EVERY})")
    p.add_argument(f"{flag}batch-size", type=int, default=batch_size,
                   help=f"sequences per step (default {batch_size})")
    p.add_argument(f"{flag}lr", type=float, default=lr, help=f"peak learning rate (default {lr})")
    p.add_argument(f"{flag}warmup", type=int, default=None,
                   help="warmup steps (default: 8%% of the steps)")
    p.add_argument(f"{flag}eval-every", type=int, default=None,
                   help="steps between held-out evaluations (default: 10 per run; 0: at the end)")
    p.add_argument(f"{flag}min-lr-ratio", type=float, default=TrainConfig.min_lr_ratio,
                   help="the cosine's final learning rate as a share of the peak (default "
                   f"{TrainConfig.min_lr_ratio})")
    p.add_argument(f"{flag}init", type=Path, default=None, metavar="FOLDER",
                   help="start from this model folder's weights (same preset and tokenizer, "
                   "e.g. the embedded model) with fresh optimizer moments, not a fresh init")


def _train_config(args: argparse.Namespace, num_rows: int, prefix: str = "") -> TrainConfig:
    # Training length is set in epochs by default because the corpus is whatever the
    # interpreter ships: 2.5M tokens on one machine, 8.6M on another. The resolved steps go in
    # the model card (and the checkpoint), so a run is still pinned down exactly. With
    # --*-seconds the steps are a ceiling and the run sets its own length from its step time,
    # so the warmup and the evaluations cannot be shares of the steps: they are fixed counts.
    def get(key: str) -> Any:
        return getattr(args, prefix.replace("-", "_") + key)

    batch_size = get("batch_size")
    seconds = get("seconds")
    steps = get("steps")
    if steps is None:
        steps = max(1, math.ceil(get("epochs") * (num_rows // max(batch_size, 1))))
    warmup = get("warmup")
    if warmup is None:
        warmup = TIMED_WARMUP if seconds is not None else max(1, round(0.08 * steps))
    eval_every = get("eval_every")
    if eval_every is None:
        eval_every = TIMED_EVAL_EVERY if seconds is not None else max(1, steps // 10)
    return TrainConfig(
        steps=steps,
        batch_size=batch_size,
        seq_len=args.seq_len,
        peak_lr=get("lr"),
        min_lr_ratio=get("min_lr_ratio"),
        warmup_steps=warmup,
        weight_decay=args.weight_decay,
        seed=args.seed,
        eval_every=eval_every,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every,
        head_rows=args.head_rows,
        seconds=seconds,
    )


def _add_common_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0, help="init and data-order seed")
    p.add_argument("--log-every", type=int, default=20, help="steps between loss readouts")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints (0: only at the end)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="wall-clock budget: stop, checkpoint and export before it runs out")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoints under --out (bitwise on the CPU)")
    p.add_argument("--head-rows", type=int, default=0,
                   help="a Qwen3.5 target's output-head loss this many rows at a time, "
                   "recomputed in the backward pass (less memory; default 0: all at once)")
    p.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the exported weights")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m turbospark_recipe",
        description="Train byte-level BPE tokenizers and small qwen3 models on the Python "
        "standard library, and ship them as Hugging Face folders.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    cor = sub.add_parser("corpus", help="build the corpus and report what went in and why the "
                         "rest did not, without training anything")
    cor.add_argument("--out", type=Path, default=None, help="also write the report here (JSON)")
    _add_corpus_args(cor)

    ev = sub.add_parser("evaluate", help="complete held-out function bodies greedily: the "
                        "share that parse and do not loop")
    ev.add_argument("--model", type=Path, default=None,
                    help="model folder (default: the embedded model)")
    ev.add_argument("--functions", type=int, default=200, help="how many (default 200)")
    ev.add_argument("--max-tokens", type=int, default=128,
                    help="the most tokens a body may take (default 128)")
    ev.add_argument("--header-only", action="store_true",
                    help="ask with each function's header alone, without the lines that open "
                    "its enclosing scopes (the first measurements' prompts)")
    ev.add_argument("--out", type=Path, default=None,
                    help="also write the share and every sample here (JSON)")
    ev.add_argument("--card", default=None, metavar="LABEL",
                    help="also write the shares and a few bodies into the model's card, as "
                    "section 'Function bodies: LABEL' (e.g. 'held-out split')")
    _add_corpus_args(ev)

    tok = sub.add_parser("tokenizer", help="train the tokenizer on the corpus' training split")
    tok.add_argument("--out", type=Path, required=True, help="folder for the tokenizer files")
    tok.add_argument("--vocab-size", type=int, default=8192)
    _add_corpus_args(tok)

    tr = sub.add_parser("train", help="train one model with a saved tokenizer")
    tr.add_argument("--tokenizer", type=Path, required=True, help="folder of tokenizer.json")
    tr.add_argument("--out", type=Path, required=True,
                    help="run folder: checkpoint in OUT/ckpt, model in OUT/model")
    tr.add_argument("--preset", choices=tuple(PRESETS), default="target", help="model shape")
    _add_corpus_args(tr)
    _add_common_train_args(tr)
    _add_train_args(tr, epochs=8.0, batch_size=32, lr=2e-3)

    rec = sub.add_parser("recipe", help="tokenizer, draft and target end to end")
    rec.add_argument("--out", type=Path, required=True,
                     help="run folder: OUT/tokenizer, OUT/target, OUT/draft, OUT/ckpt/*")
    rec.add_argument("--vocab-size", type=int, default=8192)
    rec.add_argument("--tokenizer", type=Path, default=None,
                     help="reuse this folder's tokenizer.json instead of training one (keeps "
                     "the vocabulary of models already trained with it)")
    rec.add_argument("--target-preset", choices=tuple(PRESETS), default="target")
    rec.add_argument("--draft-preset", choices=tuple(PRESETS), default="draft")
    rec.add_argument("--draft-share", type=float, default=0.35,
                     help="most of the training budget the draft may use (default 0.35)")
    rec.add_argument("--block-steps", type=int, default=0,
                     help="then train a block drafter for the target for this many steps "
                     "(0: none), into OUT/block")
    rec.add_argument("--block-batch-size", type=int, default=32,
                     help="target rows per block-drafter step (default 32)")
    rec.add_argument("--block-lr", type=float, default=1e-3,
                     help="the block drafter's peak learning rate (default 1e-3)")
    rec.add_argument("--block-share", type=float, default=0.2,
                     help="share of the time budget the block drafter gets when it trains "
                     "(default 0.2)")
    rec.add_argument("--draft-from", type=Path, default=None, metavar="FOLDER",
                     help="take this trained draft folder as the run's draft (copied as it is, "
                     "same tokenizer) instead of training one")
    rec.add_argument("--pack-out", type=Path, default=None,
                     help="also pack the trained folders into 15 MiB parts here")
    _add_corpus_args(rec)
    _add_common_train_args(rec)
    _add_train_args(rec, "target-", epochs=8.0, batch_size=32, lr=2e-3)
    _add_train_args(rec, "draft-", epochs=8.0, batch_size=32, lr=3e-3)

    pk = sub.add_parser("pack", help="tar.gz folders into parts of at most --part-mib MiB")
    pk.add_argument("folders", type=Path, nargs="+")
    pk.add_argument("--out", type=Path, required=True)
    pk.add_argument("--name", default="models")
    pk.add_argument("--part-mib", type=float, default=PART_BYTES / 2**20)

    up = sub.add_parser("unpack", help="check and extract parts written by pack")
    up.add_argument("parts", type=Path, help="folder with NAME.tar.gz.part-* and the manifest")
    up.add_argument("--to", type=Path, required=True, help="destination folder")
    up.add_argument("--name", default="models")
    return parser


def _timed(timings: dict[str, float], key: str, t0: float) -> float:
    now = time.monotonic()
    timings[key] = round(now - t0, 2)
    print(f"[time] {key}: {now - t0:.1f}s", flush=True)
    return now


def _encode_splits(
    tokenizer: Tokenizer, corpus: Corpus, seq_len: int
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    train_stream = encode_documents(tokenizer, corpus.train)
    heldout_stream = encode_documents(tokenizer, corpus.heldout)
    tokens = {"train": len(train_stream), "heldout": len(heldout_stream)}
    print(f"[data] {tokens['train']:,} training tokens, {tokens['heldout']:,} held-out tokens",
          flush=True)
    return pack_rows(train_stream, seq_len), pack_rows(heldout_stream, seq_len), tokens


def _train_and_export(
    *,
    args: argparse.Namespace,
    name: str,
    role: str,
    preset: str,
    prefix: str,
    tc: TrainConfig,
    tokenizer: Tokenizer,
    corpus: Corpus,
    data: tuple[np.ndarray, np.ndarray, dict[str, int]],
    run_dir: Path,
    model_dir: Path,
    deadline: float | None,
    export_reserve: float,
) -> TrainResult:
    train_rows, heldout_rows, tokens = data
    config = model_config(preset, tokenizer)
    init = getattr(args, f"{prefix.replace('-', '_')}init")
    result = train_model(
        config, tc, train_rows, heldout_rows,
        checkpoint_dir=run_dir / "ckpt" / name, resume=args.resume,
        deadline=None if deadline is None else deadline - export_reserve,
        progress=not args.no_progress, name=name,
        warm_start=None if init is None else load_warm_start(init, config),
    )
    t0 = time.monotonic()
    samples = card_samples(config, result.params, tokenizer, dtype=args.save_dtype)
    for s in samples:
        print(f"[{name}] sample: {s!r}", flush=True)
    card = model_card(name=name, result=result, train_config=tc, corpus=corpus.describe(),
                      tokens=tokens, samples=samples, command=command_line(args.argv),
                      save_dtype=args.save_dtype, role=role)
    export_model(model_dir, result, tokenizer, card, args.save_dtype)
    result.timings["export_s"] = time.monotonic() - t0
    with open(run_dir / f"{name}_history.jsonl", "w", encoding="utf-8") as f:
        for record in result.history:
            f.write(json.dumps(record) + "\n")
    return result


#: Texts whose ids two tokenizers must agree on to count as one (with the vocabulary size).
_TOKENIZER_PROBES = ("def f(x):\n    return x + 1\n",
                     "import os, sys  # \u00fcn\u00efcode\n\tr'doc'")


def _take_draft(folder: Path, tokenizer: Tokenizer, dest: Path) -> dict[str, Any]:
    """Copy a trained draft folder in as the run's draft; it must share the run's tokenizer
    (a draft proposes token ids the target then judges)."""
    theirs = Tokenizer.from_folder(folder)
    if theirs.vocab_size != tokenizer.vocab_size or any(
            theirs.encode(text) != tokenizer.encode(text) for text in _TOKENIZER_PROBES):
        raise BadInputError(f"the draft in {folder} has another tokenizer than this run; a "
                            "draft model must share its target's tokenizer")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(folder, dest)
    print(f"[draft] taken as it is from {folder}", flush=True)
    return {"from": str(folder)}


def _summary(result: TrainResult) -> dict[str, Any]:
    return {
        "params": count_params(result.params),
        "steps_done": result.steps_done,
        "finished": result.finished,
        "tokens_seen": result.tokens_seen,
        "eval_loss": result.eval_loss,
        "eval_ppl": math.exp(result.eval_loss) if result.eval_loss is not None else None,
        "timings": {k: round(v, 2) for k, v in result.timings.items()},
    }


def _train_block_drafter(args: argparse.Namespace, target: TrainResult,
                         data: tuple[np.ndarray, np.ndarray, dict[str, int]], folder: Path,
                         deadline: float | None) -> dict[str, Any]:
    """Train the block drafter for the just-trained target on the same rows, export it to
    ``folder`` and return its summary (held-out acceptance by block position included)."""
    from turbospark_recipe.block_drafter_training import (
        default_drafter_config,
        export_block_drafter,
        train_block_drafter,
    )

    train_rows, heldout_rows, _ = data
    config = default_drafter_config(target.config)
    on_cpu = jax.default_backend() == "cpu"
    result = train_block_drafter(
        target.config, target.params, train_rows, heldout_rows, config,
        steps=args.block_steps, batch_size=min(args.block_batch_size, len(heldout_rows)),
        lr=args.block_lr, seed=args.seed, progress=not args.no_progress,
        deadline=None if deadline is None else deadline - 20.0,
        warmup_steps=max(1, args.block_steps // 12),
        eval_every=max(1, args.block_steps // 5),
        compute_dtype="float32" if on_cpu else "bfloat16",
    )
    export_block_drafter(folder, result.config, result.params, args.save_dtype)
    last = result.last_eval or {}
    summary = {
        "params": count_params(result.params), "steps_done": result.steps_done,
        "finished": result.finished,
        "eval_loss": last.get("loss"), "acceptance_by_position": last.get("acceptance"),
        "accepted_length": last.get("accepted_length"),
        "timings": {k: round(v, 2) for k, v in result.timings.items()},
    }
    (folder / "training.json").write_text(
        json.dumps({**summary, "history": result.history}, indent=1) + "\n", encoding="utf-8")
    (folder / "README.md").write_text(block_drafter_card(
        result.config, summary, target="the target trained in the same run",
        steps=args.block_steps,
        batch_size=min(args.block_batch_size, len(heldout_rows)), seq_len=args.seq_len,
        anchors_per_row=16, lr=args.block_lr, command=command_line(args.argv)),
        encoding="utf-8")
    return summary


def _run_recipe(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    deadline = None if args.max_seconds is None else t_start + args.max_seconds
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    print(f"[recipe] jax {jax.__version__} on {jax.devices()}", flush=True)

    t = time.monotonic()
    corpus = load_corpus(args.corpus_root, args.heldout_fraction, args.max_files,
                         args.corpus_name, args.packages)
    print(f"[corpus] {json.dumps(corpus.describe())}", flush=True)
    t = _timed(timings, "corpus_s", t)

    tok_dir = out / "tokenizer"
    if args.tokenizer is not None:
        tokenizer = Tokenizer.from_folder(args.tokenizer)
        tokenizer.save(tok_dir)
    elif args.resume and (tok_dir / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_folder(tok_dir)
    else:
        tokenizer = train_tokenizer([d.text for d in corpus.train], args.vocab_size)
        tokenizer.save(tok_dir)
    t = _timed(timings, "tokenizer_s", t)
    data = _encode_splits(tokenizer, corpus, args.seq_len)
    t = _timed(timings, "encode_s", t)

    # The draft trains first: it is small and its time predictable, and the target then gets
    # whatever budget is left. 40 s are kept back per model for samples, card and export.
    reserve = 40.0
    draft_deadline = None
    if deadline is not None:
        left = deadline - time.monotonic() - 2 * reserve
        draft_deadline = time.monotonic() + reserve + max(left, 0.0) * args.draft_share
    rows = len(data[0])
    if args.draft_from is not None:
        draft_summary = _take_draft(args.draft_from, tokenizer, out / "draft")
    else:
        draft = _train_and_export(
            args=args, name="draft", role="It is the draft model for speculative decoding "
            "with the target model trained in the same run (same tokenizer).",
            preset=args.draft_preset, prefix="draft-", tc=_train_config(args, rows, "draft-"),
            tokenizer=tokenizer, corpus=corpus, data=data, run_dir=out, model_dir=out / "draft",
            deadline=draft_deadline, export_reserve=reserve,
        )
        draft_summary = _summary(draft)
    t = _timed(timings, "draft_s", t)
    target_deadline = deadline
    if deadline is not None and args.block_steps:
        left = deadline - time.monotonic() - reserve
        target_deadline = deadline - max(left, 0.0) * args.block_share
    target = _train_and_export(
        args=args, name="target", role="It is the target model; a draft model for "
        "speculative decoding " + ("was trained in the same run" if args.draft_from is None
                                   else "trained earlier was taken into the run as it was")
        + " with the same tokenizer.",
        preset=args.target_preset, prefix="target-", tc=_train_config(args, rows, "target-"),
        tokenizer=tokenizer,
        corpus=corpus, data=data, run_dir=out, model_dir=out / "target",
        deadline=target_deadline, export_reserve=reserve,
    )
    t = _timed(timings, "target_s", t)
    folders = [out / "target", out / "draft"]
    block = None
    if args.block_steps:
        block = _train_block_drafter(args, target, data, out / "block", deadline)
        folders.append(out / "block")
        t = _timed(timings, "block_s", t)
    summary: dict[str, Any] = {
        "command": command_line(args.argv),
        "corpus": corpus.describe(),
        "tokens": data[2],
        "vocab_size": tokenizer.vocab_size,
        "draft": draft_summary,
        "target": _summary(target),
    }
    if block is not None:
        summary["block"] = block
    if args.pack_out is not None:
        parts = pack_folders(folders, args.pack_out)
        summary["parts"] = [p.name for p in parts]
        t = _timed(timings, "pack_s", t)
    timings["total_s"] = round(time.monotonic() - t_start, 2)
    summary["timings"] = timings
    text = json.dumps(summary, indent=2)
    (out / "summary.json").write_text(text + "\n", encoding="utf-8")
    if args.pack_out is not None:
        (args.pack_out / "summary.json").write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    return summary



def _evaluate(args: argparse.Namespace) -> None:
    from turbospark_jax.api import load
    from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path
    from turbospark_recipe.card import set_card_section
    from turbospark_recipe.code_eval import evaluate_functions, quality_section

    corpus = load_corpus(args.corpus_root, args.heldout_fraction, args.max_files,
                         args.corpus_name, args.packages)
    model = load(args.model)
    t0 = time.monotonic()
    share, results = evaluate_functions(model, corpus.heldout, args.functions, args.max_tokens,
                                        scopes=not args.header_only)
    report = {
        "model": str(args.model or "embedded"), "corpus": corpus.describe()["name"],
        "functions": len(results), "max_tokens": args.max_tokens,
        "prompts": "header" if args.header_only else "scopes", "passing": share,
        "parsing": sum(r.parses for r in results) / len(results),
        "looping": sum(r.loops for r in results) / len(results),
        "seconds": round(time.monotonic() - t0, 1),
        "samples": [{"path": r.function.path, "line": r.function.line,
                     "context": "" if args.header_only else r.function.context,
                     "prompt": r.function.prompt, "body": r.body, "parses": r.parses,
                     "loops": r.loops} for r in results],
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if args.card:
        folder = args.model or embedded_model_path(DEFAULT_TARGET)
        set_card_section(folder, f"Function bodies: {args.card}",
                         quality_section(report))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}))


def _run(args: argparse.Namespace) -> None:
    if args.command == "corpus":
        corpus = load_corpus(args.corpus_root, args.heldout_fraction, args.max_files,
                             args.corpus_name, args.packages)
        text = json.dumps(corpus.describe(), indent=2)
        if args.out is not None:
            args.out.write_text(text + "\n", encoding="utf-8")
        print(text)
    elif args.command == "evaluate":
        _evaluate(args)
    elif args.command == "tokenizer":
        corpus = load_corpus(args.corpus_root, args.heldout_fraction, args.max_files,
                             args.corpus_name, args.packages)
        tokenizer = train_tokenizer([d.text for d in corpus.train], args.vocab_size)
        tokenizer.save(args.out)
        print(f"tokenizer with {tokenizer.vocab_size} tokens written to {args.out}")
    elif args.command == "train":
        deadline = None if args.max_seconds is None else time.monotonic() + args.max_seconds
        tokenizer = Tokenizer.from_folder(args.tokenizer)
        corpus = load_corpus(args.corpus_root, args.heldout_fraction, args.max_files,
                             args.corpus_name, args.packages)
        data = _encode_splits(tokenizer, corpus, args.seq_len)
        result = _train_and_export(
            args=args, name=args.preset, role="", preset=args.preset, prefix="",
            tc=_train_config(args, len(data[0])), tokenizer=tokenizer, corpus=corpus, data=data,
            run_dir=args.out, model_dir=args.out / "model", deadline=deadline,
            export_reserve=20.0,
        )
        print(json.dumps(_summary(result), indent=2))
    elif args.command == "recipe":
        _run_recipe(args)
    elif args.command == "pack":
        for path in pack_folders(args.folders, args.out, args.name, int(args.part_mib * 2**20)):
            print(path)
    elif args.command == "unpack":
        for path in unpack_parts(args.parts, args.to, args.name):
            print(path)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m turbospark_recipe``; returns the exit status.

    ``--help`` still exits through ``SystemExit(0)``, as argparse does.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _build_parser().parse_args(argv)
        args.argv = argv  # for the model card's reproduce line
        _run(args)
    except (TurbosparkError, OSError) as exc:
        print(f"{ERROR_PREFIX} {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("turbospark-jax recipe: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
