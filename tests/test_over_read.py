"""A remote read may fetch the gaps between the stretches it needs (`max_over_read`), bounded.

With a ratio r > 1 one request spans two stretches of a file when the gap between them is
at most r - 1 times the stretch after it: the gap's bytes are received and discarded, the
requests fetch at most r times the bytes needed, and `bytes_over_read` counts the gaps
(`bytes_read` stays the bytes needed). r = 1 asks for exact ranges, as before; local files
are read exactly unless a ratio is given. Served by the threaded test server of `test_remote`.
"""

import time

import numpy as np
import pytest
from test_remote import served, server  # noqa: F401  (fixtures)

import port
from port._sources import _ranges

from helpers import run_port, usage_error


def _plan(offsets, lengths, chunk, ratio):
    """Ranges for runs landing end to end in one buffer, and the buffer's address."""
    out = np.zeros(int(np.sum(lengths)), np.uint8)
    addresses = out.ctypes.data + np.cumsum(lengths) - lengths
    return _ranges.plan_ranges(np.array(offsets), np.array(lengths), addresses, chunk, ratio), out


def _every_other(n: int, width: int) -> tuple[list[int], list[int]]:
    """A process's rows of a column-sharded tensor: `width` bytes, then the other's `width`, n times."""
    return [2 * width * i for i in range(n)], [width] * n


def test_exact_reads_at_one_and_gaps_bridged_within_the_ratio():
    offsets, lengths = _every_other(100, 64)
    exact, _ = _plan(offsets, lengths, 1 << 20, 1.0)
    assert len(exact) == 100 and exact.over_read == 0 and not (exact.pieces[:, 0] == _ranges.SINK).any()
    assert (exact.stops - exact.starts).sum() == sum(lengths)
    bridged, _ = _plan(offsets, lengths, 1 << 20, 2.0)
    assert len(bridged) == 1 and (bridged.starts[0], bridged.stops[0]) == (0, offsets[-1] + 64)
    assert bridged.over_read == 99 * 64 and (bridged.stops - bridged.starts).sum() <= 2 * sum(lengths)
    # A gap larger than r - 1 times the stretch after it is not fetched; a smaller ratio bridges less.
    assert len(_plan(offsets, lengths, 1 << 20, 1.9)[0]) == 100
    wide, _ = _plan([0, 100, 1000], [50, 50, 50], 1 << 20, 3.0)  # gaps 50 (bridged) and 850 (not)
    assert list(zip(wide.starts.tolist(), wide.stops.tolist())) == [(0, 150), (1000, 1050)]


@pytest.mark.parametrize("seed", range(20))
def test_fetched_stays_within_the_ratio_and_no_range_starts_or_ends_with_a_gap(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    lengths = rng.integers(1, 40, n)
    offsets = np.cumsum(lengths + rng.integers(0, 60, n) * rng.integers(0, 2, n)) - lengths
    ratio = float(rng.choice([1.0, 1.5, 2.0, 4.0, np.inf]))
    chunk = int(rng.choice([16, 50, 1 << 20]))
    ranges, _ = _plan(offsets, lengths, chunk, ratio)
    fetched = int((ranges.stops - ranges.starts).sum())
    assert fetched <= ratio * lengths.sum() and fetched == lengths.sum() + ranges.over_read
    assert ((ranges.stops - ranges.starts) <= chunk).all()
    wanted = np.zeros(int(offsets.max() + lengths.max()), int)
    for i in range(len(ranges)):
        pieces = ranges.pieces_of(i)
        assert pieces[:, 1].sum() == ranges.stops[i] - ranges.starts[i]  # the pieces fill the range
        assert pieces[0, 0] != _ranges.SINK and pieces[-1, 0] != _ranges.SINK
        at = int(ranges.starts[i])
        for address, length in pieces.tolist():
            if address != _ranges.SINK:
                wanted[at : at + length] += 1
            at += length
    expected = np.zeros_like(wanted)
    for offset, length in zip(offsets.tolist(), lengths.tolist()):
        expected[offset : offset + length] += 1
    assert (wanted == expected).all()  # every byte needed lands once, nothing else does


def test_a_gap_lands_at_the_sink_and_its_bytes_are_not_copied():
    offsets, lengths = _every_other(6, 5)
    ranges, out = _plan(offsets, lengths, 1 << 20, 2.0)
    body = np.arange(60, dtype=np.uint8)  # the file's bytes 0-59: byte i is i
    _ranges.scatter(body.ctypes.data, ranges.pieces_of(0))
    assert out.tolist() == [b for o in offsets for b in range(o, o + 5)]
    out[:] = 0
    ranges.scatter(body, np.array([0]))  # as a multipart answer is copied out
    assert out.tolist() == [b for o in offsets for b in range(o, o + 5)]


def _column_half(checkpoint):
    """The 2-D tensor with the most rows and the left half of its columns: what one of two processes
    reads of a column-sharded tensor (its half row, then the other's)."""
    key = max(
        (k for k, t in checkpoint.tensors.items() if len(t.shape) == 2), key=lambda k: checkpoint.tensors[k].shape
    )
    rows, cols = checkpoint.tensors[key].shape
    return key, rows, ((0, rows), (0, cols // 2))


def _settled(served) -> int:  # noqa: F811
    """The bytes the server has sent, once no answer is in progress (it counts a body after writing it)."""
    for _ in range(500):
        if not served.active:
            break
        time.sleep(0.01)
    return served.sent


def test_two_process_shaped_reads_merge_over_http_and_say_what_they_over_read(server, served, gpt2_checkpoints):  # noqa: F811
    directory = gpt2_checkpoints[0]["lm"]
    seen = {}
    with port.open_checkpoint(directory) as local:
        key, rows, region = _column_half(local)
        expected = local.read(key, region)
    for ratio in (1, 2):
        with port.open_checkpoint(f"{server.base}/lm", max_over_read=ratio) as ckpt:
            requests, sent, read = served.requests, _settled(served), ckpt.bytes_read
            np.testing.assert_array_equal(ckpt.read(key, region), expected)
            fetched = _settled(served) - sent
            seen[ratio] = (served.requests - requests, fetched, ckpt.bytes_read - read, ckpt.bytes_over_read)
    needed = expected.nbytes
    (asked_1, sent_1, read_1, over_1), (asked_2, sent_2, read_2, over_2) = seen[1], seen[2]
    assert (read_1, sent_1, over_1) == (needed, needed, 0)  # exact: the bytes needed, no more
    assert read_2 == needed and sent_2 == needed + over_2 == needed + (rows - 1) * needed // rows
    assert sent_2 <= 2 * needed and asked_2 < asked_1 and asked_2 <= 2, seen  # one stretch (under HTTP_CHUNK)


def test_local_files_are_read_exactly_unless_a_ratio_is_given(gpt2_checkpoints, monkeypatch):
    """A local file's column half (every other stretch of each row) costs a `preadv` per row when
    read exactly, the default; given a ratio, one `preadv` reads through the other half into the
    sink, the same block comes out, and the bytes read through are counted as over-read."""
    from port._sources import _local

    calls = []
    real = _local._preadv
    monkeypatch.setattr(_local, "_preadv", lambda fd, iov, offset: calls.append(len(iov)) or real(fd, iov, offset))
    seen = {}
    for ratio in (None, 2):
        with port.open_checkpoint(gpt2_checkpoints[0]["lm"], max_over_read=ratio) as ckpt:
            key, rows, region = _column_half(ckpt)
            calls.clear()
            block = ckpt.read(key, region)
            seen[ratio] = (block, len(calls), ckpt.bytes_read, ckpt.bytes_over_read)
    (exact, exact_calls, exact_read, exact_over), (bridged, bridged_calls, read, over) = seen[None], seen[2]
    np.testing.assert_array_equal(bridged, exact)
    assert (exact_calls, exact_read, exact_over) == (rows, exact.nbytes, 0)
    assert bridged_calls == 1 and read == exact.nbytes and over == (rows - 1) * exact.nbytes // rows


@pytest.mark.parametrize("value", [0.5, 0, -1, float("nan"), "two", True])
def test_a_ratio_below_one_or_not_a_number_is_one_line_naming_it(gpt2_checkpoints, value):
    with pytest.raises(port.PortError, match=r"^max_over_read=.*: expected a number >= 1") as e:
        port.load(gpt2_checkpoints[0]["lm"], max_over_read=value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["0.5", "nan", "x"])
def test_the_flag_refuses_a_ratio_below_one(tmp_path, value):
    result = run_port("convert", tmp_path / "none", "--out", tmp_path / "out", "--max-over-read", value)
    usage_error(result, "--max-over-read", "expected a number >= 1")
    assert not (tmp_path / "out").exists()
