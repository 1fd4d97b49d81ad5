"""What an export did: `ExportReport`, the value `port.export` returns.

It holds every figure `port export` prints or writes in its `--json` / `--report`
document (files, bytes, tensors, params, this process's share, seconds, peak host
memory), so a Python caller gets them without listing the directory. It also stands
for the output directory where `export`'s old return value, a path, stood: it is
`os.PathLike` and its `str` is the directory, so `Path(report)`, `open_checkpoint(report)`
and transformers' `from_pretrained(report)` take it; `report.out` is the `Path` itself
(for `/`, `iterdir` and the rest of `Path`).

```python
report = port.export(model, "gpt2-hf", "gpt2")
report.out, report.files, report.bytes_written     # Path('/.../gpt2-hf'), ('model.safetensors',), 497759232
transformers.AutoModel.from_pretrained(report)      # the directory, through os.fspath
```
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote, and what it took; `os.fspath(report)` and `str(report)` are the output directory.

    **Fields:**

    - `out`: the output directory, absolute.
    - `process`, `num_processes`: this process's index and the run's processes (1 for one).
    - `mesh`: the axis sizes of the mesh the model's arrays are laid out on (`{}` for
      arrays on no named mesh).
    - `dtype`: the dtype floating tensors were written in, where `dtype=` said (else None).
    - `quantize`: `"fp8"` where the Linear weights were written quantized, else None.
    - `files`: the safetensors files written, by name, sorted.
    - `bytes`: their size on disk, headers included (the index is not counted).
    - `tensors`: tensors written (with `quantize`, the scales too).
    - `params`: parameters of the model's arrays written.
    - `bytes_held`: bytes of the distinct blocks this process's devices hold of the model
      (what it assembled the output from; for a model `port.restore` made, what it read).
    - `bytes_written`: tensor bytes this process wrote (all of them in a run of one process).
    - `seconds`: the export's time in this process, in seconds.
    - `peak_host_bytes`: this process's peak anonymous host memory during the export.
    - `port_version`: the version of port that wrote it (also in each file's metadata).

    ```python
    report = port.export(model, "gpt2-hf", "gpt2")
    report.tensors, report.bytes                  # 148, 497774600
    report.to_json()["out"]                       # "/.../gpt2-hf"
    ```
    """

    out: Path
    process: int
    num_processes: int
    mesh: dict[str, int]
    dtype: str | None
    quantize: str | None
    files: tuple[str, ...]
    bytes: int
    tensors: int
    params: int
    bytes_held: int
    bytes_written: int
    seconds: float
    peak_host_bytes: int
    port_version: str

    def __fspath__(self) -> str:
        """The output directory: the report stands where `export`'s old return value, a path, stood."""
        return str(self.out)

    def __str__(self) -> str:
        """The output directory, as `os.fspath` gives it (`repr` shows the figures)."""
        return str(self.out)

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values: `out` as a string, `files` as a list."""
        return {**dataclasses.asdict(self), "out": str(self.out), "files": list(self.files)}


def blocks_held(model: Any) -> int:
    """Bytes of the distinct blocks this process's devices hold of `model`'s arrays (a block
    replicated on several of its devices counted once).

    ```python
    blocks_held(port.restore("gpt2-jax", "2x2"))   # what restore read from the output in this process
    ```
    """
    total = 0
    for array in jax.tree.leaves(model):
        if isinstance(array, jax.Array):
            blocks = {
                tuple((s.start, s.stop) for s in shard.index): shard.data.nbytes for shard in array.addressable_shards
            }
            total += sum(blocks.values())
    return total


def mesh_of(arrays: Any) -> dict[str, int]:
    """The axis sizes of the mesh the first array of `arrays` laid out on a named mesh uses; `{}` if none is.

    ```python
    mesh_of(port.load("gpt2", mesh="4x2"))      # {"data": 4, "model": 2}
    ```
    """
    for array in jax.tree.leaves(arrays):
        if isinstance(array, jax.Array) and isinstance(array.sharding, NamedSharding):
            return dict(array.sharding.mesh.shape)
    return {}
