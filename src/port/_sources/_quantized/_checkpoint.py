"""`DequantizedCheckpoint`: a quantized checkpoint seen as the unquantized one it stands for.

Composed around any opened `Checkpoint` (local or remote): its `tensors` are the
checkpoint's, each quantized weight and its companions replaced by one `QuantizedInfo`
under the weight's unquantized name, so plan, place, restore and the byte counts see
ordinary tensors of their real shapes. `read_into` of a quantized tensor reads, for
each region, exactly the parts' regions that cover it (the packed bytes and the scale
blocks), and dequantizes them into the caller's buffer; `bytes_read` is the bytes the
underlying checkpoint read.

```python
with port.open_checkpoint("tiny-deepseek-fp8") as ckpt:      # a DequantizedCheckpoint
    ckpt.tensors["model.layers.0.mlp.down_proj.weight"]      # Fp8Block: float32[48, 72]
    ckpt.read("model.layers.0.mlp.down_proj.weight", ((0, 16), (0, 72)))
    ckpt.bytes_read                                          # 16 * 72 + 5 * 4: rows and one scale row
```
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, final

import numpy as np

from ..._errors import CheckpointError
from ..._text import quoted
from .._checkpoint import Checkpoint, Region, TensorInfo, check_buffer
from ._format import SMALL, out_dtype, settings_of
from ._source import READ_AS, Blocks, QuantizedInfo

_Request = tuple[Region, np.ndarray, tuple[tuple[Region, ...], ...], Blocks]
"""One request of a `read_into` batch: its region, its buffer, the parts' regions it reads, their buffers."""

BATCH_BYTES = 256 * 2**20
"""Packed bytes (and scales) read together for the requests of one `read_into`, at most about this."""


@final
class DequantizedCheckpoint(Checkpoint):
    """`inner` with its quantized weights dequantized as they are read (see the module)."""

    def __init__(self, inner: Checkpoint, sources: Sequence[QuantizedInfo], hidden: Collection[str] = ()) -> None:
        self.inner = inner
        self.directory = inner.directory
        self.config = inner.config
        first = {info.parts[0].key: info for info in sources}
        consumed = {part.key for info in sources for part in info.parts} | set(hidden)
        tensors: dict[str, TensorInfo] = {}
        for key, info in inner.tensors.items():
            if key in first:
                name = first[key].key
                if name in tensors or (name != key and name in inner.tensors and name not in consumed):
                    raise CheckpointError(
                        f"{info.file.name}: tensor {quoted(name, 200)} is both stored and made by dequantizing "
                        f"{quoted(key, 200)}"
                    )
                tensors[name] = first[key]
            elif key not in consumed:
                tensors[key] = info
        self.tensors = tensors
        self.sources = tuple(sources)

    @property
    def bytes_read(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]  # the inner checkpoint's count
        return self.inner.bytes_read

    @property
    def bytes_over_read(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]  # the inner checkpoint's count
        return self.inner.bytes_over_read

    def expect(self, reads: Mapping[str, Collection[Region]]) -> None:
        """Tell the inner checkpoint the parts' regions each quantized region will read."""
        parts: dict[str, set[Region]] = {}
        for key, regions in reads.items():
            info = self.tensors[key]
            if not isinstance(info, QuantizedInfo):
                parts.setdefault(key, set()).update(regions)
                continue
            for region in regions:
                for part, wanted in zip(info.parts, info.regions(region)):
                    parts.setdefault(part.key, set()).update(wanted)
        self.inner.expect(parts)

    def read_into(self, key: str, requests: Sequence[tuple[Region, np.ndarray]]) -> None:
        """Read regions of tensor `key` (see `Checkpoint.read_into`); a quantized one's from
        the parts' regions that cover each, dequantized into its buffer (float32, or rounded
        once to the buffer's bfloat16 or float16)."""
        info = self.tensors[key]
        if not isinstance(info, QuantizedInfo):
            self.inner.read_into(key, requests)
            return
        for region, out in requests:
            check_buffer(info, region, out, READ_AS)
        batch: list[_Request] = []
        size = 0
        for region, out in requests:
            wanted = info.regions(region)
            blocks = tuple(
                tuple(np.empty(tuple(b - a for a, b in r), part.dtype) for r in regions)
                for part, regions in zip(info.parts, wanted)
            )
            batch.append((region, out, wanted, blocks))
            size += sum(buffer.nbytes for buffers in blocks for buffer in buffers)
            if size >= BATCH_BYTES:
                self._dequantize(info, batch)
                batch, size = [], 0
        if batch:
            self._dequantize(info, batch)

    def _dequantize(self, info: QuantizedInfo, batch: list[_Request]) -> None:
        """Read the parts' regions of every request in `batch` with one call per part (so runs
        that lie end to end in a file, the rows of neighbouring column blocks, share a read),
        then dequantize each request into its buffer."""
        for i, part in enumerate(info.parts):
            reads = [(r, buffer) for _, _, wanted, blocks in batch for r, buffer in zip(wanted[i], blocks[i])]
            if reads:
                self.inner.read_into(part.key, reads)
        for region, out, _, blocks in batch:
            info.dequantize_into(region, blocks, out)

    def close(self) -> None:
        self.inner.close()


def dequantized(checkpoint: Checkpoint) -> Checkpoint:
    """`checkpoint` as a `DequantizedCheckpoint` when its config.json has a `quantization_config`;
    as it is otherwise. A `CheckpointError` for a format port does not read, or tensors that
    contradict it, before any tensor byte is read.

    ```python
    ckpt = dequantized(open_local("tiny-deepseek-fp8"))
    ```
    """
    found = settings_of(checkpoint.config)
    if found is None:
        return checkpoint
    form, settings = found
    try:
        sources, hidden = form.find(
            checkpoint.config, settings, checkpoint.tensors, out_dtype(checkpoint.config), _small(checkpoint)
        )
        return DequantizedCheckpoint(checkpoint, sources, hidden)
    except BaseException:
        checkpoint.close()
        raise


def _small(checkpoint: Checkpoint) -> Callable[[str], np.ndarray]:
    """`read(key)`: the whole of a small tensor of `checkpoint`, refusing one above `SMALL` bytes."""

    def read(key: str) -> np.ndarray:
        info = checkpoint.tensors[key]
        if info.nbytes > SMALL:
            raise CheckpointError(
                f"{info.file.name}: tensor {quoted(key, 200)} is {info.nbytes} bytes, more than the "
                f"{SMALL} a quantization state may be"
            )
        return checkpoint.read(key, tuple((0, n) for n in info.shape))

    return read


def describe(info: Any) -> str | None:
    """How `info` is stored when it is a quantized source (its format and companions), else None."""
    return info.describe() if isinstance(info, QuantizedInfo) else None
