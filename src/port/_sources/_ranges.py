"""Byte ranges of a remote file, and the caller's memory their bytes land in.

A remote read is planned as ranges (`plan_ranges`): runs that lie end to end in the
file share one request, none larger than a transport's `chunk`. Each range's bytes
fill its pieces of memory (`iovecs`: (address, length) rows, in file order) as the
answer comes: straight into them, or copied out of a buffer by `scatter`, which
copies the interleaved rows of column blocks as a few strided arrays.

Allowed to over-read (`max_over_read` r > 1), a request also spans the gap between two
stretches when the gap is at most r - 1 times the stretch after it (and `MAX_GAP`): the
gap's bytes are a piece at `SINK`, received and discarded, so a read fetches at most r
times the bytes it needs (each gap is charged to the stretch after it, once).

```python
r = plan_ranges(np.array([0, 8, 32]), np.array([8, 8, 8]), np.array([a, a + 8, b]), 1 << 20)
r.starts, r.stops, r.pieces_of(0)     # [0, 32], [16, 40], the pieces (a, 8), (a + 8, 8)
```
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_MAX_INTERLEAVE = 64  # blocks whose rows alternate in one request that `scatter` copies as strided arrays
MAX_GAP = 2**20
"""Bytes of a gap between two wanted stretches that one request may fetch and discard, at most."""
_SINK = np.empty(MAX_GAP, np.uint8)  # where every discarded gap lands (never read; its pages touched only if used)
SINK: int = _SINK.ctypes.data
"""The address of a piece whose bytes are discarded (a bridged gap's): `MAX_GAP` bytes, shared, never read."""


def memory_at(address: int, length: int) -> memoryview:
    """A writeable byte view of `length` bytes of memory at `address` (a buffer of the caller's).

    ```python
    memory_at(out.ctypes.data, out.nbytes)[:4]   # the first 4 bytes of `out`, writeable
    ```
    """
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


def iovecs(addresses: np.ndarray | Sequence[int], lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """Pieces of memory as one answer fills them, in order: a C-contiguous uint64 array of
    (address, length) rows, a `struct iovec` each (what `readv` takes).

    ```python
    iovecs([out.ctypes.data], [out.nbytes])    # array([[140..., 4096]], dtype=uint64)
    ```
    """
    iov = np.empty((len(addresses), 2), np.uint64)
    iov[:, 0], iov[:, 1] = addresses, lengths
    return iov


def scatter(source: int, pieces: np.ndarray) -> None:
    """Copy the bytes at `source`, in order, to `pieces` (an `iovecs` array).

    The rows of column blocks arrive interleaved (block A's row, block B's row, A's next
    row, ...): equal pieces whose destinations advance by one stride every `k` pieces are
    `k` strided copies, each one numpy assignment of a [rows, length] array, not one call
    per row. Anything else is copied piece by piece.
    """
    if (pieces[:, 0] == SINK).any():  # a bridged gap's bytes are skipped, not copied
        lengths = pieces[:, 1].astype(np.int64)
        body = np.frombuffer(memory_at(source, int(lengths.sum())), np.uint8)
        _scatter_at(body, np.cumsum(lengths) - lengths, pieces)
        return
    n = len(pieces)
    if n > 2:
        addresses, lengths = pieces[:, 0].astype(np.int64), pieces[:, 1]
        length = int(lengths[0])
        k = _interleave(addresses) if (lengths == lengths[0]).all() else None
        if k is not None:
            for r in range(min(k, n)):
                rows = addresses[r::k]
                stride = int(rows[1] - rows[0]) if len(rows) > 1 else length
                target = _strided(int(rows[0]), len(rows), length, stride)
                target[...] = _strided(source + r * length, len(rows), length, k * length)
            return
    for address, size in pieces.tolist():
        ctypes.memmove(address, source, size)
        source += size


def _scatter_at(body: np.ndarray, sources: np.ndarray, pieces: np.ndarray) -> None:
    """Copy piece `i`'s bytes from `body[sources[i]:]` (bytes as uint8), pieces at `SINK` skipped.

    Equal pieces (one process's rows of its column blocks) are gathered into one contiguous
    array first (a row a copy, inside numpy), then copied out as `scatter` copies them
    (strided where the rows interleave); others one by one.
    """
    kept = pieces[:, 0] != SINK
    if not kept.all():
        sources, pieces = sources[kept], pieces[kept]
    lengths = pieces[:, 1].astype(np.int64)
    if len(pieces) > 2 and (lengths == lengths[0]).all():
        width = int(lengths[0])
        rows = np.lib.stride_tricks.as_strided(body, (len(body) - width + 1, width), (1, 1), writeable=False)
        gathered = rows[sources]
        scatter(gathered.ctypes.data, pieces)
        return
    for (address, size), at in zip(pieces.tolist(), (sources + body.ctypes.data).tolist()):
        ctypes.memmove(address, at, size)


def _interleave(addresses: np.ndarray) -> int | None:
    """The smallest `k` (up to `_MAX_INTERLEAVE`) such that every `k`-th destination advances by one stride."""
    for k in range(1, min(_MAX_INTERLEAVE, len(addresses) - 1) + 1):
        steps = addresses[k:] - addresses[:-k]  # one stride for every k-th piece: k strided arrays
        if (steps == steps[0]).all() and steps[0] > 0:
            return k
    return None


def _strided(address: int, rows: int, length: int, stride: int) -> np.ndarray:
    """A [rows, length] uint8 array over memory at `address`, rows `stride` bytes apart."""
    span = (rows - 1) * stride + length
    flat = np.frombuffer(memory_at(address, span), np.uint8)
    return np.lib.stride_tricks.as_strided(flat, (rows, length), (stride, 1))


@dataclass(frozen=True)
class Ranges:
    """Byte ranges of one file, each asked for as a whole: range `i` is bytes
    [`starts[i]`, `stops[i]`), landing in `pieces[firsts[i]:firsts[i + 1]]` (an `iovecs`
    array, in file order). `part(lo, hi)` is ranges `lo` to `hi` (views, no copy).

    ```python
    r = plan_ranges(offsets, lengths, addresses, 1 << 20)
    r.starts[0], r.stops[0], r.pieces_of(0)
    ```
    """

    starts: np.ndarray
    stops: np.ndarray
    firsts: np.ndarray
    pieces: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    def part(self, lo: int, hi: int) -> Ranges:
        return Ranges(self.starts[lo:hi], self.stops[lo:hi], self.firsts[lo : hi + 1], self.pieces)

    def pieces_of(self, i: int) -> np.ndarray:
        return self.pieces[self.firsts[i] : self.firsts[i + 1]]

    @property
    def over_read(self) -> int:
        """Bytes of these ranges that are bridged gaps (pieces at `SINK`): fetched, not needed."""
        pieces = self.pieces[self.firsts[0] : self.firsts[-1]]
        return int(pieces[pieces[:, 0] == SINK, 1].sum())

    def scatter(self, body: np.ndarray, offsets: np.ndarray) -> None:
        """Copy each range's bytes, found in `body` (bytes as uint8) from `offsets[i]` on, to its pieces.

        Pieces are copied as `_scatter_at` copies them (equal ones gathered, then strided).
        """
        counts = np.diff(self.firsts)
        pieces = self.pieces[self.firsts[0] : self.firsts[-1]]
        lengths = pieces[:, 1].astype(np.int64)
        begins = np.cumsum(lengths) - lengths  # each piece's place in its range's bytes
        begins -= np.repeat(begins[self.firsts[:-1] - self.firsts[0]], counts)
        _scatter_at(body, np.repeat(offsets, counts) + begins, pieces)


def plan_ranges(
    offsets: np.ndarray, lengths: np.ndarray, addresses: np.ndarray, chunk: int, max_over_read: float = 1.0
) -> Ranges:
    """The requests that read runs (file offset, length, destination address): runs that lie
    end to end in the file share one request, and no request asks for more than `chunk`
    bytes (a run across a `chunk` boundary is cut there).

    With `max_over_read` r > 1, a gap between two stretches of runs is fetched too (a piece
    at `SINK`, discarded) when it is at most r - 1 times the stretch after it and at most
    `MAX_GAP` bytes: the requests then fetch at most r times the runs' bytes. No range
    begins or ends with a gap. r = 1 asks for the runs' bytes exactly.

    ```python
    r = plan_ranges(np.array([0, 8, 32]), np.array([8, 8, 8]), np.array([a, a + 8, b]), 1 << 20)
    # two ranges: bytes 0-16 into (a, 8), (a + 8, 8); bytes 32-40 into (b, 8)
    plan_ranges(np.array([0, 16]), np.array([8, 8]), np.array([a, b]), 1 << 20, 2.0)
    # one range: bytes 0-24 into (a, 8), (SINK, 8), (b, 8)
    ```
    """
    order = np.argsort(offsets, kind="stable")
    offsets, lengths = offsets[order].astype(np.int64), lengths[order].astype(np.int64)
    addresses = addresses[order].astype(np.int64)
    sink = None
    if max_over_read > 1 and len(offsets) > 1:
        offsets, lengths, addresses, sink = bridge_gaps(offsets, lengths, addresses, max_over_read, chunk - 1)
    ends = offsets + lengths
    new = np.ones(len(offsets), bool)  # a run that does not continue the one before starts a stretch
    new[1:] = offsets[1:] != ends[:-1]
    base = np.maximum.accumulate(np.where(new, offsets, 0))  # each run's stretch starts here
    first, last = (offsets - base) // chunk, (ends - 1 - base) // chunk
    cuts = last - first + 1
    if (cuts > 1).any():  # runs across a chunk boundary of their stretch: one piece per chunk
        run = np.repeat(np.arange(len(offsets)), cuts)
        k = np.arange(len(run)) - np.repeat(np.cumsum(cuts) - cuts, cuts)
        begin = np.maximum(offsets[run], base[run] + (first[run] + k) * chunk)
        end = np.minimum(ends[run], base[run] + (first[run] + k + 1) * chunk)
        addresses = addresses[run] + (begin - offsets[run])
        if sink is not None:
            sink = sink[run]
            addresses[sink] = SINK  # a gap cut in two: both parts discarded at the sink
        offsets, ends, base, new = begin, end, base[run], new[run] & (k == 0)
    which = (offsets - base) // chunk
    begins = new.copy()
    begins[1:] |= which[1:] != which[:-1]
    firsts = np.concatenate((np.flatnonzero(begins), [len(offsets)]))
    if sink is not None and sink.any():  # a gap cut at a chunk boundary: its part at a range's edge is not asked
        edge = np.zeros(len(offsets), bool)
        edge[firsts[:-1]] = edge[firsts[1:] - 1] = True
        kept = ~(sink & edge)
        counts = np.bincount(np.repeat(np.arange(len(firsts) - 1), np.diff(firsts))[kept], minlength=len(firsts) - 1)
        offsets, ends, addresses = offsets[kept], ends[kept], addresses[kept]
        firsts = np.concatenate(([0], np.cumsum(counts[counts > 0])))
    stops = ends[np.maximum(firsts[1:] - 1, 0)] if len(offsets) else ends
    return Ranges(offsets[firsts[:-1]], stops, firsts, iovecs(addresses, ends - offsets))


def bridge_gaps(
    offsets: np.ndarray, lengths: np.ndarray, addresses: np.ndarray, ratio: float, largest: int = MAX_GAP
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Runs (in file order) with a run at `SINK` filling each gap worth reading through: one of at
    most `ratio - 1` times the stretch of runs after it (its bytes lying end to end) and at most
    `largest` bytes (`MAX_GAP` or less); and which runs are such gaps (None: no gap is). Each gap
    is charged to the stretch after it, so the runs then span at most `ratio` times their bytes.

    ```python
    bridge_gaps(np.array([0, 16]), np.array([8, 8]), np.array([a, b]), 2.0)
    # offsets [0, 8, 16], lengths [8, 8, 8], addresses [a, SINK, b], gaps [False, True, False]
    ```
    """
    ends = offsets + lengths
    gaps = offsets[1:] - ends[:-1]
    starts = np.flatnonzero(np.concatenate(([True], gaps != 0)))  # each stretch's first run
    sizes = np.add.reduceat(lengths, starts)  # each stretch's bytes
    before = gaps[starts[1:] - 1]  # the gap before each stretch but the first
    bridge = (before > 0) & (before <= min(MAX_GAP, largest)) & (before <= (ratio - 1) * sizes[1:])
    at = starts[1:][bridge]
    if not len(at):
        return offsets, lengths, addresses, None
    sink = np.zeros(len(offsets) + len(at), bool)
    sink[at + np.arange(len(at))] = True
    return (
        np.insert(offsets, at, ends[at - 1]),
        np.insert(lengths, at, before[bridge]),
        np.insert(addresses, at, SINK),
        sink,
    )
