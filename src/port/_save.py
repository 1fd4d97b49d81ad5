"""Save: an Orbax checkpoint of the sharded parameters, restorable onto any mesh.

The output directory holds `params/` (Orbax `StandardCheckpointer`) and
`port.json` (the mapping text, `config.json`, and each leaf's shape, dtype and
logical axes), so `restore` can rebuild the module and shard it for a new mesh.
It is written beside the target under a hidden name and renamed when complete, so
a failed save leaves no directory behind. In a multi-process run every process
calls `save` with the same directory (on a file system they share), each writes
its own shards, and process 0 finishes the directory.

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
from collections.abc import Mapping as AnyMapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ._distributed import barrier
from ._errors import PortError
from ._interrupt import final, removing
from ._mapping import Mapping
from ._skeleton import leaves

FORMAT = 1


def nest(flat: AnyMapping[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, name = path.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = value
    return tree


PARTS = frozenset({"port.json", "params"})  # what `save` writes into an output directory


def is_output(directory: str | os.PathLike) -> bool:
    """Whether `directory` is a port output: `port.json` (port's metadata) and `params/`, nothing else."""
    directory = Path(directory)
    if directory.is_symlink() or not directory.is_dir():
        return False
    try:
        names = {p.name for p in directory.iterdir()}
        if (directory / "port.json").stat().st_size > 32 << 20:  # more than port's metadata ever holds
            return False
        meta = json.loads((directory / "port.json").read_text())
    except (OSError, ValueError):
        return False
    return names == PARTS and isinstance(meta, dict) and "format" in meta and (directory / "params").is_dir()


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def check_out(
    directory: str | os.PathLike,
    force: bool = False,
    inputs: tuple[str | os.PathLike, ...] = (),
    flag: str = "--out",
) -> Path:
    """The absolute output path, refusing any target that writing or replacing would harm.

    `force` allows replacing an earlier port output (see `is_output`), and nothing
    else: not a file, a symlink, a directory holding anything port did not write,
    the root, the home or working directory or one containing it, nor a directory
    that is or contains one of `inputs` (the checkpoint being read).

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
        raise PortError(f"{flag} {out}: is {what}; port writes its output into a new directory")
    for name in inputs:
        source = Path(name).resolve()
        if _inside(source, real):
            what = "is" if source == real else "contains"
            raise PortError(f"{flag} {out}: {what} the input {name}; choose another directory")
    if out.is_symlink():
        raise PortError(f"{flag} {out}: is a symbolic link; give the directory itself")
    if out.exists():
        if not out.is_dir():
            raise PortError(f"{flag} {out}: is a file, not a directory; port will not replace it")
        if not force:
            raise PortError(f"{flag} {out}: already exists (use --force to replace an earlier port output)")
        if not is_output(out):
            raise PortError(
                f"{flag} {out}: not a port output (port.json and params/ only); --force replaces only "
                "a directory port wrote"
            )
    elif not out.parent.is_dir():
        raise PortError(f"{flag} {out}: parent directory does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise PortError(f"{flag} {out}: cannot write in {out.parent} (read-only or not permitted)")
    return out


def _reason(error: BaseException) -> str:
    """What went wrong, briefly: the operating system's words when the error carries its code."""
    text = str(error)
    code = re.search(r"os_error_code='?(\d+)", text)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if code:
        return os.strerror(int(code.group(1)))
    first = (text.strip().splitlines() or [type(error).__name__])[0]
    return first if len(first) <= 200 else first[:200] + "..."


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes free for an unprivileged writer on the file system holding `directory`."""
    return shutil.disk_usage(Path(directory).absolute().parent).free


def _run_token() -> str:
    """Random hex naming this run's temporary directory; process 0's in a multi-process run."""
    token = np.frombuffer(secrets.token_bytes(8), np.uint32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        token = np.asarray(multihost_utils.broadcast_one_to_all(token))
    return token.astype(">u4").tobytes().hex()


def _replace(directory: Path, written: Path, force: bool) -> None:
    """Move `written` to `directory`; an earlier port output there is removed after the move."""
    old = directory.parent / f".{directory.name}.port-old-{secrets.token_hex(4)}"
    with removing(old):
        with final():
            if os.path.lexists(directory):
                check_out(directory, force)  # still an earlier port output, as when we started
                os.rename(directory, old)
            try:
                os.rename(written, directory)  # fails if another run has put its output there meanwhile
            except OSError as e:
                raise PortError(f"--out {directory}: another run wrote it meanwhile ({e.strerror})") from None
        if os.path.lexists(old):
            shutil.rmtree(old)


def save(
    model: Any,
    directory: str | os.PathLike,
    mapping: Mapping,
    config: AnyMapping[str, Any],
    force: bool = False,
) -> Path:
    """Write the model's arrays with Orbax, plus `port.json`; atomically, by rename."""
    import orbax.checkpoint as ocp

    directory = check_out(directory, force)
    axes = {p.path: p.axes for p in mapping.params}
    arrays = {p: a for p, a in leaves(model).items() if isinstance(a, jax.Array)}
    meta = {
        "format": FORMAT,
        "mapping_source": mapping.source,
        "mapping": mapping.text,
        "config": dict(config),
        "leaves": {
            p: {"shape": list(a.shape), "dtype": np.dtype(a.dtype).name, "axes": list(axes.get(p, ()))}
            for p, a in arrays.items()
        },
    }
    # A new name for each run, the same for every process of a multi-process run:
    # they write one checkpoint.
    tmp = directory.parent / f".{directory.name}.port-partial-{_run_token()}"
    lead = jax.process_index() == 0
    with contextlib.ExitStack() as cleanup:
        if lead:
            try:  # a new directory, never an existing one nor through a symlink
                cleanup.enter_context(removing(tmp, create=os.mkdir))
            except FileExistsError:
                raise PortError(f"{tmp}: exists; port writes only into a directory it creates") from None
            cleanup.callback(shutil.rmtree, tmp, True)
        barrier("port-save-start")
        # No compression: trained weights barely compress, and compressing doubled the
        # host memory of a save; at most 1 GB of arrays in flight to the writer.
        handler = ocp.PyTreeCheckpointHandler(
            use_compression=False, save_concurrent_gb=1, save_device_host_concurrent_gb=1
        )
        try:
            with ocp.Checkpointer(handler) as checkpointer:
                checkpointer.save(tmp / "params", args=ocp.args.PyTreeSave(nest(arrays)))
        except (OSError, ValueError, RuntimeError) as e:  # tensorstore reports I/O errors as ValueError
            raise PortError(f"--out {directory}: writing the checkpoint failed: {_reason(e)}") from None
        barrier("port-save-written")
        if lead:
            (tmp / "port.json").write_text(json.dumps(meta, indent=1))
            _replace(directory, tmp, force)
        barrier("port-save-done")
    return directory
