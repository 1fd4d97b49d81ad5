"""MXFP4 (`quant_method: "mxfp4"`, gpt-oss): the packed experts read as transformers' fused ones.

References: transformers' own MXFP4 dequantization (`convert_moe_packed_tensors`, which its
`Mxfp4Config(dequantize=True)` load runs) for the values, bit for bit, on random packed bytes
and scales; transformers' `GptOssForCausalLM` loaded from the same quantized checkpoint with
`Mxfp4Config(dequantize=True)` on CPU for the logits. The checkpoint is tests/test_gpt_oss.py's
model (hidden 96, inter 64: whole groups of 32) written by `save_pretrained`, its experts
quantized by the format's definition (OCP MX: a power-of-two scale per 32 values, e2m1
round to nearest) into the Hub's layout and `quantization_config`. Also: the exact bytes a
region and each device of a 4x2 load read, `include` / `layers` partial loads, `port plan`,
one-line errors; and DeepSeek-V4's FP4 experts (`_fp8`, `expert_dtype: "fp4"`) against
transformers' `Fp8Dequantize._dequantize_one`.
"""

import json
from collections import Counter
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from test_gpt_oss import IDS, torch_gpt_oss

import port
from port._errors import CheckpointError
from port._skeleton import leaves

from helpers import (
    element_bytes,
    logits,
    one_line,
    place_on,
    read_offsets,
    recorded_reads,
    run_port,
    transformers_or_skip,
    write_checkpoint,
)

FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
# openai/gpt-oss-20b's and -120b's quantization_config.
QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
SIZES = dict(hidden_size=96, intermediate_size=64)  # 3 and 2 groups of 32; 96 / 4 devices cuts groups
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


def is_mxfp4(info):
    """Whether `info` is an MXFP4 source (by name: importing port's module here would register the
    format that `port._sources._quantized` must register itself)."""
    return type(info).__name__ == "Mxfp4Experts"


def mxfp4(weight):
    """`weight` [experts, inputs, rows] (transformers' fused layout) quantized as the format defines it:
    (blocks uint8 [experts, rows, inputs / 32, 16], scales uint8 [experts, rows, inputs / 32]), each
    group's scale the power of two that brings its largest value to e2m1's range, values to the nearest."""
    rows = np.swapaxes(weight, 1, 2)
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    top = np.abs(groups).max(-1)
    exponent = np.clip(np.floor(np.log2(np.maximum(top, 2.0**-126))) - 2, -127, 127).astype(np.int32)
    nibbles = np.abs((groups / np.ldexp(1.0, exponent)[..., None])[..., None] - FP4).argmin(-1).astype(np.uint8)
    return np.ascontiguousarray(nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)), (exponent + 127).astype(np.uint8)


def quantize_checkpoint(source, directory):
    """The checkpoint at `source` with its experts in MXFP4, as the Hub's gpt-oss holds them, at `directory`."""
    from safetensors.numpy import load_file

    tensors = {}
    for key, value in load_file(source / "model.safetensors").items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[key + "_blocks"], tensors[key + "_scales"] = mxfp4(value)
        else:
            tensors[key] = value
    config = json.loads((source / "config.json").read_text())
    return write_checkpoint(directory, tensors, {**config, "quantization_config": QUANTIZATION})


def torch_dequantized(directory):
    """transformers' GptOssForCausalLM loaded from the MXFP4 checkpoint at `directory`, dequantized on CPU."""
    transformers = transformers_or_skip()
    import torch

    return transformers.GptOssForCausalLM.from_pretrained(
        directory,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(the MXFP4 checkpoint's directory, transformers' model loaded from it dequantized, its logits on IDS)."""
    import torch

    source = tmp_path_factory.mktemp("gpt_oss_bf")
    torch_gpt_oss(**SIZES).save_pretrained(source)
    directory = quantize_checkpoint(source, tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    model = torch_dequantized(directory)
    with torch.no_grad():
        expected = model(torch.tensor(IDS)).logits.numpy()
    return directory, model, expected


def random_packed(rng, experts, rows, groups):
    """Random MXFP4 blocks and scales: every nibble, exponents over the whole finite E8M0 range."""
    blocks = rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8)
    scales = rng.integers(0, 255, (experts, rows, groups), dtype=np.uint8)
    scales[0, 0, :] = [0, 254, 127][:groups]  # the smallest, largest and unit scales
    return blocks, scales


def write_packed(directory, blocks, scales, name="model.layers.0.mlp.experts.gate_up_proj"):
    return write_checkpoint(
        directory,
        {name + "_blocks": blocks, name + "_scales": scales},
        {"model_type": "gpt_oss", "quantization_config": QUANTIZATION},
    )


def packed_bytes(info, region):
    """The file offsets a region of an `Mxfp4Experts` must read, from the format alone: input k
    is byte k // 2 of its row of blocks (16 bytes a group of 32), and each group's scale."""
    blocks, scales = info.parts
    (e, (k0, k1), r) = region
    flat = SimpleNamespace(shape=(*blocks.shape[:2], blocks.shape[2] * 16), offset=blocks.offset, dtype=blocks.dtype)
    return element_bytes(flat, (e, r, (k0 // 2, -(-k1 // 2)))) | element_bytes(scales, (e, r, (k0 // 32, -(-k1 // 32))))


def test_pieces_cover_exactly_the_bytes_of_the_inputs():
    pieces_of = port._sources._quantized._mxfp4._pieces  # pyright: ignore  # registered by port._sources._quantized
    for start in range(0, 100):
        for stop in range(start, 101):
            pieces = pieces_of(start, stop)
            held = [g * 16 + b for (g0, g1), (b0, b1) in pieces for g in range(g0, g1) for b in range(b0, b1)]
            assert held == list(range(start // 2, -(-stop // 2))) or (start == stop and held == [])
    assert pieces_of(24, 72) == [((0, 1), (12, 16)), ((1, 2), (0, 16)), ((2, 3), (0, 4))]


def test_dequantize_is_transformers_bit_for_bit(tmp_path):
    """Random blocks and scales read region by region (aligned and not to groups, bytes, experts)
    equal transformers' `convert_moe_packed_tensors` of the whole tensor, in float32 and, cast,
    in bfloat16; each region reads exactly its bytes and the scales of its groups."""
    transformers_or_skip()
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks, scales = random_packed(rng, 3, 20, 3)
    directory = write_packed(tmp_path / "m", blocks, scales)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    theirs16 = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
    theirs, theirs16 = theirs.numpy(), theirs16.view(torch.int16).numpy()
    regions = [((0, 3), (0, 96), (0, 20)), ((1, 2), (32, 64), (4, 12)), ((0, 2), (24, 72), (3, 17))]
    regions += [((2, 3), (33, 34), (19, 20)), ((0, 3), (5, 31), (0, 20)), ((0, 1), (63, 65), (0, 1))]
    for _ in range(40):
        k0, k1 = sorted(rng.integers(0, 97, 2))
        r0, r1 = sorted(rng.integers(0, 21, 2))
        regions.append(((0, 3), (int(k0), int(k1) + 1 if k1 < 96 else 96), (int(r0), int(r1) + 1 if r1 < 20 else 20)))
    with port.open_checkpoint(directory) as ckpt:
        info = ckpt.tensors["model.layers.0.mlp.experts.gate_up_proj"]
        assert is_mxfp4(info) and info.shape == (3, 96, 20) and set(ckpt.tensors) == {info.key}
        assert theirs.shape == info.shape
        for region in regions:
            before = ckpt.bytes_read
            with recorded_reads() as calls:
                ours = ckpt.read(info.key, region)
            index = tuple(slice(a, b) for a, b in region)
            np.testing.assert_array_equal(ours.view(np.uint32), theirs[index].view(np.uint32), err_msg=str(region))
            bf16 = ours.astype(ml_dtypes.bfloat16).view(np.int16)
            np.testing.assert_array_equal(bf16, theirs16[index], err_msg=str(region))
            files, _ = read_offsets(calls)
            wanted = packed_bytes(info, region)
            assert sorted(files.tolist()) == sorted(wanted), region
            assert ckpt.bytes_read - before == len(wanted) == info.region_nbytes(region), region
    assert np.isinf(theirs).any() and (theirs[0, :32, 0] != 0).any()  # the extremes were there


def test_load_matches_transformers_1x1(quantized):
    """Logits of port's model on one device equal transformers' dequantizing load's; the expert
    leaves are its dequantized tensors, de-interleaved and transposed, bit for bit."""
    directory, model, expected = quantized
    ours = port.load(directory)
    np.testing.assert_allclose(
        np.asarray(logits(ours, IDS)), expected, atol=1e-4 * max(1.0, np.abs(expected).max()), rtol=0
    )
    experts = model.model.layers[1].mlp.experts
    gate_up, down = experts.gate_up_proj.detach().numpy(), experts.down_proj.detach().numpy()
    np.testing.assert_array_equal(np.asarray(ours.blocks.mlp.experts.gate[1]), gate_up[:, :, 0::2].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(ours.blocks.mlp.experts.up[1]), gate_up[:, :, 1::2].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(ours.blocks.mlp.experts.down[1]), down.transpose(0, 2, 1))
    assert ours.blocks.mlp.experts.gate.dtype == np.float32  # the checkpoint's dtype


def assert_read_exactly(calls, recipe, infos, mesh_shape):
    """The recorded reads are, as a multiset, the bytes of the distinct source regions of every
    distinct block of every leaf: a quantized one's packed bytes and scales (`packed_bytes`)."""
    files, _ = read_offsets(calls)
    regions = set()
    for leaf in recipe.leaves:
        for box in leaf.shards(mesh_shape):
            region, keys = leaf.source_region(box)
            regions.update((key, region) for key in keys)
    wanted = Counter()
    for key, region in regions:
        info = infos[key]
        wanted.update(packed_bytes(info, region) if is_mxfp4(info) else element_bytes(info, region))
    assert Counter(files.tolist()) == wanted
    assert recipe.read_bytes == sum(wanted.values())
    return regions


def test_load_4x2_reads_exactly_each_devices_share(quantized):
    """On 4x2 each device block reads only the blocks bytes of its inputs (24 of a row's 96 on
    `data`: half groups) and its experts, and the scales of the groups covering them; the plan's
    count is what was read. The logits equal transformers'."""
    directory, _, expected = quantized
    mesh = port.make_mesh("4x2")
    with recorded_reads() as calls:
        recipe, total, infos = place_on(directory, mesh)
    regions = assert_read_exactly(calls, recipe, infos, mesh.shape)
    assert total == recipe.read_bytes
    assert {r[1] for key, r in regions if key == GATE_UP} == {(0, 24), (24, 48), (48, 72), (72, 96)}
    gate = next(leaf for leaf in recipe.leaves if leaf.path == "blocks.mlp.experts.gate")
    assert any("quantized: mxfp4" in note for note in gate.notes), gate.notes
    model = port.load(directory, mesh=mesh)
    np.testing.assert_allclose(
        np.asarray(logits(model, IDS)), expected, atol=1e-4 * max(1.0, np.abs(expected).max()), rtol=0
    )


def test_partial_load_reads_only_its_layers_and_leaves(quantized):
    """`include` and `layers` of a quantized checkpoint: the leaves asked for, equal to the full
    load's, and only their packed bytes and scales read."""
    directory, _, _ = quantized
    full = port.load(directory)
    with recorded_reads() as calls:
        run = port.convert(directory, mesh="4x2", include=["blocks.mlp.experts"], layers=range(1, 3))
    part = leaves(run.model)
    assert run.model.embed is None and run.model.blocks.attn.wq is None
    for path in ("blocks.mlp.experts.gate", "blocks.mlp.experts.up", "blocks.mlp.experts.down"):
        np.testing.assert_array_equal(np.asarray(part[path]), np.asarray(leaves(full)[path])[1:3])
    with port.open_checkpoint(directory) as ckpt:
        regions = assert_read_exactly(calls, run.plan, ckpt.tensors, port.make_mesh("4x2").shape)
    assert {key.split(".")[2] for key, _ in regions} == {"1", "2"}
    assert run.report.bytes_read == run.plan.read_bytes


@pytest.mark.slow
def test_port_plan_shows_the_quantized_source(quantized):
    directory, _, _ = quantized
    result = run_port("plan", directory, "--mesh", "4x2")
    assert result.returncode == 0, result.stdout + result.stderr
    words = " ".join(result.stdout.split())  # the notes wrap
    for proj in ("gate_up_proj", "down_proj"):
        assert f"note: quantized: mxfp4 e2m1 (2 per byte), groups of 32, scales {proj}_scales e8m0 (uint8)" in words
    assert words.count("note: quantized: mxfp4") == 3


# ---------------------------------------------------------------- bad input


NAME = "model.layers.0.mlp.experts.down_proj"


def broken(tmp_path, **change):
    """A two-tensor MXFP4 checkpoint (`NAME`'s blocks [2, 8, 2, 16] and scales [2, 8, 2]), its
    `blocks` / `scales` given by `change(blocks=f)` as `f(the good ones)` (None: left out)."""
    blocks, scales = random_packed(np.random.default_rng(1), 2, 8, 2)
    tensors = {"blocks": blocks, "scales": scales}
    tensors = {f"{NAME}_{part}": change.get(part, lambda t: t)(t) for part, t in tensors.items()}
    tensors = {k: v for k, v in tensors.items() if v is not None}
    config = {"model_type": "gpt_oss", "quantization_config": QUANTIZATION}
    return write_checkpoint(tmp_path / "broken", tensors, config)


BAD = {
    "no scales": (
        dict(scales=lambda t: None),
        f"tensor '{NAME}_blocks' has no '{NAME}_scales' beside it",
    ),
    "no blocks": (
        dict(blocks=lambda t: None),
        f"tensor '{NAME}_scales' scales '{NAME}_blocks', which the checkpoint lacks",
    ),
    "scales short": (
        dict(scales=lambda t: t[:, :, :1].copy()),
        f"tensor '{NAME}_scales' is [2, 8, 1], but '{NAME}_blocks' [2, 8, 2, 16] needs one scale a group: [2, 8, 2]",
    ),
    "scales long": (
        dict(scales=lambda t: np.concatenate([t, t], axis=1)),
        f"tensor '{NAME}_scales' is [2, 16, 2], but '{NAME}_blocks' [2, 8, 2, 16] needs one scale a group",
    ),
    "8 bytes a group": (
        dict(blocks=lambda t: t[..., :8].copy()),
        f"tensor '{NAME}_blocks' is [2, 8, 2, 8]: MXFP4 blocks are [experts, rows, groups, 16]",
    ),
    "no expert dim": (
        dict(blocks=lambda t: t[0].copy(), scales=lambda t: t[0].copy()),
        f"tensor '{NAME}_blocks' is [8, 2, 16]: MXFP4 blocks are [experts, rows, groups, 16]",
    ),
    "int8 blocks": (
        dict(blocks=lambda t: t.view(np.int8)),
        f"tensor '{NAME}_blocks' is int8: MXFP4 blocks are uint8",
    ),
    "float scales": (
        dict(scales=lambda t: t.astype(np.float32)),
        f"tensor '{NAME}_scales' is float32: MXFP4 scales are uint8 (E8M0 exponents)",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_tensors_are_refused_in_one_line_before_any_read(tmp_path, case):
    change, message = BAD[case]
    directory = broken(tmp_path, **change)
    with recorded_reads() as calls, pytest.raises(CheckpointError) as error:
        port.open_checkpoint(directory)
    text = str(error.value)
    assert text.startswith("model.safetensors: ") and message in text and "\n" not in text, text
    assert calls == []


def test_a_nan_scale_is_refused_when_read(tmp_path):
    """E8M0's 0xFF is NaN (transformers would read it as 2 ** 128): one line naming the scales."""

    def nan(scales):
        scales[1, 3, 1] = 255
        return scales

    with port.open_checkpoint(broken(tmp_path, scales=nan)) as ckpt:
        ckpt.read(NAME, ((0, 1), (0, 64), (0, 8)))  # expert 0: no NaN read
        with pytest.raises(CheckpointError, match=rf"^model\.safetensors: tensor '{NAME}_scales' holds a NaN"):
            ckpt.read(NAME, ((1, 2), (40, 41), (3, 4)))


@pytest.mark.slow
def test_cli_refuses_scales_that_do_not_cover_the_blocks(tmp_path):
    directory = broken(tmp_path, scales=lambda t: t[:, :4].copy())
    one_line(run_port("plan", directory), f"tensor '{NAME}_scales' is [2, 4, 2], but '{NAME}_blocks' [2, 8, 2, 16]")


# ---------------------------------------------------------------- DeepSeek-V4's FP4 experts (in _fp8)


def test_deepseek_v4_fp4_experts_are_transformers_bit_for_bit(tmp_path):
    """`expert_dtype: "fp4"` (DeepSeek-V4): int8 weights of two e2m1 values a byte, low nibble
    first, one E8M0 scale per [1, 32] block, read by `_fp8` equal transformers'
    `Fp8Dequantize._dequantize_one` (after its `_unpack_fp4`), scales as E8M0 and as uint8 bytes."""
    transformers_or_skip()
    import torch
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    rng = np.random.default_rng(2)
    weight = torch.from_numpy(rng.integers(-128, 128, (40, 48), dtype=np.int8))
    exponents = torch.from_numpy(rng.integers(0, 255, (40, 3), dtype=np.uint8))
    dequantize = Fp8Dequantize(None)
    theirs = dequantize._dequantize_one(weight, exponents, output_dtype=torch.float32).numpy()
    e8m0 = exponents.view(torch.float8_e8m0fnu)
    np.testing.assert_array_equal(
        dequantize._dequantize_one(weight, e8m0, output_dtype=torch.float32).numpy().view(np.uint32),
        theirs.view(np.uint32),
    )
    name = "model.layers.0.mlp.experts.0.down_proj"
    config = {
        "model_type": "deepseek_v4",
        "quantization_config": {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
        },
    }
    for scales in (exponents, e8m0):
        directory = tmp_path / str(scales.dtype)
        directory.mkdir()
        save_file({name + ".weight": weight, name + ".weight_scale_inv": scales}, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps(config))
        with port.open_checkpoint(directory) as ckpt:
            key = name + ".weight"
            assert ckpt.tensors[key].shape == theirs.shape == (40, 96)
            for region in [((0, 40), (0, 96)), ((3, 17), (5, 77)), ((39, 40), (31, 33)), ((0, 40), (64, 96))]:
                index = tuple(slice(a, b) for a, b in region)
                np.testing.assert_array_equal(ckpt.read(key, region).view(np.uint32), theirs[index].view(np.uint32))
