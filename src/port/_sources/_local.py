"""A checkpoint in files on this machine, read region by region with positioned reads.

Tensor bytes are read straight into the caller's buffers with `preadv` (libc's,
through ctypes, the GIL released; else `os.preadv`): runs that lie end to end in the
file, within a region or across regions, share one call. A file cut short while it is
read is one `CheckpointError`, never a SIGBUS (nothing is memory-mapped), and each
read checks that the file is still the one whose header was read.

```python
ckpt = LocalCheckpoint(Path("gpt2"), config, tensors)   # as `open_local` makes it
ckpt.read("wte.weight", ((0, 50257), (0, 192)))          # exactly that region
ckpt.bytes_read                                          # 50257 * 192 * 4
```
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import final

import numpy as np

from .._errors import CheckpointError
from .._files import IOV_MAX, libc_function, open_regular
from .._text import quoted
from ._checkpoint import Checkpoint, Region, TensorInfo, check_buffer
from ._ranges import bridge_gaps
from ._runs import batches

HELD_FILES = 1024
"""Files a checkpoint holds open between reads, at most (a 700B checkpoint has about 160 shards);
one of more opens each file at every read."""

_LIBC_PREADV = libc_function("preadv", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64])


def _preadv(fd: int, iov: np.ndarray, offset: int) -> int:
    """One `preadv`: the file's bytes from `offset` on into the buffers of `iov`.

    `iov` is a C-contiguous uint64 array of (address, length) rows, a `struct iovec`
    each; at most IOV_MAX rows. Returns the bytes read (short at the end of file).
    """
    if _LIBC_PREADV is not None:
        while True:
            got = _LIBC_PREADV(fd, iov.__array_interface__["data"][0], len(iov), offset)
            if got >= 0:
                return got
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code))
    buffers = [(ctypes.c_char * int(n)).from_address(int(a)) for a, n in iov]
    return os.preadv(fd, buffers, offset)


def _read_runs(
    fd: int, offsets: np.ndarray, lengths: np.ndarray, addresses: np.ndarray, info: TensorInfo, ratio: float = 1.0
) -> int:
    """Read each run into its address: runs adjacent in the file share one `preadv`, and with
    `ratio` > 1 so do runs with a gap between them read into `SINK` (see `bridge_gaps`).
    Returns the bytes of such gaps read."""
    order = np.argsort(offsets, kind="stable")
    offsets, lengths, addresses = offsets[order], lengths[order], addresses[order]
    over = 0
    if ratio > 1 and len(offsets) > 1:
        offsets, lengths, addresses, gaps = bridge_gaps(offsets, lengths, addresses, ratio)
        over = 0 if gaps is None else int(lengths[gaps].sum())
    iov = np.empty((len(offsets), 2), np.uint64)
    iov[:, 0], iov[:, 1] = addresses, lengths
    # Calls: a new one where a run does not start where the previous ended, and every IOV_MAX runs.
    starts = np.flatnonzero(np.concatenate(([True], offsets[1:] != offsets[:-1] + lengths[:-1])))
    starts = np.unique(np.concatenate([np.arange(a, b, IOV_MAX) for a, b in zip(starts, [*starts[1:], len(offsets)])]))
    wanted = np.add.reduceat(lengths, starts)
    stops = [*starts[1:].tolist(), len(offsets)]
    for first, stop, position, size in zip(starts.tolist(), stops, offsets[starts].tolist(), wanted.tolist()):
        while True:
            try:
                got = _preadv(fd, iov[first:stop], position)
            except OSError as e:
                raise CheckpointError(
                    f"{info.file.name}: cannot read tensor {quoted(info.key, 200)}: {e.strerror or e}"
                ) from None
            if got == size:
                break
            if got == 0:
                raise CheckpointError(
                    f"{info.file.name}: truncated while reading: tensor {quoted(info.key, 200)} ends at byte "
                    f"{info.offset + info.nbytes} but the file now has {os.fstat(fd).st_size} bytes"
                )
            done = np.cumsum(iov[first:stop, 1].astype(np.int64))  # a short read: resume where it stopped
            full = int(np.searchsorted(done, got, side="right"))
            used = got - (int(done[full - 1]) if full else 0)
            first += full
            iov[first, 0] += np.uint64(used)
            iov[first, 1] -= np.uint64(used)
            position, size = position + got, size - got
    return over


@final
@dataclass
class LocalCheckpoint(Checkpoint):
    """A checkpoint in local files: config, tensor headers, and counted positioned reads of regions.

    A checkpoint of at most `HELD_FILES` files (a model's shards) opens each file once, at
    its first read, checks it is the very file whose header was read, and reads it through
    that descriptor until `close`: the file replaced meanwhile is never read, and one cut
    short is a short read, one `CheckpointError`. One of more files (a port output's chunk
    files, as `restore` reads them) opens, checks and closes its file at every read. With
    `output` (a port output's directory) no link is followed below that directory.

    ```python
    with LocalCheckpoint(Path("gpt2"), config, tensors) as ckpt:
        ckpt.read("wte.weight", ((0, 10), (0, 768)))
    ```
    """

    directory: Path
    config: dict
    tensors: dict[str, TensorInfo]
    output: Path | None = None  # a port output's directory (`restore`): no link followed below it
    max_over_read: float = 1.0  # > 1: a gap between runs read through into a sink (`bridge_gaps`)
    bytes_read: int = 0
    bytes_over_read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _held: dict[Path, int] = field(default_factory=dict, repr=False)  # file -> its descriptor, once read
    _holds: bool | None = field(default=None, repr=False)  # whether files are held open (few enough of them)

    def expect(self, reads: Mapping[str, Collection[Region]]) -> None:
        """Nothing to plan: a local file is read region by region as asked."""

    def read_into(self, key: str, requests: Sequence[tuple[Region, np.ndarray]]) -> None:
        """Read regions of tensor `key` into their buffers (see `Checkpoint.read_into`).

        Runs that lie end to end in the file, within a region or across regions (the
        column blocks of a matrix tile its rows), are read by one `preadv` straight
        into their buffers: one copy, few system calls. `bytes_read` counts the
        regions' bytes. A file cut short meanwhile is a CheckpointError.
        """
        info = self.tensors[key]
        for region, out in requests:
            check_buffer(info, region, out)
        total = sum(out.nbytes for _, out in requests)
        if total == 0:
            return
        fd, held = self._descriptor(info)
        over = 0
        try:
            for offsets, lengths, addresses in batches(info, requests):
                over += _read_runs(fd, offsets, lengths, addresses, info, self.max_over_read)
        finally:
            if not held:
                os.close(fd)
        with self._lock:
            self.bytes_read += total
            self.bytes_over_read += over

    def _descriptor(self, info: TensorInfo) -> tuple[int, bool]:
        """A descriptor of `info`'s file (checked: see `_open`), and whether it is held open
        (this checkpoint's, closed by `close`) rather than the caller's to close."""
        if self._holds is None:
            self._holds = self.output is None and len({t.file for t in self.tensors.values()}) <= HELD_FILES
        if not self._holds:
            return _open(info, self.output), False
        assert isinstance(info.file, Path)  # a local checkpoint's tensors live in local files
        with self._lock:
            fd = self._held.get(info.file)
            if fd is None:
                fd = self._held[info.file] = _open(info)
        return fd, True

    def close(self) -> None:
        """Close the files held open (a read after it opens them again)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for fd in held:
            os.close(fd)


def _open(info: TensorInfo, output: Path | None = None) -> int:
    """A descriptor of the file `info` lives in: the very file whose header was read (with
    `output`, reached with no link followed below that directory: see `open_regular`)."""
    assert isinstance(info.file, Path)  # a local checkpoint's tensors live in local files
    fd, st = open_regular(info.file, output=output)
    if info.file_id is not None and (st.st_dev, st.st_ino, st.st_size) != info.file_id:
        os.close(fd)
        change = "truncated" if st.st_size < info.file_id[2] else "changed"
        raise CheckpointError(
            f"{info.file.name}: {change} since port checked it (now {st.st_size} bytes, was {info.file_id[2]})"
        )
    return fd
