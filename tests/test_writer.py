"""The safetensors writer of `port export` (`port._export._safetensors`): exact bytes, layout, sharding, errors."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save

from port._dtypes import SAFETENSORS
from port._errors import OutputError, PortError
from port._export._safetensors import _LIBRARY_ORDER, INDEX, OutTensor, Writer, file_names, parse_size, shard_files
from port._memory import PeakMemory
from port._sources import open_checkpoint

from helpers import GPT2_CONFIG, torch_gpt2

BF16 = np.dtype(ml_dtypes.bfloat16)
META = {"format": "pt"}
_rng = np.random.default_rng(0)

ARRAYS = {
    "f32.2d": _rng.standard_normal((5, 7)).astype(np.float32),
    "bf16.3d": _rng.standard_normal((4, 3, 8)).astype(BF16),
    "f16.1d": _rng.standard_normal(9).astype(np.float16),
    "i64.1d": np.arange(-20, 17, dtype=np.int64) * 1_000_000_007,
    "bool.2d": _rng.random((3, 5)) > 0.5,
    "f32.scalar": np.array(3.5, np.float32),
    "bf16.scalar": np.array(-2.25, BF16),
    "f32.empty": np.zeros((0, 4), np.float32),
    "i64.empty": np.zeros((3, 0, 2), np.int64),
    "f64.1d": _rng.standard_normal(3),
    "i8.1d": np.arange(-3, 4, dtype=np.int8),
    "u8.1d": np.arange(250, 256, dtype=np.uint8),
}
"""Most dtypes of port's table, 0-d and empty tensors, odd sizes between them: what
`safetensors.numpy.load_file` reads (it has no float8)."""
FLOAT8 = {
    "f8.1d": _rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn),
    "f8e5.2d": _rng.standard_normal((2, 3)).astype(ml_dtypes.float8_e5m2),
}


def specs(arrays: dict) -> list[OutTensor]:
    return [OutTensor(key, a.shape, a.dtype) for key, a in arrays.items()]


def write_all(directory: Path, arrays: dict, max_shard_size: int = 10**9, order=None, **options) -> Writer:
    """`arrays` written by one Writer into `directory` (made here), in `order` (default: as given)."""
    directory.mkdir(parents=True, exist_ok=True)
    with Writer(directory, specs(arrays), max_shard_size, metadata=META, **options) as writer:
        for key in order or arrays:
            writer.write(key, arrays[key])
    return writer


def contents(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bits (NaN and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ---------------------------------------------------------------------------- exact bytes


def test_one_file_reads_back_bit_identical(tmp_path):
    writer = write_all(tmp_path, ARRAYS)
    assert writer.files == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # no index for one file
    path = tmp_path / "model.safetensors"
    loaded = load_file(path)
    assert loaded.keys() == ARRAYS.keys()
    for key, array in ARRAYS.items():
        assert same_array(loaded[key], array), key
    with safe_open(path, "numpy") as f:
        assert f.metadata() == META
        assert set(f.keys()) == set(ARRAYS)
        assert same_array(f.get_tensor("bf16.3d"), ARRAYS["bf16.3d"])
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert n % 8 == 0
    assert json.loads(data[8 : 8 + n])["__metadata__"] == META


def test_bytes_are_the_safetensors_librarys(tmp_path):
    """Laid out as the library lays a file out (alignment first, then names): the same bytes."""
    write_all(tmp_path, ARRAYS | FLOAT8)
    assert (tmp_path / "model.safetensors").read_bytes() == save(ARRAYS | FLOAT8, metadata=META)


def filled(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """An array of safetensors dtype `name` whose bytes count up (mod 256): any bit pattern will do."""
    dtype = SAFETENSORS[name]
    raw = (np.arange(int(np.prod(shape)) * dtype.itemsize) % 256).astype(np.uint8)
    return (raw % 2 == 1).reshape(shape) if name == "BOOL" else raw.view(dtype).reshape(shape)


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.text("ab.é0", min_size=1, max_size=4),
        st.tuples(st.sampled_from(sorted(SAFETENSORS)), st.lists(st.integers(0, 3), max_size=3).map(tuple)),
        max_size=8,
    )
)
def test_every_dtype_mix_matches_the_library(tmp_path_factory, entries):
    """Any dtypes and names (non-ASCII ones sort by code point, as Rust sorts UTF-8): the library's bytes."""
    arrays = {key: filled(name, shape) for key, (name, shape) in entries.items()}
    directory = tmp_path_factory.mktemp("mix")
    write_all(directory, arrays)
    assert (directory / "model.safetensors").read_bytes() == save(arrays, metadata=META)


def test_library_order_covers_the_dtype_table():
    assert sorted(_LIBRARY_ORDER) == sorted(SAFETENSORS)


def test_offsets_say_where_each_tensor_lies(tmp_path):
    writer = write_all(tmp_path, ARRAYS, max_shard_size=200)
    assert list(writer.offsets) == list(ARRAYS)
    for key, (name, offset) in writer.offsets.items():
        data = (tmp_path / name).read_bytes()
        assert data[offset : offset + ARRAYS[key].nbytes] == ARRAYS[key].tobytes()


def test_write_order_does_not_matter(tmp_path):
    keys = list(ARRAYS)
    shuffled = random.Random(0).sample(keys, len(keys))
    for name, order in [("forward", keys), ("reversed", keys[::-1]), ("shuffled", shuffled)]:
        write_all(tmp_path / name, ARRAYS, max_shard_size=300, order=order)
    assert contents(tmp_path / "forward") == contents(tmp_path / "reversed") == contents(tmp_path / "shuffled")
    assert len(contents(tmp_path / "forward")) > 2


def test_threads_may_write_at_once(tmp_path):
    write_all(tmp_path / "one", ARRAYS, max_shard_size=300)
    (tmp_path / "many").mkdir()
    with Writer(tmp_path / "many", specs(ARRAYS), 300, metadata=META) as writer:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda key: writer.write(key, ARRAYS[key]), ARRAYS))
    assert contents(tmp_path / "one") == contents(tmp_path / "many")


def test_non_contiguous_data_is_written_in_c_order(tmp_path):
    base = _rng.standard_normal((6, 4)).astype(np.float32)
    arrays = {"t": base.T, "s": base[::2, 1:3], "f": np.asfortranarray(base)}
    write_all(tmp_path, arrays)
    loaded = load_file(tmp_path / "model.safetensors")
    for key, array in arrays.items():
        assert same_array(loaded[key], np.ascontiguousarray(array))


def test_no_tensors_is_one_empty_file(tmp_path):
    writer = write_all(tmp_path, {})
    assert writer.files == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == save({}, metadata=META)
    assert load_file(tmp_path / "model.safetensors") == {}


@pytest.mark.parametrize("max_shard_size", [10**9, 250])
def test_ports_reader_accepts_the_output(tmp_path, max_shard_size):
    arrays = ARRAYS | FLOAT8
    writer = write_all(tmp_path, arrays, max_shard_size=max_shard_size)
    assert (len(writer.files) > 1) == (max_shard_size == 250)
    (tmp_path / "config.json").write_text("{}")
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.tensors.keys() == arrays.keys()
        for key, array in arrays.items():
            info = ckpt.tensors[key]
            assert (info.file.name, info.offset) == writer.offsets[key]
            assert same_array(ckpt.read(key, tuple((0, n) for n in array.shape)), array), key


# ---------------------------------------------------------------------------- sharding


def hub_split(sizes: list[int], max_shard_size: int):
    """What huggingface_hub (and so `save_pretrained`) makes of tensors of these sizes."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    return split_state_dict_into_shards_factory(
        {f"t{i}": size for i, size in enumerate(sizes)},
        get_storage_size=lambda size: size,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=30), st.integers(1, 30))
def test_grouping_is_huggingface_hubs(sizes, max_shard_size):
    tensors = [OutTensor(f"t{i}", (size,), np.dtype(np.uint8)) for i, size in enumerate(sizes)]
    expected = hub_split(sizes, max_shard_size)
    assert [[t.key for t in group] for group in shard_files(tensors, max_shard_size)] == list(
        expected.filename_to_tensors.values()
    )


def test_a_tensor_larger_than_the_maximum_gets_a_file_before_the_open_one():
    tensors = [OutTensor(f"t{i}", (size,), np.dtype(np.uint8)) for i, size in enumerate([4, 4, 20, 4, 10])]
    groups = shard_files(tensors, 10)
    expected = [["t2"], ["t0", "t1"], ["t3"], ["t4"]]
    assert [[t.key for t in g] for g in groups] == expected
    assert list(hub_split([4, 4, 20, 4, 10], 10).filename_to_tensors.values()) == expected


def test_names_index_and_total_size_are_huggingface_hubs(tmp_path):
    arrays = {f"w{i}": np.full(size, i, np.uint8) for i, size in enumerate([30, 50, 10, 120, 0, 40, 60, 5])}
    writer = write_all(tmp_path, arrays, max_shard_size=100)
    expected = hub_split([a.nbytes for a in arrays.values()], 100)
    renamed = {f"w{key[1:]}": name for key, name in expected.tensor_to_filename.items()}
    names = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert writer.files == list(expected.filename_to_tensors) == names
    index = json.loads((tmp_path / INDEX).read_text())
    assert index == {"metadata": {"total_size": expected.metadata["total_size"]}, "weight_map": renamed}
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in arrays.values())
    text = (tmp_path / INDEX).read_text()
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"  # as transformers writes it
    assert sorted(os.listdir(tmp_path)) == sorted([*writer.files, INDEX])


def test_the_same_files_as_save_pretrained_and_transformers_loads_them(tmp_path):
    """A sharded GPT-2 written tensor by tensor: save_pretrained's files, byte for byte."""
    pytest.importorskip("torch", exc_type=ImportError)
    import torch
    import transformers

    model = torch_gpt2()
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    hf_index = json.loads((tmp_path / "hf" / INDEX).read_text())
    kept = hf_index["weight_map"]  # without the tied lm_head
    arrays = {key: t.detach().numpy() for key, t in model.state_dict().items() if key in kept}
    assert arrays.keys() == kept.keys()

    out = tmp_path / "port"
    writer = write_all(out, arrays, max_shard_size=parse_size("40KB"), order=list(arrays)[::-1])
    assert len(writer.files) > 2
    for name in writer.files:
        assert (out / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    index = json.loads((out / INDEX).read_text())
    assert index["weight_map"] == hf_index["weight_map"]
    assert index["metadata"]["total_size"] == hf_index["metadata"]["total_size"]

    (out / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids = torch.tensor(np.random.default_rng(0).integers(0, GPT2_CONFIG["vocab_size"], (1, 8)))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


# ---------------------------------------------------------------------------- several writers


def test_two_writers_share_the_keys(tmp_path):
    write_all(tmp_path / "one", ARRAYS, max_shard_size=300)
    keys = list(ARRAYS)
    first, second = keys[::2], keys[1::2]
    (tmp_path / "two").mkdir()
    creator = Writer(tmp_path / "two", specs(ARRAYS), 300, metadata=META, write=first, create=True)
    joiner = Writer(tmp_path / "two", specs(ARRAYS), 300, metadata=META, write=second, create=False)
    for key in second:
        joiner.write(key, ARRAYS[key])
    joiner.close()
    for key in first:
        creator.write(key, ARRAYS[key])
    creator.close()
    assert contents(tmp_path / "one") == contents(tmp_path / "two")


def test_a_joining_writer_checks_the_files(tmp_path):
    (tmp_path / "none").mkdir()
    with pytest.raises(OutputError, match="cannot open for writing"):
        Writer(tmp_path / "none", specs(ARRAYS), 300, metadata=META, create=False)
    write_all(tmp_path / "out", ARRAYS)
    other = {**ARRAYS, "f32.2d": np.zeros((5, 8), np.float32)}
    with pytest.raises(OutputError, match="not the file this export lays out"):
        Writer(tmp_path / "out", specs(other), 10**9, metadata=META, create=False)
    with pytest.raises(OutputError, match="not the file this export lays out"):
        Writer(tmp_path / "out", specs(ARRAYS), 10**9, metadata={"format": "np"}, create=False)


def test_a_writer_with_no_keys_opens_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    with Writer(tmp_path / "empty", specs(ARRAYS), 300, write=[], create=False) as writer:
        assert writer.missing == []


# ---------------------------------------------------------------------------- errors


def one_line_error(call, match: str, kind=OutputError) -> str:
    with pytest.raises(kind, match=match) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_writes_are_one_line_errors(tmp_path):
    writer = Writer(tmp_path, specs(ARRAYS), 300, metadata=META, write=[k for k in ARRAYS if k != "u8.1d"])
    wrong = np.zeros((7, 5), np.float32)
    one_line_error(lambda: writer.write("f32.2d", wrong), r"expected float32\[5, 7\], got float32\[7, 5\]")
    one_line_error(lambda: writer.write("f32.2d", ARRAYS["f32.2d"].astype(np.float64)), r"got float64\[5, 7\]")
    one_line_error(lambda: writer.write("f32.2d", ARRAYS["f32.2d"].astype(">f4")), "expected float32")
    one_line_error(lambda: writer.write("nope\n", ARRAYS["f32.2d"]), r"tensor 'nope\\n' is not one of the tensors")
    one_line_error(lambda: writer.write("u8.1d", ARRAYS["u8.1d"]), "another writer's to write")
    writer.write("f32.2d", ARRAYS["f32.2d"])
    one_line_error(lambda: writer.write("f32.2d", ARRAYS["f32.2d"]), "'f32.2d' is written twice")
    message = one_line_error(writer.close, r"tensor 'bf16.3d' was never written \(and 9 more\)")
    assert str(tmp_path) in message
    writer.close()  # closed, with its files released, the first time
    one_line_error(lambda: writer.write("bf16.3d", ARRAYS["bf16.3d"]), "the writer is closed")


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_an_exception_in_the_block_releases_without_checking(tmp_path):
    before = open_files()
    with pytest.raises(KeyError, match="the producer failed"):  # not OutputError: nothing was checked
        with Writer(tmp_path, specs(ARRAYS), 300, metadata=META) as writer:
            writer.write("f32.2d", ARRAYS["f32.2d"])
            assert open_files() > before
            raise KeyError("the producer failed")
    assert open_files() == before
    assert writer.missing[0] == "bf16.3d"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_failed_creation_removes_what_it_created(tmp_path):
    """The last file's name is taken: the files created before it, and their descriptors, go again."""
    names = file_names(len(shard_files(specs(ARRAYS), 300)))
    assert len(names) > 2
    (tmp_path / names[-1]).write_bytes(b"taken")
    before = open_files()
    one_line_error(lambda: Writer(tmp_path, specs(ARRAYS), 300), f"{names[-1]}: cannot create: File exists")
    assert open_files() == before
    assert os.listdir(tmp_path) == [names[-1]]
    assert (tmp_path / names[-1]).read_bytes() == b"taken"


def test_bad_tensor_lists_are_refused_before_any_file(tmp_path):
    f32 = np.dtype(np.float32)
    cases = [
        ([OutTensor("a", (1,), f32), OutTensor("a", (2,), f32)], {}, "'a' is given twice"),
        ([OutTensor("__metadata__", (1,), f32)], {}, "not a name a safetensors file can hold"),
        ([OutTensor("u", (1,), np.dtype(np.uint16))], {}, "dtype uint16 has no safetensors name"),
        ([OutTensor("c", (1,), np.dtype(np.complex64))], {}, "dtype complex64"),
        ([OutTensor("n", (-1,), f32)], {}, "negative size"),
        ([OutTensor("a", (1,), f32)], {"metadata": {"format": 1}}, "`metadata` must map strings to strings"),
        ([OutTensor("a", (1,), f32)], {"write": ["b"]}, "`write` names tensor 'b'"),
        ([OutTensor("\ud800", (1,), f32)], {}, "not valid Unicode"),
    ]
    for tensors, options, match in cases:
        one_line_error(lambda: Writer(tmp_path, tensors, 100, **options), match)
    assert os.listdir(tmp_path) == []


def test_existing_files_and_links_are_never_written_through(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"someone else's")
    one_line_error(lambda: Writer(tmp_path, specs(ARRAYS), 10**9), "model.safetensors: cannot create: File exists")
    assert (tmp_path / "model.safetensors").read_bytes() == b"someone else's"

    target = tmp_path / "target"
    target.write_bytes(b"keep")
    out = tmp_path / "linked"
    out.mkdir()
    (out / "model.safetensors").symlink_to(target)
    one_line_error(lambda: Writer(out, specs(ARRAYS), 10**9), "cannot create: File exists")
    one_line_error(lambda: Writer(out, specs(ARRAYS), 10**9, create=False), "cannot open for writing")
    assert target.read_bytes() == b"keep"

    one_line_error(lambda: Writer(tmp_path / "missing", specs(ARRAYS), 10**9), "cannot open the output directory")


def test_an_index_in_the_way_is_refused(tmp_path):
    (tmp_path / INDEX).write_text("{}")
    one_line_error(lambda: Writer(tmp_path, specs(ARRAYS), 300), f"{INDEX}: cannot create: File exists")


_FULL_DISK = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    import numpy as np
    from port._errors import OutputError
    from port._export._safetensors import OutTensor, Writer

    directory, when = Path(sys.argv[1]), sys.argv[2]
    tensor = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    if when == "create":
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        writer = Writer(directory, [OutTensor("big", tensor.shape, tensor.dtype)], 10**9, metadata={"format": "pt"})
        # The file is sized already: the limit now stops the data half-way (a short write, then EFBIG).
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 19, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        with writer:
            writer.write("big", tensor)
    except OutputError as e:
        print(e)
        sys.exit(3)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["create", "write"])
def test_a_full_disk_is_one_line_error(tmp_path, when):
    """A file size limit (RLIMIT_FSIZE, set in a child process) fails writes with EFBIG, as a full disk does."""
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path), when], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 3, result.stderr
    assert os.listdir(tmp_path) == (["model.safetensors"] if when == "write" else [])
    message = result.stdout.strip()
    assert "\n" not in message and "model.safetensors" in message and "File too large" in message
    assert ("cannot size it to" if when == "create" else "cannot write tensor 'big'") in message


# ---------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "text, size",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("2GiB", 2 * 2**30),
        ("100KB", 100_000),
        ("1000", 1000),
        (1000, 1000),
        ("7B", 7),
        ("5gb", 5 * 10**9),
        (" 3 MiB ", 3 * 2**20),
        ("4.35MB", 4_350_000),
        ("1TB", 10**12),
        ("1TiB", 2**40),
        (".5KB", 500),
        ("2.KB", 2000),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text",
    ["", "GB", "5XB", "five", "-1GB", "0", 0, -5, "0.0001KB", "1e9", "nan", "inf", True, None, 2.5, "5 G B", "5GB\nx"],
)
def test_parse_size_refuses(text):
    message = one_line_error(lambda: parse_size(text, "--max-shard-size"), "--max-shard-size", kind=PortError)
    assert "expected a size" in message


def test_parse_size_names_its_parameter():
    one_line_error(lambda: parse_size("x", name="chunk"), r"^chunk=x: expected a size", kind=PortError)


# ---------------------------------------------------------------------------- memory


def test_writing_adds_at_most_the_tensor_to_memory(tmp_path):
    """A 200 MB tensor: nothing more when C-contiguous, at most one copy when it is not."""
    size = 200 * 10**6
    array = np.ones((size // 4000, 1000), np.float32)  # touched: resident before measuring
    transposed = np.ones((1000, size // 4000), np.float32).T
    tensors = [OutTensor("c", array.shape, array.dtype), OutTensor("t", transposed.shape, transposed.dtype)]
    with Writer(tmp_path, tensors, 10**10, metadata=META) as writer:
        with PeakMemory() as contiguous:
            start = contiguous.bytes
            writer.write("c", array)
        with PeakMemory() as strided:
            strided_start = strided.bytes
            writer.write("t", transposed)
        writer.close(sync=False)
    assert contiguous.bytes - start < 16 * 2**20
    assert strided.bytes - strided_start < 1.1 * size
    assert os.path.getsize(tmp_path / "model.safetensors") > 2 * size


def _cuts(n: int, rng: random.Random) -> list[tuple[int, int]]:
    """`range(n)` cut into consecutive pieces at random points."""
    points = sorted(rng.sample(range(1, n), rng.randint(0, min(3, n - 1)))) if n > 1 else []
    bounds = [0, *points, n]
    return list(zip(bounds, bounds[1:]))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_boxes_that_tile_a_tensor_write_the_same_bytes_as_the_whole(tmp_path_factory, seed):
    rng = random.Random(seed)
    shapes = {"a": (rng.randint(1, 6), rng.randint(1, 7), rng.randint(1, 5)), "b": (rng.randint(1, 9),)}
    arrays = {k: np.random.default_rng(seed).standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    tensors = [OutTensor(k, v.shape, v.dtype) for k, v in arrays.items()]
    whole, boxes = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("boxes")
    with Writer(whole, tensors, 10**9, metadata={"format": "pt"}) as writer:
        for key, value in arrays.items():
            writer.write(key, value)
    with Writer(boxes, tensors, 10**9, metadata={"format": "pt"}) as writer:
        for key, value in arrays.items():
            pieces = [_cuts(n, rng) for n in value.shape]
            order = [tuple(box) for box in np.ndindex(*map(len, pieces))]
            rng.shuffle(order)
            for choice in order:
                region = tuple(pieces[d][i] for d, i in enumerate(choice))
                writer.write_region(key, region, value[tuple(slice(a, b) for a, b in region)])
        assert writer.missing == []
    assert (whole / "model.safetensors").read_bytes() == (boxes / "model.safetensors").read_bytes()


def test_a_box_that_does_not_fit_or_comes_after_the_whole_is_refused(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with Writer(tmp_path, [OutTensor("x", x.shape, x.dtype)], 10**9) as writer:
        with pytest.raises(OutputError, match=r"box \[\[0, 4\], \[0, 4\]\] of float32\[4, 4\] does not fit"):
            writer.write_region("x", ((0, 4), (0, 4)), np.zeros((4, 4), np.float32))
        with pytest.raises(OutputError, match="does not fit"):
            writer.write_region("x", ((0, 3), (0, 2)), np.zeros((3, 2), np.float64))
        writer.write_region("x", ((0, 3), (0, 4)), x)
        with pytest.raises(OutputError, match="written twice"):
            writer.write_region("x", ((0, 1), (0, 1)), x[:1, :1])


def test_boxes_from_two_writers_make_one_file(tmp_path):
    x = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    tensors = [OutTensor("x", x.shape, x.dtype)]
    with Writer(tmp_path, tensors, 10**9) as first:
        with Writer(tmp_path, tensors, 10**9, create=False) as second:
            first.write_region("x", ((0, 8), (0, 3)), x[:, :3])
            second.write_region("x", ((0, 8), (3, 6)), x[:, 3:])
            second.close(check=False)  # its half: the whole is the caller's to check
        first.close(check=False)
    np.testing.assert_array_equal(load_file(tmp_path / "model.safetensors")["x"], x)


# ---------------------------------------------------------------------------- writing to disk as it goes


def test_writeback_starts_as_each_unit_is_written(tmp_path, monkeypatch):
    """Each `_CHUNK` written (and each box's span of the file) is handed to the kernel to write to disk
    at once, not left for the final flush; the bytes are the same as ever."""
    import port._disk as writer_module

    started = []
    monkeypatch.setattr(writer_module, "_CHUNK", 1000)
    monkeypatch.setattr(
        writer_module, "_SYNC_FILE_RANGE", lambda fd, offset, n, flags: started.append((offset, n, flags))
    )
    big = np.arange(2600, dtype=np.float32)  # 10,400 bytes: eleven units
    box = np.arange(40 * 50, dtype=np.float32).reshape(40, 50)
    tensors = [OutTensor("big", big.shape, big.dtype), OutTensor("box", box.shape, box.dtype)]
    with Writer(tmp_path, tensors, 10**9) as writer:
        assert started == [(0, writer.offsets["big"][1], 2)]  # the header
        started.clear()
        writer.write("big", big)
        start = writer.offsets["big"][1]
        assert started == [(start + i, min(1000, big.nbytes - i), 2) for i in range(0, big.nbytes, 1000)]
        started.clear()
        writer.write_region("box", ((0, 40), (0, 25)), box[:, :25])
        writer.write_region("box", ((0, 40), (25, 50)), box[:, 25:])
    at = writer.offsets["box"][1]
    spans = sorted((offset, offset + n) for offset, n, _ in started)
    assert spans[0][0] == at and spans[-1][1] == at + box.nbytes  # every row of both boxes was covered
    assert all(b - a <= 1000 + 100 for a, b in spans)  # in units of about `_CHUNK`, a row at most over
    loaded = load_file(tmp_path / "model.safetensors")
    assert same_array(loaded["big"], big) and same_array(loaded["box"], box)


def test_writeback_is_the_kernels_where_it_has_one():
    import port._disk as writer_module

    if sys.platform.startswith("linux"):
        assert writer_module._SYNC_FILE_RANGE is not None
