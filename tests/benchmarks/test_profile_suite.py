"""The profile suite's trace reading, on a made-up HLO module and made-up traces in the two
shapes the suite meets (a CPU's ops on host threads, a GPU's kernels on stream threads): which
events count, the decode window, each event's instruction and scope, the buckets, and an event
nothing maps going to ``unmapped`` with its time. No profiling runs here."""

import json

import pytest

from benchmarks import profile
from benchmarks.report import profile_lines

P = "jit(_run_blocks)/while/body/block_forward"
HLO = f"""HloModule jit__run_blocks, is_scheduled=true, entry_computation_layout={{(f32[4]{{0}})->f32[4]{{0}}}}

%fused_computation (param_0: f32[4]) -> f32[4] {{
  %param_0 = f32[4]{{0}} parameter(0)
  ROOT %add.0 = f32[4]{{0}} add(%param_0, %param_0), metadata={{op_name="{P}/layer_1/mlp/add"}}
}}

%fused_computation.1 (param_0.1: f32[4]) -> f32[4] {{
  %param_0.1 = f32[4]{{0}} parameter(0)
  ROOT %mul.0 = f32[4]{{0}} multiply(%param_0.1, %param_0.1), metadata={{op_name="{P}/embed/ple/mul"}}
}}

ENTRY %main.1 (x.1: f32[4], w.1: f32[4,4]) -> f32[4] {{
  %x.1 = f32[4]{{0}} parameter(0), metadata={{op_name="x"}}
  %w.1 = f32[4,4]{{1,0}} parameter(1), metadata={{op_name="w"}}
  %gather_fusion = f32[4]{{0}} fusion(%x.1), kind=kLoop, calls=%fused_computation.1
  %dot.3 = f32[4]{{0}} dot(%gather_fusion, %w.1), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
  %rsqrt_fusion = f32[4]{{0}} rsqrt(%dot.3), metadata={{op_name="{P}/layer_0/attention/rsqrt"}}
  %add_fusion = f32[4]{{0}} fusion(%rsqrt_fusion), kind=kLoop, calls=%fused_computation, metadata={{op_name="{P}/layer_1/mlp/add"}}
  %head_dot = f32[4]{{0}} dot(%add_fusion, %w.1), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}, metadata={{op_name="{P}/head/dot_general"}}
  %sample_fusion = f32[4]{{0}} negate(%head_dot), metadata={{op_name="jit(_run_blocks)/while/body/sample/neg"}}
  ROOT %or.1 = f32[4]{{0}} abs(%sample_fusion), metadata={{op_name="jit(_run_blocks)/while/body/or"}}
}}
"""  # noqa: E501 - HLO lines are as long as XLA writes them
LAYERS = ("linear_attention", "full_attention")
#: one token's ops: (op, microseconds), and the buckets they fall in
TOKEN = (("gather_fusion", 10.0), ("dot.3", 20.0), ("rsqrt_fusion", 5.0), ("add_fusion", 30.0),
         ("head_dot", 40.0), ("sample_fusion", 3.0), ("or.1", 2.0))
KINDS = {"ple": 10.0, "linear_attention": 25.0, "full_attention": 30.0, "head": 40.0,
         "sample": 3.0, "other": 2.0}


def meta(pid, name, threads):
    out = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}]
    out += [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": t}}
            for tid, t in threads.items()]
    return out


def span(pid, tid, name, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur,
            "args": args}


def cpu_trace():
    """Two decode tokens on an XLA CPU thread, after an op of the prompt, inside a loop's own
    event, with one event no instruction matches; the decode is the annotation's last 600
    us."""
    events = meta(1, "/host:CPU", {1: "python", 2: "tf_XLAPjRtCpuClient/1"})
    events.append(span(1, 1, profile.MARK, 0.0, 1000.0))
    events.append(span(1, 2, "add_fusion", 100.0, 50.0, hlo_op="add_fusion",
                       hlo_module="jit__run_blocks"))  # the prompt's: before the window
    events.append(span(1, 2, "while.2", 450.0, 500.0, hlo_op="while.2",
                       hlo_module="jit__run_blocks"))  # encloses the body's ops
    ts = 460.0
    for _ in range(2):
        for op, dur in TOKEN:
            events.append(span(1, 2, op, ts, dur, hlo_op=op, hlo_module="jit__run_blocks"))
            events.append(span(1, 2, f"end: {op}", ts + dur, 0.1))
            ts += dur + 5.0
    events.append(span(1, 2, "mystery.7", ts, 7.0, hlo_op="mystery.7",
                       hlo_module="jit__run_blocks"))
    return {"traceEvents": events}


def test_a_cpu_trace_maps_every_op_it_can_and_keeps_the_rest_as_unmapped():
    trace = cpu_trace()
    events, how = profile.device_events(trace)
    assert how == "host threads running HLO ops"
    assert "while.2" not in {e.name for e in events}  # a parent: its body is counted instead
    events, where = profile.decode_events(events, profile.marked_window(trace, 600e-6))
    assert where == "annotated decode"
    assert len(events) == 2 * len(TOKEN) + 1  # the prompt's op is outside the window
    s = profile.summarize(events, profile.HloIndex([HLO]), LAYERS, tokens=2)
    assert s["kernels_per_token"] == 7.5
    assert s["us_per_token_by_kind"] == {**KINDS, "unmapped": 3.5}
    assert s["mapped_events"] == 14 and s["mapped_event_share"] == round(14 / 15, 4)
    total = 2 * sum(d for _, d in TOKEN)
    assert s["mapped_time_share"] == round(total / (total + 7.0), 4)
    assert s["unmapped_top"] == [{"name": "mystery.7", "calls_per_token": 0.5,
                                  "us_per_token": 3.5}]
    # the scopes XLA dropped: the fusion's from its root, the dot's from its user
    assert s["inferred_scope_time_share"] == round(2 * 30.0 / (total + 7.0), 4)
    assert s["us_per_token_by_part"] == {
        "head/rest": 40.0, "full_attention/mlp": 30.0, "linear_attention/attention": 25.0,
        "embed/ple": 10.0, "unmapped": 3.5, "sample/rest": 3.0, "other/rest": 2.0}
    assert s["us_per_token_by_layer"] == {"0": 25.0, "1": 30.0}
    top = s["top_ops"][0]
    assert top == {"name": "head_dot", "opcode": "dot", "scope": "block_forward/head/dot_general",
                   "calls_per_token": 1.0, "us_per_token": 40.0}
    figures = profile.window_figures(events, 2, 600e-6)
    busy = total + 7.0
    first, last = events[0].ts, events[-1].ts + events[-1].dur
    assert figures["device_busy"] == round(busy / (last - first), 4)
    assert figures["device_busy_of_host_decode"] == round(busy / 600.0, 4)
    assert figures["device_us_per_token"] == round(busy / 2, 3)


def test_without_the_programs_text_nothing_maps():
    """The control: the same events with no HLO captured all go to ``unmapped``."""
    trace = cpu_trace()
    events, _ = profile.decode_events(profile.device_events(trace)[0],
                                      profile.marked_window(trace, 600e-6))
    s = profile.summarize(events, profile.HloIndex([]), LAYERS, tokens=2)
    assert s["mapped_events"] == 0 and s["mapped_time_share"] == 0.0
    assert set(s["us_per_token_by_kind"]) == {"unmapped"}


def gpu_trace():
    """One token's kernels on a GPU stream, repeated on a derived thread that must not count:
    one kernel carries its op, one only a kernel name XLA derives from its op's, one only a
    framework scope in its arguments, one (a copy) nothing."""
    events = meta(1, "/host:CPU", {1: "python"}) + meta(
        7, "/device:GPU:0", {1: "Stream #14(Compute)", 2: "XLA Ops"})
    events.append(span(1, 1, profile.MARK, 0.0, 1000.0))
    events += [
        span(7, 1, "loop_add_fusion_kernel", 500.0, 30.0, hlo_op="add_fusion",
             hlo_module="jit__run_blocks", correlation_id=1),
        span(7, 1, "rsqrt_fusion", 540.0, 5.0),
        span(7, 1, "sm90_gemm_kernel", 550.0, 40.0,
             tf_op=f"{P}/layer_1/attention/dot_general"),
        span(7, 1, "MemcpyD2D", 600.0, 4.0),
        span(7, 2, "add_fusion", 500.0, 30.0, hlo_op="add_fusion"),
    ]
    return {"traceEvents": events}


def test_a_gpu_trace_counts_its_stream_kernels_and_maps_them_three_ways():
    trace = gpu_trace()
    events, how = profile.device_events(trace)
    assert how == "device kernel streams"
    events, _ = profile.decode_events(events, profile.marked_window(trace, 900e-6))
    assert [e.name for e in events] == ["loop_add_fusion_kernel", "rsqrt_fusion",
                                        "sm90_gemm_kernel", "MemcpyD2D"]
    s = profile.summarize(events, profile.HloIndex([HLO]), LAYERS, tokens=1)
    assert s["kernels_per_token"] == 4.0
    assert s["us_per_token_by_kind"] == {"full_attention": 70.0, "linear_attention": 5.0,
                                         "unmapped": 4.0}
    assert s["unmapped_top"][0]["name"] == "MemcpyD2D"


def test_a_window_no_device_event_falls_in_takes_the_whole_trace_and_says_so():
    trace = gpu_trace()
    events, _ = profile.device_events(trace)
    kept, where = profile.decode_events(events, (5000.0, 6000.0))
    assert kept == events and where.startswith("whole trace")


def test_the_dump_and_the_report(tmp_path):
    trace = cpu_trace()
    events, how = profile.device_events(trace)
    index = profile.HloIndex([HLO])
    case = {"shape": "toy", "untraced_tokens_per_s": 10.0, "traced_tokens_per_s": 8.0,
            **profile.window_figures(events, 2, 600e-6),
            **profile.summarize(events, index, LAYERS, tokens=2)}
    path = tmp_path / "dump.json"
    profile._dump(path, trace, events, index, 3, how)
    dump = json.loads(path.read_text())
    assert len(dump["events"]) == 3 and dump["events"][0]["args"]["hlo_op"] == "add_fusion"
    assert [e["name"] for e in dump["unmapped"]] == ["mystery.7"]
    assert dump["modules"] == {"jit__run_blocks": [13]}
    lines = "\n".join(profile_lines({"cases": [case]}))
    assert "| toy | 10.0 (8.0) |" in lines and "head 40.0" in lines


@pytest.mark.parametrize("scope, expected", [
    (f"{P}/layer_0/attention/rsqrt", ("linear_attention", "linear_attention/attention", 0)),
    (f"{P}/layer_1/ple/mul", ("ple", "full_attention/ple", 1)),
    (f"{P}/layer/mlp/dot", ("layer", "layer/mlp", None)),
    (f"{P}/layer_7/dot", ("layer", "layer/rest", 7)),
    ("jit(f)/while/body/or", ("other", "other/rest", None)),
])
def test_a_scope_falls_in_its_bucket(scope, expected):
    assert profile.bucket(scope, LAYERS) == expected


def program(module, *ops):
    lines = [f"HloModule {module}, is_scheduled=true", "",
             "ENTRY %main (x: f32[]) -> f32[] {", "  %x = f32[] parameter(0)"]
    lines += [f'  %{name} = f32[] negate(%x), metadata={{op_name="jit(f)/{scope}/neg"}}'
              for name, scope in ops]
    return "\n".join([*lines, "}", ""])


def test_a_name_compiled_twice_or_in_two_modules_maps_only_where_its_scope_is_certain():
    first = program("jit_step", ("fusion.1", "layer_0/mlp"))
    second = program("jit_step", ("fusion.1", "layer_1/attention"), ("fusion.2", "layer_1/mlp"))
    index = profile.HloIndex([first, second])
    index.choose({"jit_step": {"fusion.2"}})  # the trace ran the second program
    assert index.find("fusion.1", "jit_step", "k").scope == "jit(f)/layer_1/attention/neg"
    # a trace's module name with a suffix still finds its program
    assert index.find("fusion.2", "jit_step.3", "k").scope == "jit(f)/layer_1/mlp/neg"
    index.choose({"jit_step": {"fusion.1"}})  # both hold it: the newest
    assert index.find("fusion.1", "jit_step", "k").scope == "jit(f)/layer_1/attention/neg"
    other = profile.HloIndex([first, program("jit_other", ("fusion.1", "head"))])
    assert other.find("fusion.1", "jit_other", "k").scope == "jit(f)/head/neg"
    # no module named, two scopes for the name: unmapped, not guessed
    assert other.find("fusion.1", None, "fusion_1") is None
    assert other.find(None, None, "fusion_1") is None
