"""The layout of port's output, defined once: what `save` writes and `restore` reads back.

A port output (format 3) is an ordinary Orbax composite checkpoint, written by port:

```
OUT/
  _CHECKPOINT_METADATA      Orbax: the items and their handlers, timestamps
  commit_success.txt        Orbax: the checkpoint was finalised
  params/                   the arrays, as Orbax's PyTree handler stores them without OCDBT:
    _METADATA                 the tree (each array's path; None leaves), `use_ocdbt: false`
    _sharding                 each array's NamedSharding, for a restore that names none
    commit_success.txt
    blocks.attn.wq/           one zarr array per leaf, named by its dotted module path:
      .zarray  0.0.0.0 ...    its `.zarray` and a chunk file per block of the mesh it was saved from
  port/metadata             port's metadata, JSON: the format number (3), the mapping's text and where it
  port/commit_success.txt   came from, config.json, each leaf's shape, dtype and logical axes, and the
                            version of port that wrote it (`port_version`: optional, outputs written
                            before it was recorded have none)
```

Each array is stored as zarr format 2 stores one: a directory of chunk files beside its
`.zarray` (JSON: shape, chunk shape, dtype; no compressor, no filters, C order). Chunk
`(i, j)` is the file `i.j` (a scalar's is `0`): the bytes of the array's box
`[i*ci : (i+1)*ci, j*cj : (j+1)*cj]`, row-major, every chunk full size (an edge chunk
padded past the array's end). Port chunks an array by the blocks of the mesh it was
saved from, so each device's block is one file, written from the device's own buffer
and read back straight into one; on another mesh each block reads the pieces of the
chunks it overlaps. A chunk file is a row-major region of a file, like a tensor in a
safetensors file, so `restore` reads it with the same positioned reads as `place`.

An output is untrusted when read back: the bounds here (`MAX_*`) are those `restore`
reads it under, and `save` refuses to write what would pass them. Each leaf and source
tensor it declares also obeys the rules of a checkpoint's tensors (`port._sources._checkpoint`:
at most `MAX_RANK` dimensions, at most `MAX_NBYTES` bytes, each and all together).

```python
zarray((50257, 768), (50257, 192), np.dtype("float32"))["chunks"]   # [50257, 192]
list(grid((8, 6), (4, 3)))                  # [(0, 0), (0, 1), (1, 0), (1, 1)]
chunk_name((1, 0))                          # '1.0'
is_output("out/gpt2")                       # True once `port.save(..., "out/gpt2")` has finished
```
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .._dtypes import NAMES
from .._errors import PortError
from .._files import read_small

FORMAT = 3  # the one format this port writes and reads

# The files and directories of an output.
STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's names in a checkpoint it finalised
COMMIT_FILE = "commit_success.txt"
PARAMS = "params"  # Orbax's PyTree item: the arrays
PORT = "port"  # Orbax's JSON item: port's metadata
METADATA = "port/metadata"  # port's metadata, relative to the output
TREE_METADATA = "params/_METADATA"  # Orbax's PyTree metadata
SHARDING = "params/_sharding"  # Orbax's record of each array's sharding
ZARRAY = ".zarray"  # an array's zarr metadata, in its directory
PARTS = frozenset({STEP_METADATA, COMMIT_FILE, PARAMS, PORT})  # what `save` writes into an output
PORT_PARTS = frozenset({"metadata", COMMIT_FILE})  # the JSON item `port/` (Orbax's JsonCheckpointHandler)
PARAMS_FILES = frozenset({"_METADATA", "_sharding", COMMIT_FILE})  # in `params/`, beside a directory per leaf
LEAF_PATH = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")  # a leaf's name, and its directory in params/
CHUNK_NAME = re.compile(r"[0-9]+(?:\.[0-9]+)*")  # a chunk file's name: its index (`chunk_name`)

# The fields of port/metadata, and of each of its leaves.
FIELDS = ("format", "mapping_source", "mapping", "config", "leaves")
# The checkpoint's tensor headers, for `port export`; a partial load's patterns; the version of
# port that wrote the output (not in outputs written before port recorded it).
OPTIONAL_FIELDS = ("sources", "include", "port_version")
LEAF_FIELDS = ("shape", "dtype", "axes")
# How a leaf was stored in a quantized checkpoint (`fp8 e4m3fn, 128x128 blocks, ...`), for `port info`.
OPTIONAL_LEAF_FIELDS = ("quantized",)
SOURCE_FIELDS = ("shape", "dtype")

# The bounds an output is read back under (`save` checks the metadata it writes against them).
MAX_METADATA_BYTES = 32 << 20  # port/metadata, params/_METADATA: a few hundred KB for real models
MAX_SOURCES = 1_000_000  # source tensors port/metadata records
MAX_LEAVES = 1_000_000  # leaves port/metadata lists (each a directory of params/)
MAX_INCLUDE = 1000  # patterns of a partial output
MAX_KEY_CHARS = 1000  # characters of a leaf's or a source tensor's name, or of a pattern
MAX_VERSION_CHARS = 100  # characters of `port_version`
MAX_NOTE_CHARS = 1000  # characters of a leaf's `quantized` description
MAX_PARAMS_FILES = 1_000_000  # chunk files: one per block of the saving mesh, per leaf
MAX_OUTPUT_ENTRIES = 2_000_000  # files `is_output` looks at before it calls a tree not port's


def port_version() -> str:
    """The version of the installed port, as an output records it (`"0.1.0"`; `"unknown"` for a
    source tree never installed): the package's metadata, as `port.__version__` reads it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("port")
    except PackageNotFoundError:
        return "unknown"


def zarr_dtype(dtype: np.dtype) -> str:
    """The `.zarray` name of `dtype`: NumPy's type string (`<f4`), or the name of an ml_dtypes type (`bfloat16`)."""
    dtype = np.dtype(dtype)
    return dtype.str if dtype.type.__module__ == "numpy" else dtype.name


ZARR_DTYPES: dict[str, np.dtype] = {zarr_dtype(d): d for d in NAMES.values()}
"""The dtypes an output may hold, by their `.zarray` names."""


def zarray(shape: tuple[int, ...], chunks: tuple[int, ...], dtype: np.dtype) -> dict[str, Any]:
    """The `.zarray` of an array of `shape` stored in `chunks`: uncompressed, C order, zarr format 2."""
    return {
        "chunks": list(chunks),
        "compressor": None,
        "dimension_separator": ".",
        "dtype": zarr_dtype(dtype),
        "fill_value": None,
        "filters": None,
        "order": "C",
        "shape": list(shape),
        "zarr_format": 2,
    }


def chunk_shape(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """The chunk shape for blocks of shape `block`: the block, at least 1 along each axis (zarr's minimum)."""
    return tuple(max(1, n) for n in block) if shape else ()


def grid_shape(shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[int, ...]:
    """How many chunks along each axis (none along an empty axis)."""
    return tuple(-(-n // c) for n, c in zip(shape, chunks))


def grid(shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every chunk's index, in C order (a scalar has the one chunk `()`)."""
    return itertools.product(*(range(n) for n in grid_shape(shape, chunks)))


def chunk_count(shape: tuple[int, ...], chunks: tuple[int, ...]) -> int:
    """How many chunk files an array of `shape` stored in `chunks` has."""
    return math.prod(grid_shape(shape, chunks))


def chunk_name(index: tuple[int, ...]) -> str:
    """The file name of the chunk at `index`: `"1.0"`; a scalar's chunk is `"0"`."""
    return ".".join(map(str, index)) if index else "0"


def overlapping(
    box: tuple[tuple[int, int], ...], chunks: tuple[int, ...]
) -> Iterator[tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]]:
    """The chunks a (non-empty) `box` of the array overlaps: (chunk index, the overlap in the
    chunk's coordinates, the overlap in the box's coordinates)."""
    ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(box, chunks)]
    for index in itertools.product(*ranges):
        inside, within = [], []
        for i, (a, b), c in zip(index, box, chunks):
            lo, hi = max(a, i * c), min(b, (i + 1) * c)
            inside.append((lo - i * c, hi - i * c))
            within.append((lo - a, hi - a))
        yield index, tuple(inside), tuple(within)


def _metadata(path: Path) -> Any:
    """The JSON object in `path` if it is a regular file of port's metadata size, else None."""
    try:  # never a FIFO, nor huge, nor a link (but into the Hugging Face cache's blobs)
        meta = json.loads(read_small(path, MAX_METADATA_BYTES, "port's metadata", output=path.parent))
    except (PortError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def is_output(directory: str | os.PathLike) -> bool:
    """Whether `directory` is a port output: exactly the files and directories `save` writes.

    Orbax's `_CHECKPOINT_METADATA` and `commit_success.txt`, the `params/` item holding
    only what `save` writes there, and the `port/` item holding `metadata` (a JSON
    object of this format) and `commit_success.txt`. (What `force` may replace.)

    ```python
    is_output("out/gpt2")      # True once `port.save(..., "out/gpt2")` has finished
    ```
    """
    directory = Path(directory)
    params, port = directory / PARAMS, directory / PORT
    if directory.is_symlink() or not directory.is_dir() or params.is_symlink() or not params.is_dir():
        return False
    try:
        names = {p.name for p in directory.iterdir()}
    except OSError:
        return False
    if names != PARTS or port.is_symlink() or not port.is_dir():
        return False
    try:
        items = {p.name for p in port.iterdir()}
    except OSError:
        return False
    meta = _metadata(directory / METADATA) if items == PORT_PARTS else None
    return meta is not None and meta.get("format") == FORMAT and _params_are_ours(params)


def claims_output(directory: str | os.PathLike) -> bool:
    """Whether `directory` says it is a port output rather than a checkpoint: it has `port/metadata`
    and no `config.json`. Nothing is checked: `read_output` reads it as untrusted.

    ```python
    claims_output("gpt2-jax"), claims_output("examples/tiny-gpt2")     # True, False
    ```
    """
    directory = Path(directory)
    return os.path.lexists(directory / METADATA) and not os.path.lexists(directory / "config.json")


def _params_are_ours(params: Path) -> bool:
    """Whether `params/` holds only what `save` writes there: Orbax's `_METADATA`, `_sharding` and
    commit file, and per leaf a directory named by its dotted path holding its `.zarray` and chunk
    files; every one a regular file or a directory, none a link. (What `force` would delete.)"""
    budget = MAX_OUTPUT_ENTRIES
    try:
        with os.scandir(params) as top:
            entries = list(top)
        for entry in entries:
            budget -= 1
            if entry.name in PARAMS_FILES:
                if not entry.is_file(follow_symlinks=False):
                    return False
                continue
            if not LEAF_PATH.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
                return False
            with os.scandir(entry.path) as leaf:
                for item in leaf:
                    budget -= 1
                    if (
                        budget < 0
                        or not item.is_file(follow_symlinks=False)
                        or not (item.name == ZARRAY or CHUNK_NAME.fullmatch(item.name))
                    ):
                        return False
    except OSError:
        return False
    return budget >= 0
