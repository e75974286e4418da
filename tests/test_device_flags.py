"""device_flags: the loop-graphs setting goes into XLA_FLAGS only before a backend starts,
never over the user's own command-buffer choice, and not when switched off."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp

from turbospark_jax import device_flags

_PROBE = """
import json, os
import turbospark_jax  # asks for the flag on import
from turbospark_jax import device_flags
again = device_flags.enable_loop_graphs()  # a second call changes nothing
import jax.numpy as jnp
total = float(jnp.arange(4.0).sum())  # the backend starts under the flags
print(json.dumps({"again": again, "flags": os.environ.get("XLA_FLAGS", ""),
                  "total": total}))
"""


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("XLA_FLAGS", device_flags.OPT_OUT)}
    clean.update(env, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _PROBE], env=clean, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_adds_the_flag_and_jax_still_computes():
    got = _probe(XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert got["again"] is False
    assert got["flags"].split() == ["--xla_cpu_enable_fast_math=false",
                                   device_flags.LOOP_GRAPHS_FLAG]
    assert got["total"] == 6.0


def test_the_users_command_buffer_choice_stands():
    mine = "--xla_gpu_enable_command_buffer="
    got = _probe(XLA_FLAGS=mine)
    assert got == {"again": False, "flags": mine, "total": 6.0}


def test_switched_off_by_the_environment():
    got = _probe(**{device_flags.OPT_OUT: "0"})
    assert got == {"again": False, "flags": "", "total": 6.0}


def test_too_late_once_a_backend_has_started(monkeypatch):
    jnp.zeros(1).block_until_ready()  # this process's backend is up
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv(device_flags.OPT_OUT, raising=False)
    assert device_flags.enable_loop_graphs() is False
    assert "XLA_FLAGS" not in os.environ
