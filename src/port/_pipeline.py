"""Pipelines: work handed to threads, taken back in the order it was handed over.

Port overlaps its reads and writes with the work that needs them, always in one shape:
work goes to threads as early as a bound allows, and the caller takes it back oldest
first, where a failed piece's error is raised on the caller's thread. `InFlight` is
that queue (save's chunk writes, export's staged writes); `ReadAhead` runs reads
ahead of the caller on a pool of threads (place's source reads, restore's chunk
reads), bounded by a number of units or of bytes.

```python
with ReadAhead(ahead=2) as reads:
    units = ((leaf, [partial(read, leaf, key) for key in keys], 0) for leaf in leaves)
    for leaf in reads.run(units):       # every read of `leaf` is done
        ...
pending = InFlight()
pending.add("wte", pool.submit(write, "wte"))
tag, results = pending.finish_oldest()  # waits for it; raises its error here
```
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def default_workers() -> int:
    """Reading threads when the caller names none: twice the CPU count, at most 8. A reader
    spends part of its time in Python (planning its runs, holding the GIL) and waiting on its
    page faults; a second one per core keeps the core copying meanwhile (GPT-2 medium on 2
    cores: place 0.60-0.70 s with 2 readers, 0.55-0.57 s with 4)."""
    return min(8, 2 * (os.cpu_count() or 1))


class InFlight(Generic[T]):
    """Work in flight on other threads, oldest first: per entry, what the caller keeps
    about it (its tag) and the futures doing it.

    ```python
    pending = InFlight()
    pending.add(("wte", 0), pool.submit(write_chunk, ...))
    while pending and pending.oldest_done():
        (path, host), (wrote,) = pending.finish_oldest()
    ```
    """

    def __init__(self) -> None:
        self._entries: deque[tuple[T, tuple[Future, ...]]] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, tag: T, *futures: Future) -> None:
        """Queue the work of `futures` (none, one or several) under `tag`, after the rest."""
        self._entries.append((tag, futures))

    def tags(self) -> Iterator[T]:
        """The tags of the work in flight, oldest first."""
        return (tag for tag, _ in self._entries)

    def oldest_done(self) -> bool:
        """Whether every future of the oldest entry has finished (there must be one)."""
        return all(future.done() for future in self._entries[0][1])

    def finish_oldest(self) -> tuple[T, list[Any]]:
        """Wait for the oldest entry and forget it: its tag and its futures' results. The
        first error among them is raised here, on the caller's thread."""
        tag, futures = self._entries.popleft()
        return tag, [future.result() for future in futures]

    def failed(self) -> BaseException | None:
        """The error of the oldest entry's future that has failed already, waiting for none; None if none has."""
        for _, futures in self._entries:
            for future in futures:
                if future.done() and not future.cancelled() and future.exception() is not None:
                    return future.exception()
        return None

    def cancel(self) -> None:
        """Cancel every future not yet started and forget every entry (the started ones run on)."""
        for _, futures in self._entries:
            for future in futures:
                future.cancel()
        self._entries.clear()


class ReadAhead:
    """A pool of threads reading ahead of the caller, who takes each unit of reads, in
    order, once all of them are done.

    **Arguments:**

    - `ahead`: units in flight beyond the one the caller takes (default: no bound).
    - `ahead_bytes`: bytes the units in flight hold, beyond which the caller waits for
      the oldest before more are read (default: no bound; a unit larger than it is
      read alone).
    - `workers`: reading threads (default: twice the CPU count, at most 8).
    - `name`: the threads' name prefix.

    A context manager: leaving the block on an error (a failed read, the caller's, an
    interrupt) cancels the reads not yet started and waits for those running, so no
    read outlives the block.

    ```python
    with ReadAhead(ahead_bytes=1 << 30) as reads:
        for leaf in reads.run((leaf, [partial(read, leaf)], leaf.nbytes) for leaf in leaves):
            ...
    ```
    """

    def __init__(
        self,
        ahead: float = math.inf,
        ahead_bytes: float = math.inf,
        workers: int | None = None,
        name: str = "port-read",
    ):
        self.ahead, self.ahead_bytes = ahead, ahead_bytes
        self._pool = ThreadPoolExecutor(workers or default_workers(), thread_name_prefix=name)

    def run(self, units: Iterable[tuple[T, Sequence[Callable[[], Any]], int]]) -> Iterator[T]:
        """Each unit's value once every read of it has returned, in the order of `units`.

        A unit is (value, its reads: calls without arguments, the bytes it holds). Units
        are drawn from `units` only as the bounds allow, so a lazy iterable plans each
        (allocates its memory) just in time. A failed read's error is raised here.
        """
        pending: InFlight[tuple[T, int]] = InFlight()
        held = 0
        for value, reads, nbytes in units:
            pending.add((value, nbytes), *(self._pool.submit(read) for read in reads))
            held += nbytes
            del value, reads
            while pending and (len(pending) > self.ahead or held > self.ahead_bytes):
                (ready, size), _ = pending.finish_oldest()
                held -= size
                yield ready
                del ready  # the caller's to keep, not this frame's
        while pending:
            (ready, _), _ = pending.finish_oldest()
            yield ready
            del ready

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self._pool.shutdown(wait=True, cancel_futures=kind is not None)
