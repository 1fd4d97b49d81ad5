"""`port scaffold` for targets other than port's stacked Equinox modules: Flax NNX modules
(a factory, or an NNX class) and Equinox modules that keep their layers in a list.

Each draft is made from a transformers Llama checkpoint (`helpers.torch_llama`), must pass
`port check` and `port plan` once its guesses are confirmed (`helpers.confirm_checks`),
and loads into a module whose logits are transformers'. The NNX module is the worked
example, `examples/nnx_llama/llama.py`; the list-of-layers Equinox one is `tests/list_llama.py`.
"""

import shutil
from pathlib import Path

import equinox as eqx
import numpy as np
import pytest
from safetensors.numpy import load_file

import port
from port._transforms import Reshape, Transpose
from port.authoring import check, scaffold
from port.authoring._pairing import Leaf, list_leaves

from helpers import (
    INPUT_IDS,
    REPO,
    confirm_checks,
    one_line,
    run_port,
    torch_llama,
    torch_logits,
    write_checkpoint,
)

NNX_EXAMPLE = REPO / "examples" / "nnx_llama"
LIST_LLAMA = Path(__file__).with_name("list_llama.py")

# Every weight transformers' Llama has per layer, by its key after `model.layers.{layer}.`.
LAYER_KEYS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
RULES = {"embed": ("data",), "heads": ("model",), "kv_heads": ("model",), "mlp": ("model",), "vocab": ("model",)}

# An NNX module class port builds itself, `cls(config, rngs=...)`: the example's Llama taking the
# config.json dict, with a Dropout, whose RNG key and count are the module's own state.
DICT_LLAMA = """
from flax import nnx

import llama


class DictLlama(llama.Llama):
    def __init__(self, config, *, rngs):
        super().__init__(llama.LlamaConfig.from_hf(config), rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
"""


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A transformers Llama (2 layers, grouped-query attention) saved, and its logits for INPUT_IDS."""
    model = torch_llama()
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    return directory, torch_logits(model)


@pytest.fixture
def nnx_llama(monkeypatch, tmp_path):
    """The worked example's `llama` module (and `dict_llama`, beside it in tmp_path) importable."""
    pytest.importorskip("flax.nnx")
    monkeypatch.syspath_prepend(str(NNX_EXAMPLE))
    (tmp_path / "dict_llama.py").write_text(DICT_LLAMA)
    monkeypatch.syspath_prepend(str(tmp_path))
    import llama

    return llama


def nnx_logits(model) -> np.ndarray:
    from flax import nnx

    return np.asarray(nnx.jit(lambda m, ids: m(ids))(model, np.asarray(INPUT_IDS)))


def eqx_logits(model) -> np.ndarray:
    return np.asarray(eqx.filter_jit(lambda m, ids: m(ids))(model, np.asarray(INPUT_IDS)))


def confirmed(text: str, path: Path, checkpoint) -> port.Plan:
    """The draft `text` written to `path`, its two CHECKs (q_proj and o_proj are square) confirmed:
    `port check` on 4x2 passes then."""
    path.write_text(text)
    problems = confirm_checks(path, checkpoint, mesh="4x2")
    assert len(problems) == 2 and all("[64, 64] is square" in p for p in problems), problems
    return check(path, checkpoint, mesh="4x2")


def test_list_of_layers_draft_is_one_entry_per_role(llama_checkpoint, tmp_path):
    directory, expected = llama_checkpoint
    from list_llama import ListLlama

    text = scaffold(directory, ListLlama, "list_llama:ListLlama")
    assert "12 entries paired, 0 source keys unpaired (0 patterns), 0 leaves unfilled" in text
    mapping = port.parse_mapping(text, "draft.toml")
    per_layer = {p.key: p for p in mapping.params if "{layer}" in p.key}
    assert set(per_layer) == {f"layers.{{layer}}.{k}" for k in LAYER_KEYS}  # one entry per role, not per layer
    q = (Reshape(("num_attention_heads", "head_dim", "hidden_size")),)  # a heads axis of the module's
    kv = (Reshape(("num_key_value_heads", "head_dim", "hidden_size")),)
    o = (Reshape(("hidden_size", "num_attention_heads", "head_dim")),)
    assert {(p.path, p.transforms, p.axes) for p in per_layer.values()} == {
        ("layers.{layer}.attn_norm", (), ("embed",)),
        ("layers.{layer}.attn.wq", q, ("heads", "head_dim", "embed")),
        ("layers.{layer}.attn.wk", kv, ("kv_heads", "head_dim", "embed")),
        ("layers.{layer}.attn.wv", kv, ("kv_heads", "head_dim", "embed")),
        ("layers.{layer}.attn.wo", o, ("embed", "heads", "head_dim")),
        ("layers.{layer}.mlp_norm", (), ("embed",)),
        ("layers.{layer}.gate.weight", (), ("mlp", "embed")),
        ("layers.{layer}.up.weight", (), ("mlp", "embed")),
        ("layers.{layer}.down.weight", (), ("embed", "mlp")),
    }
    unembed = next(p for p in mapping.params if p.path == "unembed")
    assert unembed.key == "lm_head.weight" and unembed.transforms == (Transpose((1, 0)),)
    assert mapping.rules == RULES | {"head_dim": ()}  # no `layers`: no leaf has a layers axis

    recipe = confirmed(text, tmp_path / "draft.toml", directory)
    assert {leaf.path for leaf in recipe.leaves} >= {"layers.0.attn.wq", "layers.1.attn.wq"}
    model = port.load(directory, mesh="4x2", mapping=tmp_path / "draft.toml")
    np.testing.assert_allclose(eqx_logits(model), expected, atol=1e-4, rtol=1e-4)
    assert tuple(model.layers[1].attn.wq.sharding.spec) == ("model", None, "data")


def test_nnx_draft_takes_the_modules_sharding_names_and_leaves_its_rng_state(llama_checkpoint, nnx_llama, tmp_path):
    directory, expected = llama_checkpoint
    from dict_llama import DictLlama

    text = scaffold(directory, DictLlama, "dict_llama:DictLlama")
    assert "rngs" not in text and "dropout" not in text  # the Dropout's RNG key and count: not drafted
    assert "12 entries paired, 0 source keys unpaired (0 patterns), 0 leaves unfilled" in text
    mapping = port.parse_mapping(text, "draft.toml")
    assert {p.key for p in mapping.params if "{layer}" in p.key} == {f"layers.{{layer}}.{k}" for k in LAYER_KEYS}
    assert all(p.axes is None for p in mapping.params)  # axes = "module" everywhere
    q_proj = (
        "[[params]]\n"
        'key = "layers.{layer}.self_attn.q_proj.weight"\n'
        'path = "layers.{layer}.attn.q_proj.kernel"\n'
        "transforms = [{ transpose = [1, 0] }]\n"
        'axes = "module"   # the module\'s sharding names: ["embed", "heads"]\n'
    )
    assert q_proj in text
    kernels = [p for p in mapping.params if p.path.endswith(".kernel")]
    assert len(kernels) == 8 and all(p.transforms == (Transpose((1, 0)),) for p in kernels)  # nnx.Linear: (in, out)
    assert mapping.rules == RULES

    confirmed(text, tmp_path / "draft.toml", directory)
    model = port.load(directory, mesh="4x2", mapping=tmp_path / "draft.toml")
    np.testing.assert_allclose(nnx_logits(model), expected, atol=1e-4, rtol=1e-4)
    assert tuple(model.layers[1].attn.q_proj.kernel[...].sharding.spec) == ("data", "model")


def test_a_list_leaf_no_key_fills_is_left_as_one_todo(llama_checkpoint, tmp_path):
    directory, _ = llama_checkpoint
    from list_llama import ListLlama

    tensors = {k: v for k, v in load_file(directory / "model.safetensors").items() if "post_attention" not in k}
    config = port.open_checkpoint(directory).config
    lacking = write_checkpoint(tmp_path / "ckpt", tensors, dict(config))
    text = scaffold(lacking, ListLlama, "list_llama:ListLlama")
    assert "11 entries paired, 0 source keys unpaired (0 patterns), 1 leaves unfilled" in text
    assert text.endswith(
        "# TODO unfilled leaves (no checkpoint key fits them):\n#   layers.{layer}.mlp_norm  2 layers of [64] float32\n"
    )


def test_only_whole_lists_of_layers_are_listed():
    f32 = np.dtype("float32")
    leaves = [
        *(Leaf(f"layers.{i}.w", (4, 3), f32) for i in range(3)),
        *(Leaf(f"convs.{i}.w", (5,), f32) for i in range(2)),  # 2 convs in a 3-layer model: not layers
        *(Leaf(f"mixed.{i}.w", (i + 1,), f32) for i in range(3)),  # shapes differ
        *(Leaf(f"layers.{i}.experts.{e}.w", (2,), f32) for i in range(3) for e in range(4)),
        Leaf("gaps.0.w", (2,), f32),
        Leaf("gaps.2.w", (2,), f32),
    ]
    listed, members = list_leaves(leaves, layers=3)
    assert [(leaf.path, leaf.shape, leaf.listed) for leaf in listed] == [
        ("layers.{layer}.w", (3, 4, 3), ("{layer}",)),
        ("convs.0.w", (5,), ()),
        ("convs.1.w", (5,), ()),
        ("mixed.0.w", (1,), ()),
        ("mixed.1.w", (2,), ()),
        ("mixed.2.w", (3,), ()),
        ("layers.{layer}.experts.{expert}.w", (3, 4, 2), ("{layer}", "{expert}")),
        ("gaps.0.w", (2,), ()),
        ("gaps.2.w", (2,), ()),
    ]
    assert members["layers.{layer}.w"] == ["layers.0.w", "layers.1.w", "layers.2.w"]
    assert listed[0].each == (4, 3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, leaf, spec",
    [
        ("llama:build", "layers.1.attn.q_proj.kernel", "(data, model)"),  # an NNX module's factory
        ("list_llama:ListLlama", "layers.1.attn.wq", "(model, -, data)"),  # Equinox, layers in a list
    ],
)
def test_scaffold_command_drafts_what_check_plan_and_verify_take(module, leaf, spec, llama_checkpoint, tmp_path):
    """Through the command line, `--module` naming a module of the working directory: the draft's
    two CHECKs are `port check` problems; confirmed, `port check` and `port plan` pass, and
    `port verify` finds the module loaded with the draft gives transformers' logits."""
    if module.startswith("llama:"):
        pytest.importorskip("flax.nnx")
        work = NNX_EXAMPLE
    else:
        work = tmp_path / "work"
        work.mkdir()
        shutil.copy(LIST_LLAMA, work)
    directory, expected = llama_checkpoint
    draft = tmp_path / "draft.toml"
    made = run_port("scaffold", directory, "--module", module, "--out", draft, cwd=work)
    assert made.returncode == 0 and f"port check {draft} {directory} --module {module}" in made.stderr, made.stderr
    assert f'model = "{module}"' in draft.read_text()

    refused = run_port("check", draft, directory, "--module", module, "--mesh", "4x2", cwd=work)
    one_line(refused, f"{draft}: 2 problems with {directory}")
    assert refused.stdout.count("a CHECK of port scaffold's is still there (CHECK: [64, 64] is square") == 2
    draft.write_text("".join(line for line in draft.read_text().splitlines(True) if "# CHECK" not in line))
    checked = run_port("check", draft, directory, "--module", module, "--mesh", "4x2", cwd=work)
    assert checked.returncode == 0 and f"{draft}: ok: 21 leaves from {directory}" in checked.stdout, checked.stderr
    planned = run_port("plan", directory, "--mapping", draft, "--module", module, "--mesh", "4x2", cwd=work)
    assert planned.returncode == 0, planned.stderr
    (row,) = [line for line in planned.stdout.splitlines() if line.startswith(leaf + " ")]
    assert spec in row, row
    verified = run_port("verify", directory, "--mapping", draft, "--module", module, cwd=work)
    assert verified.returncode == 0 and "vs LlamaForCausalLM.logits" in verified.stdout, verified.stderr


@pytest.mark.slow
def test_scaffold_command_refuses_a_class_it_cannot_build(llama_checkpoint, tmp_path):
    """`--module` naming a class that has no from_config and is no NNX module: one line, no draft."""
    pytest.importorskip("flax.nnx")
    directory, _ = llama_checkpoint
    draft = tmp_path / "draft.toml"
    refused = run_port("scaffold", directory, "--module", "llama:LlamaConfig", "--out", draft, cwd=NNX_EXAMPLE)
    one_line(refused, "'llama:LlamaConfig' is a class port cannot build", "name a factory instead", out=draft)
