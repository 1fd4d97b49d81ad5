"""Work on threads taken back in order (`port._pipeline`): place's and restore's reads ahead,
save's and export's writes in flight."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from port._pipeline import InFlight, ReadAhead


def test_in_flight_finishes_oldest_first_and_raises_there():
    with ThreadPoolExecutor(2) as pool:
        pending = InFlight()
        pending.add("a", pool.submit(lambda: 1), pool.submit(lambda: 2))
        pending.add("b")  # no futures: done at once
        pending.add("c", pool.submit(lambda: 1 / 0))
        assert len(pending) == 3 and list(pending.tags()) == ["a", "b", "c"]
        assert pending.finish_oldest() == ("a", [1, 2])
        assert pending.oldest_done() and pending.finish_oldest() == ("b", [])
        while not pending.oldest_done():
            time.sleep(0.01)
        assert isinstance(pending.failed(), ZeroDivisionError)
        with pytest.raises(ZeroDivisionError):
            pending.finish_oldest()
        assert len(pending) == 0 and pending.failed() is None


def test_in_flight_cancel_forgets_what_has_not_started():
    gate, ran = threading.Event(), []
    with ThreadPoolExecutor(1) as pool:
        pending = InFlight()
        pending.add(0, pool.submit(gate.wait))
        pending.add(1, pool.submit(ran.append, 1))
        pending.cancel()
        gate.set()
    assert len(pending) == 0 and ran == []


@pytest.mark.parametrize(
    "bounds, most", [({"ahead": 2}, 3), ({"ahead_bytes": 25}, 3), ({"ahead_bytes": 0}, 1), ({}, 10)]
)
def test_read_ahead_takes_units_in_order_within_its_bounds(bounds, most):
    """Units are drawn only as the bounds allow: at most `most` planned and not yet taken back."""
    planned, taken, seen = [], [], []

    def units():
        for i in range(10):
            planned.append(i)
            seen.append(len(planned) - len(taken))
            yield i, [lambda i=i: time.sleep(0.001 * (10 - i))], 10

    with ReadAhead(workers=4, **bounds) as reads:
        for i in reads.run(units()):
            taken.append(i)
    assert taken == list(range(10)) and max(seen) == most


def test_read_ahead_stops_at_a_failed_read_and_cancels_the_rest():
    started = []

    def read(i):
        started.append(i)
        if i == 1:
            raise ValueError("unit 1")
        time.sleep(0.05)

    taken = []
    with pytest.raises(ValueError, match="unit 1"):
        with ReadAhead(workers=1, ahead=1) as reads:
            for i in reads.run((i, [lambda i=i: read(i)], 0) for i in range(100)):
                taken.append(i)
    assert taken == [0] and len(started) < 5
