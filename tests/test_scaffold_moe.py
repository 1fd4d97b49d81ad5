"""`scaffold` of mixture-of-experts checkpoints (`{layer}`/`{expert}` groups) and unequal fused tensors.

Each test writes a small Equinox module of its own into `tmp_path` (importable, as a
mapping's `model` must be) and a checkpoint in Hugging Face layout, drafts a mapping,
and checks that the draft passes `port check` and loads exactly the checkpoint's values.
"""

import re
import textwrap

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from port._transforms import Reshape, Split
from port.authoring import check, scaffold

from helpers import confirm_checks, write_checkpoint

LAYERS, EXPERTS, EMBED, MLP, VOCAB = 2, 4, 8, 10, 13

MOE_MODULE = '''
import equinox as eqx
import jax.numpy as jnp


class Experts(eqx.Module):
    gate: jnp.ndarray  # [layers, experts, mlp, embed]: Mixtral's w1
    up: jnp.ndarray    # w3
    down: jnp.ndarray  # [layers, experts, embed, mlp]: w2


class Block(eqx.Module):
    norm: jnp.ndarray    # [layers, embed]
    router: jnp.ndarray  # [layers, experts, embed]
    experts: Experts


class Moe(eqx.Module):
    embed: jnp.ndarray         # [vocab, embed]
    blocks: Block
    expert_scale: jnp.ndarray  # [experts, embed]: a key per expert, no layers

    @classmethod
    def from_config(cls, config, *, key):
        l, e, d, m, v = (config[k] for k in ("num_hidden_layers", "num_local_experts", "hidden_size",
                                             "intermediate_size", "vocab_size"))
        experts = Experts(jnp.zeros((l, e, m, d)), jnp.zeros((l, e, m, d)), jnp.zeros((l, e, d, m)))
        return cls(jnp.zeros((v, d)), Block(jnp.zeros((l, d)), jnp.zeros((l, e, d)), experts), jnp.zeros((e, d)))


class Layer(eqx.Module):
    router: jnp.ndarray  # [experts, embed]
    w1: jnp.ndarray      # [experts, mlp, embed]


class Unstacked(eqx.Module):
    """Layers as a list, experts stacked in each: `layers.{layer}.experts.{expert}.w1` fills `layers.{layer}.w1`."""

    layers: list

    @classmethod
    def from_config(cls, config, *, key):
        l, e, d, m = (config[k] for k in ("num_hidden_layers", "num_local_experts", "hidden_size",
                                          "intermediate_size"))
        return cls([Layer(jnp.zeros((e, d)), jnp.zeros((e, m, d))) for _ in range(l)])
'''

MOE_CONFIG = {
    "model_type": "tinymoe",
    "num_hidden_layers": LAYERS,
    "num_local_experts": EXPERTS,
    "hidden_size": EMBED,
    "intermediate_size": MLP,
    "vocab_size": VOCAB,
}

# Phi-3 shapes under grouped-query attention: 6 heads, 2 kv heads of 4; qkv_proj [(6 + 2 + 2) * 4, 24]
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FF = 6, 2, 4, 24, 32

PHI3_MODULE = '''
import equinox as eqx
import jax.numpy as jnp


class Attention(eqx.Module):
    wq: jnp.ndarray  # [layers, heads, head_dim, embed]
    wk: jnp.ndarray  # [layers, kv_heads, head_dim, embed]
    wv: jnp.ndarray
    wo: jnp.ndarray  # [layers, embed, heads, head_dim]


class Mlp(eqx.Module):
    gate: jnp.ndarray  # [layers, mlp, embed]
    up: jnp.ndarray
    down: jnp.ndarray  # [layers, embed, mlp]


class Block(eqx.Module):
    attn_norm: jnp.ndarray
    attn: Attention
    mlp_norm: jnp.ndarray
    mlp: Mlp


class Phi3(eqx.Module):
    embed: jnp.ndarray
    blocks: Block
    norm: jnp.ndarray
    lm_head: jnp.ndarray

    @classmethod
    def from_config(cls, config, *, key):
        l, d, h, kv, m, v = (config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                 "num_key_value_heads", "intermediate_size", "vocab_size"))
        hd = d // h
        z = jnp.zeros
        attn = Attention(z((l, h, hd, d)), z((l, kv, hd, d)), z((l, kv, hd, d)), z((l, d, h, hd)))
        mlp = Mlp(z((l, m, d)), z((l, m, d)), z((l, d, m)))
        return cls(z((v, d)), Block(z((l, d)), attn, z((l, d)), mlp), z(d), z((v, d)))


class FlatAttention(eqx.Module):
    wq: jnp.ndarray  # [layers, heads * head_dim, embed]: torch's own rows, no heads axis
    wk: jnp.ndarray  # [layers, kv_heads * head_dim, embed]
    wv: jnp.ndarray
    wo: jnp.ndarray  # [layers, embed, heads * head_dim]


class Flat(eqx.Module):
    """Only the attention's fused projection, its parts kept as torch's 2-d weights."""

    attn: FlatAttention

    @classmethod
    def from_config(cls, config, *, key):
        l, d, h, kv = (config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                           "num_key_value_heads"))
        hd = d // h
        z = jnp.zeros
        return cls(FlatAttention(z((l, h * hd, d)), z((l, kv * hd, d)), z((l, kv * hd, d)), z((l, d, h * hd))))
'''

PHI3_CONFIG = {
    "model_type": "tinyphi3",
    "num_hidden_layers": LAYERS,
    "hidden_size": HIDDEN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "intermediate_size": FF,
    "vocab_size": VOCAB,
}


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def moe_tensors(seed=0):
    """Mixtral's layout: a tensor per layer and expert, a router per layer; and a scale per expert."""
    rng = np.random.default_rng(seed)
    found = {"model.embed_tokens.weight": normal(rng, VOCAB, EMBED)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        found[p + "post_attention_layernorm.weight"] = normal(rng, EMBED)
        found[p + "block_sparse_moe.gate.weight"] = normal(rng, EXPERTS, EMBED)
        for expert in range(EXPERTS):
            e = p + f"block_sparse_moe.experts.{expert}."
            found[e + "w1.weight"] = normal(rng, MLP, EMBED)
            found[e + "w2.weight"] = normal(rng, EMBED, MLP)
            found[e + "w3.weight"] = normal(rng, MLP, EMBED)
    for expert in range(EXPERTS):
        found[f"model.experts.{expert}.scale"] = normal(rng, EMBED)
    return found


def phi3_tensors(seed=0):
    """Phi-3's layout: q, k, v rows fused in qkv_proj, gate and up rows in gate_up_proj."""
    rng = np.random.default_rng(seed)
    found = {
        "model.embed_tokens.weight": normal(rng, VOCAB, HIDDEN),
        "model.norm.weight": normal(rng, HIDDEN),
        "lm_head.weight": normal(rng, VOCAB, HIDDEN),
    }
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        found.update(
            {
                p + "input_layernorm.weight": normal(rng, HIDDEN),
                p + "self_attn.qkv_proj.weight": normal(rng, (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": normal(rng, HIDDEN, HEADS * HEAD_DIM),
                p + "post_attention_layernorm.weight": normal(rng, HIDDEN),
                p + "mlp.gate_up_proj.weight": normal(rng, 2 * FF, HIDDEN),
                p + "mlp.down_proj.weight": normal(rng, HIDDEN, FF),
            }
        )
    return found


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    (tmp_path / "tinymoe.py").write_text(textwrap.dedent(MOE_MODULE))
    (tmp_path / "tinyphi3.py").write_text(textwrap.dedent(PHI3_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def draft_to(path, ckpt_dir, model: str, uncomment: bool = False) -> port.Mapping:
    """Scaffold `model` for `ckpt_dir` into `path` (its commented draft entries uncommented, if asked)."""
    text = scaffold(ckpt_dir, None, model)
    if uncomment:
        text = re.sub(r"^# (\[\[params\]\]|key = |path = |transforms = |axes = )", r"\1", text, flags=re.M)
    path.write_text(text)
    return port.parse_mapping(text, str(path))


def assert_loads_exactly(model, expected: dict) -> None:
    got = port._skeleton.leaves(model)
    assert set(got) == set(expected)
    for path, value in expected.items():
        np.testing.assert_array_equal(np.asarray(got[path]), value, err_msg=path)


def test_moe_draft_stacks_layers_and_experts(workspace):
    source = moe_tensors()
    ckpt = write_checkpoint(workspace / "ckpt", source, MOE_CONFIG)
    mapping = draft_to(workspace / "draft.toml", ckpt, "tinymoe:Moe")
    text = mapping.text
    assert "7 entries paired, 0 source keys unpaired (0 patterns), 0 leaves unfilled" in text
    assert "# TODO" not in text and "# CHECK" not in text
    by_path = {p.path: p for p in mapping.params}
    experts = "layers.{layer}.block_sparse_moe.experts.{expert}"
    assert {path: by_path[path].key for path in by_path} == {
        "embed": "embed_tokens.weight",
        "blocks.norm": "layers.{layer}.post_attention_layernorm.weight",
        "blocks.router": "layers.{layer}.block_sparse_moe.gate.weight",
        "blocks.experts.gate": f"{experts}.w1.weight",  # Mixtral's w1 is the gate, w3 up, w2 down
        "blocks.experts.up": f"{experts}.w3.weight",
        "blocks.experts.down": f"{experts}.w2.weight",
        "expert_scale": "experts.{expert}.scale",
    }
    assert by_path["blocks.experts.gate"].axes == ("layers", "experts", "mlp", "embed")
    assert by_path["blocks.experts.down"].axes == ("layers", "experts", "embed", "mlp")
    assert by_path["blocks.router"].axes == ("layers", "experts", "embed")
    assert by_path["expert_scale"].axes == ("experts", "embed")
    assert all(p.transforms == () for p in mapping.params)
    assert mapping.rules["experts"] == ("model",)
    assert f"#   {experts}.w1.weight" not in text  # grouped, not left over

    recipe = check(workspace / "draft.toml", ckpt, mesh="4x2")
    specs = {leaf.path: leaf for leaf in recipe.leaves}
    assert specs["blocks.experts.gate"].stack == (LAYERS, EXPERTS)
    assert specs["blocks.experts.gate"].spec == P(None, "model", None, "data")  # mlp: `model` is taken
    assert specs["expert_scale"].spec == P("model", "data")

    model = port.load(ckpt, mesh="4x2", mapping=workspace / "draft.toml")

    def per_expert(name):
        return np.stack(
            [  # noqa: E731
                np.stack(
                    [
                        source[f"model.{experts}.{name}".replace("{layer}", str(l)).replace("{expert}", str(e))]
                        for e in range(EXPERTS)
                    ]
                )
                for l in range(LAYERS)
            ]
        )

    assert_loads_exactly(
        model,
        {
            "embed": source["model.embed_tokens.weight"],
            "blocks.norm": np.stack(
                [source[f"model.layers.{l}.post_attention_layernorm.weight"] for l in range(LAYERS)]
            ),
            "blocks.router": np.stack(
                [source[f"model.layers.{l}.block_sparse_moe.gate.weight"] for l in range(LAYERS)]
            ),
            "blocks.experts.gate": per_expert("w1.weight"),
            "blocks.experts.up": per_expert("w3.weight"),
            "blocks.experts.down": per_expert("w2.weight"),
            "expert_scale": np.stack([source[f"model.experts.{e}.scale"] for e in range(EXPERTS)]),
        },
    )


def test_moe_draft_of_unstacked_layers_stacks_only_the_experts(workspace):
    source = {k: v for k, v in moe_tensors().items() if "gate" in k or "w1" in k}
    ckpt = write_checkpoint(workspace / "ckpt", source, MOE_CONFIG)
    mapping = draft_to(workspace / "draft.toml", ckpt, "tinymoe:Unstacked")
    assert {(p.path, p.key, p.axes) for p in mapping.params} == {  # one entry per role, a leaf per layer
        ("layers.{layer}.router", "layers.{layer}.block_sparse_moe.gate.weight", ("experts", "embed")),
        (
            "layers.{layer}.w1",
            "layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
            ("experts", "mlp", "embed"),
        ),
    }
    check(workspace / "draft.toml", ckpt, mesh="4x2")
    model = port.load(ckpt, mesh="4x2", mapping=workspace / "draft.toml")
    assert_loads_exactly(
        model,
        {
            **{f"layers.{l}.router": source[f"model.layers.{l}.block_sparse_moe.gate.weight"] for l in range(LAYERS)},
            **{
                f"layers.{l}.w1": np.stack(
                    [source[f"model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight"] for e in range(EXPERTS)]
                )
                for l in range(LAYERS)
            },
        },
    )


def phi3_expected(source, per_head: bool = True) -> dict:
    """The leaves of `tinyphi3:Phi3` (or, not `per_head`, the attention of `tinyphi3:Flat`) from `source`."""
    q, k = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    stack = lambda name, f: np.stack([f(source[f"model.layers.{l}.{name}"]) for l in range(LAYERS)])  # noqa: E731
    heads = (lambda x, n: x.reshape(n, HEAD_DIM, HIDDEN)) if per_head else (lambda x, n: x)
    attn = {
        "attn.wq": stack("self_attn.qkv_proj.weight", lambda x: heads(x[:q], HEADS)),
        "attn.wk": stack("self_attn.qkv_proj.weight", lambda x: heads(x[q : q + k], KV_HEADS)),
        "attn.wv": stack("self_attn.qkv_proj.weight", lambda x: heads(x[q + k :], KV_HEADS)),
    }
    if not per_head:
        return {**attn, "attn.wo": stack("self_attn.o_proj.weight", lambda x: x)}
    same = lambda x: x  # noqa: E731
    return {
        "embed": source["model.embed_tokens.weight"],
        "norm": source["model.norm.weight"],
        "lm_head": source["lm_head.weight"],
        **{f"blocks.{path}": value for path, value in attn.items()},
        "blocks.attn.wo": stack("self_attn.o_proj.weight", lambda x: x.reshape(HIDDEN, HEADS, HEAD_DIM)),
        "blocks.attn_norm": stack("input_layernorm.weight", same),
        "blocks.mlp_norm": stack("post_attention_layernorm.weight", same),
        "blocks.mlp.gate": stack("mlp.gate_up_proj.weight", lambda x: x[:FF]),
        "blocks.mlp.up": stack("mlp.gate_up_proj.weight", lambda x: x[FF:]),
        "blocks.mlp.down": stack("mlp.down_proj.weight", same),
    }


def test_phi3_fused_qkv_of_unequal_parts_is_split_per_head_by_config_names(workspace):
    source = phi3_tensors()
    ckpt = write_checkpoint(workspace / "ckpt", source, PHI3_CONFIG)
    commented = port.parse_mapping(scaffold(ckpt, None, "tinyphi3:Phi3"))
    assert {p.path for p in commented.params} == {
        "embed",
        "norm",
        "lm_head",
        "blocks.attn_norm",
        "blocks.mlp_norm",
        "blocks.attn.wo",
        "blocks.mlp.down",
    }
    assert "fused? [40, 24] on axis 0 is 3 parts of sizes [24, 8, 8]" in commented.text
    assert "fused? [64, 24] on axis 0 is 2 x [32, 24]" in commented.text  # gate_up: equal parts, as before

    mapping = draft_to(workspace / "draft.toml", ckpt, "tinyphi3:Phi3", uncomment=True)
    by_path = {p.path: p for p in mapping.params}
    sizes = ("num_attention_heads", "num_key_value_heads", "num_key_value_heads")  # 2 is also num_hidden_layers
    for index, (name, axis) in enumerate([("wq", "heads"), ("wk", "kv_heads"), ("wv", "kv_heads")]):
        entry = by_path[f"blocks.attn.{name}"]
        assert entry.key == "layers.{layer}.self_attn.qkv_proj.weight"
        assert entry.transforms == (Reshape((-1, HEAD_DIM, "hidden_size")), Split(0, index, sizes=sizes))
        assert entry.axes == ("layers", axis, "head_dim", "embed")
    for index, name in enumerate(["gate", "up"]):
        assert by_path[f"blocks.mlp.{name}"].transforms == (Split(0, index, parts=2),)

    confirm_checks(workspace / "draft.toml", ckpt, mesh="4x2")
    recipe = check(workspace / "draft.toml", ckpt, mesh="4x2")
    assert {leaf.path for leaf in recipe.leaves} == set(phi3_expected(source))
    model = port.load(ckpt, mesh="4x2", mapping=workspace / "draft.toml")
    assert_loads_exactly(model, phi3_expected(source))


def test_unequal_parts_without_a_heads_axis_split_by_plain_sizes(workspace):
    source = {k: v for k, v in phi3_tensors().items() if "qkv_proj" in k or "o_proj" in k}
    ckpt = write_checkpoint(workspace / "ckpt", source, PHI3_CONFIG)
    mapping = draft_to(workspace / "draft.toml", ckpt, "tinyphi3:Flat", uncomment=True)
    q, k = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM  # no config name for 8: plain sizes
    assert {p.path: p.transforms for p in mapping.params} == {
        "attn.wo": (),
        **{f"attn.{name}": (Split(0, index, sizes=(q, k, k)),) for index, name in enumerate(["wq", "wk", "wv"])},
    }
    confirm_checks(workspace / "draft.toml", ckpt, mesh="4x2")
    check(workspace / "draft.toml", ckpt, mesh="4x2")
    model = port.load(ckpt, mesh="4x2", mapping=workspace / "draft.toml")
    assert_loads_exactly(model, phi3_expected(source, per_head=False))


def test_moe_keys_no_leaf_fits_stay_one_group_in_the_todo(workspace, tmp_path):
    """A grid of layer x expert keys is one pattern for the author, even when no leaf takes it."""
    (tmp_path / "oddmoe.py").write_text(
        textwrap.dedent("""
        import equinox as eqx
        import jax.numpy as jnp

        class Odd(eqx.Module):
            router: jnp.ndarray  # [layers, experts, embed]
            w1: jnp.ndarray      # [layers, experts, 3]: no expert's [mlp, embed] fits

            @classmethod
            def from_config(cls, config, *, key):
                l, e, d = config["num_hidden_layers"], config["num_local_experts"], config["hidden_size"]
                return cls(jnp.zeros((l, e, d)), jnp.zeros((l, e, 3)))
    """)
    )
    source = {k: v for k, v in moe_tensors().items() if "gate" in k or "w1" in k}
    text = scaffold(write_checkpoint(workspace / "ckpt", source, MOE_CONFIG), None, "oddmoe:Odd")
    assert "1 entries paired" in text
    assert (
        f"#   layers.{{layer}}.block_sparse_moe.experts.{{expert}}.w1.weight  {LAYERS} layers x {EXPERTS} experts"
        f" of [{MLP}, {EMBED}] float32" in text
    )
    assert f"{LAYERS * EXPERTS} source keys unpaired (1 patterns)" in text
