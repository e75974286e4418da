"""``turbospark-jax serve``: its flags are checked before anything loads (one line, status 1)."""

import io

import pytest

from turbospark_jax.cli import main


@pytest.mark.parametrize(("argv", "words"), [
    (["--session-slots", "0"], "--session-slots must be >= 1"),
    (["--context", "1"], "--context must be >= 2"),
    (["--ngram", "0"], "--ngram must be >= 1"),
    (["--speculative", "--ngram", "2"], "choose one drafter"),
    (["--width", "0"], "--width must be >= 1"),
    (["--prefill-rows", "0"], "--prefill-rows must be >= 1"),
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--ngram", "2"], "one replica only"),
])
def test_bad_serve_flags_fail_before_loading(argv, words):
    err = io.StringIO()
    assert main(["serve", *argv], stdout=io.StringIO(), stderr=err) == 1
    assert words in err.getvalue() and err.getvalue().count("\n") == 1


def test_a_port_out_of_range_or_in_use_fails_before_loading():
    import socket

    err = io.StringIO()
    assert main(["serve", "--port", "70000"], stdout=io.StringIO(), stderr=err) == 1
    assert "--port must be <= 65535, got 70000" in err.getvalue()
    assert err.getvalue().count("\n") == 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        err = io.StringIO()
        assert main(["serve", "--port", str(port)], stdout=io.StringIO(), stderr=err) == 1
        assert f"cannot listen on 127.0.0.1:{port}" in err.getvalue()
        assert err.getvalue().count("\n") == 1
    from turbospark_jax.cli.arguments import check_port_free

    check_port_free("127.0.0.1", port)  # control: the same port, released, is free


def test_serve_help_names_the_endpoints():
    out = io.StringIO()
    assert main(["serve", "--help"], stdout=out, stderr=io.StringIO()) == 0
    assert "/v1/chat/completions" in out.getvalue() and "--session-slots" in out.getvalue()


def test_serve_speculative_picks_the_drafter_as_generate_does():
    pytest.importorskip("starlette")
    import jax

    from turbospark_jax.io.loading import DEFAULT_TARGET, embedded_model_path
    from turbospark_jax.server.build import load_server
    from turbospark_jax.speculative.choice import choose_drafter

    server = load_server(None, slots=1, context=64, dtype="float32", drafter="auto")
    choice = server.drafter
    want = choose_drafter(embedded_model_path(DEFAULT_TARGET), "auto", jax.default_backend())
    assert choice is not None and (choice.drafter, choice.draft_len) == (want.drafter,
                                                                         want.draft_len)
    assert choice.why == want.why and choice.why.startswith(f"auto picked {want.drafter}")
    assert load_server(None, slots=1, context=64, dtype="float32").drafter is None


def test_serve_refuses_a_drafter_the_model_does_not_have():
    pytest.importorskip("starlette")
    from turbospark_jax.errors import BadInputError
    from turbospark_jax.server.build import load_server

    with pytest.raises(BadInputError, match="assistant drafter is not available"):
        load_server(None, slots=1, context=64, drafter="assistant")
    with pytest.raises(BadInputError, match="choose one drafter"):
        load_server(None, slots=1, context=64, drafter="auto", ngram=2)


def test_serve_quantized_weights_and_kv_cache():
    """``load_server(quantize=, kv_dtype=)`` serves the quantized model (what ``serve
    --quantize --kv-dtype`` asks for): its params hold quantized weights, its caches store
    bytes, and a completion comes back over HTTP."""
    pytest.importorskip("starlette")
    import httpx
    import jax

    from turbospark_jax.quant.weights import QuantizedWeight
    from turbospark_jax.server.build import load_server
    from turbospark_jax.testing.live_server import running

    server = load_server(None, slots=1, context=64, dtype="float32", quantize="int8",
                         kv_dtype="int8", warm_up=False)  # the start-up tests cover warm-up
    producer = server.engine.producer
    assert producer.model.kv_dtype == "int8"
    assert any(isinstance(w, QuantizedWeight) for w in jax.tree.leaves(
        producer.params, is_leaf=lambda w: isinstance(w, QuantizedWeight)))
    with running(server) as url:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": server.config.model_name, "prompt": "def add(a, b):", "max_tokens": 4,
            "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_serve_refuses_a_bad_scheme_before_loading():
    err = io.StringIO()
    assert main(["serve", "--quantize", "int3"], stdout=io.StringIO(), stderr=err) == 1
    assert "--quantize int3" in err.getvalue()


def test_serve_takes_the_backends_pallas_plan_and_xla_elsewhere(monkeypatch):
    """``load_server`` serves a model on the backend's Pallas kernels where the backend has
    them (a GPU: the dense family's decode then runs in buckets, Qwen3.5 walks on its
    kernel) and on XLA's own kernels elsewhere; faked here by the plan ``serving_plan``
    resolves."""
    pytest.importorskip("starlette")
    from turbospark_jax.kernels.plan import XLA_PLAN, KernelPlan
    from turbospark_jax.server import build

    pallas = KernelPlan(row_invariant=False, pallas="interpret")
    monkeypatch.setattr(build, "serving_plan", lambda path, exact: pallas)
    served = build.load_server(None, slots=1, context=64, dtype="float32", warm_up=False)
    assert served.engine.producer.model.plan == pallas
    no_pallas = KernelPlan(row_invariant=True, pallas="off")  # the CPU's tiled forms
    monkeypatch.setattr(build, "serving_plan", lambda path, exact: no_pallas)
    served = build.load_server(None, slots=1, context=64, dtype="float32", warm_up=False)
    assert served.engine.producer.model.plan == XLA_PLAN


def test_a_serve_command_gives_the_callers_program_store_back():
    """``serve`` turns the CLI's program store on for its run; a command that ends (here on a
    replica count the machine cannot hold, refused after the store is set up) leaves the
    caller's store as it found it, as the generating commands do."""
    pytest.importorskip("starlette")
    from turbospark_jax.cli import main
    from turbospark_jax.core import compile_cache

    before = compile_cache.program_store()
    err = io.StringIO()
    assert main(["serve", "--replicas", "4096"], stdout=io.StringIO(), stderr=err) == 1
    assert "--replicas 4096" in err.getvalue()
    assert compile_cache.program_store() is before
