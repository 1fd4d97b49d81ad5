"""Restore: a `port convert` output onto any mesh, each device reading its region.

The output's `port.json` names the mapping (and through it the model class), the
`config.json` it was built from, and each leaf's shape, dtype and logical axes;
`restore` rebuilds the module's skeleton from them and asks Orbax for every leaf
under the `NamedSharding` the mapping's rules give on the new mesh.

```python
model = restore("out/gpt2", "2x4")
```
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from ._errors import PortError
from ._fill import fill
from ._mapping import dtype as dtype_named, parse_mapping
from ._mesh import as_mesh
from ._plan import partition
from ._save import FORMAT, nest
from ._skeleton import leaves, skeleton


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for name, value in tree.items():
        path = f"{prefix}{name}"
        flat.update(_flatten(value, path + ".") if isinstance(value, dict) else {path: value})
    return flat


def restore(directory: str | os.PathLike, mesh: Mesh | str | None = None) -> Any:
    """Load a `port convert` output onto `mesh`, which may differ from the one it was written with.

    `mesh` is a `Mesh` or a spec such as `"2x4"`, as for `load` (default: one device).
    The output names its model class (`port.json`); a class of your own must be
    importable (installed, or on `sys.path`).

    ```python
    model = restore("gpt2-jax", "2x4")
    ```
    """
    import orbax.checkpoint as ocp

    mesh = as_mesh(mesh)
    directory = Path(directory).absolute()
    try:
        meta = json.loads((directory / "port.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PortError(f"{directory}: not a port output (port.json: {e})") from None
    if meta.get("format") != FORMAT:
        raise PortError(f"{directory}/port.json: format {meta.get('format')} is not {FORMAT}")
    mapping = parse_mapping(meta["mapping"], f"{directory}/port.json")
    for axis, names in mapping.rules.items():
        for name in names:
            if name not in mesh.shape:
                raise PortError(f"rules.{axis} names mesh axis '{name}', which the mesh does not have")
    targets = {}
    for path, info in meta["leaves"].items():
        shape = tuple(info["shape"])
        spec, _ = partition(shape, tuple(info["axes"]), mapping.rules, mesh.shape)
        targets[path] = jax.ShapeDtypeStruct(
            shape, dtype_named(info["dtype"]), sharding=NamedSharding(mesh, spec)
        )
    restored = _flatten(ocp.StandardCheckpointer().restore(directory / "params", nest(targets)))
    skel = skeleton(mapping, meta["config"])
    absent = {p: None for p, leaf in leaves(skel).items() if hasattr(leaf, "shape") and p not in restored}
    return fill(skel, restored | absent)
