"""Meshes: `"4x2"` -> a `jax.sharding.Mesh` with axes `data` x `model`.

On a machine with no accelerator, a mesh needing more devices than there are is
simulated with host CPU devices, which JAX allows only before it starts.

```python
mesh = make_mesh("4x2")            # Mesh(data=4, model=2)
mesh_shape("8")                    # {"data": 8, "model": 1}
```
"""

from __future__ import annotations

import math
import os
import re

import jax
import numpy as np
from jax.sharding import Mesh

from ._errors import PortError

AXES = ("data", "model")
MAX_DEVICES = 65536  # a mesh larger than any machine's: refused before anything is built
MAX_SIMULATED = 512  # CPU devices port simulates in one process (JAX's start-up grows with them)


def mesh_shape(spec: str) -> dict[str, int]:
    """Parse `"4x2"` (data x model) or `"8"` (data only) into axis sizes."""
    if not re.fullmatch(r"\s*[0-9]+(\s*x\s*[0-9]+)?\s*", spec or ""):
        raise PortError(f"--mesh '{spec}': expected DATAxMODEL such as 4x2, or a device count such as 8")
    if any(len(s.strip()) > 6 for s in spec.split("x")):
        raise PortError(f"--mesh '{spec}': at most {MAX_DEVICES} devices")
    sizes = [int(s) for s in spec.split("x")] + [1]
    if min(sizes) < 1:
        raise PortError(f"--mesh '{spec}': every axis needs at least one device")
    if math.prod(sizes) > MAX_DEVICES:
        raise PortError(f"--mesh '{spec}': {math.prod(sizes)} devices, more than the {MAX_DEVICES} port accepts")
    return dict(zip(AXES, sizes[:2]))


def _user_count() -> str | None:
    """The environment variable through which the user set the CPU device count, if any."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return "XLA_FLAGS"
    if os.environ.get("JAX_NUM_CPU_DEVICES"):
        return "JAX_NUM_CPU_DEVICES"
    return None


def simulate_devices(count: int) -> bool:
    """Ask JAX for `count` host CPU devices if it has not started; True when it applied.

    Only the CPU platform is affected; an accelerator backend keeps its devices. A
    device count the user set (`XLA_FLAGS`, `JAX_NUM_CPU_DEVICES`) is kept.
    """
    if _user_count():
        return False
    if count > MAX_SIMULATED:
        raise PortError(
            f"--mesh needs {count} devices in this process; port simulates at most {MAX_SIMULATED} CPU "
            "devices (on accelerators, JAX's own devices are used)"
        )
    if jax.config.jax_num_cpu_devices >= count:
        return False
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # JAX has started: its devices are what they are
        return False
    return True


def make_mesh(spec: str | dict[str, int], devices: list | None = None) -> Mesh:
    """A mesh with axes `data` x `model` from `"4x2"`, over the first devices JAX has."""
    shape = mesh_shape(spec) if isinstance(spec, str) else dict(spec)
    needed = math.prod(shape.values())
    label = spec if isinstance(spec, str) else "x".join(map(str, shape.values()))
    if devices is None:
        if jax.distributed.is_initialized():  # every process adds its share
            from jax._src.distributed import global_state

            simulate_devices(-(-needed // (global_state.num_processes or 1)))
        else:
            simulate_devices(needed)
        devices = jax.devices()
    if len(devices) < needed:
        platform = devices[0].platform if devices else "no"
        if platform != "cpu":
            hint = " (JAX_PLATFORMS=cpu simulates them on the host)"
        elif _user_count():
            hint = f" (the CPU device count is set by {_user_count()})"
        else:
            hint = (
                " (JAX started before port could add CPU devices: call port.make_mesh first, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={needed})"
            )
        raise PortError(f"--mesh {label} needs {needed} devices but JAX has {len(devices)} {platform}{hint}")
    grid = np.array(devices[:needed]).reshape(tuple(shape.values()))
    return Mesh(grid, tuple(shape))


def as_mesh(mesh: Mesh | str | dict[str, int] | None) -> Mesh:
    """`mesh` itself, or the mesh `make_mesh` builds from a spec such as `"2x4"`; None is one device."""
    if isinstance(mesh, Mesh):
        return mesh
    if mesh is not None and not isinstance(mesh, (str, dict)):
        raise PortError(f"`mesh`: expected a jax.sharding.Mesh or a spec such as '4x2', got {type(mesh).__name__}")
    return make_mesh("1x1" if mesh is None else mesh)
