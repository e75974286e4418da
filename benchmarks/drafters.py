"""Every drafter a target has, on the same held-out prompts: acceptance and wall-clock speedup.

    PYTHONPATH=. python -m benchmarks.drafters --target models/tsj-pycoder --out DIR --preset cpu
    PYTHONPATH=. python -m benchmarks.drafters --out DIR --preset h200 --write-speculative-json
    PYTHONPATH=. python -m benchmarks.drafters --report DIR      # the table again, from the JSON

For each drafter :func:`~turbospark_jax.speculative.choice.available_drafters` finds for the target
(draft model, n-gram lookup, MTP head, block drafter, Gemma 4 assistant), at each draft length
the preset lists for it (a block drafter: up to its block less one), greedy and sampled
(temperature 0.8, top-p 0.95, seed = the prompt's index): mean tokens per round, acceptance by
draft position, and decode tokens/s (after the first token, pooled over the prompts) against
plain decoding of the same prompts with the same settings. Each configuration is loaded as the
CLI and ``tsj.load`` build it (width 16 on an accelerator; on a CPU 1 plain and draft length + 1
drafting), in the context the CLI allocates (the smallest power of two >= 256 holding prompt
and reply), and runs the same loop: device rounds where the drafter has a device form. Each
configuration runs once on the first prompt to compile, then every prompt is timed.

**Prompts**: held-out Python function headers (decorators, signature, docstring), the ones the
recipe's quality bar asks for (:mod:`turbospark_recipe.code_eval`), without the openings of
their enclosing scopes that the bar puts before them (the recorded figures were measured so):
files of the running
interpreter's standard library whose path hash is held out (``--heldout-fraction``, the
recipe's 3% by default), functions evenly spaced over them.

**Lossless**: every greedy run must equal plain greedy decoding token for token; each record
says whether it did, and the command exits with status 1 (after writing everything) when one
did not. Sampled runs are lossless in distribution only, so they are not compared.

Writes ``drafters_<backend>.json`` after every configuration (meta, prompts, records),
``drafters_<backend>.md`` (the table) and ``drafters_<backend>.png`` (acceptance by position,
each drafter at its fastest draft length). ``--write-speculative-json`` writes the target's
``speculative.json`` (:mod:`turbospark_jax.speculative.figures`): each drafter's greedy figures at
its fastest draft length on this backend, which ``--drafter auto`` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.run import _meta

SAMPLED = {"temperature": 0.8, "top_p": 0.95}


@dataclasses.dataclass(frozen=True)
class Preset:
    """How much to run: prompts, new tokens per prompt, draft lengths per drafter."""

    prompts: int
    tokens: int
    draft_lens: dict[str, tuple[int, ...]]


PRESETS = {
    "smoke": Preset(2, 8, {"draft-model": (2,), "ngram": (2,), "mtp": (2,), "block": (2,),
                           "assistant": (2,)}),
    "cpu": Preset(4, 64, {"draft-model": (2, 4), "ngram": (2, 4), "mtp": (1, 2, 3),
                          "block": (2, 4, 8), "assistant": (2, 4)}),
    "h200": Preset(16, 128, {"draft-model": (2, 3, 4, 6), "ngram": (2, 4, 6, 8),
                             "mtp": (1, 2, 3, 4), "block": (2, 4, 6, 8),
                             "assistant": (2, 4, 6)}),
    # Every drafter of the embedded models inside a share of one device call (about 150 s).
    "h200-short": Preset(12, 128, {"draft-model": (2, 4), "ngram": (4, 8), "mtp": (1, 2, 3),
                                   "block": (3, 5, 7), "assistant": (2, 4)}),
}


def held_out_prompts(n: int, root: Path | None, heldout_fraction: float) -> list[str]:
    """``n`` held-out function headers (module docstring)."""
    from turbospark_recipe.code_eval import function_prompts, spaced_sample
    from turbospark_recipe.corpus import load_corpus

    corpus = load_corpus(root, heldout_fraction=heldout_fraction)
    return [f.prompt for f in spaced_sample(function_prompts(corpus.heldout), n)]


def _context(target: Path, prompts: list[str], tokens: int) -> int:
    """The CLI's allocation for the longest prompt: a power of two >= 256 holding prompt,
    reply and one block of the widest width any configuration uses (16)."""
    from turbospark_jax.io.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(target)
    longest = max(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    need = longest + tokens + 16
    return max(256, 1 << (need - 1).bit_length())


def _run(model: Any, prompts: list[str], tokens: int, mode: str, draft_len: int | None
         ) -> dict[str, Any]:
    """Untimed runs to compile, then every prompt timed; pooled figures. On an accelerator
    every prompt runs once untimed (a longer prompt can reach a wider key bound, whose
    programs would otherwise compile inside the timed decode); on a CPU
    the first prompt alone (its decode is the cost there)."""
    import jax

    import turbospark_jax as tsj

    def one(i: int, prompt: str) -> Any:
        settings = SAMPLED if mode == "sampled" else {}
        return tsj.generate(model, prompt, max_tokens=tokens, seed=i, draft_len=draft_len,
                            **settings)

    for i, prompt in enumerate(prompts if jax.default_backend() != "cpu" else prompts[:1]):
        one(i, prompt)
    decoded, seconds, outputs = 0, 0.0, []
    rounds, drafted, accepted = 0, np.zeros(8, np.int64), np.zeros(8, np.int64)
    on_device = None
    for i, prompt in enumerate(prompts):
        c = one(i, prompt)
        outputs.append(c.token_ids)
        decoded += max(len(c.token_ids) - 1, 0)
        seconds += c.timings.decode_s
        s = c.speculative
        if s is not None:
            rounds += s.rounds
            drafted[: len(s.drafted_by_position)] += s.drafted_by_position
            accepted[: len(s.accepted_by_position)] += s.accepted_by_position
            on_device = s.on_device
    record: dict[str, Any] = {"tokens_per_s": decoded / seconds if seconds > 0 else 0.0,
                              "decoded_tokens": decoded, "decode_s": seconds}
    if draft_len is not None:
        k = draft_len
        record.update(
            rounds=rounds, drafted=int(drafted.sum()), accepted=int(accepted.sum()),
            mean_acceptance_length=(accepted.sum() + rounds) / rounds if rounds else 0.0,
            acceptance_rate=accepted.sum() / drafted.sum() if drafted.sum() else 0.0,
            acceptance_by_position=[float(a / d) if d else 0.0
                                    for a, d in zip(accepted[:k], drafted[:k], strict=True)],
            on_device=on_device)
    return {"outputs": outputs, **record}


class Results:
    """The records so far, written after each one."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"drafters_{meta['backend']}.json"
        self.meta = meta
        self.records: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        print(json.dumps(record), flush=True)
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps({"meta": self.meta, "records": self.records}, indent=1))


def measure(target: Path, out: Path, preset: Preset, prompts: list[str],
            folders: dict[str, Path], only: list[str] | None = None,
            max_seconds: float | None = None) -> Results:
    """Plain decoding, then every available drafter at each draft length, greedy and
    sampled (module docstring); no new configuration starts after ``max_seconds`` (what is
    left out is listed in the meta's ``skipped``)."""
    import jax

    import turbospark_jax as tsj
    from turbospark_jax.speculative.choice import available_drafters

    table, _ = available_drafters(target, folders)
    drafters = [d for d, a in table.items() if a.available and (only is None or d in only)]
    context = _context(target, prompts, preset.tokens)
    meta = {**_meta(), "target": str(target), "preset": dataclasses.asdict(preset),
            "context": context, "prompts": prompts, "sampled": SAMPLED,
            "drafters": {d: a.reason for d, a in table.items()},
            "command": " ".join(["python -m benchmarks.drafters",
                                 *map(shlex.quote, sys.argv[1:])])}
    results = Results(out, meta)
    started = time.perf_counter()
    plain_model = tsj.load(target, context=context)
    plain: dict[str, dict[str, Any]] = {}
    for mode in ("greedy", "sampled"):
        plain[mode] = _run(plain_model, prompts, preset.tokens, mode, None)
        results.add({"drafter": "plain", "mode": mode, "draft_len": 0,
                     "width": plain_model.producer.width,
                     **{k: v for k, v in plain[mode].items() if k != "outputs"}})
    del plain_model
    gpu = jax.default_backend() != "cpu"
    for drafter in drafters:
        limit = table[drafter].draft_len if drafter == "block" else 8
        lens = sorted({min(k, limit) for k in preset.draft_lens[drafter]})
        model = None
        for k in lens:
            if max_seconds is not None and time.perf_counter() - started > max_seconds:
                meta.setdefault("skipped", []).append({"drafter": drafter, "draft_len": k})
                continue
            if model is None or not gpu:  # on a CPU the width follows the draft length
                named = {"draft-model": "draft", "block": "block_drafter"}
                model = tsj.load(target, drafter=drafter, context=context, draft_len=k,
                                 **{named[d]: f for d, f in folders.items() if d == drafter})
            for mode in ("greedy", "sampled"):
                run_started = time.perf_counter()
                got = _run(model, prompts, preset.tokens, mode, k)
                record = {"drafter": drafter, "mode": mode, "draft_len": k,
                          "width": model.producer.target.width,
                          **{key: v for key, v in got.items() if key != "outputs"},
                          "speedup": got["tokens_per_s"] / plain[mode]["tokens_per_s"]
                          if plain[mode]["tokens_per_s"] else 0.0,
                          "wall_s": time.perf_counter() - run_started}
                if mode == "greedy":
                    record["equal_to_plain"] = got["outputs"] == plain[mode]["outputs"]
                results.add(record)
    return results


def _load_explicit(args: argparse.Namespace) -> dict[str, Path]:
    folders = {}
    if args.draft_model is not None:
        folders["draft-model"] = args.draft_model
    if args.block_drafter is not None:
        folders["block"] = args.block_drafter
    return folders


def lossless(records: list[dict[str, Any]]) -> bool:
    """Whether every greedy drafter run equalled plain greedy decoding."""
    return all(r.get("equal_to_plain", True) for r in records)


def fastest(records: list[dict[str, Any]], mode: str) -> dict[str, dict[str, Any]]:
    """Each drafter's record with the highest speedup in ``mode``."""
    best: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["drafter"] != "plain" and r["mode"] == mode and (
                r["drafter"] not in best or r["speedup"] > best[r["drafter"]]["speedup"]):
            best[r["drafter"]] = r
    return best


def markdown(data: dict[str, Any]) -> str:
    """The results as a markdown table (one row per configuration)."""
    meta = data["meta"]
    lines = [f"## Drafters for {meta['target']}, {meta['device']} ({meta['backend']}), "
             f"{len(meta['prompts'])} held-out function headers, "
             f"{meta['preset']['tokens']} new tokens, context {meta['context']} "
             f"({meta['date']})", "",
             "| drafter | mode | draft length | W | tokens/round | acceptance | acceptance by "
             "position | decode tokens/s | speedup | equal to plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["records"]:
        if r["drafter"] == "plain":
            lines.append(f"| plain | {r['mode']} | - | {r['width']} | 1.00 | - | - | "
                         f"{r['tokens_per_s']:.1f} | 1.00x | - |")
            continue
        by_pos = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        equal = {True: "yes", False: "**NO**"}.get(r.get("equal_to_plain"), "-")
        lines.append(
            f"| {r['drafter']} | {r['mode']} | {r['draft_len']} | {r['width']} | "
            f"{r['mean_acceptance_length']:.2f} | {r['acceptance_rate']:.2f} | {by_pos} | "
            f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {equal} |")
    skipped = meta.get("skipped", [])
    if skipped:
        lines += ["", "Not run (out of time): " + ", ".join(
            f"{s['drafter']} at draft length {s['draft_len']}" for s in skipped) + "."]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    """Acceptance by draft position, each drafter at its fastest draft length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, mode in zip(axes, ("greedy", "sampled"), strict=True):
        for drafter, r in sorted(fastest(data["records"], mode).items()):
            rates = r["acceptance_by_position"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o",
                    label=f"{drafter} (k={r['draft_len']}, {r['speedup']:.2f}x)")
        ax.set_title(mode)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("acceptance rate")
    fig.suptitle(f"{Path(data['meta']['target']).name} on {data['meta']['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(json_path: Path) -> None:
    """``.md`` and ``.png`` beside a results file."""
    data = json.loads(json_path.read_text())
    json_path.with_suffix(".md").write_text(markdown(data))
    plot(data, json_path.with_suffix(".png"))


def write_speculative_json(target: Path, data: dict[str, Any]) -> Path:
    """The target's ``speculative.json`` from the greedy figures (each drafter at its fastest
    draft length), with the sampled speedup at that length beside them."""
    from turbospark_jax.speculative.figures import Measurement, write_figures

    meta = data["meta"]
    sampled = {(r["drafter"], r["draft_len"]): r["speedup"] for r in data["records"]
               if r["mode"] == "sampled" and r["drafter"] != "plain"}
    found = [Measurement(
        drafter=d, backend=meta["backend"], draft_len=r["draft_len"], speedup=r["speedup"],
        mean_acceptance_length=r["mean_acceptance_length"],
        acceptance_rate=r["acceptance_rate"], command=meta["command"], device=meta["device"],
        date=meta["date"][:10], sampled_speedup=sampled.get((d, r["draft_len"])),
        lossless=lossless([x for x in data["records"] if x["drafter"] == d]))
        for d, r in sorted(fastest(data["records"], "greedy").items())]
    return write_figures(target, found)


def write_card_section(target: Path, data: dict[str, Any]) -> Path | None:
    """The table as a section of the target's model card, one section per device (``None``:
    the folder has no card)."""
    from turbospark_recipe.card import set_card_section

    if not (Path(target) / "README.md").is_file():
        return None
    meta = data["meta"]
    body = markdown(data).split("\n", 2)[2]  # the table, without the title line
    intro = (f"Measured {meta['date'][:10]} on {meta['device']} ({meta['backend']}): "
             f"{len(meta['prompts'])} held-out function headers, {meta['preset']['tokens']} "
             f"new tokens each, greedy and sampled (temperature {SAMPLED['temperature']}, "
             f"top-p {SAMPLED['top_p']}), each configuration loaded as the CLI loads it. "
             f"Reproduce: `{meta['command']}`.")
    return set_card_section(target, f"Speculative decoding on {meta['device']}",
                            intro + "\n\n" + body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=None,
                        help="the model folder (default: the embedded model)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="default: cpu on a CPU, h200 otherwise")
    parser.add_argument("--drafters", default=None,
                        help="comma-separated drafters to measure (default: all available)")
    parser.add_argument("--draft-model", type=Path, default=None)
    parser.add_argument("--block-drafter", type=Path, default=None)
    parser.add_argument("--corpus-root", type=Path, default=None,
                        help="where the held-out prompts come from (default: the stdlib)")
    parser.add_argument("--heldout-fraction", type=float, default=0.03)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no new configuration after this many seconds (the h200 "
                             "preset: 180, to end within a 4-minute device call)")
    parser.add_argument("--write-speculative-json", action="store_true",
                        help="write the target's speculative.json from the greedy figures")
    parser.add_argument("--report", type=Path, default=None,
                        help="only rewrite the table and plot of this results file")
    args = parser.parse_args(argv)
    if args.report is not None:
        report(args.report)
        return 0
    import jax

    from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path

    target = args.target or embedded_model_path(DEFAULT_TARGET)
    preset = PRESETS[args.preset or ("cpu" if jax.default_backend() == "cpu" else "h200")]
    prompts = held_out_prompts(preset.prompts, args.corpus_root, args.heldout_fraction)
    only = args.drafters.split(",") if args.drafters else None
    limit = args.max_seconds if args.max_seconds is not None else (
        180.0 if preset is PRESETS["h200"] else None)
    results = measure(target, args.out, preset, prompts, _load_explicit(args), only, limit)
    results.write()  # with what was skipped
    report(results.path)
    print(results.path.with_suffix(".md").read_text())
    if args.write_speculative_json:
        data = json.loads(results.path.read_text())
        print(f"wrote {write_speculative_json(target, data)}")
        card = write_card_section(target, data)
        print(f"wrote {card}" if card else f"no model card in {target} to add the table to")
    if not lossless(results.records):
        print("FAILED: a greedy drafter run differs from plain greedy decoding (see "
              "equal_to_plain; speculative.json marks it lossless: false)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
