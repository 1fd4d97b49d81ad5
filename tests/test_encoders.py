"""The contract every encoder family meets, against `transformers` on the same inputs.

For each family (a small seeded `*Model`, saved by `save_pretrained`, loaded by
`port.load` through its shipped mapping): the last hidden state for a batch padded on
the right and on the left, with token types where the family has them, equal to
transformers' on meshes 1x1 and 4x2; bfloat16 compute as near the float32 result as
transformers' own bfloat16 model is; the gradient of a loss on the last hidden state (the
sum of squares over real tokens) equal to PyTorch's `backward()` for every parameter, by
its checkpoint name (through `port.export`); `port export` back to the checkpoint bit
for bit, read by `from_pretrained` with no key missing or left over.
"""

import copy

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import port

from helpers import perturbed, transformers_or_skip

VOCAB = 101
BERT = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=40,
    initializer_range=0.2,
)
ROBERTA = dict(BERT, type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-5)
DISTILBERT = dict(
    vocab_size=VOCAB, dim=48, n_layers=2, n_heads=4, hidden_dim=96, max_position_embeddings=40, initializer_range=0.2
)
# name: (transformers model class, config class, config, the padding id, whether it takes token types)
FAMILIES = {
    "bert": ("BertModel", "BertConfig", dict(BERT, hidden_act="gelu_new", layer_norm_eps=1e-3), 0, True),
    "roberta": ("RobertaModel", "RobertaConfig", ROBERTA, 1, True),
    "xlm-roberta": ("XLMRobertaModel", "XLMRobertaConfig", dict(ROBERTA, pad_token_id=3), 3, True),
    "distilbert": ("DistilBertModel", "DistilBertConfig", dict(DISTILBERT, activation="relu"), 0, False),
    "distilbert-sinusoidal": (
        "DistilBertModel",
        "DistilBertConfig",
        dict(DISTILBERT, sinusoidal_pos_embds=True),
        0,
        False,
    ),
    # ModernBERT: global, local, global (a window of 2 either side), a rotary base per layer type.
    "modernbert": (
        "ModernBertModel",
        "ModernBertConfig",
        dict(
            BERT,
            intermediate_size=80,
            num_hidden_layers=3,
            local_attention=4,
            global_attn_every_n_layers=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
            rope_parameters={"full_attention": {"rope_theta": 1000.0}, "sliding_attention": {"rope_theta": 50.0}},
        ),
        0,
        False,
    ),
}
NAMES = list(FAMILIES)


def batch(name):
    """Four sequences of 12: whole, right-padded, left-padded, one real token; padding is the
    family's padding id under a zero mask. Token types (None without them): 0 and 1 for BERT."""
    _, _, config, pad, typed = FAMILIES[name]
    rng = np.random.default_rng(0)
    ids = rng.integers(4, VOCAB, (4, 12))
    mask = np.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, :5] = 0
    mask[3, 1:] = 0
    ids = np.where(mask == 1, ids, pad)
    types = None
    if typed:
        types = rng.integers(0, config.get("type_vocab_size", 2), ids.shape)
    return ids, mask, types


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """name -> (the PyTorch model, its checkpoint directory), each built once."""
    made = {}

    def get(name):
        if name not in made:
            transformers = transformers_or_skip()
            import torch

            arch, config_class, config, _, _ = FAMILIES[name]
            config = getattr(transformers, config_class)(**config)
            config._attn_implementation = "eager"
            torch.manual_seed(0)
            model = perturbed(
                getattr(transformers, arch)(config), lambda n: "norm" in n.lower() or n.endswith("bias"), 0.3
            )
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            made[name] = model, directory
        return made[name]

    return get


def torch_hidden(model, ids, mask, types):
    import torch

    kwargs = {} if types is None else {"token_type_ids": torch.tensor(types)}
    with torch.no_grad():
        out = model(torch.tensor(ids), attention_mask=torch.tensor(mask), **kwargs).last_hidden_state
    return out.float().numpy()


@eqx.filter_jit
def hidden(model, ids, mask, types, dtype=None):
    kwargs = {} if types is None else {"token_type_ids": types}
    return model(ids, attention_mask=mask, dtype=dtype, **kwargs)


def real_squares(model, ids, mask, types):
    """The loss the gradients are taken of: the sum of squares of the real tokens' last hidden state."""
    return jnp.sum(jnp.where(mask[..., None] == 1, hidden(model, ids, mask, types) ** 2, 0.0))


@pytest.mark.parametrize("mesh_spec", ["1x1", "4x2"])
@pytest.mark.parametrize("name", NAMES)
def test_last_hidden_state_matches_transformers(family, name, mesh_spec):
    """Every position, padded ones included: transformers masks keys only, so a padded query
    still gets an output, which port reproduces."""
    model, directory = family(name)
    ids, mask, types = batch(name)
    ours = np.asarray(hidden(port.load(directory, mesh=port.make_mesh(mesh_spec)), ids, mask, types))
    theirs = torch_hidden(model, ids, mask, types)
    assert ours.shape == (4, 12, 48)
    assert np.abs(ours - theirs).max() < 1e-4


@pytest.mark.parametrize("mesh_spec", ["1x1", "4x2"])
@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_compute_within_transformers_own_error(family, name, mesh_spec):
    """dtype=bfloat16 on float32 parameters: bfloat16 states, off transformers' float32 ones by
    no more than 1.5 times what transformers' own bfloat16 model is, over the real tokens."""
    import torch

    model, directory = family(name)
    ids, mask, types = batch(name)
    half = hidden(port.load(directory, mesh=port.make_mesh(mesh_spec)), ids, mask, types, jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    real = mask == 1
    full = torch_hidden(model, ids, mask, types)[real]
    theirs = torch_hidden(copy.deepcopy(model).to(torch.bfloat16), ids, mask, types)[real]
    ours = np.asarray(half, np.float32)[real]
    assert np.abs(ours - full).max() <= 1.5 * np.abs(theirs - full).max()


@pytest.mark.parametrize("name", NAMES)
def test_gradients_match_pytorch(family, name, tmp_path):
    """jax.grad of the sum of squares of the real tokens' states equals PyTorch's backward for
    every parameter that gets one (the pooler gets none), by checkpoint name, within 1e-4 of its
    largest entry (and 1e-6 of the largest of all: the key bias's is zero but for rounding, as
    softmax cancels it)."""
    import torch

    model, directory = family(name)
    ids, mask, types = batch(name)
    model.zero_grad()
    kwargs = {} if types is None else {"token_type_ids": torch.tensor(types)}
    out = model(torch.tensor(ids), attention_mask=torch.tensor(mask), **kwargs).last_hidden_state
    loss = (out**2 * torch.tensor(mask)[..., None]).sum()
    loss.backward()
    ours = port.load(directory, mesh=port.make_mesh("1x1"))
    value, grads = eqx.filter_value_and_grad(real_squares)(ours, ids, mask, types)
    assert float(value) == pytest.approx(loss.item(), rel=1e-5)
    port.export(grads, tmp_path / "grads", directory)
    arch = FAMILIES[name][0]
    exported = getattr(transformers_or_skip(), arch).from_pretrained(tmp_path / "grads").state_dict()
    theirs = {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}
    assert theirs and set(theirs) <= set(exported)
    largest = max(np.abs(grad).max() for grad in theirs.values())
    for key, grad in theirs.items():
        np.testing.assert_allclose(
            exported[key].numpy(), grad, atol=1e-4 * np.abs(grad).max() + 1e-6 * largest, rtol=0, err_msg=key
        )


@pytest.mark.parametrize("name", NAMES)
def test_export_round_trip(family, name, tmp_path):
    """port.load on 4x2 -> port.export -> from_pretrained: the source file's tensors bit for bit,
    no key missing, unexpected or mismatched, the original model's state."""
    import torch

    model, directory = family(name)
    out = port.export(port.load(directory, mesh=port.make_mesh("4x2")), tmp_path / "hf", directory).out
    source, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == source.keys()
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key
    arch = FAMILIES[name][0]
    back, info = getattr(transformers_or_skip(), arch).from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    ours, theirs = back.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
