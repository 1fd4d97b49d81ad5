"""Convert: the whole pipeline in one call, source -> mapping -> skeleton -> plan -> place -> fill -> save.

`convert` is the one chain of steps: the command line's `port convert` calls it and
only formats what it returns. Everything is checked before a tensor byte is read
(the plan, the output directory and its free space, and in a multi-process run
that every process was given the same settings).

```python
import port

run = port.convert("gpt2", mesh="4x2", out="gpt2-jax")   # a Conversion
run.model                     # a sharded port.models.gpt2.GPT2
run.report.bytes_read         # 497758208
model = port.load("gpt2", mesh="4x2")                     # just the model

skel = port.skeleton(MyModel, config)                       # your own module
model = port.convert("ckpt/", skel, "my_mapping.toml", "2x2").model
```
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ._console import size_text
from ._errors import OutputError
from ._fill import fill
from ._mapping import Mapping, mapping_for
from ._memory import PeakMemory
from ._place import place
from ._plan import LeafPlan, Plan, plan
from ._runtime import agree, as_mesh, mesh_spec
from ._save import check_out, free_bytes, save
from ._skeleton import skeleton as make_skeleton
from ._source import Checkpoint, open_checkpoint


@dataclass(frozen=True)
class Progress:
    """Where a conversion is: `phase` "read" (reading and placing) or "write", bytes done of total."""

    phase: str
    done: int
    total: int
    leaves_done: int
    leaves: int


@dataclass(frozen=True)
class Report:
    """What a conversion did: seconds per phase, bytes read, bytes per device, peak host memory."""

    process: int
    num_processes: int
    out: str | None
    mesh: dict[str, int]
    dtype: str | None
    seconds: float
    place_seconds: float
    save_seconds: float
    params: int
    bytes_read: int
    device_bytes: dict[str, int]
    peak_host_bytes: int

    def to_json(self) -> dict[str, Any]:
        """The report as `port convert --report` writes it."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Conversion:
    """The result of `convert`: the sharded model, the plan it followed, and the report."""

    model: Any
    plan: Plan
    report: Report


def fingerprint(checkpoint: Checkpoint) -> str:
    """A digest of a checkpoint's config and tensor headers: equal for the same checkpoint on every host."""
    headers = sorted((k, t.dtype.name, list(t.shape)) for k, t in checkpoint.tensors.items())
    text = json.dumps([checkpoint.config, headers], sort_keys=True, default=str)
    return f"config and headers sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"


def convert(
    checkpoint: str | os.PathLike | Checkpoint,
    skeleton: Any = None,
    mapping: str | os.PathLike | Mapping | None = None,
    mesh: Mesh | str | None = None,
    *,
    dtype: str | np.dtype | None = None,
    out: str | os.PathLike | None = None,
    force: bool = False,
    progress: Callable[[Progress], None] | None = None,
) -> Conversion:
    """Convert a checkpoint into a sharded model, and save it to `out` if given.

    **Arguments:**

    - `checkpoint`: a checkpoint directory, a Hugging Face repo id, or an opened `Checkpoint`.
    - `skeleton`: the module to fill (`port.skeleton(MyModel, config)`); default: the
      mapping's model built from the checkpoint's `config.json`.
    - `mapping`: a `Mapping` or a mapping file; default: the shipped one for `model_type`.
    - `mesh`: a `Mesh` or a spec such as `"4x2"` or `"data=2,model=4"` (default: one device).
    - `dtype`: cast floating parameters (`"bfloat16"`, ...); default: keep the checkpoint's.
    - `out`: write the model there as an Orbax checkpoint (`port.restore` reads it back);
      `force` replaces an earlier port output there, and nothing else.
    - `progress`: called with a `Progress` after each leaf is placed, and as writing
      starts and ends.

    Returns a `Conversion`: `.model`, `.plan`, `.report`.

    ```python
    run = convert("gpt2", mesh="4x2", out="gpt2-jax", progress=print)
    ```
    """
    start = time.perf_counter()
    owned = not isinstance(checkpoint, Checkpoint)
    with PeakMemory() as peak:
        ckpt = open_checkpoint(checkpoint) if owned else checkpoint
        try:
            mapping = mapping_for(ckpt.config, mapping)
            if skeleton is None:
                skeleton = make_skeleton(mapping, ckpt.config)
            if out is not None:
                out = check_out(out, force, inputs=(ckpt.directory,))
            mesh = as_mesh(mesh)
            recipe = plan(skeleton, mapping, ckpt.tensors, ckpt.config, mesh.shape, dtype)
            if out is not None:
                if recipe.nbytes > (free := free_bytes(out)):
                    raise OutputError(
                        f"--out {out}: needs {size_text(recipe.nbytes)}, only {size_text(free)} free on its file system"
                    )
            agree(
                {
                    "--mesh": mesh_spec(dict(mesh.shape)),
                    "--dtype": None if dtype is None else str(dtype),
                    "--out": None if out is None else str(out),
                    "--force": force,
                    "--mapping": mapping.text,  # its text: the file may sit at another path on each host
                    "MODEL": fingerprint(ckpt),
                }
            )
            placed = 0

            def advance(leaf: LeafPlan) -> None:
                nonlocal placed
                placed += 1
                if progress is not None:
                    progress(Progress("read", ckpt.bytes_read, recipe.read_bytes, placed, len(recipe.leaves)))

            if progress is not None:
                progress(Progress("read", 0, recipe.read_bytes, 0, len(recipe.leaves)))
            placing = time.perf_counter()
            arrays = place(recipe, ckpt, mesh, advance)
            model = fill(skeleton, arrays)
            jax.block_until_ready(arrays)
            writing = time.perf_counter()
            if out is not None:
                total = recipe.nbytes
                if progress is not None:
                    progress(Progress("write", 0, total, 0, len(recipe.leaves)))
                out = save(model, out, mapping, ckpt.config, force=force, sources=ckpt.tensors)
                if progress is not None:
                    progress(Progress("write", total, total, len(recipe.leaves), len(recipe.leaves)))
            done = time.perf_counter()
        finally:
            if owned:
                ckpt.close()
    device_bytes: dict[str, int] = {}
    for array in arrays.values():
        for shard in array.addressable_shards if array is not None else ():
            device_bytes[str(shard.device.id)] = device_bytes.get(str(shard.device.id), 0) + shard.data.nbytes
    report = Report(
        process=jax.process_index(),
        num_processes=jax.process_count(),
        out=None if out is None else str(out),
        mesh=dict(mesh.shape),
        dtype=None if dtype is None else str(dtype),
        seconds=round(time.perf_counter() - start, 3),
        place_seconds=round(writing - placing, 3),
        save_seconds=round(done - writing, 3),
        params=recipe.params,
        bytes_read=ckpt.bytes_read,
        device_bytes=device_bytes,
        peak_host_bytes=peak.bytes,
    )
    return Conversion(model, recipe, report)


def load(
    model: str | os.PathLike,
    mesh: Mesh | str | None = None,
    dtype: str | np.dtype | None = None,
    mapping: str | os.PathLike | Mapping | None = None,
) -> Any:
    """A pretrained model from a checkpoint, sharded on `mesh`: `convert(...).model`.

    **Arguments:**

    - `model`: a checkpoint directory or a Hugging Face repo id.
    - `mesh`: a `Mesh` or a spec such as `"4x2"` or `"data=2,model=4"` (default: one device).
    - `dtype`: cast floating parameters (`"bfloat16"`, ...); default: keep the checkpoint's.
    - `mapping`: a `Mapping` or a mapping file; default: the shipped one for `config.json`'s
      `model_type`, whose module is the model built.

    ```python
    model = load("gpt2", mesh="4x2")
    ```
    """
    return convert(model, mapping=mapping, mesh=mesh, dtype=dtype).model
