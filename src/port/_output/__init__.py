"""Port's output: the directory `port convert` writes, restorable onto any mesh.

`_layout` defines the format once (its files, port's metadata fields, the zarr chunk
files, the bounds it is read back under, `is_output`); `_directory` checks where `save`
may write (`check_out`); `_save` writes it (`save`, and `Saving` for `convert`, which
writes each leaf while the next is placed); `_read` reads its metadata back, untrusted
(`read_output`); `_restore` reads its arrays onto a mesh (`restore`, and `restore_plan`:
where each leaf would land on a mesh, from the metadata alone).

Names are imported when first used, each from its own module: `check_out`,
`read_output` and the layout import no JAX, so a command refused on them answers
without starting it.

```python
port.save(model, "gpt2-jax", mapping, config)
model = port.restore("gpt2-jax", "2x4")
```
"""

from typing import TYPE_CHECKING

from .._lazy import lazy

_EXPORTS = {
    "FORMAT": "._layout",
    "claims_output": "._layout",
    "is_output": "._layout",
    "port_version": "._layout",
    "check_out": "._directory",
    "Output": "._read",
    "describe": "._read",
    "read_output": "._read",
    "written_mesh": "._read",
    "LeafPlacement": "._restore",
    "RestorePlan": "._restore",
    "restore": "._restore",
    "restore_plan": "._restore",
    "Saving": "._save",
    "save": "._save",
}

if TYPE_CHECKING:  # what the names are, for type checkers; at run time they are imported when first used
    from ._directory import check_out
    from ._layout import FORMAT, claims_output, is_output, port_version
    from ._read import Output, describe, read_output, written_mesh
    from ._restore import LeafPlacement, RestorePlan, restore, restore_plan
    from ._save import Saving, save

__all__ = [  # the names of _EXPORTS, sorted
    "FORMAT",
    "LeafPlacement",
    "Output",
    "RestorePlan",
    "Saving",
    "check_out",
    "claims_output",
    "describe",
    "is_output",
    "port_version",
    "read_output",
    "restore",
    "restore_plan",
    "save",
    "written_mesh",
]

__getattr__, __dir__ = lazy(globals(), _EXPORTS)
