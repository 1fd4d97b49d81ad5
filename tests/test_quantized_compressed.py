"""compressed-tensors checkpoints (`quant_method: "compressed-tensors"`), read as published.

Each test checkpoint is a tiny random Qwen3 quantized and written by the compressed-tensors
package itself (its `apply_quantization_config`, qparams from `calculate_qparams` on the
weights' min and max, `ModelCompressor.compress_model`, `save_pretrained`, `update_config`),
so the tensors and `quantization_config` are laid out exactly as the package writes them:
`pack-quantized` int4 (with and without zero points, bfloat16 and float32 scales), int3
(values across int32 words), int2 (float16 scales) and int8 per channel, `nvfp4-pack-quantized`,
and FP8 per channel and per tensor (`float-quantized`) and in 16x16 blocks (`naive-quantized`).
The references:

- every region read equals, bit for bit, the package's own decompression of that module
  (its compressor's `decompress`), for regions unaligned to groups and packing, and reads
  exactly its packed words, its covering scales and zero-point words (counted here);
- a loaded model's logits (1x1, 4x2) equal those of transformers' own load of the same
  compressed checkpoint (`CompressedTensorsConfig(dequantize=True)`, on CPU), and its
  parameters that model's weights bit for bit; on 4x2 each device reads its share, exactly.
"""

import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

import port
from port._errors import CheckpointError

from helpers import VOCAB, logits, one_line, run_port, transformers_or_skip

IDS = np.random.default_rng(1).integers(3, VOCAB, (2, 12))
QWEN3 = dict(  # every input width (64, 96, 128) a multiple of 16: NVFP4's and the package's groups
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    initializer_range=0.2,
    bos_token_id=0,
    eos_token_id=0,
)
GROUP = dict(type="int", strategy="group", group_size=16)
FP8_STATIC_INPUT = dict(num_bits=8, type="float", strategy="tensor", dynamic=False)  # an input_scale
NVFP4_INPUT = dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="local")
NVFP4 = dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, scale_dtype="float8_e4m3fn")
# name: (weights, input_activations, the model's dtype when quantized)
VARIANTS = {
    "int4": (dict(num_bits=4, **GROUP), None, "bfloat16"),
    "int4-zero": (dict(num_bits=4, symmetric=False, **GROUP), None, "float32"),
    "int3-zero": (dict(num_bits=3, symmetric=False, **GROUP), None, "float32"),
    "int8-channel": (dict(num_bits=8, type="int", strategy="channel", symmetric=False), None, "bfloat16"),
    "int2-zero": (dict(num_bits=2, type="int", strategy="group", group_size=32, symmetric=False), None, "float16"),
    "nvfp4": (NVFP4, NVFP4_INPUT, "float32"),
    "fp8-channel": (dict(num_bits=8, type="float", strategy="channel"), FP8_STATIC_INPUT, "bfloat16"),
    "fp8-tensor": (dict(num_bits=8, type="float", strategy="tensor"), FP8_STATIC_INPUT, "float16"),
    "fp8-block": (dict(num_bits=8, type="float", strategy="block", block_structure=[16, 16]), None, "float32"),
}
KEYS = (
    "model.layers.0.self_attn.q_proj.weight",  # [96, 64]
    "model.layers.1.self_attn.o_proj.weight",  # [64, 96]
    "model.layers.1.mlp.down_proj.weight",  # [64, 128]
)
REGIONS = (((5, 37), (3, 50)), ((1, 2), (17, 18)), ((0, 64), (9, 31)), ((63, 64), (0, 64)), ((16, 48), (16, 32)))


def compressed_tensors():
    transformers_or_skip()
    return pytest.importorskip("compressed_tensors", exc_type=ImportError)


def torch_qwen3():
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**QWEN3)
    config._attn_implementation = "eager"
    return transformers.Qwen3ForCausalLM(config).eval()


def calibrate(module) -> None:
    """Set a quantized module's weight qparams from its weight's min and max, as llm-compressor's
    min-max observer does (`calculate_qparams`, and `generate_gparam` for a global scale);
    activation scales (static ones) to 1."""
    import torch
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args, weight = module.quantization_scheme.weights, module.weight.data
    global_scale = None
    if args.strategy == "tensor_group":
        global_scale = generate_gparam(weight.amin(), weight.amax())
        module.weight_global_scale.data.copy_(global_scale)
    if args.strategy in ("group", "tensor_group"):
        grouped = weight.unflatten(-1, (-1, args.group_size))
        low, high = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "block":
        (bm, bn), (m, n) = args.block_structure, weight.shape
        blocks = weight.reshape(m // bm, bm, n // bn, bn)
        low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
    elif args.strategy == "channel":
        low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    else:
        low, high = weight.amin(), weight.amax()
    scale, zero = calculate_qparams(low, high, args, global_scale=global_scale)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    for name in ("input_scale", "input_global_scale"):
        if hasattr(module, name):
            getattr(module, name).data.copy_(torch.ones_like(getattr(module, name)))
    module.quantization_status = QuantizationStatus.FROZEN


def write_compressed(model, directory: Path, name: str) -> Path:
    """`model` quantized by the compressed-tensors package as `VARIANTS[name]` says (every
    Linear but lm_head), compressed and saved in its layout with its quantization_config."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    weights, inputs, dtype = VARIANTS[name]
    model = copy.deepcopy(model).to(getattr(torch, dtype))
    arguments = {k: getattr(torch, v) if k == "scale_dtype" else v for k, v in weights.items()}
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**arguments),
        input_activations=None if inputs is None else QuantizationArgs(**inputs),
    )
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            calibrate(module)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(str(directory))
    return directory


def decompressed(directory: Path, key: str) -> np.ndarray:
    """The package's own decompression of the module of weight `key` (its compressor's `decompress`), as float32."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    settings = json.loads((directory / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(settings).config_groups["group_0"]
    module = key.removesuffix(".weight") + "."
    tensors = {k.removeprefix(module): v for k, v in load_file(directory / "model.safetensors").items()}
    state = {k: v for k, v in tensors.items() if k.startswith("weight")}
    return BaseCompressor.get_value_from_registry(scheme.format).decompress(state, scheme)["weight"].float().numpy()


def transformers_load(directory: Path):
    """transformers' own load of the compressed checkpoint, dequantized on CPU, in float32."""
    transformers = transformers_or_skip()
    import torch

    config = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=config, dtype=torch.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): the directory of VARIANTS[name], written on first use (one source model for all)."""
    compressed_tensors()
    source, made = torch_qwen3(), {}

    def get(name):
        if name not in made:
            made[name] = write_compressed(source, tmp_path_factory.mktemp(name), name)
        return made[name]

    return get


def expected_bytes(name: str, region) -> int:
    """The bytes a region of a [out, in] weight of VARIANTS[name] reads, from the format's layout:
    packed words of its rows, scales of the groups (or blocks, rows) covering it, zero-point words."""
    (a, b), (c, d) = region
    weights, _, dtype = VARIANTS[name]
    rows, itemsize = b - a, {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]
    if name.startswith("int"):
        bits, words = weights["num_bits"], lambda lo, hi: -(-hi * weights["num_bits"] // 32) - lo * bits // 32
        size = weights.get("group_size")
        groups = -(-d // size) - c // size if size else 1
        zero = words(a, b) * groups * 4 if not weights.get("symmetric", True) else 0
        return rows * words(c, d) * 4 + rows * groups * itemsize + zero
    if name == "nvfp4":
        return rows * (-(-d // 2) - c // 2) + rows * (-(-d // 16) - c // 16) + 4
    if name == "fp8-channel":
        return rows * (d - c) + rows * itemsize
    if name == "fp8-tensor":
        return rows * (d - c) + itemsize
    return rows * (d - c) + (-(-b // 16) - a // 16) * (-(-d // 16) - c // 16) * itemsize


# ------------------------------------------------------------------ exact regions


@pytest.mark.parametrize("name", list(VARIANTS))
def test_regions_equal_the_packages_decompression_and_read_only_their_words_and_groups(checkpoints, name):
    directory = checkpoints(name)
    with port.open_checkpoint(directory) as ckpt:
        for key in KEYS:
            info, reference = ckpt.tensors[key], decompressed(directory, key)
            assert info.shape == reference.shape and info.dtype == np.float32
            for region in (*REGIONS, tuple((0, n) for n in info.shape)):
                before = ckpt.bytes_read
                got = ckpt.read(key, region)
                np.testing.assert_array_equal(got, reference[tuple(slice(a, b) for a, b in region)], err_msg=key)
                assert ckpt.bytes_read - before == expected_bytes(name, region), (key, region)


def test_describe_names_the_format_and_its_companions(checkpoints):
    described = {}
    for name in VARIANTS:
        with port.open_checkpoint(checkpoints(name)) as ckpt:
            described[name] = ckpt.tensors["model.layers.0.mlp.down_proj.weight"].describe()
            assert "model.layers.0.mlp.down_proj.weight_packed" not in ckpt.tensors
            assert not [k for k in ckpt.tensors if k.endswith(("_scale", "_shape", "_zero_point"))]
    assert described == {
        "int4": "int4 pack-quantized (8 per int32), groups of 16, scales weight_scale bfloat16",
        "int4-zero": "int4 pack-quantized (8 per int32), groups of 16, scales weight_scale float32, "
        "zero points weight_zero_point",
        "int3-zero": "int3 pack-quantized (32 in 3 int32), groups of 16, scales weight_scale float32, "
        "zero points weight_zero_point",
        "int8-channel": "int8 pack-quantized (4 per int32), per-channel, scales weight_scale bfloat16, "
        "zero points weight_zero_point",
        "int2-zero": "int2 pack-quantized (16 per int32), groups of 32, scales weight_scale float16, "
        "zero points weight_zero_point",
        "nvfp4": "nvfp4 e2m1 (2 per byte), groups of 16, scales weight_scale float8_e4m3fn, "
        "global scale weight_global_scale",
        "fp8-channel": "fp8 e4m3fn float-quantized, per-channel, scales weight_scale bfloat16",
        "fp8-tensor": "fp8 e4m3fn float-quantized, one scale, scales weight_scale float16",
        "fp8-block": "fp8 e4m3fn naive-quantized, 16x16 blocks, scales weight_scale float32",
    }


def test_opening_reads_no_tensor_byte_but_the_weight_shape_of_per_channel_packed_weights(checkpoints):
    """[out, in] comes from the headers (a group's scales fix `in`); per channel the packed width
    leaves `in` to within 32 / num_bits, so each module's 16-byte weight_shape is read."""
    for name, read in (("int4-zero", 0), ("nvfp4", 0), ("fp8-block", 0), ("int8-channel", 14 * 16)):
        with port.open_checkpoint(checkpoints(name)) as ckpt:
            assert ckpt.bytes_read == read, name


# ------------------------------------------------------------------ models


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")  # dequantize=True, the rest its own
@pytest.mark.parametrize("name", ["int4", "int4-zero", "nvfp4", "fp8-channel"])
def test_logits_and_parameters_equal_transformers_own_load(checkpoints, name):
    """Loaded on 1x1 and 4x2 in float32 (a bfloat16 checkpoint's values widened, as transformers does)."""
    directory = checkpoints(name)
    reference = transformers_load(directory)
    import torch

    with torch.no_grad():
        expected = reference(torch.tensor(IDS)).logits.numpy()
    q_proj = reference.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    for mesh in ("1x1", "4x2"):
        model = port.load(directory, mesh=mesh, dtype="float32")
        assert np.abs(np.asarray(logits(model, IDS)) - expected).max() <= 1e-4, mesh
        np.testing.assert_array_equal(np.asarray(model.blocks.attn.wq[0]), q_proj.reshape(6, 16, 64))


def test_the_default_dtype_is_the_checkpoints(checkpoints):
    assert port.load(checkpoints("int4"), mesh="1x1").blocks.mlp.down.dtype == np.dtype("bfloat16")
    assert port.load(checkpoints("nvfp4"), mesh="1x1").blocks.mlp.down.dtype == np.float32


@pytest.mark.parametrize("name", ["int4-zero", "nvfp4"])
def test_each_device_reads_its_packed_words_and_the_groups_that_cover_them(checkpoints, name):
    """Placing on 4x2 reads exactly, per distinct block of each leaf, its packed words, scales and
    zero-point words (counted here from the layout, not by port), and every other tensor's region."""
    mesh = port.make_mesh("4x2")
    with port.open_checkpoint(checkpoints(name)) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, mesh.shape)
        expected = 0
        for leaf in recipe.leaves:
            for box in leaf.shards(mesh.shape):
                region, keys = leaf.source_region(box)
                if leaf.notes and leaf.notes[0].startswith("quantized: "):
                    expected += expected_bytes(name, region) * len(keys)
                else:
                    info = ckpt.tensors[keys[0]]
                    expected += math.prod(b - a for a, b in region) * info.dtype.itemsize * len(keys)
        assert recipe.read_bytes == expected
        port.place(recipe, ckpt, mesh)
        assert ckpt.bytes_read == expected


# ------------------------------------------------------------------ bad input


def corrupted(source: Path, tmp_path: Path, change) -> Path:
    """A copy of `source` with `change(tensors, quantization_config)` applied."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "bad"
    shutil.copytree(source, directory)
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    change(tensors, config["quantization_config"])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


DOWN = "model.layers.1.mlp.down_proj"
BAD = {
    "missing scale": (
        "int4",
        lambda t, c: t.pop(f"{DOWN}.weight_scale"),
        f"model.safetensors: tensor '{DOWN}.weight_packed' has no '{DOWN}.weight_scale' beside it",
    ),
    "missing zero point": (
        "int4-zero",
        lambda t, c: t.pop(f"{DOWN}.weight_zero_point"),
        f"model.safetensors: tensor '{DOWN}.weight_packed' has no '{DOWN}.weight_zero_point' beside it "
        "(config group 'group_0' is asymmetric)",
    ),
    "group size": (
        "int4",
        lambda t, c: c["config_groups"]["group_0"]["weights"].update(group_size=32),
        "model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight_packed' is [64, 16], but "
        "'model.layers.0.mlp.down_proj.weight_scale' [64, 8] in groups of 32 makes 256 columns of 4 bits, "
        "32 int32 a row",  # the first in the file
    ),
    "packed width": (
        "int4",
        lambda t, c: t.update({f"{DOWN}.weight_packed": t[f"{DOWN}.weight_packed"][:, :15].clone()}),
        f"model.safetensors: tensor '{DOWN}.weight_packed' is [64, 15], but '{DOWN}.weight_scale' [64, 8] "
        "in groups of 16 makes 128 columns of 4 bits, 16 int32 a row",
    ),
    "nvfp4 scales": (
        "nvfp4",
        lambda t, c: t.update({f"{DOWN}.weight_scale": t[f"{DOWN}.weight_scale"][:, :7].clone()}),
        f"model.safetensors: tensor '{DOWN}.weight_scale' is [64, 7], but '{DOWN}.weight_packed' [64, 128] "
        "(nvfp4-pack-quantized, groups of 16) needs [64, 8]",
    ),
    "zero-point rows": (
        "int4-zero",
        lambda t, c: t.update({f"{DOWN}.weight_zero_point": t[f"{DOWN}.weight_zero_point"][:7].clone()}),
        f"model.safetensors: tensor '{DOWN}.weight_zero_point' is int32 [7, 8], but '{DOWN}.weight_packed''s "
        "4-bit zero points packed along its 64 rows are int32 [8, 8]",
    ),
    "weight_shape": (
        "int8-channel",
        lambda t, c: t.update({f"{DOWN}.weight_shape": t[f"{DOWN}.weight_shape"] * 2}),
        f"model.safetensors: tensor '{DOWN}.weight_shape' holds [128, 256], but '{DOWN}.weight_packed' is "
        "[64, 32] of 8-bit values",
    ),
    "unknown format": (
        "int4",
        lambda t, c: c["config_groups"]["group_0"].update(format="marlin-24"),
        "config.json: quantization_config.config_groups['group_0']: format 'marlin-24' is not supported "
        "(supported: pack-quantized, nvfp4-pack-quantized, float-quantized, int-quantized, naive-quantized)",
    ),
    "group without weights": (
        "int4",
        lambda t, c: c["config_groups"]["group_0"].update(weights=None),
        "config.json: no quantization_config.config_groups entry has 'weights'",
    ),
    "no target": (
        "int4",
        lambda t, c: c["config_groups"]["group_0"].update(targets=["re:.*self_attn.*"]),
        "model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight_packed' is quantized, but no "
        "quantization_config.config_groups entry targets it",
    ),
    "ignored": (
        "fp8-channel",
        lambda t, c: c["ignore"].append("re:.*down_proj"),
        "model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight' is quantized, but "
        "quantization_config.ignore lists it ('re:.*down_proj')",
    ),
    "bad pattern": (
        "int4",
        lambda t, c: c["ignore"].append("re:(["),
        "config.json: quantization_config.ignore 're:([' is not a regular expression: ",
    ),
    "orphan": (
        "nvfp4",
        lambda t, c: t.update({"model.layers.0.extra.weight_global_scale": t[f"{DOWN}.weight_global_scale"].clone()}),
        "model.safetensors: tensor 'model.layers.0.extra.weight_global_scale' belongs to no quantized weight",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_contradicting_tensors_and_configs_fail_in_one_line_before_any_byte_is_read(checkpoints, tmp_path, case):
    name, change, message = BAD[case]
    directory = corrupted(checkpoints(name), tmp_path, change)
    with pytest.raises(CheckpointError) as raised:
        port.open_checkpoint(directory)
    assert str(raised.value).startswith(message), str(raised.value)


def test_a_nan_scale_fails_when_its_region_is_read(checkpoints, tmp_path):
    def nan(tensors, config):
        tensors[f"{DOWN}.weight_scale"][3, 2] = float("nan")

    directory = corrupted(checkpoints("int4-zero"), tmp_path, nan)
    with port.open_checkpoint(directory) as ckpt:
        ckpt.read(f"{DOWN}.weight", ((0, 3), (0, 128)))  # rows without it
        with pytest.raises(CheckpointError, match=f"tensor '{DOWN}.weight_scale' holds a NaN or infinite scale"):
            ckpt.read(f"{DOWN}.weight", ((0, 8), (0, 64)))


@pytest.mark.slow
def test_port_plan_shows_the_format_and_refuses_a_contradiction_in_one_line(checkpoints, tmp_path):
    directory = checkpoints("int4-zero")
    planned = run_port("plan", str(directory), "--mesh", "4x2")
    assert planned.returncode == 0, planned.stderr
    assert "quantized: int4 pack-quantized (8 per int32), groups of 16" in planned.stdout
    _, change, message = BAD["zero-point rows"]
    bad = corrupted(directory, tmp_path, change)
    one_line(run_port("plan", str(bad), "--mesh", "4x2"), message)
