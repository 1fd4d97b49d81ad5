"""Save: one Orbax checkpoint of the sharded parameters and port's metadata, restorable onto any mesh.

The output is an ordinary Orbax composite checkpoint, laid out as `_layout` says (port's
format 3): `params/` (a zarr array per leaf, a chunk file per device block) and `port/`
(port's metadata: the mapping, config.json, each leaf's shape, dtype and logical axes).
Stock Orbax restores it without port, given a target of the arrays' shapes on the devices
at hand (docs/output-format.md shows it in a one-device process); `restore` rebuilds the
module from `port/metadata` and shards it for any mesh.

Port writes these files itself, at the speed of the disk: each device's block is one
chunk file, written by a pool of threads straight from the device's buffer (on CPU,
without a copy), the kernel asked to start writing each 64 MB to disk as it goes, and
every file flushed before the directory is renamed into place. (Orbax's own writer
copied every array to fresh host memory, then wrote through an OCDBT database at a
fraction of the disk's speed: `docs/benchmarks.md`.)

Everything is written into `.OUT.port-partial-TOKEN` beside the target, registered
with the supervisor as it is created, and renamed into place when complete
(`_destination`), so a failed or interrupted save leaves nothing behind; with `force`,
an earlier output is moved aside only at that rename, so until then it stays complete.
In a multi-process run (joined by `port.initialize`) every process calls `save` with
the same directory (on a file system they share): process 0 creates it, each process
writes the chunks of the blocks its devices hold (replica 0 of each), and process 0
writes the metadata and renames it into place once all have written.

```python
save(model, "out/gpt2", mapping, config)
model = restore("out/gpt2", make_mesh("2x4"))
```
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from collections.abc import Mapping as AnyMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._destination import make_partial, partial_path, put_in_place, writing
from .._disk import sync_directory, write_new
from .._errors import OutputError, PortError, RunError
from .._mapping import Mapping, mapping_for
from .._pipeline import InFlight
from .._runtime import exchange, num_processes
from .._targets import leaves, path_str, target_of
from .._text import quoted, size_text
from ._directory import OUTPUT_KIND, check_out
from ._layout import (
    COMMIT_FILE,
    FORMAT,
    LEAF_PATH,
    MAX_LEAVES,
    MAX_METADATA_BYTES,
    MAX_NOTE_CHARS,
    MAX_SOURCES,
    METADATA,
    PARAMS,
    PORT,
    SHARDING,
    STEP_METADATA,
    TREE_METADATA,
    ZARRAY,
    chunk_count,
    chunk_name,
    chunk_shape,
    grid,
    is_output,
    port_version,
    zarray,
)

_PYTREE_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
_JSON_HANDLER = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
WORKERS = 4  # threads writing chunk files: enough to keep a disk and the page cache busy


def _key(entry: Any) -> dict[str, Any]:
    """Orbax's metadata of one step of a tree path: a sequence index is key_type 1, any other key 2."""
    if isinstance(entry, jax.tree_util.SequenceKey):
        return {"key": str(entry.idx), "key_type": 1}
    for attr in ("name", "key"):
        if hasattr(entry, attr):
            return {"key": str(getattr(entry, attr)), "key_type": 2}
    return {"key": str(entry), "key_type": 2}


def _sharding_text(array: jax.Array) -> str | None:
    """Orbax's description of a `NamedSharding` (in `params/_sharding`), from which stock Orbax rebuilds it."""
    sharding = array.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    mesh = sharding.mesh
    assert isinstance(mesh, jax.sharding.Mesh)  # a placed array's mesh has its devices, not an AbstractMesh
    spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
    return json.dumps(
        {
            "sharding_type": "NamedSharding",
            "shape": list(mesh.devices.shape),
            "axis_names": list(mesh.axis_names),
            "axis_types": [str(t) for t in mesh.axis_types],
            "partition_spec": spec,
            "device_mesh": {"mesh": np.vectorize(lambda d: {"id": d.id}, otypes=[object])(mesh.devices).tolist()},
        }
    )


_Arrays = list[tuple[str, list[dict[str, Any]], jax.Array]]  # (dotted path, Orbax's key metadata, array) per leaf


def _tree_metadata(
    arrays: _Arrays, nones: list[list[dict[str, Any]]], chunks: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """`params/_METADATA`: Orbax's PyTree metadata of arrays stored as zarr without OCDBT."""
    tree = {}
    for path, keys, _ in arrays:
        tree[str(tuple(k["key"] for k in keys))] = {
            "key_metadata": keys,
            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(chunks[path])},
        }
    for keys in nones:
        tree[str(tuple(k["key"] for k in keys))] = {
            "key_metadata": keys,
            "value_metadata": {"value_type": "None", "skip_deserialize": True},
        }
    return {
        "tree_metadata": tree,
        "use_ocdbt": False,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }


def _write_small(path: Path, data: bytes) -> int:
    """`write_new` of a metadata file: no array bytes written (0, for the count)."""
    write_new(path, data)
    return 0


def _write_chunk(path: Path, shard: Any, chunks: tuple[int, ...]) -> int:
    """Write one device's block as its chunk file; returns the bytes written.

    On CPU the block is written from the device's own buffer (NumPy's view of it, no
    copy); from an accelerator it is copied to the host first. A block short of the
    chunk shape (an uneven split's last) is padded, as zarr stores edge chunks.
    """
    data = np.asarray(shard.data)
    if data.shape != chunks:
        padded = np.zeros(chunks, data.dtype)
        padded[tuple(slice(0, n) for n in data.shape)] = data
        data = padded
    write_new(path, np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
    return data.nbytes


def _checkpoint_metadata(started: int) -> bytes:
    """`_CHECKPOINT_METADATA`: Orbax's record of a composite checkpoint's items, their handlers and its times."""
    return json.dumps(
        {
            "init_timestamp_nsecs": started,
            "item_handlers": {PARAMS: _PYTREE_HANDLER, PORT: _JSON_HANDLER},
            "custom_metadata": {},
            "commit_timestamp_nsecs": time.time_ns(),
        }
    ).encode()


def _commit_text(directory: Path) -> bytes:
    return f"Checkpoint commit was successful to {directory}".encode()


class Saving:
    """An output being written: arrays are added as they are made, and the chunk files of
    the blocks this process holds are written meanwhile by a pool of threads; `finish`
    writes the metadata and renames the output into place.

    Leaving the block without `finish` (an error, an interrupt) cancels the writes not
    yet started, waits for the others and removes the partial output. Every process
    of a multi-process run makes one, adds every array (each writes only replica 0 of
    the blocks its devices hold) and finishes it.

    ```python
    with Saving(check_out("out/gpt2"), progress=print) as saving:
        for path, array in port.place(recipe, ckpt, mesh).items():
            saving.add(path, array)
        saving.finish(model, mapping, config)
    ```

    **Arguments:**

    - `directory`: the output, as `check_out` returned it.
    - `force`: at `finish`, replace an earlier port output there (see `put_in_place`).
    - `progress`: called with (bytes written, bytes to write so far) as each chunk file is
      written, on the thread that adds or finishes; `leaves_written` counts the leaves done.
    - `workers`: threads writing chunk files.
    - `name`: the caller's parameter naming the output, as messages name it (`out=...: ...`).
    """

    def __init__(
        self,
        directory: Path,
        force: bool = False,
        progress: Callable[[int, int], None] | None = None,
        workers: int = WORKERS,
        name: str = "out",
    ):
        self.directory, self.force, self.progress, self.name = directory, force, progress, name
        self.me, self.processes = jax.process_index(), jax.process_count()
        if self.processes > 1 and num_processes() is None:
            raise RunError("port save in several processes needs the run joined by port.initialize (or port's flags)")
        self.partial = partial_path(directory)
        self.started = time.time_ns()
        self.written = self.total = self._held = 0
        self.leaves_written = 0  # leaves whose every file this process writes is written
        self._left: dict[str, int] = {}  # files still being written, per leaf
        self._adding: str | None = None  # the leaf `add` is queueing files of (not done before that ends)
        self._budget = 0  # host bytes of accelerator blocks in flight: the largest array added
        self._chunks: dict[str, tuple[int, ...]] = {}
        self._pending: InFlight[tuple[int, str]] = InFlight()  # per file: (host bytes it holds, its leaf)
        self._cleanup = contextlib.ExitStack()
        self._finished = False
        try:
            with self._failing():
                if self.me == 0:
                    make_partial(self.partial, self._cleanup)
                    os.mkdir(self.partial / PARAMS)
                    os.mkdir(self.partial / PORT)
                exchange("save-created", "", "word that the output's directory exists")
        except BaseException:
            self._cleanup.close()
            raise
        self._pool: ThreadPoolExecutor = ThreadPoolExecutor(
            workers, thread_name_prefix="port-save"
        )  # last: __exit__ shuts it

    def _failing(self) -> contextlib.AbstractContextManager[None]:
        """An `OSError` within becomes one `OutputError` line naming the output (and the file, inside it)."""
        return writing(self.directory, self.partial, "the checkpoint", self.name)

    def add(self, path: str, array: jax.Array) -> None:
        """Start writing `array`, the leaf at dotted module path `path`: its `.zarray` (process 0)
        and a chunk file per block this process holds (replica 0), chunked as the array is sharded.
        Raises the error of an earlier write that failed."""
        if not LEAF_PATH.fullmatch(path):
            raise OutputError(f"{self.name}={self.directory}: leaf {quoted(path)} is not named by a dotted module path")
        if path in self._chunks:
            raise ValueError(f"leaf '{path}' added twice")
        chunks = self._chunks[path] = chunk_shape(array.shape, array.sharding.shard_shape(array.shape))
        folder = self.partial / PARAMS / path
        nbytes = math.prod(chunks) * array.dtype.itemsize
        self._budget = max(self._budget, array.nbytes)
        self._left[path], self._adding = 0, path
        with self._failing():
            os.makedirs(folder, exist_ok=True)  # by whichever process comes first
            if self.me == 0:  # written (and flushed) by the pool too: this thread goes on placing
                text = json.dumps(zarray(array.shape, chunks, array.dtype)).encode()
                self._left[path] += 1
                self._pending.add((0, path), self._pool.submit(_write_small, folder / ZARRAY, text))
            for shard in array.addressable_shards if array.size else ():
                if shard.replica_id != 0:
                    continue
                start = tuple(s.indices(n)[0] for s, n in zip(shard.index, array.shape))
                file = folder / chunk_name(tuple(a // c for a, c in zip(start, chunks)))
                host = nbytes if shard.device.platform != "cpu" else 0  # CPU blocks are written without a copy
                while self._pending and (
                    self._pending.oldest_done() or len(self._pending) >= 64 or host and self._held + host > self._budget
                ):
                    self._finish_oldest()
                self.total += nbytes
                self._held += host
                self._left[path] += 1
                self._pending.add((host, path), self._pool.submit(_write_chunk, file, shard, chunks))
        self._adding = None
        if not self._left[path]:  # all written already, or nothing of it is this process's to write
            self.leaves_written += 1

    def _finish_oldest(self) -> None:
        (host, path), (wrote,) = self._pending.finish_oldest()
        self.written += wrote
        self._held -= host
        self._left[path] -= 1
        if not self._left[path] and path != self._adding:
            self.leaves_written += 1
        if self.progress is not None:
            self.progress(self.written, self.total)

    def finish(
        self,
        model: Any,
        mapping: Mapping,
        config: AnyMapping[str, Any],
        sources: AnyMapping[str, Any] | None = None,
        include: Sequence[str] | None = None,
        quantized: AnyMapping[str, str] | None = None,
    ) -> Path:
        """Wait for every chunk, then (process 0, once every process has written its share)
        write the metadata of `model` (whose arrays are exactly those added) and rename
        the output into place. Returns the output's path. `quantized`: how each leaf read
        from a quantized source was stored there, by its path (recorded for `port info`)."""
        with self._failing():
            if self.progress is not None:
                self.progress(self.written, self.total)
            while self._pending:
                self._finish_oldest()
            arrays, nones = _tree(model, set(self._chunks))
            if {path for path, _, _ in arrays} != set(self._chunks):
                raise ValueError("the model's arrays are not the ones added")
            counts = exchange("save-written", str(self.written), "what it wrote")
            if self.me == 0:
                expected = sum(
                    chunk_count(a.shape, self._chunks[p]) * math.prod(self._chunks[p]) * a.dtype.itemsize
                    for p, _, a in arrays
                    if a.size
                )
                if sum(int(n) for n in counts.values()) != expected:
                    raise OutputError(
                        f"{self.name}={self.directory}: the processes wrote {counts}, not the {expected} bytes laid out"
                    )
                self._check_written(arrays)
                annotated = target_of(model).axes(model)
                self._commit(
                    arrays, nones, _metadata_of(arrays, mapping, config, sources, include, quantized, annotated)
                )
            exchange("save-done", "", "word that the output is in place")
        self._finished = True
        return self.directory

    def _check_written(self, arrays: _Arrays) -> None:
        """Process 0, before the metadata: every chunk file of every leaf is in this output's
        directory, a regular file of its chunk's size. What the processes said they wrote is
        not proof: this is what restore will find."""
        for path, _, array in arrays:
            if not array.size:
                continue
            chunks = self._chunks[path]
            size = math.prod(chunks) * array.dtype.itemsize
            names = {chunk_name(index) for index in grid(array.shape, chunks)}
            with os.scandir(self.partial / PARAMS / path) as entries:
                found = {e.name: e for e in entries if e.name != ZARRAY}
            missing = sorted(names - set(found))
            wrong = sorted(
                n
                for n in names & set(found)
                if not found[n].is_file(follow_symlinks=False) or found[n].stat(follow_symlinks=False).st_size != size
            )
            if missing or wrong or len(found) != len(names):
                what = (
                    f"{len(missing)} of its {len(names)} chunk files are missing (first {missing[0]})"
                    if missing
                    else f"chunk file {wrong[0]} is not a regular file of {size} bytes"
                    if wrong
                    else "it holds files that are not its chunks"
                )
                raise OutputError(
                    f"{self.name}={self.directory}: leaf {quoted(path)}: {what}; the output is not complete"
                )

    def _commit(self, arrays: _Arrays, nones: list, meta: dict[str, Any]) -> None:
        """Process 0: the metadata files, every directory flushed, and the rename into place."""
        partial = self.partial
        sharding = {
            base64.b64encode(p.encode()).decode(): text for p, _, a in arrays if (text := _sharding_text(a)) is not None
        }
        files = {
            TREE_METADATA: json.dumps(_tree_metadata(arrays, nones, self._chunks)).encode(),
            SHARDING: json.dumps(sharding).encode(),
            f"{PARAMS}/{COMMIT_FILE}": _commit_text(partial / PARAMS),
            METADATA: json.dumps(meta).encode(),
            f"{PORT}/{COMMIT_FILE}": _commit_text(partial / PORT),
            STEP_METADATA: _checkpoint_metadata(self.started),
            COMMIT_FILE: _commit_text(self.directory),
        }
        _check_readable(f"{self.name}={self.directory}", meta, files[METADATA], files[TREE_METADATA], len(nones))
        list(self._pool.map(lambda item: write_new(partial / item[0], item[1]), files.items()))
        list(self._pool.map(sync_directory, [partial / PARAMS / p for p in self._chunks]))
        for name in (PARAMS, PORT, ""):
            sync_directory(partial / name)
        put_in_place(partial, self.directory, self.force, ours=is_output, what=OUTPUT_KIND, name=self.name)

    def __enter__(self) -> Saving:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        try:
            self._pool.shutdown(wait=True, cancel_futures=not self._finished)
        finally:
            self._cleanup.close()


def _check_readable(output: str, meta: dict[str, Any], port_meta: bytes, tree_meta: bytes, nones: int) -> None:
    """Refuse, before any metadata file is written (the partial output then removed), metadata
    that `restore` would refuse to read back under its bounds, which are these: `port/metadata`
    or `params/_METADATA` over `MAX_METADATA_BYTES`, more than `MAX_SOURCES` source tensors or
    `MAX_LEAVES` leaves. The one line names the `output` (`out=DIR`) and says which file, how large,
    and what in it is large."""
    sources = meta.get("sources") or {}
    for count, bound, what in (
        (len(sources), MAX_SOURCES, "source tensors"),
        (len(meta["leaves"]), MAX_LEAVES, "leaves"),
    ):
        if count > bound:
            raise OutputError(
                f"{output}: port/metadata would record {count} {what}, more than restore "
                f"reads back ({bound} at most); the output is not written"
            )
    counts = {
        "leaves": f"{len(meta['leaves'])} leaves",
        "sources": f"{len(sources)} tensors",
        "include": f"{len(meta.get('include') or ())} patterns",
    }
    for name, data, why in [
        (METADATA, port_meta, lambda: _largest_field(meta, counts)),
        (TREE_METADATA, tree_meta, lambda: f"{len(meta['leaves'])} arrays and {nones} None leaves"),
    ]:
        if len(data) > MAX_METADATA_BYTES:
            raise OutputError(
                f"{output}: {name} would be {len(data)} bytes ({size_text(len(data))}), more than restore "
                f"reads back ({MAX_METADATA_BYTES} at most; {why()}); the output is not written"
            )


def _largest_field(meta: dict[str, Any], counts: dict[str, str]) -> str:
    """What makes `port/metadata` large: its largest field, its size and what it holds."""
    sizes = {name: len(json.dumps(value).encode()) for name, value in meta.items()}
    name = max(sizes, key=sizes.__getitem__)
    held = f", {counts[name]}" if name in counts else ""
    return f"its '{name}' takes {size_text(sizes[name])}{held}"


def _tree(model: Any, added: set[str]) -> tuple[_Arrays, list[list[dict[str, Any]]]]:
    """The arrays of `model` in tree order (dotted path, Orbax's key metadata, array), and the key
    metadata of its other leaves (stored as None). The tree is the model's as its target sees it
    (an NNX module's state); the module's own state that was not `added` (an NNX Rngs' key) is
    left out: its constructor makes it again."""
    arrays, nones = [], []
    target = target_of(model)
    own = set(target.own(model)) - added
    flat, _ = jax.tree_util.tree_flatten_with_path(target.tree(model), is_leaf=lambda x: x is None)
    for keypath, leaf in flat:
        keys, path = [_key(k) for k in keypath], path_str(keypath)
        if path in own:
            continue
        if isinstance(leaf, jax.Array):
            arrays.append((path, keys, leaf))
        else:
            nones.append(keys)
    return arrays, nones


def _axes(mapping: Mapping, path: str, annotated: AnyMapping[str, tuple]) -> tuple[str | None, ...] | None:
    """The logical axes of the leaf at `path`: its mapping entry's, or the module's annotation where the
    entry says `axes = "module"` (None: no entry)."""
    entry = mapping.entry(path)
    if entry is None:
        return None
    if entry.axes is None:
        return annotated.get(path)
    return entry.axes


def _metadata_of(
    arrays: _Arrays,
    mapping: Mapping,
    config: AnyMapping[str, Any],
    sources: AnyMapping[str, Any] | None,
    include: Sequence[str] | None,
    quantized: AnyMapping[str, str] | None = None,
    annotated: AnyMapping[str, tuple] | None = None,
) -> dict[str, Any]:
    """`port/metadata`: the format, the mapping, the config, each leaf's shape, dtype and logical axes
    (and how it was stored, when quantized), the version of port writing it."""
    axes = {path: _axes(mapping, path, annotated or {}) for path, _, _ in arrays}
    meta = {
        "format": FORMAT,
        "mapping_source": mapping.source,
        "mapping": mapping.text,
        "config": dict(config),
        "leaves": {
            path: {
                "shape": list(a.shape),
                "dtype": np.dtype(a.dtype).name,
                "axes": list(axes[path] or (None,) * a.ndim),
            }
            | ({"quantized": quantized[path][:MAX_NOTE_CHARS]} if quantized and path in quantized else {})
            for path, _, a in arrays
        },
        "port_version": port_version(),
    }
    if include is not None:
        meta["include"] = list(include)
    if sources is not None:
        meta["sources"] = {  # the dtype a tensor loads as (a quantized one's: the checkpoint's), as export writes it
            key: {"shape": list(info.shape), "dtype": np.dtype(getattr(info, "load_dtype", info.dtype)).name}
            for key, info in sources.items()
        }
    return meta


def save(
    model: Any,
    directory: str | os.PathLike,
    mapping: Mapping | str | os.PathLike | None = None,
    config: AnyMapping[str, Any] | None = None,
    force: bool = False,
    sources: AnyMapping[str, Any] | None = None,
    include: Sequence[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write `model`'s arrays and port's metadata as one Orbax checkpoint, atomically.

    **Arguments:**

    - `model`: the module whose `jax.Array` leaves are saved (sharded as they are; each
      process writes its own shards).
    - `directory`: the output, a directory `save` creates (see the layout above).
    - `mapping`: the `Mapping` the model was converted with (or a mapping file); its text
      and each leaf's logical axes go into `port/metadata`, for `restore` to shard the
      leaves on a new mesh. Default: the shipped one for `config` (as `mapping_for` picks
      it for the model's class): a model built from scratch needs only its config.
    - `config`: the checkpoint's `config.json` (a model built from scratch: the config it
      was built from), from which `restore` rebuilds the module; required.
    - `force`: replace an earlier port output at `directory` (and nothing else, see
      `check_out`); it stays complete until the new output is.
    - `sources`: the checkpoint's tensor headers (`Checkpoint.tensors`), recorded so that
      `port export` can write the same tensors back; `port convert` passes those its plan
      reads (`written_back`), the ones export writes. At most `MAX_SOURCES`.
    - `include`: the patterns a partial model was loaded with (its other leaves None),
      recorded so that `restore` accepts the leaves the output lacks.
    - `progress`: called with (bytes this process has written, bytes it writes) as
      writing starts and as each chunk file is written.

    Returns the absolute output path. Raises `OutputError`, one line, when the directory
    may not be written, writing fails (a full disk, a file-size limit), or the metadata
    would pass the bounds `restore` reads back (`MAX_METADATA_BYTES`, `MAX_SOURCES`, `MAX_LEAVES`);
    nothing is left behind then.

    ```python
    with port.open_checkpoint("ckpt/gpt2") as ckpt:
        model = port.load("ckpt/gpt2", mesh="4x2")
        save(model, "gpt2-jax", port.mapping_for(ckpt.config), ckpt.config)
    save(Llama.from_config(config, key=jax.random.key(0)), "llama-jax", config=config)  # from scratch
    ```

    An output saved without `sources` (a model built from scratch) exports all the same:
    `port export` derives the tensors from the mapping, the config and the leaves.
    """
    if config is None:
        raise PortError("`config`: save needs the config.json the model is built from (config=...)")
    mapping = mapping_for(config, mapping, built=type(model))
    directory = check_out(directory, force, name="directory")
    with Saving(directory, force, progress, name="directory") as saving:
        own = target_of(model).own(model)
        for path, array in leaves(model).items():
            if isinstance(array, jax.Array) and (path not in own or mapping.entry(path) is not None):
                saving.add(path, array)
        return saving.finish(model, mapping, config, sources, include)
