"""device_flags: importing the package leaves XLA_FLAGS alone; a decode program and a greedy
fixed-form burst of rounds record their while loops as CUDA graphs through their own compiler
options, every other program keeps XLA's defaults."""

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
import turbospark_jax
import jax.numpy as jnp
total = float(jnp.arange(4.0).sum())
print(json.dumps({"flags": os.environ.get("XLA_FLAGS"), "total": total}))
"""


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    clean.update(env, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _PROBE], env=clean, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_leaves_the_flags_alone():
    assert _probe() == {"flags": None, "total": 6.0}
    mine = "--xla_cpu_enable_fast_math=false"
    assert _probe(XLA_FLAGS=mine) == {"flags": mine, "total": 6.0}


def test_a_decode_program_records_its_while_loops():
    want = {"xla_gpu_enable_command_buffer": device_flags.DECODE_COMMAND_BUFFERS}
    assert device_flags.decode_program_options() == want
    assert "WHILE" in want["xla_gpu_enable_command_buffer"].split(",")


def test_greedy_fixed_rounds_take_the_decode_options_and_sampled_ones_never():
    assert device_flags.fixed_rounds_options(True) == device_flags.decode_program_options()
    assert device_flags.fixed_rounds_options(False) is None


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
    from turbospark_jax.kernels.plan import KernelPlan
    from turbospark_jax.models.dense.config import DenseConfig
    from turbospark_jax.models.dense.model import DenseModel
    from turbospark_jax.testing.toy import ToyAttentionModel

    programs = block_program.BlockPrograms(ToyAttentionModel(vocab=8, dim=4), donate=False)
    assert programs.decode is programs.any  # widths that do not agree: one program
    config = DenseConfig(model_type="llama", vocab_size=16, hidden_size=16,
                         intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8)
    model = DenseModel(config, jnp.float32, plan=KernelPlan(row_invariant=True))
    assert model.widths_agree
    assert block_program.BlockPrograms(model, donate=False).decode is not \
        block_program.BlockPrograms(model, donate=False).any
