"""device_flags: the loop-graphs setting goes into XLA_FLAGS only when asked for, only before
a backend starts, and never over the user's own command-buffer choice; a decode program's own
options follow the same switch."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from turbospark_jax.engine import loop_graphs as device_flags

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
             if k not in ("XLA_FLAGS", device_flags.OPT_IN)}
    clean.update(env, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _PROBE], env=clean, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_leaves_the_flags_alone_by_default():
    got = _probe(XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert got == {"again": False, "flags": "--xla_cpu_enable_fast_math=false", "total": 6.0}


def test_asked_for_the_flag_goes_in_and_jax_still_computes():
    got = _probe(XLA_FLAGS="--xla_cpu_enable_fast_math=false", **{device_flags.OPT_IN: "1"})
    assert got["again"] is False
    assert got["flags"].split() == ["--xla_cpu_enable_fast_math=false",
                                   device_flags.LOOP_GRAPHS_FLAG]
    assert got["total"] == 6.0


def test_the_users_command_buffer_choice_stands():
    mine = "--xla_gpu_enable_command_buffer="
    got = _probe(XLA_FLAGS=mine, **{device_flags.OPT_IN: "1"})
    assert got == {"again": False, "flags": mine, "total": 6.0}


def test_too_late_once_a_backend_has_started(monkeypatch):
    jnp.zeros(1).block_until_ready()  # this process's backend is up
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv(device_flags.OPT_IN, "1")
    assert device_flags.enable_loop_graphs() is False
    assert "XLA_FLAGS" not in os.environ


def test_a_decode_programs_options_follow_the_switch_and_the_users_flags(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv(device_flags.OPT_IN, raising=False)
    want = {"xla_gpu_enable_command_buffer": device_flags.DECODE_COMMAND_BUFFERS}
    assert device_flags.decode_program_options() == want
    assert "WHILE" in want["xla_gpu_enable_command_buffer"].split(",")
    monkeypatch.setenv(device_flags.OPT_IN, "0")
    assert device_flags.decode_program_options() is None
    monkeypatch.delenv(device_flags.OPT_IN)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    assert device_flags.decode_program_options() is None


def test_greedy_fixed_rounds_take_the_decode_options_and_sampled_ones_never(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv(device_flags.OPT_IN, raising=False)
    monkeypatch.delenv(device_flags.FIXED_ROUNDS_GRAPHS, raising=False)
    assert device_flags.fixed_rounds_options(True) == device_flags.decode_program_options()
    assert device_flags.fixed_rounds_options(True) is not None
    assert device_flags.fixed_rounds_options(False) is None
    monkeypatch.setenv(device_flags.FIXED_ROUNDS_GRAPHS, "0")
    assert device_flags.fixed_rounds_options(True) is None


def test_the_decode_options_compile_and_change_no_bit():
    """Every kind named is one this jaxlib knows (a misspelt one fails the compile), and the
    program computes what it computes without them."""
    x = jnp.arange(8.0)
    fn = lambda v: jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 1.5),  # noqa: E731
                                      (0, v))[1]
    plain = jax.jit(fn)(x)
    with_options = jax.jit(fn, compiler_options={"xla_gpu_enable_command_buffer":
                                                 device_flags.DECODE_COMMAND_BUFFERS})(x)
    assert np.array_equal(np.asarray(plain), np.asarray(with_options))


def test_a_decode_program_of_a_row_invariant_model_is_its_own_jit():
    from turbospark_jax.engine import program as block_program
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel
    from turbospark_jax.testing.toy import ToyAttentionModel

    programs = block_program.BlockPrograms(ToyAttentionModel(vocab=8, dim=4), donate=False)
    assert programs.decode is programs.any  # widths that do not agree: one program
    config = DenseConfig(model_type="llama", vocab_size=16, hidden_size=16,
                         intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8)
    model = DenseModel(config, jnp.float32, kernels="rowinv")
    assert model.widths_agree
    assert block_program.BlockPrograms(model, donate=False).decode is not \
        block_program.BlockPrograms(model, donate=False).any
