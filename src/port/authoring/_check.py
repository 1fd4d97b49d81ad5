"""Check: a mapping against a checkpoint and its model, on a mesh's shape, reading no tensor data.

Everything `plan` checks (every leaf filled once, every key used, ignored or tied,
shapes, dtypes, rules and mesh axes) is checked, and every problem found is
reported, not only the first. No device is needed: the mesh is only its axis sizes.

```python
try:
    recipe = check("draft.toml", "tinylm-checkpoint", mesh="4x2")
except port.PlanError as e:
    print("\\n".join(e.problems))
```
"""

from __future__ import annotations

import os
from collections.abc import Mapping as AnyMapping
from typing import Any

from jax.sharding import Mesh

from .._console import quoted
from .._errors import PlanError, PortError
from .._mapping import Mapping, load_mapping
from .._mesh import mesh_shape, mesh_spec
from .._plan import Plan, plan_problems
from .._skeleton import skeleton
from .._source import Checkpoint, open_checkpoint


def check(
    mapping: str | os.PathLike | Mapping,
    checkpoint: str | os.PathLike | Checkpoint,
    mesh: str | AnyMapping[str, int] | Mesh | None = None,
) -> Plan:
    """Check a mapping against a checkpoint and the model it names, listing every problem.

    Reads the mapping, the checkpoint's `config.json` and tensor headers, and builds
    the model's skeleton; reads no tensor data and needs no device.

    **Arguments:**

    - `mapping`: a mapping file or a parsed `Mapping`.
    - `checkpoint`: a checkpoint directory, a Hugging Face repo id, or an opened
      `Checkpoint` (one this opens, it closes).
    - `mesh`: the mesh to plan for: a spec such as `"4x2"` or `"data=2,model=2"`, axis
      sizes such as `{"data": 2, "model": 2}`, or a `Mesh` (only its shape is used);
      default: `"1x1"`.

    Returns the `Plan` when the mapping fits. Raises `PlanError` otherwise, whose
    `problems` list every problem found, each naming its entry or key.

    ```python
    recipe = port.check("mappings/gpt2.toml", "gpt2", mesh="data=2,model=2")
    len(recipe.leaves), recipe.params         # 20, 124439808
    ```
    """
    shape = _mesh_shape(mesh)
    parsed = mapping if isinstance(mapping, Mapping) else load_mapping(mapping)
    owned = not isinstance(checkpoint, Checkpoint)
    ckpt = open_checkpoint(checkpoint) if owned else checkpoint
    try:
        result = plan_problems(skeleton(parsed, ckpt.config), parsed, ckpt.tensors, ckpt.config, shape)
    finally:
        if owned:
            ckpt.close()
    if isinstance(result, Plan):
        return result
    raise PlanError(result)


def _mesh_shape(mesh: Any) -> dict[str, int]:
    """The axis sizes of a mesh given as a spec, as axis sizes, or as a `Mesh`."""
    if mesh is None:
        return mesh_shape("1x1")
    if isinstance(mesh, str):
        return mesh_shape(mesh)
    if isinstance(mesh, Mesh):  # only its shape is used
        mesh = dict(mesh.shape)
    if isinstance(mesh, AnyMapping) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in mesh.items()
    ):
        return mesh_shape(mesh_spec(dict(mesh)))  # the same checks as a spec's
    raise PortError(
        f"`mesh`: expected a spec such as '4x2', axis sizes such as {{'data': 2}}, or a Mesh; got {quoted(mesh)}"
    )
