"""PyTorch's own format (`pytorch_model.bin`, a `torch.save` zip), read in place by `port._sources._pytorch`.

Checkpoints are written by `torch.save` and by Hugging Face (`huggingface_hub.save_torch_state_dict(...,
safe_serialization=False)`: the `pytorch_model-0000k-of-0000n.bin` shards and their index that
`save_pretrained(..., safe_serialization=False)` wrote before transformers 5 dropped the option;
transformers 5.23 still loads them). Converted models give transformers' logits; each device block
reads exactly its region of the `.bin`; and a `.bin` is untrusted: a pickle naming `os.system` runs
nothing, and a truncated, corrupt, compressed, legacy, big-endian or non-row-major file is one line.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import equinox as eqx
import ml_dtypes
import numpy as np
import pytest

import port
import port._sources._directory
import port._sources._pytorch
from port._errors import CheckpointError
from port._sources import LocalCheckpoint

from helpers import (
    INPUT_IDS,
    assert_blocks_read_exactly,
    logits,
    one_line,
    place_on,
    run_port,
    torch_gpt2,
    torch_llama,
    torch_logits,
    transformers_or_skip,
)

torch = pytest.importorskip("torch", exc_type=ImportError)


# ---------------------------------------------------------------- writing checkpoints


def save_bin(model, directory: Path, shard_size: str | None = None) -> Path:
    """`model`'s config and state dict as Hugging Face writes a `.bin` checkpoint: one `pytorch_model.bin`,
    or (with `shard_size`) `pytorch_model-0000k-of-0000n.bin` shards and `pytorch_model.bin.index.json`."""
    from huggingface_hub import save_torch_state_dict

    model.config.save_pretrained(directory)
    save_torch_state_dict(model.state_dict(), directory, safe_serialization=False, max_shard_size=shard_size or "5GB")
    return directory


def torch_save(directory: Path, tensors: dict, **options) -> Path:
    """`tensors` written by `torch.save` as `directory/pytorch_model.bin`, with an empty config."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text("{}")
    torch.save(tensors, directory / "pytorch_model.bin", **options)
    return directory / "pytorch_model.bin"


def rezip(path: Path, replace: dict | None = None, compress: tuple = (), drop: tuple = ()) -> Path:
    """The zip `path` rewritten (by Python's `zipfile`) with records whose names end in a key of
    `replace` replaced, those ending in one of `compress` deflated, those in `drop` left out."""
    replace = replace or {}
    with zipfile.ZipFile(path) as source:
        records = [(info.filename, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(path, "w") as out:
        for name, data in records:
            if drop and name.endswith(drop):
                continue
            data = next((v for k, v in replace.items() if name.endswith(k)), data)
            method = zipfile.ZIP_DEFLATED if compress and name.endswith(compress) else zipfile.ZIP_STORED
            out.writestr(name, data, compress_type=method)
    return path


def central_entry(raw: bytes, record: str) -> int:
    """Where the central directory header of the record named `record` starts in the zip `raw`."""
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        length = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46 : at + 46 + length].decode().endswith(record):
            return at
        at = raw.find(b"PK\x01\x02", at + 4)
    raise AssertionError(record)


def as_numpy(tensor) -> np.ndarray:
    """A CPU tensor's values as NumPy, bfloat16 and float8 included (through their bits)."""
    kinds = {
        torch.bfloat16: ml_dtypes.bfloat16,
        torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
        torch.float8_e5m2: ml_dtypes.float8_e5m2,
    }
    if tensor.dtype in kinds:
        bits = tensor.view(torch.int16 if tensor.dtype == torch.bfloat16 else torch.uint8)
        return bits.numpy().view(kinds[tensor.dtype])
    return tensor.numpy()


def refused(path: Path, *substrings: str) -> str:
    """Opening the checkpoint at `path` (a file or its directory) is one CheckpointError line naming the file."""
    directory = path if path.is_dir() else path.parent
    with pytest.raises(CheckpointError) as error:
        port.open_checkpoint(directory)
    message = str(error.value)
    assert "\n" not in message
    for s in substrings:
        assert s in message, f"{s!r} not in {message!r}"
    return message


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """get(arch): (single .bin dir, sharded .bin dir, safetensors dir, PyTorch logits), built once."""
    transformers_or_skip()
    made = {}

    def get(arch):
        if arch not in made:
            model = torch_gpt2() if arch == "gpt2" else torch_llama()
            root = tmp_path_factory.mktemp(arch)
            single = save_bin(model, root / "single")
            sharded = save_bin(model, root / "sharded", shard_size="20KB")
            model.save_pretrained(root / "safetensors")
            made[arch] = single, sharded, root / "safetensors", torch_logits(model)
        return made[arch]

    return get


# ---------------------------------------------------------------- reading


def test_every_dtype_and_view_reads_torchs_values(tmp_path):
    """Each dtype port reads, a scalar, an empty tensor, a row view at a storage offset, and tied
    entries over one storage: whole tensors and regions are torch's values, bytes counted exactly."""
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(5, 6, generator=generator)
    tensors = {
        "f32": matrix,
        "tied": matrix,
        "row": matrix[3],
        "rows": matrix[1:4],
        "f64": torch.randn(3, 2, dtype=torch.float64, generator=generator),
        "f16": torch.randn(4, 3, generator=generator).half(),
        "bf16": torch.randn(7, 2, generator=generator).bfloat16(),
        "e4m3": torch.randn(6, generator=generator).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(2, 3, generator=generator).to(torch.float8_e5m2),
        "i64": torch.arange(-6, 6).reshape(3, 4),
        "i32": torch.arange(5, dtype=torch.int32),
        "i16": torch.arange(4, dtype=torch.int16),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
    }
    path = torch_save(tmp_path / "ckpt", tensors)
    with port.open_checkpoint(tmp_path / "ckpt") as ckpt:
        assert set(ckpt.tensors) == set(tensors)
        assert ckpt.tensors["tied"].offset == ckpt.tensors["f32"].offset
        assert ckpt.tensors["row"].offset == ckpt.tensors["f32"].offset + 3 * 6 * 4
        for key, tensor in tensors.items():
            info = ckpt.tensors[key]
            expected = as_numpy(tensor.detach())
            assert info.file == path and info.shape == expected.shape and info.dtype == expected.dtype, key
            whole = ckpt.read(key, tuple((0, n) for n in info.shape))
            assert whole.tobytes() == expected.tobytes(), key
        before = ckpt.bytes_read
        block = ckpt.read("rows", ((1, 3), (2, 5)))
        np.testing.assert_array_equal(block, matrix[2:4, 2:5].numpy())
        assert ckpt.bytes_read - before == 2 * 3 * 4


def test_no_byteorder_record_reads_little_endian(tmp_path):
    """Files from PyTorch before 2.1 have no byteorder record: their data is little-endian."""
    torch_save(tmp_path / "ckpt", {"w": torch.arange(6.0).reshape(2, 3)}, _disable_byteorder_record=True)
    with port.open_checkpoint(tmp_path / "ckpt") as ckpt:
        np.testing.assert_array_equal(ckpt.read("w", ((0, 2), (0, 3))), np.arange(6.0, dtype=np.float32).reshape(2, 3))


@pytest.mark.slow
def test_pytorch_is_not_needed(tmp_path):
    """Reading a .bin imports no torch: a process where `import torch` fails reads it."""
    torch_save(tmp_path / "ckpt", {"w": torch.arange(4.0)})
    code = (
        "import sys; sys.modules['torch'] = None  # import torch now raises ImportError\n"
        "import port._sources\n"
        "ckpt = port._sources.open_checkpoint(sys.argv[1])\n"
        "print(ckpt.read('w', ((1, 3),)).tolist(), sys.modules['torch'])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, tmp_path / "ckpt"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[1.0, 2.0] None"


def test_hugging_face_layouts_are_found(models):
    """The single file and the shards with their index (a layout transformers loads); the tied
    lm_head is the embedding's bytes."""
    single, sharded, _, expected = models("gpt2")
    assert sorted(p.name for p in single.iterdir()) == ["config.json", "pytorch_model.bin"]
    shards = sorted(p.name for p in sharded.glob("*.bin"))
    assert len(shards) > 1 and shards[0] == f"pytorch_model-00001-of-{len(shards):05d}.bin"
    assert (sharded / "pytorch_model.bin.index.json").is_file()
    theirs = transformers_or_skip().GPT2LMHeadModel.from_pretrained(sharded).eval()
    np.testing.assert_allclose(torch_logits(theirs), expected, atol=1e-4, rtol=0)
    with port.open_checkpoint(single) as one, port.open_checkpoint(sharded) as many:
        assert one.tensors.keys() == many.tensors.keys()
        assert {info.file.name for info in many.tensors.values()} == set(shards)
        wte, head = one.tensors["transformer.wte.weight"], one.tensors["lm_head.weight"]
        assert (wte.offset, wte.shape) == (head.offset, head.shape)
        for key, info in one.tensors.items():
            region = tuple((0, n) for n in info.shape)
            assert one.read(key, region).tobytes() == many.read(key, region).tobytes(), key


def test_safetensors_are_preferred_and_bin_index_names_are_checked(tmp_path, models):
    single, _, safetensors, _ = models("gpt2")
    both = tmp_path / "both"
    both.mkdir()
    for source in (single / "pytorch_model.bin", safetensors / "model.safetensors", single / "config.json"):
        os.link(source, both / source.name)
    with port.open_checkpoint(both) as ckpt:
        assert {info.file.name for info in ckpt.tensors.values()} == {"model.safetensors"}

    outside = tmp_path / "outside"
    outside.mkdir()
    os.link(single / "config.json", outside / "config.json")
    for name, expected in [
        ("../both/pytorch_model.bin", "not a plain file name"),
        ("weights.pt", "not a .bin file"),
        ("gone.bin", "which is not in"),
    ]:
        if name == "weights.pt":
            (outside / name).write_bytes(b"")
        (outside / "pytorch_model.bin.index.json").write_text(f'{{"weight_map": {{"w": "{name}"}}}}')
        refused(outside, "pytorch_model.bin.index.json", expected)
    (outside / "pytorch_model.bin.index.json").unlink()
    refused(outside, "no weights")


# ---------------------------------------------------------------- conversion


@pytest.mark.parametrize(
    "arch, layout, mesh",
    [
        ("gpt2", "single", "1x1"),
        ("gpt2", "sharded", "4x2"),
        ("llama", "single", "4x2"),
        ("llama", "sharded", "1x1"),
    ],
)
def test_logits_match_transformers(models, arch, layout, mesh):
    single, sharded, _, expected = models(arch)
    model = port.load(single if layout == "single" else sharded, mesh=port.make_mesh(mesh))
    ours = np.asarray(logits(model, INPUT_IDS))
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def test_same_arrays_as_from_safetensors(models):
    """The sharded .bin and save_pretrained's safetensors convert to the same arrays, bit for bit."""
    _, sharded, safetensors, _ = models("llama")
    mesh = port.make_mesh("4x2")
    ours = port._skeleton.leaves(eqx.filter(port.load(sharded, mesh=mesh), eqx.is_array))
    theirs = port._skeleton.leaves(eqx.filter(port.load(safetensors, mesh=mesh), eqx.is_array))
    assert ours.keys() == theirs.keys()
    for path, array in ours.items():
        assert array.sharding == theirs[path].sharding, path
        assert np.asarray(array).tobytes() == np.asarray(theirs[path]).tobytes(), path


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_each_block_reads_exactly_its_region(models, reads, arch):
    """On 4x2 each device block reads exactly its source region of the .bin, each byte once (one file:
    the `reads` fixture tells bytes apart by their offset in the file)."""
    single, _, _, _ = models(arch)
    mesh = port.make_mesh("4x2")
    recipe, total, infos = place_on(single, mesh)
    per_block, elsewhere = reads()
    assert_blocks_read_exactly(per_block, recipe, infos, mesh.shape)
    assert total == recipe.read_bytes == sum(len(files) for _, _, files in per_block) + len(elsewhere)
    used = {key for leaf in recipe.leaves for key in leaf.keys}
    assert total == sum(infos[key].nbytes for key in used)  # the tied lm_head.weight is never read


# ---------------------------------------------------------------- untrusted files


class Payload:
    """Pickles as a call of `function(argument)`: what a malicious data.pkl holds."""

    def __init__(self, function, argument):
        self.function, self.argument = function, argument

    def __reduce__(self):
        return self.function, (self.argument,)


def payloads(marker: Path) -> dict[str, bytes]:
    """data.pkl payloads that create `marker` when unpickled by `pickle.load` (or `torch.load` without
    weights_only): a hand-written `os system` GLOBAL, `posix.system` as pickle writes it, and
    `builtins.eval` through protocol 4's STACK_GLOBAL, inside a state dict."""
    command = f"touch {marker}".encode()
    return {
        "os.system": b"\x80\x02cos\nsystem\nX" + struct.pack("<I", len(command)) + command + b"\x85R.",
        "posix.system": pickle.dumps({"w": Payload(os.system, command.decode())}, protocol=2),
        "builtins.eval": pickle.dumps({"w": Payload(eval, f"__import__('os').system('touch {marker}')")}, protocol=4),
    }


@pytest.mark.slow
def test_payloads_are_live(tmp_path):
    """The payloads do run under plain pickle: refusing them below means something."""
    for name, payload in payloads(tmp_path / "ran").items():
        (tmp_path / "payload.pkl").write_bytes(payload)
        code = "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())"
        subprocess.run([sys.executable, "-c", code, str(tmp_path / "payload.pkl")], check=True, timeout=60)
        assert (tmp_path / "ran").exists(), name
        (tmp_path / "ran").unlink()


@pytest.mark.slow
def test_a_pickle_naming_os_system_is_refused_by_the_command(tmp_path):
    marker = tmp_path / "marker"
    path = torch_save(tmp_path / "ckpt", {"w": torch.zeros(3)})
    rezip(path, {"data.pkl": payloads(marker)["os.system"]})
    result = run_port("convert", tmp_path / "ckpt", "--mesh", "1x1", "--out", tmp_path / "out", timeout=120)
    one_line(result, "pytorch_model.bin", "'os.system'", "nothing was imported or run")
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["os.system", "posix.system", "builtins.eval"])
def test_a_pickle_naming_a_foreign_global_is_refused(tmp_path, name):
    marker = tmp_path / "marker"
    path = torch_save(tmp_path / "ckpt", {"w": torch.zeros(3)})
    rezip(path, {"data.pkl": payloads(marker)[name]})
    refused(path, "pytorch_model.bin: data.pkl names the global", repr(name))
    assert not marker.exists()


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _local_header_smashed(path: Path) -> None:
    with zipfile.ZipFile(path) as z:
        at = next(i.header_offset for i in z.infolist() if i.filename.endswith("data/0"))
    raw = bytearray(path.read_bytes())
    raw[at : at + 4] = b"XXXX"
    path.write_bytes(bytes(raw))


def _record_outside(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    at = central_entry(bytes(raw), "data/0")
    raw[at + 42 : at + 46] = struct.pack("<I", len(raw) - 10)  # the local header's offset: past the directory
    path.write_bytes(bytes(raw))


def _binunicode(text: str) -> bytes:
    return b"X" + struct.pack("<I", len(text)) + text.encode()


def _long4(n: int) -> bytes:
    raw = n.to_bytes(n.bit_length() // 8 + 1, "little", signed=True)
    return b"\x8b" + struct.pack("<I", len(raw)) + raw


def huge(what: str) -> bytes:
    """The data.pkl of `{"w": a float32 tensor of 3}` as torch.save writes it (storage '0'), but with
    a 5000-digit number (which Python will not print) for its storage's `numel`, or its `offset`,
    `size` or `stride`."""
    numbers = {"numel": b"K\x03", "offset": b"K\x00", "size": b"K\x03", "stride": b"K\x01"}
    numbers[what] = _long4(10**5000)
    storage = b"(" + _binunicode("storage") + b"ctorch\nFloatStorage\n" + _binunicode("0") + _binunicode("cpu")
    return (
        b"\x80\x02}"
        + _binunicode("w")
        + b"ctorch._utils\n_rebuild_tensor_v2\n("
        + storage
        + numbers["numel"]
        + b"tQ"
        + numbers["offset"]
        + numbers["size"]
        + b"\x85"
        + numbers["stride"]
        + b"\x85\x89ccollections\nOrderedDict\n)RtRs."
    )


CASES = {  # name: (state dict, torch.save options, how the file is broken, what the line says)
    "truncated": ({"w": torch.zeros(64)}, {}, _truncated, "truncated or corrupt zip"),
    "local header": ({"w": torch.zeros(64)}, {}, _local_header_smashed, "the local header of record"),
    "record outside": ({"w": torch.zeros(64)}, {}, _record_outside, "starts outside the archive"),
    "record short": (
        {"w": torch.zeros(64)},
        {},
        lambda p: rezip(p, {"data/0": b"\0" * 100}),
        "holds 100 bytes but its storage of 64 float32 needs 256",
    ),
    "record missing": ({"w": torch.zeros(4)}, {}, lambda p: rezip(p, drop=("data/0",)), "has no record"),
    "pickle cut": (
        {"w": torch.zeros(4)},
        {},
        lambda p: rezip(p, {"data.pkl": pickle.dumps({"w": 1})[:-3]}),
        "corrupt data.pkl",
    ),
    "not a state dict": ({"model": {"w": torch.zeros(4)}}, {}, None, "entry 'model' is a dict, not a tensor"),
    "no data.pkl": ({"w": torch.zeros(4)}, {}, lambda p: rezip(p, drop=("data.pkl",)), "a zip without data.pkl"),
    "compressed data": (
        {"w": torch.zeros(64)},
        {},
        lambda p: rezip(p, compress=("data/0",)),
        "data/0' is compressed (method 8)",
    ),
    "compressed pickle": (
        {"w": torch.zeros(4)},
        {},
        lambda p: rezip(p, compress=("data.pkl",)),
        "data.pkl' is compressed (method 8)",
    ),
    "legacy": ({"w": torch.zeros(4)}, {"_use_new_zipfile_serialization": False}, None, "the legacy torch.save format"),
    "big-endian": ({"w": torch.zeros(4)}, {}, lambda p: rezip(p, {"byteorder": b"big"}), "saved big-endian"),
    "transposed": (
        {"w": torch.zeros(3, 4).t()},
        {},
        None,
        "tensor 'w' is not stored row-major (shape [4, 3], strides [1, 4])",
    ),
    "column": ({"w": torch.zeros(3, 4)[:, 1]}, {}, None, "tensor 'w' is not stored row-major"),
    "broadcast": ({"w": torch.zeros(4).expand(3, 4)}, {}, None, "tensor 'w' is not stored row-major"),
    "complex": (
        {"w": torch.zeros(2, dtype=torch.complex64)},
        {},
        None,
        "holds a torch.ComplexFloatStorage, a storage of a dtype port does not read",
    ),
    "uint16": ({"w": torch.zeros(2, dtype=torch.uint16)}, {}, None, "dtype torch.uint16"),
    "memo jump": (
        {"w": torch.zeros(4)},
        {},
        lambda p: rezip(p, {"data.pkl": b"\x80\x02}r\x00\x00\x00\x40."}),
        "memo index 1073741824 out of order",
    ),
    "range": (
        {"w": torch.zeros(4)},
        {},
        lambda p: rezip(p, {"data.pkl": pickle.dumps(range(3), protocol=4)}),
        "data.pkl names the global 'builtins.range'",
    ),
    "instance": (
        {"w": torch.zeros(4)},
        {},
        lambda p: rezip(p, {"data.pkl": b"(i__main__\nX\n."}),
        "the pickle opcode INST",
    ),
    "parameter of a dict": (
        {"w": torch.zeros(4)},
        {},
        lambda p: rezip(
            p,
            {
                "data.pkl": (
                    b"\x80\x02}"
                    + _binunicode("w")
                    + b"ctorch._utils\n_rebuild_parameter\nccollections\nOrderedDict\n)R"
                    b"\x89)\x87Rs."
                )
            },
        ),
        "corrupt data.pkl: a parameter whose data is not a tensor",
    ),
    **{
        f"{what} of 5000 digits": (
            {"w": torch.zeros(3)},
            {},
            lambda p, what=what: rezip(p, {"data.pkl": huge(what)}),
            expected,
        )
        for what, expected in [
            ("numel", "storage '0' claims more than 2**63 - 1 bytes"),
            *(
                (what, "tensor 'w' has an offset, size or stride past 2**63 - 1")
                for what in ("offset", "size", "stride")
            ),
        ]
    },
}


@pytest.mark.parametrize("case", CASES)
def test_bad_files_are_one_line(tmp_path, case):
    tensors, options, breaks, expected = CASES[case]
    path = torch_save(tmp_path / "ckpt", tensors, **options)
    if breaks is not None:
        breaks(path)
    refused(path, "pytorch_model.bin: ", expected)


@pytest.mark.slow
def test_a_truncated_file_is_one_line_through_the_command(tmp_path):
    path = torch_save(tmp_path / "ckpt", {"w": torch.zeros(64)})
    _truncated(path)
    one_line(
        run_port("convert", tmp_path / "ckpt", "--mesh", "1x1", "--out", tmp_path / "out", timeout=120),
        "pytorch_model.bin",
        "truncated or corrupt zip",
    )


def test_every_cut_and_mutant_is_refused_or_read(tmp_path):
    """Every truncation of a small .bin is refused; random changes to its zip structure and pickle
    (never to tensor bytes) are refused in one line naming the file, or read within the file."""
    path = torch_save(tmp_path / "ckpt", {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2).half()})
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        local = [(i.header_offset, i.file_size) for i in z.infolist() if "/data/" in i.filename]
    data = []  # tensor bytes: after each data record's local header, its name and extra field
    for at, size in local:
        start = at + 30 + sum(struct.unpack_from("<2H", raw, at + 26))
        data.append((start, start + size))
    for size in range(len(raw)):
        path.write_bytes(raw[:size])
        with pytest.raises(CheckpointError, match="^pytorch_model.bin: "):
            port._sources._pytorch.read_tensors(path, 10**8)
    rng = random.Random(0)
    structure = [i for i in range(len(raw)) if not any(a <= i < b for a, b in data)]
    outcomes = set()
    for _ in range(600):
        mutant = bytearray(raw)
        for at in rng.sample(structure, rng.choice([1, 2, 4])):
            mutant[at] = rng.choice([0, 0xFF, mutant[at] ^ (1 << rng.randrange(8)), rng.randrange(256)])
        path.write_bytes(bytes(mutant))
        try:
            tensors, _ = port._sources._pytorch.read_tensors(path, 10**8)
        except CheckpointError as e:
            assert str(e).startswith("pytorch_model.bin: ") and "\n" not in str(e)
            outcomes.add("refused")
            continue
        outcomes.add("read")
        checkpoint = LocalCheckpoint(tmp_path, {}, tensors)
        for key, info in tensors.items():
            assert info.offset + info.nbytes <= len(mutant)
            checkpoint.read(key, tuple((0, n) for n in info.shape))
    assert outcomes == {"refused", "read"}


def test_pickle_and_directory_sizes_are_bounded_before_reading(tmp_path, monkeypatch):
    path = torch_save(tmp_path / "ckpt", {"w": torch.zeros(4), "v": torch.ones(3)})
    with zipfile.ZipFile(path) as z:
        pickle_size = next(i.file_size for i in z.infolist() if i.filename.endswith("data.pkl"))
    monkeypatch.setattr(port._sources._pytorch, "MAX_PICKLE", pickle_size - 1)
    monkeypatch.setattr(port._sources._pytorch, "_unpickle", lambda *a: pytest.fail("the pickle was read"))
    refused(path, f"its data.pkl takes {pickle_size} bytes, more than port reads ({pickle_size - 1})")
    monkeypatch.undo()

    monkeypatch.setattr(port._sources._pytorch, "MAX_OPCODES", 10)
    refused(path, "data.pkl builds more than 10 objects")
    monkeypatch.undo()

    directory = port._sources._pytorch.directory_length(path)
    monkeypatch.setattr(port._sources._directory, "MAX_HEADERS", directory - 1)
    monkeypatch.setattr(port._sources._directory, "read_tensors", lambda *a: pytest.fail("a directory was read"))
    refused(path, f"the zip directories of its 1 files take {directory} bytes, more than {directory - 1} in all")


# ---------------------------------------------------------------- objects nested deep


DEEP = 1_000_000
_KEY_W = _binunicode("w")

NESTED = {  # a state dict holding objects nested DEEP deep, each way a pickle can nest them
    # {((((...)))): 1}: hashing the key recurses in C once per level (issue 21, row 5: SIGSEGV)
    "TUPLE1 chain as a key": b"\x80\x02})" + b"\x85" * DEEP + b"K\x01s.",
    "MARK ... TUPLE": b"\x80\x02}" + _KEY_W + b"(" * DEEP + b"t" * DEEP + b"s.",
    "EMPTY_LIST + APPEND": b"\x80\x02}" + _KEY_W + b"]" * DEEP + b"a" * (DEEP - 1) + b"s.",
    "EMPTY_DICT + SETITEM": b"\x80\x02}" + _KEY_W + b"}" + b"K\x01}" * (DEEP - 1) + b"s" * DEEP + b".",
}


def nested_bin(directory: Path, data: bytes) -> Path:
    """A minimal torch.save zip (`{"w": zeros(3)}`, an empty config) whose data.pkl is `data`."""
    return rezip(torch_save(directory, {"w": torch.zeros(3)}), {"data.pkl": data})


@pytest.mark.slow
def test_a_deep_key_crashes_plain_pickle(tmp_path):
    """The first payload is live: `pickle.loads` of it dies by SIGSEGV (C stack overflow, hashing the key)."""
    (tmp_path / "deep.pkl").write_bytes(NESTED["TUPLE1 chain as a key"])
    code = "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())"
    result = subprocess.run(
        [sys.executable, "-c", code, "deep.pkl"], cwd=tmp_path, capture_output=True, timeout=120, check=False
    )
    if result.returncode == 0:
        pytest.skip("this process's C stack holds a million frames: no crash to show")
    assert result.returncode == -signal.SIGSEGV, result


@pytest.mark.parametrize("how", NESTED)
def test_objects_nested_a_million_deep_are_refused(tmp_path, how):
    path = nested_bin(tmp_path / "ckpt", NESTED[how])
    refused(
        path,
        f"pytorch_model.bin: data.pkl nests objects more than {port._sources._pytorch.MAX_DEPTH} deep: refused "
        "(nothing was run)",
    )
    with pytest.raises(CheckpointError, match="nests objects more than"):  # port.load, in this process
        port.load(tmp_path / "ckpt", mapping=Path(__file__).resolve().parents[1] / "mappings" / "gpt2.toml")


@pytest.mark.slow
def test_objects_nested_a_million_deep_are_one_line_through_the_command(tmp_path):
    nested_bin(tmp_path / "ckpt", NESTED["TUPLE1 chain as a key"])
    one_line(
        run_port("plan", tmp_path / "ckpt", "--mesh", "1x1", timeout=120),
        "pytorch_model.bin: data.pkl nests objects more than 100 deep: refused (nothing was run)",
    )


def test_nesting_is_counted_exactly_up_to_the_bound(tmp_path):
    """A dict whose key is a tuple nested `levels` deep nests `levels + 1` deep: MAX_DEPTH is read (and
    refused as holding no tensor), one level more is refused unread."""
    depth = port._sources._pytorch.MAX_DEPTH
    for levels, expected in [
        (depth - 1, "data.pkl has a key that is not a string (a tuple)"),
        (depth, f"data.pkl nests objects more than {depth} deep"),
    ]:
        path = nested_bin(tmp_path / f"ckpt{levels}", b"\x80\x02})" + b"\x85" * (levels - 1) + b"K\x01s.")
        refused(path, expected)


@pytest.mark.parametrize(
    "data",
    [
        # a list appended to itself: infinitely deep
        b"\x80\x02}" + _KEY_W + b"]q\x00h\x00as.",
        # lists nested through the memo, each one filled after it was nested: the stack never holds more than
        # two, but the last is 1000 deep
        b"\x80\x02}"
        + _KEY_W
        + b"".join(b"]r" + struct.pack("<I", i) + b"0" for i in range(1000))
        + b"".join(b"j" + struct.pack("<I", i) + b"j" + struct.pack("<I", i + 1) + b"a0" for i in range(999))
        + b"j\x00\x00\x00\x00s.",
    ],
    ids=["self", "through the memo"],
)
def test_an_object_changed_after_it_was_nested_is_refused(tmp_path, data):
    path = nested_bin(tmp_path / "ckpt", data)
    refused(
        path,
        "data.pkl changes an object after nesting it in another (APPEND at byte",
        "which a state dict never does: refused (nothing was run)",
    )
