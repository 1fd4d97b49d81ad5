"""Issue 24 row 6: scaffold names axes and reshape sizes from any integer of config.json, and
warns where two fields share a size.

The module is a reader's own, written to a file (as `port scaffold --module` finds it);
its sizes all come from config.json: the hidden size, heads, the positions, T5's
`relative_attention_num_buckets` (port's `buckets` axis), and a codebook table sized by
two keys port has never heard of (no axis of port's vocabulary).
"""

import importlib
import re
import textwrap

import numpy as np
import pytest

import port
from port._transforms import Reshape
from port.authoring import check, scaffold
from port.authoring._axes import config_dims, shared

from helpers import confirm_checks, run_port, write_checkpoint

MODULE = textwrap.dedent(
    '''
    """A reader's module: every size from config.json."""

    import equinox as eqx
    import jax
    import jax.numpy as jnp


    class Net(eqx.Module):
        embed: jax.Array  # [vocab, embed]
        pos: jax.Array  # [positions, embed]
        wq: jax.Array  # [heads, head_dim, embed]: torch q_proj [heads * head_dim, embed]
        relative_bias: jax.Array  # [buckets, heads]
        codebook: jax.Array  # [codebooks, codebook_dim, embed]: torch [codebooks * codebook_dim, embed]

        def __init__(self, config):
            e, h = config["hidden_size"], config["num_attention_heads"]
            self.embed = jnp.zeros((config["vocab_size"], e))
            self.pos = jnp.zeros((config["max_position_embeddings"], e))
            self.wq = jnp.zeros((h, config.get("head_dim", e // h), e))
            self.relative_bias = jnp.zeros((config["relative_attention_num_buckets"], h))
            self.codebook = jnp.zeros((config.get("num_codebooks", 3), config.get("codebook_dim", 5), e))

        @classmethod
        def from_config(cls, config, *, key):
            return cls(config)
    '''
)

# Hidden size 64 = positions 64: the case. 4 = heads = layers and 3 = codebooks =
# eos_token_id share sizes too, but a layer count sizes only a stack and a token id nothing.
SHARED = {
    "model_type": "net",
    "vocab_size": 10,
    "hidden_size": 64,
    "max_position_embeddings": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "relative_attention_num_buckets": 8,
    "num_codebooks": 3,
    "codebook_dim": 5,
    "eos_token_id": 3,
}
# The same family with distinct sizes, as the guide tells authors to make test configs.
DISTINCT = SHARED | {"hidden_size": 12, "max_position_embeddings": 20, "num_attention_heads": 2, "head_dim": 7}
WARNING = (
    "# sizes shared by several config.json fields: 64 = hidden_size, max_position_embeddings: the axes of "
    "leaves with a 64 dimension were chosen by name; check them (the entries marked CHECK), or make a test "
    "config with distinct sizes"
)
UNNAMED_NOTE = (
    "# axis 0 of [3, 5, {e}] is config.json's num_codebooks (3), no axis of port's vocabulary "
    '(port.nn.AXES): left unnamed (""), so replicated'
)


def tensors(config, seed=0):
    rng = np.random.default_rng(seed)
    e, h = config["hidden_size"], config["num_attention_heads"]
    hd = config.get("head_dim", e // h)
    c, k = config.get("num_codebooks", 3), config.get("codebook_dim", 5)
    shapes = {
        "embed_tokens.weight": (config["vocab_size"], e),
        "position_embeddings.weight": (config["max_position_embeddings"], e),
        "attn.q_proj.weight": (h * hd, e),
        "attn.relative_attention_bias.weight": (config["relative_attention_num_buckets"], h),
        "codebook.weight": (c * k, e),
    }
    return {key: rng.standard_normal(shape).astype(np.float32) for key, shape in shapes.items()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A directory holding the reader's module `reader_net.py` (on sys.path) and a checkpoint per config."""
    root = tmp_path_factory.mktemp("axes")
    (root / "reader_net.py").write_text(MODULE)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        for name, config in [("shared", SHARED), ("distinct", DISTINCT)]:
            write_checkpoint(root / name, tensors(config), config)
        yield root


def reader_class():
    """The reader's `reader_net:Net`, imported from the `work` directory (on sys.path)."""
    return importlib.import_module("reader_net").Net


def draft_of(work, name):
    Net = reader_class()

    return scaffold(work / name, Net, "reader_net:Net")


def entry_block(text, path):
    """The lines of the draft's entry for `path`, with the comments above it."""
    blocks = re.split(r"\n\n", text)
    (block,) = [b for b in blocks if f'path = "{path}"' in b and "[[params]]" in b]
    return block


def test_shared_sizes_are_warned_of_and_each_guess_is_a_check(work, tmp_path):
    text = draft_of(work, "shared")
    mapping = port.parse_mapping(text, "draft.toml")
    by_path = {p.path: p for p in mapping.params}
    # Chosen by name: the position table's 64 is positions, every other 64 embed.
    assert by_path["pos"].axes == ("positions", "embed")
    assert by_path["embed"].axes == ("vocab", "embed")
    assert by_path["wq"].axes == ("heads", "head_dim", "embed")
    # Reshape sizes by the dimension's axis, not the number: no `[4, 16, 64]`.
    assert by_path["wq"].transforms == (Reshape(("num_attention_heads", -1, "hidden_size")),)
    assert by_path["codebook"].transforms == (Reshape(("num_codebooks", "codebook_dim", "hidden_size")),)
    # The header lists the one size two fields give to different axes.
    assert [line for line in text.splitlines() if line.startswith("# sizes shared")] == [WARNING]
    for axis, chosen in enumerate(["positions", "embed"]):
        assert (
            f"# CHECK: axis {axis} of [64, 64] is 64, which several config.json fields give (hidden_size, "
            f"max_position_embeddings): {chosen} chosen by the leaf's name"
        ) in entry_block(text, "pos")
    # A position table is named so: the other 64-wide leaves are no doubt (nor Llama-2's 4096-wide ones).
    for path in ("embed", "wq", "codebook"):
        assert "# CHECK: axis" not in entry_block(text, path), path
    assert "# CHECK" not in entry_block(text, "relative_bias")  # 8, and 4 only a layer count besides

    # Each CHECK is a `port check` problem until the author deletes it; then it passes.
    draft = tmp_path / "draft.toml"
    draft.write_text(text)
    problems = confirm_checks(draft, work / "shared")
    assert len(problems) == text.count("# CHECK") == 4  # pos's two axes; pos's and wq's orientation (square)
    assert check(draft, work / "shared").params == 10 * 64 + 64 * 64 * 2 + 8 * 4 + 15 * 64


def test_any_config_integer_names_an_axis_and_a_reshape_size(work):
    text = draft_of(work, "distinct")
    assert "# sizes shared" not in text and "# CHECK" not in text and "# TODO" not in text
    mapping = port.parse_mapping(text, "draft.toml")
    by_path = {p.path: p for p in mapping.params}
    # relative_attention_num_buckets is T5's `buckets`; the codebook's sizes are no axis port
    # knows: unnamed (replicated), each key in a comment.
    assert by_path["relative_bias"].axes == ("buckets", "heads")
    assert UNNAMED_NOTE.format(e=12) in entry_block(text, "codebook")
    assert by_path["codebook"].axes == (None, None, "embed")
    assert by_path["codebook"].transforms == (Reshape(("num_codebooks", "codebook_dim", "hidden_size")),)
    assert by_path["wq"].transforms == (Reshape(("num_attention_heads", "head_dim", "hidden_size")),)
    assert "" not in mapping.rules
    assert set(mapping.rules) == {"embed", "heads", "head_dim", "positions", "vocab", "buckets"}

    # The draft passes check unedited and converts: each leaf the checkpoint's tensor, reshaped.
    Net = reader_class()

    checkpoint = work / "distinct"
    check(port.parse_mapping(text, "draft.toml"), checkpoint, mesh="2x1")
    model = port.convert(checkpoint, port.skeleton(Net, DISTINCT), mapping, port.make_mesh("1x1")).model
    source = tensors(DISTINCT)
    np.testing.assert_array_equal(np.asarray(model.relative_bias), source["attn.relative_attention_bias.weight"])
    np.testing.assert_array_equal(np.asarray(model.codebook), source["codebook.weight"].reshape(3, 5, 12))
    np.testing.assert_array_equal(np.asarray(model.wq), source["attn.q_proj.weight"].reshape(2, 7, 12))
    np.testing.assert_array_equal(np.asarray(model.pos), source["position_embeddings.weight"])


def test_a_size_no_config_integer_gives_stays_a_number_with_a_check(tmp_path, work):
    """Without `num_codebooks` and `codebook_dim` (the module's defaults, 3 and 5), the codebook
    reshape keeps two numbers, each a CHECK: the mapping serves those sizes only."""
    Net = reader_class()

    config = {k: v for k, v in DISTINCT.items() if k not in ("num_codebooks", "codebook_dim", "eos_token_id")}
    text = scaffold(write_checkpoint(tmp_path / "ckpt", tensors(config), config), Net, "reader_net:Net")
    codes = entry_block(text, "codebook")
    assert 'transforms = [{ reshape = [3, 5, "hidden_size"] }]' in codes
    assert 'axes = ["dim3", "dim5", "embed"]' in codes
    for size in (3, 5):
        assert f"# CHECK: reshape size {size} is written as a number: no config.json integer alone gives it" in codes
        assert f"# TODO: name this axis: dim{size}" in codes


def test_the_fields_a_size_is_shared_by():
    dims = config_dims(
        {
            "hidden_size": 64,
            "n_embd": 64,  # the same axis under two names: no doubt
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,  # a layer count sizes a stack, never a leaf's own dimension
            "max_positions": 32,  # TinyLM's own name: its words say positions
            "num_buckets": 32,
            "pad_token_id": 32,  # a token id is no size
            "text_config": {"vocab_size": 100, "intermediate_size": 100},
        }
    )
    assert shared(64, dims) == [] and shared(2, dims) == []
    llama2 = config_dims({"hidden_size": 4096, "max_position_embeddings": 4096, "num_attention_heads": 32})
    assert shared(4096, llama2, "layers.{layer}.self_attn.q_proj.weight") == []  # no position table
    assert shared(4096, llama2, "wpe") == ["hidden_size", "max_position_embeddings"]
    assert dims[32] == [("positions", "max_positions"), ("", "num_buckets")]
    assert shared(32, dims) == ["max_positions", "num_buckets"]
    assert shared(100, dims) == ["text_config.vocab_size", "text_config.intermediate_size"]
    # A refined head size (port.nn.REFINED) is a head_dim, Llama 4's dense MLP an mlp; a top-k, a
    # window, a step or a scale is no parameter's size.
    other = config_dims(
        {
            "v_head_dim": 10,
            "intermediate_size_mlp": 64,
            "num_experts_per_tok": 5,
            "sliding_window": 5,
            "interleave_moe_layer_step": 5,
            "floor_scale": 5,
        }
    )
    assert other == {10: [("head_dim", "v_head_dim")], 64: [("mlp", "intermediate_size_mlp")]}


@pytest.mark.slow
def test_port_check_refuses_the_shared_size_guesses(work, tmp_path):
    """Through the command line: the draft warns, and `port check` lists each guess as a problem."""
    draft = tmp_path / "draft.toml"
    made = run_port("scaffold", work / "shared", "--module", "reader_net:Net", "--out", draft, cwd=work)
    assert made.returncode == 0, made.stderr
    assert WARNING in draft.read_text()
    refused = run_port("check", draft, work / "shared", "--module", "reader_net:Net", cwd=work)
    n = draft.read_text().count("# CHECK")
    assert refused.returncode == 1 and f"port: error: {draft}: {n} problems with" in refused.stderr, refused.stderr
    guesses = draft.read_text().count("# CHECK: axis")
    assert guesses == 2  # pos [64, 64]: both axes
    assert refused.stdout.count("a CHECK of port scaffold's is still there (CHECK: axis") == guesses
