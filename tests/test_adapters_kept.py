"""Adapters kept as `port.nn.LoRA` leaves: their layout in each family's leaves, keep mode
against PEFT, `port.lora` and `port.export_adapter`.

Tiny random bases written with transformers, adapters with PEFT (`init_lora_weights=False`:
non-zero A and B), in tmp_path; nothing is downloaded.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import port
from port._adapters._layout import layout
from port._errors import PlanError
from port._transforms import Chain
from port.nn import LoRA

from helpers import run_port, transformers_or_skip

LINEAR = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "c_fc",
    "c_proj",
    "dense",
    "dense_h_to_4h",
    "dense_4h_to_h",
)
"""Module names of the projections PEFT users target (GPT-NeoX's `dense`, GPT-2's `c_fc`, `c_proj`)."""
FUSED = ("c_attn", "query_key_value", "qkv_proj", "gate_up_proj")


def _weights(name):
    """The family's tiny torch model's config (a dict) and its 2-d weights by key, as numpy."""
    import torch
    from test_decoders import FAMILIES

    transformers = transformers_or_skip()
    arch, config_class, config = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(getattr(transformers, config_class)(**config))
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items() if v.ndim == 2}
    return model.config.to_dict(), weights


def _full(chain, x):
    """`chain` applied to the whole of `x`."""
    return chain.apply(x, chain.regions(tuple((0, n) for n in chain.shape)))


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3", "phi3", "gemma2", "gpt_neox", "mixtral", "deepseek_v3"])
def test_every_unfused_projection_has_a_layout_whose_delta_is_peft_s(name):
    """For each linear-like entry of the family's mapping, a layout is found unless the entry
    cuts a fused tensor (refused in one line saying "load it merged"), and the LoRA built
    from PEFT's factors reshaped by it gives the leaf that the chain makes of `B @ A`."""
    from port._plan import config_names
    from port._skeleton import skeleton

    config, weights = _weights(name)
    mapping = port.mapping_for(config, keys=weights)
    names = config_names(skeleton(mapping, config), config)
    conv1d = name == "gpt2"
    found = refused = 0
    rng = np.random.default_rng(0)
    for key, w in weights.items():
        module = key.removesuffix(".weight")
        leaf_name = module.rsplit(".", 1)[-1]
        if not key.endswith(".weight") or leaf_name not in LINEAR + FUSED:
            continue
        param = next(p for p in mapping.params if p.pattern().match(mapping.key_name(key)))
        fused = any(t.name in ("split", "stride") for t in param.transforms)
        if fused:
            with pytest.raises(PlanError, match=f"^{module}: .*load it merged"):
                layout(param, names, w.shape, "conv1d" if conv1d else "linear", module)
            refused += 1
            continue
        lay = layout(param, names, w.shape, "conv1d" if conv1d else "linear", module)
        out_size, in_size = (w.shape[1], w.shape[0]) if conv1d else w.shape
        assert (lay.fan_out, lay.fan_in) == (out_size, in_size), key
        rank = 3
        a = rng.standard_normal((rank, in_size)).astype(np.float32)
        b = rng.standard_normal((out_size, rank)).astype(np.float32)
        delta = b @ a  # [out, in], torch Linear's layout
        source = delta.T if conv1d else delta

        chain = Chain.build(param.build(names), w.shape)
        expected = _full(chain, np.ascontiguousarray(source))
        node = LoRA(
            jnp.zeros(expected.shape),
            jnp.asarray(a.reshape(lay.a_shape(rank))),
            jnp.asarray(b.reshape(lay.b_shape(rank))),
            None,
            1.0,
            lay.inputs,
            lay.transposed,
        )
        np.testing.assert_allclose(np.asarray(node.delta()), expected, rtol=1e-5, atol=1e-5, err_msg=key)
        found += 1
    assert found >= 2 * int(config.get("num_hidden_layers", config.get("n_layer", 1)))
    assert refused == 0 or name in ("gpt2", "gpt_neox", "phi3")


PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(base, directory, **lora):
    """`base` (a torch model) with a random PEFT adapter (A and B non-zero), saved at `directory`; the PeftModel."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    settings = dict(r=4, lora_alpha=8, target_modules=PROJECTIONS, init_lora_weights=False) | lora
    model = get_peft_model(base, LoraConfig(**settings))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    """A tiny Llama base, saved; a random LoRA on every projection (rank 4, one layer's q_proj rank 4 too), saved."""
    from helpers import torch_llama

    root = tmp_path_factory.mktemp("llama-lora")
    base = torch_llama()
    base.save_pretrained(root / "base")
    peft_model = _peft(base, root / "adapter")
    return root / "base", root / "adapter", peft_model


def _kept_model(base_dir, adapter_dir, mesh="4x2"):
    """The base at `base_dir` with the adapter at `adapter_dir` kept, through the pipeline (no `adapter=` wiring)."""
    from port._adapters import open_adapter
    from port._adapters._kept import keep

    with port.open_checkpoint(base_dir) as base:
        adapter = open_adapter(adapter_dir, base)
        kept = keep(None, base.config, base, adapter)
        skeleton = kept.skeleton(port.skeleton(kept.mapping, base.config))
        try:
            return port.convert(kept.checkpoint, skeleton, kept.mapping, mesh=mesh).model, kept
        finally:
            adapter.checkpoint.close()


def test_kept_adapter_gives_peft_s_logits_and_its_factors_bit_for_bit_sharded_by_the_leaf_s_axes(llama_adapter):
    """Keep mode: the model's logits equal the PeftModel's (float32); each `a`, `b` is the adapter's
    lora_A, lora_B reshaped, bit for bit, sharded on 4x2 as the leaf's axes say; merging it
    gives the model the adapter merged into the base gives."""
    from safetensors.numpy import load_file

    from helpers import INPUT_IDS, logits, torch_logits

    base_dir, adapter_dir, peft_model = llama_adapter
    model = port.load(base_dir, adapter=adapter_dir, adapter_mode="keep", mesh="4x2")
    wq = model.blocks.attn.wq
    assert isinstance(wq, LoRA) and wq.scale == 2.0 and wq.inputs == 1 and not wq.transposed
    assert wq.a.shape == (2, 4, 64) and wq.b.shape == (2, 4, 16, 4)
    assert tuple(wq.base.sharding.spec) == (None, "model", None, "data")
    assert tuple(wq.a.sharding.spec) == (None, None, "data")  # layers, rank, embed
    assert tuple(wq.b.sharding.spec) == (None, "model", None, None)  # layers, heads, head_dim, rank
    assert tuple(model.blocks.mlp.down.a.sharding.spec) == (None, None, "model")  # down: in = mlp
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    for layer in range(2):
        stem = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        np.testing.assert_array_equal(np.asarray(wq.a[layer]), tensors[f"{stem}.lora_A.weight"])
        np.testing.assert_array_equal(np.asarray(wq.b[layer]), tensors[f"{stem}.lora_B.weight"].reshape(4, 16, 4))
    ours = np.asarray(logits(model, INPUT_IDS))
    np.testing.assert_allclose(ours, torch_logits(peft_model, INPUT_IDS), rtol=1e-4, atol=1e-4)
    merged = port.nn.merged(model)
    np.testing.assert_allclose(np.asarray(logits(merged, INPUT_IDS)), ours, rtol=1e-5, atol=1e-5)
    loaded = port.load(base_dir, adapter=adapter_dir, mesh="4x2")  # merged as read
    ours_merged, theirs = port._targets.leaves(merged), port._targets.leaves(loaded)
    assert ours_merged.keys() == theirs.keys()
    for path, leaf in theirs.items():
        assert leaf.sharding == ours_merged[path].sharding, path
        np.testing.assert_allclose(np.asarray(ours_merged[path]), np.asarray(leaf), rtol=1e-6, atol=1e-6, err_msg=path)


def test_the_extended_mapping_s_text_parses_back_to_it(llama_adapter):
    """The kept mapping is a real mapping: its text parses to the same entries and rules."""
    _, kept = _kept_model(*llama_adapter[:2], mesh="1x1")
    again = port.parse_mapping(kept.mapping.text, "again")
    assert again.params == kept.mapping.params and again.rules == kept.mapping.rules
    assert kept.mapping.rules["rank"] == ()
    assert {p.path for p in again.params} >= {"blocks.attn.wq.base", "blocks.attn.wq.a", "blocks.attn.wq.b"}


@pytest.mark.parametrize(
    "lora",
    [
        dict(use_dora=True, target_modules=["q_proj", "down_proj"]),
        dict(use_rslora=True, target_modules=["v_proj", "up_proj"], rank_pattern={"v_proj": 2}),
    ],
    ids=["dora", "rslora-rank-pattern"],
)
def test_dora_and_rslora_with_a_rank_pattern_are_kept_with_peft_s_logits(tmp_path, lora):
    """DoRA's magnitude is kept (`[layers, *out]`), rsLoRA's scale and a per-module rank too."""
    from helpers import INPUT_IDS, logits, torch_llama, torch_logits

    base = torch_llama()
    base.save_pretrained(tmp_path / "base")
    peft_model = _peft(base, tmp_path / "adapter", **lora)
    model, _ = _kept_model(tmp_path / "base", tmp_path / "adapter")
    if lora.get("use_dora"):
        assert model.blocks.attn.wq.magnitude.shape == (2, 4, 16)
    else:
        assert model.blocks.attn.wv.rank == 2 and model.blocks.attn.wv.scale == 8 / 2**0.5
    ours = np.asarray(logits(model, INPUT_IDS))
    np.testing.assert_allclose(ours, torch_logits(peft_model, INPUT_IDS), rtol=1e-4, atol=1e-4)


def test_gpt2_s_conv1d_projections_are_kept_transposed_with_peft_s_logits(tmp_path):
    """GPT-2's `Conv1D` weights (`[in, out]`, fan_in_fan_out): the leaf is inputs first (`transposed`)."""
    from helpers import INPUT_IDS, logits, torch_gpt2, torch_logits

    base = torch_gpt2()
    base.save_pretrained(tmp_path / "base")
    peft_model = _peft(base, tmp_path / "adapter", target_modules=["c_fc", "c_proj"], fan_in_fan_out=True)
    model, _ = _kept_model(tmp_path / "base", tmp_path / "adapter")
    assert model.blocks.mlp.w_fc.transposed and model.blocks.mlp.w_fc.a.shape == (2, 4, 64)
    ours = np.asarray(logits(model, INPUT_IDS))
    np.testing.assert_allclose(ours, torch_logits(peft_model, INPUT_IDS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (dict(target_modules=["embed_tokens"]), "^model.embed_tokens: 'embed' is the model's own leaf.*load it merged"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save replaces .*lm_head.* load it merged"),
        (dict(layers_to_transform=[1]), "adapts 1 of the 2 weights 'blocks.attn.wq'.*load it merged"),
        (dict(alpha_pattern={"layers.1.self_attn.q_proj": 3}), r"scale 0.75 differ.*'blocks.attn.wq'.*load it merged"),
    ],
    ids=["embedding", "modules-to-save", "some-layers", "alpha-pattern-within-a-stack"],
)
def test_what_keep_mode_cannot_hold_is_refused_in_one_line(tmp_path, lora, message):
    """An embedding target, modules_to_save, a stack adapted in some layers only or with two
    scales: one line naming the module, saying to load it merged."""
    from port._adapters import open_adapter
    from port._adapters._kept import keep

    from helpers import torch_llama

    base = torch_llama()
    base.save_pretrained(tmp_path / "base")
    _peft(base, tmp_path / "adapter", **({"target_modules": ["q_proj"]} | lora))
    with port.open_checkpoint(tmp_path / "base") as ckpt:
        adapter = open_adapter(tmp_path / "adapter", ckpt)
        with pytest.raises(port.PlanError, match=message) as raised:
            keep(None, ckpt.config, ckpt, adapter)
        adapter.checkpoint.close()
    assert "\n" not in str(raised.value)


def test_a_fused_gpt2_c_attn_is_refused_in_keep_mode(tmp_path):
    """GPT-2's `c_attn` is cut into wq, wk, wv: one shared `a` cannot be kept; load it merged."""
    from port._adapters import open_adapter
    from port._adapters._kept import keep

    from helpers import torch_gpt2

    base = torch_gpt2()
    base.save_pretrained(tmp_path / "base")
    _peft(base, tmp_path / "adapter", target_modules=["c_attn"], fan_in_fan_out=True)
    with port.open_checkpoint(tmp_path / "base") as ckpt:
        adapter = open_adapter(tmp_path / "adapter", ckpt)
        with pytest.raises(port.PlanError, match=r"^transformer.h.0.attn.c_attn: .*splits its tensor.*load it merged"):
            keep(None, ckpt.config, ckpt, adapter)
        adapter.checkpoint.close()


def test_a_kept_adapter_exported_again_is_the_same_files_byte_for_byte(llama_adapter, tmp_path):
    """Round trip: PEFT's adapter loaded kept, then `export_adapter`, gives PEFT's safetensors file
    and adapter_config.json back, byte for byte."""
    base_dir, adapter_dir, _ = llama_adapter
    model, kept = _kept_model(base_dir, adapter_dir)
    out = port.export_adapter(model, tmp_path / "again", base_dir, adapter_config=kept.adapter_config)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / name).read_bytes() == (adapter_dir / name).read_bytes(), name


def _meets_vllm_s_rules(directory):
    """What vLLM's adapter loader asks of a PEFT adapter, as its source states it (vllm/lora/peft_helper.py:
    `r`, `lora_alpha` and `target_modules` given, no `modules_to_save`, no DoRA, `bias` "none"; and its
    tensor names, `base_model.model.<module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r]).
    vLLM itself needs CUDA, which this suite does not have."""
    import re

    from safetensors import safe_open

    config = json.loads((directory / "adapter_config.json").read_text())
    assert {"r", "lora_alpha", "target_modules"} <= set(config) and config["target_modules"]
    assert not config.get("modules_to_save") and not config.get("use_dora") and config.get("bias", "none") == "none"
    with safe_open(directory / "adapter_model.safetensors", "np") as f:
        keys = list(f.keys())
        assert keys
        for key in keys:
            match = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
            assert match, key
            shape = f.get_slice(key).get_shape()
            assert len(shape) == 2 and shape[0 if match.group(2) == "A" else 1] == config["r"], (key, shape)


def test_port_lora_attaches_fresh_sharded_adapters_that_peft_loads_back_with_port_s_logits(llama_adapter, tmp_path):
    """`port.lora` puts a LoRA on each leaf PEFT's target names pick (every layer's q_proj and
    v_proj), the model unchanged until trained, the factors sharded as the leaf's axes say and the
    only trainable leaves; once changed, `export_adapter` writes what `PeftModel.from_pretrained`
    loads with the same logits; `port.export` of the model writes it merged, with those logits too."""
    import equinox as eqx
    import jax
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import INPUT_IDS, logits, torch_logits

    base_dir = llama_adapter[0]
    base = port.load(base_dir, mesh="4x2")
    model = port.lora(base, base_dir, rank=4, alpha=8, targets=["q_proj", "v_proj"], key=jax.random.key(0))
    adapted = [p for p in ("wq", "wk", "wv", "wo") if isinstance(getattr(model.blocks.attn, p), LoRA)]
    assert adapted == ["wq", "wv"] and not isinstance(model.blocks.mlp.up, LoRA)
    wq = model.blocks.attn.wq
    assert wq.a.shape == (2, 4, 64) and wq.scale == 2.0 and not np.asarray(wq.b).any()
    assert tuple(wq.a.sharding.spec) == (None, None, "data") and tuple(wq.b.sharding.spec) == (
        None,
        "model",
        None,
        None,
    )
    before = np.asarray(logits(base, INPUT_IDS))
    np.testing.assert_array_equal(np.asarray(logits(model, INPUT_IDS)), before)
    params, _ = eqx.partition(model, port.nn.trainable(model))
    assert len(jax.tree.leaves(params)) == 4  # a and b of wq and wv
    rng = np.random.default_rng(3)
    model = eqx.tree_at(
        lambda m: (m.blocks.attn.wq.b, m.blocks.attn.wv.b),
        model,
        (rng.standard_normal(wq.b.shape, np.float32), rng.standard_normal(model.blocks.attn.wv.b.shape, np.float32)),
    )
    ours = np.asarray(logits(model, INPUT_IDS))
    assert np.abs(ours - before).max() > 1e-2
    out = port.export_adapter(model, tmp_path / "mine", base_dir)
    _meets_vllm_s_rules(out)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out)
    np.testing.assert_allclose(torch_logits(peft_model, INPUT_IDS), ours, rtol=1e-4, atol=1e-4)
    port.export(model, tmp_path / "merged", base_dir)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(torch_logits(merged, INPUT_IDS), ours, rtol=1e-4, atol=1e-4)


def test_export_adapter_refuses_a_model_without_adapters_and_replaces_only_its_own_output(llama_adapter, tmp_path):
    """No adapter: one line. `out` holding something else: refused even with force, nothing
    written; an earlier adapter export: refused without force, replaced with it."""
    base_dir, adapter_dir, _ = llama_adapter
    base = port.load(base_dir)
    with pytest.raises(port.PortError, match="holds no adapter"):
        port.export_adapter(base, tmp_path / "none", base_dir)
    assert not (tmp_path / "none").exists()
    model, kept = _kept_model(base_dir, adapter_dir, mesh="1x1")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(port.OutputError):
        port.export_adapter(model, other, base_dir, force=True)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    out = port.export_adapter(model, tmp_path / "adapter", base_dir)
    with pytest.raises(port.OutputError):
        port.export_adapter(model, out, base_dir)
    again = port.export_adapter(model, out, base_dir, force=True, adapter_config=kept.adapter_config)
    assert (again / "adapter_config.json").read_bytes() == (adapter_dir / "adapter_config.json").read_bytes()


def test_a_kept_output_restores_with_its_adapter_and_exports_it_or_the_merged_model(llama_adapter, tmp_path):
    """An output written with the adapter kept records it: `port.restore` (onto another mesh) gives
    the LoRA nodes back; `export_adapter` from the output alone writes PEFT's files byte for byte;
    `port.export` from it writes the merged model, which transformers loads with PEFT's logits."""
    from transformers import AutoModelForCausalLM

    from port._adapters import open_adapter
    from port._adapters._kept import keep

    from helpers import INPUT_IDS, torch_logits

    base_dir, adapter_dir, peft_model = llama_adapter
    with port.open_checkpoint(base_dir) as base:
        adapter = open_adapter(adapter_dir, base)
        kept = keep(None, base.config, base, adapter)
        skeleton = kept.skeleton(port.skeleton(kept.mapping, base.config))
        port.convert(kept.checkpoint, skeleton, kept.mapping, mesh="4x2", out=tmp_path / "out")
        adapter.checkpoint.close()
    model = port.restore(tmp_path / "out", mesh="2x4")
    assert isinstance(model.blocks.mlp.down, LoRA) and tuple(model.blocks.mlp.down.a.sharding.spec) == (
        None,
        None,
        "model",
    )
    again = port.export_adapter(model, tmp_path / "again", tmp_path / "out")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (again / name).read_bytes() == (adapter_dir / name).read_bytes(), name
    port.export(model, tmp_path / "merged", tmp_path / "out")
    assert "port_adapter" not in (tmp_path / "merged" / "config.json").read_text()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(
        torch_logits(merged, INPUT_IDS), torch_logits(peft_model, INPUT_IDS), rtol=1e-4, atol=1e-4
    )
    # The command's bytes_read is what its restore read: the base and the factors A and B, not the
    # merged weights export wrote from.
    result = run_port("export", tmp_path / "out", "--out", tmp_path / "cli", "--json")
    assert result.returncode == 0, result.stderr
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(port.restore(tmp_path / "out", mesh="1x1")))
    assert json.loads(result.stdout)["bytes_read"] == held > json.loads(result.stdout)["bytes_written"]


@pytest.fixture(scope="module")
def gpt2_base(tmp_path_factory):
    """A tiny GPT-2 checkpoint and port's model of it."""
    from helpers import torch_gpt2

    directory = tmp_path_factory.mktemp("gpt2-base")
    torch_gpt2().save_pretrained(directory)
    return directory, port.load(directory)


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["nothing_here"], r"^targets=\['nothing_here'\]: no module of .* matches them"),
        (["wte"], r"^transformer.wte: 'wte' is not a stacked layer weight"),
        (["c_attn"], r"^transformer.h.0.attn.c_attn: mapping entry .* splits its tensor"),
        (["h.0.mlp.c_fc"], r"^transformer.h.0.mlp.c_fc: the targets pick it but not 'transformer.h.1.mlp.c_fc'"),
        ("c_fc", r"^targets='c_fc': expected a list of module names"),
    ],
    ids=["no-match", "embedding", "fused", "one-layer", "a-string"],
)
def test_port_lora_refuses_targets_it_cannot_adapt_in_one_line(gpt2_base, targets, message):
    """A target naming nothing, the embedding, a fused tensor, one layer of a stack, or a string
    where a list is expected: one line, the model untouched."""
    import jax

    directory, model = gpt2_base
    with pytest.raises(port.PortError, match=message) as raised:
        port.lora(model, directory, rank=2, alpha=4, targets=targets, key=jax.random.key(0), fan_in_fan_out=True)
    assert "\n" not in str(raised.value)


def test_port_lora_on_gpt2_s_conv1d_weights_exports_what_peft_loads(gpt2_base, tmp_path):
    """`fan_in_fan_out`: GPT-2's `[in, out]` weights take `transposed` adapters; once changed,
    `PeftModel.from_pretrained` of the export gives port's logits."""
    import equinox as eqx
    import jax
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import INPUT_IDS, logits, torch_logits

    directory, base = gpt2_base
    model = port.lora(
        base, directory, rank=2, alpha=4, targets=["c_fc", "c_proj"], key=jax.random.key(1), fan_in_fan_out=True
    )
    assert model.blocks.mlp.w_fc.transposed and model.blocks.attn.wo.a.shape == (
        2,
        2,
        4,
        16,
    )  # wo: in = heads x head_dim
    rng = np.random.default_rng(0)
    bs = [model.blocks.mlp.w_fc.b, model.blocks.mlp.w_proj.b, model.blocks.attn.wo.b]
    model = eqx.tree_at(
        lambda m: (m.blocks.mlp.w_fc.b, m.blocks.mlp.w_proj.b, m.blocks.attn.wo.b),
        model,
        tuple(rng.standard_normal(b.shape, np.float32) for b in bs),
    )
    out = port.export_adapter(model, tmp_path / "gpt2-lora", directory)
    assert json.loads((out / "adapter_config.json").read_text())["fan_in_fan_out"] is True  # as PEFT writes it
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), out)
    ours = np.asarray(logits(model, INPUT_IDS))
    np.testing.assert_allclose(torch_logits(peft_model, INPUT_IDS), ours, rtol=1e-4, atol=1e-4)


def test_an_output_s_malformed_adapter_record_is_refused_in_one_line(tmp_path):
    """An output is untrusted: a `port_adapter` record that is not the tables port writes, or
    names an adapter at a leaf the output does not hold, is one `OutputError` line."""
    import jax

    from port._adapters._kept import restored_skeleton
    from port._errors import OutputError

    skeleton = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    factors = {"w.a": jax.ShapeDtypeStruct((4, 3), jnp.float32), "w.b": jax.ShapeDtypeStruct((2, 4), jnp.float32)}
    for record, message in [
        ([], "must hold 'adapter_config' and 'nodes'"),
        ({"adapter_config": {}, "nodes": {"w": {"scale": "2", "inputs": 1, "transposed": False}}}, "must be {scale"),
        ({"adapter_config": {}, "nodes": {"v": {"scale": 2.0, "inputs": 1, "transposed": False}}}, "does not hold"),
        (
            {"adapter_config": {}, "nodes": {"w": {"scale": 2.0, "inputs": 1, "transposed": True}}},
            "do not fit the leaf",
        ),
    ]:
        with pytest.raises(OutputError, match=f"^out/port/metadata: config: 'port_adapter'.*{message}"):
            restored_skeleton(skeleton, {"port_adapter": record}, factors, "out/port/metadata")
    fine = {"adapter_config": {}, "nodes": {"w": {"scale": 2.0, "inputs": 1, "transposed": False}}}
    assert isinstance(restored_skeleton(skeleton, {"port_adapter": fine}, factors, "out")["w"], LoRA)
