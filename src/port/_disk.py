"""Disk: bytes written at their offsets, the kernel asked to write them to disk as they go.

Both of port's writers (save's chunk files, export's safetensors files) write large
files with positioned writes and flush them before their directory is renamed into
place. Left alone, the pages wait in the page cache until that final flush, which then
writes everything while nothing else happens; so each 64 MB written is handed to the
kernel to write at once (Linux's `sync_file_range`; elsewhere the flush does the work).

```python
pwrite_all(fd, memoryview(data), offset)                 # all of it, however many writes
pwrite_rows(fd, [(offset, row), (offset + stride, row)])  # a box's rows, each at its offset
write_new(path, data)                                    # a new file, flushed
sync_directory(path.parent)                              # its entry too
```
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable
from pathlib import Path

from ._files import libc_function

_CHUNK = 64 << 20
"""Bytes one pwrite is asked for: far below every platform's limit on one call, and the
unit after which writing to disk is started (`_start_writeback`)."""

_SYNC_FILE_RANGE = libc_function(  # Linux's; None elsewhere (macOS)
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
)
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writing the range's dirty pages, without waiting
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing `nbytes` at `offset` to disk now, and return at once.

    Without it the pages wait in the page cache until the final `fdatasync`, which then
    writes the whole file while nothing else happens (about a third of an export's time
    on the development machine). Advisory: where it is not available, or fails, the
    final flush does the work.
    """
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """All of `data` at `offset`, however many writes it takes, each 64 MB's writeback
    started as it is written (`_start_writeback`); raises `OSError`."""
    done = 0
    while done < len(data):
        wrote = os.pwrite(fd, data[done : done + _CHUNK], offset + done)
        if wrote <= 0:
            raise OSError(errno.EIO, "the file system wrote nothing")
        _start_writeback(fd, offset + done, wrote)
        done += wrote


def pwrite_rows(fd: int, rows: Iterable[tuple[int, memoryview]]) -> None:
    """Each `(offset, row)` written at its offset (a box of a tensor: one run of bytes per row),
    writeback started for each 64 MB span of the file written; raises `OSError`."""
    first: int | None = None  # the span of the file written since writeback was last started
    last = 0
    for at, row in rows:
        if os.pwrite(fd, row, at) != len(row):  # short: finish it the careful way
            pwrite_all(fd, memoryview(row), at)
        first, last = at if first is None else min(first, at), max(last, at + len(row))
        if last - first >= _CHUNK:
            _start_writeback(fd, first, last - first)
            first, last = None, 0
    if first is not None and last > first:
        _start_writeback(fd, first, last - first)


def write_new(path: Path, data: bytes | memoryview) -> None:
    """Create `path` (never an existing file, nor through a link) holding `data`, flushed to disk.

    The kernel is asked to start writing each 64 MB to disk as soon as it is written
    (`pwrite_all`), so the final flush finds little left. An `OSError` names `path`.
    """
    try:
        fd = os.open(path, _OPEN_NEW, 0o644)
        try:
            pwrite_all(fd, memoryview(data).cast("B"), 0)
            getattr(os, "fdatasync", os.fsync)(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def sync_directory(path: Path) -> None:
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
