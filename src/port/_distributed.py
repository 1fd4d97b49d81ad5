"""Multi-process runs on JAX's own runtime (`jax.distributed`).

Every process runs the same conversion; the mesh spans all their devices, and
`jax.make_array_from_callback` asks each process only for the blocks of its own
devices, so each reads only what its devices hold. Orbax writes the output
collectively.

```python
port.initialize("10.0.0.1:1234", num_processes=2, process_id=0)   # before any JAX work
mesh = port.make_mesh("4x2")                                         # all processes' devices
model = port.load("gpt2", mesh=mesh)
```

The same from the environment: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`.
"""

from __future__ import annotations

import os

import jax

from ._errors import PortError
from ._mesh import simulate_devices


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise PortError(f"{name}={value!r}: expected an integer") from None


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_devices: int | None = None,
) -> bool:
    """Join a multi-process run, from the arguments or JAX's environment variables.

    Returns False (and does nothing) when neither names a run. On a machine with no
    accelerator, each process simulates `local_devices` CPU devices, and processes
    exchange data through gloo. Call it before JAX starts (before any JAX operation).
    """
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    given = (coordinator, num_processes, process_id)
    if all(v is None for v in given):
        return False
    if any(v is None for v in given):
        raise PortError(
            "a multi-process run needs all of --coordinator HOST:PORT, --num-processes N and "
            "--process-id I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)"
        )
    if ":" not in coordinator:
        raise PortError(f"--coordinator {coordinator!r}: expected HOST:PORT")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise PortError(f"--process-id {process_id}: expected 0 <= I < --num-processes {num_processes}")
    if local_devices:
        simulate_devices(local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id)
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PortError(f"--coordinator {coordinator}: could not join the run ({first})") from None
    return True


def barrier(name: str) -> None:
    """Wait for every process (a no-op in a single-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
