"""`port export --quantize fp8` / `port.export(quantize="fp8")`: FP8 with block scales on the way
back (DeepSeek / Qwen's layout), and exports from quantized sources.

- A bfloat16 Qwen3 exported in FP8 (16x16 blocks): every projection in float8_e4m3fn with
  its float32 `weight_scale_inv`, norms, embeddings and the head untouched, the
  `quantization_config` the Hub's carry; the FP8 bytes and scales are transformers'
  `Fp8Quantize`'s of the same weights bit for bit; transformers loads the export
  (`FineGrainedFP8Config(dequantize=True)`) to the weights port reads back (exactly
  `q * scale`) and the same logits; the command line writes the same tensors.
- A round trip: FP8 checkpoints quantized here by the format's definition from float32
  weights (scale = amax / 448, q = e4m3(x / scale), blocks that do not divide the shape,
  float32 and bfloat16 scales, DeepSeek-V3's experts and router), loaded by port and
  exported unchanged with `quantize="fp8"`, give back every tensor byte for byte (fresh
  scales, from the bfloat16 values, would not: the test checks they differ).
- Without `quantize`, an FP8 source (a checkpoint, or a `port convert` output of one) is
  written in its checkpoint's dtype, bfloat16, without `quantization_config`.
- `modules_to_not_convert` matched as transformers matches it; bad values of the flags and
  arguments refused in one line (a usage error, exit 2, from the command line), nothing written;
  two processes each quantize the blocks they hold.
"""

import json
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_quantized_fp8 import QWEN3 as FP8_QWEN3

import port
from port._errors import CheckpointError, PortError

from helpers import VOCAB, logits, one_line, port_command, port_env, run_port, transformers_or_skip, usage_error

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
BLOCK = 16
IDS = np.random.default_rng(3).integers(3, VOCAB, (2, 12))
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt2"

QWEN3 = FP8_QWEN3 | {
    "tie_word_embeddings": False
}  # every projection divides into 16x16 blocks: transformers 5.24's FP8 load needs that
SETTINGS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}


def torch_model(name: str, dtype: str = "float32"):
    """A seeded tiny transformers model: `qwen3` (blocks divide it), `qwen3-uneven` (they do not),
    `deepseek_v3` (MLA, experts, a router); skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    if name == "deepseek_v3":
        from test_deepseek_v3 import torch_deepseek

        return torch_deepseek("lora", dtype=None if dtype == "float32" else dtype)
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**(QWEN3 | ({"intermediate_size": 88} if name == "qwen3-uneven" else {})))
    config._attn_implementation = "eager"
    return transformers.Qwen3ForCausalLM(config).to(getattr(torch, dtype))


def tensors_of(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory's safetensors files as NumPy, float8 included."""
    import torch
    from safetensors.torch import load_file

    kinds = {torch.float8_e4m3fn: FP8, torch.bfloat16: BF16}
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        for key, value in load_file(path).items():
            found[key] = (
                value.view(torch.uint8).numpy().view(kinds[value.dtype]) if value.dtype in kinds else value.numpy()
            )
    return found


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == b.tobytes()


def spread(scale: np.ndarray, shape) -> np.ndarray:
    """One scale per element of a weight of `shape` (ceil-divided 16x16 blocks)."""
    full = np.repeat(np.repeat(scale.astype(np.float32), BLOCK, -2), BLOCK, -1)
    return full[..., : shape[-2], : shape[-1]]


def definition(w: np.ndarray, scale_dtype) -> tuple[np.ndarray, np.ndarray]:
    """`w` in FP8 e4m3 by the format's definition: scale = amax / 448 per 16x16 block, stored in
    `scale_dtype`, q = e4m3(w / scale)."""
    m, n = w.shape
    grid = (-(-m // BLOCK), -(-n // BLOCK))
    padded = np.zeros((grid[0] * BLOCK, grid[1] * BLOCK), np.float32)
    padded[:m, :n] = w
    scale = np.abs(padded.reshape(grid[0], BLOCK, grid[1], BLOCK)).max(axis=(1, 3)) / np.float32(448)
    scale = np.where(scale == 0, np.float32(1), scale).astype(scale_dtype)
    return (w / spread(scale, w.shape)).astype(FP8), scale


def quantized_keys(tensors: dict) -> list[str]:
    """The weights the Hub's FP8 checkpoints quantize: every projection (not norms, embeddings, head, router)."""
    return [k for k, v in tensors.items() if "proj" in k and k.endswith(".weight") and v.ndim == 2]


def write_fp8(source: Path, out: Path, scale_dtype) -> Path:
    """The float32 save_pretrained directory `source` as the Hub publishes it in FP8: each
    projection quantized from its float32 values, the rest in bfloat16 (DeepSeek's router
    bias in float32), config.json's dtype bfloat16 and its quantization_config."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(source / "model.safetensors")
    written = {}
    for key, value in tensors.items():
        if key in quantized_keys(tensors):
            written[key], written[key + "_scale_inv"] = definition(value, scale_dtype)
        else:
            written[key] = value if key.endswith("e_score_correction_bias") else value.astype(BF16)
    out.mkdir(parents=True)
    save_file(written, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config |= {"dtype": "bfloat16", "quantization_config": SETTINGS}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def bf16_qwen3(tmp_path_factory):
    """The bfloat16 Qwen3 as save_pretrained writes it."""
    directory = tmp_path_factory.mktemp("qwen3") / "bf16"
    torch_model("qwen3", "bfloat16").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def fp8_export(bf16_qwen3, tmp_path_factory):
    """bf16_qwen3 loaded on 4x2 and exported with quantize="fp8", 16x16 blocks."""
    out = tmp_path_factory.mktemp("qwen3-fp8") / "hf"
    port.export(port.load(bf16_qwen3, mesh="4x2"), out, bf16_qwen3, quantize="fp8", quantize_block=(BLOCK, BLOCK))
    return out


@pytest.fixture(scope="module")
def fp8_sources(tmp_path_factory):
    """get(name, scale_dtype): an FP8 checkpoint quantized here (see `write_fp8`), made once each."""
    made = {}

    def get(name, scale_dtype="float32"):
        if (name, scale_dtype) not in made:
            root = tmp_path_factory.mktemp(f"{name}-{scale_dtype}")
            torch_model(name).save_pretrained(root / "float32")
            made[name, scale_dtype] = write_fp8(root / "float32", root / "fp8", np.dtype(scale_dtype))
        return made[name, scale_dtype]

    return get


# ---------------------------------------------------------------- a bfloat16 model written in FP8


def test_fp8_export_is_the_hub_layout_and_port_reads_back_its_scales_values(bf16_qwen3, fp8_export):
    source, written = tensors_of(bf16_qwen3), tensors_of(fp8_export)
    quantized = [k for k in source if k.endswith("_proj.weight")]
    assert len(quantized) == 14 and "lm_head.weight" in source
    assert written.keys() == source.keys() | {k + "_scale_inv" for k in quantized}
    for key, value in source.items():
        if key not in quantized:  # norms, embeddings, the head: as they were
            assert same_bytes(written[key], value), key
            continue
        (m, n), scale = value.shape, written[key + "_scale_inv"]
        assert written[key].dtype == FP8 and written[key].shape == (m, n), key
        assert scale.dtype == np.float32 and scale.shape == (m // BLOCK, n // BLOCK), key
    config = json.loads((fp8_export / "config.json").read_text())
    assert config["quantization_config"] == SETTINGS | {"modules_to_not_convert": ["lm_head", "model.embed_tokens"]}
    assert config["dtype"] == json.loads((bf16_qwen3 / "config.json").read_text())["dtype"] == "bfloat16"
    with port.open_checkpoint(fp8_export) as ckpt:  # exactly the values the scales define
        for key in quantized:
            q, scale = written[key], written[key + "_scale_inv"]
            expected = q.astype(np.float32) * spread(scale, q.shape)
            assert np.array_equal(ckpt.read(key, ((0, q.shape[0]), (0, q.shape[1]))), expected), key
    model = port.load(fp8_export, mesh="1x1")
    down = written["model.layers.1.mlp.down_proj.weight"].astype(np.float32)
    down *= spread(written["model.layers.1.mlp.down_proj.weight_scale_inv"], down.shape)
    assert model.blocks.mlp.down.dtype == BF16 and same_bytes(np.asarray(model.blocks.mlp.down[1]), down.astype(BF16))


def test_fp8_bytes_and_scales_are_transformers_fp8quantize_s(bf16_qwen3, fp8_export):
    """The same weights through transformers' own quantizer (`Fp8Quantize`): the same bytes."""
    from types import SimpleNamespace

    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    settings = SimpleNamespace(weight_block_size=(BLOCK, BLOCK), scale_fmt=None)
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=settings))
    source, written = tensors_of(bf16_qwen3), tensors_of(fp8_export)
    for key in [k for k in source if k.endswith("_proj.weight")]:
        theirs = quantize._quantize_one(key, torch.from_numpy(source[key].view(np.uint16)).view(torch.bfloat16))
        q = theirs[key].view(torch.uint8).numpy().view(FP8)
        assert same_bytes(written[key], q), key
        assert same_bytes(written[key + "_scale_inv"], theirs[key + "_scale_inv"].numpy()), key


def test_transformers_loads_the_fp8_export_as_port_does(fp8_export):
    """transformers' FP8 load (dequantize=True, on CPU): the weights port reads, bit for bit, and the logits."""
    transformers = transformers_or_skip()
    import torch

    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        fp8_export,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=[BLOCK, BLOCK]),
        dtype=torch.float32,
    ).eval()
    state = theirs.state_dict()
    with port.open_checkpoint(fp8_export) as ckpt:
        for key, info in ckpt.tensors.items():
            expected = ckpt.read(key, tuple((0, n) for n in info.shape)).astype(np.float32)
            assert np.array_equal(state[key].numpy(), expected), key
    ours = np.asarray(logits(port.load(fp8_export, mesh="1x1", dtype="float32"), IDS))
    with torch.no_grad():
        expected = theirs(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(ours, expected, atol=2e-5, rtol=0)


def test_assembled_whole_on_the_host_the_same_bytes(bf16_qwen3, fp8_export, tmp_path, monkeypatch):
    """Where the device blocks are no boxes of their tensors, each tensor is gathered whole: the same files."""
    import port._export._export as exporting

    monkeypatch.setattr(exporting, "blocks", lambda inverse, arrays: None)
    out = port.export(
        port.load(bf16_qwen3, mesh="4x2"), tmp_path / "hf", bf16_qwen3, quantize="fp8", quantize_block=16
    ).out
    for name in ("config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (fp8_export / name).read_bytes()


def test_progress_counts_the_bytes_written(bf16_qwen3, tmp_path):
    """Default 128x128 blocks, each a whole tiny weight, though 4x2's device blocks cut them: the
    progress ends at the bytes written, values and scales."""
    seen = []
    model = port.load(bf16_qwen3, mesh="4x2")
    out = port.export(model, tmp_path / "hf", bf16_qwen3, quantize="fp8", progress=seen.append).out
    written = sum(v.nbytes for v in tensors_of(out).values())
    assert seen[-1].done == seen[-1].total == written
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


def test_modules_to_not_convert_are_left_as_they_are(bf16_qwen3, tmp_path):
    """The config's names (a module and what is under it, a suffix, `.*`), as transformers reads them, stay bfloat16."""
    config = json.loads((bf16_qwen3 / "config.json").read_text())
    skip = ["model.layers.1.mlp", "o_proj", "model.layers.*.self_attn.k_proj"]
    config["quantization_config"] = {"quant_method": "fp8", "modules_to_not_convert": skip}
    model = port.load(bf16_qwen3, mesh="1x1")
    out = port.export(model, tmp_path / "hf", bf16_qwen3, config=config, quantize="fp8", quantize_block=BLOCK).out
    written = tensors_of(out)
    kept = {k for k, v in written.items() if k.endswith("_proj.weight") and v.dtype == BF16}
    assert kept == {
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        *(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in ("k", "o")),
    }
    assert sum(k.endswith("_scale_inv") for k in written) == 14 - len(kept)
    listed = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert listed[:3] == skip and {"lm_head", "model.embed_tokens"} <= set(listed)


@pytest.mark.parametrize(
    "patterns",
    [["model.layers.1.mlp"], ["o_proj"], ["layers.1"], ["model.layers.*.self_attn.k_proj"], ["mlp.gate"], ["a.*b"]],
)
def test_module_names_match_as_transformers_matches_them(patterns):
    transformers_or_skip()
    from transformers.quantizers.quantizers_utils import should_convert_module

    from port._export._quantize import _Patterns

    names = [
        "model.layers.1.mlp.down_proj",
        "model.layers.11.mlp.down_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.3.mlp.gate",
        "model.layers.3.mlp.gate_proj",
        "lm_head",
        "axxb.c",
        "axxbc",
    ]
    ours = _Patterns(patterns)
    assert [ours.match(n) for n in names] == [not should_convert_module(n, patterns) for n in names]


@pytest.mark.parametrize("names", [["(a+)+b"], "lm_head", [7], ["x" * 1001], ["*x"]])
def test_a_modules_to_not_convert_port_cannot_match_is_one_line(bf16_qwen3, tmp_path, names):
    config = json.loads((bf16_qwen3 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "modules_to_not_convert": names}
    model = port.load(bf16_qwen3, mesh="1x1")
    with pytest.raises(CheckpointError, match="modules_to_not_convert") as error:
        port.export(model, tmp_path / "hf", bf16_qwen3, config=config, quantize="fp8")
    assert "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- FP8 sources: round trips


@pytest.mark.parametrize(
    "name, scale_dtype", [("qwen3-uneven", "float32"), ("qwen3-uneven", "bfloat16"), ("deepseek_v3", "float32")]
)
def test_an_fp8_source_exported_unchanged_is_written_back_byte_for_byte(fp8_sources, tmp_path, name, scale_dtype):
    """Every tensor, FP8 weights and their scales included, equal to the source's; the source's
    scales are kept, where fresh ones (from the bfloat16 values the model holds) would differ."""
    from port._export._quantize import Target, quantize_box

    source = fp8_sources(name, scale_dtype)
    model = port.load(source, mesh="4x2")
    out = port.export(model, tmp_path / "hf", source, quantize="fp8", quantize_block=BLOCK).out
    original, written = tensors_of(source), tensors_of(out)
    assert written.keys() == original.keys()
    for key, value in original.items():
        assert same_bytes(written[key], value), key
    settings = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in settings.items() if k != "modules_to_not_convert"} == SETTINGS
    fresh = 0
    with port.open_checkpoint(source) as ckpt:
        for key in quantized_keys(original):
            values = ckpt.read(key, tuple((0, n) for n in ckpt.tensors[key].shape)).astype(BF16)
            target = Target(key, values.shape, BF16, (BLOCK, BLOCK), np.dtype(scale_dtype))
            fresh += not same_bytes(quantize_box(values, target)[1], original[key + "_scale_inv"])
    assert fresh > 0  # the source's scales, not fresh ones, give its bytes back


@pytest.mark.slow
def test_the_command_line_writes_the_source_back_given_source(fp8_sources, tmp_path):
    """`port convert` of an FP8 checkpoint, then `port export --quantize fp8 --source` it: the
    source's bytes and scales again; without --source (the output keeps no scales) they differ."""
    source = fp8_sources("qwen3-uneven")
    assert run_port("convert", source, "--mesh", "4x2", "--out", tmp_path / "jax").returncode == 0
    flags = ["--quantize", "fp8", "--quantize-block", str(BLOCK)]
    result = run_port("export", tmp_path / "jax", "--out", tmp_path / "hf", *flags, "--source", source)
    assert result.returncode == 0, result.stderr
    original, written = tensors_of(source), tensors_of(tmp_path / "hf")
    assert written.keys() == original.keys() and all(same_bytes(written[k], v) for k, v in original.items())
    assert run_port("export", tmp_path / "jax", "--out", tmp_path / "fresh", *flags).returncode == 0
    fresh = tensors_of(tmp_path / "fresh")
    assert not all(same_bytes(fresh[k], v) for k, v in original.items() if k.endswith("_scale_inv"))
    missing = run_port("export", tmp_path / "jax", "--out", tmp_path / "none", *flags, "--source", tmp_path / "nowhere")
    one_line(missing, "nowhere", out=tmp_path / "none")


@pytest.fixture(scope="module")
def unquantized(fp8_sources, tmp_path_factory):
    """The uneven Qwen3's FP8 checkpoint loaded by port and exported without quantize."""
    source = fp8_sources("qwen3-uneven")
    return port.export(port.load(source, mesh="1x1"), tmp_path_factory.mktemp("unquantized") / "hf", source).out


def test_an_fp8_source_exported_without_quantize_is_written_in_bfloat16(fp8_sources, unquantized):
    """The dequantized weights in the checkpoint's dtype, as port loads them; no scales, no quantization_config."""
    source = fp8_sources("qwen3-uneven")
    written = tensors_of(unquantized)
    assert written.keys() == {k for k in tensors_of(source) if not k.endswith("_scale_inv")}
    with port.open_checkpoint(source) as ckpt:
        for key, value in written.items():
            expected = ckpt.read(key, tuple((0, n) for n in value.shape)).astype(BF16)
            assert same_bytes(value, expected), key
    config = json.loads((unquantized / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"


@pytest.mark.slow
def test_a_convert_output_of_an_fp8_source_exports_in_bfloat16(fp8_sources, unquantized, tmp_path):
    """`port convert` of the FP8 checkpoint records its tensors as they load (bfloat16), so `port
    export` of that output writes what Python's export of the checkpoint writes."""
    assert run_port("convert", fp8_sources("qwen3-uneven"), "--out", tmp_path / "jax").returncode == 0
    result = run_port("export", tmp_path / "jax", "--out", tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    written, expected = tensors_of(tmp_path / "hf"), tensors_of(unquantized)
    assert written.keys() == expected.keys() and all(same_bytes(written[k], v) for k, v in expected.items())
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())


# ---------------------------------------------------------------- the command line


@pytest.mark.slow
def test_the_command_line_writes_what_python_writes(bf16_qwen3, fp8_export, tmp_path):
    """`port convert` then `port export --quantize fp8 --quantize-block 16`: the same tensors;
    without --quantize-block, 128x128 blocks (one partial block per tiny weight)."""
    assert run_port("convert", bf16_qwen3, "--out", tmp_path / "jax").returncode == 0
    result = run_port(
        "export", tmp_path / "jax", "--out", tmp_path / "hf", "--quantize", "fp8", "--quantize-block", "16", "--json"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["quantize"] == "fp8"
    written, expected = tensors_of(tmp_path / "hf"), tensors_of(fp8_export)
    assert written.keys() == expected.keys() and all(same_bytes(written[k], v) for k, v in expected.items())
    result = run_port("export", tmp_path / "jax", "--out", tmp_path / "default", "--quantize", "fp8")
    assert result.returncode == 0, result.stderr
    settings = json.loads((tmp_path / "default" / "config.json").read_text())["quantization_config"]
    assert settings["weight_block_size"] == [128, 128]
    written = tensors_of(tmp_path / "default")
    with port.open_checkpoint(tmp_path / "default") as ckpt:
        for key in [k for k in written if k.endswith("_proj.weight")]:
            q, scale = written[key], written[key + "_scale_inv"]
            assert scale.shape == (1, 1) and q.dtype == FP8
            whole = ((0, q.shape[0]), (0, q.shape[1]))
            assert np.array_equal(ckpt.read(key, whole), q.astype(np.float32) * scale[0, 0]), key


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, named",
    [
        (["--quantize", "int3"], "--quantize"),
        (["--quantize", "fp8", "--quantize-block", "0x5"], "--quantize-block"),
        (["--quantize", "fp8", "--quantize-block", "abc"], "--quantize-block"),
        (["--quantize", "fp8", "--quantize-block", "16x"], "--quantize-block"),
        (["--quantize-block", "16"], "--quantize-block"),
    ],
)
def test_bad_quantize_flags_are_usage_errors(tmp_path, flags, named):
    (tmp_path / "jax").mkdir()
    result = run_port("export", tmp_path / "jax", "--out", tmp_path / "hf", *flags)
    usage_error(result, named)
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("Error:")]  # one line says it
    assert named in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jax"]


def test_the_command_line_offers_the_formats_export_writes():
    import typing

    from port import _cli
    from port._export._quantize_args import METHODS

    assert typing.get_args(_cli.Quantize) == METHODS


@pytest.mark.parametrize(
    "arguments, named",
    [
        ({"quantize": "int3"}, "quantize='int3'"),
        ({"quantize": "fp8", "quantize_block": (0, 5)}, "quantize_block=(0, 5)"),
        ({"quantize": "fp8", "quantize_block": "abc"}, "quantize_block='abc'"),
        ({"quantize_block": 16}, "quantize_block=16 needs quantize"),
    ],
)
def test_bad_quantize_arguments_are_one_line(bf16_qwen3, tmp_path, arguments, named):
    model = port.load(bf16_qwen3, mesh="1x1")
    with pytest.raises(PortError) as error:
        port.export(model, tmp_path / "hf", bf16_qwen3, **arguments)
    assert named in str(error.value) and "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- two processes


@pytest.mark.slow
def test_two_processes_quantize_the_blocks_they_hold(tmp_path):
    """tiny-gpt2 exported by 2 processes x 4 devices with --quantize fp8: the files one process
    writes; with 128x128 blocks, which the processes' boxes cut, one line each and nothing written."""
    from test_multiprocess import free_port

    converted = tmp_path / "jax"
    port.convert(EXAMPLE, mesh="1x1", out=converted)
    single = port.export(
        port.restore(converted, mesh="4x2"), tmp_path / "one", converted, quantize="fp8", quantize_block=BLOCK
    ).out

    def run(out, *flags):
        address = f"127.0.0.1:{free_port()}"
        argv = [*port_command(), "export", str(converted), "--mesh", "4x2", "--out", str(out), *flags]
        argv += ["--coordinator", address, "--num-processes", "2"]
        procs = [
            subprocess.Popen(
                [*argv, "--process-id", str(i)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=port_env(),
            )
            for i in range(2)
        ]
        done = [p.communicate(timeout=240) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, done)]

    results = run(tmp_path / "two", "--quantize", "fp8", "--quantize-block", str(BLOCK))
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    shares = [int(r.stderr.split("this process wrote ")[1].split("(")[1].split(" bytes")[0]) for r in results]
    assert 0 < shares[1] < shares[0]
    written, expected = tensors_of(tmp_path / "two"), tensors_of(single)
    assert written.keys() == expected.keys() and all(same_bytes(written[k], v) for k, v in expected.items())
    assert any(v.dtype == FP8 for v in written.values())
    assert (tmp_path / "two" / "config.json").read_bytes() == (single / "config.json").read_bytes()
    for result in run(tmp_path / "cut", "--quantize", "fp8"):  # each process names the tensors, in one line
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("port: error: ")]
        assert len(errors) == 1 and "c_attn.weight': a process holds its box" in errors[0], result.stderr
        assert "cuts its 128x128 blocks" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jax", "one", "two"]
