"""A quantized KV cache on a tensor-parallel mesh (2 simulated CPU devices, in a subprocess:
the device count is fixed when JAX starts): the rows split over their KV heads as an
unquantized cache's do, the scales whole on every device, and the guarantees hold bitwise
on the mesh. Its logits stay near one device's: a key split over the devices may round an
ulp apart, and so land a quantization step apart (1/254 of its row's range), which the
tolerance allows."""

import json
import os
import subprocess
import sys

CHECK = """
import json, jax, jax.numpy as jnp
from turbospark_jax.models.dense.model import DenseModel, unstack_layers
from turbospark_jax.parallel.sharding import ShardedProducer, tp_mesh
from turbospark_jax.testing import mesh_checks as M
model = DenseModel(M.config("llama", 4), jnp.float32, scan_layers=False, kv_dtype="int8")
params = unstack_layers(model.init_params(jax.random.PRNGKey(7)))
producer = ShardedProducer(model, params, mesh=tp_mesh(jax.devices()[:2]), capacity=64,
                           width=4, steps_per_call=4)
result = M.conformance(producer, full=False)
state = producer.prefill_chunk(producer.init_state(), M.PROMPT, 0)[1]
gap = M.against_one_device(model, params, result)
print(json.dumps({"passed": result["passed"], "dtype": str(state.cache.k[0].dtype),
                  "kv_spec": str(state.cache.k[0].sharding.spec),
                  "scale_spec": str(state.cache.k_scale[0].sharding.spec), **gap}))
"""


def test_quantized_cache_on_a_mesh():
    flags = os.environ.get("XLA_FLAGS", "")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=2".strip()}
    run = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["passed"] and got["dtype"] == "int8"
    assert "'tp'" in got["kv_spec"] and "'tp'" not in got["scale_spec"]
    assert got["same_tokens"] and got["max_abs_logit_diff"] <= 1e-2 * got["max_logit"]
