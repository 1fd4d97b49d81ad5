"""`scaffold`: a draft mapping from checkpoint headers and a module skeleton."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import port
from port._transforms import Reshape, Transpose
from port.authoring import scaffold

from helpers import confirm_checks, torch_gpt2, transformers_or_skip, write_checkpoint

V, E, H, D, F, L, T = 11, 12, 3, 4, 20, 2, 8
CONFIG = {
    "model_type": "tinynet",
    "vocab_size": V,
    "hidden_size": E,
    "num_attention_heads": H,
    "intermediate_size": F,
    "num_hidden_layers": L,
    "tie_word_embeddings": False,
}


class Attention(eqx.Module):
    wq: jax.Array  # [heads, head_dim, embed]: torch q_proj [H*D, E] split on its out axis
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array  # [embed, heads, head_dim]: torch o_proj [E, H*D] split on its in axis
    bo: jax.Array

    def __init__(self, key):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = jax.random.normal(kq, (H, D, E))
        self.wk = jax.random.normal(kk, (H, D, E))
        self.wv = jax.random.normal(kv, (H, D, E))
        self.wo = jax.random.normal(ko, (E, H, D))
        self.bo = jnp.zeros(E)


class MLP(eqx.Module):
    up: eqx.nn.Linear  # weight [F, E], as torch
    down: eqx.nn.Linear

    def __init__(self, key):
        ku, kd = jax.random.split(key)
        self.up = eqx.nn.Linear(E, F, key=ku)
        self.down = eqx.nn.Linear(F, E, key=kd)


class Block(eqx.Module):
    ln_attn: eqx.nn.LayerNorm
    attn: Attention
    ln_mlp: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, key):
        ka, km = jax.random.split(key)
        self.ln_attn = eqx.nn.LayerNorm(E)
        self.attn = Attention(ka)
        self.ln_mlp = eqx.nn.LayerNorm(E)
        self.mlp = MLP(km)


class TinyNet(eqx.Module):
    embed: jax.Array  # [vocab, embed]
    layers: Block  # every leaf stacked: [L, ...]
    final_norm: eqx.nn.LayerNorm
    unembed: jax.Array  # [embed, vocab]: logits = x @ unembed, torch lm_head transposed

    def __init__(self, config, key):
        ke, kl, ku = jax.random.split(key, 3)
        self.embed = jax.random.normal(ke, (config["vocab_size"], config["hidden_size"]))
        self.layers = eqx.filter_vmap(Block)(jax.random.split(kl, config["num_hidden_layers"]))
        self.final_norm = eqx.nn.LayerNorm(config["hidden_size"])
        self.unembed = jax.random.normal(ku, (config["hidden_size"], config["vocab_size"]))

    @classmethod
    def from_config(cls, config, *, key):
        return cls(config, key)


def tinynet_tensors():
    """A torch-layout state dict under `net.`, with a causal-mask buffer per layer."""
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    tensors = {
        "net.embed_tokens.weight": f32(V, E),
        "net.norm.weight": f32(E),
        "net.norm.bias": f32(E),
        "net.lm_head.weight": f32(V, E),
    }
    for i in range(L):
        p = f"net.layers.{i}."
        tensors.update(
            {
                p + "attention_norm.weight": f32(E),
                p + "attention_norm.bias": f32(E),
                p + "attn.q_proj.weight": f32(E, E),
                p + "attn.k_proj.weight": f32(E, E),
                p + "attn.v_proj.weight": f32(E, E),
                p + "attn.o_proj.weight": f32(E, E),
                p + "attn.o_proj.bias": f32(E),
                p + "attn.bias": np.tril(np.ones((1, 1, T, T), bool)),
                p + "ffn_norm.weight": f32(E),
                p + "ffn_norm.bias": f32(E),
                p + "mlp.fc1.weight": f32(F, E),
                p + "mlp.fc1.bias": f32(F),
                p + "mlp.fc2.weight": f32(E, F),
                p + "mlp.fc2.bias": f32(E),
            }
        )
    return tensors


def entries(mapping):
    return {p.path: p for p in mapping.params}


def test_scaffold_of_a_users_module_converts_unedited(tmp_path):
    tensors = tinynet_tensors()
    ckpt_dir = write_checkpoint(tmp_path / "ckpt", tensors, CONFIG)
    skeleton = eqx.filter_eval_shape(TinyNet.from_config, CONFIG, key=jax.random.key(0))
    with port.open_checkpoint(ckpt_dir) as ckpt:
        text = scaffold(ckpt, skeleton, "test_scaffold:TinyNet")
        assert scaffold(ckpt, skeleton, "test_scaffold:TinyNet") == text  # deterministic
        mapping = port.parse_mapping(text, "draft.toml")
        recipe = port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, {"data": 2, "model": 2})

    assert "17 entries paired, 0 source keys unpaired (0 patterns), 0 leaves unfilled" in text
    assert "# TODO" not in text
    assert mapping.model == "test_scaffold:TinyNet" and mapping.model_types == ("tinynet",)
    assert mapping.prefixes == ("net.",)
    assert mapping.ignore == ("layers.*.attn.bias",)
    assert len(recipe.ignored) == L
    by_path = entries(mapping)
    assert {p.key for p in mapping.params if p.stacked} == {
        f"layers.{{layer}}.{k}"
        for k in (
            "attention_norm.weight",
            "attention_norm.bias",
            "attn.q_proj.weight",
            "attn.k_proj.weight",
            "attn.v_proj.weight",
            "attn.o_proj.weight",
            "attn.o_proj.bias",
            "ffn_norm.weight",
            "ffn_norm.bias",
            "mlp.fc1.weight",
            "mlp.fc1.bias",
            "mlp.fc2.weight",
            "mlp.fc2.bias",
        )
    }
    assert by_path["layers.ln_attn.weight"].key == "layers.{layer}.attention_norm.weight"
    assert by_path["layers.ln_mlp.bias"].key == "layers.{layer}.ffn_norm.bias"
    assert by_path["layers.attn.wq"].transforms == (Reshape(("num_attention_heads", -1, "hidden_size")),)
    assert by_path["layers.attn.wo"].transforms == (Reshape(("hidden_size", "num_attention_heads", -1)),)
    assert by_path["layers.attn.wq"].axes == ("layers", "heads", "head_dim", "embed")
    assert by_path["unembed"].key == "lm_head.weight"
    assert by_path["unembed"].transforms == (Transpose((1, 0)),)
    assert by_path["unembed"].axes == ("embed", "vocab")
    assert by_path["embed"].transforms == () and by_path["embed"].key == "embed_tokens.weight"
    assert by_path["layers.mlp.up.weight"].transforms == ()
    assert by_path["layers.mlp.up.weight"].axes == ("layers", "mlp", "embed")
    assert by_path["final_norm.bias"].key == "norm.bias"
    assert mapping.rules == {
        "embed": ("data",),
        "head_dim": (),
        "heads": ("model",),
        "layers": (),
        "mlp": ("model",),
        "vocab": ("model",),
    }

    model = port.convert(ckpt_dir, skeleton, mapping, port.make_mesh("2x2")).model
    stack = lambda name, f=lambda x: x: np.stack([f(tensors[f"net.layers.{i}.{name}"]) for i in range(L)])  # noqa: E731
    expected = {
        "embed": tensors["net.embed_tokens.weight"],
        "unembed": tensors["net.lm_head.weight"].T,
        "final_norm.weight": tensors["net.norm.weight"],
        "final_norm.bias": tensors["net.norm.bias"],
        "layers.ln_attn.weight": stack("attention_norm.weight"),
        "layers.ln_attn.bias": stack("attention_norm.bias"),
        "layers.ln_mlp.weight": stack("ffn_norm.weight"),
        "layers.ln_mlp.bias": stack("ffn_norm.bias"),
        "layers.attn.wq": stack("attn.q_proj.weight", lambda x: x.reshape(H, D, E)),
        "layers.attn.wk": stack("attn.k_proj.weight", lambda x: x.reshape(H, D, E)),
        "layers.attn.wv": stack("attn.v_proj.weight", lambda x: x.reshape(H, D, E)),
        "layers.attn.wo": stack("attn.o_proj.weight", lambda x: x.reshape(E, H, D)),
        "layers.attn.bo": stack("attn.o_proj.bias"),
        "layers.mlp.up.weight": stack("mlp.fc1.weight"),
        "layers.mlp.up.bias": stack("mlp.fc1.bias"),
        "layers.mlp.down.weight": stack("mlp.fc2.weight"),
        "layers.mlp.down.bias": stack("mlp.fc2.bias"),
    }
    got = port._skeleton.leaves(model)
    assert set(got) == set(expected)
    for path, value in expected.items():
        np.testing.assert_array_equal(np.asarray(got[path]), value, err_msg=path)


@pytest.fixture(scope="module")
def gpt2_draft(tmp_path_factory):
    from port.models.gpt2 import GPT2

    directory = tmp_path_factory.mktemp("gpt2") / "lm"
    torch_gpt2().save_pretrained(directory)
    ckpt = port.open_checkpoint(directory)
    skeleton = eqx.filter_eval_shape(GPT2.from_config, ckpt.config, key=jax.random.key(0))
    return ckpt, skeleton, scaffold(ckpt, skeleton, "port.models.gpt2:GPT2")


def test_scaffold_of_gpt2_pairs_all_but_the_fused_attention(gpt2_draft):
    ckpt, skeleton, text = gpt2_draft
    mapping = port.parse_mapping(text, "draft.toml")
    assert mapping.prefixes == ("transformer.",)
    assert mapping.model_types == ("gpt2",)
    # Issue 24 row 5: the reference comes from config.json's architectures, as the shipped mapping's.
    assert mapping.reference == port.mapping_for({"model_type": "gpt2"}).reference
    shipped = entries(port.mapping_for({"model_type": "gpt2"}))
    by_path = entries(mapping)
    for path in [
        "wte",
        "wpe",
        "ln_f.weight",
        "ln_f.bias",
        "blocks.ln_1.weight",
        "blocks.ln_1.bias",
        "blocks.ln_2.weight",
        "blocks.ln_2.bias",
        "blocks.mlp.w_fc",
        "blocks.mlp.b_fc",
        "blocks.mlp.w_proj",
        "blocks.mlp.b_proj",
        "blocks.attn.wo",
        "blocks.attn.bo",
    ]:
        assert by_path[path].key == shipped[path].key, path
        assert by_path[path].transforms == shipped[path].transforms, path
        assert by_path[path].axes == shipped[path].axes, path
    # GPT-2's Conv1D (in, out) orientation is port's too: reshapes only, no transposes.
    assert by_path["blocks.attn.wo"].transforms == (Reshape(("n_head", -1, "n_embd")),)
    assert by_path["blocks.mlp.w_fc"].transforms == ()
    assert set(by_path) == set(shipped) - {f"blocks.attn.{x}" for x in ("wq", "wk", "wv", "bq", "bk", "bv")}
    assert "14 entries paired, 4 source keys unpaired (2 patterns), 6 leaves unfilled" in text

    unpaired = text.split("# TODO unpaired source keys")[1].split("# TODO unfilled leaves")[0]
    assert "#   h.{layer}.attn.c_attn.weight  2 layers of [64, 192] float32" in unpaired
    assert "#   h.{layer}.attn.c_attn.bias  2 layers of [192] float32" in unpaired
    assert "fused? [64, 192] on axis 1 is 3 x [64, 64]: try { split = { axis = 1, parts = 3, index = 0 } }" in unpaired
    assert "fused? [192] on axis 0 is 3 x [64]: try { split = { axis = 0, parts = 3, index = 0 } }" in unpaired
    unfilled = text.split("# TODO unfilled leaves")[1]
    for name in ("wq", "wk", "wv"):
        assert f"#   blocks.attn.{name}  [2, 64, 4, 16] float32" in unfilled
    for name in ("bq", "bk", "bv"):
        assert f"#   blocks.attn.{name}  [2, 4, 16] float32" in unfilled


def test_gpt2_draft_with_its_fused_suggestions_uncommented_is_the_shipped_mapping(gpt2_draft):
    ckpt, skeleton, text = gpt2_draft
    uncommented = re.sub(r"^# (\[\[params\]\]|key = |path = |transforms = |axes = )", r"\1", text, flags=re.M)
    mapping = port.parse_mapping(uncommented, "draft.toml")
    shipped = port.mapping_for({"model_type": "gpt2"})
    assert entries(mapping) == entries(shipped)
    assert {a: r for a, r in mapping.rules.items()} == shipped.rules
    port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, {"data": 2, "model": 2})


def test_scaffold_suggests_a_tie_and_flags_unknown_axes(tmp_path):
    class Small(eqx.Module):
        embed: jax.Array
        gain: jax.Array

        def __init__(self, config):
            self.embed = jnp.zeros((config["vocab_size"], config["d_model"]))
            self.gain = jnp.zeros(7)

        @classmethod
        def from_config(cls, config, *, key):
            return cls(config)

    config = {"model_type": "small", "vocab_size": 10, "d_model": 6}
    tensors = {
        "model.embed_tokens.weight": np.ones((10, 6), np.float32),
        "model.gain": np.ones(7, np.float32),
        "model.rotary_emb.inv_freq": np.ones(3, np.float32),
        "lm_head.weight": np.ones((10, 6), np.float32),
    }
    ckpt_dir = write_checkpoint(tmp_path / "ckpt", tensors, config)
    skeleton = eqx.filter_eval_shape(Small.from_config, config, key=jax.random.key(0))
    with port.open_checkpoint(ckpt_dir) as ckpt:
        text = scaffold(ckpt, skeleton, "x:Small")
        mapping = port.parse_mapping(text)
        recipe = port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, {"data": 2, "model": 1})
    assert mapping.prefixes == ("model.",)
    assert mapping.tied == {"lm_head.weight": "embed_tokens.weight"}
    assert mapping.ignore == ("rotary_emb.inv_freq",)
    assert entries(mapping)["gain"].axes == ("dim7",)
    assert "# TODO: name this axis: dim7" in text
    assert mapping.rules["dim7"] == ()
    assert recipe.tied == (("lm_head.weight", "embed_tokens.weight"),)
    # Each top-level key drafted says what it was inferred from; a tie config.json does not state is a CHECK.
    assert 'prefixes = ["model."]   # key layout: 3 of 4 keys begin with it, no path of the model does' in text
    assert '    "rotary_emb.inv_freq",   # a known buffer, not a parameter' in text
    assert 'tied = { "lm_head.weight" = "embed_tokens.weight" }   # CHECK: the same shape as a paired key' in text
    for said, line in [
        (True, "# config.json's tie_word_embeddings = true: a copy of a paired key, never read"),
        (False, "# CHECK: config.json says tie_word_embeddings = false, but the model has no leaf for it"),
    ]:
        tied = write_checkpoint(tmp_path / f"tied-{said}", tensors, config | {"tie_word_embeddings": said})
        drafted = scaffold(tied, skeleton, "x:Small")
        assert line in drafted and drafted.count("# CHECK") == (0 if said else 1), drafted


def test_unused_keys_are_grouped_by_the_widest_subtree_nothing_else_is_under():
    from port.authoring._keys import unused_patterns

    names = [
        "decoder.block.0.q.weight",
        "decoder.block.1.q.weight",
        "decoder.norm.weight",
        "encoder.block.0.q.weight",
        "encoder.block.0.bias.weight",  # only the first layer has it
        "encoder.block.1.q.weight",
        "head.weight",
        "head.extra.weight",
        "layers.0.attn.bias",  # a buffer: may be covered or not
    ]
    unused = {"decoder.block.0.q.weight", "decoder.block.1.q.weight", "decoder.norm.weight"}
    unused |= {"encoder.block.0.bias.weight", "head.extra.weight"}
    found = unused_patterns({n: "m." + n for n in names}, {"m." + n for n in unused}, {"m.layers.0.attn.bias"})
    assert found == {
        "decoder.*": (3, "decoder."),  # every key under it unused, of more than one pattern
        "encoder.block.*.bias.weight": (1, ""),  # encoder.block.* holds used keys
        "head.extra.weight": (1, ""),  # head.* holds a used key
    }
    # A subtree of one pattern is written as that pattern, which says more.
    assert unused_patterns({"a.0.b": "a.0.b", "a.1.b": "a.1.b", "c": "c"}, {"a.0.b", "a.1.b"}) == {"a.*.b": (2, "")}


def test_scaffold_refuses_a_model_that_fits_nothing(tmp_path):
    ckpt_dir = write_checkpoint(tmp_path / "ckpt", {"a": np.ones(3, np.float32)}, {"model_type": "x"})
    skeleton = eqx.filter_eval_shape(TinyNet.from_config, CONFIG, key=jax.random.key(0))
    with port.open_checkpoint(ckpt_dir) as ckpt, pytest.raises(port.PortError, match="fits any leaf"):
        scaffold(ckpt, skeleton, "test_scaffold:TinyNet")


def test_scaffold_opens_the_checkpoint_and_builds_the_skeleton_itself(tmp_path):
    ckpt_dir = write_checkpoint(tmp_path / "ckpt", tinynet_tensors(), CONFIG)
    skeleton = eqx.filter_eval_shape(TinyNet.from_config, CONFIG, key=jax.random.key(0))
    with port.open_checkpoint(ckpt_dir) as ckpt:
        text = scaffold(ckpt, skeleton, "test_scaffold:TinyNet")
        assert ckpt.bytes_read == 0
    assert scaffold(ckpt_dir, TinyNet, "test_scaffold:TinyNet") == text  # a path, and the class
    assert scaffold(str(ckpt_dir), None, "test_scaffold:TinyNet") == text  # the class `model` names
    with pytest.raises(port.PortError, match="expected 'package.module:Class'"):
        scaffold(ckpt_dir, TinyNet, "TinyNet")


def test_scaffold_escapes_checkpoint_names_in_its_comments(tmp_path):
    class One(eqx.Module):
        embed: jax.Array

        def __init__(self):
            self.embed = jnp.zeros((10, 6))

        @classmethod
        def from_config(cls, config, *, key):
            return cls()

    tensors = {"embed.weight": np.ones((10, 6), np.float32), "extra\u202e\x85.weight": np.ones(5, np.float32)}
    text = scaffold(write_checkpoint(tmp_path / "ckpt", tensors, {"model_type": "one"}), One, "x:One")
    # no leaf is left for it: ignored, its name escaped (a terminal shows it, acts on nothing)
    assert '    "extra\\u202e\\u0085.weight",   # not paired with any leaf: 1 key; no unfilled leaf fits' in text
    assert all(line.isprintable() for line in text.split("\n"))
    mapping = port.parse_mapping(text)
    assert mapping.params[0].key == "embed.weight" and mapping.ignore == ("extra\u202e\x85.weight",)


class T5Block(eqx.Module):
    attn_norm: jax.Array  # [embed]
    wq: jax.Array  # [heads, head_dim, embed]
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array  # [embed, heads, head_dim]
    mlp_norm: jax.Array
    wi: jax.Array  # [mlp, embed]
    wf: jax.Array  # [embed, mlp]

    def __init__(self, config):
        e, h, d, f = config["d_model"], config["num_heads"], config["d_kv"], config["d_ff"]
        self.attn_norm = self.mlp_norm = jnp.ones(e)
        self.wq = self.wk = self.wv = jnp.zeros((h, d, e))
        self.wo = jnp.zeros((e, h, d))
        self.wi, self.wf = jnp.zeros((f, e)), jnp.zeros((e, f))


class T5Encoder(eqx.Module):
    """The encoder half of T5, the model a reader brings for a full T5 checkpoint."""

    embed: jax.Array
    relative_bias: jax.Array | None  # [buckets, heads]
    blocks: T5Block
    final_norm: jax.Array

    def __init__(self, config, bias=True):
        self.embed = jnp.zeros((config["vocab_size"], config["d_model"]))
        buckets = (config["relative_attention_num_buckets"], config["num_heads"])
        self.relative_bias = jnp.zeros(buckets) if bias else None
        self.blocks = eqx.filter_vmap(lambda _: T5Block(config))(jnp.arange(config["num_layers"]))
        self.final_norm = jnp.ones(config["d_model"])

    @classmethod
    def from_config(cls, config, *, key):
        return cls(config)


@pytest.fixture(scope="module")
def t5_checkpoint(tmp_path_factory):
    transformers_or_skip()
    from transformers import T5Config, T5ForConditionalGeneration

    directory = tmp_path_factory.mktemp("t5") / "t5"
    config = T5Config(vocab_size=97, d_model=40, d_kv=12, d_ff=80, num_layers=3, num_heads=4)
    T5ForConditionalGeneration(config).save_pretrained(directory)  # relative_attention_num_buckets: 32
    return directory


def test_scaffold_ignores_what_an_encoder_only_module_leaves_out(t5_checkpoint, tmp_path):
    """Issue 24 row 5: a full T5 checkpoint, an encoder-only module: the decoder ignored in one line,
    with why; its keys named as no pairing's rival; `port check` then finds no key unused."""
    with port.open_checkpoint(t5_checkpoint) as ckpt:
        n_decoder = sum(key.startswith("decoder.") for key in ckpt.tensors)
        skeleton = eqx.filter_eval_shape(T5Encoder.from_config, ckpt.config, key=jax.random.key(0))
        text = scaffold(ckpt, skeleton, "test_scaffold:T5Encoder")
        without_bias = scaffold(ckpt, eqx.filter_eval_shape(T5Encoder, ckpt.config, False), "test_scaffold:T5Encoder")
    assert n_decoder == 3 * 13 + 2  # 13 a layer; the relative attention bias (in the first) and the final norm
    assert port.parse_mapping(text).ignore == ("decoder.*",)
    assert f"    \"decoder.*\",   # not paired with any leaf: {n_decoder} keys, every key under 'decoder.'" in text
    assert "0 source keys unpaired (0 patterns), 0 leaves unfilled; 1 ignore patterns" in text
    assert "TODO unpaired" not in text and "also matches decoder" not in text
    # Issue 24 row 2: the two norms of a layer, alike by name, paired in the order of the module's leaves
    by_path = entries(port.parse_mapping(text))
    assert by_path["blocks.attn_norm"].key == "encoder.block.{layer}.layer.0.layer_norm.weight"
    assert by_path["blocks.mlp_norm"].key == "encoder.block.{layer}.layer.1.layer_norm.weight"
    assert by_path["blocks.wi"].key == "encoder.block.{layer}.layer.1.DenseReluDense.wi.weight"
    assert by_path["blocks.wf"].key == "encoder.block.{layer}.layer.1.DenseReluDense.wo.weight"
    draft = tmp_path / "draft.toml"
    draft.write_text(text)
    confirm_checks(draft, t5_checkpoint)  # the CHECKs are the only problems: no key unused
    recipe = port.check(draft, t5_checkpoint)
    assert len(recipe.ignored) == n_decoder and len(recipe.leaves) == 11

    # Without a leaf for the encoder's relative attention bias, that key is ignored by its own pattern.
    assert port.parse_mapping(without_bias).ignore == (
        "decoder.*",
        "encoder.block.*.layer.*.SelfAttention.relative_attention_bias.weight",
    )
    assert (
        '    "encoder.block.*.layer.*.SelfAttention.relative_attention_bias.weight",   # not paired with any leaf: '
        "1 key; no unfilled leaf fits or resembles it" in without_bias
    )
