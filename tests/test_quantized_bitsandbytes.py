"""bitsandbytes 4-bit checkpoints (`quant_method: "bitsandbytes"`, nf4 and fp4, nested absmax),
read as unsloth's `-bnb-4bit` releases store them.

The checkpoints are made by bitsandbytes itself on the CPU: single weights by its
`quantize_4bit` and `QuantState.as_dict(packed=True)`, models by transformers'
`from_pretrained(quantization_config=BitsAndBytesConfig(...))` then `save_pretrained` (the
Hub's layout). The references:

- every region of a weight equals bitsandbytes' `dequantize_4bit` of the state its
  `QuantState.from_dict` reads from the same file, bit for bit (float32, and the state's own
  dtype after port's cast), and reads exactly the packed bytes, absmax blocks and nested
  absmax blocks its elements fall in (counted here from the element indices);
- a tiny Llama in nf4 (nested) and a tiny GPT-2 in fp4 (Conv1D, stored transposed) loaded by
  port give the logits of transformers' model holding the weights `dequantize_4bit` gives.
  (transformers' own 4-bit model on CPU is no reference: its `Linear4bit` forward differs from
  `x @ dequantize_4bit(w).T` by 3e-2 here, and its `dequantize()` gave logits 7.5 away.)
"""

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import port
from port._errors import CheckpointError
from port._sources._quantized._bitsandbytes import Bnb4bit

from helpers import INPUT_IDS, logits, one_line, run_port, torch_gpt2, torch_llama, transformers_or_skip

STATE = ".quant_state.bitsandbytes__"
# name: (quant_type, nested, blocksize, shape, the dtype quantized)
CASES = {
    "nf4": ("nf4", False, 64, (40, 100), "float32"),
    "nf4-nested": ("nf4", True, 32, (96, 173), "bfloat16"),  # odd rows: bytes shared by two rows; 3 nested blocks
    "fp4": ("fp4", False, 128, (48, 72), "bfloat16"),
    "fp4-nested": ("fp4", True, 32, (96, 172), "float32"),
}


def regions(out: int, inner: int) -> list:
    """Whole, unaligned to blocks and to the two-per-byte packing, single elements, one row, one column band."""
    return [
        ((0, out), (0, inner)),
        ((3, 17), (5, inner - 7)),
        ((out - 1, out), (inner - 1, inner)),
        ((out // 2, out // 2 + 1), (0, inner)),
        ((1, out - 2), (inner // 2 - 1, inner // 2 + 2)),
        ((7, 9), (0, 1)),
    ]


def bnb_state(tensors: dict, name: str):
    """bitsandbytes' own reading of weight `name`'s state from a checkpoint's tensors."""
    import bitsandbytes.functional as F
    import torch

    parts = {k[len(name) + 1 :]: torch.from_numpy(v) for k, v in tensors.items() if k.startswith(name + ".")}
    return F.QuantState.from_dict(parts, torch.device("cpu"))


def bnb_dequantized(tensors: dict, name: str, dtype: str | None = None) -> np.ndarray:
    """bitsandbytes' `dequantize_4bit` of weight `name` (in its state's dtype, or `dtype`), as NumPy."""
    import bitsandbytes.functional as F
    import torch

    state = bnb_state(tensors, name)
    if dtype is not None:
        state.dtype = getattr(torch, dtype)
    with torch._dynamo.config.patch(disable=True):  # its odd-width path, uncompiled (seconds saved)
        out = F.dequantize_4bit(torch.from_numpy(tensors[name]), state)
    return out.float().numpy().astype(ml_dtypes.bfloat16 if out.dtype == torch.bfloat16 else np.float32)


def write_weight(directory: Path, case: str) -> Path:
    """One weight `w.weight` quantized by bitsandbytes as `case` says, in the Hub's layout."""
    import bitsandbytes.functional as F
    import torch

    quant_type, nested, blocksize, shape, dtype = CASES[case]
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=getattr(torch, dtype))
    q, state = F.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type)
    tensors = {"w.weight": q.numpy()} | {f"w.weight.{k}": v.numpy() for k, v in state.as_dict(packed=True).items()}
    return write_tensors(directory, tensors)


def write_tensors(directory: Path, tensors: dict, settings: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    quantization = {"quant_method": "bitsandbytes", "load_in_4bit": True} if settings is None else settings
    config = {"model_type": "llama", "dtype": "float32", "quantization_config": quantization}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """get(case): the directory of `case`'s one quantized weight, made once."""
    pytest.importorskip("bitsandbytes", exc_type=ImportError)
    made = {}

    def get(case):
        if case not in made:
            made[case] = write_weight(tmp_path_factory.mktemp(case), case)
        return made[case]

    return get


def expected_bytes(region, inner: int, blocksize: int, nested: int, absmax_itemsize: int) -> int:
    """The bytes `region` of a `[*, inner]` weight needs, from its elements' flat indices: each
    packed byte, absmax block and nested absmax block any of them falls in, once."""
    (a, b), (c, d) = region
    index = (np.arange(a, b)[:, None] * inner + np.arange(c, d)[None, :]).ravel()
    blocks = np.unique(index // blocksize)
    total = np.unique(index // 2).size + blocks.size * absmax_itemsize
    return total + (np.unique(blocks // nested).size * 4 if nested else 0)


# ------------------------------------------------------------------ the format, region by region


@pytest.mark.parametrize("case", list(CASES))
def test_regions_equal_bitsandbytes_dequantize_4bit_and_read_only_their_bytes(weights, case):
    quant_type, nested, blocksize, (out, inner), dtype = CASES[case]
    directory = weights(case)
    tensors = load_file(directory / "model.safetensors")
    expected32 = bnb_dequantized(tensors, "w.weight", "float32")
    expected = bnb_dequantized(tensors, "w.weight")  # in the state's own dtype
    with port.open_checkpoint(directory) as ckpt:
        # Opening reads the JSON state, and a nested state's 256 absmax values.
        assert ckpt.bytes_read == tensors["w.weight" + STATE + quant_type].size + (1024 if nested else 0)
        assert list(ckpt.tensors) == ["w.weight"]
        info = ckpt.tensors["w.weight"]
        assert info.shape == (out, inner) and info.dtype == np.float32
        absmax = "uint8 nested by 256" if nested else "float32"
        assert info.describe() == f"bitsandbytes {quant_type}, blocks of {blocksize}, absmax {absmax}"
        for region in regions(out, inner):
            before = ckpt.bytes_read
            got = ckpt.read("w.weight", region)
            part = tuple(slice(a, b) for a, b in region)
            np.testing.assert_array_equal(got.view(np.uint32), expected32[part].view(np.uint32), str(region))
            np.testing.assert_array_equal(got.astype(expected.dtype), expected[part], str(region))
            wanted = expected_bytes(region, inner, blocksize, 256 if nested else 0, 1 if nested else 4)
            assert ckpt.bytes_read - before == info.region_nbytes(region) == wanted, region


def test_a_nan_absmax_is_refused_when_read(weights, tmp_path):
    tensors = load_file(weights("nf4") / "model.safetensors")
    tensors["w.weight.absmax"][3] = np.nan
    with port.open_checkpoint(write_tensors(tmp_path / "nan", tensors)) as ckpt:
        ckpt.read("w.weight", ((0, 1), (0, 100)))  # blocks 0-1: finite
        with pytest.raises(CheckpointError, match=r"'w\.weight\.absmax' holds a NaN or infinite scale"):
            ckpt.read("w.weight", ((2, 3), (0, 100)))


# ------------------------------------------------------------------ models, against transformers


def quantize_model(model, directory: Path, **settings) -> Path:
    """`model` saved, loaded by transformers with a BitsAndBytesConfig on the CPU (bitsandbytes
    quantizes it) and saved again: the Hub's `-bnb-4bit` layout, at `directory`/quantized."""
    transformers = transformers_or_skip()
    pytest.importorskip("bitsandbytes", exc_type=ImportError)
    import torch

    model.save_pretrained(directory / "plain")
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, **settings)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        directory / "plain", quantization_config=config, device_map="cpu"
    )
    quantized.save_pretrained(directory / "quantized")
    return directory / "quantized"


def reference_logits(model, directory: Path, transposed: tuple[str, ...] = ()) -> np.ndarray:
    """The logits of `model` (transformers) holding the checkpoint's weights, each quantized
    one as bitsandbytes' `dequantize_4bit` gives it (transposed into `Conv1D` modules)."""
    import torch

    tensors = load_file(directory / "model.safetensors")
    names = {k.split(STATE)[0] for k in tensors if STATE in k}
    state = {k: torch.from_numpy(v) for k, v in tensors.items() if k.split(".weight.")[0] + ".weight" not in names}
    for name in names:
        w = torch.from_numpy(bnb_dequantized(tensors, name))
        state[name] = w.T if name.split(".")[-2] in transposed else w
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        return model(torch.tensor(INPUT_IDS)).logits.numpy()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama in nf4 with nested absmax (float32, for tight logits), and its reference logits."""
    directory = quantize_model(
        torch_llama(), tmp_path_factory.mktemp("llama"), bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
    )
    return directory, reference_logits(torch_llama(), directory)


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
def test_a_llama_in_nf4_gives_transformers_logits_from_the_dequantized_weights(llama, mesh):
    directory, expected = llama
    ours = np.asarray(logits(port.load(directory, mesh=mesh), INPUT_IDS))
    print(f"{mesh}: max |port - transformers| {np.abs(ours - expected).max():.3g}")
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def test_each_device_reads_its_packed_bytes_and_the_absmax_blocks_that_cover_them(llama):
    """Placing on 4x2 reads exactly the plan's bytes, counted here from the elements each
    device's region holds; on one device, every stored byte once (states read when opened)."""
    directory, _ = llama
    mesh = port.make_mesh("4x2")
    with port.open_checkpoint(directory) as ckpt:
        opened = ckpt.bytes_read
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, mesh.shape)
        expected = 0
        for leaf in recipe.leaves:
            for box in leaf.shards(mesh.shape):
                region, keys = leaf.source_region(box)
                for key in keys:
                    info = ckpt.tensors[key]
                    if isinstance(info, Bnb4bit):
                        expected += expected_bytes(region, info.shape[1], info.blocksize, info.nested_blocksize, 1)
                    else:
                        expected += math.prod(b - a for a, b in region) * info.dtype.itemsize
        assert recipe.read_bytes == expected
        port.place(recipe, ckpt, mesh)
        assert ckpt.bytes_read - opened == expected
    tensors = load_file(directory / "model.safetensors")
    stored = sum(v.nbytes for k, v in tensors.items() if STATE not in k and not k.endswith("quant_map"))
    one = port.make_mesh("1x1")
    with port.open_checkpoint(directory) as ckpt:
        opened = ckpt.bytes_read
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, one.shape)
        port.place(recipe, ckpt, one)
        assert ckpt.bytes_read - opened == stored


def test_gpt2_conv1d_weights_are_shown_as_the_checkpoint_stores_them(tmp_path):
    """transformers quantizes GPT-2's `Conv1D` weights transposed (`[out, in]`); port shows
    them `[in, out]` as the unquantized checkpoint has them, so `mappings/gpt2.toml` applies
    (the square `attn.c_proj` would otherwise load transposed)."""
    directory = quantize_model(torch_gpt2(), tmp_path, bnb_4bit_quant_type="fp4")
    with port.open_checkpoint(directory) as ckpt:
        info = ckpt.tensors["transformer.h.0.attn.c_attn.weight"]
        assert info.shape == (64, 192) and info.stored == (192, 64)
        assert info.describe() == "bitsandbytes fp4, blocks of 64, absmax float32, transposed"
    expected = reference_logits(torch_gpt2(), directory, transposed=("c_attn", "c_proj", "c_fc"))
    ours = np.asarray(logits(port.load(directory, mesh="4x2"), INPUT_IDS))
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


# ------------------------------------------------------------------ bad input


def _json(text: bytes):
    return lambda t: t | {"w.weight" + STATE + "nf4": np.frombuffer(text, np.uint8)}


def _state(**changes):
    def change(tensors):
        key = "w.weight" + STATE + "nf4"
        fields = json.loads(tensors[key].tobytes()) | changes
        return tensors | {key: np.frombuffer(json.dumps(fields).encode(), np.uint8)}

    return change


def _drop(*suffixes):
    return lambda t: {k: v for k, v in t.items() if not k.endswith(suffixes)}


BAD = {
    "not json": (_json(b'{"quant_type": "nf4", '), r"'w\.weight\.quant_state\.bitsandbytes__nf4': not valid JSON"),
    "not an object": (_json(b"[1, 2]"), "the quant_state is not a JSON object"),
    "shape lies": (_state(shape=[40, 98]), r"'w\.weight' is uint8\[2000, 1\], but \[40, 98\] packed two per byte"),
    "shape not two": (_state(shape=[4000]), r"shape \[4000\] is not two positive integers"),
    "blocksize": (_state(blocksize=48), "blocksize 48 is not one of 32, 64"),
    "dtype": (_state(dtype="int8"), "dtype 'int8' is not one of float32, bfloat16, float16"),
    "quant_type lies": (_state(quant_type="fp4"), "quant_type 'fp4' is not the 'nf4' its name says"),
    "unknown key": (_state(scale=2), "unknown quant_state key 'scale'"),
    "unknown quant type": (
        lambda t: {k.replace("__nf4", "__int4"): v for k, v in t.items()},
        r"'w\.weight\.quant_state\.bitsandbytes__int4': quant type 'int4' is not nf4 or fp4",
    ),
    "no absmax": (_drop(".absmax"), r"'w\.weight' is bitsandbytes 4-bit but has no 'w\.weight\.absmax' beside it"),
    "no quant_map": (_drop(".quant_map"), r"has no 'w\.weight\.quant_map' beside it"),
    "absmax short": (
        lambda t: t | {"w.weight.absmax": t["w.weight.absmax"][:-1]},
        r"'w\.weight\.absmax' is float32\[62\], but 'w\.weight' needs float32\[63\]",
    ),
    "no state": (_drop("bitsandbytes__nf4"), r"'w\.weight\.absmax' has no 'w\.weight\.quant_state\.bitsandbytes__nf4'"),
    "nested without nested_absmax": (
        lambda t: (
            _state(nested_blocksize=256, nested_dtype="float32", nested_offset=0.5)(t)
            | {"w.weight.absmax": t["w.weight.absmax"].astype(np.uint8)}
        ),
        r"has no 'w\.weight\.nested_absmax' beside it",
    ),
    "nested half said": (_state(nested_blocksize=256), "a nested quant_state without nested_dtype"),
    "nested offset": (
        _state(nested_blocksize=256, nested_dtype="float32", nested_offset=1e39),
        r"nested_offset 1e\+39 is not a number float32 holds",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_naming_the_tensor(weights, tmp_path, name):
    change, message = BAD[name]
    tensors = change(load_file(weights("nf4") / "model.safetensors"))  # [40, 100] in 63 blocks of 64
    directory = write_tensors(tmp_path / "bad", tensors)
    with pytest.raises(CheckpointError, match=message) as error:
        port.open_checkpoint(directory)
    assert "\n" not in str(error.value) and str(error.value).startswith("model.safetensors: ")


def test_an_eight_bit_checkpoint_is_refused(weights, tmp_path):
    tensors = load_file(weights("nf4") / "model.safetensors")
    directory = write_tensors(tmp_path / "8bit", tensors, {"quant_method": "bitsandbytes", "load_in_8bit": True})
    with pytest.raises(CheckpointError, match="has no load_in_4bit true: port reads bitsandbytes' 4-bit"):
        port.open_checkpoint(directory)


@pytest.mark.slow
def test_port_plan_shows_the_format_and_refuses_a_lying_state(llama, tmp_path):
    directory, _ = llama
    planned = run_port("plan", str(directory), "--mesh", "4x2")
    assert planned.returncode == 0, planned.stderr
    assert "quantized: bitsandbytes nf4, blocks of 64, absmax uint8 nested by 256" in planned.stdout
    tensors = load_file(directory / "model.safetensors")
    key = "model.layers.1.mlp.up_proj.weight" + STATE + "nf4"
    fields = json.loads(tensors[key].tobytes()) | {"shape": [128, 63]}
    tensors[key] = np.frombuffer(json.dumps(fields).encode(), np.uint8)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_text((directory / "config.json").read_text())
    one_line(
        run_port("plan", str(bad), "--mesh", "4x2"),
        "'model.layers.1.mlp.up_proj.weight' is uint8[4096, 1], but [128, 63] packed two per byte is uint8[4032, 1]",
    )
