"""Each drafter's speed-up over plain decoding on the embedded models, greedy and sampled.

For every drafter :func:`~turbospark_jax.speculative.choice.available_drafters` finds for the
target (draft model, n-gram lookup, MTP head, block drafter, Gemma 4 assistant), at each draft
length the preset lists (a block drafter: at most its block less one), greedy and sampled
(:data:`SAMPLED`, seed = the prompt's index): tokens per round, acceptance by draft position
and decode tokens/s after the first token, pooled over held-out prompts, against plain
decoding of the same prompts with the same settings. Each configuration is loaded as the CLI
loads it (``tsj.load``), in the context the CLI allocates, and compiled on untimed runs first.

**Prompts**: held-out Python function headers (the recipe's quality-bar prompts without
their enclosing scopes) from the running interpreter's standard library, the files whose path
hash the recipe holds out.

**Lossless**: every greedy run must equal plain greedy decoding token for token; each case
says whether it did, and the suite's status is 1 when one did not.

**Model figures**: a preset that asks for them (not ``smoke``) then writes the target's
``speculative.json`` (:mod:`turbospark_jax.speculative.figures`: each drafter's greedy figures
at its fastest draft length on this backend, which ``--drafter auto`` reads) and the table as
a section of its model card.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common

SAMPLED = {"temperature": 0.8, "top_p": 0.95}


@dataclasses.dataclass(frozen=True)
class Preset:
    prompts: int
    tokens: int
    draft_lens: dict[str, tuple[int, ...]]
    modes: tuple[str, ...] = ("greedy", "sampled")
    #: start no configuration after this many seconds (those left are listed as skipped)
    budget_s: float | None = None
    model_figures: bool = True


_GPU = Preset(16, 128, {"draft-model": (2, 3, 4, 6), "ngram": (2, 4, 6, 8),
                        "mtp": (1, 2, 3, 4), "block": (2, 4, 6, 8), "assistant": (2, 4, 6)},
              budget_s=540.0)
PRESETS = {
    "smoke": Preset(1, 8, {"ngram": (2,)}, modes=("greedy",), model_figures=False),
    "cpu": Preset(2, 32, {"draft-model": (3,), "ngram": (3,), "mtp": (2,), "block": (4,),
                          "assistant": (2,)}, budget_s=240.0),
    "h100": _GPU,
    "h200": _GPU,
}


def held_out_prompts(n: int) -> list[str]:
    """``n`` held-out function headers, evenly spaced over the held-out files."""
    from turbospark_recipe.code_eval import function_prompts, spaced_sample
    from turbospark_recipe.corpus import load_corpus

    corpus = load_corpus(None, heldout_fraction=0.03)
    return [f.prompt for f in spaced_sample(function_prompts(corpus.heldout), n)]


def context_for(target: Path, prompts: list[str], tokens: int) -> int:
    """The CLI's allocation for the longest prompt: a power of two >= 256 holding prompt,
    reply and one block of the widest width a configuration uses (16)."""
    from turbospark_jax.io.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(target)
    longest = max(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    return max(256, 1 << (longest + tokens + 16 - 1).bit_length())


def pooled_run(model: Any, prompts: list[str], tokens: int, mode: str,
               draft_len: int | None) -> dict[str, Any]:
    """Untimed runs to compile (every prompt on an accelerator, where a longer prompt can
    reach programs of a wider key bound; the first on a CPU), then every prompt timed;
    figures pooled over the prompts."""
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
            mean_acceptance_length=float((accepted.sum() + rounds) / rounds) if rounds else 0.0,
            acceptance_rate=float(accepted.sum() / drafted.sum()) if drafted.sum() else 0.0,
            acceptance_by_position=[float(a / d) if d else 0.0
                                    for a, d in zip(accepted[:k], drafted[:k], strict=True)],
            on_device=on_device)
    return {"outputs": outputs, **record}


def run(preset: Preset, results: common.Results, model_figures: bool = True,
        target: Path | None = None) -> int:
    """Plain decoding, then every available drafter at each draft length (module docstring).
    Returns 1 when a greedy run differed from plain greedy decoding, else 0."""
    import jax

    import turbospark_jax as tsj
    from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path
    from turbospark_jax.speculative.choice import available_drafters

    target = Path(target or embedded_model_path(DEFAULT_TARGET))
    prompts = held_out_prompts(preset.prompts)
    table, _ = available_drafters(target)
    drafters = [d for d, a in table.items() if a.available and d in preset.draft_lens]
    context = context_for(target, prompts, preset.tokens)
    meta = results.data["meta"]
    meta.update(target=str(target), context=context, prompts=prompts, sampled=SAMPLED,
                drafters={d: a.reason for d, a in table.items()})
    plain_model = tsj.load(target, context=context)
    plain: dict[str, dict[str, Any]] = {}
    for mode in preset.modes:
        plain[mode] = pooled_run(plain_model, prompts, preset.tokens, mode, None)
        results.add({"drafter": "plain", "mode": mode, "draft_len": 0,
                     "width": plain_model.producer.width,
                     **{k: v for k, v in plain[mode].items() if k != "outputs"}})
    del plain_model
    gpu = jax.default_backend() != "cpu"
    for drafter in drafters:
        limit = table[drafter].draft_len if drafter == "block" else 8
        model = None
        for k in sorted({min(k, limit) for k in preset.draft_lens[drafter]}):
            if results.out_of_time():  # listed as skipped, without loading anything
                model = None
            elif model is None or not gpu:  # on a CPU the width follows the draft length
                model = tsj.load(target, drafter=drafter, context=context, draft_len=k)
            for mode in preset.modes:
                results.case({"drafter": drafter, "mode": mode, "draft_len": k},
                             lambda m=model, k=k, mode=mode: _against_plain(
                                 m, prompts, preset.tokens, mode, k, plain[mode]))
    status = 0 if lossless(results.cases) else 1
    if model_figures and preset.model_figures and results.cases:
        print(f"wrote {write_speculative_json(target, results.data)}")
        card = write_card_section(target, results.data)
        print(f"wrote {card}" if card else f"no model card in {target} to add the table to")
    return status


def _against_plain(model: Any, prompts: list[str], tokens: int, mode: str, k: int,
                   plain: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    got = pooled_run(model, prompts, tokens, mode, k)
    record = {"width": model.producer.target.width,
              **{key: v for key, v in got.items() if key != "outputs"},
              "speedup": got["tokens_per_s"] / plain["tokens_per_s"]
              if plain["tokens_per_s"] else 0.0,
              "wall_s": time.perf_counter() - started}
    if mode == "greedy":
        record["equal_to_plain"] = got["outputs"] == plain["outputs"]
    return record


def lossless(records: list[dict[str, Any]]) -> bool:
    """Whether every greedy drafter run equalled plain greedy decoding."""
    return all(r.get("equal_to_plain", True) for r in records)


def fastest(records: list[dict[str, Any]], mode: str) -> dict[str, dict[str, Any]]:
    """Each drafter's case with the highest speed-up in ``mode``."""
    best: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["drafter"] != "plain" and r["mode"] == mode and (
                r["drafter"] not in best or r["speedup"] > best[r["drafter"]]["speedup"]):
            best[r["drafter"]] = r
    return best


def table(data: dict[str, Any]) -> list[str]:
    """The cases as markdown table lines, one row per configuration."""
    lines = ["| drafter | mode | draft length | W | tokens/round | acceptance | acceptance by "
             "position | decode tokens/s | speed-up | equal to plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["cases"]:
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
    return lines


def write_speculative_json(target: Path, data: dict[str, Any]) -> Path:
    """The target's ``speculative.json`` from the greedy figures (each drafter at its fastest
    draft length), with the sampled speed-up at that length beside them."""
    from turbospark_jax.speculative.figures import Measurement, write_figures

    meta = data["meta"]
    sampled = {(r["drafter"], r["draft_len"]): r["speedup"] for r in data["cases"]
               if r["mode"] == "sampled" and r["drafter"] != "plain"}
    found = [Measurement(
        drafter=d, backend=meta["backend"], draft_len=r["draft_len"], speedup=r["speedup"],
        mean_acceptance_length=r["mean_acceptance_length"],
        acceptance_rate=r["acceptance_rate"], command=meta["command"],
        device=meta["device_kind"], date=meta["date"][:10],
        sampled_speedup=sampled.get((d, r["draft_len"])),
        lossless=lossless([x for x in data["cases"] if x["drafter"] == d]))
        for d, r in sorted(fastest(data["cases"], "greedy").items())]
    return write_figures(target, found)


def write_card_section(target: Path, data: dict[str, Any]) -> Path | None:
    """The table as a section of the target's model card, one section per device (``None``:
    the folder has no card)."""
    from turbospark_recipe.card import set_card_section

    if not (target / "README.md").is_file():
        return None
    meta = data["meta"]
    intro = (f"Measured {meta['date'][:10]} on {meta['device_kind']} ({meta['backend']}): "
             f"{len(meta['prompts'])} held-out function headers, "
             f"{meta['settings']['tokens']} new tokens each, greedy and sampled (temperature "
             f"{SAMPLED['temperature']}, top-p {SAMPLED['top_p']}), each configuration loaded "
             f"as the CLI loads it. Reproduce: `{meta['command']}`.")
    return set_card_section(target, f"Speculative decoding on {meta['device_kind']}",
                            intro + "\n\n" + "\n".join(table(data)) + "\n")
