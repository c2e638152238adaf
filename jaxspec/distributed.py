"""Several hosts: JAX's own multi-controller runtime (`jax.distributed`), one process per host.

Every process runs the same program: it loads the same checkpoint, builds `jaxspec.make_mesh` over all
processes' devices (jax.devices() lists them all), and calls `jaxspec.generate` with the same arguments.
Parameters go into the shards each process owns (`sharding.place`), the jitted loops run as one SPMD program
across the hosts, and results are gathered back to every process (`sharding.to_host`).
"""
from __future__ import annotations

import jax


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_count: int | None = None) -> None:
    """Join the job before any other JAX call.

    On GPU clusters (SLURM, Open MPI, Kubernetes, ...) JAX finds all three arguments itself. On CPU (tests, a
    dry run) pass them, with `local_device_count` fake devices per process; CPU collectives then go over gloo.
    """
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", int(local_device_count))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU client reads it
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def shutdown() -> None:
    jax.distributed.shutdown()


__all__ = ["initialize", "shutdown"]
