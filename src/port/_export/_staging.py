"""Staging: a fixed amount of host memory in which the next output is assembled while earlier ones are written.

Export assembles each output tensor (or each block of one) on the host, then writes
it. Done in turn, the copying and the writing each wait for the other. `Staging`
overlaps them: buffers are taken from one ring of `capacity` bytes, each is handed to
a single background thread to write, and its bytes are reused only once that write
is done. Host memory stays at `capacity` however many tensors pass through, and the
writes happen in the order they were submitted.

```python
with Staging(capacity=3 * 2**20) as staging:
    for key, value in tensors.items():
        buffer = staging.take(value.nbytes)                 # waits while earlier writes hold its bytes
        array = buffer.view(value.dtype).reshape(value.shape)
        array[...] = value                                  # assembled here ...
        staging.submit(buffer, writer.write, key, array)    # ... written there, meanwhile
# leaving the block waits for every write; an error in one is raised here, or at the next take
```
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._pipeline import InFlight

_ALIGN = 64  # bytes: where each buffer starts, a cache line (and any dtype's alignment)


class Staging:
    """A ring of `capacity` bytes of host memory and one thread that writes what is submitted, in order.

    **Arguments:**

    - `capacity`: bytes of the ring; no buffer taken may be larger.
    - `done`: called on the writing thread with each submitted call's result as it
      finishes (for example, to count bytes written).
    """

    def __init__(self, capacity: int, done: Callable[[Any], None] | None = None):
        self.capacity = int(capacity)
        self._ring: np.ndarray | None = None  # allocated on the first take: nothing to hold for no writes
        self._head = 0
        self._flight: InFlight[tuple[int, int]] = InFlight()  # each write, by the bytes (start, stop) it holds
        self._taken: tuple[int, int] | None = None
        self._done = done
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="port-write")
        self._closed = threading.Event()

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` of the ring (uint8), once no write in flight still needs them; raises a failed write's error.

        The buffer must be passed to `submit` before the next `take`.
        """
        nbytes = int(nbytes)
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"Staging.take: {nbytes} bytes, but the ring holds {self.capacity}")
        if self._taken is not None:
            raise RuntimeError("Staging.take: the previous buffer was never submitted")
        if self._closed.is_set():
            raise RuntimeError("Staging.take: closed")
        if self._ring is None:
            memory = np.empty(self.capacity + _ALIGN, np.uint8)
            skip = -memory.ctypes.data % _ALIGN
            self._ring = memory[skip : skip + self.capacity]
        start = -(-self._head // _ALIGN) * _ALIGN  # aligned for any dtype viewed in it
        start = start if start + nbytes <= self.capacity else 0
        stop = start + nbytes
        while self._flight and self._overlaps(start, stop):
            self._flight.finish_oldest()
        if (error := self._flight.failed()) is not None:
            raise error
        self._taken = (start, stop)
        self._head = stop
        return self._ring[start:stop]

    def submit(self, buffer: np.ndarray, write: Callable[..., Any], *args: Any) -> None:
        """Call `write(*args)` on the writing thread; the bytes of `buffer` (the last `take`) are free once it returns."""
        if self._taken is None:
            raise RuntimeError("Staging.submit: no buffer was taken")
        start, stop = self._taken
        if buffer.size != stop - start:
            raise ValueError("Staging.submit: not the buffer last taken")
        self._taken = None
        self._flight.add((start, stop), self._thread.submit(self._run, write, args))

    def drain(self) -> None:
        """Wait for every write submitted; raises the first that failed."""
        while self._flight:
            self._flight.finish_oldest()  # re-raises the write's error here, on the caller's thread

    def close(self) -> None:
        """Wait for the writes and stop the thread (what `with` does); raises the first write that failed."""
        if self._closed.is_set():
            return
        try:
            self.drain()
        finally:
            self._stop()

    def _stop(self) -> None:
        """Cancel what has not started, wait for what has: no write outlives this (the files it writes may close)."""
        self._closed.set()
        self._flight.cancel()
        self._thread.shutdown(wait=True)
        self._ring = None

    def _run(self, write: Callable[..., Any], args: tuple) -> Any:
        result = write(*args)
        if self._done is not None:
            self._done(result)
        return result

    def _overlaps(self, start: int, stop: int) -> bool:
        return any(a < stop and start < b for a, b in self._flight.tags())

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:  # already failing: stop without waiting for writes not begun, and keep the first error
            self._stop()
