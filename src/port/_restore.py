"""Restore: a `port convert` output onto any mesh, each device reading its region.

An output (see `_save` for its layout: Orbax's composite checkpoint of `params/`, the
arrays, and `port/metadata`, port's JSON) is untrusted: it may come from anywhere.
`restore` makes no Orbax call and imports no module an output names except port's own
models (`port.models.*`), unless the caller passes the class; it checks everything
before reading an array: `port/metadata` field by field, the arrays
`params/_METADATA` declares against it, sizes against the bytes stored, and the
module's skeleton built from its config against every leaf. Then it reads each
device's region of each leaf with TensorStore from `params/` (zarr arrays in an OCDBT
database, as Orbax writes them). Every problem is one `OutputError` line naming the
directory, file and leaf.

```python
model = restore("out/gpt2", "2x4")
model = restore("out/mine", "2x4", model=MyModel)   # a module of your own
```
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pkgutil
import re
import stat
from collections import deque
from collections.abc import Iterator, Mapping as AnyMapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ._console import one_line, quoted
from ._errors import OutputError, PortError
from ._fill import fill
from ._dtypes import NAMES, dtype as dtype_named, floating
from ._mapping import Mapping, import_object, parse_mapping
from ._runtime import as_mesh
from ._place import _box
from ._plan import check_include, partition, selects
from ._save import FORMAT, MAX_METADATA_BYTES
from ._skeleton import leaves, skeleton

MAX_PARAMS_FILES = 100_000  # Orbax's OCDBT writes a handful of files per process
INLINE_SLACK_BYTES = 64 << 20  # OCDBT keeps chunks of up to 1 KB inside (compressed) tree nodes
CONFIG_INT_FLOOR = 1 << 20  # config integers up to this are always accepted
MAX_NODE_BYTES = 100_000_000  # Orbax's OCDBT `max_decoded_node_bytes`: bounds decompression
READ_AHEAD_BYTES = 1 << 30  # host bytes of blocks read but not yet on their devices

_FIELDS = ("format", "mapping_source", "mapping", "config", "leaves")
_OPTIONAL_FIELDS = ("sources", "include")  # the checkpoint's tensor headers, for `port export`; a partial load's patterns
MAX_INCLUDE = 1000
MAX_SOURCES = 1_000_000
MAX_KEY_CHARS = 1000
MAX_RANK = 16
_LEAF_FIELDS = ("shape", "dtype", "axes")
_PATH = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")
_SHIPPED = "port.models"


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array as `port/metadata` declares it."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

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

    @property
    def where(self) -> str:
        return f"{self.directory}/port/metadata"

    @property
    def params(self) -> Path:
        return self.directory / "params"


def restore(
    directory: str | os.PathLike,
    mesh: Mesh | str | None = None,
    *,
    model: type | None = None,
    include: Sequence[str] | None = None,
) -> Any:
    """Load a `port convert` output onto `mesh`, which may differ from the one it was written with.

    **Arguments:**

    - `directory`: the output, as `port convert` or `save` wrote it (format 2: Orbax's
      checkpoint of `params/` and `port/`). An output of an earlier port (format 1,
      `port.json` beside `params/`) is refused: convert the checkpoint again.
    - `mesh`: a `Mesh` or a spec such as `"2x4"`, as for `load` (default: one device).
    - `model`: the module class to build, with `from_config(config, *, key)`. Without
      it, the class the output names is imported only if it is one of port's models
      (`port.models.*`); an output naming any other module is refused, since importing
      it would run code that came with the output. Given, it is used as it is, whatever
      the output names: the name is not compared, every leaf's shape and dtype are.
    - `include`: read only the leaves these module-path patterns select (a path, a
      dotted prefix such as `"blocks"`, or a glob such as `"blocks.attn.*"`); the others
      are None. An output written with `include` holds only its leaves: the rest are None.

    Returns the module, every array under its `NamedSharding` on `mesh` (each leaf's
    logical axes mapped to mesh axes by the output's mapping rules).

    Raises `OutputError`, one line naming the directory (and the file and leaf), for an
    output that is incomplete, corrupt, inconsistent or not port's. Every check that
    needs no array data runs before the first array is read; a chunk that is missing
    or cut short is found when it is read.

    ```python
    model = restore("gpt2-jax", "2x4")
    model = restore("mine-jax", port.make_mesh("4x2"), model=MyModel)
    embeddings = restore("gpt2-jax", include=["wte", "wpe"])     # everything else None
    ```
    """
    mesh = as_mesh(mesh)
    if model is not None and (not isinstance(model, type) or not hasattr(model, "from_config")):
        raise PortError(f"`model`: expected a class with from_config(config, *, key), got {quoted(model)}")
    output = read_output(directory)
    cls = model_class(output, model)
    _check_rules(output, mesh)
    _check_stored(output)
    _check_sizes(output, _params_bytes(output.params))
    _check_config(output)
    skel = _build(cls, output)
    absent = _check_skeleton(skel, output, cls)
    if include is not None:
        check_include(output.leaves, include, f"the output {output.directory}")
        chosen = {p: leaf for p, leaf in output.leaves.items() if selects(p, include)}
        absent += [path for path in output.leaves if path not in chosen]
        output = dataclasses.replace(output, leaves=chosen)
    arrays = dict(_read_arrays(output, _open_arrays(output), mesh))
    return fill(skel, arrays | {path: None for path in absent})


def describe(shape: tuple[int, ...], dtype: np.dtype) -> str:
    """`float32[101,64]`: a leaf's dtype and shape, as messages show them."""
    return f"{np.dtype(dtype).name}[{','.join(map(str, shape))}]"


def _read_json(path: Path, what: str) -> Any:
    """Parse the JSON file `path`, refusing anything but a regular file of at most `MAX_METADATA_BYTES`."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise OutputError(f"{path}: missing ({what})") from None
    except OSError as e:
        raise OutputError(f"{path}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise OutputError(f"{path}: not a regular file ({what})")
    if info.st_size > MAX_METADATA_BYTES:
        raise OutputError(f"{path}: {info.st_size} bytes, more than {what} ever holds ({MAX_METADATA_BYTES} at most)")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)
    except OSError as e:
        raise OutputError(f"{path}: cannot be read ({e.strerror})") from None
    if len(data) > MAX_METADATA_BYTES:
        raise OutputError(f"{path}: more than {MAX_METADATA_BYTES} bytes ({what} holds far less)")
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0][:200]
        raise OutputError(f"{path}: not valid JSON ({reason})") from None


def read_output(directory: str | os.PathLike) -> Output:
    """Read and check `port/metadata` of the output at `directory`; reads no array.

    Checks the format number and the type of every field, parses the mapping, and
    checks every leaf's name, shape, dtype and axes against the mapping. Imports nothing.

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
    if not os.path.lexists(directory / "port" / "metadata"):
        if os.path.lexists(directory / "port.json") and not os.path.lexists(directory / "port"):
            raise OutputError(
                f"{directory}: written by an earlier port (format 1, port.json); this port reads format "
                f"{FORMAT}: convert the checkpoint again"
            )
        raise OutputError(f"{directory}: not a port output (no port/metadata)")
    where = f"{directory}/port/metadata"
    meta = _read_json(directory / "port" / "metadata", "port's metadata")
    if not isinstance(meta, dict):
        raise OutputError(f"{where}: expected a JSON object, got {type(meta).__name__}")
    for name in meta:
        if name not in _FIELDS + _OPTIONAL_FIELDS:
            expected = ", ".join(_FIELDS + _OPTIONAL_FIELDS)
            raise OutputError(f"{where}: unknown field {quoted(name)} (expected {expected})")
    for name in _FIELDS:
        if name not in meta:
            raise OutputError(f"{where}: missing field '{name}'")
    if type(meta["format"]) is not int or meta["format"] != FORMAT:
        raise OutputError(f"{where}: format {quoted(meta['format'])} is not {FORMAT}, the one this port reads")
    for name, kind in (("mapping_source", str), ("mapping", str), ("config", dict), ("leaves", dict)):
        if not isinstance(meta[name], kind):
            raise OutputError(f"{where}: '{name}' must be a JSON {'string' if kind is str else 'object'}")
    mapping = _parse(meta["mapping"], where)
    entries = {p.path: p for p in mapping.params}
    declared = {}
    for path, info in meta["leaves"].items():
        leaf = _leaf(path, info, where)
        if path not in entries:
            raise OutputError(f"{where}: leaf '{path}' has no entry in the output's mapping")
        if leaf.axes != entries[path].axes:
            raise OutputError(
                f"{where}: leaf '{path}': axes {list(leaf.axes)} differ from its mapping entry's "
                f"{list(entries[path].axes)}"
            )
        declared[path] = leaf
    if not declared:
        raise OutputError(f"{where}: 'leaves' is empty")
    sources = _sources(meta["sources"], where) if "sources" in meta else None
    include = _include(meta["include"], where) if "include" in meta else None
    return Output(directory, mapping, meta["config"], declared, sources, include)


def _include(value: Any, where: str) -> list[str]:
    """`port/metadata`'s `include`: the patterns a partial output was converted with."""
    if (
        not isinstance(value, list) or not 0 < len(value) <= MAX_INCLUDE
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
        if not isinstance(info, dict) or set(info) != {"shape", "dtype"}:
            raise OutputError(f"{where}: source {quoted(key)} must be an object with exactly shape, dtype")
        shape, dtype = info["shape"], info["dtype"]
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(type(n) is int and n >= 0 for n in shape):
            raise OutputError(f"{where}: source {quoted(key)}: 'shape' must be a list of non-negative integers")
        if not isinstance(dtype, str) or dtype not in NAMES:
            raise OutputError(f"{where}: source {quoted(key)}: dtype {quoted(dtype)} is not one port knows")
        sources[key] = (tuple(shape), dtype_named(dtype))
    return sources


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
    if not isinstance(path, str) or not _PATH.fullmatch(path):
        raise OutputError(f"{where}: leaf name {quoted(path)} is not a dotted module path")
    if not isinstance(info, dict) or set(info) != set(_LEAF_FIELDS):
        raise OutputError(f"{where}: leaf '{path}' must be an object with exactly {', '.join(_LEAF_FIELDS)}")
    shape, dtype, axes = info["shape"], info["dtype"], info["axes"]
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise OutputError(f"{where}: leaf '{path}': 'shape' must be a list of non-negative integers")
    if not isinstance(dtype, str) or dtype not in NAMES:
        raise OutputError(f"{where}: leaf '{path}': dtype {quoted(dtype)} is not one of {', '.join(sorted(NAMES))}")
    np_dtype = dtype_named(dtype)
    if jax.dtypes.canonicalize_dtype(np_dtype) != np_dtype:
        raise OutputError(f"{where}: leaf '{path}': JAX holds {dtype} only with jax_enable_x64 set")
    if not isinstance(axes, list) or not all(a is None or isinstance(a, str) for a in axes):
        raise OutputError(f"{where}: leaf '{path}': 'axes' must be a list of logical axis names or null")
    if len(axes) != len(shape):
        raise OutputError(f"{where}: leaf '{path}': {len(axes)} axes for a {len(shape)}-d shape")
    return Leaf(path, tuple(shape), np_dtype, tuple(axes))


def model_class(output: Output, model: type | None = None) -> type:
    """`model` if given, else the class the output names, which must be one of port's models.

    **Arguments:**

    - `output`: a checked output (`read_output`).
    - `model`: the caller's class, used as it is; nothing is imported then.

    ```python
    model_class(read_output("gpt2-jax"))     # port.models.gpt2.GPT2
    ```
    """
    if model is not None:
        return model
    spec = output.mapping.model
    module, _, name = spec.partition(":")
    package, _, submodule = module.rpartition(".")
    if package != _SHIPPED or submodule not in _shipped_modules() or not name.isidentifier() or name.startswith("_"):
        raise OutputError(
            f"{output.where}: model {quoted(spec)} is not one of port's models ({_SHIPPED}.*), and restore "
            f"imports no other module an output names; pass the class: port.restore(directory, mesh, model=YourModel)"
        )
    cls = import_object(spec, f"{output.where}: model")
    if not isinstance(cls, type) or not hasattr(cls, "from_config"):
        raise OutputError(f"{output.where}: model {quoted(spec)} is not a model class")
    return cls


def _shipped_modules() -> set[str]:
    """The public modules of `port.models`, found without importing any."""
    import port.models

    return {m.name for m in pkgutil.iter_modules(port.models.__path__) if not m.name.startswith("_")}


def _check_rules(output: Output, mesh: Mesh) -> None:
    """Every mesh axis the mapping's rules name exists in `mesh`."""
    for axis, names in output.mapping.rules.items():
        for name in names:
            if name not in mesh.shape:
                raise OutputError(
                    f"{output.where}: mapping rules.{axis} names mesh axis {quoted(name)}, which the mesh "
                    f"({', '.join(mesh.shape)}) does not have"
                )


def _check_stored(output: Output) -> None:
    """The arrays `params/_METADATA` declares, which must be exactly `port/metadata`'s leaves."""
    params = output.params
    if not params.is_dir():
        raise OutputError(f"{params}: missing or not a directory (an incomplete port output)")
    where = f"{params}/_METADATA"
    meta = _read_json(params / "_METADATA", "Orbax's metadata")
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(tree, dict):
        raise OutputError(f"{where}: not Orbax's PyTree metadata (no 'tree_metadata')")
    if meta.get("use_ocdbt") is not True or meta.get("use_zarr3") is not False:
        raise OutputError(f"{where}: arrays not stored as port writes them (zarr in an OCDBT database)")
    stored = set()
    for entry in tree.values():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, dict) and isinstance(k.get("key"), str) for k in keys):
            raise OutputError(f"{where}: an entry without key names")
        path = ".".join(k["key"] for k in keys)
        if not _PATH.fullmatch(path):
            raise OutputError(f"{where}: array {quoted(path)} is not named by a dotted module path")
        if isinstance(value, dict) and value.get("value_type") == "None":  # an absent leaf (no pooler): no data
            continue
        if not isinstance(value, dict) or value.get("value_type") != "jax.Array":
            raise OutputError(f"{where}: '{path}' is not stored as a jax.Array")
        stored.add(path)
    for path in sorted(stored - set(output.leaves)):
        raise OutputError(f"{params}: holds array '{path}', which port/metadata does not list")
    for path in sorted(set(output.leaves) - stored):
        raise OutputError(f"{params}: has no array '{path}', which port/metadata lists")


def _params_bytes(params: Path) -> int:
    """Bytes in the files under `params`, refusing links to directories and anything but regular files."""
    total, count = 0, 0
    for root, dirs, files in os.walk(params, onerror=_walk_error):
        for name in dirs:
            if os.path.islink(os.path.join(root, name)):
                raise OutputError(f"{os.path.join(root, name)}: a symbolic link to a directory; port writes none")
        for name in files:
            path = os.path.join(root, name)
            count += 1
            if count > MAX_PARAMS_FILES:
                raise OutputError(f"{params}: more than {MAX_PARAMS_FILES} files; not an output port wrote")
            try:
                info = os.stat(path)
            except OSError as e:
                raise OutputError(f"{path}: cannot be read ({e.strerror})") from None
            if not stat.S_ISREG(info.st_mode):
                raise OutputError(f"{path}: not a regular file")
            total += info.st_size
    return total


def _walk_error(error: OSError) -> None:
    raise OutputError(f"{error.filename}: cannot be read ({error.strerror})")


def _check_sizes(output: Output, stored_bytes: int) -> None:
    """The arrays `port/metadata` declares fit in the bytes `params/` stores (uncompressed, as save writes them)."""
    declared = sum(leaf.size * leaf.dtype.itemsize for leaf in output.leaves.values())
    if declared > stored_bytes + INLINE_SLACK_BYTES:
        raise OutputError(
            f"{output.where}: declares {declared} bytes of arrays but {output.params} holds only "
            f"{stored_bytes} bytes of files"
        )


def _check_config(output: Output) -> None:
    """No integer in the config exceeds the values the output holds (or 2**20): bounds what building the model costs."""
    limit = max(sum(leaf.size for leaf in output.leaves.values()), CONFIG_INT_FLOOR)
    todo: list[tuple[str, Any]] = [("", output.config)]
    while todo:
        name, value = todo.pop()
        if isinstance(value, dict):
            todo.extend((f"{name}.{k}" if name else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            todo.extend((f"{name}[{i}]", v) for i, v in enumerate(value))
        elif type(value) is int and abs(value) > limit:
            raise OutputError(
                f"{output.where}: config {quoted(name)} is {quoted(value, 30)}, more than the {limit} "
                "values the output holds"
            )


def _build(cls: type, output: Output) -> Any:
    """The skeleton of `cls` built from the output's config (shapes and dtypes, no memory)."""
    try:
        return skeleton(cls, output.config)
    except PortError as e:
        raise OutputError(f"{output.where}: config: {one_line(str(e)).removeprefix('config.json: ')}") from None
    except Exception as e:  # jax or the model on values it does not expect
        reason = one_line((str(e).strip().splitlines() or [""])[0], 200)
        raise OutputError(
            f"{output.where}: config: {cls.__qualname__} cannot be built from it ({type(e).__name__}: {reason})"
        ) from None


def _check_skeleton(skel: Any, output: Output, cls: type) -> list[str]:
    """Every leaf of `port/metadata` is a skeleton leaf of the same shape and kind of dtype; returns
    the skeleton's leaves the output lacks, each an optional mapping entry's or one its `include`
    left out (set to None)."""
    name = cls.__qualname__
    targets = {p: leaf for p, leaf in leaves(skel).items() if hasattr(leaf, "shape")}
    for path, leaf in output.leaves.items():
        target = targets.get(path)
        if target is None:
            raise OutputError(f"{output.where}: leaf '{path}' is not a leaf of {name} built from its config")
        if tuple(target.shape) != leaf.shape or floating(target.dtype) != floating(leaf.dtype):
            raise OutputError(
                f"{output.where}: leaf '{path}' is {leaf} but {describe(target.shape, target.dtype)} in "
                f"{name} built from its config"
            )
    optional = {p.path for p in output.mapping.params if p.key_optional}
    absent = [path for path in targets if path not in output.leaves]
    for path in absent:
        if path not in optional and selects(path, output.include):
            raise OutputError(
                f"{output.where}: leaf '{path}' of {name} built from its config is missing, and the "
                "mapping does not mark it optional"
            )
    return absent




def _kvstore(params: Path, path: str = "") -> dict[str, Any]:
    """The TensorStore spec of the OCDBT database in `params` (at `path` inside it)."""
    return {
        "driver": "ocdbt",
        "base": {"driver": "file", "path": f"{params}/"},
        "cache_pool": "cache_pool#ocdbt",
        "config": {"max_decoded_node_bytes": MAX_NODE_BYTES},
        "path": path,
    }


def _reason(error: Exception) -> str:
    """TensorStore's message, its first line without the spec it appends."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return one_line(re.split(r" \[(?:tensorstore_spec|source locations)", text)[0], 300)


def _open_arrays(output: Output) -> dict[str, Any]:
    """Every leaf's stored array (a TensorStore), its metadata checked; reads no array data."""
    import tensorstore as ts

    context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}})  # tree nodes, shared
    return {path: _open_array(output, leaf, context) for path, leaf in output.leaves.items()}


def _open_array(output: Output, leaf: Leaf, context: Any) -> Any:
    """Open the stored array of `leaf`, checking its metadata against `port/metadata`."""
    import tensorstore as ts

    spec = {
        "driver": "zarr",
        "kvstore": _kvstore(output.params, f"{leaf.path}/"),
        "fill_missing_data_reads": False,  # a missing chunk is an error, never zeros
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
    }
    where = f"{output.params}: leaf '{leaf.path}'"
    try:
        store = ts.open(spec, open=True, read=True, context=context).result()
        metadata = store.spec().to_json().get("metadata", {})
        dtype = np.dtype(store.dtype.numpy_dtype)
    except Exception as e:  # tensorstore reports every failure as ValueError
        raise OutputError(f"{where}: cannot be opened ({_reason(e)})") from None
    if tuple(store.shape) != leaf.shape or dtype != leaf.dtype:
        raise OutputError(f"{where}: stored as {describe(store.shape, dtype)} but port/metadata says {leaf}")
    if metadata.get("compressor") is not None or metadata.get("filters") is not None:
        raise OutputError(f"{where}: stored compressed or filtered; port stores arrays uncompressed")
    return store


def _read_arrays(output: Output, stores: AnyMapping[str, Any], mesh: Mesh) -> Iterator[tuple[str, jax.Array]]:
    """Each leaf under its `NamedSharding` on `mesh`, every distinct device block read once.

    Reads run ahead of placement by up to `READ_AHEAD_BYTES` of host memory; a failed
    read cancels those still running.
    """
    pending: deque[tuple[Leaf, NamedSharding, dict, int]] = deque()
    in_flight = 0
    try:
        for path, leaf in output.leaves.items():
            spec, _ = partition(leaf.shape, leaf.axes, output.mapping.rules, mesh.shape)
            sharding = NamedSharding(mesh, spec)
            reads, nbytes = {}, 0
            for index in sharding.addressable_devices_indices_map(leaf.shape).values():
                box = _box(index, leaf.shape)
                if box not in reads:
                    reads[box] = stores[path][tuple(slice(a, b) for a, b in box)].read()
                    nbytes += math.prod(b - a for a, b in box) * leaf.dtype.itemsize
            pending.append((leaf, sharding, reads, nbytes))
            in_flight += nbytes
            while in_flight > READ_AHEAD_BYTES and pending:
                in_flight -= pending[0][3]
                yield _place(output, *pending.popleft()[:3])
        while pending:
            yield _place(output, *pending.popleft()[:3])
    finally:
        for _, _, reads, _ in pending:
            for future in reads.values():
                future.cancel()


def _place(output: Output, leaf: Leaf, sharding: NamedSharding, reads: dict) -> tuple[str, jax.Array]:
    """The leaf's `jax.Array` from its blocks' reads: each device gets its block."""
    try:
        blocks = {box: future.result() for box, future in reads.items()}
    except Exception as e:  # tensorstore reports every failure as ValueError
        for future in reads.values():
            future.cancel()
        raise OutputError(f"{output.params}: leaf '{leaf.path}': cannot be read ({_reason(e)})") from None
    arrays = [
        jax.device_put(blocks[_box(index, leaf.shape)], device)
        for device, index in sharding.addressable_devices_indices_map(leaf.shape).items()
    ]
    return leaf.path, jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)
