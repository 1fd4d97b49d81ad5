"""Staging: assembling the next output while a thread writes the last, in a fixed ring of host memory."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from port._export._staging import Staging


def test_every_write_sees_its_own_bytes_though_the_ring_wraps():
    """A slow writer and a ring of 2.5 buffers: no buffer is reused while its write is in flight."""
    seen, order = {}, []

    def write(i, data):
        time.sleep(0.002)  # the writer lags: `take` must wait for it
        seen[i] = data.copy()
        order.append(i)
        return i

    sizes = [4000, 1000, 3000, 4000, 7, 0, 2500, 4000, 1, 3999] * 3
    with Staging(10_000) as staging:
        for i, n in enumerate(sizes):
            buffer = staging.take(n)
            buffer[...] = i % 251
            staging.submit(buffer, write, i, buffer)
    assert order == list(range(len(sizes)))  # in submission order
    for i, n in enumerate(sizes):
        assert seen[i].size == n and (seen[i] == i % 251).all(), i


def test_buffers_start_aligned_for_any_dtype():
    with Staging(1000) as staging:
        for n in (3, 5, 8, 1, 100):
            buffer = staging.take(n)
            assert buffer.ctypes.data % 64 == 0
            staging.submit(buffer, lambda: None)


def test_counts_what_is_done_on_the_writing_thread():
    done, threads = [], set()

    def count(result):
        done.append(result)
        threads.add(threading.current_thread().name)

    with Staging(100, done=count) as staging:
        for n in (10, 20, 30):
            buffer = staging.take(n)
            staging.submit(buffer, lambda n=n: n)
    assert done == [10, 20, 30]
    assert all(name.startswith("port-write") for name in threads)


def test_a_failed_write_is_raised_on_the_callers_thread():
    def fail():
        raise OSError("disk full")

    staging = Staging(100)
    buffer = staging.take(10)
    staging.submit(buffer, fail)
    with pytest.raises(OSError, match="disk full"):
        for _ in range(1000):  # raised by the first take after the write fails
            staging.submit(staging.take(60), lambda: time.sleep(0.001))
    staging._stop()


def test_a_failed_write_is_raised_at_close():
    def fail():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        with Staging(100) as staging:
            staging.submit(staging.take(10), fail)


def test_an_error_in_the_block_waits_for_the_running_write_and_cancels_the_rest():
    """Leaving on an exception: the write under way finishes, those not begun never run."""
    started, finished = [], []
    gate = threading.Event()

    def write(i):
        started.append(i)
        gate.wait(5)
        finished.append(i)

    with pytest.raises(KeyboardInterrupt):
        with Staging(1000) as staging:  # room for all three: no take waits
            for i in range(3):
                staging.submit(staging.take(10), write, i)
            while not started:
                time.sleep(0.001)
            threading.Timer(0.05, gate.set).start()
            raise KeyboardInterrupt
    assert started == finished == [0]  # nothing writes after the block is left


def test_misuse_is_refused():
    with Staging(100) as staging:
        with pytest.raises(ValueError, match="101 bytes"):
            staging.take(101)
        buffer = staging.take(10)
        with pytest.raises(RuntimeError, match="never submitted"):
            staging.take(10)
        with pytest.raises(ValueError, match="not the buffer"):
            staging.submit(np.empty(3, np.uint8), lambda: None)
        staging.submit(buffer, lambda: None)
        with pytest.raises(RuntimeError, match="no buffer"):
            staging.submit(buffer, lambda: None)
    with pytest.raises(RuntimeError, match="closed"):
        staging.take(1)


def test_memory_is_the_capacity_whatever_passes_through():
    """A thousand buffers through a 1 MB ring: the ring is the only host memory they use."""
    staging = Staging(1 << 20)
    first = None
    for _i in range(1000):
        buffer = staging.take(300_000)
        first = first if first is not None else buffer.base
        assert buffer.base is first  # a view of the one ring, never a fresh allocation
        staging.submit(buffer, lambda: None)
    staging.close()
