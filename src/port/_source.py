"""Source: a checkpoint directory, its `config.json` and safetensors headers.

Opening a checkpoint reads only `config.json` and the safetensors headers. Tensor
bytes are read later, region by region, through [`Checkpoint.view`][]: a view of
the memory-mapped file covering exactly the region, counted in `bytes_read`.

```python
ckpt = open_checkpoint("path/to/gpt2")     # or a Hugging Face repo id
ckpt.tensors["h.0.attn.c_attn.weight"].shape    # (768, 2304), no data read
block = ckpt.view("wte.weight", ((0, 50257), (0, 192)))   # read when copied
ckpt.bytes_read                                  # 50257 * 192 * 4
```
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from ._errors import PortError

Region = tuple[tuple[int, int], ...]
"""A box in a tensor: one `(start, stop)` per dimension."""

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

_MAX_HEADER = 100 * 1024 * 1024
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, absolute byte offset, dtype and shape."""

    key: str
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate the header of one safetensors file; reads no tensor data."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise PortError(f"{name}: truncated: {size} bytes, too short for a safetensors header")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, _MAX_HEADER):
                raise PortError(
                    f"{name}: corrupt header: header length {n} does not fit in a file of {size} bytes"
                )
            raw = f.read(n)
    except OSError as e:
        raise PortError(f"{name}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PortError(f"{name}: corrupt header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise PortError(f"{name}: corrupt header: expected a JSON object")
    data_start, data_size = 8 + n, size - 8 - n
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise PortError(f"{name}: corrupt header: bad entry for tensor '{key}'") from None
        if not (
            isinstance(dtype_name, str)
            and isinstance(shape, list)
            and all(type(d) is int for d in [*shape, begin, end])
        ):
            raise PortError(f"{name}: corrupt header: bad entry for tensor '{key}'")
        shape = tuple(shape)
        if dtype_name not in DTYPES:
            raise PortError(f"{name}: tensor '{key}' has unsupported dtype {dtype_name}")
        info = TensorInfo(key, path, DTYPES[dtype_name], shape, data_start + begin)
        if begin < 0 or any(d < 0 for d in shape) or end - begin != info.nbytes:
            raise PortError(
                f"{name}: corrupt header: tensor '{key}' {dtype_name}{list(shape)} needs "
                f"{info.nbytes} bytes but its offsets span {end - begin}"
            )
        if end > data_size:
            raise PortError(
                f"{name}: truncated: tensor '{key}' ends at data byte {end} but the file holds "
                f"only {data_size} data bytes"
            )
        tensors[key] = info
    return tensors


def resolve(model: str | os.PathLike) -> Path:
    """A local checkpoint directory, or a Hugging Face repo id fetched through its cache."""
    path = Path(model)
    if path.exists():
        if not path.is_dir():
            raise PortError(f"{model}: not a directory (give the checkpoint's directory)")
        return path
    text = str(model)
    if not _REPO_ID.match(text):
        raise PortError(f"{model}: no such directory, and not a Hugging Face repo id")
    try:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        snapshot = huggingface_hub.snapshot_download(
            text, allow_patterns=["config.json", "*.safetensors", _INDEX]
        )
    except LocalEntryNotFoundError:
        raise PortError(
            f"{model}: no such directory, and not in the Hugging Face cache (offline or no network)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PortError(f"{model}: no such directory, and the Hugging Face Hub said: {reason}") from None
    return Path(snapshot)


def _files(directory: Path) -> list[Path]:
    index = directory / _INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise PortError(f"{index}: not a valid safetensors index (no weight_map)") from None
        missing = [n for n in names if not (directory / n).exists()]
        if missing:
            raise PortError(f"{index}: lists {missing[0]}, which is not in {directory}")
        return [directory / n for n in names]
    if (directory / _SINGLE).exists():
        return [directory / _SINGLE]
    found = sorted(directory.glob("*.safetensors"))
    if found:
        return found
    if any((directory / n).exists() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise PortError(
            f"{directory}: has only PyTorch pickle weights (pytorch_model.bin); port reads "
            "safetensors: re-save with save_pretrained(..., safe_serialization=True)"
        )
    raise PortError(f"{directory}: no safetensors weights ({_SINGLE} or {_INDEX})")


@dataclass
class Checkpoint:
    """An opened checkpoint: config, tensor headers, and counted views of regions."""

    directory: Path
    config: dict
    tensors: dict[str, TensorInfo]
    bytes_read: int = 0
    _maps: dict[Path, mmap.mmap] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def view(self, key: str, region: Region) -> np.ndarray:
        """A read-only view of exactly `region` of tensor `key`, straight from the memory map.

        Nothing is copied here: the bytes are read when the view is (copied into its
        destination), and only the region's bytes are. `bytes_read` counts them.
        """
        info = self.tensors[key]
        if len(region) != len(info.shape) or any(
            not 0 <= a <= b <= n for (a, b), n in zip(region, info.shape)
        ):
            raise ValueError(f"region {region} is outside tensor '{key}' of shape {info.shape}")
        buffer = self._map(info.file)
        if info.offset + info.nbytes > len(buffer):  # cut since its header was read
            raise PortError(
                f"{info.file.name}: truncated: tensor '{key}' ends at byte {info.offset + info.nbytes} "
                f"but the file has {len(buffer)}"
            )
        whole = np.ndarray(info.shape, info.dtype, buffer=buffer, offset=info.offset)
        view = whole[tuple(slice(a, b) for a, b in region)]
        with self._lock:
            self.bytes_read += view.nbytes
        return view

    def _map(self, path: Path) -> mmap.mmap:
        with self._lock:
            if path not in self._maps:
                with open(path, "rb") as f:
                    self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return self._maps[path]

    def close(self) -> None:
        """Drop the memory maps (arrays placed from them hold copies, never views)."""
        self._maps.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checkpoint(model: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint directory or Hugging Face repo id, reading only config and headers."""
    directory = resolve(model)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise PortError(f"{directory}: no config.json")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PortError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise PortError(f"{config_path}: expected a JSON object")
    tensors: dict[str, TensorInfo] = {}
    for path in _files(directory):
        for key, info in read_header(path).items():
            if key in tensors:
                raise PortError(f"{path.name}: tensor '{key}' is also in {tensors[key].file.name}")
            tensors[key] = info
    return Checkpoint(directory, config, tensors)
