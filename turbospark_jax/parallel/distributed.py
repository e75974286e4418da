"""Multi-host runs: ``jax.distributed`` initialisation, and a launcher for one machine.

A multi-host run is one Python process per host (or per GPU group), all running the same
program. Each calls :func:`initialize` before anything else touches JAX; afterwards
``jax.devices()`` lists the devices of every process, a mesh over them
(:func:`~turbospark_jax.parallel.sharding.tp_mesh`) is global, and a
:class:`~turbospark_jax.parallel.sharding.ShardedProducer` on it runs one program across the hosts:
every process makes the same calls with the same arguments and gets the same tokens back.

On a cluster, start the processes with your scheduler and pass each the coordinator's
``host:port``, the process count and its own index. On one machine, :func:`launch_local`
does that with CPU devices, which is how the tests run the same code path.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence

import jax

from turbospark_jax.errors import BadInputError


def initialize(
    coordinator: str, num_processes: int, process_id: int, *, cpu_devices: int | None = None
) -> None:
    """Join a multi-process JAX run. Call it first, before any other JAX call.

    Args:
      coordinator: ``host:port`` of process 0, which hosts the coordination service.
      num_processes: processes in the run.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      cpu_devices: run on this many CPU devices per process (with gloo collectives between
        the processes) instead of the accelerators: for tests on one machine. Such a process
        compiles its programs afresh (jax's persistent compilation cache off).

    Raises:
      BadInputError: ``process_id`` is outside ``[0, num_processes)``.
    """
    if not 0 <= process_id < num_processes:
        raise BadInputError(
            f"process_id={process_id} must be in [0, {num_processes}); number the processes "
            "0 .. num_processes - 1"
        )
    if cpu_devices is not None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # Under jax 0.12 a gloo program read back from the persistent compilation cache hangs
        # in its first collective (the same two processes pass over a cold cache and hang
        # over the cache they wrote); programs of a CPU run are compiled afresh.
        jax.config.update("jax_enable_compilation_cache", False)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def launch_local(
    module: str, num_processes: int = 2, cpu_devices: int = 4, args: Sequence[str] = (),
    timeout: float = 600.0,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python -m module`` as ``num_processes`` processes of one multi-host run on this
    machine, and wait for them all.

    Each process gets ``--coordinator localhost:<free port> --num-processes N --process-id i
    --cpu-devices D`` followed by ``args``; the module passes the first four to
    :func:`initialize`.

    Returns:
      The completed processes, in process order (``stdout`` and ``stderr`` captured as text).

    Raises:
      subprocess.TimeoutExpired: a process ran past ``timeout`` (all are killed first).
    """
    coordinator = f"localhost:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, "--coordinator", coordinator,
             "--num-processes", str(num_processes), "--process-id", str(i),
             "--cpu-devices", str(cpu_devices), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        for i in range(num_processes)
    ]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done
