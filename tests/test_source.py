"""safetensors headers and counted region reads of `port._source`."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from port._errors import PortError
from port._source import Checkpoint, read_header

BF16 = np.dtype(ml_dtypes.bfloat16)

ARRAYS = {
    "f32.3d": np.random.default_rng(0).standard_normal((5, 6, 7)).astype(np.float32),
    "f16.2d": np.random.default_rng(1).standard_normal((9, 4)).astype(np.float16),
    "bf16.3d": np.random.default_rng(2).standard_normal((4, 3, 8)).astype(BF16),
    "i64.1d": np.arange(-20, 17, dtype=np.int64) * 1_000_000_007,
    "f32.4d": np.arange(2 * 3 * 1 * 5, dtype=np.float32).reshape(2, 3, 1, 5),
    "f32.scalar": np.array(3.5, dtype=np.float32),
}
DTYPE_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", BF16: "BF16", np.dtype(np.int64): "I64"}


def _slices(region):
    return tuple(slice(a, b) for a, b in region)


@st.composite
def regions(draw, shape, allow_empty=False):
    out = []
    for n in shape:
        a = draw(st.integers(0, n if allow_empty else n - 1))
        b = draw(st.integers(a if allow_empty else a + 1, n))
        out.append((a, b))
    return tuple(out)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt")
    keys = list(ARRAYS)
    save_file({k: ARRAYS[k] for k in keys[:4]}, str(directory / "a.safetensors"), metadata={"format": "np"})
    save_file({k: ARRAYS[k] for k in keys[4:]}, str(directory / "b.safetensors"))
    return directory


@pytest.fixture(scope="module")
def headers(checkpoint_dir):
    tensors = {}
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        tensors.update(read_header(path))
    return tensors


# ------------------------------------------------------------------------- headers


def test_read_header_dtype_shape_offset(checkpoint_dir, headers):
    assert set(headers) == set(ARRAYS)  # __metadata__ is not a tensor
    for key, array in ARRAYS.items():
        info = headers[key]
        assert info.key == key
        assert info.dtype == array.dtype
        assert info.shape == array.shape
        assert info.nbytes == array.nbytes
        # The offset is absolute: the raw bytes there are the array's bytes.
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            assert f.read(info.nbytes) == array.tobytes()


def test_read_header_offset_follows_header_length(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"w": np.ones((2, 3), np.float32)}, str(path))
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8 : 8 + n])["w"]["data_offsets"]
    assert read_header(path)["w"].offset == 8 + n + begin


# --------------------------------------------------------------------------- reads


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_read_equals_array_box(checkpoint_dir, headers, data):
    key = data.draw(st.sampled_from(sorted(ARRAYS)), label="key")
    array = ARRAYS[key]
    region = data.draw(regions(array.shape, allow_empty=data.draw(st.booleans())), label="region")
    ckpt = Checkpoint(checkpoint_dir, {}, headers)
    try:
        got = ckpt.read(key, region)
        want = array[_slices(region)]
        assert got.dtype == want.dtype  # bfloat16 stays bfloat16
        assert got.shape == want.shape
        assert got.tobytes() == np.ascontiguousarray(want).tobytes()
        assert ckpt.bytes_read == want.nbytes
    finally:
        ckpt.close()


def test_read_whole_bfloat16_and_scalar(checkpoint_dir, headers):
    with Checkpoint(checkpoint_dir, {}, headers) as ckpt:
        got = ckpt.read("bf16.3d", ((0, 4), (0, 3), (0, 8)))
        assert got.dtype == BF16
        np.testing.assert_array_equal(got, ARRAYS["bf16.3d"])
        scalar = ckpt.read("f32.scalar", ())
        assert scalar.shape == () and scalar == np.float32(3.5)
        assert ckpt.bytes_read == ARRAYS["bf16.3d"].nbytes + 4


def test_bytes_read_accumulates(checkpoint_dir, headers):
    ckpt = Checkpoint(checkpoint_dir, {}, headers)
    with ckpt:
        ckpt.read("f32.3d", ((1, 3), (0, 6), (2, 5)))
        ckpt.read("i64.1d", ((4, 9),))
        ckpt.read("f16.2d", ((0, 0), (0, 4)))  # empty: nothing read
        assert ckpt.bytes_read == 2 * 6 * 3 * 4 + 5 * 8


def test_read_of_truncated_data_raises(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_file({"w": np.arange(100, dtype=np.float32)}, str(path))
    tensors = read_header(path)
    path.write_bytes(path.read_bytes()[:-40])  # cut after the header was read
    with Checkpoint(tmp_path, {}, tensors) as ckpt:
        ckpt.read("w", ((0, 10),))
        with pytest.raises(PortError, match="truncated") as e:
            ckpt.read("w", ((80, 100),))
    assert "cut.safetensors" in str(e.value)


# -------------------------------------------------- a read touches only its region


class Recorder:
    """Wraps os.preadv, recording (offset, bytes asked, bytes read) of every call."""

    def __init__(self, real):
        self.real = real
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, fd, buffers, offset, *args):
        asked = sum(memoryview(b).nbytes for b in buffers)
        n = self.real(fd, buffers, offset, *args)
        self.calls.append((offset, asked, n))
        return n


def _element_offsets(info, region) -> list[int]:
    """The file offset of every element of `region`, in C order."""
    idx = np.ix_(*[np.arange(a, b) for a, b in region])
    flat = np.ravel_multi_index(idx, info.shape) if region else np.array(0)
    return (info.offset + np.asarray(flat).reshape(-1) * info.dtype.itemsize).tolist()


def _contiguous_runs(starts: list[int], item: int) -> int:
    starts = sorted(starts)
    return sum(1 for i, s in enumerate(starts) if i == 0 or starts[i - 1] + item != s)


def _check_reads_only_region(ckpt, key, region, array):
    info = ckpt.tensors[key]
    item = info.dtype.itemsize
    real = os.preadv
    recorder = Recorder(real)
    before = ckpt.bytes_read
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("port._source.os.preadv", recorder)
        got = ckpt.read(key, region)
    assert os.preadv is real
    want = array[_slices(region)]
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()

    nbytes = math.prod(b - a for a, b in region) * item
    assert ckpt.bytes_read - before == nbytes
    assert sum(n for _, _, n in recorder.calls) == nbytes
    assert all(asked == n for _, asked, n in recorder.calls)  # no short reads from a local file

    elements = set(_element_offsets(info, region)) if nbytes else set()
    touched: Counter[int] = Counter()
    for offset, _, n in recorder.calls:
        # Each range is a union of whole elements of the region...
        assert n > 0 and n % item == 0, (offset, n)
        for start in range(offset, offset + n, item):
            assert start in elements, f"read element at byte {start} outside region {region}"
            touched[start] += 1
    # ...no byte is read twice, and together they are the region.
    assert all(c == 1 for c in touched.values())
    assert set(touched) == elements
    # One call per maximal contiguous run of the region's bytes, no more.
    assert len(recorder.calls) == _contiguous_runs(list(elements), item)
    return recorder.calls


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_read_touches_only_region_bytes(checkpoint_dir, headers, data):
    key = data.draw(st.sampled_from(["f32.3d", "bf16.3d", "f32.4d", "f16.2d", "i64.1d"]), label="key")
    array = ARRAYS[key]
    region = data.draw(regions(array.shape, allow_empty=data.draw(st.booleans())), label="region")
    with Checkpoint(checkpoint_dir, {}, headers) as ckpt:
        _check_reads_only_region(ckpt, key, region, array)


def test_runs_per_outer_index(checkpoint_dir, headers):
    array = ARRAYS["f32.3d"]  # (5, 6, 7)
    with Checkpoint(checkpoint_dir, {}, headers) as ckpt:
        # Whole inner dims: the region is one contiguous run.
        calls = _check_reads_only_region(ckpt, "f32.3d", ((1, 4), (0, 6), (0, 7)), array)
        assert len(calls) == 1 and calls[0][2] == 3 * 6 * 7 * 4
        # Whole last dim, partial middle dim: one run per outer index.
        calls = _check_reads_only_region(ckpt, "f32.3d", ((1, 4), (2, 5), (0, 7)), array)
        assert len(calls) == 3 and all(n == 3 * 7 * 4 for _, _, n in calls)
        info = ckpt.tensors["f32.3d"]
        assert [o for o, _, _ in calls] == [info.offset + (i * 42 + 14) * 4 for i in (1, 2, 3)]
        # Partial last dim: one run per (outer, middle) index.
        calls = _check_reads_only_region(ckpt, "f32.3d", ((1, 4), (2, 5), (1, 3)), array)
        assert len(calls) == 9 and all(n == 2 * 4 for _, _, n in calls)
        # One outer index and whole inner dims of a partial middle: still one run.
        calls = _check_reads_only_region(ckpt, "f32.3d", ((2, 3), (1, 5), (0, 7)), array)
        assert len(calls) == 1
        # An empty region reads nothing.
        calls = _check_reads_only_region(ckpt, "f32.3d", ((2, 3), (1, 1), (0, 7)), array)
        assert calls == []


# ----------------------------------------------------------------- corrupt inputs


def _write(path: Path, header: object, data: bytes = b"", raw_header: bytes | None = None) -> Path:
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def _valid(tmp_path, name="valid.safetensors") -> Path:
    path = tmp_path / name
    save_file({"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int64)}, str(path))
    return path


def _assert_port_error(path: Path, word: str) -> str:
    with pytest.raises(PortError) as e:
        read_header(path)
    message = str(e.value)
    assert path.name in message, message
    assert word in message, message
    assert "\n" not in message and "\r" not in message, message
    return message


def test_valid_file_has_no_error(tmp_path):
    assert set(read_header(_valid(tmp_path))) == {"a", "b"}


def test_truncated_data(tmp_path):
    path = _valid(tmp_path, "cut-data.safetensors")
    path.write_bytes(path.read_bytes()[:-3])
    _assert_port_error(path, "truncated")


@pytest.mark.parametrize("size", [0, 1, 7])
def test_shorter_than_length_prefix(tmp_path, size):
    path = tmp_path / f"tiny{size}.safetensors"
    path.write_bytes(b"\x10" * size)
    _assert_port_error(path, "truncated")


def test_header_cut_short(tmp_path):
    path = _valid(tmp_path, "cut-header.safetensors")
    n = int.from_bytes(path.read_bytes()[:8], "little")
    path.write_bytes(path.read_bytes()[: 8 + n // 2])
    _assert_port_error(path, "corrupt header")


def test_header_length_larger_than_file(tmp_path):
    path = tmp_path / "long.safetensors"
    path.write_bytes((1000).to_bytes(8, "little") + b'{"a": 1}')
    _assert_port_error(path, "corrupt header")
    path.write_bytes((2**64 - 1).to_bytes(8, "little") + b"{}")
    _assert_port_error(path, "corrupt header")


@pytest.mark.parametrize(
    "raw", [b"not json", b'{"a": ', b"\xff\xfe\x00garbage", b"", b"[1, 2]", b'"text"', b"null"]
)
def test_header_not_json_object(tmp_path, raw):
    path = _write(tmp_path / "nojson.safetensors", None, b"\0" * 16, raw_header=raw)
    _assert_port_error(path, "corrupt header")


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 44]},  # needs 48 bytes
        {"dtype": "F32", "shape": [3, 4], "data_offsets": [4, 48]},
        {"dtype": "I64", "shape": [2], "data_offsets": [0, 8]},
        {"dtype": "F16", "shape": [], "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [3, -4], "data_offsets": [0, 48]},
        {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]},
    ],
)
def test_offsets_not_matching_shape(tmp_path, entry):
    path = _write(tmp_path / "offsets.safetensors", {"t": entry}, b"\0" * 64)
    message = _assert_port_error(path, "corrupt header")
    assert "'t'" in message


@pytest.mark.parametrize(
    "entry",
    [
        {"shape": [1], "data_offsets": [0, 4]},  # no dtype
        {"dtype": "F32", "data_offsets": [0, 4]},  # no shape
        {"dtype": "F32", "shape": [1]},  # no offsets
        {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]},
        {"dtype": "F32", "shape": ["x"], "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": 4, "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [1], "data_offsets": None},
        [1, 2, 3],
        "F32",
        7,
    ],
)
def test_bad_entry(tmp_path, entry):
    path = _write(tmp_path / "entry.safetensors", {"t": entry}, b"\0" * 8)
    _assert_port_error(path, "corrupt header")


@pytest.mark.parametrize("dtype", ["F128", "f32", "C64", "U64", ""])
def test_unsupported_dtype(tmp_path, dtype):
    entry = {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}
    path = _write(tmp_path / "dtype.safetensors", {"t": entry}, b"\0" * 4)
    message = _assert_port_error(path, "unsupported dtype")
    assert "'t'" in message


@pytest.mark.parametrize("dtype", [["F32"], {"name": "F32"}])
def test_non_string_dtype(tmp_path, dtype):
    entry = {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}
    path = _write(tmp_path / "dtype-list.safetensors", {"t": entry}, b"\0" * 4)
    _assert_port_error(path, "corrupt header")


def test_missing_file(tmp_path):
    path = tmp_path / "missing.safetensors"
    _assert_port_error(path, "cannot read")
