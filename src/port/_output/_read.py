"""Reading an output's metadata, untrusted: `port/metadata` checked field by field, and no JAX.

`read_output` reads and checks what an output says it holds (its mapping, config and
leaves) from `port/metadata` alone, imports nothing the output names and reads no
array; `port info`, `port plan DIR` and `port export` refuse a directory that is not a
port output from it before JAX is imported. `restore` (`_restore`) reads the arrays
after it, through the same bounded readers (`read_json`, `regular_file`).

```python
output = read_output("gpt2-jax")
output.leaves["wte"].shape        # (50257, 768)
written_mesh(output)              # {"data": 2, "model": 2}
```
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .._dtypes import NAMES
from .._dtypes import dtype as dtype_named
from .._errors import OutputError, PortError
from .._files import hub_blob, read_small
from .._mapping import Mapping, parse_mapping
from .._sources._checkpoint import MAX_NBYTES, MAX_RANK, tensor_bytes
from .._text import first_line, one_line, quoted
from ._layout import (
    FIELDS,
    FORMAT,
    LEAF_FIELDS,
    LEAF_PATH,
    MAX_INCLUDE,
    MAX_KEY_CHARS,
    MAX_LEAVES,
    MAX_METADATA_BYTES,
    MAX_NOTE_CHARS,
    MAX_SOURCES,
    MAX_VERSION_CHARS,
    METADATA,
    OPTIONAL_FIELDS,
    OPTIONAL_LEAF_FIELDS,
    PARAMS,
    PORT,
    SHARDING,
    SOURCE_FIELDS,
)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array as `port/metadata` declares it."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str | None, ...]
    quantized: str | None = None  # how it was stored in a quantized checkpoint (`fp8 e4m3fn, 128x128 blocks, ...`)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __str__(self) -> str:
        return describe(self.shape, self.dtype)


@dataclasses.dataclass(frozen=True)
class Output:
    """A port output's checked `port/metadata`."""

    directory: Path
    mapping: Mapping
    config: dict[str, Any]
    leaves: dict[str, Leaf]
    sources: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None  # key -> (shape, dtype), in file order
    include: list[str] | None = None  # the patterns of a partial output (its other leaves None)
    mapping_source: str = ""  # where the mapping was read from when the output was written
    port_version: str | None = None  # the port that wrote it; None: not recorded (an older output)

    @property
    def where(self) -> str:
        return f"{self.directory}/{METADATA}"

    @property
    def params(self) -> Path:
        return self.directory / PARAMS


def describe(shape: tuple[int, ...], dtype: np.dtype) -> str:
    """`float32[101,64]`: a leaf's dtype and shape, as messages show them."""
    return f"{np.dtype(dtype).name}[{','.join(map(str, shape))}]"


def regular_file(path: Path, what: str, output: Path) -> os.stat_result:
    """`path`'s status (`lstat`: a link is not followed, but for one into the Hugging Face cache
    repo's `blobs/` of an `output` downloaded there), refusing anything but a regular file in one
    line naming `what` it is. The directories above it are checked by the callers."""
    try:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode) and (blob := hub_blob(output, path)) is not None:
            info = os.lstat(blob)
    except FileNotFoundError:
        raise OutputError(f"{path}: missing ({what})") from None
    except OSError as e:
        raise OutputError(f"{path}: cannot be read ({e.strerror})") from None
    if stat.S_ISLNK(info.st_mode):
        raise OutputError(f"{path}: a symbolic link, not a regular file of the output: refused ({what})")
    if not stat.S_ISREG(info.st_mode):
        raise OutputError(f"{path}: not a regular file ({what})")
    return info


def require_directory(path: Path, what: str) -> None:
    """Refuse `path` unless it is a directory, not a symbolic link to one, in one line (naming `what` it is
    when it is missing)."""
    if path.is_symlink():
        raise OutputError(f"{path}: a symbolic link, not a directory of the output: refused")
    if not path.is_dir():
        raise OutputError(f"{path}: missing or not a directory ({what})")


def read_json(directory: Path, path: Path, what: str) -> Any:
    """Parse the JSON file `path` of the output `directory`, refusing anything but a regular file
    of at most `MAX_METADATA_BYTES` reached with no link followed below `directory`."""
    info = regular_file(path, what, directory)
    if info.st_size > MAX_METADATA_BYTES:
        raise OutputError(f"{path}: {info.st_size} bytes, more than {what} ever holds ({MAX_METADATA_BYTES} at most)")
    data = read_small(path, MAX_METADATA_BYTES, what, output=directory)
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        reason = "nested too deeply" if isinstance(e, RecursionError) else first_line(e)[:200]
        raise OutputError(f"{path}: not valid JSON ({reason})") from None


def written_mesh(output: Output) -> dict[str, int] | None:
    """The mesh the output's arrays were sharded over when written (`{"data": 2, "model": 2}`),
    as `params/_sharding` records it; None where it does not, or not in the expected form."""
    try:
        shardings = read_json(output.directory, output.directory / SHARDING, "the arrays' shardings")
        first = json.loads(next(iter(shardings.values()))) if isinstance(shardings, dict) and shardings else None
    except (OutputError, ValueError, TypeError, RecursionError):
        return None
    if not isinstance(first, dict):
        return None
    names, sizes = first.get("axis_names"), first.get("shape")
    if not (
        isinstance(names, list)
        and isinstance(sizes, list)
        and len(names) == len(sizes)
        and all(isinstance(n, str) and n.isidentifier() for n in names)
        and all(type(k) is int and k > 0 for k in sizes)
    ):
        return None
    return dict(zip(names, sizes))


def read_output(directory: str | os.PathLike) -> Output:
    """Read and check `port/metadata` of the output at `directory`; reads no array.

    Checks the format number and the type of every field, parses the mapping, and
    checks every leaf's name, shape, dtype and axes against the mapping. Every count and
    size is bounded: the leaves and source tensors (`MAX_LEAVES`, `MAX_SOURCES`), their
    names (`MAX_KEY_CHARS`), and each one's shape as a checkpoint tensor's is (`MAX_RANK`
    dimensions, `MAX_NBYTES` bytes), each and all together. Imports nothing.

    **Arguments:**

    - `directory`: the output directory.

    ```python
    output = read_output("gpt2-jax")
    output.leaves["wte"].shape    # (50257, 768)
    ```
    """
    directory = Path(directory).absolute()
    if not directory.exists():
        raise OutputError(f"{directory}: does not exist")
    if not directory.is_dir():
        raise OutputError(f"{directory}: not a port output (a file, not a directory)")
    if not os.path.lexists(directory / METADATA):
        raise OutputError(f"{directory}: not a port output (no {METADATA})")
    where = f"{directory}/{METADATA}"
    require_directory(directory / PORT, "port's item of the output")
    meta = read_json(directory, directory / METADATA, "port's metadata")
    if not isinstance(meta, dict):
        raise OutputError(f"{where}: expected a JSON object, got {type(meta).__name__}")
    if "format" not in meta:
        raise OutputError(f"{where}: missing field 'format'")
    if type(meta["format"]) is not int or meta["format"] != FORMAT:  # another format's fields may differ: first
        raise OutputError(f"{where}: format {quoted(meta['format'])} is not {FORMAT}, the one this port reads")
    for name in meta:
        if name not in FIELDS + OPTIONAL_FIELDS:
            expected = ", ".join(FIELDS + OPTIONAL_FIELDS)
            raise OutputError(f"{where}: unknown field {quoted(name)} (expected {expected})")
    for name in FIELDS:
        if name not in meta:
            raise OutputError(f"{where}: missing field '{name}'")
    for name, kind in (("mapping_source", str), ("mapping", str), ("config", dict), ("leaves", dict)):
        if not isinstance(meta[name], kind):
            raise OutputError(f"{where}: '{name}' must be a JSON {'string' if kind is str else 'object'}")
    if len(meta["leaves"]) > MAX_LEAVES:
        raise OutputError(
            f"{where}: 'leaves' lists {len(meta['leaves'])} leaves, more than an output holds ({MAX_LEAVES} at most)"
        )
    mapping = _parse(meta["mapping"], where)
    declared = {}
    for path, info in meta["leaves"].items():
        leaf = _leaf(path, info, where)
        entry = mapping.entry(path)
        if entry is None:  # a leaf a `strict=False` conversion kept: replicated, unless it names axes
            if any(axis is not None for axis in leaf.axes):
                raise OutputError(f"{where}: leaf '{path}' has no entry in the output's mapping, yet names axes")
        elif entry.axes is not None and leaf.axes != entry.axes:  # None: the module's annotations, recorded
            raise OutputError(
                f"{where}: leaf '{path}': axes {list(leaf.axes)} differ from its mapping entry's {list(entry.axes)}"
            )
        declared[path] = leaf
    if not declared:
        raise OutputError(f"{where}: 'leaves' is empty")
    _check_total((leaf.nbytes for leaf in declared.values()), "its leaves", where)
    sources = _sources(meta["sources"], where) if "sources" in meta else None
    include = _include(meta["include"], where) if "include" in meta else None
    version = _version(meta["port_version"], where) if "port_version" in meta else None
    return Output(directory, mapping, meta["config"], declared, sources, include, meta["mapping_source"], version)


def _version(value: Any, where: str) -> str:
    """`port/metadata`'s `port_version`: the version of port that wrote the output, a short plain string."""
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= MAX_VERSION_CHARS
        or not value.isascii()
        or not value.isprintable()
    ):
        raise OutputError(f"{where}: 'port_version' must be a version string of at most {MAX_VERSION_CHARS} characters")
    return value


def _include(value: Any, where: str) -> list[str]:
    """`port/metadata`'s `include`: the patterns a partial output was converted with."""
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_INCLUDE
        or not all(isinstance(p, str) and 0 < len(p) <= MAX_KEY_CHARS and p.isprintable() for p in value)
    ):
        raise OutputError(f"{where}: 'include' must be a list of at most {MAX_INCLUDE} module-path patterns")
    return value


def _sources(value: Any, where: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """`port/metadata`'s `sources`: the checkpoint's tensor names, shapes and dtypes, every field checked."""
    if not isinstance(value, dict) or len(value) > MAX_SOURCES:
        raise OutputError(f"{where}: 'sources' must be an object of at most {MAX_SOURCES} tensors")
    sources = {}
    for key, info in value.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS or not key.isprintable():
            raise OutputError(f"{where}: source tensor name {quoted(key)} is not a plain name")
        if not isinstance(info, dict) or set(info) != set(SOURCE_FIELDS):
            raise OutputError(
                f"{where}: source {quoted(key)} must be an object with exactly {', '.join(SOURCE_FIELDS)}"
            )
        what, dtype = f"source {quoted(key)}", info["dtype"]
        shape = _shape(info["shape"], where, what)
        if not isinstance(dtype, str) or dtype not in NAMES:
            raise OutputError(f"{where}: {what}: dtype {quoted(dtype)} is not one port knows")
        np_dtype = dtype_named(dtype)
        _check_bytes(shape, np_dtype, where, what)
        sources[key] = (shape, np_dtype)
    _check_total((math.prod(s) * d.itemsize for s, d in sources.values()), "its source tensors", where)
    return sources


def _shape(value: Any, where: str, what: str) -> tuple[int, ...]:
    """A shape in `port/metadata` (of `what`: "leaf 'wte'"): a list of non-negative integers, at
    most `MAX_RANK` of them, as a checkpoint's tensor has."""
    if isinstance(value, list) and len(value) > MAX_RANK:
        raise OutputError(f"{where}: {what}: 'shape' has {len(value)} dimensions (at most {MAX_RANK})")
    if not isinstance(value, list) or not all(type(n) is int and n >= 0 for n in value):
        raise OutputError(f"{where}: {what}: 'shape' must be a list of non-negative integers")
    return tuple(value)


def _check_bytes(shape: tuple[int, ...], dtype: np.dtype, where: str, what: str) -> None:
    """Refuse a shape of more than `MAX_NBYTES` bytes (`tensor_bytes`), as a checkpoint's tensor's is
    refused, before anything multiplies, prints or allocates by it."""
    if tensor_bytes(shape, dtype.itemsize) is None:
        raise OutputError(
            f"{where}: {what}: {dtype.name} shape {quoted(list(shape), 60)} is too large (more than {MAX_NBYTES} bytes)"
        )


def _check_total(sizes: Iterable[int], what: str, where: str) -> None:
    """Refuse `what` ("its leaves") taking more than `MAX_NBYTES` bytes together."""
    total = 0
    for size in sizes:
        total += size
        if total > MAX_NBYTES:
            raise OutputError(f"{where}: {what} take more than {MAX_NBYTES} bytes together")


def _parse(text: str, where: str) -> Mapping:
    """The output's mapping, parsed (nothing it names is imported)."""
    try:
        return parse_mapping(text, f"{where}: mapping")
    except PortError as e:
        raise OutputError(one_line(str(e))) from None
    except Exception as e:  # a mapping parse_mapping does not expect (e.g. [rules] not a table)
        raise OutputError(f"{where}: mapping is not valid ({type(e).__name__}: {one_line(str(e), 100)})") from None


def _leaf(path: Any, info: Any, where: str) -> Leaf:
    """One entry of `port/metadata`'s `leaves`, every field checked."""
    if not isinstance(path, str) or len(path) > MAX_KEY_CHARS or not LEAF_PATH.fullmatch(path):
        raise OutputError(
            f"{where}: leaf name {quoted(path)} is not a dotted module path of at most {MAX_KEY_CHARS} characters"
        )
    if not isinstance(info, dict) or not set(LEAF_FIELDS) <= set(info) <= {*LEAF_FIELDS, *OPTIONAL_LEAF_FIELDS}:
        raise OutputError(
            f"{where}: leaf '{path}' must be an object with exactly {', '.join(LEAF_FIELDS)} "
            f"(and optionally {', '.join(OPTIONAL_LEAF_FIELDS)})"
        )
    quantized = info.get("quantized")
    if quantized is not None and (
        not isinstance(quantized, str) or not 0 < len(quantized) <= MAX_NOTE_CHARS or not quantized.isprintable()
    ):
        raise OutputError(
            f"{where}: leaf '{path}': 'quantized' must be a printable string of at most {MAX_NOTE_CHARS} characters"
        )
    shape, dtype, axes = _shape(info["shape"], where, f"leaf '{path}'"), info["dtype"], info["axes"]
    if not isinstance(dtype, str) or dtype not in NAMES:
        raise OutputError(f"{where}: leaf '{path}': dtype {quoted(dtype)} is not one of {', '.join(sorted(NAMES))}")
    np_dtype = dtype_named(dtype)
    _check_bytes(shape, np_dtype, where, f"leaf '{path}'")
    if np_dtype.itemsize == 8 and not _held_by_jax(np_dtype):
        raise OutputError(f"{where}: leaf '{path}': JAX holds {dtype} only with jax_enable_x64 set")
    if not isinstance(axes, list) or not all(a is None or isinstance(a, str) for a in axes):
        raise OutputError(f"{where}: leaf '{path}': 'axes' must be a list of logical axis names or null")
    if len(axes) != len(shape):
        raise OutputError(f"{where}: leaf '{path}': {len(axes)} axes for a {len(shape)}-d shape")
    return Leaf(path, shape, np_dtype, tuple(axes), quantized)


def _held_by_jax(dtype: np.dtype) -> bool:
    """Whether JAX holds `dtype` as it is: a 64-bit one only with `jax_enable_x64` set. JAX is
    imported here, for a 64-bit leaf only: every other check of an output needs none."""
    import jax

    return jax.dtypes.canonicalize_dtype(dtype) == dtype
