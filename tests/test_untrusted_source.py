"""Untrusted checkpoints: read nothing outside, run nothing, accept no corrupted bytes, exhaust nothing.

The checkpoint's files are refused in one line naming the file when they point
outside the checkpoint directory, are not regular files (a FIFO would hang the
reader), are larger than they may be, or break the safetensors format as the
reference loader reads it; and a checkpoint cut short while it is read is one line,
never a SIGBUS.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import port
import port._files
import port._sources._directory
from port._errors import PortError
from port._sources import LocalCheckpoint, open_checkpoint

from helpers import one_line, port_command, port_env, read_header, run_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"


def sharded(directory: Path, weight_map: dict | None = None) -> Path:
    """The tiny GPT-2 example as a one-shard indexed checkpoint, its index pointing where asked."""
    directory.mkdir(parents=True)
    shutil.copy(EXAMPLE / "config.json", directory / "config.json")
    shutil.copy(EXAMPLE / "model.safetensors", directory / "shard.safetensors")
    keys = load_file(EXAMPLE / "model.safetensors").keys()
    weight_map = weight_map or dict.fromkeys(keys, "shard.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def convert(tmp_path: Path, model: Path) -> subprocess.CompletedProcess:
    """`port convert MODEL --out OUT`, within seconds, leaving no OUT behind."""
    began = time.perf_counter()
    result = run_port("convert", model, "--mesh", "2x2", "--out", tmp_path / "out", timeout=60)
    assert time.perf_counter() - began < 30
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    return result


# ---------------------------------------------------------------- shards named by the index


@pytest.mark.slow
def test_index_pointing_outside_the_directory_is_refused(tmp_path):
    """A valid checkpoint one level up, or anywhere by absolute path, is not read."""
    shutil.copy(EXAMPLE / "model.safetensors", tmp_path / "outside.safetensors")
    keys = list(load_file(EXAMPLE / "model.safetensors"))
    for name, target in [("up", "../outside.safetensors"), ("absolute", str(tmp_path / "outside.safetensors"))]:
        model = sharded(tmp_path / name, dict.fromkeys(keys, target))
        one_line(
            convert(tmp_path, model),
            "model.safetensors.index.json",
            repr(target),
            "not a plain file name in the checkpoint directory",
        )


@pytest.mark.parametrize("target", ["/etc/passwd", "/proc/self/environ", "/dev/stdin", "..", ".", "a/../b", "x\x00y"])
def test_index_naming_system_files_opens_nothing(tmp_path, target, monkeypatch):
    keys = list(load_file(EXAMPLE / "model.safetensors"))
    model = sharded(tmp_path / "model", dict.fromkeys(keys, target))
    opened, real = [], port._files.open_regular

    def open_regular(path, name=None, **options):
        opened.append(Path(path).name)
        return real(path, name, **options)

    monkeypatch.setattr(port._files, "open_regular", open_regular)
    with pytest.raises(PortError, match="not a plain file name") as e:
        open_checkpoint(model)
    assert opened == ["config.json", "model.safetensors.index.json"] and "\n" not in str(e.value)


@pytest.mark.slow
def test_index_naming_etc_passwd_leaks_nothing(tmp_path):
    keys = list(load_file(EXAMPLE / "model.safetensors"))
    line = one_line(convert(tmp_path, sharded(tmp_path / "model", dict.fromkeys(keys, "/etc/passwd"))), "/etc/passwd")
    first = Path("/etc/passwd").read_bytes()[:8]
    assert str(int.from_bytes(first, "little")) not in line and str(Path("/etc/passwd").stat().st_size) not in line


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero", "dev-stdin", "dangling"])
def test_a_shard_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    model = sharded(tmp_path / "model")
    shard = model / "shard.safetensors"
    shard.unlink()
    make = {
        "fifo": lambda: os.mkfifo(shard),
        "directory": lambda: shard.mkdir(),
        "dev-zero": lambda: shard.symlink_to("/dev/zero"),
        "dev-stdin": lambda: shard.symlink_to("/dev/stdin"),
        "dangling": lambda: shard.symlink_to(tmp_path / "nowhere"),
    }
    make[kind]()
    expected = "cannot read" if kind == "dangling" else "not a regular file"
    one_line(convert(tmp_path, model), "shard.safetensors", expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero"])
def test_config_or_index_that_is_not_a_regular_file_is_refused_at_once(tmp_path, name, kind):
    model = sharded(tmp_path / "model")
    (model / name).unlink()
    {"fifo": lambda p: os.mkfifo(p), "directory": lambda p: p.mkdir(), "dev-zero": lambda p: p.symlink_to("/dev/zero")}[
        kind
    ](model / name)
    one_line(convert(tmp_path, model), name, "not a regular file")


@pytest.mark.slow
@pytest.mark.parametrize("name, size", [("config.json", 10 * 2**30), ("model.safetensors.index.json", 2**30)])
def test_huge_config_or_index_is_refused_unread(tmp_path, name, size):
    """A 10 GB config.json (sparse: no disk) is refused from its size, not read."""
    model = sharded(tmp_path / "model")
    with open(model / name, "r+b") as f:
        f.truncate(size)
    one_line(convert(tmp_path, model), name, f"{size} bytes, more than")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize(
    "text, expected",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"n_layer": ' + "7" * 5000 + "}", "Exceeds the limit"),
        (b'{"a": "\xff"}', "not valid UTF-8"),
        ('{"a": 1', "Expecting"),
    ],
)
def test_config_or_index_json_that_breaks_the_parser_is_one_line(tmp_path, name, text, expected):
    model = sharded(tmp_path / "model")
    (model / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(PortError) as e:
        open_checkpoint(model)
    message = str(e.value)
    assert message.startswith(str(model / name)) and expected in message and "\n" not in message, message


def test_hugging_face_cache_symlinks_are_followed(tmp_path):
    """A snapshot's files are links to ../../blobs/<sha>: a link whose target is a regular file is fine."""
    blobs, snapshot = tmp_path / "repo" / "blobs", tmp_path / "repo" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(EXAMPLE / name, blobs / f"sha-{name}")
        (snapshot / name).symlink_to(Path("../../blobs") / f"sha-{name}")
    with open_checkpoint(snapshot) as ckpt:
        wte = ckpt.read("transformer.wte.weight", ((0, 5), (0, 64)))
    np.testing.assert_array_equal(wte, load_file(EXAMPLE / "model.safetensors")["transformer.wte.weight"][:5])


# ---------------------------------------------------------------- exhausting nothing


def _sparse_shard(path: Path, header_length: int) -> None:
    """A file whose length field claims `header_length` bytes, all of them holes (no disk)."""
    with open(path, "wb") as f:
        f.write(header_length.to_bytes(8, "little"))
        f.truncate(8 + header_length + 16)


@pytest.mark.slow
def test_headers_are_bounded_across_shards_before_any_is_read(tmp_path, monkeypatch):
    """Six shards of (junk) 60 MB headers: refused from their lengths, no header read."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(EXAMPLE / "config.json", model / "config.json")
    names = [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)]
    for name in names:
        _sparse_shard(model / name, 60_000_000)
    weight_map = {f"t{i}": name for i, name in enumerate(names)}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    one_line(convert(tmp_path, model), str(model), "360000000 bytes, more than 100000000 in all")
    monkeypatch.setattr(port._sources._directory, "parse_header", lambda *a: pytest.fail("a header was read"))
    with pytest.raises(PortError, match="in all"):
        open_checkpoint(model)


def test_header_budget_is_shared_by_the_shards(tmp_path, monkeypatch):
    """Within the total, each header may take only what the earlier ones left."""
    for i in range(3):
        save_file({f"w{i}": np.zeros(4, np.float32)}, tmp_path / f"s{i}.safetensors")
    (tmp_path / "config.json").write_text("{}")
    lengths = [port._sources._directory.header_length(tmp_path / f"s{i}.safetensors") for i in range(3)]
    monkeypatch.setattr(port._sources._directory, "MAX_HEADERS", sum(lengths))
    assert set(open_checkpoint(tmp_path).tensors) == {"w0", "w1", "w2"}
    monkeypatch.setattr(port._sources._directory, "MAX_HEADERS", sum(lengths) - 1)
    with pytest.raises(PortError, match=f"take {sum(lengths)} bytes, more than {sum(lengths) - 1} in all"):
        open_checkpoint(tmp_path)


def test_too_many_shards_are_refused_before_opening_any(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    count = port._sources._directory.MAX_SHARDS + 1
    weight_map = {f"t{i}": f"s{i}.safetensors" for i in range(count)}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    monkeypatch.setattr(port._sources._directory, "header_length", lambda *a: pytest.fail("a shard was opened"))
    with pytest.raises(PortError, match=f"lists {count} shard files, more than"):
        open_checkpoint(model)


def test_a_header_past_the_format_limit_is_refused_unread(tmp_path, monkeypatch):
    path = tmp_path / "big.safetensors"
    _sparse_shard(path, 100_000_001)  # the reference's MAX_HEADER_SIZE is 100_000_000
    monkeypatch.setattr(port._sources._directory, "parse_header", lambda *a: pytest.fail("the header was read"))
    with pytest.raises(PortError, match="exceeds the format's limit of 100000000 bytes"):
        read_header(path)


# ---------------------------------------------------------------- the format, as the reference reads it


def _raw(path: Path, text: str | bytes, data: bytes = b"", length: int | None = None, pad: bool = True) -> Path:
    raw = text.encode() if isinstance(text, str) else text
    if pad:
        raw += b" " * (-len(raw) % 8)
    path.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return path


def _reference_refuses(path: Path) -> bool:
    try:
        load_file(path)
    except Exception:  # noqa: BLE001 - any refusal: SafetensorError, or NumPy's ValueError
        return True
    return False


A = '"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
B = '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}'


def _x(value: str) -> str:
    """Tensor `a` with an ignored field `x` holding `value`."""
    return '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + value + "}}"


REFUSED = {
    "overlap": ("{" + A + ',"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}}', 6, "inside the previous tensor"),
    "gap": ("{" + A + ',"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}', 12, "belong to no tensor"),
    "not from 0": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', 8, "belong to no tensor"),
    "trailing bytes": ("{" + A + "}", 5, "1 bytes after the last tensor"),
    "cut data": ("{" + A + "," + B + "}", 7, "truncated"),
    "offsets reversed": ('{"a":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}}', 4, "needs 0 bytes"),
    "negative size": ('{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', 4, "bad entry"),
    "negative zero": ('{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}', 0, "bad entry"),
    "float size": ('{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', 4, "bad entry"),
    "bool size": ('{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', 4, "bad entry"),
    "size past u64": ('{"a":{"dtype":"F32","shape":[18446744073709551616,0],"data_offsets":[0,0]}}', 0, "bad entry"),
    "too large for NumPy": (
        '{"a":{"dtype":"F32","shape":[2305843009213693952,0],"data_offsets":[0,0]}}',
        0,
        "too large",
    ),
    "65 dimensions": (
        '{"a":{"dtype":"F32","shape":[' + ",".join(["1"] * 65) + '],"data_offsets":[0,4]}}',
        4,
        "65 dimensions",
    ),
    "three offsets": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,4]}}', 4, "bad entry"),
    "unknown dtype": ('{"a":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}}', 4, "unsupported dtype"),
    "entry null": ('{"a":null}', 0, "bad entry"),
    "metadata list": ('{"__metadata__":[],' + A + "}", 4, "__metadata__ must map strings to strings"),
    "metadata int value": ('{"__metadata__":{"k":1},' + A + "}", 4, "__metadata__ must map strings to strings"),
    "metadata twice": ('{"__metadata__":{},"__metadata__":{},' + A + "}", 4, "appears twice"),
    "field twice": ('{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4, "appears twice"),
    "NaN": (_x("NaN"), 4, "NaN is not JSON"),
    "Infinity": (_x("-Infinity"), 4, "-Infinity is not JSON"),
    "1e400": (_x("1e400"), 4, "number out of range"),
    "5000 digits": (
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,' + "4" * 5000 + "]}}",
        4,
        "integer of 5000 digits",
    ),
    "nested 126 deep": (_x("[" * 126 + "]" * 126), 4, "nested 128 levels deep"),  # 128 with the two objects around
    "nested 100000 deep": (_x("[" * 100_000 + "]" * 100_000), 4, "nested too deeply"),
    "lone surrogate": ('{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4, "lone surrogate"),
    "trailing comma": ("{" + A + ",}", 4, "not valid JSON"),
    "trailing NUL": ("{" + A + "}\x00", 4, "not valid JSON"),
    "byte order mark": ("\ufeff{" + A + "}", 4, "not valid JSON"),
    "not UTF-8": (b'{"\xff":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4, "not UTF-8"),
    "empty": ("", 0, "not valid JSON"),
    "array": ("[]", 0, "expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_port_refuses_what_the_reference_refuses(tmp_path, case):
    text, data, expected = REFUSED[case]
    path = _raw(tmp_path / "x.safetensors", text, b"\0" * data)
    assert _reference_refuses(path)
    with pytest.raises(PortError) as e:
        read_header(path)
    message = str(e.value)
    assert message.startswith("x.safetensors: ") and expected in message, message
    assert "\n" not in message and len(message) < 300, message


def test_a_header_length_one_byte_short_is_refused(tmp_path):
    """One of the header's padding spaces counted as data: the JSON still parses, but the
    data no longer ends where the last tensor does."""
    path = tmp_path / "short.safetensors"
    save_file({"w": np.arange(6, dtype=np.float32)}, path)
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    assert raw[8 + n - 1 : 8 + n] == b" "  # safetensors pads its header with spaces
    raw[:8] = (n - 1).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    assert _reference_refuses(path)
    with pytest.raises(PortError, match="1 bytes after the last tensor"):
        read_header(path)


ACCEPTED = {
    "zero-size tensors sharing offsets": (
        '{"z":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
        + A
        + ',"y":{"dtype":"F32","shape":[2,0],"data_offsets":[4,4]}}',
        4,
    ),
    "whitespace around": ("\n\t {" + A + "} \r\n", 4),
    "unknown field": (_x('{"y":[1,2.5,"z"]}'), 4),
    "nested 125 deep": (_x("[" * 125 + "]" * 125), 4),
    "surrogate pair": ('{"\\ud83d\\ude00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "no tensors": ("{}", 0),
    "metadata": ('{"__metadata__":{"format":"pt"},' + A + "}", 4),
    "empty name": ('{"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    "large shape of no bytes": ('{"a":{"dtype":"F32","shape":[1152921504606846976,0],"data_offsets":[0,0]}}', 0),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_port_accepts_what_the_reference_accepts(tmp_path, case):
    text, data = ACCEPTED[case]
    path = _raw(tmp_path / "x.safetensors", text, bytes(range(data)))
    reference = load_file(path)
    tensors = read_header(path)
    assert set(tensors) == set(reference)
    with LocalCheckpoint(tmp_path, {}, tensors) as ckpt:
        for key, array in reference.items():
            got = ckpt.read(key, tuple((0, n) for n in array.shape))
            assert got.dtype == array.dtype and got.shape == array.shape and got.tobytes() == array.tobytes()


# Where port is stricter than the reference loader, on purpose: each would make port
# guess (which of two entries is meant), or print a name that forges a terminal line.
STRICTER = {
    "tensor twice": ("{" + A + "," + A + "}", 4, "appears twice"),
    "metadata key twice": ('{"__metadata__":{"k":"1","k":"2"},' + A + "}", 4, "appears twice"),
    "metadata null": ('{"__metadata__":null,' + A + "}", 4, "__metadata__ must map strings to strings"),
    "control character in a name": (
        '{"a\\n":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        4,
        "control characters",
    ),
    "dtype port does not convert": ('{"a":{"dtype":"U32","shape":[1],"data_offsets":[0,4]}}', 4, "unsupported dtype"),
}


@pytest.mark.parametrize("case", sorted(STRICTER))
def test_port_refuses_ambiguity_the_reference_accepts(tmp_path, case):
    text, data, expected = STRICTER[case]
    path = _raw(tmp_path / "x.safetensors", text, b"\0" * data)
    assert not _reference_refuses(path)
    with pytest.raises(PortError, match=expected):
        read_header(path)


# ---------------------------------------------------------------- layer indices


def _gpt2_keys_renamed(directory: Path, old: str, new: str) -> Path:
    tensors = load_file(EXAMPLE / "model.safetensors")
    tensors[new] = tensors.pop(old)
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors")
    shutil.copy(EXAMPLE / "config.json", directory / "config.json")
    return directory


@pytest.mark.parametrize("index", ["\u0661", "01", "1" + "0" * 12])
def test_layer_index_must_be_plain_ascii_digits(tmp_path, index):
    """`h.\u0661.` (Arabic-Indic one) or `h.01.` would be layer 1 a second time: neither matches."""
    key = f"transformer.h.{index}.ln_1.weight"
    model = _gpt2_keys_renamed(tmp_path / "model", "transformer.h.1.ln_1.weight", key)
    with open_checkpoint(model) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        skeleton = port.skeleton(mapping, ckpt.config)
        problems = port._plan.plan_problems(skeleton, mapping, ckpt.tensors, ckpt.config, {"data": 1, "model": 1})
    assert any(f"'{key}' is not used by the mapping" in p for p in problems), problems
    assert any("missing tensor 'h.1.ln_1.weight'" in p for p in problems), problems


@pytest.mark.slow
def test_layer_index_with_leading_zero_is_refused_through_the_command(tmp_path):
    model = _gpt2_keys_renamed(tmp_path / "model", "transformer.h.1.ln_1.weight", "transformer.h.01.ln_1.weight")
    one_line(convert(tmp_path, model), "missing tensor 'h.1.ln_1.weight'")


# ---------------------------------------------------------------- cut while being read


def _make_gpt2():
    spec = importlib.util.spec_from_file_location("make_gpt2", REPO / "bench" / "make_gpt2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker_anon_bytes(supervisor: int) -> int | None:
    """Anonymous memory of the `port` worker (the supervisor's child), or None before it starts.

    It grows by the blocks as they are read (656 MB for GPT-2 small on 8 devices),
    whether the bytes come by read or through a memory map.
    """
    try:
        children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
        status = Path(f"/proc/{children[0]}/status").read_text() if children else ""
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:")), None)


@pytest.mark.slow
def test_truncating_the_checkpoint_while_it_is_read_is_one_line(tmp_path):
    """A checkpoint cut while `port convert` places it: never SIGBUS (exit 135, as reading through
    a memory map ends), but one line and nothing left behind, or success if the reading was done."""
    pristine = _make_gpt2().write("small", tmp_path / "pristine") / "model.safetensors"
    size = pristine.stat().st_size
    failures = 0
    for seed in range(4):
        rng = random.Random(seed)
        model = tmp_path / f"model{seed}"
        model.mkdir()
        shutil.copy(pristine.parent / "config.json", model)
        shutil.copyfile(pristine, model / "model.safetensors")
        out = tmp_path / f"out{seed}"
        run = subprocess.Popen(
            [*port_command(), "convert", model, "--mesh", "4x2", "--out", out],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=port_env(),
        )
        # Imports take some 75 MB; placing then adds the blocks, 656 MB: cut somewhere in it.
        threshold = 100_000_000 + int(rng.uniform(0.0, 0.8) * 600_000_000)
        began = time.perf_counter()
        while (
            run.poll() is None and (_worker_anon_bytes(run.pid) or 0) < threshold and time.perf_counter() - began < 120
        ):
            time.sleep(0.001)
        os.truncate(model / "model.safetensors", rng.randrange(size // 10, size // 2))
        _, stderr = run.communicate(timeout=300)
        assert run.returncode in (0, 1), (seed, run.returncode, stderr)
        if run.returncode == 1:
            failures += 1
            one_line(subprocess.CompletedProcess(run.args, 1, "", stderr), "model.safetensors: truncated")
            assert not out.exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert failures >= 1  # the cut did land while reading
