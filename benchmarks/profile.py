"""Where a decode step's device time goes: kernels a token, the device's busy share and the
timeline split by layer kind, per model shape, driven through the public API.

Each case builds the shape's random-weight model on the exact path (as the decode suite does),
runs one completion of ``context`` prompt tokens and ``new_tokens`` new ones through
``run_raw_completion`` to compile every program the loop takes, times one more untraced, then
runs it once more under ``jax.profiler.trace``. The written trace (Chrome trace format) is read
back and every device event of the decode (after the first token) is mapped to the HLO
instruction that launched it, and that instruction to the JAX named scope it was traced under,
through the optimized HLO text of the programs compiled during the warm-up. The scopes the
models open (``layer_{i}`` around each layer, ``attention``, ``mlp``, ``delta_rule`` and
``ple`` inside, ``embed``, ``head``, and the block program's ``sample``) give each event a
bucket:

* the kind of its layer (the config's ``layer_types[i]``: ``linear_attention`` for gated
  DeltaNet, ``full_attention``, ``sliding_attention``); ``ple`` for Gemma 4's per-layer
  inputs, wherever they run; ``embed``, ``head``, ``sample``; ``other`` for what no such scope
  covers (the loop's own bookkeeping); ``unmapped`` for an event no HLO instruction was found
  for;
* and finer, ``<kind>/<part>`` with the part the layer's inner scope names (``mlp``,
  ``attention``, ``delta_rule``, ``ple``, else ``rest``).

A profile runs the programs op by op unless ``XLA_FLAGS`` keeps command buffers while
profiling (``--xla_enable_command_buffers_during_profiling=true``); each case records which.
Where the mapping fails on a backend whose trace this suite has not seen, the events still
count (kernels a token and busy share need no mapping), the unmapped share says how much was
lost, and with ``dump_events`` (a preset field, or the ``TSJ_PROFILE_DUMP`` environment
variable: a count) the first raw device events go to ``profile_<preset>_<shape>_events.json``
beside the results, to fix the mapping from.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gzip
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import common


@dataclasses.dataclass(frozen=True)
class Preset:
    shapes: tuple[str, ...]
    context: int
    new_tokens: int
    dtype: str
    #: raw device events written beside the results per shape (0: none)
    dump_events: int = 0
    #: the most expensive ops listed per case
    top: int = 15


_GPU = Preset(("llama-3.2-1b", "qwen3.5-0.8b", "qwen3.5-4b", "gemma4-e2b"), 128, 64,
              "bfloat16", dump_events=200)
PRESETS = {
    "smoke": Preset(("tiny", "qwen3.5-tiny", "gemma4-tiny"), 16, 8, "float32"),
    "cpu": Preset(("qwen3.5-tiny", "gemma4-tiny", "small-60m"), 128, 32, "float32"),
    "h100": _GPU,
    "h200": _GPU,
}

#: The host annotation around the traced completion: it places the decode in the trace.
MARK = "turbospark_profile_completion"
#: Threads of a device's trace that repeat its kernels (one event per HLO op or module, or a
#: step), left out where kernel threads are there.
DERIVED = ("XLA Modules", "XLA Ops", "Async XLA Ops", "Steps", "Framework", "Source code",
           "TensorFlow", "Launch Stats", "XLA TraceMe", "_counters_")
#: Scopes that name a layer's part (the innermost one of these wins).
PARTS = ("mlp", "attention", "delta_rule", "ple")
#: Top-level scopes outside the layers, in the order they are looked for.
OUTSIDE = ("embed", "head", "sample")


# -- the HLO side: op name -> scope ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Op:
    """One HLO instruction of a compiled program."""

    module: str
    name: str
    opcode: str
    scope: str  # the op_name metadata: the JAX scope path; "" when the program names none
    inferred: bool = False  # the scope is a neighbour's (see parse_hlo)


_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$")
_OPCODE = re.compile(r"\s([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
_KERNEL_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_SCOPED = re.compile(r"(?:^|/)(?:layer_\d+|layer|embed|head|sample)(?:/|$)")
_SCAFFOLD = {"while", "body", "cond", "closed_call"}
_OPERAND = re.compile(r"%([\w.\-]+)")
#: Rounds of taking a neighbour's scope (a chain of unscoped instructions is rarely longer).
_ROUNDS = 4


def parse_hlo(text: str) -> tuple[str, dict[str, Op], dict[str, str]]:
    """``(module name, {instruction name: Op}, {custom kernel name: instruction name})`` of one
    HLO module's text.

    XLA's passes drop the metadata of some instructions they make (a dot they rewrite, a
    reduction they split). Such an instruction takes the scope of the computation it calls
    (a fusion's root, else the scope most of it has), else that of its nearest users or
    operands that have one (``Op.inferred``)."""
    module = ""
    first = text.split("\n", 1)[0]
    if first.startswith("HloModule "):
        module = first.split()[1].rstrip(",")
    codes: dict[str, str] = {}
    scopes: dict[str, str] = {}
    called: dict[str, list[str]] = {}
    operands: dict[str, list[str]] = {}
    computations: dict[str, list[str]] = {}  # computation -> its instructions' scopes
    roots: dict[str, str] = {}
    kernels: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            computations[current] = []
            continue
        found = _INSTRUCTION.match(line)
        if not found or not current:
            continue
        name, rest = found.groups()
        opcode = _OPCODE.search(" " + rest)
        scope = _OP_NAME.search(rest)
        code = opcode.group(1) if opcode else "?"
        target = _TARGET.search(rest)
        if target:
            code = f"{code}:{target.group(1)}"
            for kernel in _KERNEL_NAME.findall(rest)[:1]:
                kernels.setdefault(kernel, name)
        codes[name] = code
        scopes[name] = scope.group(1) if scope else ""
        called[name] = _CALLS.findall(rest)
        operands[name] = _OPERAND.findall(rest.split("metadata=", 1)[0])
        if scope:
            computations[current].append(scope.group(1))
            if line.lstrip().startswith("ROOT"):
                roots[current] = scope.group(1)
    inferred: set[str] = set()
    for name, comps in called.items():
        if scopes[name]:
            continue
        for comp in comps:
            found_scope = roots.get(comp) or (
                collections.Counter(computations[comp]).most_common(1)[0][0]
                if computations.get(comp) else "")
            if found_scope:
                scopes[name] = found_scope
                inferred.add(name)
                break
    users: dict[str, list[str]] = collections.defaultdict(list)
    for name, ins in operands.items():
        for o in ins:
            if o in scopes and o != name:
                users[o].append(name)
    for _ in range(_ROUNDS):  # a chain of unscoped instructions resolves a link a round
        found_now = {}
        for name, scope in scopes.items():
            if scope:
                continue
            near = [scopes[u] for u in users.get(name, ()) if scopes[u]] or [
                scopes[o] for o in operands[name] if scopes.get(o)]
            if near:
                found_now[name] = near[0]
        if not found_now:
            break
        scopes.update(found_now)
        inferred.update(found_now)
    table = {name: Op(module, name, codes[name], scopes[name], name in inferred)
             for name in codes}
    return module, table, kernels


def _kernel_key(name: str) -> str:
    """A GPU kernel's name as XLA derives it from its instruction's (``.`` and ``-`` to
    ``_``), for matching one to the other."""
    return re.sub(r"[^0-9A-Za-z_]", "_", name)


class HloIndex:
    """The instructions of the programs compiled for a run, found by the names a trace gives
    an event: the ``hlo_op`` (and ``hlo_module``) it carries, else its kernel's name.

    A module name compiled more than once stands for one of its programs at a time (the
    newest, until :meth:`choose` picks by what a trace ran). A name that would pick between
    instructions of different scopes finds none: an event is unmapped rather than guessed."""

    def __init__(self, texts: list[str]) -> None:
        # module name -> its programs (instruction tables and custom kernel names), newest last
        self.modules: dict[str, list[tuple[dict[str, Op], dict[str, str]]]] = \
            collections.defaultdict(list)
        for text in texts:
            module, table, kernels = parse_hlo(text)
            self.modules[module].append((table, kernels))
        self.choose({})

    def choose(self, seen: dict[str, set[str]]) -> None:
        """For each module name, the program that holds the most of the op names a trace ran
        under it (``seen``: trace module name -> op names; ties go to the newest)."""
        ran: dict[str, set[str]] = collections.defaultdict(set)
        for module, names in seen.items():
            resolved = self.resolve(module)
            if resolved is not None:
                ran[resolved] |= names
        self.chosen: dict[str, dict[str, Op]] = {}
        self.kernels: dict[str, list[Op]] = collections.defaultdict(list)
        for module, programs in self.modules.items():
            names = ran.get(module, set())
            best = max(range(len(programs)),
                       key=lambda i: (len(names & programs[i][0].keys()), i))
            table, kernels = programs[best]
            self.chosen[module] = table
            for op in table.values():
                self.kernels[_kernel_key(op.name)].append(op)
            for kernel, name in kernels.items():
                self.kernels[_kernel_key(kernel)].append(table[name])

    def resolve(self, module: str | None) -> str | None:
        """The captured module name a trace's ``hlo_module`` names: itself, else the longest
        captured name it starts with (a trace may add a suffix)."""
        if module is None:
            return None
        if module in self.modules:
            return module
        prefixes = [m for m in self.modules if m and module.startswith(m)]
        return max(prefixes, key=len) if prefixes else None

    def find(self, op: str | None, module: str | None, kernel: str) -> Op | None:
        if op:
            resolved = self.resolve(module)
            if resolved is not None:
                if op in self.chosen[resolved]:
                    return self.chosen[resolved][op]
                # another program of the name (both ran): where its scope is not in doubt
                found = _one_scope([t[op] for t, _ in self.modules[resolved] if op in t])
                if found is not None:
                    return found
            else:
                found = _one_scope([t[op] for t in self.chosen.values() if op in t])
                if found is not None:
                    return found
        for key in (_kernel_key(kernel), re.sub(r"_\d+$", "", _kernel_key(kernel))):
            found = _one_scope(self.kernels.get(key, []))
            if found is not None:
                return found
        return None


def _one_scope(candidates: list[Op]) -> Op | None:
    """The first of ``candidates`` where they all have one scope, else None."""
    return candidates[0] if candidates and len({o.scope for o in candidates}) == 1 else None


@contextlib.contextmanager
def capture_hlo() -> Iterator[list[str]]:
    """The optimized HLO text of every program compiled (or taken from a compilation cache)
    inside the block. Hooks JAX's compile step, a private function: where it is missing the
    list stays empty and every event goes unmapped, which the results then say."""
    texts: list[str] = []
    try:
        from jax._src import compiler
    except ImportError:  # pragma: no cover - a JAX without the module
        yield texts
        return
    original = getattr(compiler, "compile_or_get_cached", None)
    if original is None:  # pragma: no cover
        yield texts
        return

    def compile_and_keep(*args: Any, **kwargs: Any) -> Any:
        executable = original(*args, **kwargs)
        # the text is a nicety: a program whose text cannot be read still runs
        with contextlib.suppress(Exception):
            texts.extend(m.to_string() for m in executable.hlo_modules())
        return executable

    compiler.compile_or_get_cached = compile_and_keep
    try:
        yield texts
    finally:
        compiler.compile_or_get_cached = original


# -- the trace side: device events ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Event:
    name: str
    ts: float  # microseconds
    dur: float
    thread: str
    args: dict[str, Any]


def read_trace(folder: Path) -> dict[str, Any]:
    """The Chrome trace ``jax.profiler.trace`` wrote under ``folder``, else one built from
    its XSpace file (``traceEvents`` with process and thread names as metadata events)."""
    found = sorted(folder.glob("plugins/profile/*/*.trace.json.gz"))
    if found:
        with gzip.open(found[-1], "rt") as f:
            return json.load(f)
    planes = sorted(folder.glob("plugins/profile/*/*.xplane.pb"))
    if not planes:
        raise FileNotFoundError(f"no trace under {folder}")
    from jax._src.profiler import ProfileData

    events: list[dict[str, Any]] = []
    data = ProfileData.from_file(str(planes[-1]))
    for pid, plane in enumerate(data.planes):
        events.append({"ph": "M", "pid": pid, "name": "process_name",
                       "args": {"name": plane.name}})
        for tid, line in enumerate(plane.lines):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": line.name}})
            for ev in line.events:
                events.append({"ph": "X", "pid": pid, "tid": tid, "name": ev.name,
                               "ts": ev.start_ns / 1e3, "dur": ev.duration_ns / 1e3,
                               "args": {k: v for k, v in ev.stats}})
    return {"traceEvents": events}


def _names(trace: dict[str, Any]) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
    processes: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    return processes, threads


def device_events(trace: dict[str, Any]) -> tuple[list[Event], str]:
    """The trace's device events and how they were told apart.

    A device's own process (``/device:...``) gives its kernel threads (``Stream ...``), else
    its threads that do not repeat others (:data:`DERIVED`). A backend without one (the CPU)
    runs its ops on host threads, where an op's event carries ``hlo_op``; an event that
    encloses others of its thread (a loop around its body's ops) is left out, so time is
    counted once."""
    processes, threads = _names(trace)
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = {pid for pid, name in processes.items() if name.startswith("/device:")}

    def thread(e: dict[str, Any]) -> str:
        return threads.get((e.get("pid"), e.get("tid")), str(e.get("tid")))

    if device:
        mine = [e for e in spans if e.get("pid") in device]
        streams = [e for e in mine if thread(e).startswith("Stream")]
        how = "device kernel streams"
        if not streams:
            streams = [e for e in mine if not thread(e).startswith(DERIVED)]
            how = "device threads"
        if not streams:
            streams = [e for e in mine if thread(e) == "XLA Ops"]
            how = "device XLA ops"
        chosen = streams
    else:
        chosen = [e for e in spans if "hlo_op" in e.get("args", {})
                  and not str(e.get("name", "")).startswith("end: ")]
        how = "host threads running HLO ops"
    events = [Event(str(e.get("name", "")), float(e["ts"]), float(e["dur"]), thread(e),
                    dict(e.get("args", {}))) for e in chosen]
    return _leaves(events), how


def _leaves(events: list[Event]) -> list[Event]:
    """``events`` less those that enclose another event of their thread (an event of the
    same span as another, or one of no duration, encloses nothing)."""
    parents: set[int] = set()
    by_thread: dict[str, list[int]] = collections.defaultdict(list)
    for i, e in enumerate(events):
        by_thread[e.thread].append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: (events[i].ts, -events[i].dur))
        open_: list[int] = []
        for i in idx:
            e = events[i]
            while open_ and events[open_[-1]].ts + events[open_[-1]].dur <= e.ts:
                open_.pop()
            if open_ and e.dur > 0:
                parent = events[open_[-1]]
                end, parent_end = e.ts + e.dur, parent.ts + parent.dur
                if end <= parent_end and (e.ts > parent.ts or end < parent_end):
                    parents.add(open_[-1])
            open_.append(i)
    return sorted((e for i, e in enumerate(events) if i not in parents), key=lambda e: e.ts)


def marked_window(trace: dict[str, Any], decode_s: float) -> tuple[float, float] | None:
    """``(start, end)`` in trace microseconds of the decode: the last ``decode_s`` seconds of
    the host annotation :data:`MARK` around the completion. None without the annotation."""
    marks = [e for e in trace.get("traceEvents", [])
             if e.get("ph") == "X" and e.get("name") == MARK]
    if not marks:
        return None
    end = float(marks[-1]["ts"]) + float(marks[-1]["dur"])
    return end - decode_s * 1e6, end


def decode_events(events: list[Event], window: tuple[float, float] | None
                  ) -> tuple[list[Event], str]:
    """The events inside ``window`` and which window that was. Without one, or where none
    falls inside it (a device clock the trace does not align with the host's), every event
    of the trace, the prompt's included, and the name says so."""
    if window is None:
        return events, "whole trace (no annotation)"
    inside = [e for e in events if window[0] <= e.ts < window[1]]
    if not inside and events:
        return events, "whole trace (no device event inside the annotated decode)"
    return inside, "annotated decode"


def union_us(events: list[Event]) -> float:
    """Microseconds covered by at least one of ``events``."""
    total, reach = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.ts):
        start, end = max(e.ts, reach), e.ts + e.dur
        if end > start:
            total += end - start
        reach = max(reach, end)
    return total


# -- scopes to buckets ----------------------------------------------------------------------


def bucket(scope: str, layer_types: tuple[str, ...]) -> tuple[str, str, int | None]:
    """``(kind, "<home>/<part>", layer index)`` of a scope path such as
    ``jit(f)/layer_3/mlp/dot_general``: home is the layer's kind (``layer`` for a scanned
    stack, whose index the scope does not name) or the top-level scope outside the layers;
    kind is home, but ``ple`` for anything under a ``ple`` scope."""
    parts = scope.split("/")
    layer = next((int(p[6:]) for p in parts
                  if p.startswith("layer_") and p[6:].isdigit()), None)
    inner = next((p for p in reversed(parts) if p in PARTS), None)
    if layer is not None:
        home = layer_types[layer] if layer < len(layer_types) else "layer"
    elif "layer" in parts:
        home = "layer"
    else:
        home = next((p for p in OUTSIDE if p in parts), "other")
    return ("ple" if inner == "ple" else home), f"{home}/{inner or 'rest'}", layer


def short_scope(scope: str) -> str:
    """A scope path without its program's name and the loops' scaffolding."""
    parts = scope.split("/")
    if parts and parts[0].startswith("jit("):
        parts = parts[1:]
    return "/".join(p for p in parts if p not in _SCAFFOLD)


def scope_in_args(args: dict[str, Any]) -> str | None:
    """A scope path an event's own arguments carry (a trace that names the framework op),
    when no instruction was found for it."""
    for value in args.values():
        text = str(value)
        named = _OP_NAME.search(text)
        text = named.group(1) if named else text
        if "/" in text and _SCOPED.search(text):
            return text
    return None


def scope_of(event: Event, index: HloIndex) -> tuple[Op | None, str | None]:
    """The instruction behind ``event`` (None where none was found) and its scope (None: the
    event is unmapped)."""
    module = event.args.get("hlo_module")
    op = index.find(str(event.args.get("hlo_op") or "") or None,
                    None if module is None else str(module), event.name)
    return op, op.scope if op is not None else scope_in_args(event.args)


def summarize(events: list[Event], index: HloIndex, layer_types: tuple[str, ...],
              tokens: int, top: int = 15) -> dict[str, Any]:
    """A decode window's device events as the figures a case records (see the module's
    docstring); ``tokens`` decoded in it."""
    per = max(tokens, 1)
    seen: dict[str, set[str]] = collections.defaultdict(set)
    for e in events:
        if e.args.get("hlo_op"):
            seen[str(e.args.get("hlo_module", ""))].add(str(e.args["hlo_op"]))
    index.choose(seen)
    kinds: dict[str, float] = collections.Counter()
    kind_calls: dict[str, int] = collections.Counter()
    parts: dict[str, float] = collections.Counter()
    layers: dict[int, float] = collections.Counter()
    ops: dict[tuple[str, str, str], list[float]] = {}
    unmapped: dict[str, list[float]] = {}
    mapped_events, mapped_us, inferred_us, total_us = 0, 0.0, 0.0, 0.0
    for e in events:
        total_us += e.dur
        op, scope = scope_of(e, index)
        if scope is None:
            kinds["unmapped"] += e.dur
            parts["unmapped"] += e.dur
            kind_calls["unmapped"] += 1
            u = unmapped.setdefault(e.name, [0, 0.0])
            u[0] += 1
            u[1] += e.dur
            continue
        mapped_events += 1
        mapped_us += e.dur
        if op is not None and op.inferred:
            inferred_us += e.dur
        kind, where, layer = bucket(scope, layer_types)
        kinds[kind] += e.dur
        kind_calls[kind] += 1
        parts[where] += e.dur
        if layer is not None:
            layers[layer] += e.dur
        key = (op.name, op.opcode, scope) if op is not None else (e.name, "?", scope)
        o = ops.setdefault(key, [0, 0.0])
        o[0] += 1
        o[1] += e.dur

    def us(x: float) -> float:
        return round(x / per, 3)

    ranked = sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "device_events": len(events),
        "kernels_per_token": round(len(events) / per, 2),
        "summed_device_us_per_token": us(total_us),
        "mapped_events": mapped_events,
        "mapped_event_share": round(mapped_events / len(events), 4) if events else 0.0,
        "mapped_time_share": round(mapped_us / total_us, 4) if total_us else 0.0,
        "inferred_scope_time_share": round(inferred_us / total_us, 4) if total_us else 0.0,
        "us_per_token_by_kind": {k: us(v) for k, v in sorted(kinds.items(), key=lambda kv:
                                                             -kv[1])},
        "kernels_per_token_by_kind": {k: round(v / per, 2) for k, v in kind_calls.items()},
        "us_per_token_by_part": {k: us(v) for k, v in sorted(parts.items(), key=lambda kv:
                                                             -kv[1])},
        "us_per_token_by_layer": {str(i): us(layers[i]) for i in sorted(layers)},
        "top_ops": [{"name": name, "opcode": code, "scope": short_scope(scope),
                     "calls_per_token": round(n / per, 2), "us_per_token": us(t)}
                    for (name, code, scope), (n, t) in ranked],
        "unmapped_top": [{"name": name[:120], "calls_per_token": round(n / per, 2),
                          "us_per_token": us(t)}
                         for name, (n, t) in sorted(unmapped.items(),
                                                    key=lambda kv: -kv[1][1])[:5]],
    }


def window_figures(events: list[Event], tokens: int, host_decode_s: float) -> dict[str, Any]:
    """Kernels a token and the device's busy share over the window of ``events``."""
    if not events:
        return {"device_busy": 0.0, "device_busy_of_host_decode": 0.0,
                "device_us_per_token": 0.0, "device_window_s": 0.0}
    busy = union_us(events)
    span = max(e.ts + e.dur for e in events) - min(e.ts for e in events)
    return {"device_busy": round(busy / span, 4) if span > 0 else 0.0,
            "device_busy_of_host_decode": round(busy / (host_decode_s * 1e6), 4)
            if host_decode_s > 0 else 0.0,
            "device_us_per_token": round(busy / max(tokens, 1), 3),
            "device_window_s": round(span / 1e6, 6)}


# -- the suite ------------------------------------------------------------------------------


def _dump_count(preset: Preset) -> int:
    raw = os.environ.get("TSJ_PROFILE_DUMP", "")
    return int(raw) if raw.strip().isdigit() else preset.dump_events


def _dump(path: Path, trace: dict[str, Any], events: list[Event], index: HloIndex,
          count: int, how: str) -> None:
    """The first ``count`` device events as the trace gives them, what the trace's processes
    and threads are called, and the programs captured: what a mapping is fixed from."""
    processes, threads = _names(trace)
    raw: list[dict[str, Any]] = [dataclasses.asdict(e) for e in events[:count]]
    if not raw:  # nothing was told apart as a device event: show what the trace has
        raw = [e for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("args")][:count]
    unmapped = [dataclasses.asdict(e) for e in events if scope_of(e, index)[1] is None][:50]
    path.write_text(json.dumps({
        "selection": how,
        "processes": {str(k): v for k, v in processes.items()},
        "threads": sorted(set(threads.values())),
        "modules": {m: [len(t) for t, _ in programs] for m, programs in index.modules.items()},
        "events": raw, "unmapped": unmapped}, indent=1, default=str) + "\n")


def profile_case(shape: str, preset: Preset, results: common.Results) -> dict[str, Any]:
    import jax

    import turbospark_jax as tsj

    jax.clear_caches()  # every program the loop takes compiles again, inside the capture
    capacity = preset.context + preset.new_tokens + 64
    with capture_hlo() as texts:
        built = common.build(shape, capacity=capacity, exact=True,
                             burst=min(64, preset.new_tokens), dtype=preset.dtype)
        request = tsj.CompletionRequest(
            prompt_ids=common.prompt_ids(preset.context, built.config.vocab_size),
            max_tokens=preset.new_tokens, sampling=tsj.SamplingConfig(), seed=3,
            parallel_prefill=True)
        tsj.run_raw_completion(built.producer, request)
    untraced = tsj.run_raw_completion(built.producer, request)
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder), jax.profiler.TraceAnnotation(MARK):
            traced = tsj.run_raw_completion(built.producer, request)
        trace = read_trace(Path(folder))
    tokens = len(traced.token_ids) - 1
    decode_s = traced.timings.decode_s
    events, how = device_events(trace)
    events, where = decode_events(events, marked_window(trace, decode_s))
    index = HloIndex(texts)
    figures = {
        "width": built.producer.width,
        "tokens_decoded": tokens,
        "untraced_tokens_per_s": round(untraced.timings.decode_tokens_per_s(
            len(untraced.token_ids)), 2),
        "traced_tokens_per_s": round(traced.timings.decode_tokens_per_s(
            len(traced.token_ids)), 2),
        "host_decode_s": round(decode_s, 6),
        **window_figures(events, tokens, decode_s),
        **summarize(events, index, tuple(built.config.layer_types), tokens, preset.top),
        "event_selection": how,
        "window": where,
        "hlo_programs_captured": sum(len(p) for p in index.modules.values()),
        "command_buffers_in_profile": "xla_enable_command_buffers_during_profiling=true"
        in os.environ.get("XLA_FLAGS", ""),
    }
    count = _dump_count(preset)
    if count > 0:
        path = results.path.parent / f"profile_{results.data['preset']}_{shape}_events.json"
        _dump(path, trace, events, index, count, how)
        figures["events_dump"] = path.name
    return figures


def run(preset: Preset, results: common.Results) -> None:
    results.data["meta"]["profile_dump"] = _dump_count(preset)
    for shape in preset.shapes:
        label = {"shape": shape, "exact": True, "context": preset.context,
                 "new_tokens": preset.new_tokens}
        started = time.perf_counter()
        case = results.case(label, lambda s=shape: profile_case(s, preset, results))
        if case is not None:
            case["case_s"] = round(time.perf_counter() - started, 1)
            results.write()
