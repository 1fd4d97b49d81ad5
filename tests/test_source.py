"""safetensors headers and counted, positioned region reads of `port._sources`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from port._errors import PortError
from port._sources import LocalCheckpoint

from helpers import element_bytes, read_header, read_offsets, recorded_reads

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
    with LocalCheckpoint(checkpoint_dir, {}, headers) as ckpt:
        got = ckpt.read(key, region)
        want = array[_slices(region)]
        assert got.dtype == want.dtype  # bfloat16 stays bfloat16
        assert got.shape == want.shape and got.flags.c_contiguous
        assert got.tobytes() == np.ascontiguousarray(want).tobytes()
        assert ckpt.bytes_read == want.nbytes


def test_read_whole_bfloat16_and_scalar(checkpoint_dir, headers):
    with LocalCheckpoint(checkpoint_dir, {}, headers) as ckpt:
        got = ckpt.read("bf16.3d", ((0, 4), (0, 3), (0, 8)))
        assert got.dtype == BF16
        np.testing.assert_array_equal(got, ARRAYS["bf16.3d"])
        scalar = ckpt.read("f32.scalar", ())
        assert scalar.shape == () and scalar == np.float32(3.5)
        assert ckpt.bytes_read == ARRAYS["bf16.3d"].nbytes + 4


def test_bytes_read_accumulates(checkpoint_dir, headers):
    ckpt = LocalCheckpoint(checkpoint_dir, {}, headers)
    with ckpt, recorded_reads() as calls:
        ckpt.read("f32.3d", ((1, 3), (0, 6), (2, 5)))
        ckpt.read("i64.1d", ((4, 9),))
        ckpt.read("f16.2d", ((0, 0), (0, 4)))  # empty: nothing read
        assert ckpt.bytes_read == 2 * 6 * 3 * 4 + 5 * 8
    assert len(read_offsets(calls)[0]) == ckpt.bytes_read


def test_read_into_given_buffer(checkpoint_dir, headers):
    with LocalCheckpoint(checkpoint_dir, {}, headers) as ckpt:
        out = np.full((2, 4), 7, np.float16)
        assert ckpt.read("f16.2d", ((3, 5), (0, 4)), out=out) is out
        np.testing.assert_array_equal(out, ARRAYS["f16.2d"][3:5])
        for bad in (np.empty((2, 4), np.float32), np.empty((4, 2), np.float16), np.empty((2, 8), np.float16)[:, ::-2]):
            with pytest.raises(ValueError, match="must be a writeable float16"):
                ckpt.read("f16.2d", ((3, 5), (0, 4)), out=bad)
        with pytest.raises(ValueError, match="outside"):
            ckpt.read("f16.2d", ((3, 10), (0, 4)))


def test_read_of_file_cut_since_its_header_raises(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_file({"w": np.arange(100, dtype=np.float32)}, str(path))
    tensors = read_header(path)
    path.write_bytes(path.read_bytes()[:-40])  # cut after the header was read
    with LocalCheckpoint(tmp_path, {}, tensors) as ckpt, pytest.raises(PortError, match="truncated since") as e:
        ckpt.read("w", ((0, 10),))
    assert "cut.safetensors" in str(e.value) and "\n" not in str(e.value)


def test_read_of_file_cut_while_reading_raises(tmp_path, monkeypatch):
    """What a memory map would turn into SIGBUS is a short read, and one PortError line."""
    import port._sources._local

    path = tmp_path / "cut.safetensors"
    save_file({"w": np.arange(1000, dtype=np.float32)}, str(path))
    tensors = read_header(path)
    real = port._sources._local._preadv

    def cut_first(fd, iov, offset):
        os.truncate(path, tensors["w"].offset + 100)
        return real(fd, iov, offset)

    monkeypatch.setattr(port._sources._local, "_preadv", cut_first)
    with LocalCheckpoint(tmp_path, {}, tensors) as ckpt, pytest.raises(PortError) as e:
        ckpt.read("w", ((0, 1000),))
    message = str(e.value)
    assert message.startswith("cut.safetensors: truncated while reading: tensor 'w'"), message
    assert "\n" not in message and ckpt.bytes_read == 0


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_short_reads_are_resumed(checkpoint_dir, headers, data):
    """A preadv may read less than asked (signals, 2 GB per call): the rest is read after."""
    import port._sources._local

    real = port._sources._local._preadv
    cuts = data.draw(st.lists(st.integers(1, 64), min_size=1, max_size=20), label="cuts")

    def short(fd, iov, offset):
        limit = cuts.pop() if cuts else 1 << 40
        ends = np.cumsum(iov[:, 1].astype(np.int64))
        keep = int(np.searchsorted(ends, limit))
        rows = np.array(iov[: keep + 1], copy=True)
        if keep < len(iov):
            rows[-1, 1] -= np.uint64(max(0, int(ends[keep]) - limit))
        return real(fd, rows, offset)

    key = data.draw(st.sampled_from(["f32.3d", "bf16.3d", "i64.1d"]), label="key")
    region = data.draw(regions(ARRAYS[key].shape), label="region")
    with LocalCheckpoint(checkpoint_dir, {}, headers) as ckpt, pytest.MonkeyPatch.context() as patch:
        patch.setattr(port._sources._local, "_preadv", short)
        got = ckpt.read(key, region)
    assert got.tobytes() == np.ascontiguousarray(ARRAYS[key][_slices(region)]).tobytes()


@pytest.mark.parametrize("max_runs", [1, 3, 7])
def test_many_runs_are_read_in_bounded_batches(checkpoint_dir, headers, monkeypatch, max_runs):
    """A region of very many runs is cut along its first axis; every batch still reads only its bytes."""
    import port._sources._runs

    monkeypatch.setattr(port._sources._runs, "MAX_RUNS", max_runs)
    region = ((1, 5), (0, 6), (2, 5))  # 24 runs
    outs = [np.empty((4, 6, 3), np.float32), np.empty((4, 6, 4), np.float32)]
    with LocalCheckpoint(checkpoint_dir, {}, headers) as ckpt, recorded_reads() as calls:
        ckpt.read_into("f32.3d", [(region, outs[0]), (((1, 5), (0, 6), (3, 7)), outs[1])])
    np.testing.assert_array_equal(outs[0], ARRAYS["f32.3d"][1:5, :, 2:5])
    np.testing.assert_array_equal(outs[1], ARRAYS["f32.3d"][1:5, :, 3:7])
    files, _ = read_offsets(calls)
    assert len(files) == ckpt.bytes_read == outs[0].nbytes + outs[1].nbytes
    assert sum(len(iov) for _, iov, _ in calls) == 48  # each run once, however batched


def test_reads_without_libc_preadv(checkpoint_dir, headers, monkeypatch):
    """Where libc has no preadv, os.preadv fills the same buffers."""
    import port._sources._local

    monkeypatch.setattr(port._sources._local, "_LIBC_PREADV", None)
    with LocalCheckpoint(checkpoint_dir, {}, headers) as ckpt:
        got = ckpt.read("bf16.3d", ((1, 4), (0, 3), (2, 6)))
    assert got.tobytes() == np.ascontiguousarray(ARRAYS["bf16.3d"][1:4, :, 2:6]).tobytes()


# -------------------------------------------------- a read touches only its region


def _element_offsets(info, region) -> list[int]:
    """The file offset of every element of `region`, in C order."""
    idx = np.ix_(*[np.arange(a, b) for a, b in region])
    flat = np.ravel_multi_index(idx, info.shape) if region else np.array(0)
    return (info.offset + np.asarray(flat).reshape(-1) * info.dtype.itemsize).tolist()


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_read_touches_only_region_bytes(checkpoint_dir, headers, data):
    """The bytes the preads read are exactly the region's, each once, each into its place."""
    key = data.draw(st.sampled_from(["f32.3d", "bf16.3d", "f32.4d", "f16.2d", "i64.1d"]), label="key")
    array = ARRAYS[key]
    region = data.draw(regions(array.shape, allow_empty=data.draw(st.booleans())), label="region")
    with LocalCheckpoint(checkpoint_dir, {}, headers) as ckpt, recorded_reads() as calls:
        info = ckpt.tensors[key]
        out = ckpt.read(key, region)
        files, addresses = read_offsets(calls)
    nbytes = math.prod(b - a for a, b in region) * info.dtype.itemsize
    assert len(files) == len(set(files.tolist())) == nbytes == ckpt.bytes_read
    wanted = [start + i for start in _element_offsets(info, region) for i in range(info.dtype.itemsize)]
    # In C order, byte k of the region lands in byte k of `out`.
    assert files.tolist() == (wanted if nbytes else [])
    assert (addresses - out.ctypes.data).tolist() == list(range(nbytes))
    assert out.tobytes() == np.ascontiguousarray(array[_slices(region)]).tobytes()


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_read_into_a_view_of_a_larger_array(checkpoint_dir, headers, data):
    """A region read into its place in a larger array (a block's part of a restored array):
    each byte read once, straight into its place; nothing else in the larger array changes."""
    key = data.draw(st.sampled_from(["f32.3d", "bf16.3d", "f32.4d", "f16.2d", "i64.1d"]), label="key")
    array = ARRAYS[key]
    region = data.draw(regions(array.shape), label="region")
    shape = tuple(b - a for a, b in region)
    pads = [data.draw(st.integers(0, 3), label="pad") for _ in shape]
    starts = [data.draw(st.integers(0, pad), label="start") for pad in pads]
    outer = np.zeros([n + pad for n, pad in zip(shape, pads)], array.dtype)
    place = outer[tuple(slice(s, s + n) for s, n in zip(starts, shape))]
    with LocalCheckpoint(checkpoint_dir, {}, headers) as ckpt, recorded_reads() as calls:
        ckpt.read_into(key, [(region, place)])
        files, addresses = read_offsets(calls)
    info = ckpt.tensors[key]
    assert len(files) == len(set(files.tolist())) == place.nbytes == ckpt.bytes_read
    assert set(files.tolist()) == element_bytes(info, region)
    # Every byte landed inside `place`'s elements: their addresses in `outer`, each once.
    index = np.arange(outer.size).reshape(outer.shape)[tuple(slice(s, s + n) for s, n in zip(starts, shape))]
    inside = (outer.ctypes.data + index.reshape(-1)[:, None] * outer.itemsize + np.arange(outer.itemsize)).reshape(-1)
    assert sorted(addresses.tolist()) == sorted(inside.tolist())
    expected = np.zeros_like(outer)
    expected[tuple(slice(s, s + n) for s, n in zip(starts, shape))] = array[_slices(region)]
    assert outer.tobytes() == expected.tobytes()


def test_regions_that_tile_rows_are_read_by_one_call(checkpoint_dir, headers):
    """Column blocks of a matrix read together: their runs lie end to end in the file, one preadv."""
    array = ARRAYS["f32.3d"]  # (5, 6, 7)
    blocks = [((0, 5), (0, 6), (0, 3)), ((0, 5), (0, 6), (3, 7))]
    outs = [np.empty((5, 6, b - a), np.float32) for _, _, (a, b) in blocks]
    with LocalCheckpoint(checkpoint_dir, {}, headers) as ckpt, recorded_reads() as calls:
        ckpt.read_into("f32.3d", list(zip(blocks, outs)))
    assert len(calls) == 1 and len(calls[0][1]) == 2 * 5 * 6
    np.testing.assert_array_equal(np.concatenate(outs, axis=2), array)
    files, _ = read_offsets(calls)
    assert sorted(files.tolist()) == list(
        range(ckpt.tensors["f32.3d"].offset, ckpt.tensors["f32.3d"].offset + array.nbytes)
    )
    # Only one of them: 30 runs with gaps between them, one preadv each.
    with LocalCheckpoint(checkpoint_dir, {}, headers) as ckpt, recorded_reads() as calls:
        ckpt.read("f32.3d", blocks[0])
    assert len(calls) == 30


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


@pytest.mark.parametrize("raw", [b"not json", b'{"a": ', b"\xff\xfe\x00garbage", b"", b"[1, 2]", b'"text"', b"null"])
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
