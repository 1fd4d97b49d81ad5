"""Save: one Orbax checkpoint of the sharded parameters and port's metadata, restorable onto any mesh.

The output is an ordinary Orbax composite checkpoint (port's format 3):

```
OUT/
  _CHECKPOINT_METADATA      Orbax: the items and their handlers, timestamps
  commit_success.txt        Orbax: the checkpoint was finalised
  params/                   the arrays, as Orbax's PyTree handler stores them without OCDBT:
    _METADATA                 the tree (each array's path; None leaves), `use_ocdbt: false`
    _sharding                 each array's NamedSharding, for a restore that names none
    blocks.attn.wq/           one zarr array per leaf (see `_zarr`): `.zarray` and a chunk
      .zarray  0.0.0.0 ...    file per block of the mesh it was saved from
  port/metadata             port's metadata, JSON: the format number (3), the mapping's text and where it
  port/commit_success.txt   came from, config.json, and each leaf's shape, dtype and logical axes
```

Stock Orbax restores it without port (`ocp.StandardCheckpointer().restore(OUT / "params")`
gives the arrays as a nested dict, `ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(OUT)`
both items); `restore` rebuilds the module from `port/metadata` and shards it for any mesh.

Port writes these files itself, at the speed of the disk: each device's block is one
chunk file, written by a pool of threads straight from the device's buffer (on CPU,
without a copy), the kernel asked to start writing each 64 MB to disk as it goes, and
every file flushed before the directory is renamed into place. (Orbax's own writer
copied every array to fresh host memory, then wrote through an OCDBT database at a
fraction of the disk's speed: `docs/benchmarks.md`.)

Everything is written into `.OUT.port-partial-TOKEN` beside the target, registered
with the supervisor as it is created, and renamed into place when complete, so a
failed or interrupted save leaves nothing behind; with `force`, an earlier output is
moved aside only at that rename, so until then it stays complete. In a multi-process
run (joined by `port.initialize`) every process calls `save` with the same directory
(on a file system they share): process 0 creates it, each process writes the chunks of
the blocks its devices hold (replica 0 of each), and process 0 writes the metadata
and renames it into place once all have written.

```python
save(model, "out/gpt2", mapping, config)
model = restore("out/gpt2", make_mesh("2x4"))
```
"""

from __future__ import annotations

import base64
import errno
import contextlib
import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import stat
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Mapping as AnyMapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ._console import one_line
from ._errors import OutputError, PortError, RunError
from ._interrupt import final, removing
from ._mapping import Mapping
from ._runtime import exchange, num_processes, run_token
from ._skeleton import path_str
from ._writer import _CHUNK, _start_writeback
from ._zarr import ZARRAY, chunk_count, chunk_name, chunk_shape, zarray

FORMAT = 3
MAX_METADATA_BYTES = 32 << 20  # port/metadata, params/_METADATA: a few hundred KB for real models
STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's names in a checkpoint it finalised
COMMIT_FILE = "commit_success.txt"
PARTS = frozenset({STEP_METADATA, COMMIT_FILE, "params", "port"})  # what `save` writes into an output
PORT_PARTS = frozenset({"metadata", COMMIT_FILE})  # the JSON item `port/` (Orbax's JsonCheckpointHandler)
FORMAT_1_PARTS = frozenset({"port.json", "params"})  # what an earlier port wrote


def _metadata(path: Path) -> Any:
    """The JSON object in `path` if it is a regular file of port's metadata size, else None."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_METADATA_BYTES:  # never a FIFO, nor huge
            return None
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and "format" in meta else None


def is_output(directory: str | os.PathLike) -> bool:
    """Whether `directory` is a port output: exactly the files and directories `save` writes.

    Orbax's `_CHECKPOINT_METADATA` and `commit_success.txt`, the `params/` item, and the
    `port/` item holding `metadata` (a JSON object with a `format`) and `commit_success.txt`;
    or what an earlier port wrote (format 1: `port.json` and `params/`), which `--force`
    may replace too.

    ```python
    is_output("out/gpt2")      # True once `port convert --out out/gpt2` has finished
    ```
    """
    directory = Path(directory)
    params = directory / "params"
    if directory.is_symlink() or not directory.is_dir() or params.is_symlink() or not params.is_dir():
        return False
    try:
        names = {p.name for p in directory.iterdir()}
    except OSError:
        return False
    if names == FORMAT_1_PARTS:
        meta = _metadata(directory / "port.json")
        return meta is not None and meta["format"] == 1
    port = directory / "port"
    if names != PARTS or port.is_symlink() or not port.is_dir():
        return False
    try:
        items = {p.name for p in port.iterdir()}
    except OSError:
        return False
    return items == PORT_PARTS and _metadata(port / "metadata") is not None


_OUTPUT = "a port output (Orbax's checkpoint of params/ and port/ only)"


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def check_out(
    directory: str | os.PathLike,
    force: bool = False,
    inputs: tuple[str | os.PathLike, ...] = (),
    flag: str = "--out",
    ours: Callable[[Path], bool] = is_output,
    what: str = _OUTPUT,
) -> Path:
    """The absolute output path, refusing any target that writing or replacing would harm.

    `force` allows replacing an earlier output of the same kind (`ours`: see
    `is_output`; `port export` passes its own), and nothing else: not a file, a
    symlink, a directory holding anything port did not write, the root, the home or
    working directory or one containing it, nor a directory that is or contains one
    of `inputs` (the checkpoint being read).

    ```python
    check_out("out/gpt2", force=True, inputs=("ckpt/gpt2",))   # Path('/abs/out/gpt2')
    ```
    """
    out = Path(directory).absolute()
    real = out.resolve()
    here, home = Path.cwd().resolve(), Path.home().resolve()
    if real == Path(real.anchor) or real == home or _inside(here, real):
        what = "the root directory" if real == Path(real.anchor) else "your home directory" if real == home else (
            "the working directory" if real == here else "a directory containing the working directory"
        )
        raise OutputError(f"{flag} {out}: is {what}; port writes its output into a new directory")
    for name in inputs:
        source = Path(name).resolve()
        if _inside(source, real):
            what = "is" if source == real else "contains"
            raise OutputError(f"{flag} {out}: {what} the input {name}; choose another directory")
    if out.is_symlink():
        raise OutputError(f"{flag} {out}: is a symbolic link; give the directory itself")
    if out.exists():
        if not out.is_dir():
            raise OutputError(f"{flag} {out}: is a file, not a directory; port will not replace it")
        if not force:
            raise OutputError(f"{flag} {out}: already exists (use --force to replace an earlier port output)")
        if not ours(out):
            raise OutputError(f"{flag} {out}: not {what}; --force replaces only a directory port wrote")
    elif not out.parent.is_dir():
        raise OutputError(f"{flag} {out}: parent directory does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {out}: cannot write in {out.parent} (read-only or not permitted)")
    return out


def _reason(error: BaseException) -> str:
    """What went wrong, briefly: the operating system's words when the error carries its code."""
    text = str(error)
    code = re.search(r"os_error_code='?(\d+)", text)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if code:
        return os.strerror(int(code.group(1)))
    return one_line((text.strip().splitlines() or [type(error).__name__])[0], 200)


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes free for an unprivileged writer on the file system holding `directory`."""
    return shutil.disk_usage(Path(directory).absolute().parent).free


def _remove_if_made(path: Path, made: os.stat_result) -> None:
    """Remove the directory `path` if it is still the one made here (not one put there since it was renamed)."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return
    if (now.st_dev, now.st_ino) == (made.st_dev, made.st_ino):
        shutil.rmtree(path, ignore_errors=True)


def make_partial(partial: Path, cleanup: contextlib.ExitStack) -> None:
    """Create `partial`, the directory a run writes its output into, registered with the supervisor.

    Never an existing directory nor through a symlink (a one-line `OutputError` if
    something is there). When `cleanup` closes, it is removed unless it was renamed into
    place meanwhile: only the directory made here, never one found at that name later.
    An interrupt removes it through the supervisor (`removing`).

    ```python
    with contextlib.ExitStack() as cleanup:
        make_partial(out.parent / f".{out.name}.port-partial-{token}", cleanup)
    ```
    """
    try:
        cleanup.enter_context(removing(partial, create=os.mkdir))
    except FileExistsError:
        raise OutputError(f"{partial}: exists; port writes only into a directory it creates") from None
    cleanup.callback(_remove_if_made, partial, os.lstat(partial))


@contextlib.contextmanager
def replacing(
    directory: Path, force: bool, ours: Callable[[Path], bool] = is_output, what: str = _OUTPUT
) -> Iterator[None]:
    """Around the caller's rename of its finished output to `directory`: the earlier output makes way.

    With `force`, an earlier output there (`check_out` again, with `ours`: still one
    port wrote, as when the run began) is moved aside first, put back if the block
    fails, and removed once the new one is in place. No interrupt is acted on until
    the block is done.

    ```python
    with replacing(out, force):
        os.rename(partial, out)
    ```
    """
    aside = directory.parent / f".{directory.name}.port-old-{secrets.token_hex(4)}"
    with removing(aside):
        with final():
            if force and os.path.lexists(directory):
                check_out(directory, force, ours=ours, what=what)
                os.rename(directory, aside)
            try:
                yield
            finally:
                if os.path.lexists(aside) and not os.path.lexists(directory):
                    os.rename(aside, directory)
        if os.path.lexists(aside):
            shutil.rmtree(aside)


_PYTREE_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
_JSON_HANDLER = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
WORKERS = 4  # threads writing chunk files: enough to keep a disk and the page cache busy
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclasses.dataclass(frozen=True)
class _Stored:
    """One array as the output stores it: its tree path, chunk shape, and this process's chunks to write."""

    path: str
    keys: list[dict[str, Any]]  # Orbax's key_metadata: [{"key": "blocks", "key_type": 2}, ...]
    array: jax.Array
    chunks: tuple[int, ...]
    mine: list[tuple[tuple[int, ...], Any]]  # (chunk index, the shard holding it), replica 0 only

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunks) * self.array.dtype.itemsize


def _key(entry: Any) -> dict[str, Any]:
    """Orbax's metadata of one step of a tree path: a sequence index is key_type 1, any other key 2."""
    if isinstance(entry, jax.tree_util.SequenceKey):
        return {"key": str(entry.idx), "key_type": 1}
    for attr in ("name", "key"):
        if hasattr(entry, attr):
            return {"key": str(getattr(entry, attr)), "key_type": 2}
    return {"key": str(entry), "key_type": 2}


def _stored(model: Any) -> tuple[list[_Stored], list[list[dict[str, Any]]]]:
    """The arrays of `model` as stored (in tree order), and the tree paths of its other leaves (stored as None)."""
    arrays, nones = [], []
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: x is None)
    for keypath, leaf in flat:
        keys = [_key(k) for k in keypath]
        if not isinstance(leaf, jax.Array):
            nones.append(keys)
            continue
        chunks = chunk_shape(leaf.shape, leaf.sharding.shard_shape(leaf.shape))
        mine = []
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0 and leaf.size:
                start = tuple(s.indices(n)[0] for s, n in zip(shard.index, leaf.shape))
                mine.append((tuple(a // c for a, c in zip(start, chunks)), shard))
        arrays.append(_Stored(path_str(keypath), keys, leaf, chunks, mine))
    return arrays, nones


def _sharding_text(array: jax.Array) -> str | None:
    """Orbax's description of a `NamedSharding` (in `params/_sharding`), from which stock Orbax rebuilds it."""
    sharding = array.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    mesh = sharding.mesh
    spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
    return json.dumps({
        "sharding_type": "NamedSharding",
        "shape": list(mesh.devices.shape),
        "axis_names": list(mesh.axis_names),
        "axis_types": [str(t) for t in mesh.axis_types],
        "partition_spec": spec,
        "device_mesh": {"mesh": np.vectorize(lambda d: {"id": d.id}, otypes=[object])(mesh.devices).tolist()},
    })


def _tree_metadata(arrays: list[_Stored], nones: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """`params/_METADATA`: Orbax's PyTree metadata of arrays stored as zarr without OCDBT."""
    tree = {}
    for stored in arrays:
        tree[str(tuple(k["key"] for k in stored.keys))] = {
            "key_metadata": stored.keys,
            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(stored.chunks)},
        }
    for keys in nones:
        tree[str(tuple(k["key"] for k in keys))] = {
            "key_metadata": keys, "value_metadata": {"value_type": "None", "skip_deserialize": True}
        }
    return {
        "tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True, "custom_metadata": None,
    }


def _write_new(path: Path, data: bytes | memoryview) -> None:
    """Create `path` (never an existing file, nor through a link) holding `data`, flushed to disk.

    The kernel is asked to start writing each 64 MB to disk as soon as it is written
    (`_start_writeback`), so the final flush finds little left. An `OSError` names `path`.
    """
    view = memoryview(data).cast("B")
    try:
        fd = os.open(path, _OPEN_NEW, 0o644)
        try:
            done = 0
            while done < len(view):
                wrote = os.pwrite(fd, view[done : done + _CHUNK], done)
                if wrote <= 0:
                    raise OSError(errno.EIO, "the file system wrote nothing")
                _start_writeback(fd, done, wrote)
                done += wrote
            getattr(os, "fdatasync", os.fsync)(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def _sync_directory(path: Path) -> None:
    """Flush `path`'s entries to disk, where the file system can."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the files themselves are flushed
    finally:
        os.close(fd)


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
    _write_new(path, np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
    return data.nbytes


def _write_chunks(
    partial: Path, arrays: list[_Stored], progress: Callable[[int, int], None] | None, workers: int = WORKERS
) -> int:
    """Write this process's chunk files with `workers` threads; returns the bytes written.

    Blocks are handed to the threads in tree order; from an accelerator, at most the
    largest array's bytes of host copies are in flight. `progress(done, total)` is
    called (on this thread) as each chunk is written.
    """
    jobs = [(partial / "params" / s.path / chunk_name(index), shard, s.chunks, s.chunk_bytes)
            for s in arrays for index, shard in s.mine]
    total = sum(job[3] for job in jobs)
    budget = max((s.array.nbytes for s in arrays), default=0)
    done, in_flight = 0, 0
    if progress is not None:
        progress(0, total)
    with ThreadPoolExecutor(workers, thread_name_prefix="port-save") as pool:
        pending: deque[tuple[Future, int]] = deque()

        def finish_oldest() -> None:
            nonlocal done, in_flight
            future, nbytes = pending.popleft()
            done += future.result()
            in_flight -= nbytes
            if progress is not None:
                progress(done, total)

        try:
            for path, shard, chunks, nbytes in jobs:
                host = shard.data.devices().pop().platform != "cpu"
                while pending and (len(pending) >= 4 * workers or host and in_flight + nbytes > budget):
                    finish_oldest()
                pending.append((pool.submit(_write_chunk, path, shard, chunks), nbytes if host else 0))
                in_flight += pending[-1][1]
            while pending:
                finish_oldest()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return done


def _checkpoint_metadata(started: int) -> bytes:
    """`_CHECKPOINT_METADATA`: Orbax's record of a composite checkpoint's items, their handlers and its times."""
    return json.dumps({
        "init_timestamp_nsecs": started,
        "item_handlers": {"params": _PYTREE_HANDLER, "port": _JSON_HANDLER},
        "custom_metadata": {},
        "commit_timestamp_nsecs": time.time_ns(),
    }).encode()


def _commit_text(directory: Path) -> bytes:
    return f"Checkpoint commit was successful to {directory}".encode()


def save(
    model: Any,
    directory: str | os.PathLike,
    mapping: Mapping,
    config: AnyMapping[str, Any],
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
    - `mapping`: the `Mapping` the model was converted with; its text and each leaf's
      logical axes go into `port/metadata`, for `restore` to shard the leaves on a new mesh.
    - `config`: the checkpoint's `config.json`, from which `restore` rebuilds the module.
    - `force`: replace an earlier port output at `directory` (and nothing else, see
      `check_out`); it stays complete until the new output is.
    - `sources`: the checkpoint's tensor headers (`Checkpoint.tensors`), recorded so that
      `port export` can write the same tensors back; `port convert` passes them.
    - `include`: the patterns a partial model was loaded with (its other leaves None),
      recorded so that `restore` accepts the leaves the output lacks.
    - `progress`: called with (bytes this process has written, bytes it writes) as
      writing starts and as each chunk file is written.

    Returns the absolute output path. Raises `OutputError`, one line, when the directory
    may not be written or writing fails (a full disk, a file-size limit); nothing is
    left behind then.

    ```python
    with port.open_checkpoint("ckpt/gpt2") as ckpt:
        model = port.load("ckpt/gpt2", mesh="4x2")
        save(model, "gpt2-jax", port.mapping_for(ckpt.config), ckpt.config)
    ```
    """
    directory = check_out(directory, force)
    me, processes = jax.process_index(), jax.process_count()
    if processes > 1 and num_processes() is None:
        raise RunError("port save in several processes needs the run joined by port.initialize (or port's flags)")
    started = time.time_ns()
    arrays, nones = _stored(eqx.filter(model, lambda leaf: isinstance(leaf, jax.Array)))
    axes = {p.path: p.axes for p in mapping.params}
    meta = {
        "format": FORMAT,
        "mapping_source": mapping.source,
        "mapping": mapping.text,
        "config": dict(config),
        "leaves": {
            s.path: {"shape": list(s.array.shape), "dtype": np.dtype(s.array.dtype).name,
                     "axes": list(axes.get(s.path, ()))}
            for s in arrays
        },
    }
    if include is not None:
        meta["include"] = list(include)
    if sources is not None:
        meta["sources"] = {
            key: {"shape": list(info.shape), "dtype": np.dtype(info.dtype).name} for key, info in sources.items()
        }
    expected = sum(chunk_count(s.array.shape, s.chunks) * s.chunk_bytes for s in arrays if s.array.size)
    partial = directory.parent / f".{directory.name}.port-partial-{run_token()}"
    with contextlib.ExitStack() as cleanup:
        try:
            if me == 0:
                make_partial(partial, cleanup)
                for name in ("params", "port", *(f"params/{s.path}" for s in arrays)):
                    os.mkdir(partial / name)
                for s in arrays:
                    text = json.dumps(zarray(s.array.shape, s.chunks, s.array.dtype))
                    _write_new(partial / "params" / s.path / ZARRAY, text.encode())
            exchange("save-created", "", "word that the output's directories exist")
            wrote = _write_chunks(partial, arrays, progress)
            counts = exchange("save-written", str(wrote), "what it wrote")
            if me == 0:
                if sum(int(n) for n in counts.values()) != expected:
                    raise OutputError(f"--out {directory}: the processes wrote {counts}, not the {expected} bytes laid out")
                sharding = {base64.b64encode(s.path.encode()).decode(): text
                            for s in arrays if (text := _sharding_text(s.array)) is not None}
                files = {
                    "params/_METADATA": json.dumps(_tree_metadata(arrays, nones)).encode(),
                    "params/_sharding": json.dumps(sharding).encode(),
                    "params/" + COMMIT_FILE: _commit_text(partial / "params"),
                    "port/metadata": json.dumps(meta).encode(),
                    "port/" + COMMIT_FILE: _commit_text(partial / "port"),
                    STEP_METADATA: _checkpoint_metadata(started),
                    COMMIT_FILE: _commit_text(directory),
                }
                for name, data in files.items():
                    _write_new(partial / name, data)
                for name in (*(f"params/{s.path}" for s in arrays), "params", "port", ""):
                    _sync_directory(partial / name)
                with replacing(directory, force):
                    try:
                        os.rename(partial, directory)
                    except OSError as e:
                        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                            raise OutputError(f"--out {directory}: another run wrote it meanwhile") from None
                        raise
                _sync_directory(directory.parent)
            exchange("save-done", "", "word that the output is in place")
        except PortError:
            raise
        except OSError as e:
            where = f" ({Path(e.filename).relative_to(partial)})" if e.filename and partial in Path(e.filename).parents else ""
            raise OutputError(f"--out {directory}: writing the checkpoint failed: {_reason(e)}{where}") from None
    return directory
