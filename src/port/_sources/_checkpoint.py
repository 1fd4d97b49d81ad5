"""The checkpoint every source is: a config, each tensor's header, and counted reads of regions.

`Checkpoint` is the abstract interface the pipeline asks (plan, place, restore and
export see no other): `config`, `tensors` (a `TensorInfo` per key: file, offset, dtype,
shape), `read_into` (regions of one tensor into the caller's buffers, each region's
bytes and nothing else), `bytes_read`, `expect` and `close`. Its final classes are
`LocalCheckpoint` (files, by positioned reads) and `RemoteCheckpoint` (a URL, by byte
range); each builds on this module's rules, not on the other.

Also here, the rules every format's tensors obey, whatever their header: at most
`MAX_RANK` dimensions, at most `MAX_NBYTES` bytes (`tensor_bytes`), names without
`CONTROL_CHARACTERS`; and the contract of a buffer `read_into` fills (`check_buffer`).

```python
with open_checkpoint("path/to/gpt2") as ckpt:                  # a LocalCheckpoint
    info = ckpt.tensors["wte.weight"]                          # TensorInfo(..., shape=(50257, 768))
    block = ckpt.read("wte.weight", ((0, 10), (0, 768)))       # float32[10, 768]
    ckpt.bytes_read                                            # 30720
```
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._transport import RemoteFile

Region = tuple[tuple[int, int], ...]
"""A box in a tensor: one `(start, stop)` per dimension."""

MAX_NBYTES = 2**63 - 1
"""NumPy's limit on an array's size in bytes: no tensor may need more."""
MAX_RANK = 64
"""NumPy's limit on dimensions: no tensor may have more."""
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")
"""What no tensor name (nor shard file name) may hold."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, absolute byte offset, dtype and shape.

    `file_id` is the file's (device, inode, size) when its header was read: the
    data is read only from that same file.
    """

    key: str
    file: Path | RemoteFile  # RemoteFile: a checkpoint read from a URL
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    file_id: tuple[int, int, int] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def load_dtype(self) -> np.dtype:
        """The dtype a parameter read from this tensor has unless the plan casts it: its own
        (a quantized source's is the checkpoint's `torch_dtype`, not float32)."""
        return self.dtype

    @property
    def band_rows(self) -> int | None:
        """What the first row of a band of this tensor (the jobs a large tensor is read in) must
        be a multiple of for bands to read no byte twice: any row (1) for a plain tensor; a
        quantized source says (None: never cut it)."""
        return 1

    def region_nbytes(self, region: Region) -> int:
        """The bytes reading `region` of this tensor reads (a quantized source's: its packed
        bytes and the scale blocks that cover them)."""
        return math.prod(b - a for a, b in region) * self.dtype.itemsize


def tensor_bytes(shape: Sequence[int], itemsize: int) -> int | None:
    """Bytes of a tensor of `shape`, or None when NumPy could not hold it (the product
    of the non-zero sizes, times the item size, above 2**63 - 1).

    ```python
    tensor_bytes([50257, 768], 4), tensor_bytes([2**40, 2**40], 4)   # (154389504, None)
    ```
    """
    size = itemsize
    for d in shape:
        if d:
            size *= d
            if size > MAX_NBYTES:
                return None
    return size if all(shape) else 0


def region_shape(info: TensorInfo, region: Region) -> tuple[int, ...]:
    """The shape of `region` of tensor `info`; a ValueError where it does not lie inside it.

    ```python
    region_shape(info, ((0, 10), (0, 768)))   # (10, 768)
    ```
    """
    if len(region) != len(info.shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(region, info.shape)):
        raise ValueError(f"region {region} is outside tensor '{info.key}' of shape {info.shape}")
    return tuple(b - a for a, b in region)


def check_buffer(info: TensorInfo, region: Region, out: np.ndarray, dtypes: Collection[np.dtype] = ()) -> None:
    """A ValueError unless `out` can take `region` of tensor `info`: a writeable array of the
    region's shape and the tensor's dtype (or one of `dtypes`), C-contiguous or a view of one
    (no negative stride).

    ```python
    check_buffer(info, ((0, 10), (0, 768)), np.empty((10, 768), np.float32))   # fine
    ```
    """
    shape = region_shape(info, region)
    if not (
        isinstance(out, np.ndarray)
        and (out.dtype == info.dtype or out.dtype in dtypes)
        and out.shape == shape
        and out.flags.writeable
        and all(stride >= 0 for stride in out.strides)
    ):
        raise ValueError(
            f"buffer for region {region} of '{info.key}' must be a writeable {info.dtype.name}{list(shape)} "
            "(C-contiguous, or a view of one)"
        )


class Checkpoint(abc.ABC):
    """An opened checkpoint: config, tensor headers, and counted reads of regions.

    Abstract: `open_checkpoint` returns one of its final classes, `LocalCheckpoint` or
    `RemoteCheckpoint`. Each has these attributes:

    - `directory`: where it was opened (a local directory's `Path`, or a URL with no credentials).
    - `config`: its `config.json`, a dict.
    - `tensors`: each tensor's `TensorInfo`, by key.
    - `bytes_read`: the bytes read so far (for a remote checkpoint, transferred).
    - `bytes_over_read`: bytes fetched beside them and discarded (a remote checkpoint's
      gaps between stretches, within its `max_over_read`; 0 for local files, read exactly).

    A checkpoint is a context manager: leaving the block calls `close`.

    ```python
    with port.open_checkpoint("path/to/gpt2") as ckpt:
        ckpt.read("wte.weight", ((0, 10), (0, 768)))
    ```
    """

    directory: Any
    config: dict
    tensors: dict[str, TensorInfo]
    bytes_read: int
    bytes_over_read: int = 0

    def read(self, key: str, region: Region, out: np.ndarray | None = None) -> np.ndarray:
        """Exactly `region` of tensor `key` as a C-contiguous array (`out`, if given).

        ```python
        ckpt.read("wte.weight", ((0, 10), (0, 768)))   # float32[10, 768]; 30720 bytes read
        ```
        """
        info = self.tensors[key]
        if out is None:
            out = np.empty(region_shape(info, region), info.dtype)
        self.read_into(key, [(region, out)])
        return out

    @abc.abstractmethod
    def expect(self, reads: Mapping[str, Collection[Region]]) -> None:
        """Be told, before a load reads anything, the regions of each tensor it will read (a
        source may plan its reads with it: a remote checkpoint fetches the small tensors read
        whole that lie together in a file in one request).

        ```python
        ckpt.expect({"h.0.ln_1.weight": {((0, 768),)}, "h.0.ln_1.bias": {((0, 384),), ((384, 768),)}})
        ```
        """

    @abc.abstractmethod
    def read_into(self, key: str, requests: Sequence[tuple[Region, np.ndarray]]) -> None:
        """Read regions of tensor `key`, each into its buffer of the region's shape and the
        tensor's dtype (C-contiguous, or a view of one, such as a block's part of a larger
        array: see `check_buffer`), reading each region's bytes and nothing else, counted in
        `bytes_read`. A file changed or cut short meanwhile is a CheckpointError. (A quantized
        tensor's buffer may also be of a narrower floating dtype: dequantized, it is rounded
        once to it; see `port._sources._quantized`.)

        ```python
        ckpt.read_into("wte.weight", [(((0, 10), (0, 384)), left), (((0, 10), (384, 768)), right)])
        ```
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the checkpoint holds open between reads (connections, threads)."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
