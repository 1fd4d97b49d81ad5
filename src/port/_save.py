"""Save: one Orbax checkpoint of the sharded parameters and port's metadata, restorable onto any mesh.

The output is an ordinary Orbax composite checkpoint (format 2):

```
OUT/
  _CHECKPOINT_METADATA      Orbax: the items and their handlers, timestamps
  commit_success.txt        Orbax: the checkpoint was finalised
  params/                   the arrays: an Orbax PyTree (zarr in an OCDBT database), nested as the module is
  port/metadata             port's metadata, JSON: the format number (2), the mapping's text and where it
  port/commit_success.txt   came from, config.json, and each leaf's shape, dtype and logical axes
```

Stock Orbax restores it without port (`ocp.StandardCheckpointer().restore(OUT / "params")`
gives the arrays as a nested dict, `ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(OUT)`
both items); `restore` rebuilds the module from `port/metadata` and shards it for any mesh.

Orbax writes the checkpoint into a temporary directory beside the target and renames it
into place when complete (its atomic finalisation). Port names that directory
(`.OUT.port-partial-TOKEN`) and registers it with the supervisor as it creates it, so
a failed or interrupted save leaves nothing behind; with `force`, an earlier output is
moved aside only at that rename, so until then it stays complete. In a multi-process
run every process calls `save` with the same directory (on a file system they share),
each writes its own shards, and process 0 creates and finalises the directory.

```python
save(model, "out/gpt2", mapping, config)
model = restore("out/gpt2", make_mesh("2x4"))
```
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Mapping as AnyMapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ._console import one_line
from ._errors import OutputError, PortError
from ._interrupt import final, removing
from ._mapping import Mapping
from ._runtime import run_token
from ._skeleton import leaves

FORMAT = 2
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


def _temporary_path(directory: Path, force: bool, cleanup: contextlib.ExitStack) -> type:
    """Orbax's temporary-path class for one save to `directory`, as port names, creates and finalises it.

    Orbax's `Checkpointer` asks it for the temporary path (`from_final`), has process 0
    `create` it, writes there, and has process 0 `finalize` it. Here the path is
    `.NAME.port-partial-TOKEN` beside `directory`, the same in every process; `create`
    makes it and registers it with the supervisor in one step (`removing`: nothing is
    there to leave before, and an interrupt from then on removes it); `cleanup` removes
    it if the save fails. `finalize` moves an earlier output aside (only with `force`,
    and only one `check_out` still accepts) within the same `final()` block as Orbax's
    rename, puts it back if the rename fails, and removes it once the new output is in
    place. Orbax's own `force` would delete the earlier output before writing.
    """
    from etils import epath
    from orbax.checkpoint.path import atomicity

    token = run_token()
    partial = directory.parent / f".{directory.name}.port-partial-{token}"

    class PortTemporaryPath(atomicity.AtomicRenameTemporaryPath):
        path = partial

        @classmethod
        def from_final(cls, final_path: Any, **options: Any) -> PortTemporaryPath:
            # Whatever path Orbax was handed (see `save`), the output is `directory`.
            return cls(epath.Path(partial), epath.Path(directory), **options)

        async def create(self) -> Any:
            make_partial(partial, cleanup)
            if self._checkpoint_metadata_store is not None:  # as Orbax's own create
                self._checkpoint_metadata_store.update(
                    file_path=self.get() / STEP_METADATA, init_timestamp_nsecs=time.time_ns()
                )
            return self.get()

        async def finalize(self) -> None:
            with replacing(directory, force):
                try:
                    await super().finalize()  # Orbax's commit file and timestamp, and its rename
                except FileExistsError:
                    raise OutputError(f"--out {directory}: another run wrote it meanwhile") from None

    return PortTemporaryPath


def save(
    model: Any,
    directory: str | os.PathLike,
    mapping: Mapping,
    config: AnyMapping[str, Any],
    force: bool = False,
    sources: AnyMapping[str, Any] | None = None,
    include: Sequence[str] | None = None,
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

    Returns the absolute output path. Raises `OutputError`, one line, when the directory
    may not be written or writing fails (a full disk, a file-size limit); nothing is
    left behind then.

    ```python
    with port.open_checkpoint("ckpt/gpt2") as ckpt:
        model = port.load("ckpt/gpt2", mesh="4x2")
        save(model, "gpt2-jax", port.mapping_for(ckpt.config), ckpt.config)
    ```
    """
    import orbax.checkpoint as ocp

    directory = check_out(directory, force)
    params = eqx.filter(model, lambda leaf: isinstance(leaf, jax.Array))
    axes = {p.path: p.axes for p in mapping.params}
    meta = {
        "format": FORMAT,
        "mapping_source": mapping.source,
        "mapping": mapping.text,
        "config": dict(config),
        "leaves": {
            p: {"shape": list(a.shape), "dtype": np.dtype(a.dtype).name, "axes": list(axes.get(p, ()))}
            for p, a in leaves(params).items()
        },
    }
    if include is not None:
        meta["include"] = list(include)
    if sources is not None:
        meta["sources"] = {
            key: {"shape": list(info.shape), "dtype": np.dtype(info.dtype).name} for key, info in sources.items()
        }
    # No compression: trained weights barely compress, and compressing doubled the
    # host memory of a save; at most 1 GB of arrays in flight to the writer.
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("params", ocp.args.PyTreeSave, ocp.PyTreeCheckpointHandler(
        use_compression=False, save_concurrent_gb=1, save_device_host_concurrent_gb=1
    ))
    registry.add("port", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
    items = ocp.args.Composite(params=ocp.args.PyTreeSave(params), port=ocp.args.JsonSave(meta))
    with contextlib.ExitStack() as cleanup:
        temporary = _temporary_path(directory, force, cleanup)
        try:
            with ocp.Checkpointer(
                ocp.CompositeCheckpointHandler(handler_registry=registry), temporary_path_class=temporary
            ) as checkpointer:
                # Orbax is handed the temporary path to check, not `directory`: it refuses an
                # existing directory, which `force` replaces (in `finalize`, once the new one is complete).
                checkpointer.save(temporary.path, args=items)
        except PortError:
            raise
        except (OSError, ValueError, RuntimeError) as e:  # tensorstore reports I/O errors as ValueError
            raise OutputError(f"--out {directory}: writing the checkpoint failed: {_reason(e)}") from None
    return directory
