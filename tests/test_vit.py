"""ViT: port's image encoder, converted by the shipped `mappings/vit.toml`, against `transformers` ViTModel.

Parity goes through the converter: a `ViTModel` (or `ViTForImageClassification`, keys
under `vit.` and a `classifier` head) written by `save_pretrained`, loaded by `port`
onto a mesh, gives the same last hidden state and pooled output on the same pixels.
Small awkward configs: 3 heads of 16 (the `model` axis of 2 cannot split them), 1, 3
and 4 channels, a 16 x 18 image whose last 2 columns no 4 x 4 patch covers, no q/k/v
biases. `port verify` draws pixel values for it; `port export` writes back what
`ViTModel.from_pretrained` loads bit for bit; `port plan` sizes ViT-B/16 reading no
tensor byte. The tests that build a `transformers` model skip without PyTorch.
"""

import json
import math
import operator
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import port
from port._errors import ConfigError
from port.authoring._verify import input_kind, pixel_values
from port.models.bert import Bert
from port.models.vit import ViT, ViTConfig

from helpers import hooked, perturbed, run_port, transformers_or_skip, write_sparse_checkpoint

CONFIG = dict(
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=3,
    intermediate_size=80,
    image_size=16,
    patch_size=4,
)

# name: (the transformers class that writes the checkpoint, config overrides)
CASES = {
    "rgb": ("ViTModel", {}),  # bare keys, pooler, exact gelu
    "four-channel": (
        "ViTModel",
        dict(  # no q/k/v biases; 16 x 18 pixels: 2 columns cropped
            num_channels=4,
            image_size=[16, 18],
            qkv_bias=False,
            layer_norm_eps=1e-5,
            hidden_act="gelu_new",
            pooler_output_size=20,
            pooler_act="relu",
        ),
    ),
    "grey-classifier": ("ViTForImageClassification", dict(num_channels=1, num_labels=5)),  # vit. keys
}
PARITY = [("rgb", "1x1"), ("rgb", "4x2"), ("rgb", "8x1"), ("four-channel", "4x2"), ("grey-classifier", "8x1")]


def pixels_for(config: dict) -> np.ndarray:
    return pixel_values({**CONFIG, **config}, batch=2, seed=1)


def torch_vit(class_name: str, **overrides):
    """A seeded transformers ViT of the small config, norms and biases perturbed; skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    config = transformers.ViTConfig(**{**CONFIG, **overrides}, initializer_range=0.2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return perturbed(
        getattr(transformers, class_name)(config), lambda name: "layernorm" in name or name.endswith("bias"), 0.3
    )


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """get(case): the case's checkpoint directory, its pixels and transformers' (hidden, pooled or None)."""
    made = {}

    def get(case):
        if case not in made:
            import torch

            class_name, overrides = CASES[case]
            model = torch_vit(class_name, **overrides)
            directory = tmp_path_factory.mktemp(case)
            model.save_pretrained(directory)
            pixels = pixels_for(overrides)
            with torch.no_grad():
                out = getattr(model, "vit", model)(torch.from_numpy(pixels))
            pooled = None if out.pooler_output is None else out.pooler_output.numpy()
            made[case] = directory, pixels, (out.last_hidden_state.numpy(), pooled)
        return made[case]

    return get


@pytest.fixture(scope="module")
def loaded(twins):
    """get(case, mesh): port.load of the case's checkpoint onto the mesh (one load each)."""
    made = {}

    def get(case, mesh):
        if (case, mesh) not in made:
            made[case, mesh] = port.load(twins(case)[0], mesh=port.make_mesh(mesh))
        return made[case, mesh]

    return get


run = eqx.filter_jit(lambda model, pixels: model(pixels))


def expected_specs(mesh: str) -> dict[str, P]:
    """Heads and the MLP on `model`, embed on `data`; 3 heads do not split over a `model` axis of 2."""
    heads = None if mesh == "4x2" else "model"
    return {
        "patch_weight": P("data", None, None, None),
        "patch_bias": P("data"),
        "cls_token": P("data"),
        "position_embeddings": P(None, "data"),
        "layers.attn_norm.weight": P(None, "data"),
        "layers.attn.wq": P(None, heads, None, "data"),
        "layers.attn.wo": P(None, "data", heads, None),
        "layers.mlp.up": P(None, "model", "data"),
        "layers.mlp.bup": P(None, "model"),
        "layers.mlp.down": P(None, "data", "model"),
        "norm.bias": P("data"),
    }


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("case, mesh", PARITY)
def test_hidden_states_match_transformers(twins, loaded, case, mesh):
    directory, pixels, (hidden, pooled) = twins(case)
    ours = loaded(case, mesh)
    ours_hidden = run(ours, pixels)
    assert ours_hidden.shape == hidden.shape == (2, 17, 48)
    assert np.abs(np.asarray(ours_hidden) - hidden).max() <= 1e-4
    if pooled is None:  # ViTForImageClassification saves no pooler
        assert ours.pooler.weight is None and ours.pooler.bias is None
        with pytest.raises(ValueError, match="no pooler"):
            ours.pooled(ours_hidden)
    else:
        ours_pooled = ours.pooled(ours_hidden)
        assert ours_pooled.shape == pooled.shape
        assert np.abs(np.asarray(ours_pooled) - pooled).max() <= 1e-4
    for path, spec in expected_specs(mesh).items():
        assert operator.attrgetter(path)(ours).sharding.spec == spec, path
    if not CASES[case][1].get("qkv_bias", True):
        assert ours.layers.attn.bq is None and ours.layers.attn.bv is None


def test_unbatched_pixels_give_the_batch_of_one(twins, loaded):
    _, pixels, (hidden, _) = twins("rgb")
    ours = loaded("rgb", "1x1")
    unbatched = run(ours, pixels[1])
    assert unbatched.shape == (17, 48)
    np.testing.assert_allclose(np.asarray(unbatched), np.asarray(run(ours, pixels))[1], rtol=0, atol=1e-5)
    assert np.abs(np.asarray(unbatched) - hidden[1]).max() <= 1e-4


def test_plan_of_a_classifier_checkpoint(twins):
    """`vit.` keys found through the prefix, the classifier ignored, the absent pooler None, and the
    plan says why the heads are not split."""
    directory, _, _ = twins("grey-classifier")
    with port.open_checkpoint(directory) as ckpt:
        assert all(k.startswith(("vit.", "classifier.")) for k in ckpt.tensors)
        mapping = port.mapping_for(ckpt.config)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2}
        )
        assert ckpt.bytes_read == 0
    assert sorted(recipe.ignored) == ["classifier.bias", "classifier.weight"]
    assert recipe.empty == ("pooler.weight", "pooler.bias")
    leaf = {leaf.path: leaf for leaf in recipe.leaves}["layers.attn.wq"]
    assert leaf.keys == tuple(f"vit.encoder.layer.{i}.attention.attention.query.weight" for i in range(2))
    assert any("heads 3 not divisible by model=2" in note for note in leaf.notes)


# ---------------------------------------------------------------- port verify and port export


@pytest.mark.slow
def test_verify_draws_pixel_values(twins):
    """Through the command line: the model class says it takes pixel values, verify draws 4 x 16 x 18."""
    directory, _, _ = twins("four-channel")
    result = run_port("verify", directory, "--mesh", "4x2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "vs ViTModel.last_hidden_state (float32 [2, 17, 48]" in output and ": ok (tolerance" in output
    assert float(output.split("max abs difference ")[1].split()[0]) <= 1e-4


@pytest.mark.parametrize("case", ["rgb", "grey-classifier"])
def test_verify_in_bfloat16_allows_for_the_references_own_rounding(twins, case):
    """In 16 bits port's run and the reference's each round: verify measures the reference's own
    error against float32 and allows twice it (the 2e-2 relative bound alone refused ViT at 0.078)."""
    directory, _, _ = twins(case)
    result = port.verify(directory, "4x2", dtype="bfloat16")
    assert result.dtype == "bfloat16" and result.reference_error is not None and result.reference_error > 0
    assert result.tolerance == max(2e-2 * max(1.0, result.max_abs_reference), 2 * result.reference_error)
    assert result.max_abs_diff <= result.tolerance, (result.max_abs_diff, result.reference_error)
    assert port.verify(directory, "1x1").reference_error is None  # float32: the reference is exact


@pytest.mark.slow
def test_verify_in_bfloat16_through_the_command_line(twins):
    """The installed `port verify --dtype bfloat16` exits 0 and shows the reference's own rounding."""
    directory, _, _ = twins("grey-classifier")
    result = run_port("verify", directory, "--dtype", "bfloat16")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output
    found = re.search(
        r"the reference's own bfloat16 error ([\d.e-]+)\) on mesh 1x1: ok \(tolerance ([\d.e-]+)\)", output
    )
    assert found, output
    assert float(found[2]) >= 2 * float(found[1]) * 0.999  # printed to 3 figures


def test_verify_inputs_follow_the_model_class():
    assert input_kind(ViT) == "pixel_values" and input_kind(Bert) == "input_ids"
    drawn = pixel_values({"image_size": [16, 18], "num_channels": 4})
    assert drawn.shape == (2, 4, 16, 18) and drawn.dtype == np.float32
    assert pixel_values({}).shape == (2, 3, 224, 224)  # ViTConfig's defaults
    with pytest.raises(ConfigError, match="image_size"):
        pixel_values({"image_size": [16]})


@pytest.mark.parametrize("case", ["rgb", "four-channel"])
def test_export_round_trip(twins, loaded, case, tmp_path):
    """port.load on 4x2 -> port.export -> ViTModel.from_pretrained: no missing or unexpected key,
    every tensor bit for bit the original's."""
    import torch
    from safetensors import safe_open

    transformers = transformers_or_skip()
    directory, _, _ = twins(case)
    out = port.export(loaded(case, "4x2"), tmp_path / "hf", directory).out
    original = transformers.ViTModel.from_pretrained(directory)
    exported, info = transformers.ViTModel.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    theirs, ours = original.state_dict(), exported.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in theirs)
    with safe_open(directory / "model.safetensors", "np") as src, safe_open(out / "model.safetensors", "np") as dst:
        assert set(src.keys()) == set(dst.keys())
        assert all(np.array_equal(src.get_tensor(k), dst.get_tensor(k)) for k in src.keys())


# ---------------------------------------------------------------- full size: ViT-B/16, planned


VIT_B16 = {  # google/vit-base-patch16-224-in21k config.json
    "architectures": ["ViTModel"],
    "attention_probs_dropout_prob": 0.0,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.0,
    "hidden_size": 768,
    "image_size": 224,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
    "model_type": "vit",
    "num_attention_heads": 12,
    "num_channels": 3,
    "num_hidden_layers": 12,
    "patch_size": 16,
    "qkv_bias": True,
}

# On the `port` process's PYTHONPATH: records the offset of every read of tensor bytes
# (port._sources._local._preadv, the one place they come from) into $READS_FILE at exit.
READ_RECORDER = """
import atexit, json, os
import port._sources._local as source

reads, real = [], source._preadv

def _preadv(fd, iov, offset):
    reads.append(offset)
    return real(fd, iov, offset)

source._preadv = _preadv
atexit.register(lambda: open(os.environ["READS_FILE"], "w").write(json.dumps(reads)))
"""


def vit_b16_shapes() -> dict[str, list[int]]:
    """Every tensor of a ViTModel (pooler included) of ViT-B/16's sizes, bare keys."""
    E, I, C, p, n = 768, 3072, 3, 16, 1 + (224 // 16) ** 2
    shapes = {
        "embeddings.cls_token": [1, 1, E],
        "embeddings.position_embeddings": [1, n, E],
        "embeddings.patch_embeddings.projection.weight": [E, C, p, p],
        "embeddings.patch_embeddings.projection.bias": [E],
        "layernorm.weight": [E],
        "layernorm.bias": [E],
        "pooler.dense.weight": [E, E],
        "pooler.dense.bias": [E],
    }
    for layer in range(12):
        prefix = f"encoder.layer.{layer}."
        for name in ("layernorm_before", "layernorm_after", "attention.output.dense", "output.dense"):
            shapes[f"{prefix}{name}.bias"] = [E]
        for name in ("layernorm_before", "layernorm_after"):
            shapes[f"{prefix}{name}.weight"] = [E]
        for name in ("query", "key", "value"):
            shapes[f"{prefix}attention.attention.{name}.weight"] = [E, E]
            shapes[f"{prefix}attention.attention.{name}.bias"] = [E]
        shapes[f"{prefix}attention.output.dense.weight"] = [E, E]
        shapes[f"{prefix}intermediate.dense.weight"] = [I, E]
        shapes[f"{prefix}intermediate.dense.bias"] = [I]
        shapes[f"{prefix}output.dense.weight"] = [E, I]
    return shapes


@pytest.mark.slow
def test_plan_full_size_vit_b16(tmp_path):
    """`port plan --mesh 4x2` on ViT-B/16's real sizes: exit 0, the bytes per device the shardings give
    (matrices 8 ways, q/k/v and MLP biases on model, the rest on data, the pooler bias whole), no read."""
    shapes = vit_b16_shapes()
    write_sparse_checkpoint(tmp_path / "vit-b16", VIT_B16, dict(sorted(shapes.items())), dtype="F32")
    env = hooked(tmp_path / "recorder", READ_RECORDER) | {"READS_FILE": str(tmp_path / "reads.json")}
    result = run_port("plan", tmp_path / "vit-b16", "--mesh", "4x2", env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output

    def share(key):
        if key == "pooler.dense.bias":
            return 1
        if len(shapes[key]) == 2 and key.endswith("weight") and not key.startswith("pooler"):
            return 1 / 8
        if key.endswith(("query.bias", "key.bias", "value.bias", "intermediate.dense.bias")):
            return 1 / 2
        return 1 / 4

    params = sum(math.prod(shape) for shape in shapes.values())
    per_device = sum(4 * math.prod(shape) * share(key) for key, shape in shapes.items())
    summary = output.strip().splitlines()[-1]
    found = re.fullmatch(r"([\d.]+)M params in 24 leaves; ([\d.]+) MB to read, ([\d.]+) MB per device", summary)
    assert found, summary
    assert float(found[1]) == round(params / 1e6, 1)
    assert float(found[2]) == round(4 * params / 1e6, 1)
    assert float(found[3]) == round(per_device / 1e6, 1)
    assert re.search(r"layers\.attn\.wq\s+f32\[12,12,64,768\]\s+\(-, model, -, data\)", output)
    assert re.search(r"patch_weight\s+f32\[768,3,16,16\]\s+\(data, -, -, -\)", output)
    assert json.loads((tmp_path / "reads.json").read_text()) == []  # the recorder ran, and saw no read


# ---------------------------------------------------------------- the module, its config and its inputs


@pytest.fixture(scope="module")
def random_vit():
    """A 16 x 12 ViT of zeros (the checks read shapes only; no init, no PyTorch)."""
    shapes = eqx.filter_eval_shape(ViT.from_config, {**CONFIG, "image_size": [16, 12]}, key=jax.random.key(0))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def test_field_shapes():
    model = eqx.filter_eval_shape(
        ViT.from_config, {**CONFIG, "num_channels": 4, "image_size": [16, 18]}, key=jax.random.key(0)
    )
    assert model.patch_weight.shape == (48, 4, 4, 4)
    assert model.cls_token.shape == model.patch_bias.shape == model.norm.weight.shape == (48,)
    assert model.position_embeddings.shape == (17, 48)  # 4 x 4 patches: 18 // 4 == 4
    assert model.layers.attn.wq.shape == (2, 3, 16, 48)
    assert model.layers.attn.bq.shape == (2, 3, 16)
    assert model.layers.attn.wo.shape == (2, 48, 3, 16)
    assert model.layers.mlp.up.shape == (2, 80, 48)
    assert model.pooler.weight.shape == (48, 48)
    assert model.config.layer_norm_eps == 1e-12 and model.config.hidden_act == "gelu"
    no_bias = eqx.filter_eval_shape(ViT.from_config, {**CONFIG, "qkv_bias": False}, key=jax.random.key(0))
    assert no_bias.layers.attn.bq is None and no_bias.layers.attn.bk is None and no_bias.layers.attn.bv is None


@pytest.mark.parametrize(
    "shape, dtype, error, match",
    [
        ((2, 3, 16, 16), jnp.float32, ValueError, r"image of 16x16 pixels, but config.json's image_size is 16x12"),
        ((2, 4, 16, 12), jnp.float32, ValueError, r"has 4 channels .*num_channels is 3"),
        ((2, 1, 3, 16, 12), jnp.float32, ValueError, r"must have shape \(batch, channels, height, width\)"),
        ((16, 12), jnp.float32, ValueError, r"or \(channels, height, width\), got \(16, 12\)"),
        ((2, 3, 16, 12), jnp.int32, TypeError, "must have a floating dtype, got int32"),
    ],
)
def test_bad_pixels_are_one_line(random_vit, shape, dtype, error, match):
    for call in (random_vit, run):  # eager and under filter_jit
        with pytest.raises(error, match=match) as caught:
            call(*((jnp.zeros(shape, dtype),) if call is random_vit else (random_vit, jnp.zeros(shape, dtype))))
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden_size=50), "'hidden_size' \\(50\\) must be divisible by 'num_attention_heads' \\(3\\)"),
        (dict(image_size=[16, 2]), "'image_size' \\[16, 2\\] is smaller than 'patch_size' \\[4, 4\\]"),
        (dict(image_size=[16, 16, 3]), "'image_size' must be a positive integer or a list of two"),
        (dict(patch_size=0), "'patch_size' must be a positive integer"),
        (dict(hidden_act="mish"), "'hidden_act'"),
        (dict(pooler_act="mish"), "'pooler_act'"),
        (dict(qkv_bias="yes"), "'qkv_bias' must be a boolean"),
    ],
)
def test_config_rejects_unsupported(change, match):
    with pytest.raises(ConfigError, match=match) as caught:
        ViTConfig.from_hf({**CONFIG, **change})
    assert "\n" not in str(caught.value)


def test_head_dim_from_config():
    """transformers reads an explicit `head_dim` (heads x head_dim need not be hidden_size)."""
    config = ViTConfig.from_hf({**CONFIG, "hidden_size": 50, "head_dim": 8})
    assert config.head_dim == 8 and config.num_positions == 17


def test_a_classifiers_backbone_exports_as_the_backbone(twins, loaded, tmp_path):
    """A `ViTForImageClassification` checkpoint loads as the backbone (its head ignored), and
    exports as what the module holds: config.json says `ViTModel`, the tensors are the
    backbone's, bit for bit, under the checkpoint's own `vit.` names."""
    from safetensors.numpy import load_file

    directory, _, _ = twins("grey-classifier")
    out = port.export(loaded("grey-classifier", "1x1"), tmp_path / "hf", directory).out
    assert json.loads((out / "config.json").read_text())["architectures"] == ["ViTModel"]
    source, written = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(written) == {k for k in source if not k.startswith("classifier.")}
    assert all(np.array_equal(written[k], source[k]) for k in written)
