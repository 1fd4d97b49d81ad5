"""Save: an Orbax checkpoint of the sharded parameters, restorable onto any mesh.

The output directory holds `params/` (Orbax `StandardCheckpointer`) and
`port.json` (the mapping text, `config.json`, and each leaf's shape, dtype and
logical axes), so `restore` can rebuild the module and shard it for a new mesh.
It is written beside the target under a hidden name and renamed when complete, so
a failed save leaves no directory behind. In a multi-process run every process
calls `save` with the same directory (on a file system they share), each writes
its own shards, and process 0 finishes the directory.

```python
save(model, "out/gpt2", mapping, config)
model = restore("out/gpt2", make_mesh("2x4"))
```
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping as AnyMapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ._distributed import barrier
from ._errors import PortError
from ._fill import fill
from ._mapping import Mapping, dtype as dtype_named, parse_mapping
from ._plan import partition
from ._skeleton import leaves, skeleton

FORMAT = 1


def _nest(flat: AnyMapping[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, name = path.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = value
    return tree


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for name, value in tree.items():
        path = f"{prefix}{name}"
        flat.update(_flatten(value, path + ".") if isinstance(value, dict) else {path: value})
    return flat


def check_out(directory: str | os.PathLike, force: bool = False) -> Path:
    """The absolute output path, refusing an existing one unless `force`."""
    directory = Path(directory).absolute()
    if directory.exists() and not force:
        raise PortError(f"--out {directory}: already exists (use --force to replace it)")
    if not directory.parent.is_dir():
        raise PortError(f"--out {directory}: parent directory does not exist")
    return directory


def save(
    model: Any,
    directory: str | os.PathLike,
    mapping: Mapping,
    config: AnyMapping[str, Any],
    force: bool = False,
) -> Path:
    """Write the model's arrays with Orbax, plus `port.json`; atomically, by rename."""
    import orbax.checkpoint as ocp

    directory = check_out(directory, force)
    axes = {p.path: p.axes for p in mapping.params}
    arrays = {p: a for p, a in leaves(model).items() if isinstance(a, jax.Array)}
    meta = {
        "format": FORMAT,
        "mapping_source": mapping.source,
        "mapping": mapping.text,
        "config": dict(config),
        "leaves": {
            p: {"shape": list(a.shape), "dtype": np.dtype(a.dtype).name, "axes": list(axes.get(p, ()))}
            for p, a in arrays.items()
        },
    }
    # One name for every process of a multi-process run: they write one checkpoint.
    tmp = directory.parent / f".{directory.name}.port-partial"
    lead = jax.process_index() == 0
    if lead:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier("port-save-start")
    try:
        # No compression: trained weights barely compress, and compressing doubled the
        # host memory of a save; at most 1 GB of arrays in flight to the writer.
        handler = ocp.PyTreeCheckpointHandler(
            use_compression=False, save_concurrent_gb=1, save_device_host_concurrent_gb=1
        )
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(tmp / "params", args=ocp.args.PyTreeSave(_nest(arrays)))
        barrier("port-save-written")
        if lead:
            (tmp / "port.json").write_text(json.dumps(meta, indent=1))
            if directory.exists():
                shutil.rmtree(directory)
            os.rename(tmp, directory)
        barrier("port-save-done")
    finally:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def restore(directory: str | os.PathLike, mesh: Mesh) -> Any:
    """Load a `port convert` output onto `mesh`, which may differ from the one it was written with."""
    import orbax.checkpoint as ocp

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
    restored = _flatten(ocp.StandardCheckpointer().restore(directory / "params", _nest(targets)))
    skel = skeleton(mapping, meta["config"])
    absent = {p: None for p, leaf in leaves(skel).items() if hasattr(leaf, "shape") and p not in restored}
    return fill(skel, restored | absent)
