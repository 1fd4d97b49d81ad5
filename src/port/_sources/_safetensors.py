"""The safetensors format, and the Hugging Face layout around it, parsed from bytes.

A safetensors file is an 8-byte little-endian header length N, N bytes of a JSON
header (each tensor's dtype, shape and `data_offsets`, and an optional `__metadata__`),
then the tensors' bytes. The format has exact rules; this module refuses exactly what
the reference loader (huggingface/safetensors) refuses, and a little more on purpose
(a key twice, dtypes port does not convert, control characters in names): the header
length (`header_length_of`), the JSON (`parse_header`, as strictly as serde_json reads
it), every entry and the layout (`header_tensors`: contiguous, no gap, no overlap, no
trailing byte). Around the files: `config.json` and `model.safetensors.index.json`
(`shard_names_in`: only plain file names inside the checkpoint), each bounded in size
(`MAX_CONFIG`, `MAX_INDEX`), all of one checkpoint's headers by `MAX_HEADERS`.

Everything here works on bytes already read, the same for a local file and a remote one.

```python
n = header_length_of(first_8_bytes, file_size, "model.safetensors")
tensors = header_tensors(parse_header(raw, "model.safetensors"), n, file_size, path, "model.safetensors")
```
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import numpy as np

from .._dtypes import SAFETENSORS
from .._errors import CheckpointError
from .._text import first_line, quoted
from ._checkpoint import CONTROL_CHARACTERS, MAX_RANK, TensorInfo, tensor_bytes

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

INDEX = "model.safetensors.index.json"
"""The shard index of a sharded checkpoint."""
SINGLE = "model.safetensors"
"""The one file of an unsharded checkpoint."""

_U64 = 2**64
_MAX_DEPTH = 128  # serde_json's recursion limit: the reference refuses JSON nested this deep
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def load_json(text: str | bytes, where: str, **hooks: Any) -> Any:
    """`json.loads`, with every way it can fail as one CheckpointError line naming `where`.

    ```python
    load_json(b'{"n_layer": 12}', "gpt2/config.json")   # {'n_layer': 12}
    load_json(b'{"a": 1', "gpt2/config.json")           # CheckpointError: gpt2/config.json: not valid JSON (...)
    ```
    """
    try:
        return json.loads(text, **hooks)
    except RecursionError:
        raise CheckpointError(f"{where}: not valid JSON (nested too deeply)") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: not valid UTF-8 (at byte {e.start})") from None
    except ValueError as e:  # JSONDecodeError, too-long integers, and the hooks' refusals
        raise CheckpointError(f"{where}: not valid JSON ({first_line(e)})") from None


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
    header = load_json(text, f"{name}: corrupt header", **_HEADER_JSON)
    if not isinstance(header, dict):
        raise CheckpointError(f"{name}: corrupt header: expected a JSON object")
    if _SURROGATE_ESCAPE.search(text):  # only escapes can make a string that is not Unicode
        if problem := _json_problem(header, 0, check_strings=True):
            raise CheckpointError(f"{name}: corrupt header: {problem}")
    return header


_FIELDS = {"dtype", "shape", "data_offsets"}


def _entry(key: str, entry: Any, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """dtype, shape, begin and end of one tensor entry, each checked."""
    if not isinstance(entry, dict) or not _FIELDS <= entry.keys():
        raise CheckpointError(f"{name}: corrupt header: bad entry for tensor {quoted(key, 200)}")
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not (
        type(dtype_name) is str
        and type(shape) is list
        and type(offsets) is list
        and len(offsets) == 2
        and {int} >= set(map(type, shape))
        and type(offsets[0]) is int
        and type(offsets[1]) is int
    ):  # ints are u64s (see _u64_or_float)
        raise CheckpointError(f"{name}: corrupt header: bad entry for tensor {quoted(key, 200)}")
    if len(entry) > 3:  # other fields are ignored, as the reference does
        for value in (value for field_name, value in entry.items() if field_name not in _FIELDS):
            if problem := _json_problem(value, 2, False):
                raise CheckpointError(f"{name}: corrupt header: tensor {quoted(key, 200)}: {problem}")
    dtype = SAFETENSORS.get(dtype_name)
    if dtype is None:
        raise CheckpointError(f"{name}: tensor {quoted(key, 200)} has unsupported dtype {quoted(dtype_name, 20)}")
    if len(shape) > MAX_RANK:
        raise CheckpointError(
            f"{name}: corrupt header: tensor {quoted(key, 200)} has {len(shape)} dimensions (at most {MAX_RANK})"
        )
    nbytes = tensor_bytes(shape, dtype.itemsize)
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
            f"{name}: truncated: the tensors end at data byte {position} but the file holds only {data_size} data bytes"
        )
    if position < data_size:
        raise CheckpointError(
            f"{name}: corrupt header: {data_size - position} bytes after the last tensor (trailing bytes, "
            "or a wrong header length)"
        )


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
        raise CheckpointError(
            f"{name}: corrupt header: its length field exceeds the format's limit of {MAX_HEADER} bytes"
        )
    if 8 + n > size:
        raise CheckpointError(f"{name}: corrupt header: its length field runs past the end of the file ({size} bytes)")
    if n > limit:
        raise CheckpointError(f"{name}: its header would take the checkpoint's headers past {MAX_HEADERS} bytes in all")
    return n


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
        if CONTROL_CHARACTERS.search(key):
            raise CheckpointError(f"{name}: corrupt header: tensor name {quoted(key, 200)} has control characters")
        dtype, shape, begin, end = _entry(key, entry, name)
        tensors[key] = TensorInfo(key, file, dtype, shape, 8 + n + begin, file_id)
        spans.append((begin, end, key))
    _check_layout(spans, size - 8 - n, name)
    return tensors


def plain_name(name: Any) -> bool:
    """A file name with no directory in it: no separator, not `.` or `..`, no NUL or control character.

    ```python
    plain_name("model-00001-of-00002.safetensors"), plain_name("../x"), plain_name("a/b")   # True, False, False
    ```
    """
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(sep in name for sep in ("/", "\\", os.sep))
        and not CONTROL_CHARACTERS.search(name)
    )


def shard_names_in(raw: bytes, where: str) -> list[str]:
    """The shard files an index's bytes `raw` name (`where` names it in errors): plain names,
    sorted, distinct, at most `MAX_SHARDS`. The checks for a local index and a remote one.

    ```python
    shard_names_in(b'{"weight_map": {"a": "model-1.safetensors"}}', "index")   # ["model-1.safetensors"]
    ```
    """
    data = load_json(raw, where, object_pairs_hook=_unique_keys)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{where}: not a valid safetensors index (no weight_map)")
    for name in weight_map.values():
        if not plain_name(name):
            shown = quoted(name, 200) if isinstance(name, str) else f"of type {type(name).__name__}"
            raise CheckpointError(f"{where}: shard {shown} is not a plain file name in the checkpoint directory")
    names = set(weight_map.values())
    if not names:
        raise CheckpointError(f"{where}: weight_map lists no shard files")
    if len(names) > MAX_SHARDS:
        raise CheckpointError(f"{where}: lists {len(names)} shard files, more than {MAX_SHARDS}")
    return sorted(names)
