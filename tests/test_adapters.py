"""PEFT LoRA adapters read and merged: `open_adapter`, `MergedCheckpoint`, `port.load(..., adapter=)`
and `port convert --adapter`.

Tiny random bases written with transformers, adapters with PEFT (`init_lora_weights=False`:
non-zero A and B) in tmp_path; nothing is downloaded. The merged weights equal PEFT's
`merge_and_unload()` within one rounding of the dtype, the loaded model's logits the
`PeftModel`'s, each block reads only the factor rows and columns it needs, and every bad
adapter is refused in one line before any tensor byte is read.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import port
from port._adapters import MergedCheckpoint, open_adapter
from port._adapters._merged import _oriented
from port._errors import PortError

from helpers import INPUT_IDS, logits, one_line, run_port, torch_gpt2, torch_llama, torch_logits, usage_error

REPO = Path(__file__).resolve().parents[1]
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CASES = {
    # name: (base, base dtype, LoraConfig's arguments)
    "linear": ("llama", None, dict(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS)),
    "embedding_and_saved_head": (
        "llama",
        None,
        dict(r=4, lora_alpha=16, target_modules=["q_proj", "embed_tokens"], modules_to_save=["lm_head"]),
    ),
    "rslora_patterns": (
        "llama",
        None,
        dict(
            r=8,
            lora_alpha=4,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"v_proj": 2, "layers.1.self_attn.q_proj": 3},
            alpha_pattern={"down_proj": 32},
        ),
    ),
    "dora": ("llama", None, dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "o_proj", "up_proj"])),
    "bfloat16": ("llama", "bfloat16", dict(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS)),
    "gpt2_conv1d": ("gpt2", None, dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"])),
}


def _torch_base(kind, dtype):
    return torch_llama(dtype=dtype) if kind == "llama" else torch_gpt2()


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """get(name): (base directory, adapter directory, PeftModel's logits, merge_and_unload's state dict),
    made on the first call for each case."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    made = {}

    def get(name):
        if name not in made:
            kind, dtype, settings = CASES[name]
            root = tmp_path_factory.mktemp(name)
            base = root / "base"
            _torch_base(kind, dtype).save_pretrained(base)
            fan_in_fan_out = kind == "gpt2"
            peft_model = get_peft_model(
                AutoModelForCausalLM.from_pretrained(base),
                LoraConfig(init_lora_weights=False, fan_in_fan_out=fan_in_fan_out, **settings),
            )
            _train_saved_modules(peft_model)
            peft_model.save_pretrained(root / "adapter")
            loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), root / "adapter").eval()
            expected = torch_logits(loaded, INPUT_IDS)
            merged = {k: v.float().numpy() for k, v in loaded.merge_and_unload().state_dict().items()}
            made[name] = (base, root / "adapter", expected, merged)
        return made[name]

    return get


def _train_saved_modules(peft_model):
    """Change the copies `modules_to_save` made (PEFT starts them equal to the base's), as training would."""
    import torch

    generator = torch.Generator().manual_seed(1)
    for module in peft_model.modules():
        if isinstance(getattr(module, "modules_to_save", None), torch.nn.ModuleDict):
            weight = module.modules_to_save["default"].weight
            with torch.no_grad():
                weight.add_(0.1 * torch.randn(weight.shape, generator=generator).to(weight.dtype))


def _full(ckpt, key):
    return ckpt.read(key, tuple((0, n) for n in ckpt.tensors[key].shape))


def _ulp(x, dtype):
    """One unit in the last place of `x` in `dtype` (bfloat16: 8 significant bits; float32: 24)."""
    bits = 8 if dtype == "bfloat16" else 24
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 1e-30))) - bits + 1)


@pytest.mark.parametrize("name", list(CASES))
def test_merged_weights_equal_merge_and_unload(cases, name):
    """Every tensor read through `MergedCheckpoint` (whole, and in blocks that cut rows and
    columns) equals PEFT's `merge_and_unload()` state dict within one rounding of its dtype;
    the adapted ones differ from the base."""
    base_dir, adapter_dir, _, merged = cases(name)
    with port.open_checkpoint(base_dir) as base:
        adapter = open_adapter(adapter_dir, base, base_name=str(base_dir))
        ckpt = MergedCheckpoint(base, adapter)
        assert adapter.targets, name
        changed = set(adapter.targets) | set(adapter.saved)
        for key, info in ckpt.tensors.items():
            ours = _full(ckpt, key)
            theirs = merged[key if key in merged else f"transformer.{key}"]
            if info.dtype.name == "bfloat16":
                assert np.all(np.abs(ours.astype(np.float32) - theirs) <= _ulp(theirs, "bfloat16")), key
            else:
                np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=key)
            if key in changed:
                assert not np.array_equal(ours, base.read(key, tuple((0, n) for n in info.shape))), key
            if len(info.shape) == 2 and min(info.shape) > 2:
                rows, cols = info.shape[0] // 3, info.shape[1] // 2
                blocks = np.empty(info.shape, info.dtype)
                ckpt.read_into(
                    key,
                    [
                        (((0, rows), (0, cols)), blocks[:rows, :cols]),
                        (((0, rows), (cols, info.shape[1])), blocks[:rows, cols:]),
                        (((rows, info.shape[0]), (0, info.shape[1])), blocks[rows:]),
                    ],
                )
                np.testing.assert_array_equal(blocks, ours, err_msg=key)


def test_scales_follow_rslora_and_the_patterns(cases):
    """`rank_pattern` / `alpha_pattern` give modules their own rank and alpha (PEFT's suffix
    match), and rsLoRA divides by the rank's square root."""
    base_dir, adapter_dir, _, _ = cases("rslora_patterns")
    with port.open_checkpoint(base_dir) as base:
        targets = open_adapter(adapter_dir, base).targets
    layer = "model.layers.{}.{}.weight"
    found = {
        key: (t.rank, t.scale)
        for key, t in targets.items()
        if key in (layer.format(0, "self_attn.q_proj"), layer.format(1, "self_attn.q_proj"))
        or key.endswith(("v_proj.weight", "down_proj.weight"))
    }
    assert found[layer.format(0, "self_attn.q_proj")] == (8, pytest.approx(4 / 8**0.5))
    assert found[layer.format(1, "self_attn.q_proj")] == (3, pytest.approx(4 / 3**0.5))
    assert found[layer.format(0, "self_attn.v_proj")] == (2, pytest.approx(4 / 2**0.5))
    assert found[layer.format(1, "mlp.down_proj")] == (8, pytest.approx(32 / 8**0.5))


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
@pytest.mark.parametrize("name", ["embedding_and_saved_head", "dora", "gpt2_conv1d"])
def test_logits_equal_the_peft_model_s(cases, name, mesh):
    """`port.load(base, adapter=...)` gives the `PeftModel`'s logits (float32), on one device and on
    4x2: GPT-2's fused `c_attn` (a Conv1D, `fan_in_fan_out`) merges as any other weight."""
    base_dir, adapter_dir, expected, _ = cases(name)
    model = port.load(base_dir, mesh=port.make_mesh(mesh), adapter=adapter_dir)
    np.testing.assert_allclose(np.asarray(logits(model, INPUT_IDS)), expected, atol=2e-5, rtol=1e-5)


def test_the_plain_base_s_logits_differ(cases):
    """The comparison above can fail: the base alone does not give the adapted logits."""
    base_dir, _, expected, _ = cases("embedding_and_saved_head")
    assert np.abs(np.asarray(logits(port.load(base_dir), INPUT_IDS)) - expected).max() > 1e-3


def test_each_block_reads_only_its_factor_rows_and_columns(cases, monkeypatch):
    """On 4x2, each block of an adapted weight reads the rows of `lora_B` of its outputs and the
    columns of `lora_A` of its inputs, and nothing else of the adapter: the adapter's bytes read
    are exactly those, fewer than whole factors per block; on 1x1, each factor is read once whole."""
    base_dir, adapter_dir, _, _ = cases("linear")
    blocks = []
    delta = MergedCheckpoint._delta

    def spy(self, target, outs, ins):
        blocks.append((target, outs, ins))
        return delta(self, target, outs, ins)

    monkeypatch.setattr(MergedCheckpoint, "_delta", spy)
    for mesh in ("1x1", "4x2"):
        blocks.clear()
        report = port.convert(base_dir, mesh=port.make_mesh(mesh), adapter=adapter_dir).report
        with port.open_checkpoint(base_dir) as base:
            adapter = open_adapter(adapter_dir, base)
            outputs = {key: base.tensors[key].shape[0] for key in adapter.targets}
            whole = sum(adapter.checkpoint.tensors[k].nbytes for t in adapter.targets.values() for k in (t.a, t.b))
        needed = sum(((o1 - o0) + (i1 - i0)) * t.rank * 4 for t, (o0, o1), (i0, i1) in blocks)
        assert report.adapter_bytes_read == needed, mesh
        assert {t.weight for t, _, _ in blocks} == set(outputs)
        if mesh == "1x1":
            assert needed == whole
        else:  # the model axis cuts outputs (or inputs): blocks read parts of the factors
            assert any(o1 - o0 < outputs[t.weight] for t, (o0, o1), _ in blocks)


def test_oriented_regions():
    """A region of an `[in, out]` weight (Conv1D, embedding) is its outputs' columns and inputs' rows."""
    from port._adapters import Target

    linear = Target("m", "m.weight", "a", "b", None, 2, 1.0, "linear")
    conv = Target("m", "m.weight", "a", "b", None, 2, 1.0, "conv1d")
    assert _oriented(linear, ((0, 3), (4, 8))) == ((0, 3), (4, 8))
    assert _oriented(conv, ((0, 3), (4, 8))) == ((4, 8), (0, 3))


# ---------------------------------------------------------------------------- bad adapters


def _edited(adapter_dir, tmp_path, config=None, tensors=None, drop=()):
    """A copy of `adapter_dir` with `config` merged into its adapter_config.json, `tensors` added or
    replacing, and the tensors `drop` names left out."""
    from safetensors.numpy import load_file, save_file

    out = tmp_path / "edited"
    shutil.copytree(adapter_dir, out)
    if config is not None:
        path = out / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    if tensors is not None or drop:
        held = load_file(out / "adapter_model.safetensors")
        held = {k: v for k, v in held.items() if k not in drop} | (tensors or {})
        save_file(held, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return out


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
BAD = {
    "ia3": (dict(config={"peft_type": "IA3"}), "adapter_config.json: peft_type is 'IA3'"),
    "prompt_tuning": (dict(config={"peft_type": "PROMPT_TUNING"}), "peft_type is 'PROMPT_TUNING'"),
    "no_rank": (dict(config={"r": None}), "field 'r' is None"),
    "bad_alpha": (dict(config={"lora_alpha": "8"}), "field 'lora_alpha' is '8'"),
    "bad_rank_pattern": (dict(config={"rank_pattern": {"q_proj": 0}}), "rank_pattern['q_proj'] is 0"),
    "bad_alpha_pattern": (dict(config={"alpha_pattern": {"v_proj": -1}}), "alpha_pattern['v_proj'] is -1"),
    "rank_contradicts": (
        dict(config={"r": 3}),
        "lora_A.weight' has shape [4, 128] (float32), expected [3, 128] (rank 3",
    ),
    "pattern_rank_contradicts": (dict(config={"rank_pattern": {"v_proj": 2}}), "expected [2, 64] (rank 2"),
    "shape_contradicts_base": (
        dict(tensors={f"{Q0}.lora_B.weight": np.zeros((65, 4), np.float32)}),
        f"'{Q0}.lora_B.weight' has shape [65, 4]",
    ),
    "missing_module": (
        dict(
            tensors={
                "base_model.model.model.layers.0.self_attn.z_proj.lora_A.weight": np.zeros((4, 64), np.float32),
                "base_model.model.model.layers.0.self_attn.z_proj.lora_B.weight": np.zeros((64, 4), np.float32),
            }
        ),
        "base checkpoint has no 'model.layers.0.self_attn.z_proj.weight'",
    ),
    "unknown_key": (
        dict(tensors={"base_model.model.model.norm.scale": np.zeros(64, np.float32)}),
        "tensor 'base_model.model.model.norm.scale' is not a LoRA tensor PEFT writes",
    ),
    "missing_lora_b": (dict(drop=(f"{Q0}.lora_B.weight",)), f"'{Q0}.lora_A.weight' has no lora_B beside it"),
    "base_name": (
        dict(config={"base_model_name_or_path": "meta-llama/Llama-3.2-1B"}),
        "base_model_name_or_path is 'meta-llama/Llama-3.2-1B', but the base loaded is",
    ),
    "lora_bias": (dict(config={"lora_bias": True}), "field 'lora_bias' is set"),
    "layer_replication": (dict(config={"layer_replication": [[0, 2]]}), "field 'layer_replication' is set"),
    "bias": (dict(config={"bias": "all"}), "field 'bias' is 'all'"),
    "dora_without_magnitude": (dict(config={"use_dora": True}), "has no lora_magnitude_vector (use_dora is true)"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_adapter_is_refused_before_any_byte_is_read(cases, tmp_path, name):
    """Each bad adapter is one PortError naming the adapter's file and the field or key; neither
    checkpoint has read a tensor byte."""
    base_dir, adapter_dir, _, _ = cases("linear")
    edits, message = BAD[name]
    bad = _edited(adapter_dir, tmp_path, **edits)
    with port.open_checkpoint(base_dir) as base:
        with pytest.raises(PortError) as caught:
            open_adapter(bad, base, base_name=str(base_dir))
        assert base.bytes_read == 0
    said = str(caught.value)
    assert "\n" not in said and str(bad) in said, said
    assert message in said, said


def test_not_an_adapter_directory(cases, tmp_path):
    """A base checkpoint given as the adapter: no adapter_config.json, said in one line."""
    base_dir, _, _, _ = cases("linear")
    with port.open_checkpoint(base_dir) as base:
        with pytest.raises(PortError, match="no adapter_config.json"):
            open_adapter(base_dir, base)


def test_the_command_line_s_modes_are_the_library_s():
    """`--adapter-mode`'s choices are `adapter_mode=`'s (spelled in `_cli` so `--help` imports no NumPy)."""
    import typing

    from port._cli import AdapterMode
    from port._convert import ADAPTER_MODES

    assert typing.get_args(AdapterMode) == ADAPTER_MODES


def test_a_bad_adapter_mode_is_refused(cases):
    base_dir, adapter_dir, _, _ = cases("linear")
    with pytest.raises(PortError, match="adapter_mode='merged': expected 'merge' or 'keep'"):
        port.load(base_dir, adapter=adapter_dir, adapter_mode="merged")


# ---------------------------------------------------------------------------- the command line


@pytest.mark.slow
def test_port_convert_with_an_adapter(cases, tmp_path):
    """`port convert BASE --adapter ADAPTER` writes the merged model (restored, the PeftModel's
    logits) and says the adapter and the bytes read from it."""
    base_dir, adapter_dir, expected, _ = cases("embedding_and_saved_head")
    out = tmp_path / "out"
    result = run_port("convert", base_dir, "--adapter", adapter_dir, "--out", out, "--report", tmp_path / "r.json")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["adapter"] == str(adapter_dir) and report["adapter_mode"] == "merge"
    assert 0 < report["adapter_bytes_read"] < report["bytes_read"]
    np.testing.assert_allclose(np.asarray(logits(port.restore(out), INPUT_IDS)), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ia3", "rank_contradicts", "missing_module", "base_name"])
def test_port_convert_refuses_a_bad_adapter_in_one_line(cases, tmp_path, name):
    """A bad adapter through the command line: one `port: error:` line, exit 1, nothing written."""
    base_dir, adapter_dir, _, _ = cases("linear")
    edits, message = BAD[name]
    bad = _edited(adapter_dir, tmp_path, **edits)
    out = tmp_path / "out"
    one_line(run_port("convert", base_dir, "--adapter", bad, "--out", out), message, out=out)


@pytest.mark.slow
def test_adapter_flags_misused(cases, tmp_path):
    """--adapter-mode without --adapter, or a mode that is not one, is a usage error; --adapter-only
    on an output without a kept adapter is one line, and nothing is written."""
    base_dir, adapter_dir, _, _ = cases("linear")
    usage_error(run_port("convert", base_dir, "--adapter-mode", "keep", "--out", tmp_path / "o"), "needs --adapter")
    usage_error(
        run_port("convert", base_dir, "--adapter", adapter_dir, "--adapter-mode", "merged", "--out", tmp_path / "o"),
        "--adapter-mode",
    )
    plain = tmp_path / "plain"
    assert run_port("convert", base_dir, "--out", plain).returncode == 0
    out = tmp_path / "exported"
    one_line(run_port("export", plain, "--adapter-only", "--out", out), "holds no adapter", out=out)


def test_load_keeps_the_adapter_with_the_peft_model_s_logits(cases):
    """`adapter_mode="keep"`: the adapted leaves are `port.nn.LoRA` nodes holding PEFT's factors, and the
    model gives the `PeftModel`'s logits."""
    from port.nn import LoRA

    base_dir, adapter_dir, expected, _ = cases("dora")
    model = port.load(base_dir, mesh=port.make_mesh("4x2"), adapter=adapter_dir, adapter_mode="keep")
    assert isinstance(model.blocks.attn.wq, LoRA) and model.blocks.attn.wq.magnitude is not None
    np.testing.assert_allclose(np.asarray(logits(model, INPUT_IDS)), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_kept_then_exported_the_adapter_is_byte_identical(cases, tmp_path):
    """`port convert --adapter-mode keep` then `port export --adapter-only` writes the adapter's
    safetensors file back byte for byte."""
    base_dir, adapter_dir, _, _ = cases("dora")
    out, exported = tmp_path / "out", tmp_path / "exported"
    result = run_port("convert", base_dir, "--adapter", adapter_dir, "--adapter-mode", "keep", "--out", out)
    assert result.returncode == 0, result.stderr
    assert "(kept, " in result.stderr + result.stdout
    result = run_port("export", out, "--adapter-only", "--out", exported)
    assert result.returncode == 0, result.stderr
    written = (exported / "adapter_model.safetensors").read_bytes()
    assert written == (adapter_dir / "adapter_model.safetensors").read_bytes()


def test_an_adapter_is_read_from_a_url(cases):
    """An adapter named by an `http://` URL is read in place by byte range: the same merged model,
    the adapter's bytes counted; a URL with no adapter there is one line."""
    from test_remote import start_server

    base_dir, adapter_dir, expected, _ = cases("embedding_and_saved_head")
    server = start_server(adapter_dir.parent)
    try:
        run = port.convert(base_dir, adapter=f"{server.base}/adapter")
        np.testing.assert_allclose(np.asarray(logits(run.model, INPUT_IDS)), expected, atol=2e-5, rtol=1e-5)
        assert run.report.adapter == f"{server.base}/adapter" and run.report.adapter_bytes_read > 0
        with pytest.raises(PortError, match="no adapter_config.json"):
            port.load(base_dir, adapter=f"{server.base}/base")
    finally:
        server.shutdown()


@pytest.mark.slow
def test_an_adapter_repo_id_resolves_through_the_hub_cache(tmp_path):
    """`--adapter someone/tiny-gpt2-lora` (a repo id) is read from the Hugging Face cache, offline; a
    repo id neither there nor a directory is one line."""
    example = REPO / "examples" / "tiny-gpt2-lora"
    entry = tmp_path / "hub" / "models--someone--tiny-gpt2-lora"
    shutil.copytree(example, entry / "snapshots" / ("0" * 40))
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text("0" * 40)
    out = tmp_path / "out"
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    result = run_port(
        "convert", REPO / "examples" / "tiny-gpt2", "--adapter", "someone/tiny-gpt2-lora", "--out", out, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "with adapter someone/tiny-gpt2-lora (merged" in result.stderr
    missing = run_port(
        "convert", REPO / "examples" / "tiny-gpt2", "--adapter", "someone/absent", "--out", tmp_path / "o", env=env
    )
    one_line(missing, "someone/absent: no such directory", out=tmp_path / "o")


def test_an_adapter_merges_onto_a_quantized_base(cases, tmp_path):
    """An FP8 base (dequantized as it is read, into bfloat16 blocks) takes an adapter as the plain
    base does: the model is the dequantized checkpoint's with the adapter merged."""
    import jax
    from test_quantized_fp8 import write_fp8

    base_dir, adapter_dir, _, _ = cases("bfloat16")
    fp8, dequantized = write_fp8(base_dir, tmp_path / "fp8")
    adapter_dir = _edited(adapter_dir, tmp_path, config={"base_model_name_or_path": None})  # names neither
    ours = port.load(fp8, adapter=adapter_dir, mesh=port.make_mesh("2x2"))
    theirs = port.load(dequantized, adapter=adapter_dir)
    assert ours.blocks.attn.wq.dtype == np.dtype("bfloat16")
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("shape", [(1, 1, 1), (5632, 16, 2048), (64, 256, 3000), (3, 40000, 2)])
def test_the_product_is_tiled_to_stay_on_the_calling_thread(shape, monkeypatch):
    """`_product` gives `b @ a`, each NumPy product in it below OpenBLAS's threading threshold (so
    port's reading threads do not each start BLAS threads)."""
    from port._adapters import _merged

    rows, rank, columns = shape
    rng = np.random.default_rng(0)
    b = rng.standard_normal((rows, rank), dtype=np.float32)
    a = rng.standard_normal((rank, columns), dtype=np.float32)
    sizes = []
    matmul = np.matmul

    def counted(x, y, out):
        sizes.append(x.shape[0] * x.shape[1] * y.shape[1])
        return matmul(x, y, out=out)

    monkeypatch.setattr(_merged.np, "matmul", counted)
    got = _merged._product(b, a)
    monkeypatch.undo()
    np.testing.assert_allclose(got, b @ a, rtol=1e-5, atol=1e-4)
    assert max(sizes) <= max(_merged.SMALL_PRODUCT, rank)


def test_a_block_of_the_product_is_the_whole_products_bit_for_bit():
    """The merged delta of any block (interior tiles, edge tiles, odd cuts) equals that block of the
    whole weight's delta exactly: BLAS rounds an element alike only within tiles of one shape."""
    from port._adapters._merged import _product

    rng = np.random.default_rng(0)
    b = rng.standard_normal((300, 8)).astype(np.float32)
    a = rng.standard_normal((8, 5000)).astype(np.float32)
    whole = _product(b, a)
    np.testing.assert_allclose(whole, b @ a, rtol=1e-5, atol=1e-5)
    for (r0, r1), (c0, c1) in [
        ((0, 150), (0, 2500)),
        ((150, 300), (2500, 5000)),
        ((7, 293), (1, 4999)),
        ((0, 300), (2048, 4096)),
    ]:
        np.testing.assert_array_equal(_product(b[r0:r1], a[:, c0:c1], r0, c0), whole[r0:r1, c0:c1])
