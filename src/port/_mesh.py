"""Meshes: `"4x2"` or `"data=2,expert=2,model=2"` -> a `jax.sharding.Mesh`.

`"4x2"` is the short form of `"data=4,model=2"` (and `"8"` of `"data=8,model=1"`);
the named form gives a mesh of any rank with any axis names, which mapping rules
may then name (`expert = "expert"`). On a machine with no accelerator, a mesh
needing more devices than there are is simulated with host CPU devices, which JAX
allows only before it starts.

```python
mesh = make_mesh("4x2")                    # Mesh(data=4, model=2)
mesh_shape("8")                            # {"data": 8, "model": 1}
mesh_shape("data=2,expert=2,model=2")      # {"data": 2, "expert": 2, "model": 2}
```
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping as AnyMapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ._console import quoted
from ._errors import PortError

AXES = ("data", "model")
MAX_DEVICES = 65536  # a mesh larger than any machine's: refused before anything is built
MAX_SIMULATED = 512  # CPU devices port simulates in one process (JAX's start-up grows with them)


_SHORT = re.compile(r"\s*[0-9]+(\s*x\s*[0-9]+)?\s*")
_NAMED = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([0-9]+)\s*")
_EXPECTED = "expected DATAxMODEL such as 4x2, a device count such as 8, or named axes such as data=2,expert=2,model=2"


def mesh_shape(spec: str) -> dict[str, int]:
    """The axis sizes a mesh spec names, in order; a one-line `PortError` naming `--mesh` if malformed.

    **Arguments:**

    - `spec`: `"4x2"` (data x model), `"8"` (data only, model 1), or named axes such as
      `"data=2,expert=2,model=2"`.

    ```python
    port.mesh_shape("4x2")              # {"data": 4, "model": 2}
    port.mesh_shape("data=2,expert=4")  # {"data": 2, "expert": 4}
    ```
    """
    spec = spec or ""
    if _SHORT.fullmatch(spec):
        pairs = list(zip(AXES, [*spec.split("x"), "1"][:2]))
    else:
        parts = [_NAMED.fullmatch(part) for part in spec.split(",")]
        if not all(parts):
            raise PortError(f"--mesh '{spec}': {_EXPECTED}")
        pairs = [(m.group(1), m.group(2)) for m in parts]
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise PortError(f"--mesh '{spec}': axis '{next(n for n in names if names.count(n) > 1)}' named twice")
    if any(len(size.strip()) > 6 for _, size in pairs):
        raise PortError(f"--mesh '{spec}': at most {MAX_DEVICES} devices")
    shape = {name: int(size) for name, size in pairs}
    if min(shape.values()) < 1:
        raise PortError(f"--mesh '{spec}': every axis needs at least one device")
    if math.prod(shape.values()) > MAX_DEVICES:
        raise PortError(
            f"--mesh '{spec}': {math.prod(shape.values())} devices, more than the {MAX_DEVICES} port accepts"
        )
    return shape


def mesh_spec(shape: dict[str, int]) -> str:
    """The named form of a mesh's axis sizes, as `mesh_shape` reads it: `"data=4,model=2"`."""
    return ",".join(f"{name}={size}" for name, size in shape.items())


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


def devices_per_process(shape: AnyMapping[str, int], processes: int, label: str | None = None) -> int:
    """How many of a mesh's devices each of `processes` processes holds; a `PortError` unless they split evenly."""
    total = math.prod(shape.values())
    if processes < 1 or total % processes:
        label = label or mesh_spec(dict(shape))
        raise PortError(f"--mesh {label} ({total} devices) does not split evenly over {processes} processes")
    return total // processes


def make_mesh(spec: str | dict[str, int], devices: list | None = None) -> Mesh:
    """A mesh from a spec or axis sizes, over the first devices JAX has.

    On a host with no accelerator, the CPU devices the mesh needs are simulated if JAX
    has not started yet (in a multi-process run, each process its share).

    **Arguments:**

    - `spec`: `"4x2"` (axes `data` x `model`), `"8"`, named axes of any rank such as
      `"data=2,expert=2,model=2"`, or a dict of axis sizes.
    - `devices`: the devices to lay out (default: `jax.devices()`, in order).

    ```python
    mesh = port.make_mesh("4x2")
    mesh = port.make_mesh({"data": 2, "expert": 2, "model": 2})
    ```
    """
    shape = mesh_shape(spec) if isinstance(spec, str) else dict(spec)
    needed = math.prod(shape.values())
    label = spec if isinstance(spec, str) else mesh_spec(shape)
    if devices is None:
        if not jax.distributed.is_initialized():
            simulate_devices(needed)
        else:  # every process adds its share, in a run port joined (one JAX joined alone sets its own)
            from ._distributed import num_processes

            if (processes := num_processes()) is not None:
                simulate_devices(devices_per_process(shape, processes, label))
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


def _sizes(mesh: Any) -> dict[str, int]:
    """The axis sizes of a mesh given as a spec, as axis sizes, or None (one device); checked as a spec is."""
    if mesh is None:
        return mesh_shape("1x1")
    if isinstance(mesh, str):
        return mesh_shape(mesh)
    if isinstance(mesh, AnyMapping) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in mesh.items()
    ):
        return mesh_shape(mesh_spec(dict(mesh)))
    raise PortError(
        f"`mesh`: expected a jax.sharding.Mesh, a spec such as '4x2', or axis sizes such as {{'data': 2}}; "
        f"got {quoted(mesh)}"
    )


def as_shape(mesh: Mesh | str | AnyMapping[str, int] | None) -> dict[str, int]:
    """The axis sizes of `mesh`, given as any of the forms `as_mesh` takes; needs no device."""
    return dict(mesh.shape) if isinstance(mesh, Mesh) else _sizes(mesh)


def as_mesh(mesh: Mesh | str | AnyMapping[str, int] | None) -> Mesh:
    """`mesh` itself, or the mesh `make_mesh` builds from a spec (`"2x4"`) or axis sizes; None is one device."""
    if isinstance(mesh, Mesh):
        return mesh
    return make_mesh(mesh if isinstance(mesh, str) else _sizes(mesh))  # a spec is named in messages as given
