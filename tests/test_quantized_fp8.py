"""FP8 checkpoints with block scales (`quant_method: "fp8"`), read as published: DeepSeek-V3 /
Kimi K2 (MLA, blocks that do not divide `kv_a_proj_with_mqa`), Qwen3 `-FP8` and Qwen3-MoE.

Test checkpoints are tiny random transformers models quantized here by the format's
definition (per block of 16x16: scale = amax / 448, q = float8_e4m3fn(x / scale),
`weight_scale_inv` = scale beside each `*proj.weight`), laid out as the Hub's. The references:

- the dequantized tensors equal transformers' `_dequantize_fp8_weight` (its FP8 integration's
  ceil-divided blocks) bit for bit, region by region, for float32, E8M0 (`F8_E8M0` and uint8)
  and per-tensor scales, blocks that do not divide the shape, stacked experts;
- a loaded model's parameters equal port's load of the same checkpoint dequantized by that
  function (bit for bit, every leaf), and its logits equal transformers' from that dequantized
  checkpoint; where every block divides its weight (Qwen3), also transformers' own FP8 load
  (`FineGrainedFP8Config(dequantize=True)`), in float32 and, for the parameters, bfloat16;
- each device reads exactly its region's FP8 bytes and the scale blocks that cover them,
  in one process and in each of two.
"""

import json
import math
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import port
from port._errors import CheckpointError

from helpers import VOCAB, assert_same, logits, one_line, run_port, saved_once, transformers_or_skip

FP8 = ml_dtypes.float8_e4m3fn
BLOCK = 16
IDS = np.random.default_rng(1).integers(3, VOCAB, (2, 12))

QWEN3 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    initializer_range=0.2,
    bos_token_id=0,
    eos_token_id=0,
)
QWEN3_MOE = dict(QWEN3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def quantize(w: np.ndarray, block=(BLOCK, BLOCK)) -> tuple[np.ndarray, np.ndarray]:
    """`w` ([..., M, N]) in FP8 e4m3 with one float32 scale per block (ceil-divided): the format's definition."""
    *lead, m, n = w.shape
    (bm, bn), grid = block, (-(-m // block[0]), -(-n // block[1]))
    padded = np.zeros((*lead, grid[0] * bm, grid[1] * bn), np.float32)
    padded[..., :m, :n] = w
    blocks = padded.reshape(*lead, grid[0], bm, grid[1], bn)
    scale = np.abs(blocks).max(axis=(-3, -1)) / 448.0
    scale[scale == 0] = 1.0
    q = (blocks / scale[..., :, None, :, None]).reshape(padded.shape)[..., :m, :n]
    return q.astype(FP8), scale.astype(np.float32)


def reference(q: np.ndarray, scale: np.ndarray, block, dtype="float32") -> np.ndarray:
    """transformers' own dequantization of an FP8 weight (`_dequantize_fp8_weight`), as NumPy."""
    import torch
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight = torch.from_numpy(np.ascontiguousarray(q).view(np.uint8)).view(torch.float8_e4m3fn)
    scales = torch.from_numpy(np.ascontiguousarray(scale).view(np.uint8)).view(
        {np.dtype(np.float32): torch.float32, np.dtype(ml_dtypes.float8_e8m0fnu): torch.float8_e8m0fnu}[scale.dtype]
    )
    out = _dequantize_fp8_weight(weight, scales.float(), None if block is None else list(block), getattr(torch, dtype))
    return out.float().numpy().astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)


def quantized_keys(tensors: dict) -> list[str]:
    """The weights the Hub's FP8 checkpoints quantize: every projection (not norms, embeddings, head, routers)."""
    return [k for k, v in tensors.items() if "proj" in k and k.endswith(".weight") and v.ndim >= 2]


def write_fp8(source: Path, out: Path, block=(BLOCK, BLOCK)) -> tuple[Path, Path]:
    """`source` (a save_pretrained directory) as an FP8 checkpoint at `out`, and the same
    dequantized by transformers' function at `out`-dequantized: (fp8, dequantized)."""
    tensors = load_file(source / "model.safetensors")
    fp8, plain = dict(tensors), dict(tensors)
    for key in quantized_keys(tensors):
        q, scale = quantize(tensors[key].astype(np.float32), block)
        fp8[key], fp8[key + "_scale_inv"] = q, scale
        plain[key] = reference(q, scale, block).astype(tensors[key].dtype)
    config = json.loads((source / "config.json").read_text())
    dequantized = out.with_name(out.name + "-dequantized")
    for directory, weights in ((out, fp8), (dequantized, plain)):
        directory.mkdir(parents=True)
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
        settings = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        settings["weight_block_size"] = list(block)
        written = config | ({"quantization_config": settings} if directory == out else {})
        (directory / "config.json").write_text(json.dumps(written))
    return out, dequantized


def torch_model(name: str):
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    if name == "deepseek_v3":
        from test_deepseek_v3 import torch_deepseek

        return torch_deepseek("lora")
    arch, config = {"qwen3": ("Qwen3", QWEN3), "qwen3_moe": ("Qwen3Moe", QWEN3_MOE)}[name]
    config = getattr(transformers, f"{arch}Config")(**config)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return getattr(transformers, f"{arch}ForCausalLM")(config)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """get(name): (fp8 directory, dequantized directory, transformers' logits from the dequantized one)."""
    saved = saved_once(tmp_path_factory, torch_model, IDS)
    made = {}

    def get(name):
        if name not in made:
            source = saved(name).directory
            fp8, dequantized = write_fp8(source, tmp_path_factory.mktemp("fp8") / name)
            made[name] = fp8, dequantized, torch_logits_of(dequantized)
        return made[name]

    return get


def torch_logits_of(directory: Path) -> np.ndarray:
    transformers = transformers_or_skip()
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def load_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as NumPy, float8 included (safetensors' NumPy loader refuses them)."""
    import torch
    from safetensors.torch import load_file as load_torch

    kinds = {
        torch.float8_e4m3fn: FP8,
        torch.float8_e8m0fnu: ml_dtypes.float8_e8m0fnu,
        torch.bfloat16: ml_dtypes.bfloat16,
    }
    return {
        k: v.view(torch.uint8).numpy().view(kinds[v.dtype]) if v.dtype in kinds else v.numpy()
        for k, v in load_torch(path).items()
    }


# ------------------------------------------------------------------ the format, region by region


def write_one(directory: Path, tensors: dict, settings: dict, dtype="float32") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    config = {"model_type": "llama", "dtype": dtype, "quantization_config": {"quant_method": "fp8"} | settings}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


REGIONS = [((0, 120), (0, 64)), ((16, 32), (0, 64)), ((5, 117), (3, 61)), ((112, 120), (48, 64)), ((7, 8), (9, 10))]


@pytest.mark.parametrize("scales", ["float32", "e8m0", "uint8"])
def test_regions_dequantize_as_transformers_does_and_read_only_their_blocks(tmp_path, scales):
    """A [120, 64] weight in 16x16 blocks (the last row of blocks half full, where transformers
    5.24's loader, deriving the block from the grid, is off): each region equals
    `_dequantize_fp8_weight`'s, reading its rows and columns and the scale blocks that cover them."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 2, (120, 64)).astype(np.float32)
    q, scale = quantize(w)
    if scales != "float32":  # ue8m0: powers of two (rounded up, as DeepSeek's scale_fmt does)
        scale = np.exp2(np.ceil(np.log2(scale))).astype(ml_dtypes.float8_e8m0fnu)
        q = (w / np.repeat(np.repeat(scale.astype(np.float32), 16, 0), 16, 1)[:120]).astype(FP8)
    expected = reference(q, scale, (BLOCK, BLOCK))
    stored = scale.view(np.uint8) if scales == "uint8" else scale
    settings = {"weight_block_size": [16, 16]} | ({"scale_fmt": "ue8m0"} if scales != "float32" else {})
    directory = write_one(tmp_path / "c", {"w.weight": q, "w.weight_scale_inv": stored}, settings)
    with port.open_checkpoint(directory) as ckpt:
        assert list(ckpt.tensors) == ["w.weight"]
        info = ckpt.tensors["w.weight"]
        assert info.shape == (120, 64) and info.dtype == np.float32
        assert info.describe() == f"fp8 e4m3fn, 16x16 blocks, scales weight_scale_inv {stored.dtype.name}"
        for region in REGIONS:
            before = ckpt.bytes_read
            got = ckpt.read("w.weight", region)
            (a, b), (c, d) = region
            assert np.array_equal(got.view(np.uint32), expected[a:b, c:d].view(np.uint32)), region
            scale_rows, scale_cols = -(-b // 16) - a // 16, -(-d // 16) - c // 16
            assert ckpt.bytes_read - before == (b - a) * (d - c) + scale_rows * scale_cols * stored.itemsize


def test_per_tensor_scales_and_stacked_experts(tmp_path):
    """`weight_block_size: null`: one scale per tensor (absent, it is 128x128, transformers' default); a [4, 40, 24] stack of experts in 16x16
    blocks has a [4, 3, 2] grid of scales."""
    rng = np.random.default_rng(1)
    w = rng.normal(0, 1, (40, 24)).astype(np.float32)
    s = np.float32(np.abs(w).max() / 448)
    q = (w / s).astype(FP8)
    directory = write_one(
        tmp_path / "tensor", {"w.weight": q, "w.weight_scale_inv": np.array([s])}, {"weight_block_size": None}
    )
    with port.open_checkpoint(directory) as ckpt:
        assert ckpt.tensors["w.weight"].describe() == "fp8 e4m3fn, one scale, scales weight_scale_inv float32"
        assert np.array_equal(ckpt.read("w.weight", ((3, 9), (0, 24))), reference(q, np.array([s]), None)[3:9])
        assert ckpt.bytes_read == 6 * 24 + 4
    stack = rng.normal(0, 1, (4, 40, 24)).astype(np.float32)
    q, scale = quantize(stack)
    assert scale.shape == (4, 3, 2)
    directory = write_one(
        tmp_path / "stack", {"e.weight": q, "e.weight_scale_inv": scale}, {"weight_block_size": [16, 16]}
    )
    with port.open_checkpoint(directory) as ckpt:
        got = ckpt.read("e.weight", ((1, 3), (20, 40), (10, 24)))
        expected = np.stack([reference(q[i], scale[i], (16, 16)) for i in range(4)])
        assert np.array_equal(got, expected[1:3, 20:40, 10:24])
        assert ckpt.bytes_read == 2 * 20 * 14 + 2 * 2 * 2 * 4


# ------------------------------------------------------------------ families, against transformers


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3", "qwen3_moe"])
def test_a_loaded_model_is_the_dequantized_checkpoint_and_matches_transformers(checkpoints, name):
    fp8, dequantized, expected = checkpoints(name)
    model = port.load(fp8, mesh="4x2")
    assert_same(model, port.load(dequantized, mesh="4x2"))
    ours = np.asarray(logits(model, IDS))
    print(f"{name}: max |port - transformers| {np.abs(ours - expected).max():.3g}")
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def test_kv_a_proj_blocks_do_not_divide_its_rows(checkpoints):
    """DeepSeek-V3's `kv_a_proj_with_mqa` has kv_lora_rank + rope dims rows (576 in the real
    model, 22 here): its last row of blocks is partial, as the format allows."""
    fp8, _, _ = checkpoints("deepseek_v3")
    header = load_tensors(fp8 / "model.safetensors")
    assert header["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (22, 48)
    assert header["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 3)


def test_qwen3_matches_transformers_own_fp8_load_in_float32_and_bfloat16(checkpoints):
    """Where every block divides its weight, transformers can load the FP8 checkpoint itself
    (dequantize=True, on CPU): its parameters are port's, bit for bit, in float32 and bfloat16."""
    transformers = transformers_or_skip()
    import torch

    fp8, _, expected = checkpoints("qwen3")
    for dtype in ("float32", "bfloat16"):
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            fp8,
            quantization_config=transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=[16, 16]),
            dtype=getattr(torch, dtype),
        )
        model = port.load(fp8, mesh="1x1", dtype=dtype)
        for ours, key in (
            (model.blocks.mlp.down, "model.layers.{}.mlp.down_proj.weight"),
            (model.blocks.attn.wk, "model.layers.{}.self_attn.k_proj.weight"),
        ):
            for layer in range(2):
                reference_weight = theirs.state_dict()[key.format(layer)].float().numpy()
                mine = np.asarray(ours[layer]).astype(np.float32).reshape(reference_weight.shape)
                assert np.array_equal(mine, reference_weight), (dtype, key)
        if dtype == "float32":
            with torch.no_grad():
                np.testing.assert_allclose(theirs(torch.tensor(IDS)).logits.numpy(), expected, atol=1e-5, rtol=0)


def test_the_checkpoints_dtype_is_the_default_and_dtype_overrides_it(tmp_path, checkpoints):
    fp8, _, _ = checkpoints("qwen3")
    copy = tmp_path / "bf16"
    shutil.copytree(fp8, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    model = port.load(copy, mesh="1x1")
    assert model.blocks.mlp.down.dtype == ml_dtypes.bfloat16
    assert port.load(copy, mesh="1x1", dtype="float32").blocks.mlp.down.dtype == np.float32


# ------------------------------------------------------------------ bytes read, partial loads


def test_each_device_reads_its_fp8_region_and_the_scale_blocks_that_cover_it(checkpoints):
    """Placing on 4x2 reads exactly the plan's bytes: per distinct block of each leaf, its FP8
    region plus its covering scale blocks, counted here from the shapes, not by port."""
    fp8, _, _ = checkpoints("qwen3_moe")
    mesh = port.make_mesh("4x2")
    with port.open_checkpoint(fp8) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, mesh.shape)
        assert ckpt.bytes_read == 0
        expected = 0
        for leaf in recipe.leaves:
            for box in leaf.shards(mesh.shape):
                region, keys = leaf.source_region(box)
                info = ckpt.tensors[keys[0]]
                if leaf.notes and leaf.notes[0].startswith("quantized: "):
                    (a, b), (c, d) = region
                    scales = (-(-b // 16) - a // 16) * (-(-d // 16) - c // 16) * 4
                    expected += ((b - a) * (d - c) + scales) * len(keys)
                else:
                    expected += math.prod(y - x for x, y in region) * info.dtype.itemsize * len(keys)
        assert recipe.read_bytes == expected
        port.place(recipe, ckpt, mesh)
        assert ckpt.bytes_read == expected


def test_include_and_layers_read_only_what_they_select(checkpoints):
    fp8, dequantized, _ = checkpoints("qwen3")
    part = port.load(fp8, mesh="4x2", include=["blocks.mlp"], layers=range(1, 2))
    whole = port.load(dequantized, mesh="4x2")
    assert part.embed is None and part.blocks.attn.wq is None
    assert np.array_equal(np.asarray(part.blocks.mlp.down[0]), np.asarray(whole.blocks.mlp.down[1]))


# ------------------------------------------------------------------ every path


@pytest.mark.slow
def test_convert_plan_and_restore_through_the_installed_port(checkpoints, tmp_path):
    fp8, dequantized, expected = checkpoints("qwen3")
    planned = run_port("plan", str(fp8), "--mesh", "4x2")
    assert planned.returncode == 0, planned.stderr
    assert "quantized: fp8 e4m3fn, 16x16 blocks, scales weight_scale_inv float32" in planned.stdout
    out = tmp_path / "out"
    converted = run_port("convert", str(fp8), "--mesh", "4x2", "--out", str(out))
    assert converted.returncode == 0, converted.stderr
    info = run_port("info", str(out))
    assert info.returncode == 0, info.stderr
    (row,) = [line for line in info.stdout.splitlines() if line.startswith("blocks.mlp.down ")]
    assert row.endswith("fp8 e4m3fn, 16x16 blocks, scales weight_scale_inv float32")
    assert "quantized source" in info.stdout
    leaves = {leaf["path"]: leaf for leaf in json.loads(run_port("info", str(out), "--json").stdout)["leaves"]}
    assert leaves["embed"]["quantized"] is None
    assert leaves["blocks.attn.wq"]["quantized"] == "fp8 e4m3fn, 16x16 blocks, scales weight_scale_inv float32"
    restored = port.restore(out, port.make_mesh("4x2"))
    assert_same(restored, port.load(dequantized, mesh="4x2"))
    np.testing.assert_allclose(np.asarray(logits(restored, IDS)), expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_two_processes_each_read_their_share_of_an_fp8_checkpoint(checkpoints, tmp_path):
    from test_multiprocess import expected_reads, free_port, run_processes

    fp8, dequantized, _ = checkpoints("qwen3_moe")
    out, address = tmp_path / "out", f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "port", "convert", str(fp8), "--mesh", "4x2", "--out", str(out)]
    command += ["--report", str(tmp_path / "run.json"), "--coordinator", address, "--num-processes", "2"]
    run_processes(lambda i: command + ["--process-id", str(i)])
    reports = [json.loads((tmp_path / f"run.{i}.json").read_text()) for i in range(2)]
    shares = expected_reads(fp8, port.mesh_shape("4x2"))
    assert [r["bytes_read"] for r in reports] == shares
    assert_same(port.restore(out, port.make_mesh("4x2")), port.load(dequantized, mesh="4x2"))


@pytest.mark.slow
def test_an_fp8_checkpoint_over_http_and_hf_loads_as_the_local_one(checkpoints, monkeypatch):
    import huggingface_hub.constants
    from test_remote import start_server

    fp8, dequantized, _ = checkpoints("qwen3")
    expected = port.load(dequantized, mesh="4x2")
    httpd = start_server(fp8.parent)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", httpd.base)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token")  # what the test server's Hub wants
    httpd.state.hub = ("/someone/fp8/resolve/main/", Path(fp8.name))
    try:
        for url in (f"{httpd.base}/{fp8.name}", "hf://someone/fp8"):
            with port.open_checkpoint(url) as ckpt:
                assert ckpt.tensors["model.layers.0.mlp.down_proj.weight"].shape == (64, 96)
            model = port.load(url, mesh="4x2")
            assert_same(model, expected)
    finally:
        httpd.shutdown()


# ------------------------------------------------------------------ bad input


def corrupted(source: Path, tmp_path: Path, change) -> Path:
    directory = tmp_path / "bad"
    shutil.copytree(source, directory)
    tensors = load_tensors(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


SCALE = "model.layers.1.mlp.down_proj.weight_scale_inv"
BAD = {
    "missing scale": (
        lambda t, c: t.pop(SCALE),
        "model.safetensors: tensor 'model.layers.1.mlp.down_proj.weight' is float8_e4m3fn but has no "
        "'model.layers.1.mlp.down_proj.weight_scale_inv' beside it",
    ),
    "scales not covering": (
        lambda t, c: t.update({SCALE: t[SCALE][:, :3]}),
        f"model.safetensors: tensor '{SCALE}' is [4, 3], but 'model.layers.1.mlp.down_proj.weight' [64, 96] "
        "in 16x16 blocks needs [4, 6]",
    ),
    "block size": (
        lambda t, c: c["quantization_config"].update(weight_block_size=[32, 32]),
        "model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight_scale_inv' is [4, 6], but "
        "'model.layers.0.mlp.down_proj.weight' [64, 96] in 32x32 blocks needs [2, 3]",  # the first in the file
    ),
    "bad block": (
        lambda t, c: c["quantization_config"].update(weight_block_size=[0, 16]),
        "config.json: quantization_config.weight_block_size [0, 16] must be two positive integers",
    ),
    "unknown method": (
        lambda t, c: c["quantization_config"].update(quant_method="fp3"),
        "config.json: quantization_config.quant_method 'fp3' is not supported (supported: ",
    ),
    "orphan scale": (
        lambda t, c: t.update({"model.layers.0.extra.weight_scale_inv": t[SCALE]}),
        "model.safetensors: tensor 'model.layers.0.extra.weight_scale_inv' scales 'model.layers.0.extra.weight', "
        "which the checkpoint lacks",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_contradicting_tensors_fail_in_one_line_before_any_byte_is_read(checkpoints, tmp_path, case):
    change, message = BAD[case]
    fp8, _, _ = checkpoints("qwen3")
    directory = corrupted(fp8, tmp_path, change)
    with pytest.raises(CheckpointError) as raised:
        port.open_checkpoint(directory)
    assert str(raised.value).startswith(message)


@pytest.mark.slow
def test_the_command_line_refuses_them_and_a_nan_scale_leaves_nothing(checkpoints, tmp_path):
    fp8, _, _ = checkpoints("qwen3")
    directory = corrupted(fp8, tmp_path, BAD["scales not covering"][0])
    result = run_port("plan", str(directory), "--mesh", "4x2")
    one_line(result, "tensor 'model.layers.1.mlp.down_proj.weight_scale_inv' is [4, 3]")

    def nan(tensors, config):
        tensors[SCALE] = tensors[SCALE].copy()
        tensors[SCALE][2, 1] = np.nan

    shutil.rmtree(directory)
    directory = corrupted(fp8, tmp_path, nan)
    out = tmp_path / "out"
    result = run_port("convert", str(directory), "--mesh", "4x2", "--out", str(out))
    one_line(result, f"model.safetensors: tensor '{SCALE}' holds a NaN or infinite scale", out=out)
