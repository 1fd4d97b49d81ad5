"""Files port is given and does not trust: opened only when regular, never waited on, read bounded.

Every file port reads that someone else wrote (a checkpoint's `config.json`, index,
headers and tensor bytes; an output's metadata and chunks) is opened here: only a
regular file (a FIFO, a device or a directory is refused, never opened), checked again
on the open descriptor, read with positioned reads of an exact length or, whole, only
below a bound checked before a byte is read. The primitives the checkpoint sources,
`restore`'s output reader and the export writer share: `open_regular`, `read_small`
(the one bounded read of a small file), `pread_exact`, `libc_function` and `IOV_MAX`.

```python
fd, st = open_regular(Path("ckpt/model.safetensors"))
first = pread_exact(fd, 8, 0, "model.safetensors")            # exactly 8 bytes, or one error
config = read_small(Path("ckpt/config.json"), 8 << 20, "a config.json")
```
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._errors import CheckpointError, OutputError


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, from its `st_mode`: "a directory", "a FIFO"...

    ```python
    file_kind(os.stat("/dev/null").st_mode)    # 'a character device'
    ```
    """
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "an unknown kind of file")


_READ = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def open_regular(path: Path, name: str | None = None, *, output: Path | None = None) -> tuple[int, os.stat_result]:
    """Open `path` for reading if, and only if, it is a regular file (or a link to one, but with `output`).

    Checked before opening (`stat`, so a FIFO or device is never opened) and again
    on the open descriptor (`fstat`: the same file, still regular). Opened with
    `O_NONBLOCK`, so even a FIFO swapped in between cannot block. Returns the
    descriptor and its `fstat`.

    With `output` (a port output's directory, which holds `path`), no link is followed
    below that directory: each directory from it down to `path` is opened relative to
    the one above with `O_NOFOLLOW | O_DIRECTORY`, and `path` itself with `O_NOFOLLOW`,
    so a link anywhere there (to a file of another user, another output, a device) is
    refused, not read: an `OutputError` naming it. One exception: an output downloaded
    into the Hugging Face cache, whose files are links into its repo's `blobs/`; a link
    there is followed to a file directly in that `blobs/`, and nowhere else. (A
    checkpoint's files may be links anywhere: the cache stores each as one to its blob.)

    ```python
    fd, st = open_regular(Path("ckpt/model.safetensors"))
    fd, st = open_regular(Path("out/params/wte/0.0"), output=Path("out"))   # no link followed below out/
    ```
    """
    name = name or path.name
    if output is not None:
        return _open_below(path, name, output)
    try:
        before = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(before.st_mode):
        raise CheckpointError(f"{name}: not a regular file ({file_kind(before.st_mode)})")
    try:
        fd = os.open(path, _READ)
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read: {e.strerror or e}") from None
    return fd, _same_regular(fd, before, name, CheckpointError)


def _same_regular(fd: int, before: os.stat_result, name: str, error: type[Exception]) -> os.stat_result:
    """The `fstat` of `fd`, if it is still the regular file `before` describes; else `fd` closed and `error` raised."""
    try:
        after = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise error(f"{name}: cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise error(f"{name}: replaced while being opened (now {file_kind(after.st_mode)})")
    return after


def _link_refused(shown: Any, what: str) -> OutputError:
    """The one line refusing a symbolic link found in an output where `what` should be."""
    return OutputError(f"{shown}: a symbolic link, not {what} of the output: refused")


def _open_below(path: Path, name: str, output: Path) -> tuple[int, os.stat_result]:
    """`open_regular(path, name, output=output)`: every step below `output` taken without following a link."""
    try:
        parts = path.relative_to(output).parts
    except ValueError:
        parts = ()
    if not parts or any(part in (".", "..") for part in parts):
        raise OutputError(f"{name}: not a file inside the output {output}")
    try:  # the output itself is the directory the caller named: a link to it is the caller's choice
        fd = os.open(output, _READ | _DIRECTORY)
    except OSError as e:
        raise OutputError(f"{output}: cannot read: {e.strerror or e}") from None
    where = output
    try:
        for part in parts[:-1]:
            where = where / part
            try:
                below = os.open(part, _READ | _DIRECTORY | _NOFOLLOW, dir_fd=fd)
            except OSError as e:
                raise _step_refused(fd, part, where, e) from None
            os.close(fd)
            fd = below
        last = parts[-1]
        try:
            before = os.stat(last, dir_fd=fd, follow_symlinks=False)
        except OSError as e:
            raise OutputError(f"{name}: cannot read: {e.strerror or e}") from None
        if stat.S_ISLNK(before.st_mode):
            blob = hub_blob(output, path)
            if blob is None:
                raise _link_refused(name, "a regular file")
            return _open_blob(blob, name)
        if not stat.S_ISREG(before.st_mode):
            raise OutputError(f"{name}: not a regular file ({file_kind(before.st_mode)})")
        try:
            opened = os.open(last, _READ | _NOFOLLOW, dir_fd=fd)
        except OSError as e:
            if e.errno == errno.ELOOP:  # made a link since the stat above
                raise _link_refused(name, "a regular file") from None
            raise OutputError(f"{name}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    return opened, _same_regular(opened, before, name, OutputError)


def hub_blob(output: Path, path: Path) -> Path | None:
    """Where the link `path` leads, if `output` is (in) a snapshot of the Hugging Face cache
    (`.../models--org--name/snapshots/REV/...`) and the link ends at a file directly in that
    repo's `blobs/`, as the cache stores every downloaded file; None otherwise."""
    real = Path(os.path.realpath(output))
    for snapshot in (real, *real.parents):
        repo = snapshot.parent.parent
        if snapshot.parent.name == "snapshots" and repo.name.startswith(("models--", "datasets--")):
            target = Path(os.path.realpath(path))
            return target if target.parent == repo / "blobs" else None
    return None


def _open_blob(blob: Path, name: str) -> tuple[int, os.stat_result]:
    """Open a blob of the Hugging Face cache (`hub_blob`): a regular file, no link followed."""
    try:
        before = os.stat(blob, follow_symlinks=False)
        if not stat.S_ISREG(before.st_mode):
            raise OutputError(f"{name}: not a regular file ({file_kind(before.st_mode)})")
        opened = os.open(blob, _READ | _NOFOLLOW)
    except OSError as e:
        raise OutputError(f"{name}: cannot read: {e.strerror or e}") from None
    return opened, _same_regular(opened, before, name, OutputError)


def _step_refused(fd: int, part: str, where: Path, error: OSError) -> OutputError:
    """Why the directory `part` (shown as `where`) below the descriptor `fd` could not be
    opened without following a link: a link, not a directory, or the system's reason."""
    try:
        mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        return OutputError(f"{where}: cannot read: {error.strerror or error}")
    if stat.S_ISLNK(mode):
        return _link_refused(where, "a directory")
    if not stat.S_ISDIR(mode):
        return OutputError(f"{where}: not a directory ({'a regular file' if stat.S_ISREG(mode) else file_kind(mode)})")
    return OutputError(f"{where}: cannot read: {error.strerror or error}")


def pread_exact(fd: int, n: int, offset: int, name: str, error: type[Exception] = CheckpointError) -> bytes:
    """Exactly `n` bytes at `offset`, or `error` (by default a CheckpointError) saying the file is shorter.

    ```python
    pread_exact(fd, 8, 0, "model.safetensors")    # the header's length field
    ```
    """
    parts, got = [], 0
    try:
        while got < n:
            chunk = os.pread(fd, min(n - got, 1 << 26), offset + got)
            if not chunk:
                raise error(f"{name}: truncated while reading: ends at byte {offset + got}, {n - got} bytes short")
            parts.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise error(f"{name}: cannot read: {e.strerror or e}") from None
    return b"".join(parts)


def read_small(path: Path, limit: int, what: str, *, output: Path | None = None) -> bytes:
    """The whole of a small regular file, refused unread when larger than `limit` bytes.

    The one bounded read of a small file port is given: a checkpoint's `config.json` and
    shard index, an output's metadata. `what` names the file in the refusal, with its
    article ("a config.json"). With `output` (the port output holding `path`) the file is
    reached as `open_regular` reaches one there, no link followed below it, and every
    refusal is an `OutputError`; else a `CheckpointError`.

    ```python
    read_small(Path("gpt2/config.json"), 8 << 20, "a config.json")          # b'{"n_layer": 12, ...}'
    read_small(out / "port" / "metadata", 32 << 20, "port's metadata", output=out)
    ```
    """
    error = CheckpointError if output is None else OutputError
    fd, st = open_regular(path, str(path), output=output)
    try:
        if st.st_size > limit:
            raise error(f"{path}: {st.st_size} bytes, more than {what} may have ({limit})")
        data = pread_exact(fd, st.st_size, 0, str(path), error)
        if os.pread(fd, 1, st.st_size):  # grew meanwhile: read no more
            raise error(f"{path}: grew while being read")
        return data
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


def libc_function(name: str, argtypes: list, restype: Any = ctypes.c_ssize_t) -> Callable | None:
    """libc's function `name` through ctypes (the GIL released during each call, `errno`
    kept), or None where there is no such libc or the platform's sizes are not 64-bit.

    ```python
    preadv = libc_function("preadv", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64])
    ```
    """
    if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_size_t) != 8:
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return None
    function.argtypes = argtypes
    function.restype = restype
    return function


def _iov_max() -> int:
    """How many buffers one `preadv` may fill (IOV_MAX; 1024 on Linux)."""
    try:
        value = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        value = -1
    return min(value, 1024) if value > 0 else 16


IOV_MAX = _iov_max()
"""How many buffers one `preadv` or `readv` may fill."""
