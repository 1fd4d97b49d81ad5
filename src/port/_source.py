"""Source: a checkpoint directory, its `config.json` and safetensors headers.

A checkpoint is untrusted input. Opening one reads only `config.json`, the shard
index and the safetensors headers, each bounded in size before a byte of it is
read, from regular files only (a FIFO, a device or a directory is refused, never
waited on), named by the index as plain file names inside the checkpoint
directory. Each header is validated as the safetensors format specifies, refusing
whatever the reference loader refuses. Tensor bytes are read later, region by
region, with positioned reads (`preadv`) straight into the caller's buffers: a file
cut short while it is read is one `CheckpointError`, never a SIGBUS.

```python
ckpt = open_checkpoint("path/to/gpt2")          # or a Hugging Face repo id
ckpt.tensors["h.0.attn.c_attn.weight"].shape    # (768, 2304), no data read
block = ckpt.read("wte.weight", ((0, 50257), (0, 192)))   # exactly that region
ckpt.bytes_read                                  # 50257 * 192 * 4
```
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import math
import os
import re
import stat
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np

from ._text import first_line, quoted
from ._dtypes import SAFETENSORS
from ._errors import CheckpointError, OutputError

Region = tuple[tuple[int, int], ...]
"""A box in a tensor: one `(start, stop)` per dimension."""

MAX_HEADER = 100_000_000
"""Bytes one safetensors header may have: the reference loader's `MAX_HEADER_SIZE`."""
MAX_HEADERS = 100_000_000
"""Bytes the headers of all shards of one checkpoint may have together."""
MAX_SHARDS = 10_000
"""Shard files one checkpoint may have."""
MAX_CONFIG = 8 * 2**20
"""Bytes a `config.json` may have."""
MAX_INDEX = 64 * 2**20
"""Bytes a `model.safetensors.index.json` may have."""

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_U64 = 2**64
_MAX_NBYTES = 2**63 - 1  # NumPy's limit on an array's size in bytes
_MAX_RANK = 64  # NumPy's limit on dimensions
_MAX_DEPTH = 128  # serde_json's recursion limit: the reference refuses JSON nested this deep
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_MAX_RUNS = 1 << 22  # runs (contiguous pieces) handled in one batch: bounds the bookkeeping


# ---------------------------------------------------------------------------- files


def _kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device",
             stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}
    return next((name for test, name in kinds.items() if test(mode)), "an unknown kind of file")


_READ = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def open_regular(path: Path, name: str | None = None, *, output: Path | None = None) -> tuple[int, os.stat_result]:
    """Open `path` for reading if, and only if, it is a regular file (or a link to one, but with `output`).

    Checked before opening (`stat`, so a FIFO or device is never opened) and again
    on the open descriptor (`fstat`: the same file, still regular). Opened with
    `O_NONBLOCK`, so even a FIFO swapped in between cannot block. Returns the
    descriptor and its `fstat`.

    With `output` (a port output's directory, which holds `path`), no link is followed
    below that directory: each directory from it down to `path` is opened relative to
    the one above with `O_NOFOLLOW | O_DIRECTORY`, and `path` itself with `O_NOFOLLOW`,
    so a link anywhere there (to a file of another user, another output, a device) is
    refused, not read: an `OutputError` naming it. One exception: an output downloaded
    into the Hugging Face cache, whose files are links into its repo's `blobs/`; a link
    there is followed to a file directly in that `blobs/`, and nowhere else. (A
    checkpoint's files may be links anywhere: the cache stores each as one to its blob.)

    ```python
    fd, st = open_regular(Path("ckpt/model.safetensors"))
    fd, st = open_regular(Path("out/params/wte/0.0"), output=Path("out"))   # no link followed below out/
    ```
    """
    name = name or path.name
    if output is not None:
        return _open_below(path, name, output)
    try:
        before = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(before.st_mode):
        raise CheckpointError(f"{name}: not a regular file ({_kind(before.st_mode)})")
    try:
        fd = os.open(path, _READ)
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read: {e.strerror or e}") from None
    return fd, _same_regular(fd, before, name, CheckpointError)


def _same_regular(fd: int, before: os.stat_result, name: str, error: type[Exception]) -> os.stat_result:
    """The `fstat` of `fd`, if it is still the regular file `before` describes; else `fd` closed and `error` raised."""
    try:
        after = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise error(f"{name}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise error(f"{name}: replaced while being opened (now {_kind(after.st_mode)})")
    return after


def _link_refused(shown: Any, what: str) -> OutputError:
    """The one line refusing a symbolic link found in an output where `what` should be."""
    return OutputError(f"{shown}: a symbolic link, not {what} of the output: refused")


def _open_below(path: Path, name: str, output: Path) -> tuple[int, os.stat_result]:
    """`open_regular(path, name, output=output)`: every step below `output` taken without following a link."""
    try:
        parts = path.relative_to(output).parts
    except ValueError:
        parts = ()
    if not parts or any(part in (".", "..") for part in parts):
        raise OutputError(f"{name}: not a file inside the output {output}")
    try:  # the output itself is the directory the caller named: a link to it is the caller's choice
        fd = os.open(output, _READ | _DIRECTORY)
    except OSError as e:
        raise OutputError(f"{output}: cannot read: {e.strerror or e}") from None
    where = output
    try:
        for part in parts[:-1]:
            where = where / part
            try:
                below = os.open(part, _READ | _DIRECTORY | _NOFOLLOW, dir_fd=fd)
            except OSError as e:
                raise _step_refused(fd, part, where, e) from None
            os.close(fd)
            fd = below
        last = parts[-1]
        try:
            before = os.stat(last, dir_fd=fd, follow_symlinks=False)
        except OSError as e:
            raise OutputError(f"{name}: cannot read: {e.strerror or e}") from None
        if stat.S_ISLNK(before.st_mode):
            blob = hub_blob(output, path)
            if blob is None:
                raise _link_refused(name, "a regular file")
            return _open_blob(blob, name)
        if not stat.S_ISREG(before.st_mode):
            raise OutputError(f"{name}: not a regular file ({_kind(before.st_mode)})")
        try:
            opened = os.open(last, _READ | _NOFOLLOW, dir_fd=fd)
        except OSError as e:
            if e.errno == errno.ELOOP:  # made a link since the stat above
                raise _link_refused(name, "a regular file") from None
            raise OutputError(f"{name}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    return opened, _same_regular(opened, before, name, OutputError)


def hub_blob(output: Path, path: Path) -> Path | None:
    """Where the link `path` leads, if `output` is (in) a snapshot of the Hugging Face cache
    (`.../models--org--name/snapshots/REV/...`) and the link ends at a file directly in that
    repo's `blobs/`, as the cache stores every downloaded file; None otherwise."""
    real = Path(os.path.realpath(output))
    for snapshot in (real, *real.parents):
        repo = snapshot.parent.parent
        if snapshot.parent.name == "snapshots" and repo.name.startswith(("models--", "datasets--")):
            target = Path(os.path.realpath(path))
            return target if target.parent == repo / "blobs" else None
    return None


def _open_blob(blob: Path, name: str) -> tuple[int, os.stat_result]:
    """Open a blob of the Hugging Face cache (`hub_blob`): a regular file, no link followed."""
    try:
        before = os.stat(blob, follow_symlinks=False)
        if not stat.S_ISREG(before.st_mode):
            raise OutputError(f"{name}: not a regular file ({_kind(before.st_mode)})")
        opened = os.open(blob, _READ | _NOFOLLOW)
    except OSError as e:
        raise OutputError(f"{name}: cannot read: {e.strerror or e}") from None
    return opened, _same_regular(opened, before, name, OutputError)


def _step_refused(fd: int, part: str, where: Path, error: OSError) -> OutputError:
    """Why the directory `part` (shown as `where`) below the descriptor `fd` could not be
    opened without following a link: a link, not a directory, or the system's reason."""
    try:
        mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        return OutputError(f"{where}: cannot read: {error.strerror or error}")
    if stat.S_ISLNK(mode):
        return _link_refused(where, "a directory")
    if not stat.S_ISDIR(mode):
        return OutputError(f"{where}: not a directory ({'a regular file' if stat.S_ISREG(mode) else _kind(mode)})")
    return OutputError(f"{where}: cannot read: {error.strerror or error}")


def _pread_exact(fd: int, n: int, offset: int, name: str) -> bytes:
    """Exactly `n` bytes at `offset`, or a CheckpointError saying the file is shorter."""
    parts, got = [], 0
    try:
        while got < n:
            chunk = os.pread(fd, min(n - got, 1 << 26), offset + got)
            if not chunk:
                raise CheckpointError(f"{name}: truncated while reading: ends at byte {offset + got}, {n - got} bytes short")
            parts.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read: {e.strerror or e}") from None
    return b"".join(parts)


def read_small(path: Path, limit: int, what: str) -> bytes:
    """The whole of a small regular file, refused unread when larger than `limit` bytes."""
    fd, st = open_regular(path, str(path))
    try:
        if st.st_size > limit:
            raise CheckpointError(f"{path}: {st.st_size} bytes, more than a {what} may have ({limit})")
        data = _pread_exact(fd, st.st_size, 0, str(path))
        if os.pread(fd, 1, st.st_size):  # grew meanwhile: read no more
            raise CheckpointError(f"{path}: grew while being read")
        return data
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _load_json(text: str | bytes, where: str, **hooks: Any) -> Any:
    """`json.loads`, with every way it can fail as one CheckpointError line naming `where`."""
    try:
        return json.loads(text, **hooks)
    except RecursionError:
        raise CheckpointError(f"{where}: not valid JSON (nested too deeply)") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: not valid UTF-8 (at byte {e.start})") from None
    except ValueError as e:  # JSONDecodeError, too-long integers, and the hooks' refusals
        raise CheckpointError(f"{where}: not valid JSON ({first_line(e)})") from None


# ---------------------------------------------------------------------------- headers


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, absolute byte offset, dtype and shape.

    `file_id` is the file's (device, inode, size) when its header was read: the
    data is read only from that same file.
    """

    key: str
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    file_id: tuple[int, int, int] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Refused(ValueError):
    """JSON the reference parser (serde_json) refuses but Python's would accept."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all different (`json.loads` would keep the last of two)."""
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(f"key {quoted(key, 200)} appears twice")
            seen.add(key)
    return result


def _u64_or_float(text: str) -> int | float:
    """A JSON integer as serde_json reads it: a u64, else (negative or larger) a float."""
    if len(text) < 20 and text[0] != "-":  # below 10**19 < 2**64
        return int(text)
    digits = text.lstrip("-")
    if len(digits) > 20:
        raise _Refused(f"integer of {len(digits)} digits")
    value = int(text)
    return value if 0 <= value < _U64 and text[0] != "-" else float(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number out of range: {text[:40]}")
    return value


def _no_constant(text: str) -> Any:
    raise _Refused(f"{text} is not JSON")


_HEADER_JSON = dict(
    object_pairs_hook=_unique_keys, parse_int=_u64_or_float, parse_float=_finite_float, parse_constant=_no_constant
)


def _json_problem(value: Any, depth: int, check_strings: bool) -> str | None:
    """What the reference parser refuses in a JSON value nested `depth` deep: nesting
    of 128 levels, or (when `check_strings`) a string with a lone surrogate escape."""
    stack = [(value, depth)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level + 1 >= _MAX_DEPTH:
                return f"nested {_MAX_DEPTH} levels deep"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
        elif check_strings and isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "a string holds a lone surrogate escape (not Unicode)"
    return None


def parse_header(raw: bytes, name: str) -> dict[str, Any]:
    """The JSON object of a safetensors header, parsed as strictly as the reference does.

    UTF-8 only; whitespace around the object allowed (serde_json's, the same as
    Python's); no NaN or Infinity, no number out of range, no key twice (the
    reference keeps the last of two tensor entries; port refuses the ambiguity).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{name}: corrupt header: not UTF-8 (byte {e.start} of the header)") from None
    header = _load_json(text, f"{name}: corrupt header", **_HEADER_JSON)
    if not isinstance(header, dict):
        raise CheckpointError(f"{name}: corrupt header: expected a JSON object")
    if _SURROGATE_ESCAPE.search(text):  # only escapes can make a string that is not Unicode
        if problem := _json_problem(header, 0, check_strings=True):
            raise CheckpointError(f"{name}: corrupt header: {problem}")
    return header


def _nbytes(shape: Sequence[int], itemsize: int) -> int | None:
    """Bytes of a tensor of `shape`, or None when NumPy could not hold it (the product
    of the non-zero sizes, times the item size, above 2**63 - 1)."""
    size = itemsize
    for d in shape:
        if d:
            size *= d
            if size > _MAX_NBYTES:
                return None
    return size if all(shape) else 0


_FIELDS = {"dtype", "shape", "data_offsets"}


def _entry(key: str, entry: Any, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """dtype, shape, begin and end of one tensor entry, each checked."""
    if not isinstance(entry, dict) or not _FIELDS <= entry.keys():
        raise CheckpointError(f"{name}: corrupt header: bad entry for tensor {quoted(key, 200)}")
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not (
        type(dtype_name) is str and type(shape) is list and type(offsets) is list and len(offsets) == 2
        and {int} >= set(map(type, shape)) and type(offsets[0]) is int and type(offsets[1]) is int
    ):  # ints are u64s (see _u64_or_float)
        raise CheckpointError(f"{name}: corrupt header: bad entry for tensor {quoted(key, 200)}")
    if len(entry) > 3:  # other fields are ignored, as the reference does
        for value in (value for field_name, value in entry.items() if field_name not in _FIELDS):
            if problem := _json_problem(value, 2, False):
                raise CheckpointError(f"{name}: corrupt header: tensor {quoted(key, 200)}: {problem}")
    dtype = SAFETENSORS.get(dtype_name)
    if dtype is None:
        raise CheckpointError(f"{name}: tensor {quoted(key, 200)} has unsupported dtype {quoted(dtype_name, 20)}")
    if len(shape) > _MAX_RANK:
        raise CheckpointError(f"{name}: corrupt header: tensor {quoted(key, 200)} has {len(shape)} dimensions (at most {_MAX_RANK})")
    nbytes = _nbytes(shape, dtype.itemsize)
    if nbytes is None:
        raise CheckpointError(f"{name}: corrupt header: tensor {quoted(key, 200)} {dtype_name}{shape} is too large")
    begin, end = offsets
    if end < begin or end - begin != nbytes:
        raise CheckpointError(
            f"{name}: corrupt header: tensor {quoted(key, 200)} {dtype_name}{shape} needs {nbytes} bytes "
            f"but its offsets span {end - begin}"
        )
    return dtype, tuple(shape), begin, end


def _check_metadata(value: Any, name: str) -> None:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise CheckpointError(f"{name}: corrupt header: __metadata__ must map strings to strings")


def _check_layout(spans: list[tuple[int, int, str]], data_size: int, name: str) -> None:
    """The tensors tile the data exactly: from byte 0, no gap, no overlap, to the file's end.

    As the reference's `Metadata::validate` (huggingface/safetensors,
    safetensors/src/tensor.rs) does: entries sorted by `data_offsets`, each must
    start where the previous ended (`InvalidOffset`), and the last must end where
    the file does (`read_metadata`: `MetadataIncompleteBuffer`). A header length one
    byte short, hidden by the header's padding spaces, shows here as one data byte
    too many.
    """
    position = 0
    for begin, end, key in sorted(spans):
        if begin > position:
            raise CheckpointError(
                f"{name}: corrupt header: data bytes {position} to {begin} belong to no tensor "
                f"(a gap before tensor {quoted(key, 200)})"
            )
        if begin < position:
            raise CheckpointError(
                f"{name}: corrupt header: tensor {quoted(key, 200)} starts at data byte {begin}, inside the "
                f"previous tensor (which ends at {position})"
            )
        position = end
    if position > data_size:
        raise CheckpointError(
            f"{name}: truncated: the tensors end at data byte {position} but the file holds only "
            f"{data_size} data bytes"
        )
    if position < data_size:
        raise CheckpointError(
            f"{name}: corrupt header: {data_size - position} bytes after the last tensor (trailing bytes, "
            "or a wrong header length)"
        )


def _header_length(fd: int, size: int, name: str, limit: int) -> int:
    """The header length N of an open safetensors file: N <= limit and 8 + N <= its size."""
    if size < 8:
        raise CheckpointError(f"{name}: truncated: {size} bytes, too short for a safetensors header")
    return header_length_of(_pread_exact(fd, 8, 0, name), size, name, limit)


def header_length_of(prefix: bytes, size: int, name: str, limit: int = MAX_HEADER) -> int:
    """The header length N in a safetensors file's first 8 bytes `prefix`, for a file of `size`
    bytes: N <= limit and 8 + N <= size. The same checks for a local file and a remote one.

    ```python
    header_length_of((120).to_bytes(8, "little"), 4096, "model.safetensors")   # 120
    ```
    """
    if size < 8 or len(prefix) < 8:
        raise CheckpointError(f"{name}: truncated: {size} bytes, too short for a safetensors header")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER:
        raise CheckpointError(f"{name}: corrupt header: its length field exceeds the format's limit of {MAX_HEADER} bytes")
    if 8 + n > size:
        raise CheckpointError(f"{name}: corrupt header: its length field runs past the end of the file ({size} bytes)")
    if n > limit:
        raise CheckpointError(f"{name}: its header would take the checkpoint's headers past {MAX_HEADERS} bytes in all")
    return n


def header_length(path: Path) -> int:
    """The header length of a safetensors file, checked against its size; reads 8 bytes."""
    fd, st = open_regular(path)
    try:
        return _header_length(fd, st.st_size, path.name, MAX_HEADER)
    finally:
        os.close(fd)


def read_header(path: Path, limit: int = MAX_HEADER) -> dict[str, TensorInfo]:
    """Parse and validate the header of one safetensors file; reads no tensor data.

    Refuses what the reference loader (`safetensors`) refuses, and also: duplicate
    keys, dtypes port does not convert, tensor names with control characters, and a
    header longer than `limit` bytes (what is left of the checkpoint's budget).
    """
    return _read_header(path, limit)[0]


def _header_of(path: Path, limit: int) -> tuple[dict[str, Any], int, os.stat_result]:
    """The header object of one safetensors file (read as `parse_header` does), its length, the file's stat."""
    fd, st = open_regular(path)
    try:
        n = _header_length(fd, st.st_size, path.name, limit)
        raw = _pread_exact(fd, n, 8, path.name)
    finally:
        os.close(fd)
    return parse_header(raw, path.name), n, st


def raw_header(path: Path) -> dict[str, Any]:
    """The JSON object of one safetensors file's header, `__metadata__` included; entries not checked.

    ```python
    raw_header(Path("out/model.safetensors"))["__metadata__"]    # {"format": "pt"}
    ```
    """
    return _header_of(path, MAX_HEADER)[0]


def _read_header(path: Path, limit: int) -> tuple[dict[str, TensorInfo], int]:
    """The tensors of one safetensors file, and the length of its header."""
    header, n, st = _header_of(path, limit)
    file_id = (st.st_dev, st.st_ino, st.st_size)
    return header_tensors(header, n, st.st_size, path, path.name, file_id), n


def header_tensors(
    header: dict[str, Any], n: int, size: int, file: Any, name: str, file_id: tuple[int, int, int] | None = None
) -> dict[str, TensorInfo]:
    """The tensors of a parsed header (`parse_header`) of length `n` in a file of `size` bytes,
    every entry and the layout checked; each `TensorInfo` names `file`. Errors name `name`.

    ```python
    header_tensors(parse_header(raw, "x"), len(raw), 8 + len(raw) + 16, path, "x")   # {"w": TensorInfo(...)}
    ```
    """
    tensors, spans = {}, []
    for key, entry in header.items():
        if key == "__metadata__":
            _check_metadata(entry, name)
            continue
        if _CONTROL.search(key):
            raise CheckpointError(f"{name}: corrupt header: tensor name {quoted(key, 200)} has control characters")
        dtype, shape, begin, end = _entry(key, entry, name)
        tensors[key] = TensorInfo(key, file, dtype, shape, 8 + n + begin, file_id)
        spans.append((begin, end, key))
    _check_layout(spans, size - 8 - n, name)
    return tensors


# ---------------------------------------------------------------------------- the checkpoint


def resolve(model: str | os.PathLike) -> Path:
    """A local checkpoint directory (or a `file://` URL), or a Hugging Face repo id fetched
    through its cache. Other URLs are read in place by `open_checkpoint`, not resolved here."""
    from ._remote import is_url, redact

    if is_url(model):
        if not str(model).lower().startswith("file://"):
            raise CheckpointError(f"{redact(str(model))}: a remote checkpoint; this needs a local directory or a repo id")
        model = unquote(urlsplit(str(model)).path)
    path = Path(model)
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{model}: not a directory (give the checkpoint's directory)")
        return path
    text = str(model)
    if not _REPO_ID.match(text):
        raise CheckpointError(f"{model}: no such directory, and not a Hugging Face repo id")
    try:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        snapshot = huggingface_hub.snapshot_download(
            text, allow_patterns=["config.json", "*.safetensors", _INDEX]
        )
        if not any(Path(snapshot).glob("*.safetensors")):  # a repo with PyTorch weights only
            snapshot = huggingface_hub.snapshot_download(
                text, allow_patterns=["config.json", _BIN_SINGLE, "pytorch_model-*.bin", _BIN_INDEX]
            )
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{model}: no such directory, and not in the Hugging Face cache (offline or no network)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"{model}: no such directory, and the Hugging Face Hub said: {first_line(e)}") from None
    return Path(snapshot)


def _plain_name(name: Any) -> bool:
    """A file name with no directory in it: no separator, not `.` or `..`, no NUL or control character."""
    return (
        isinstance(name, str) and name not in ("", ".", "..")
        and not any(sep in name for sep in ("/", "\\", os.sep)) and not _CONTROL.search(name)
    )


def shard_names(index: Path) -> list[str]:
    """The shard files a `model.safetensors.index.json` names: plain names, sorted, distinct."""
    return shard_names_in(read_small(index, MAX_INDEX, "safetensors index"), str(index))


def shard_names_in(raw: bytes, where: str) -> list[str]:
    """The shard files an index's bytes `raw` name (`where` names it in errors): plain names,
    sorted, distinct, at most `MAX_SHARDS`. The checks for a local index and a remote one.

    ```python
    shard_names_in(b'{"weight_map": {"a": "model-1.safetensors"}}', "index")   # ["model-1.safetensors"]
    ```
    """
    data = _load_json(raw, where, object_pairs_hook=_unique_keys)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{where}: not a valid safetensors index (no weight_map)")
    for name in weight_map.values():
        if not _plain_name(name):
            shown = quoted(name, 200) if isinstance(name, str) else f"of type {type(name).__name__}"
            raise CheckpointError(f"{where}: shard {shown} is not a plain file name in the checkpoint directory")
    names = set(weight_map.values())
    if not names:
        raise CheckpointError(f"{where}: weight_map lists no shard files")
    if len(names) > MAX_SHARDS:
        raise CheckpointError(f"{where}: lists {len(names)} shard files, more than {MAX_SHARDS}")
    return sorted(names)


_BIN_INDEX = "pytorch_model.bin.index.json"
_BIN_SINGLE = "pytorch_model.bin"


def _files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint directory: its safetensors files (those its
    `model.safetensors.index.json` lists, `model.safetensors`, or every `*.safetensors`);
    when it has none, its `torch.save` zips (those `pytorch_model.bin.index.json` lists,
    each a `.bin`, or `pytorch_model.bin`). Index entries are plain names inside it.

    ```python
    _files(Path("gpt2"))   # [Path("gpt2/model.safetensors")]
    ```
    """

    def listed(index: Path) -> list[Path]:
        names = shard_names(index)
        missing = [n for n in names if not os.path.lexists(directory / n)]
        if missing:
            raise CheckpointError(f"{index}: lists {quoted(missing[0], 200)}, which is not in {directory}")
        return [directory / n for n in names]

    if os.path.lexists(directory / _INDEX):
        return listed(directory / _INDEX)
    if os.path.lexists(directory / _SINGLE):
        return [directory / _SINGLE]
    found = sorted(directory.glob("*.safetensors"))
    if len(found) > MAX_SHARDS:
        raise CheckpointError(f"{directory}: {len(found)} safetensors files, more than {MAX_SHARDS}")
    if found:
        return found
    if os.path.lexists(directory / _BIN_INDEX):
        shards = listed(directory / _BIN_INDEX)
        other = next((p.name for p in shards if p.suffix != ".bin"), None)
        if other is not None:
            raise CheckpointError(f"{directory / _BIN_INDEX}: lists {quoted(other, 200)}, which is not a .bin file")
        return shards
    if os.path.lexists(directory / _BIN_SINGLE):
        return [directory / _BIN_SINGLE]
    raise CheckpointError(f"{directory}: no weights ({_SINGLE}, {_INDEX}, {_BIN_SINGLE} or {_BIN_INDEX})")


def _headers(directory: Path, files: list[Path]) -> dict[str, TensorInfo]:
    """Every file's tensors, with the headers' total size checked before any header is read.

    A safetensors file's header is its JSON; a `torch.save` zip's (a `.bin`, see
    `_torchfile`) its zip directory and `data.pkl`. Both share one budget, `MAX_HEADERS`.
    """
    from . import _torchfile  # here: it reads through this module's helpers

    pickled = [path.suffix == ".bin" for path in files]
    total = sum(_torchfile.directory_length(p) if b else header_length(p) for p, b in zip(files, pickled))
    if total > MAX_HEADERS:
        what = "zip directories" if any(pickled) else "safetensors headers"
        raise CheckpointError(
            f"{directory}: the {what} of its {len(files)} files take {total} bytes, more than {MAX_HEADERS} in all"
        )
    tensors: dict[str, TensorInfo] = {}
    budget = MAX_HEADERS
    for path, is_bin in zip(files, pickled):
        found, n = (_torchfile.read_tensors if is_bin else _read_header)(path, min(budget, MAX_HEADER))
        budget -= n
        for key, info in found.items():
            if key in tensors:
                raise CheckpointError(f"{path.name}: tensor {quoted(key, 200)} is also in {tensors[key].file.name}")
            tensors[key] = info
    return tensors


# ---------------------------------------------------------------------------- reading regions


def libc_function(name: str, argtypes: list, restype: Any = ctypes.c_ssize_t) -> Callable | None:
    """libc's function `name` through ctypes (the GIL released during each call, `errno`
    kept), or None where there is no such libc or the platform's sizes are not 64-bit.

    ```python
    preadv = libc_function("preadv", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64])
    ```
    """
    if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_size_t) != 8:
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return None
    function.argtypes = argtypes
    function.restype = restype
    return function


_LIBC_PREADV = libc_function("preadv", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64])


def _iov_max() -> int:
    """How many buffers one `preadv` may fill (IOV_MAX; 1024 on Linux)."""
    try:
        value = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        value = -1
    return min(value, 1024) if value > 0 else 16


_IOV_MAX = _iov_max()


def _preadv(fd: int, iov: np.ndarray, offset: int) -> int:
    """One `preadv`: the file's bytes from `offset` on into the buffers of `iov`.

    `iov` is a C-contiguous uint64 array of (address, length) rows, a `struct iovec`
    each; at most IOV_MAX rows. Returns the bytes read (short at the end of file).
    """
    if _LIBC_PREADV is not None:
        while True:
            got = _LIBC_PREADV(fd, iov.__array_interface__["data"][0], len(iov), offset)
            if got >= 0:
                return got
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code))
    buffers = [(ctypes.c_char * int(n)).from_address(int(a)) for a, n in iov]
    return os.preadv(fd, buffers, offset)


def _region_shape(info: TensorInfo, region: Region) -> tuple[int, ...]:
    if len(region) != len(info.shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(region, info.shape)):
        raise ValueError(f"region {region} is outside tensor '{info.key}' of shape {info.shape}")
    return tuple(b - a for a, b in region)


def _run_axis(shape: tuple[int, ...], region: Region) -> int:
    """The axis a run of `region` ranges over: the innermost one it does not cover whole
    (the axes after it are whole, so one run spans them); -1 for the whole tensor."""
    return next((i for i in range(len(region) - 1, -1, -1) if region[i] != (0, shape[i])), -1)


def _contiguous_from(out: np.ndarray) -> int:
    """The outermost axis from which `out`'s elements lie end to end (0 for a C-contiguous
    array; its number of axes when not even the innermost one is contiguous)."""
    if out.flags.c_contiguous:
        return 0
    axis, expected = out.ndim, out.itemsize
    for i in range(out.ndim - 1, -1, -1):
        if out.shape[i] != 1 and out.strides[i] != expected:
            break
        expected *= out.shape[i]
        axis = i
    return axis


def _runs_axis(info: TensorInfo, region: Region, out: np.ndarray) -> int:
    """The outermost axis a run spans: from it in, the region lies end to end both in the
    file and in `out`. There is one run per index of the axes before it."""
    return max(_run_axis(info.shape, region), 0, _contiguous_from(out))


def _pieces(info: TensorInfo, region: Region, out: np.ndarray) -> Iterator[tuple[Region, np.ndarray]]:
    """`(region, out)` cut along its first axis into pieces of at most about `_MAX_RUNS` runs."""
    count = math.prod(b - a for a, b in region[: _runs_axis(info, region, out)])
    if count <= _MAX_RUNS:
        yield region, out
        return
    (a, b), rest = region[0], region[1:]
    step = max(1, (b - a) * _MAX_RUNS // count)
    for start in range(a, b, step):
        stop = min(b, start + step)
        yield ((start, stop), *rest), out[start - a : stop - a]


def _run_layout(shape: tuple[int, ...], itemsize: int, region: Region, axis: int) -> tuple[np.ndarray, int]:
    """Where the runs spanning `axis` on (see `_runs_axis`) start, relative to the tensor's
    first byte, and their length."""
    strides = [math.prod(shape[i + 1 :]) * itemsize for i in range(len(shape))]
    if axis < len(shape):
        a, b = region[axis]
        length, starts = (b - a) * strides[axis], np.array([a * strides[axis]], np.int64)
    else:  # single elements (a scalar, or a destination whose innermost axis is strided)
        length, starts = itemsize, np.zeros(1, np.int64)
    for (lo, hi), stride in zip(region[:axis], strides[:axis]):
        starts = (starts[:, None] + np.arange(lo, hi, dtype=np.int64)[None, :] * stride).reshape(-1)
    starts.setflags(write=False)
    return starts, length


_cached_run_layout = functools.lru_cache(maxsize=128)(_run_layout)
"""The same, remembered for regions of up to `_CACHED_RUNS` runs: the blocks of a stacked
leaf ask it once per layer (at most 128 x 128 KB kept)."""
_CACHED_RUNS = 1 << 14


def _addresses(out: np.ndarray, axis: int, count: int, length: int) -> np.ndarray:
    """Where each run lands in `out`: one per index of the axes before `axis`, in C order."""
    if out.flags.c_contiguous:
        return np.uint64(out.ctypes.data) + np.arange(count, dtype=np.uint64) * np.uint64(length)
    addresses = np.array([out.ctypes.data], np.uint64)
    for n, stride in zip(out.shape[:axis], out.strides[:axis]):
        addresses = (addresses[:, None] + np.arange(n, dtype=np.uint64)[None, :] * np.uint64(stride)).reshape(-1)
    return addresses


def runs(info: TensorInfo, region: Region, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contiguous pieces of `region` in the file: (file offsets, lengths, addresses in `out`).

    A run spans the axes from `_runs_axis` on whole; there is one run per index of the
    axes before it, in C order. `out` may be a strided view (a block's part of a larger
    array): a run then also ends where `out`'s memory stops being contiguous.

    ```python
    runs(info, ((0, 2), (1, 3)), out)   # a (2, 3) float32 tensor: offsets [o+4, o+16], lengths [8, 8]
    ```
    """
    if out.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty.astype(np.uint64)
    region = tuple(map(tuple, region))
    axis = _runs_axis(info, region, out)
    count = math.prod(b - a for a, b in region[:axis])
    layout = _cached_run_layout if count <= _CACHED_RUNS else _run_layout
    starts, length = layout(info.shape, info.dtype.itemsize, region, axis)
    return starts + info.offset, np.full(len(starts), length, np.int64), _addresses(out, axis, len(starts), length)


def _check_out(info: TensorInfo, region: Region, out: np.ndarray) -> None:
    shape = _region_shape(info, region)
    if not (
        isinstance(out, np.ndarray) and out.dtype == info.dtype and out.shape == shape
        and out.flags.writeable and all(stride >= 0 for stride in out.strides)
    ):
        raise ValueError(
            f"buffer for region {region} of '{info.key}' must be a writeable {info.dtype.name}{list(shape)} "
            "(C-contiguous, or a view of one)"
        )


def _read_runs(fd: int, offsets: np.ndarray, lengths: np.ndarray, addresses: np.ndarray, info: TensorInfo) -> None:
    """Read each run into its address: runs adjacent in the file share one `preadv`."""
    order = np.argsort(offsets, kind="stable")
    offsets, lengths = offsets[order], lengths[order]
    iov = np.empty((len(offsets), 2), np.uint64)
    iov[:, 0], iov[:, 1] = addresses[order], lengths
    # Calls: a new one where a run does not start where the previous ended, and every IOV_MAX runs.
    starts = np.flatnonzero(np.concatenate(([True], offsets[1:] != offsets[:-1] + lengths[:-1])))
    starts = np.unique(np.concatenate([np.arange(a, b, _IOV_MAX) for a, b in zip(starts, [*starts[1:], len(offsets)])]))
    wanted = np.add.reduceat(lengths, starts)
    stops = [*starts[1:].tolist(), len(offsets)]
    for first, stop, position, size in zip(starts.tolist(), stops, offsets[starts].tolist(), wanted.tolist()):
        while True:
            try:
                got = _preadv(fd, iov[first:stop], position)
            except OSError as e:
                raise CheckpointError(f"{info.file.name}: cannot read tensor {quoted(info.key, 200)}: {e.strerror or e}") from None
            if got == size:
                break
            if got == 0:
                raise CheckpointError(
                    f"{info.file.name}: truncated while reading: tensor {quoted(info.key, 200)} ends at byte "
                    f"{info.offset + info.nbytes} but the file now has {os.fstat(fd).st_size} bytes"
                )
            done = np.cumsum(iov[first:stop, 1].astype(np.int64))  # a short read: resume where it stopped
            full = int(np.searchsorted(done, got, side="right"))
            used = got - (int(done[full - 1]) if full else 0)
            first += full
            iov[first, 0] += np.uint64(used)
            iov[first, 1] -= np.uint64(used)
            position, size = position + got, size - got


@dataclass
class Checkpoint:
    """An opened checkpoint: config, tensor headers, and counted reads of regions."""

    directory: Path
    config: dict
    tensors: dict[str, TensorInfo]
    output: Path | None = None  # a port output's directory (`restore`): no link followed below it
    bytes_read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def read(self, key: str, region: Region, out: np.ndarray | None = None) -> np.ndarray:
        """Exactly `region` of tensor `key` as a C-contiguous array (`out`, if given).

        ```python
        ckpt.read("wte.weight", ((0, 10), (0, 768)))   # float32[10, 768]; 30720 bytes read
        ```
        """
        info = self.tensors[key]
        if out is None:
            out = np.empty(_region_shape(info, region), info.dtype)
        self.read_into(key, [(region, out)])
        return out

    def expect(self, reads: Mapping[str, Collection[Region]]) -> None:
        """Be told, before a load reads anything, the regions of each tensor it will read. A
        local file has no use for it; a remote checkpoint fetches the small tensors read whole
        that lie together in a file in one request.

        ```python
        ckpt.expect({"h.0.ln_1.weight": {((0, 768),)}, "h.0.ln_1.bias": {((0, 384),), ((384, 768),)}})
        ```
        """

    def read_into(self, key: str, requests: Sequence[tuple[Region, np.ndarray]]) -> None:
        """Read regions of tensor `key`, each into its buffer of the region's shape and the
        tensor's dtype (C-contiguous, or a view of one, such as a block's part of a larger
        array), reading each region's bytes and nothing else.

        Runs that lie end to end in the file, within a region or across regions (the
        column blocks of a matrix tile its rows), are read by one `preadv` straight
        into their buffers: one copy, few system calls. `bytes_read` counts the
        regions' bytes. A file cut short meanwhile is a CheckpointError.
        """
        info = self.tensors[key]
        for region, out in requests:
            _check_out(info, region, out)
        pieces = [piece for region, out in requests for piece in _pieces(info, region, out)]
        batches: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[]]
        count = 0
        for region, out in pieces:
            found = runs(info, region, out)
            if count and count + len(found[0]) > _MAX_RUNS:
                batches.append([])
                count = 0
            batches[-1].append(found)
            count += len(found[0])
        total = sum(out.nbytes for _, out in requests)
        if total == 0:
            return
        fd = self._open(info, self.output)
        try:
            for batch in batches:
                offsets, lengths, addresses = (np.concatenate(parts) for parts in zip(*batch))
                if len(offsets):
                    _read_runs(fd, offsets, lengths, addresses, info)
        finally:
            os.close(fd)
        with self._lock:
            self.bytes_read += total

    @staticmethod
    def _open(info: TensorInfo, output: Path | None = None) -> int:
        """A descriptor of the file `info` lives in: the very file whose header was read (with
        `output`, reached with no link followed below that directory: see `open_regular`)."""
        fd, st = open_regular(info.file, output=output)
        if info.file_id is not None and (st.st_dev, st.st_ino, st.st_size) != info.file_id:
            os.close(fd)
            change = "truncated" if st.st_size < info.file_id[2] else "changed"
            raise CheckpointError(
                f"{info.file.name}: {change} since port checked it (now {st.st_size} bytes, "
                f"was {info.file_id[2]})"
            )
        return fd

    def close(self) -> None:
        """Nothing to release: every read opens and closes its file."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checkpoint(model: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint, reading only its `config.json` and tensor headers.

    Every file is untrusted: headers are checked in full (offsets, sizes, dtypes) before
    anything is read; a `CheckpointError` names the file and what is wrong.

    **Arguments:**

    - `model`: a directory with `config.json` and `*.safetensors` (sharded ones with
      their `model.safetensors.index.json`), or a Hugging Face repo id; or a URL of such
      a directory, read in place by byte range (`http(s)://`, `hf://org/name[@revision]`,
      `s3://`, `gs://`: see `port._remote`).

    Returns a `Checkpoint` (a context manager: it closes its files).

    ```python
    with port.open_checkpoint("path/to/gpt2") as ckpt:
        ckpt.config["n_layer"], ckpt.tensors["wte.weight"].shape
    ```
    """
    from ._remote import is_url, open_remote

    if is_url(model) and not str(model).lower().startswith("file://"):
        return open_remote(str(model))
    directory = resolve(model)
    config_path = directory / "config.json"
    if not os.path.lexists(config_path):
        raise CheckpointError(f"{directory}: no config.json")
    config = _load_json(read_small(config_path, MAX_CONFIG, "config.json"), str(config_path))
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    return Checkpoint(directory, config, _headers(directory, _files(directory)))
