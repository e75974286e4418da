"""One process of a multi-host tensor-parallel decode (started by
:func:`turbospark_jax.parallel.distributed.launch_local`).

Every process joins the run, builds the global mesh over all processes' devices, makes the
same random dense model straight into its shards, and runs the same greedy completion (a
chunked prefill, then decode bursts) through a
:class:`~turbospark_jax.parallel.sharding.ShardedProducer`. It prints one JSON line: its process
index,
the devices it sees, and the tokens; the test checks that the processes agree.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from turbospark_jax.generation.completion import CompletionRequest
from turbospark_jax.models.dense.config import DenseConfig
from turbospark_jax.parallel import distributed

#: The model every process builds (weights large enough that greedy decoding does not repeat
#: one token), and the request every process runs.
CONFIG = DenseConfig(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
                     head_dim=16, tie_word_embeddings=True, initializer_range=0.3)
SEED = 11
REQUEST = CompletionRequest(prompt_ids=[3, 17, 5, 3, 17, 5, 40, 2, 9], max_tokens=8,
                            prefill_chunk_size=4, burst=4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--cpu-devices", type=int, default=None)
    a = parser.parse_args()
    distributed.initialize(a.coordinator, a.num_processes, a.process_id,
                           cpu_devices=a.cpu_devices)

    # Imported after initialize: nothing may touch a JAX backend before it.
    from turbospark_jax.generation.driver import run_raw_completion
    from turbospark_jax.models.dense.model import DenseModel
    from turbospark_jax.parallel.sharding import ShardedProducer, init_sharded_params, tp_mesh

    model = DenseModel(CONFIG, jnp.float32)
    mesh = tp_mesh()  # every device of every process
    params = init_sharded_params(model, jax.random.PRNGKey(SEED), mesh)
    producer = ShardedProducer(model, params, mesh=mesh, capacity=64, width=4,
                               steps_per_call=4)
    completion = run_raw_completion(producer, REQUEST)
    print(json.dumps({
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "compilation_cache": bool(jax.config.jax_enable_compilation_cache),
        "tokens": [int(t) for t in completion.token_ids],
    }), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
