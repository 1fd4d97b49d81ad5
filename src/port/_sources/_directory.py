"""A checkpoint directory on this machine: found (or fetched into the Hugging Face cache) and opened.

`open_local` reads only `config.json`, the shard index and the weight files' headers,
each bounded in size before a byte of it is read, from regular files only, named by
the index as plain file names inside the directory (`_weight_files`). The weight files are
the safetensors files (`model.safetensors.index.json`'s, `model.safetensors`, or every
`*.safetensors`), else the `torch.save` zips (`pytorch_model.bin.index.json`'s, or
`pytorch_model.bin`: see `_pytorch`); all their headers together are bounded by
`MAX_HEADERS`, checked from their lengths before any header is read.

```python
ckpt = open_local("path/to/gpt2")        # or a Hugging Face repo id, through its cache
ckpt.tensors["h.0.attn.c_attn.weight"].shape    # (768, 2304), no data read
```
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from .._errors import CheckpointError
from .._files import open_regular, pread_exact, read_small
from .._text import first_line, quoted
from ._checkpoint import TensorInfo
from ._local import LocalCheckpoint
from ._pytorch import directory_length, read_tensors
from ._safetensors import (
    INDEX,
    MAX_CONFIG,
    MAX_HEADER,
    MAX_HEADERS,
    MAX_INDEX,
    MAX_SHARDS,
    SINGLE,
    header_length_of,
    header_tensors,
    load_json,
    parse_header,
    shard_names_in,
)
from ._urls import is_url, redact

REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
"""What a Hugging Face repo id looks like (`gpt2`, `org/name`), when it names no directory and is no URL."""
_BIN_INDEX = "pytorch_model.bin.index.json"
_BIN_SINGLE = "pytorch_model.bin"


def open_local(model: str | os.PathLike, max_over_read: float = 1.0) -> LocalCheckpoint:
    """Open a local checkpoint directory (or a `file://` URL, or a Hugging Face repo id fetched
    through its cache), reading only its `config.json` and tensor headers. With `max_over_read`
    > 1, a read's gaps between runs are read through (`LocalCheckpoint.max_over_read`).

    ```python
    with open_local("path/to/gpt2") as ckpt:
        ckpt.config["n_layer"]
    ```
    """
    directory = resolve(model)
    config_path = directory / "config.json"
    if not os.path.lexists(config_path):
        raise CheckpointError(f"{directory}: no config.json")
    config = load_json(read_small(config_path, MAX_CONFIG, "a config.json"), str(config_path))
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    return LocalCheckpoint(
        directory, config, _headers(directory, _weight_files(directory)), max_over_read=max_over_read
    )


def resolve(model: str | os.PathLike) -> Path:
    """A local checkpoint directory (or a `file://` URL), or a Hugging Face repo id fetched
    through its cache. Other URLs are read in place by `open_checkpoint`, not resolved here."""
    if is_url(model):
        if not str(model).lower().startswith("file://"):
            raise CheckpointError(
                f"{redact(str(model))}: a remote checkpoint; this needs a local directory or a repo id"
            )
        model = unquote(urlsplit(str(model)).path)
    path = Path(model)
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{model}: not a directory (give the checkpoint's directory)")
        return path
    text = str(model)
    if not REPO_ID.match(text):
        raise CheckpointError(f"{model}: no such directory, and not a Hugging Face repo id")
    found = snapshot(text, ["config.json", "*.safetensors", INDEX])
    if not any(found.glob("*.safetensors")):  # a repo with PyTorch weights only
        found = snapshot(text, ["config.json", _BIN_SINGLE, "pytorch_model-*.bin", _BIN_INDEX])
    return found


def snapshot(repo: str, patterns: list[str]) -> Path:
    """The snapshot of Hub repo `repo`'s files that `patterns` match, through the Hugging Face
    cache (offline: what the cache holds); a one-line `CheckpointError` when there is none."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(huggingface_hub.snapshot_download(repo, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{repo}: no such directory, and not in the Hugging Face cache (offline or no network)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"{repo}: no such directory, and the Hugging Face Hub said: {first_line(e)}") from None


def shard_names(index: Path) -> list[str]:
    """The shard files a `model.safetensors.index.json` names: plain names, sorted, distinct."""
    return shard_names_in(read_small(index, MAX_INDEX, "a safetensors index"), str(index))


def _weight_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint directory: its safetensors files (those its
    `model.safetensors.index.json` lists, `model.safetensors`, or every `*.safetensors`);
    when it has none, its `torch.save` zips (those `pytorch_model.bin.index.json` lists,
    each a `.bin`, or `pytorch_model.bin`). Index entries are plain names inside it.

    ```python
    _weight_files(Path("gpt2"))   # [Path("gpt2/model.safetensors")]
    ```
    """

    def listed(index: Path) -> list[Path]:
        names = shard_names(index)
        missing = [n for n in names if not os.path.lexists(directory / n)]
        if missing:
            raise CheckpointError(f"{index}: lists {quoted(missing[0], 200)}, which is not in {directory}")
        return [directory / n for n in names]

    if os.path.lexists(directory / INDEX):
        return listed(directory / INDEX)
    if os.path.lexists(directory / SINGLE):
        return [directory / SINGLE]
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
    raise CheckpointError(f"{directory}: no weights ({SINGLE}, {INDEX}, {_BIN_SINGLE} or {_BIN_INDEX})")


def _headers(directory: Path, files: list[Path]) -> dict[str, TensorInfo]:
    """Every file's tensors, with the headers' total size checked before any header is read.

    A safetensors file's header is its JSON; a `torch.save` zip's (a `.bin`, see
    `_pytorch`) its zip directory and `data.pkl`. Both share one budget, `MAX_HEADERS`.
    """
    pickled = [path.suffix == ".bin" for path in files]
    total = sum(directory_length(p) if b else header_length(p) for p, b in zip(files, pickled))
    if total > MAX_HEADERS:
        what = "zip directories" if any(pickled) else "safetensors headers"
        raise CheckpointError(
            f"{directory}: the {what} of its {len(files)} files take {total} bytes, more than {MAX_HEADERS} in all"
        )
    tensors: dict[str, TensorInfo] = {}
    budget = MAX_HEADERS
    for path, is_bin in zip(files, pickled):
        found, n = (read_tensors if is_bin else read_safetensors)(path, min(budget, MAX_HEADER))
        budget -= n
        for key, info in found.items():
            if key in tensors:
                raise CheckpointError(f"{path.name}: tensor {quoted(key, 200)} is also in {tensors[key].file.name}")
            tensors[key] = info
    return tensors


def _header_length(fd: int, size: int, name: str, limit: int) -> int:
    """The header length N of an open safetensors file: N <= limit and 8 + N <= its size."""
    if size < 8:
        raise CheckpointError(f"{name}: truncated: {size} bytes, too short for a safetensors header")
    return header_length_of(pread_exact(fd, 8, 0, name), size, name, limit)


def header_length(path: Path) -> int:
    """The header length of a safetensors file, checked against its size; reads 8 bytes."""
    fd, st = open_regular(path)
    try:
        return _header_length(fd, st.st_size, path.name, MAX_HEADER)
    finally:
        os.close(fd)


def _header_of(path: Path, limit: int) -> tuple[dict[str, Any], int, os.stat_result]:
    """The header object of one safetensors file (read as `parse_header` does), its length, the file's stat."""
    fd, st = open_regular(path)
    try:
        n = _header_length(fd, st.st_size, path.name, limit)
        raw = pread_exact(fd, n, 8, path.name)
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


def read_safetensors(path: Path, limit: int) -> tuple[dict[str, TensorInfo], int]:
    """The tensors of one safetensors file, and the length of its header; reads no tensor data.

    Refuses what the reference loader (`safetensors`) refuses, and also: duplicate
    keys, dtypes port does not convert, tensor names with control characters, and a
    header longer than `limit` bytes (what is left of the checkpoint's budget).

    ```python
    tensors, n = read_safetensors(Path("gpt2/model.safetensors"), MAX_HEADER)
    ```
    """
    header, n, st = _header_of(path, limit)
    file_id = (st.st_dev, st.st_ino, st.st_size)
    return header_tensors(header, n, st.st_size, path, path.name, file_id), n
