"""Meshes as text: a mesh spec parsed and checked, and how its devices split over a run's processes.

No JAX here: the command line checks `--mesh` and the process count before JAX is
imported, so a bad flag is told at once. (`_runtime` builds the mesh itself.)

```python
mesh_shape("4x2")                          # {"data": 4, "model": 2}
mesh_shape("8")                            # {"data": 8, "model": 1}
mesh_shape("data=2,expert=2,model=2")      # {"data": 2, "expert": 2, "model": 2}
mesh_spec({"data": 4, "model": 2})         # "data=4,model=2"
devices_per_process({"data": 4, "model": 2}, 2)   # 4
```
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping as AnyMapping

from ._errors import PortError, RunError

AXES = ("data", "model")
MAX_DEVICES = 65536  # a mesh larger than any machine's: refused before anything is built


_SHORT = re.compile(r"\s*[0-9]+(\s*x\s*[0-9]+)?\s*")
_NAMED = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([0-9]+)\s*")
_EXPECTED = "expected DATAxMODEL such as 4x2, a device count such as 8, or named axes such as data=2,expert=2,model=2"


def mesh_shape(spec: str) -> dict[str, int]:
    """The axis sizes a mesh spec names, in order; a one-line `PortError` naming `mesh=` if malformed.

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
        matches = [_NAMED.fullmatch(part) for part in spec.split(",")]
        parts = [m for m in matches if m is not None]
        if len(parts) != len(matches):
            raise PortError(f"mesh='{spec}': {_EXPECTED}")
        pairs = [(m.group(1), m.group(2)) for m in parts]
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise PortError(f"mesh='{spec}': axis '{next(n for n in names if names.count(n) > 1)}' named twice")
    if any(len(size.strip()) > 6 for _, size in pairs):
        raise PortError(f"mesh='{spec}': at most {MAX_DEVICES} devices")
    shape = {name: int(size) for name, size in pairs}
    if min(shape.values()) < 1:
        raise PortError(f"mesh='{spec}': every axis needs at least one device")
    if math.prod(shape.values()) > MAX_DEVICES:
        raise PortError(f"mesh='{spec}': {math.prod(shape.values())} devices, more than the {MAX_DEVICES} port accepts")
    return shape


def mesh_spec(shape: dict[str, int]) -> str:
    """The named form of a mesh's axis sizes, as `mesh_shape` reads it: `"data=4,model=2"`."""
    return ",".join(f"{name}={size}" for name, size in shape.items())


def devices_per_process(shape: AnyMapping[str, int], processes: int, label: str | None = None) -> int:
    """How many of a mesh's devices each of `processes` processes holds; a `PortError` unless they split evenly."""
    total = math.prod(shape.values())
    if processes < 1 or total % processes:
        label = label or mesh_spec(dict(shape))
        raise PortError(f"mesh={label} ({total} devices) does not split evenly over {processes} processes")
    return total // processes


def env_int(name: str) -> int | None:
    """The integer in environment variable `name` (`JAX_NUM_PROCESSES`); None when unset or empty."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise RunError(f"{name}={value!r}: expected an integer") from None
