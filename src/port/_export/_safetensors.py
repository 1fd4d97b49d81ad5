"""Safetensors: the files `port export` writes, tensor by tensor, straight to their offsets.

`port export` writes a Hugging Face model directory: `model.safetensors`, or shards
`model-00001-of-00003.safetensors` with their `model.safetensors.index.json`
(`{"metadata": {"total_size": N}, "weight_map": {key: file}}`), as `save_pretrained`
writes them. The layout is decided before any tensor exists: which file each tensor
goes in (`shard_files`: the greedy rule of `huggingface_hub`, in the given order) and
where in it (the safetensors library's order: largest alignment first, then by name,
so a file is byte for byte what `safetensors` `save_file` writes for the same tensors).
Creating the writer writes every header and sizes every file; each tensor is then
written with positioned writes (`pwrite`) at its offset, in any order, from any
process that opens the files: nothing but the tensor being written is held in memory.

```python
tensors = [OutTensor("wte.weight", (50257, 768), np.dtype("float32")), ...]
with Writer(out, tensors, parse_size("5GB"), metadata={"format": "pt"}) as writer:
    for key, array in produce():        # one tensor at a time, any order
        writer.write(key, array)
writer.files                            # ["model-00001-of-00002.safetensors", ...]
```

A multi-process export divides the keys: process 0 creates the files
(`create=True, write=its_keys`), the others open them once it has
(`create=False, write=their_keys`); each writes and closes its share.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import stat
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from fractions import Fraction
from numbers import Integral
from pathlib import Path
from typing import Any

import numpy as np

from .._copy import contiguous
from .._disk import pwrite_all, pwrite_rows
from .._dtypes import SAFETENSORS
from .._errors import OutputError, PortError
from .._sources import MAX_HEADER
from .._text import printable, quoted

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_HEADER_NAMES: dict[np.dtype, str] = {d: name for name, d in SAFETENSORS.items()}
"""Port's dtype table read backwards: a dtype's safetensors header name."""

_LIBRARY_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
"""How the safetensors library orders a file's tensors, first to last, before their names:
its `Dtype` enum backwards (huggingface/safetensors, safetensors/src/tensor.rs, `prepare`),
which puts the widest alignment first. Names only: the dtypes are `SAFETENSORS`'s."""
_RANK = {name: i for i, name in enumerate(_LIBRARY_ORDER)}

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)")


@dataclass(frozen=True)
class OutTensor:
    """One tensor to write: its key, shape and dtype (one of port's `SAFETENSORS` dtypes).

    ```python
    OutTensor("h.0.attn.c_attn.weight", (768, 2304), np.dtype("float32")).nbytes   # 7077888
    ```
    """

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_size(text: str | int, name: str = "max_shard_size") -> int:
    """A size in bytes from a command-line value: `"5GB"`, `"1.5GB"`, `"2GiB"`, `"1000"` or an int.

    Units as `transformers` reads them: KB, MB, GB, TB are powers of 1000; KiB, MiB,
    GiB, TiB powers of 1024; B or none, bytes; any case. A fraction of a byte is
    dropped (exactly: `"4.35MB"` is 4350000).

    **Arguments:**

    - `text`: the value.
    - `name`: the parameter it came from, named in the error (`max_shard_size=5XB: ...`).

    Returns the size, at least 1; anything else is a one-line `PortError`.

    ```python
    parse_size("5GB")      # 5000000000
    parse_size("2GiB")     # 2147483648
    ```
    """
    if isinstance(text, Integral) and not isinstance(text, bool):
        size = int(text)
    else:
        found = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
        unit = _UNITS.get(found[2].upper()) if found is not None else None
        if found is None or not unit:
            raise PortError(
                f"{name}={printable(str(text))}: expected a size such as 5GB, 500MB, 2GiB or a number of bytes"
            )
        size = math.floor(Fraction(found[1]) * unit)
    if size <= 0:
        raise PortError(f"{name}={printable(str(text))}: expected a size of at least 1 byte")
    return size


def shard_files(tensors: Sequence[OutTensor], max_shard_size: int) -> list[list[OutTensor]]:
    """The tensors of each file, as `save_pretrained` groups them for `max_shard_size` bytes.

    `huggingface_hub`'s greedy rule (`split_state_dict_into_shards_factory`), in the
    given order: a tensor that would take the current file past `max_shard_size`
    starts the next one; a tensor larger than the maximum gets a file of its own,
    placed when it is met, before the file still being filled. There is always at
    least one file (one file is `model.safetensors`).

    ```python
    sizes = [4, 4, 20, 4]          # nbytes, max_shard_size=10
    # -> files [20], [4, 4], [4]
    ```
    """
    files: list[list[OutTensor]] = []
    current: list[OutTensor] = []
    size = 0
    for tensor in tensors:
        if tensor.nbytes > max_shard_size:
            files.append([tensor])
            continue
        if size + tensor.nbytes > max_shard_size:
            files.append(current)
            current, size = [], 0
        current.append(tensor)
        size += tensor.nbytes
    if current or not files:
        files.append(current)
    return files


def file_names(count: int) -> list[str]:
    """The names of `count` files: `model.safetensors`, or `model-00001-of-00003.safetensors`, ..."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(tensors: Sequence[OutTensor], metadata: dict[str, str] | None, name: str) -> tuple[bytes, dict[str, int]]:
    """One file's header, length prefix and padding included, and each tensor's offset in the file.

    The header is the JSON the safetensors library writes (compact, `__metadata__`
    first, the tensors in the order of their data), padded with spaces to a multiple
    of 8 bytes.
    """
    ordered = sorted(tensors, key=lambda t: (_RANK[_HEADER_NAMES[t.dtype]], t.key))
    entries: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    begin = 0
    for t in ordered:
        dtype_name = _HEADER_NAMES[t.dtype]
        entries[t.key] = {"dtype": dtype_name, "shape": list(t.shape), "data_offsets": [begin, begin + t.nbytes]}
        begin += t.nbytes
    try:
        text = json.dumps(entries, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        raise OutputError(f"{name}: a tensor name or metadata value is not valid Unicode (a lone surrogate)") from None
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER:
        raise OutputError(
            f"{name}: its header would take {len(text)} bytes, more than safetensors reads ({MAX_HEADER})"
        )
    start = 8 + len(text)
    offsets, position = {}, start
    for t in ordered:
        offsets[t.key] = position
        position += t.nbytes
    return len(text).to_bytes(8, "little") + text, offsets


def _check(tensors: Sequence[OutTensor], metadata: dict[str, str] | None, write: Collection[str] | None) -> None:
    seen: set[str] = set()
    for t in tensors:
        if not isinstance(t.key, str) or t.key == "__metadata__":
            raise OutputError(f"tensor name {quoted(t.key)}: not a name a safetensors file can hold")
        if t.key in seen:
            raise OutputError(f"tensor {quoted(t.key, 200)} is given twice")
        seen.add(t.key)
        if t.dtype not in _HEADER_NAMES:
            raise OutputError(f"tensor {quoted(t.key, 200)}: dtype {t.dtype.name} has no safetensors name port writes")
        if any(d < 0 for d in t.shape):
            raise OutputError(f"tensor {quoted(t.key, 200)}: shape {list(t.shape)} has a negative size")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise OutputError("`metadata` must map strings to strings")
    unknown = next((key for key in write or () if key not in seen), None)
    if unknown is not None:
        raise OutputError(f"`write` names tensor {quoted(unknown, 200)}, which is not among the tensors")


class Writer:
    """Safetensors files (and their index) in `directory`, filled one tensor at a time.

    **Arguments:**

    - `directory`: an existing directory (the caller's); the files are created in it.
    - `tensors`: every tensor of the export, in state-dict order (it decides the files).
    - `max_shard_size`: bytes per file (see `shard_files`, `parse_size`).
    - `metadata`: each file's `__metadata__` (`{"format": "pt"}` for transformers), or none.
    - `write`: the keys this writer writes (all, by default); `close` checks each was.
    - `create`: create the files (each exclusively, never through a link), write their
      headers, size them and write the index; with `False`, open the files another
      writer created (another process: the layout must be the same) to write `write`'s
      keys into them. A file whose size or header differs is an `OutputError`.

    A context manager: leaving the block calls `close`, or, on an exception, only
    releases the files. Writing may go on from several threads. Creating that fails
    part-way removes the files it created; a write that fails leaves the files as they
    are, for the caller to remove with the directory it writes them into.

    ```python
    with Writer(out, tensors, 5 * 10**9, metadata={"format": "pt"}) as writer:
        writer.write("wte.weight", wte)
    ```
    """

    def __init__(
        self,
        directory: Path,
        tensors: Sequence[OutTensor],
        max_shard_size: int,
        metadata: dict[str, str] | None = None,
        write: Collection[str] | None = None,
        create: bool = True,
    ):
        tensors = list(tensors)
        _check(tensors, metadata, write)
        self.directory = Path(directory)
        self.shards = shard_files(tensors, max_shard_size)
        self.files = file_names(len(self.shards))
        self.total_size = sum(t.nbytes for t in tensors)
        self.tensors = {t.key: t for t in tensors}
        self.offsets: dict[str, tuple[str, int]]
        """Where each tensor's bytes go: (file name, byte offset in the file), in the given order."""
        headers, where = [], {}
        for name, shard in zip(self.files, self.shards):
            header, offsets = _header(shard, metadata, name)
            headers.append(header)
            where.update((key, (name, offset)) for key, offset in offsets.items())
        self.offsets = {t.key: where[t.key] for t in tensors}
        self.sizes = {
            name: len(h) + sum(t.nbytes for t in shard) for name, shard, h in zip(self.files, self.shards, headers)
        }
        """Each file's size on disk, header included, by name."""
        keys = self.tensors.keys() if write is None else set(write)
        self._order = [t.key for t in tensors if t.key in keys]  # what close checks, in the given order
        self._pending = set(self._order)
        self._busy: set[str] = set()
        self._filled: dict[str, int] = {}  # elements written by `write_region`, per tensor
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._dir: int | None = None
        self._created = create
        try:
            self._dir = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise OutputError(f"{self.directory}: cannot open the output directory: {e.strerror or e}") from None
        try:
            needed = {self.offsets[key][0] for key in self._order}
            for name, header in zip(self.files, headers):
                size = self.sizes[name]
                if create:
                    self._create(name, header, size)
                elif name in needed:
                    self._open(name, header, size)
            if create and len(self.files) > 1:
                self._write_index()
        except BaseException:
            for name in self._fds if create else ():  # each created here, exclusively: removed again
                try:
                    os.unlink(name, dir_fd=self._dir)
                except OSError:
                    pass
            self._release()
            raise

    def _create(self, name: str, header: bytes, size: int) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o644, dir_fd=self._dir)
        except OSError as e:
            raise OutputError(f"{self.directory / name}: cannot create: {e.strerror or e}") from None
        self._fds[name] = fd  # released with the others if what follows fails
        try:
            os.ftruncate(fd, size)
        except OSError as e:
            raise OutputError(f"{self.directory / name}: cannot size it to {size} bytes: {e.strerror or e}") from None
        _pwrite_all(fd, memoryview(header), 0, self.directory / name, "its header")

    def _open(self, name: str, header: bytes, size: int) -> None:
        path = self.directory / name
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=self._dir)
        except OSError as e:
            raise OutputError(f"{path}: cannot open for writing: {e.strerror or e}") from None
        self._fds[name] = fd
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OutputError(f"{path}: not a regular file")
            found = os.pread(fd, len(header), 0) if st.st_size == size else b""
        except OSError as e:
            raise OutputError(f"{path}: cannot read its header: {e.strerror or e}") from None
        if found != header:
            raise OutputError(f"{path}: not the file this export lays out (another set of tensors, or not yet created)")

    def _write_index(self) -> None:
        index = {
            "metadata": {"total_size": self.total_size},
            "weight_map": {key: name for key, (name, _) in self.offsets.items()},
        }
        data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(INDEX, flags, 0o644, dir_fd=self._dir)
        except OSError as e:
            raise OutputError(f"{self.directory / INDEX}: cannot create: {e.strerror or e}") from None
        self._fds[INDEX] = fd
        _pwrite_all(fd, memoryview(data), 0, self.directory / INDEX, "the index")

    def _release(self) -> None:
        fds, self._fds = [*self._fds.values(), *([self._dir] if self._dir is not None else [])], {}
        self._dir = None
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def _spec(self, key: str) -> OutTensor:
        """The tensor `key` names, while this writer is open."""
        spec = self.tensors.get(key)
        if spec is None:
            raise OutputError(f"tensor {quoted(key, 200)} is not one of the tensors being written")
        if self._dir is None:
            raise OutputError(f"tensor {quoted(key, 200)}: the writer is closed")
        return spec

    def write(self, key: str, data: np.ndarray) -> None:
        """Write tensor `key`'s bytes at its offset; `data` has its shape and dtype exactly.

        A key not among this writer's, a tensor written twice, a shape or dtype that
        differs, and a failed write (a full disk, a file size limit) are one-line
        `OutputError`s. C-contiguous data is written as it is; other data is copied once.

        ```python
        writer.write("wte.weight", np.asarray(wte))
        ```
        """
        spec = self._spec(key)
        data = np.asarray(data)
        if data.shape != spec.shape or data.dtype != spec.dtype:
            raise OutputError(
                f"tensor {quoted(key, 200)}: expected {spec.dtype.name}{list(spec.shape)}, "
                f"got {data.dtype.name}{list(data.shape)}"
            )
        with self._lock:
            if key not in self._pending or key in self._busy:
                mine = key in self._order
                raise OutputError(
                    f"tensor {quoted(key, 200)} " + ("is written twice" if mine else "is another writer's to write")
                )
            self._busy.add(key)
        try:
            name, offset = self.offsets[key]
            if spec.nbytes:
                flat = contiguous(data).reshape(-1).view(np.uint8)
                what = f"tensor {quoted(key, 200)}"
                _pwrite_all(self._fds[name], memoryview(flat), offset, self.directory / name, what)  # pyright: ignore[reportArgumentType]  # an ndarray is a buffer: numpy's stubs say so only for Python >= 3.12
        finally:
            with self._lock:
                self._busy.discard(key)
        with self._lock:
            self._pending.discard(key)

    def write_region(self, key: str, region: Sequence[tuple[int, int]], data: np.ndarray) -> int:
        """Write the box `region` (`(start, stop)` per dimension) of tensor `key`; returns the bytes written.

        The boxes a caller writes of one tensor must not overlap (as the distinct blocks
        of a sharded array do not): a tensor counts as written once its boxes add up to
        it. Boxes of one tensor may come from several writers (processes), each counting
        only its own; `close(check=False)` leaves the whole to the caller. Each run of
        the box that is contiguous in the file is one positioned write.

        ```python
        writer.write_region("h.0.attn.c_attn.weight", ((0, 768), (0, 384)), block)
        ```
        """
        spec = self._spec(key)
        region = tuple((int(a), int(b)) for a, b in region)
        extents = tuple(b - a for a, b in region)
        data = np.asarray(data)
        if (
            len(region) != len(spec.shape)
            or any(not 0 <= a <= b <= n for (a, b), n in zip(region, spec.shape))
            or data.shape != extents
            or data.dtype != spec.dtype
        ):
            raise OutputError(
                f"tensor {quoted(key, 200)}: box {[list(r) for r in region]} of {data.dtype.name}{list(data.shape)} "
                f"does not fit {spec.dtype.name}{list(spec.shape)}"
            )
        with self._lock:
            if key not in self._pending:
                raise OutputError(f"tensor {quoted(key, 200)} is written twice")
        if data.size:
            # the trailing dimensions the box spans whole, and the one before them: one run per index of the rest
            d = len(region) - 1
            while d > 0 and extents[d] == spec.shape[d]:
                d -= 1
            strides = [math.prod(spec.shape[i + 1 :]) for i in range(len(spec.shape))]
            run = extents[d] * strides[d] if region else 1
            rows = contiguous(data).reshape(-1).view(np.uint8)
            rows = rows.reshape(-1, run * spec.dtype.itemsize)
            grid = itertools.product(*(range(a, b) for a, b in region[:d]))
            name, offset = self.offsets[key]
            size, base = spec.dtype.itemsize, region[d][0] * strides[d] if region else 0
            at = (offset + (sum(i * stride for i, stride in zip(index, strides)) + base) * size for index in grid)
            try:
                pwrite_rows(self._fds[name], zip(at, rows))  # pyright: ignore[reportArgumentType]  # rows of bytes: an ndarray's are buffers, which numpy's stubs say only for Python >= 3.12
            except OSError as e:
                raise OutputError(
                    f"{self.directory / name}: cannot write tensor {quoted(key, 200)}: {e.strerror or e}"
                ) from None
        with self._lock:
            self._filled[key] = self._filled.get(key, 0) + data.size
            if self._filled[key] >= math.prod(spec.shape):
                self._pending.discard(key)
        return data.nbytes

    @property
    def missing(self) -> list[str]:
        """The keys this writer has still to write, in the given order."""
        return [key for key in self._order if key in self._pending]

    def close(self, sync: bool = True, check: bool = True) -> None:
        """Check every key of `write` was written, flush the files to disk and release them.

        With `sync`, each file's data reaches the disk (`fdatasync`), and with `create`
        the directory's new entries too, before this returns: the files are complete
        should the directory then be renamed into place. A key never written is an
        `OutputError` naming the first (the files are released all the same).
        Closing twice does nothing. `check=False` leaves completeness to the caller (a
        multi-process export, whose processes each write part of every tensor).
        """
        if self._dir is None:
            return
        try:
            missing = self.missing if check else []
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise OutputError(f"{self.directory}: tensor {quoted(missing[0], 200)} was never written{more}")
            if sync:
                sync_data = getattr(os, "fdatasync", os.fsync)
                for name, fd in self._fds.items():
                    try:
                        sync_data(fd)
                    except OSError as e:
                        raise OutputError(f"{self.directory / name}: cannot flush to disk: {e.strerror or e}") from None
                if self._created:
                    try:
                        os.fsync(self._dir)
                    except OSError:
                        pass  # some file systems cannot sync a directory; the files themselves are flushed
        finally:
            self._release()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self._release()


def _pwrite_all(fd: int, data: memoryview, offset: int, path: Path, what: str) -> None:
    """`pwrite_all`, an OSError as one OutputError line naming `path` and `what` was written."""
    try:
        pwrite_all(fd, data, offset)
    except OSError as e:
        raise OutputError(f"{path}: cannot write {what}: {e.strerror or e}") from None
