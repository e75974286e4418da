"""Multi-host tensor parallelism, two processes on this machine with 4 CPU devices each.

The processes join one ``jax.distributed`` run, build a mesh over all 8 devices, make the
model in its shards and decode greedily; both must print the same tokens, and those must be
the tokens the same model decodes on one device here.
"""

import json

import jax
import jax.numpy as jnp
import pytest

from turbospark_jax.engine.producer import BlockProducer
from turbospark_jax.errors import BadInputError
from turbospark_jax.generation.driver import run_raw_completion
from turbospark_jax.models.dense.model import DenseModel
from turbospark_jax.parallel.distributed import initialize, launch_local
from turbospark_jax.testing import multihost_decode as M


def test_two_processes_decode_the_same_tokens():
    runs = launch_local("turbospark_jax.testing.multihost_decode", num_processes=2,
                        cpu_devices=4, timeout=500)
    for r in runs:
        assert r.returncode == 0, r.stderr[-4000:]
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
    assert [r["process"] for r in reports] == [0, 1]
    assert all(r["devices"] == 8 and r["local_devices"] == 4 for r in reports)
    # a CPU run compiles afresh: under jax 0.12 programs read back from the persistent cache
    # hung in their first collective (distributed.initialize)
    assert not any(r["compilation_cache"] for r in reports)
    assert reports[0]["tokens"] == reports[1]["tokens"]

    model = DenseModel(M.CONFIG, jnp.float32)
    single = BlockProducer(model, model.init_params(jax.random.PRNGKey(M.SEED)), capacity=64,
                           width=4, steps_per_call=4)
    want = [int(t) for t in run_raw_completion(single, M.REQUEST).token_ids]
    assert reports[0]["tokens"] == want
    assert len(set(want)) > 1  # a control on the model: its output is not one repeated token


def test_a_process_index_outside_the_run_is_refused():
    with pytest.raises(BadInputError, match="process_id=2"):
        initialize("localhost:1", num_processes=2, process_id=2)
