"""Restore: a `port convert` output onto any mesh, each device reading its region.

An output (see `_layout`: Orbax's composite checkpoint of `params/`, the arrays as
zarr chunk files, and `port/metadata`, port's JSON) is untrusted: it may come
from anywhere. `restore` makes no Orbax call and imports no module an output names
except port's own models (`port.models.*`), unless the caller passes the class; it
checks everything before reading an array: `port/metadata` field by field (`_read`), the arrays
`params/_METADATA` declares against it, each array's `.zarray` against its leaf, every
chunk file's size against its chunk (so every byte declared is on disk before anything
is built or allocated), and the module's skeleton built from its config against every
leaf. Then each distinct block of this process's devices is read with positioned reads
(`Checkpoint.read_into`, as `place` reads a safetensors file) from only the chunk bytes
it covers, straight into the block's memory, which the device adopts. Every file read
is a regular file inside the output, reached with no symbolic link below its directory
followed (`open_regular(..., output=...)`): a link in a tampered output cannot make
restore, or `port export` after it, read a file from elsewhere. Every problem is one
`OutputError` line naming the directory, file and leaf.

```python
model = restore("out/gpt2", "2x4")
model = restore("out/mine", "2x4", model=MyModel)   # a module of your own
```
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pkgutil
from collections.abc import Iterator, Sequence
from collections.abc import Mapping as AnyMapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._dtypes import floating
from .._errors import OutputError, PortError
from .._fill import fill
from .._mapping import import_object
from .._memory import check_host_memory
from .._meshes import mesh_spec
from .._model import is_buildable, is_model
from .._pipeline import ReadAhead
from .._place import aligned_empty, assemble
from .._place import boxes as _boxes
from .._plan import check_include, partition, selects
from .._runtime import as_mesh, as_shape
from .._skeleton import own_state, skeleton
from .._sources import Checkpoint, LocalCheckpoint, Region, TensorInfo
from .._targets import target_of
from .._text import one_line, quoted
from ._layout import (
    LEAF_PATH,
    MAX_PARAMS_FILES,
    TREE_METADATA,
    ZARR_DTYPES,
    ZARRAY,
    chunk_count,
    chunk_name,
    grid,
    overlapping,
)
from ._read import Leaf, Output, describe, read_json, read_output, regular_file, require_directory

CONFIG_INT_FLOOR = 1 << 20  # config integers up to this are always accepted
READ_AHEAD_BYTES = 1 << 30  # host bytes of blocks read but not yet on their devices
_SHIPPED = "port.models"


def restore(
    directory: str | os.PathLike | Output,
    mesh: Mesh | str | None = None,
    *,
    model: type | None = None,
    include: Sequence[str] | None = None,
) -> Any:
    """Load a `port convert` output onto `mesh`, which may differ from the one it was written with.

    **Arguments:**

    - `directory`: the output, as `port convert` or `save` wrote it (format 3: Orbax's
      checkpoint of `params/`, zarr chunk files, and `port/`). An output of any other
      format is refused. Or the `Output` `read_output` read from it (its metadata is
      then not read again).
    - `mesh`: a `Mesh` or a spec such as `"2x4"`, as for `load` (default: one device).
    - `model`: the module to build: a class with `from_config(config, *, key)`, a Flax NNX
      module class, or a factory function (`build(config)`), as a mapping's `model` names. Without
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
    needs no array data runs before the first array is read, each chunk file's size
    among them; a chunk changed or cut short after that is found when it is read.

    ```python
    model = restore("gpt2-jax", "2x4")
    model = restore("mine-jax", port.make_mesh("4x2"), model=MyModel)
    embeddings = restore("gpt2-jax", include=["wte", "wpe"])     # everything else None
    ```
    """
    mesh = as_mesh(mesh)
    if model is not None and not is_buildable(model):
        raise PortError(
            f"`model`: expected a class with from_config(config, *, key), got {quoted(model)} "
            "(or a Flax NNX module class, or a factory function)"
        )
    output = directory if isinstance(directory, Output) else read_output(directory)
    cls = model_class(output, model)
    placement = restore_plan(output, mesh)  # every rule's mesh axis exists; each leaf's spec
    _check_stored(output)
    chunks, checkpoint = _open_arrays(output)  # every declared byte is in a file of the output
    _check_config(output)
    skel = _build(cls, output)
    from .._adapters._kept import restored_skeleton  # an output of a model with an adapter kept: its LoRA nodes

    skel = restored_skeleton(skel, output.config, output.leaves, output.where)
    absent = _check_skeleton(skel, output, cls)
    if include is not None:
        check_include(output.leaves, include, f"the output {output.directory}")
        chosen = {p: leaf for p, leaf in output.leaves.items() if selects(p, include)}
        absent += [path for path in output.leaves if path not in chosen]
        output = dataclasses.replace(output, leaves=chosen)
    specs = {leaf.path: leaf.spec for leaf in placement.leaves if leaf.path in output.leaves}
    device_bytes = sum(leaf.device_bytes for leaf in placement.leaves if leaf.path in output.leaves)
    check_host_memory(device_bytes, mesh, f"mesh {mesh_spec(dict(mesh.shape))}")
    arrays = dict(_read_arrays(output, chunks, checkpoint, mesh, specs))
    own = [path for path in target_of(skel).own(skel) if path not in output.leaves and path in absent]
    state = (
        own_state(cls, output.mapping.model_config(output.config), own, NamedSharding(mesh, PartitionSpec()))
        if own
        else {}
    )
    return fill(skel, arrays | {path: None for path in absent if path not in state} | state)


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
    """Where one leaf of an output lands on a mesh: its `PartitionSpec` (its logical axes through
    the output's mapping rules), why a dimension is replicated (`notes`), and its bytes on each device."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str | None, ...]
    spec: PartitionSpec
    notes: tuple[str, ...]
    device_bytes: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """How `restore` lays an output out on a mesh: one `LeafPlacement` per leaf it holds, in its order.

    `absent` lists the optional leaves of its mapping the output lacks (None once restored),
    `excluded` those a partial output (`include`) left out.
    """

    output: Output
    mesh_shape: dict[str, int]
    leaves: tuple[LeafPlacement, ...]
    absent: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()

    @property
    def params(self) -> int:
        return sum(leaf.size for leaf in self.leaves)

    @property
    def device_bytes(self) -> int:
        """Bytes each device holds once every leaf is restored (shards are equal in size)."""
        return sum(leaf.device_bytes for leaf in self.leaves)

    @property
    def read_bytes(self) -> int:
        """Bytes read from the output: each distinct block once, so every array byte once (in one process)."""
        return sum(leaf.nbytes for leaf in self.leaves)


def restore_plan(
    output: Output | str | os.PathLike, mesh: Mesh | str | AnyMapping[str, int] | None = None
) -> RestorePlan:
    """How `restore` would lay the output out on `mesh`, from its checked metadata alone: no array
    is read, no module imported, no device needed (`port plan DIR --mesh 2x4` prints it).

    **Arguments:**

    - `output`: an output directory, or one `read_output` has read.
    - `mesh`: a `Mesh`, a spec such as `"2x4"`, or axis sizes such as `{"data": 2, "model": 4}`
      (default: one device).

    **Returns:** a `RestorePlan`: each leaf's `LeafPlacement` (its `PartitionSpec`, notes on
    what is replicated, bytes per device) and the totals. Raises `OutputError` when the
    output's mapping rules name a mesh axis `mesh` does not have (its leaves cannot be
    placed on it).

    ```python
    plan = port.restore_plan("gpt2-jax", "2x4")
    plan.leaves[0].spec       # PartitionSpec(None, 'data'): vocab 50257 not divisible by model=4
    plan.device_bytes         # bytes each device holds once restored
    ```
    """
    if not isinstance(output, Output):
        output = read_output(output)
    shape = as_shape(mesh)
    for axis, names in output.mapping.rules.items():
        for name in names:
            if name not in shape:
                raise OutputError(
                    f"{output.where}: mapping rules.{axis} names mesh axis {quoted(name)}, which the mesh "
                    f"({', '.join(shape)}) does not have"
                )
    placed = []
    for leaf in output.leaves.values():
        spec, notes = partition(leaf.shape, leaf.axes, output.mapping.rules, shape)
        block = [n // _devices(entry, shape) for n, entry in zip(leaf.shape, tuple(spec) + (None,) * len(leaf.shape))]
        placed.append(
            LeafPlacement(
                leaf.path, leaf.shape, leaf.dtype, leaf.axes, spec, notes, math.prod(block) * leaf.dtype.itemsize
            )
        )
    missing = [
        p for p in dict.fromkeys(p.path for p in output.mapping.params if not p.path_stack) if p not in output.leaves
    ]
    absent = tuple(
        p.path
        for p in output.mapping.params
        if p.key_optional and p.path in missing and selects(p.path, output.include)
    )
    excluded = tuple(p for p in missing if not selects(p, output.include))
    return RestorePlan(output, shape, tuple(placed), tuple(dict.fromkeys(absent)), excluded)


def _devices(entry: Any, shape: AnyMapping[str, int]) -> int:
    """How many devices a `PartitionSpec` entry splits its dimension over."""
    if entry is None:
        return 1
    return math.prod(shape[name] for name in (entry if isinstance(entry, tuple) else (entry,)))


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
            f"imports no other module an output names; name the class: `port export DIR --module {quoted(spec)[1:-1]}` "
            "on the command line, port.restore(directory, mesh, model=YourModel) in Python"
        )
    cls = import_object(spec, f"{output.where}: model")
    if not is_model(cls):
        raise OutputError(f"{output.where}: model {quoted(spec)} is not a model class")
    return cls


def _shipped_modules() -> set[str]:
    """The public modules of `port.models`, found without importing any."""
    import port.models

    return {m.name for m in pkgutil.iter_modules(port.models.__path__) if not m.name.startswith("_")}


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
        return skeleton(cls, output.mapping.model_config(output.config))
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
    target = target_of(skel)
    own = target.own(skel)
    targets = {p: leaf for p, leaf in target.leaves(skel).items() if hasattr(leaf, "shape")}
    for path, leaf in output.leaves.items():
        target = targets.get(path)
        if target is None:
            raise OutputError(f"{output.where}: leaf '{path}' is not a leaf of {name} built from its config")
        if tuple(target.shape) != leaf.shape or floating(target.dtype) != floating(leaf.dtype):
            raise OutputError(
                f"{output.where}: leaf '{path}' is {leaf} but {describe(target.shape, target.dtype)} in "
                f"{name} built from its config"
            )
    absent = [path for path in targets if path not in output.leaves]
    for path in absent:
        entry = output.mapping.entry(path)
        if entry is None and path in own:  # the module's own state (an NNX Rngs): its constructor makes it
            continue
        if not (entry is not None and entry.key_optional) and selects(path, output.include):
            raise OutputError(
                f"{output.where}: leaf '{path}' of {name} built from its config is missing, and the "
                "mapping does not mark it optional"
            )
    return absent


def _check_stored(output: Output) -> None:
    """The arrays `params/_METADATA` declares, which must be exactly `port/metadata`'s leaves."""
    params = output.params
    require_directory(params, "an incomplete port output")
    where = f"{output.directory}/{TREE_METADATA}"
    meta = read_json(output.directory, output.directory / TREE_METADATA, "Orbax's metadata")
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(tree, dict):
        raise OutputError(f"{where}: not Orbax's PyTree metadata (no 'tree_metadata')")
    if meta.get("use_ocdbt") is not False or meta.get("use_zarr3") is not False:
        raise OutputError(f"{where}: arrays not stored as port writes them (zarr chunk files, no OCDBT)")
    stored = set()
    for entry in tree.values():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, dict) and isinstance(k.get("key"), str) for k in keys):
            raise OutputError(f"{where}: an entry without key names")
        path = ".".join(k["key"] for k in keys)
        if not LEAF_PATH.fullmatch(path):
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


def _chunk_shape(output: Output, leaf: Leaf) -> tuple[int, ...]:
    """The chunk shape of `leaf`'s stored array, from its `.zarray`, every field checked against the leaf."""
    folder = output.params / leaf.path
    require_directory(folder, f"leaf '{leaf.path}' of port/metadata")
    where = f"{folder}/{ZARRAY}"
    meta = read_json(output.directory, folder / ZARRAY, "zarr's metadata of the array")
    if not isinstance(meta, dict) or meta.get("zarr_format") != 2 or type(meta.get("zarr_format")) is not int:
        raise OutputError(f"{where}: not zarr format 2 metadata")
    if meta.get("shape") != list(leaf.shape):
        raise OutputError(f"{where}: shape {quoted(meta.get('shape'))} but port/metadata says {leaf}")
    if not isinstance(meta.get("dtype"), str) or ZARR_DTYPES.get(meta["dtype"]) != leaf.dtype:
        raise OutputError(f"{where}: dtype {quoted(meta.get('dtype'))} but port/metadata says {leaf}")
    if meta.get("compressor") is not None or meta.get("filters") is not None:
        raise OutputError(f"{where}: stored compressed or filtered; port stores arrays uncompressed")
    if meta.get("order") != "C" or meta.get("dimension_separator", ".") != ".":
        raise OutputError(f"{where}: not stored in C order with '.'-separated chunk names, as port stores arrays")
    chunks = meta.get("chunks")
    if (
        not isinstance(chunks, list)
        or len(chunks) != len(leaf.shape)
        or not all(type(c) is int and 1 <= c <= max(n, 1) for c, n in zip(chunks, leaf.shape))
    ):
        raise OutputError(f"{where}: chunks {quoted(chunks)} are not a chunk shape for {leaf}")
    return tuple(chunks)


def _open_arrays(output: Output) -> tuple[dict[str, tuple[int, ...]], Checkpoint]:
    """Every leaf's chunk shape, and its chunk files as the tensors of a `Checkpoint` (keyed
    `LEAF/CHUNK`), each found to be a regular file of exactly a chunk's bytes, not a link; reads
    no array data. The checkpoint opens each with no link followed below the output's directory."""
    shapes, tensors = {}, {}
    budget = MAX_PARAMS_FILES
    for path, leaf in output.leaves.items():
        chunks = shapes[path] = _chunk_shape(output, leaf)
        if leaf.size == 0:
            continue
        budget -= chunk_count(leaf.shape, chunks)
        if budget < 0:
            raise OutputError(f"{output.params}: more than {MAX_PARAMS_FILES} chunk files; not an output port wrote")
        nbytes = math.prod(chunks) * leaf.dtype.itemsize
        for index in grid(leaf.shape, chunks):
            file = output.params / path / chunk_name(index)
            info = regular_file(file, f"a chunk of leaf '{path}'", output.directory)
            if info.st_size != nbytes:
                raise OutputError(
                    f"{file}: {info.st_size} bytes, but a chunk of leaf '{path}' ({describe(chunks, leaf.dtype)}) "
                    f"is {nbytes}"
                )
            key = f"{path}/{chunk_name(index)}"
            tensors[key] = TensorInfo(key, file, leaf.dtype, chunks, 0, (info.st_dev, info.st_ino, info.st_size))
    return shapes, LocalCheckpoint(output.params, {}, tensors, output=output.directory)


def _plan_reads(
    path: str, leaf: Leaf, chunks: tuple[int, ...], boxes: list[Region]
) -> tuple[dict[Region, np.ndarray], dict[str, list[tuple[Region, np.ndarray]]]]:
    """The (uninitialised) blocks of `boxes`, and the reads that fill them, by chunk file:
    each overlap of a block and a chunk is read from the chunk straight into its place in
    the block (a view; one run per row where the block is wider than the chunk)."""
    blocks, reads = {}, {}
    for box in boxes:
        block = blocks[box] = aligned_empty(tuple(b - a for a, b in box), leaf.dtype)
        if block.size == 0:
            continue
        for index, region, within in overlapping(box, chunks):
            place = block[tuple(slice(a, b) for a, b in within)]
            reads.setdefault(f"{path}/{chunk_name(index)}", []).append((region, place))
    return blocks, reads


def _read_arrays(
    output: Output,
    chunks: AnyMapping[str, tuple[int, ...]],
    checkpoint: Checkpoint,
    mesh: Mesh,
    specs: AnyMapping[str, PartitionSpec],
) -> Iterator[tuple[str, jax.Array]]:
    """Each leaf under its `NamedSharding` on `mesh`, each distinct block of this process's
    devices read once, from only the chunk bytes it covers, straight into the block's memory
    where the chunk's piece is contiguous there (always, on the mesh it was saved from).

    Reads run ahead of placement by up to `READ_AHEAD_BYTES` of host memory; a failed
    read cancels those not yet started.
    """

    def unit(leaf: Leaf) -> tuple[tuple[Leaf, NamedSharding, dict], list, int]:
        """One leaf's blocks (allocated now) and its reads, one per chunk file."""
        sharding = NamedSharding(mesh, specs[leaf.path])
        blocks, reads = _plan_reads(leaf.path, leaf, chunks[leaf.path], _boxes(leaf.shape, sharding))
        jobs = [
            functools.partial(_read_chunk, output, leaf, checkpoint, key, requests) for key, requests in reads.items()
        ]
        return (leaf, sharding, blocks), jobs, sum(block.nbytes for block in blocks.values())

    with ReadAhead(ahead_bytes=READ_AHEAD_BYTES, name="port-restore") as ahead:
        for leaf, sharding, blocks in ahead.run(unit(leaf) for leaf in output.leaves.values()):
            yield leaf.path, assemble(leaf.shape, sharding, blocks)
            del blocks


def _read_chunk(
    output: Output, leaf: Leaf, checkpoint: Checkpoint, key: str, requests: list[tuple[Region, np.ndarray]]
) -> None:
    """Read the pieces of one chunk file into the blocks of `leaf` they fill; one `OutputError` line naming the leaf."""
    try:
        checkpoint.read_into(key, requests)
    except PortError as e:
        raise OutputError(f"{output.params}: leaf '{leaf.path}': cannot be read ({one_line(str(e), 300)})") from None
