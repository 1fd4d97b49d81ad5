"""The Python API: `load` a pretrained model, or `convert` into your own skeleton.

```python
import port

mesh = port.make_mesh("4x2")
model = port.load("gpt2", mesh=mesh)                 # a sharded port.models.gpt2.GPT2
logits = model(input_ids)

skel = eqx.filter_eval_shape(MyModel, ..., key=key)   # your own module
model = port.convert("ckpt/", skel, "my_mapping.toml", mesh)
```
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from jax.sharding import Mesh

from ._fill import fill
from ._mapping import Mapping, load_mapping, mapping_for
from ._mesh import as_mesh
from ._place import place
from ._plan import plan
from ._skeleton import skeleton as make_skeleton
from ._source import Checkpoint, open_checkpoint


def convert(
    checkpoint: str | os.PathLike | Checkpoint,
    skeleton: Any,
    mapping: str | os.PathLike | Mapping,
    mesh: Mesh,
    *,
    dtype: str | np.dtype | None = None,
) -> Any:
    """Fill `skeleton` from `checkpoint` through `mapping`, every leaf sharded on `mesh`."""
    if not isinstance(mapping, Mapping):
        mapping = load_mapping(mapping)
    owned = not isinstance(checkpoint, Checkpoint)
    ckpt = open_checkpoint(checkpoint) if owned else checkpoint
    try:
        recipe = plan(skeleton, mapping, ckpt.tensors, ckpt.config, mesh.shape, dtype)
        return fill(skeleton, place(recipe, ckpt, mesh))
    finally:
        if owned:
            ckpt.close()


def load(
    model: str | os.PathLike,
    mesh: Mesh | str | None = None,
    dtype: str | np.dtype | None = None,
    mapping: str | os.PathLike | Mapping | None = None,
) -> Any:
    """A pretrained model from a checkpoint directory or Hugging Face repo id, sharded on `mesh`.

    The architecture comes from `config.json` `model_type` unless `mapping` is given;
    `mesh` is a `Mesh` or a spec such as `"4x2"` (default: one device); `dtype` casts
    floating parameters.
    """
    with open_checkpoint(model) as ckpt:
        mapping = mapping_for(ckpt.config, mapping)
        return convert(ckpt, make_skeleton(mapping, ckpt.config), mapping, as_mesh(mesh), dtype=dtype)
