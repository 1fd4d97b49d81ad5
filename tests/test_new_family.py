"""docs/adding-an-architecture.md followed on a family port does not ship: OPT.

The reader's module (`OPT_MODULE`, written here as a reader of the guide writes it, from
`port.nn`'s layers) and a tiny `OPTForCausalLM` checkpoint from transformers, with
distinct sizes (hidden 48, heads 4, ffn 80, vocab 97, positions 40 + OPT's offset of 2,
2 layers), as the guide asks. Then, through the installed `port`, in a working
directory of the reader's: `port scaffold`; only the edits the guide tells the reader
to make (each named by its step below, and the test checks the draft changed in no
other way); `port check`; `port verify --roundtrip` (and `--padding left`) against
transformers' OPTForCausalLM, the `reference` scaffold drafted from config.json;
`port convert`; `port export --module`, whose checkpoint is the original's, bit for bit.
"""

import difflib
import re

import numpy as np
import pytest

from helpers import one_line, perturbed, run_port, transformers_or_skip

pytestmark = pytest.mark.slow

# The reader's module, as docs/adding-an-architecture.md has them write it (TinyLM's shape).
OPT_MODULE = '''\
"""OPT (Meta's decoder) in Equinox: pre-norm blocks, learned positions offset by 2, a tied head."""

import equinox as eqx
import jax
import jax.numpy as jnp

import port
from port.nn import LayerNorm, attend, prepare, scan

OFFSET = 2  # OPT's position table has 2 rows before position 0
EPS = 1e-5  # OPT's LayerNorms use torch's default epsilon; config.json has none


class Block(eqx.Module):
    attn_norm: LayerNorm
    wq: jax.Array  # [heads, head_dim, embed]
    wk: jax.Array
    wv: jax.Array
    bq: jax.Array  # [heads, head_dim]
    bk: jax.Array
    bv: jax.Array
    wo: jax.Array  # [embed, heads, head_dim]
    bo: jax.Array
    mlp_norm: LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, config: dict, *, key):
        e, h, f = config["hidden_size"], config["num_attention_heads"], config["ffn_dim"]
        d = e // h
        keys = jax.random.split(key, 6)
        init = lambda k, *shape: 0.02 * jax.random.normal(k, shape)  # noqa: E731
        self.attn_norm = LayerNorm(e, eps=EPS, dtype=jnp.float32)
        self.wq, self.wk, self.wv = (init(k, h, d, e) for k in keys[:3])
        self.bq, self.bk, self.bv = jnp.zeros((h, d)), jnp.zeros((h, d)), jnp.zeros((h, d))
        self.wo, self.bo = init(keys[3], e, h, d), jnp.zeros(e)
        self.mlp_norm = LayerNorm(e, eps=EPS, dtype=jnp.float32)
        self.fc1 = eqx.nn.Linear(e, f, key=keys[4])
        self.fc2 = eqx.nn.Linear(f, e, key=keys[5])

    def __call__(self, x, mask):  # x: [batch, seq, embed], mask: [batch, seq, seq]
        y = self.attn_norm(x)
        q = jnp.einsum("bse,hde->bshd", y, self.wq) + self.bq
        k = jnp.einsum("bse,hde->bshd", y, self.wk) + self.bk
        v = jnp.einsum("bse,hde->bshd", y, self.wv) + self.bv
        attn = attend(q, k, v, mask, scale=q.shape[-1] ** -0.5)
        x = x + jnp.einsum("bshd,ehd->bse", attn, self.wo) + self.bo
        ff = jax.nn.relu(jax.vmap(jax.vmap(self.fc1))(self.mlp_norm(x)))
        return x + jax.vmap(jax.vmap(self.fc2))(ff)


class OPT(eqx.Module):
    embed: jax.Array  # [vocab, embed], also the LM head
    pos: jax.Array  # [positions + OFFSET, embed]
    blocks: Block  # every leaf stacked on a leading layer axis
    norm: LayerNorm

    def __init__(self, config: dict, *, key):
        e = config["hidden_size"]
        k_embed, k_pos, k_blocks = jax.random.split(key, 3)
        self.embed = 0.02 * jax.random.normal(k_embed, (config["vocab_size"], e))
        self.pos = 0.02 * jax.random.normal(k_pos, (config["max_position_embeddings"] + OFFSET, e))
        keys = jax.random.split(k_blocks, config["num_hidden_layers"])
        self.blocks = eqx.filter_vmap(lambda k: Block(config, key=k))(keys)
        self.norm = LayerNorm(e, eps=EPS, dtype=jnp.float32)

    @classmethod
    def from_config(cls, config: dict, *, key) -> "OPT":
        if not config.get("do_layer_norm_before", True):
            raise port.ConfigError("config.json: do_layer_norm_before = false (OPT-350m's post-norm) is not supported")
        if config.get("word_embed_proj_dim", config["hidden_size"]) != config["hidden_size"]:
            raise port.ConfigError("config.json: word_embed_proj_dim != hidden_size (projected embeddings)")
        if config.get("activation_function", "relu") != "relu":
            raise port.ConfigError("config.json: only activation_function = relu")
        return cls(config, key=key)

    def __call__(self, input_ids, *, attention_mask=None, remat=None):
        """[batch, seq] ids -> [batch, seq, vocab] logits; 0 in `attention_mask` is padding."""
        limit = ("max_position_embeddings", self.pos.shape[0] - OFFSET)
        tokens = prepare(input_ids, attention_mask=attention_mask, limit=limit)
        x = self.embed[tokens.ids] + self.pos[tokens.positions + OFFSET]
        x, _ = scan(lambda block, h: (block(h, tokens.mask), None), x, self.blocks, remat=remat)
        return tokens.output(self.norm(x) @ self.embed.T)
'''

# Distinct sizes, as the guide asks of test configs: each axis is named by its own size.
CONFIG = dict(
    vocab_size=97,
    hidden_size=48,
    num_attention_heads=4,
    ffn_dim=80,
    max_position_embeddings=40,
    num_hidden_layers=2,
    word_embed_proj_dim=48,
    do_layer_norm_before=True,
    init_std=0.2,  # large weights, and perturbed norms: a wrong detail shows far above the tolerance
)
CHECKPOINT, MODULE = "opt-checkpoint", "opt_model:OPT"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The reader's working directory: their module and the checkpoint, then the draft scaffold wrote."""
    transformers_or_skip()
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    work = tmp_path_factory.mktemp("opt-work")
    (work / "opt_model.py").write_text(OPT_MODULE)
    torch.manual_seed(0)
    model = perturbed(OPTForCausalLM(OPTConfig(**CONFIG)), lambda name: "layer_norm" in name, 0.5)
    model.save_pretrained(work / CHECKPOINT)
    result = run_port("scaffold", CHECKPOINT, "--module", MODULE, "--out", "draft.toml", cwd=work)
    assert result.returncode == 0, result.stderr
    return work


def edit_as_the_guide_says(draft: str) -> str:
    """The review of docs/adding-an-architecture.md's step 2, nothing else."""
    # "CHECK: a guess": each is confirmed (the test below asserts the guesses), then its comment deleted.
    # "TODO: name this axis": pos's first axis, 42 = max_position_embeddings + 2, is the position.
    lines = [line for line in draft.splitlines() if not line.startswith(("# CHECK", "# TODO: name this axis"))]
    return "\n".join(lines).replace('"dim42"', '"positions"').replace("dim42 = []", "positions = []") + "\n"


def test_scaffold_drafts_prefix_reference_and_no_leftovers(work):
    import port

    text = (work / "draft.toml").read_text()
    mapping = port.parse_mapping(text)
    # drafted, each with where it comes from: the key layout, config.json's architectures
    assert mapping.prefixes == ("model.decoder.",)
    assert 'prefixes = ["model.decoder."]   # key layout: 36 of 36 keys begin with it' in text
    assert mapping.reference == {"class": "transformers:OPTForCausalLM", "output": "logits"}
    assert "# config.json's architectures" in text
    assert "0 source keys unpaired (0 patterns), 0 leaves unfilled" in text and "TODO unpaired" not in text
    # the guesses the reader confirms: the two norms of a layer, the biases, the square weights
    by_path = {p.path: p for p in mapping.params}
    assert by_path["blocks.attn_norm.weight"].key == "layers.{layer}.self_attn_layer_norm.weight"
    assert by_path["blocks.mlp_norm.bias"].key == "layers.{layer}.final_layer_norm.bias"
    assert by_path["norm.weight"].key == "final_layer_norm.weight"
    assert by_path["blocks.bq"].key == "layers.{layer}.self_attn.q_proj.bias"
    assert by_path["blocks.wo"].key == "layers.{layer}.self_attn.out_proj.weight"
    assert by_path["blocks.wq"].transforms == by_path["blocks.wk"].transforms  # no transpose: torch's (out, in)
    assert by_path["pos"].axes == ("dim42", "embed")  # no config.json value is 42: the reader names it


def test_the_guides_edits_make_a_mapping_that_checks_verifies_and_exports(work):
    draft = (work / "draft.toml").read_text()
    edited = edit_as_the_guide_says(draft)
    # Only what the guide says changed: comment lines gone, dim42 renamed.
    for line in difflib.ndiff(draft.splitlines(), edited.splitlines()):
        if line.startswith("- "):
            assert line[2:].startswith("# CHECK") or "dim42" in line, line
        elif line.startswith("+ "):
            assert "positions" in line, line
    (work / "draft.toml").write_text(edited)

    result = run_port("check", "draft.toml", CHECKPOINT, "--mesh", "2x2", "--module", MODULE, cwd=work)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "draft.toml: ok: 20 leaves from opt-checkpoint" in result.stdout

    args = ["--mapping", "draft.toml", "--module", MODULE, "--mesh", "2x2"]
    result = run_port("verify", CHECKPOINT, *args, "--roundtrip", "--padding", "left", "--length", "24", cwd=work)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert re.search(
        r"vs OPTForCausalLM\.logits \(float32 \[2, 24, 97\], left-padded, max \|reference\| [\d.]+\) on mesh 2x2: ok",
        out,
    )
    assert "opt-checkpoint: round trip: 36 tensors exported back bit for bit: ok" in out

    result = run_port("convert", CHECKPOINT, *args, "--out", "opt-jax", cwd=work)
    assert result.returncode == 0, result.stderr
    result = run_port("export", "opt-jax", "--out", "opt-hf", "--module", MODULE, cwd=work)
    assert result.returncode == 0, result.stderr
    from safetensors.numpy import load_file

    original, exported = (
        load_file(work / CHECKPOINT / "model.safetensors"),
        load_file(work / "opt-hf" / "model.safetensors"),
    )
    assert sorted(exported) == sorted(original)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key


def test_check_suggests_the_prefix_a_mapping_lacks(work, monkeypatch):
    """Issue 24 row 5: keys no entry matches until a prefix is stripped: check says which prefix."""
    import port

    text = edit_as_the_guide_says((work / "draft.toml").read_text())
    (work / "none.toml").write_text(re.sub(r"^prefixes = .*\n", "", text, flags=re.M))
    result = run_port("check", "none.toml", CHECKPOINT, "--module", MODULE, cwd=work)
    one_line(result, "none.toml: 57 problems")  # the hint, 20 entries matching nothing, 36 keys unused
    assert result.stdout.splitlines()[0] == (
        "none.toml: 36 keys begin with 'model.decoder.' and match entries without it: "
        'add prefixes = ["model.decoder."]?'
    )
    # A prefix the mapping has, too short: the longer one is suggested first in the list.
    (work / "short.toml").write_text(re.sub(r"^prefixes = .*$", 'prefixes = ["model."]', text, flags=re.M))
    monkeypatch.syspath_prepend(str(work))  # what --module does for the command line
    with pytest.raises(port.PlanError) as caught:
        port.check(work / "short.toml", work / CHECKPOINT)
    assert caught.value.problems[0].endswith(
        "36 keys begin with 'model.decoder.' and match entries without it: "
        'add prefixes = ["model.decoder.", "model."]?'
    )
