"""`scaffold` of models with layer groups (dense layers among MoE ones): one entry per group.

Tiny DeepSeek-V3, Qwen3-MoE (layer 1 of 3 dense) and Llama 4 (dense/MoE alternating)
checkpoints from transformers, drafted against port's own modules and compared with
the shipped mappings: the draft's (key pattern, path) pairs are the shipped ones, for
the attention, norm and MLP / expert keys of every group.
"""

import re
import tomllib
from pathlib import Path

import pytest

from port.authoring import check, scaffold
from port.authoring._scaffold import draft

from helpers import confirm_checks, transformers_or_skip

MAPPINGS = Path(__file__).resolve().parents[1] / "mappings"
FAMILIES = ("deepseek_v3", "qwen3_moe", "llama4")
MTP = 3  # DeepSeek-V3's multi-token-prediction layer: the one after the tiny model's 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> a checkpoint directory of the family's tiny model (DeepSeek-V3's with an MTP layer added)."""
    transformers_or_skip()
    from safetensors.numpy import load_file, save_file
    from test_decoders import torch_model

    made = {}
    for name in FAMILIES:
        directory = tmp_path_factory.mktemp(name)
        torch_model(name).save_pretrained(directory)
        if name == "deepseek_v3":  # the released checkpoints store `model.layers.{num_hidden_layers}.*`
            file = directory / "model.safetensors"
            tensors = load_file(file)
            tensors |= {
                k.replace("model.layers.1.", f"model.layers.{MTP}.", 1): v
                for k, v in tensors.items()
                if k.startswith("model.layers.1.")
            }
            tensors[f"model.layers.{MTP}.eh_proj.weight"] = tensors["model.embed_tokens.weight"][:48, :48].copy()
            save_file(tensors, file, metadata={"format": "pt"})
        made[name] = directory
    return made


def shipped(name):
    return tomllib.loads((MAPPINGS / f"{name}.toml").read_text())


def pairs(mapping):
    return {(p["key"], p["path"]) for p in mapping.get("params", [])}


def _regex(pattern):
    return re.compile(re.escape(pattern).replace(r"\{layer\}", r"\d+").replace(r"\{expert\}", r"\d+") + "$")


def applicable(name, d):
    """The shipped mapping's pairs this checkpoint and module have: key present, path a leaf."""
    names = {k.removeprefix(d.prefix or "") for k in _keys(d)}
    leaves = {e.path for e in d.entries} | {leaf.path for leaf in d.free}
    return {(k, p) for k, p in pairs(shipped(name)) if p in leaves and any(_regex(k).match(n) for n in names)}


def _keys(d):
    from port._sources import open_checkpoint

    with open_checkpoint(d.source) as ckpt:
        return list(ckpt.tensors)


@pytest.mark.parametrize("name", FAMILIES)
def test_draft_pairs_each_group_as_the_shipped_mapping(checkpoints, name):
    model = shipped(name)["model"]
    d = draft(checkpoints[name], None, model)
    text = scaffold(checkpoints[name], None, model)
    got = pairs(tomllib.loads(text))
    ship = pairs(shipped(name))
    # no pair the shipped mapping contradicts: a key it maps goes where it goes, a path it fills from that key
    for key, path in got:
        assert path in {p for k, p in ship if k == key}, (key, path)
        assert key in {k for k, p in ship if p == path}, (key, path)
    want = applicable(name, d)
    # a fused key (split into several leaves of one group: DeepSeek-V3's kv_a_proj_with_mqa) is left
    # to the author, listed with a hint; the others are drafted
    fused = {k for k, p in want if sum(k == k2 and p.split(".")[0] == p2.split(".")[0] for k2, p2 in want) > 1}
    whole = {(k, p) for k, p in want if k not in fused}
    assert len(got & whole) >= 0.8 * len(whole), sorted(whole - got)
    assert fused <= {g.pattern for g in d.unpaired}
    # both groups: attention, norms and the MLP (or experts) of each
    from port._mapping import import_object
    from port._plan import layer_groups
    from port._skeleton import skeleton
    from port._sources import open_checkpoint

    with open_checkpoint(checkpoints[name]) as ckpt:
        groups = layer_groups(skeleton(import_object(model, "model"), ckpt.config))
    assert len(groups) == 2
    for label in groups:
        mine = {p for _, p in got if p.startswith(label + ".")}
        assert {p for p in mine if ".attn." in p}, (label, mine)
        assert {p for p in mine if p.endswith("norm")}, (label, mine)
        assert {p for p in mine if ".mlp." in p}, (label, mine)
    # one entry per group for a key pattern both groups hold
    norms = {p for k, p in got if k == "layers.{layer}.input_layernorm.weight"}
    assert norms == {f"{label}.attn_norm" for label in groups}
    # what is left is marked
    for group in d.unpaired:
        assert re.search(r"^#   " + re.escape(group.pattern), text, re.MULTILINE), group.pattern
    for leaf in d.free:
        assert re.search(r"^#   " + re.escape(leaf.path) + " ", text, re.MULTILINE), leaf.path
    if d.unpaired:
        assert "# TODO unpaired source keys" in text
    if d.free:
        assert "# TODO unfilled leaves" in text


def test_deepseek_multi_token_prediction_layer_is_ignored_by_name(checkpoints):
    text = scaffold(checkpoints["deepseek_v3"], None, shipped("deepseek_v3")["model"])
    mapping = tomllib.loads(text)
    assert "layers.{num_hidden_layers}.*" in mapping["ignore"]
    assert f"layer {MTP} (layers.{MTP}.*)" in text
    assert f"layers.{MTP}." not in "".join(p["key"] for p in mapping["params"])
    assert not re.search(rf"^#   layers\.{MTP}\.", text, re.MULTILINE)  # not listed as unpaired either


def test_qwen3_moe_draft_passes_check_as_it_is(checkpoints):
    """Every key and leaf paired: the draft is a working mapping, one stack per group."""
    text = scaffold(checkpoints["qwen3_moe"], None, shipped("qwen3_moe")["model"])
    assert "TODO unpaired" not in text and "TODO unfilled" not in text
    path = checkpoints["qwen3_moe"] / "draft.toml"
    path.write_text(text)
    assert len(confirm_checks(path, checkpoints["qwen3_moe"])) >= 1  # its guesses first, then nothing else
    plan = check(path, checkpoints["qwen3_moe"])
    assert {leaf.path for leaf in plan.leaves} >= {"dense.attn.wq", "blocks.attn.wq", "blocks.mlp.experts.gate"}


def test_layers_no_group_holds_and_empty_groups():
    """An unstacked layer whose index no group holds is listed, with a TODO, when it is not the MTP layer."""
    import numpy as np

    from port.authoring._pairing import Leaf
    from port.authoring._scaffold import _passes

    class Info:
        shape, dtype = (4,), np.dtype("float32")

    names = {f"layers.{i}.norm.weight": f"model.layers.{i}.norm.weight" for i in (0, 1, 5)}
    leaves = [Leaf("a.norm", (1, 4), np.dtype("float32")), Leaf("b.norm", (1, 4), np.dtype("float32"))]
    passes, notes, ignore, beyond = _passes(
        names, {k: Info for k in names.values()}, leaves, {"a": (0,), "b": (1,), "c": ()}, {"num_hidden_layers": 2}
    )
    assert [p.label for p in passes] == [None, "a", "b"]
    assert passes[2].names == {"layers.0.norm.weight": "model.layers.1.norm.weight"}  # row 0 of b is layer 1
    assert ignore == [] and [g.pattern for g in beyond] == ["layers.5.norm.weight"]
    assert any("TODO" in n and "5" in n for n in notes)
    assert any("'c' holds no layer" in n for n in notes)
    passes, notes, ignore, beyond = _passes(
        names, {k: Info for k in names.values()}, leaves, {"a": (0,), "b": (1,)}, {"num_hidden_layers": 5}
    )
    assert ignore == ["layers.{num_hidden_layers}.*"] and beyond == []
