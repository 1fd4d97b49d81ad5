"""A header fuzzer: port refuses exactly what the reference safetensors loader refuses.

Seeded mutants of one valid safetensors file (byte flips, insertions and deletions
in the length field and the JSON header; offsets shifted, dtypes and shapes changed,
keys duplicated, files cut or lengthened) are read in-process by port and by the
reference loader (`safetensors.numpy.load_file`). Every mutant is either refused by
port with one `PortError` line (no other exception), or, if the reference accepts it
too, read by port as exactly the same tensors: names, dtypes, shapes and bytes.
Every mutant the reference refuses, port refuses.

Port is stricter than the reference on purpose in these cases only (the reference
accepts them; `STRICTER` lists the messages):
- a key twice in one JSON object (the reference silently keeps the last tensor);
- `"__metadata__": null` (port wants a string-to-string map or no key);
- control characters in a tensor name (they would forge lines in messages);
- dtypes port does not convert (U16, U32, U64, C64, and newer ones);
- integers of more than 20 digits anywhere in the header (the reference reads them
  as floats where a field is ignored).
The reference's NumPy front end cannot build float8 arrays (`AttributeError`): for a
mutant with a float8 tensor the PyTorch front end is the reference (without PyTorch,
such a mutant is held to the one-line contract only).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from port._errors import PortError
from port._sources import LocalCheckpoint

from helpers import read_header

MUTANTS = 1000
STRICTER = (
    "appears twice",
    "__metadata__ must map strings to strings",
    "control characters",
    "unsupported dtype",
    "digits",
)
DTYPE_NAMES = [
    "F64",
    "F32",
    "F16",
    "BF16",
    "F8_E4M3",
    "F8_E5M2",
    "I64",
    "I32",
    "I16",
    "I8",
    "U8",
    "BOOL",
    "U16",
    "U32",
    "U64",
    "C64",
    "F4",
    "f32",
    "F128",
    "",
    "int",
]


def base_file(path: Path) -> bytes:
    rng = np.random.default_rng(0)
    save_file(
        {
            "a.weight": rng.standard_normal((3, 4)).astype(np.float32),
            "a.bias": rng.standard_normal(4).astype(np.float16),
            "b.0.w": rng.standard_normal((2, 3, 2)).astype(ml_dtypes.bfloat16),
            "ids": np.arange(5, dtype=np.int64),
            "mask": np.array([True, False, True]),
            "empty": np.zeros((0, 3), np.float32),
            "scalar": np.array(7, np.int32),
            "bytes": np.arange(6, dtype=np.uint8),
        },
        path,
        metadata={"format": "pt"},
    )
    return path.read_bytes()


def _split(blob: bytes) -> tuple[int, bytes, bytes]:
    n = int.from_bytes(blob[:8], "little")
    return n, blob[8 : 8 + n], blob[8 + n :]


def _join(header: dict | str, data: bytes, delta: int = 0) -> bytes:
    raw = (header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))).encode()
    raw += b" " * (-len(raw) % 8)
    return (len(raw) + delta).to_bytes(8, "little") + raw + data


def mutate(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One seeded mutant of `blob` and the name of the mutation."""
    n, raw, data = _split(blob)
    header = json.loads(raw)
    tensors = [k for k in header if k != "__metadata__"]
    kind = rng.choice(
        [
            "flip length",
            "flip header",
            "insert header",
            "delete header",
            "truncate",
            "append",
            "shift offsets",
            "change dtype",
            "change shape",
            "duplicate key",
            "metadata",
            "length off by k",
            "swap offsets",
            "drop tensor",
            "extra field",
            "raw token",
        ]
    )
    if kind == "flip length":
        out = bytearray(blob)
        for _ in range(rng.randint(1, 3)):
            out[rng.randrange(8)] ^= 1 << rng.randrange(8)
        return kind, bytes(out)
    if kind == "flip header":
        out = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            at = 8 + rng.randrange(n)
            out[at] = rng.randrange(256) if rng.random() < 0.5 else out[at] ^ (1 << rng.randrange(8))
        return kind, bytes(out)
    if kind in ("insert header", "delete header"):
        at, count = rng.randrange(n), rng.randint(1, 8)
        if kind == "insert header":
            new = raw[:at] + bytes(rng.choice(b' {}[],:"0129.-eE\\atrufnl\x00\xff') for _ in range(count)) + raw[at:]
        else:
            new = raw[:at] + raw[at + count :]
        fix = rng.random() < 0.7  # keep the length field right, or not
        return kind, (len(new) if fix else n).to_bytes(8, "little") + new + data
    if kind == "truncate":
        return kind, blob[: rng.randrange(len(blob))]
    if kind == "append":
        return kind, blob + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    if kind == "length off by k":
        return kind, (n + rng.choice([-9, -8, -2, -1, 1, 2, 8])).to_bytes(8, "little") + blob[8:]
    key = rng.choice(tensors)
    entry = header[key]
    if kind == "shift offsets":  # one end, or the whole tensor
        delta = rng.choice([-8, -4, -2, -1, 1, 2, 4, 8, 1000, -(2**40), 2**64])
        for i in [0, 1] if rng.random() < 0.5 else [rng.randrange(2)]:
            entry["data_offsets"][i] += delta
    elif kind == "change dtype":
        entry["dtype"] = rng.choice(DTYPE_NAMES)
    elif kind == "change shape":
        shape = entry["shape"]
        choice = rng.randrange(6)
        if choice == 0 and shape:
            shape[rng.randrange(len(shape))] = rng.choice([0, 1, 2, 3, 12, 2**62, 2**64, -1])
        elif choice == 1:
            shape.insert(rng.randrange(len(shape) + 1), rng.choice([1, 2, 0]))
        elif choice == 2 and shape:
            shape.pop(rng.randrange(len(shape)))
        elif choice == 3:
            entry["shape"] = [1] * rng.choice([63, 64, 65])
        elif choice == 4 and shape:
            shape.reverse()
        else:
            entry["shape"] = rng.choice([[1.0], ["3"], [True], 3, None, [[2]]])
    elif kind == "duplicate key":
        text = json.dumps(header, separators=(",", ":"))
        target = rng.choice(["__metadata__", key, "dtype", "shape"])
        if target in ("dtype", "shape"):
            text = text.replace(f'"{target}":', f'"{target}":{json.dumps(entry[target])},"{target}":', 1)
        else:
            text = "{" + json.dumps(target) + ":" + json.dumps(header[target]) + "," + text[1:]
        return kind, _join(text, data)
    elif kind == "metadata":
        header["__metadata__"] = rng.choice([None, [], {"k": 1}, {"k": None}, "pt", {"k": "v", "x": "\n"}, {}])
    elif kind == "swap offsets":
        other = rng.choice(tensors)
        entry["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], entry["data_offsets"]
    elif kind == "drop tensor":
        del header[key]
    elif kind == "extra field":
        entry[rng.choice(["x", "name", "offsets"])] = rng.choice(
            [1, "s", [1, [2, [3]]], {"a": {"b": None}}, 2**70, -1, 1.5, "\u00e9"]
        )
    elif kind == "raw token":
        text = json.dumps(header, separators=(",", ":"))
        token = rng.choice(
            ["NaN", "Infinity", "-0", "1e400", "01", "1" * 30, '"\\ud800"', "[" * 130 + "]" * 130, "true"]
        )
        text = text.replace("[", "[" + token + ",", 1) if rng.random() < 0.5 else text[:-1] + ',"x":' + token + "}"
        return kind, _join(text, data)
    return kind, _join(header, data)


NO_REFERENCE = "no reference"


def reference(path: Path) -> dict[str, tuple[np.dtype, tuple, bytes]] | None:
    """What the reference loader reads, or None if it refuses the file."""
    try:
        tensors = load_file(path)
    except AttributeError:  # a dtype its NumPy front end cannot build (float8): ask its PyTorch one
        try:
            import torch
            from safetensors.torch import load_file as load_torch
        except ImportError:  # no PyTorch here: this mutant has no reference
            return NO_REFERENCE

        try:
            torch_tensors = load_torch(path)
        except Exception:  # noqa: BLE001
            return None
        return {
            k: (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
            for k, t in torch_tensors.items()
        }
    except Exception:  # noqa: BLE001 - SafetensorError, or NumPy refusing a shape
        return None
    return {k: (v.dtype, v.shape, v.tobytes()) for k, v in tensors.items()}


def port_reads(path: Path) -> dict[str, tuple[np.dtype, tuple, bytes]]:
    """Every tensor of the file, read whole through port's Checkpoint."""
    tensors = read_header(path)
    with LocalCheckpoint(path.parent, {}, tensors) as ckpt:
        return {
            key: (info.dtype, info.shape, ckpt.read(key, tuple((0, n) for n in info.shape)).tobytes())
            for key, info in tensors.items()
        }


FLOAT8 = {np.dtype(ml_dtypes.float8_e4m3fn): "float8_e4m3fn", np.dtype(ml_dtypes.float8_e5m2): "float8_e5m2"}


def test_mutants_are_refused_or_read_as_the_reference_reads_them(tmp_path):
    began = time.perf_counter()
    blob = base_file(tmp_path / "base.safetensors")
    assert port_reads(tmp_path / "base.safetensors") == reference(tmp_path / "base.safetensors")
    outcomes: dict[str, int] = {}
    for seed in range(MUTANTS):
        kind, mutant = mutate(blob, random.Random(seed))
        path = tmp_path / "mutant.safetensors"
        path.write_bytes(mutant)
        want = reference(path)
        try:
            got = port_reads(path)
        except PortError as e:
            message = str(e)
            assert "\n" not in message and message.startswith("mutant.safetensors: "), (seed, kind, message)
            if want is NO_REFERENCE:  # a float8 mutant without PyTorch: only the one-line contract
                outcomes[NO_REFERENCE] = outcomes.get(NO_REFERENCE, 0) + 1
                continue
            if want is not None:  # port refuses what the reference accepts: only on purpose
                assert any(s in message for s in STRICTER), (seed, kind, message)
                outcomes["port stricter"] = outcomes.get("port stricter", 0) + 1
            else:
                outcomes["both refuse"] = outcomes.get("both refuse", 0) + 1
            continue
        # Any other exception fails the test here: port raises PortError or nothing.
        if want is NO_REFERENCE:
            outcomes[NO_REFERENCE] = outcomes.get(NO_REFERENCE, 0) + 1
            continue
        assert want is not None, (seed, kind, "port accepts what the reference refuses")
        assert set(got) == set(want), (seed, kind)
        for key, (dtype, shape, data) in got.items():
            ref_dtype, ref_shape, ref_data = want[key]
            assert (FLOAT8.get(dtype, dtype), shape, data) == (ref_dtype, ref_shape, ref_data), (seed, kind, key)
        outcomes["both accept"] = outcomes.get("both accept", 0) + 1
    seconds = time.perf_counter() - began
    print(f"{MUTANTS} mutants in {seconds:.1f} s: {outcomes}")
    assert sum(outcomes.values()) == MUTANTS
    # The mutants reach both verdicts: a fuzzer whose mutants are all refused tests little.
    assert outcomes.get("both accept", 0) >= MUTANTS // 20 and outcomes.get("both refuse", 0) >= MUTANTS // 3, outcomes
