"""SigLIP and SigLIP 2: the text and vision towers and the dual models (`port.models.siglip`,
`port.models.siglip2`), against transformers.

Tiny random checkpoints written by `save_pretrained` (a `SiglipModel`, a head-less
`SiglipVisionModel`, a `Siglip2Model`), norms and biases perturbed,
the logit scale and bias SigLIP's own, eager attention. Each tower's last hidden state and pooled output (the text's
at its last token, over a padded batch with its mask; the vision's by the attention
pooling head) and the dual models' `logits_per_image` and features equal transformers' on
meshes 1x1 and 4x2; SigLIP 2 runs three NaFlex images of different spatial shapes in one
batch (padded, one grid upscaled along an axis), its position table resized exactly as
`F.interpolate(bilinear, antialias=True)`; bfloat16 compute is as near float32 as
transformers' own bfloat16 model; the gradients of the sigmoid loss equal PyTorch's per
parameter. A tower loads from the dual checkpoint (`mapping="siglip_vision"`) and exports
as the tower's class; every module's export round trips bit for bit; `port verify` runs a
tower and the dual model through the command line. The tests that build a `transformers`
model skip without PyTorch.
"""

from __future__ import annotations

import copy
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import port
from port._errors import ConfigError
from port._transforms import Reshape
from port.models.siglip import Siglip, SiglipVision, TextConfig, VisionConfig, sigmoid_loss
from port.models.siglip2 import Siglip2, Siglip2Vision, resize_positions
from port.models.siglip2 import VisionConfig as NaFlexConfig

from helpers import one_line, perturbed, run_port, transformers_or_skip

TEXT = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=8,
    projection_size=48,  # the vision tower's hidden size: the dual model's shared space
)
VISION = dict(
    hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4
)
NAFLEX = dict(
    hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, patch_size=4, num_patches=16
)
IDS = np.array([[5, 9, 13, 2, 7, 1, 1, 1], [3, 4, 11, 1, 1, 1, 1, 1], [8, 6, 5, 4, 3, 2, 21, 17]])
MASK = np.array([[1] * 5 + [0] * 3, [1] * 3 + [0] * 5, [1] * 8])
PIXELS = np.random.default_rng(1).standard_normal((3, 3, 16, 16)).astype(np.float32)
# SigLIP 2: 4 x 4 patches (the table's own grid), 2 x 7 (columns upscaled, 2 padding), 3 x 5 (1 padding)
SPATIAL = np.array([[4, 4], [2, 7], [3, 5]])
PATCH_MASK = (np.arange(16)[None] < SPATIAL.prod(-1)[:, None]).astype(np.int64)
PATCHES = np.random.default_rng(2).standard_normal((3, 16, 4 * 4 * 3)).astype(np.float32)

CASES = {
    "dual": ("SiglipModel", dict(text_config=TEXT, vision_config=VISION)),
    "headless-vision": ("SiglipVisionModel", {**VISION, "vision_use_head": False, "hidden_act": "gelu"}),
    "dual2": ("Siglip2Model", dict(text_config=TEXT, vision_config=NAFLEX)),
}


def torch_siglip(name: str):
    """A seeded transformers model of the case, norms, biases and logit scale/bias perturbed, eager attention."""
    transformers = transformers_or_skip()
    import torch

    class_name, arguments = CASES[name]
    config = getattr(transformers, class_name.replace("Model", "Config"))(**arguments)
    config._attn_implementation = "eager"
    for sub in ("text_config", "vision_config"):
        if hasattr(config, sub):
            getattr(config, sub)._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config)
    if hasattr(model, "logit_scale"):  # SigLIP's own initialisation (transformers' is 0 and 0)
        with torch.no_grad():
            model.logit_scale.fill_(np.log(10.0))
            model.logit_bias.fill_(-2.0)
    return perturbed(model, lambda n: ("norm" in n or "bias" in n or "probe" in n) and "logit" not in n, 0.3)


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """get(name): the case's transformers model and the directory it saved."""
    made = {}

    def get(name):
        if name not in made:
            model = torch_siglip(name)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            made[name] = model, directory
        return made[name]

    return get


@pytest.fixture(scope="module")
def loaded():
    """get(directory, mesh, mapping=None): port.load of it onto the mesh (one load each)."""
    made = {}

    def get(directory, mesh, mapping=None):
        if (directory, mesh, mapping) not in made:
            made[directory, mesh, mapping] = port.load(directory, mesh=port.make_mesh(mesh), mapping=mapping)
        return made[directory, mesh, mapping]

    return get


@eqx.filter_jit
def text_outputs(model, ids, mask):
    hidden = model(ids, mask)
    return hidden, model.pooled(hidden)


@eqx.filter_jit
def vision_outputs(model, pixels):
    hidden = model(pixels)
    return (hidden,) if model.head is None else (hidden, model.pooled(hidden))


@eqx.filter_jit
def naflex_outputs(model, patches, mask, spatial):
    hidden = model(patches, mask, spatial)
    return hidden, model.pooled(hidden, mask)


@eqx.filter_jit
def dual_outputs(model, dtype=None):
    logits = model(IDS, PIXELS, attention_mask=MASK, dtype=dtype)
    return logits, model.text_features(IDS, MASK, dtype=dtype), model.image_features(PIXELS, dtype=dtype)


@eqx.filter_jit
def dual2_outputs(model, dtype=None):
    images = (PATCHES, PATCH_MASK, SPATIAL)
    logits = model(IDS, *images, attention_mask=MASK, dtype=dtype)
    return logits, model.text_features(IDS, MASK, dtype=dtype), model.image_features(*images, dtype=dtype)


def torch_run(model, **inputs):
    import torch

    given = {k: torch.tensor(v) for k, v in inputs.items()}
    if "pixel_values" in given:
        given["pixel_values"] = given["pixel_values"].to(model.dtype)
    with torch.no_grad():
        return model(**given)


def pooled_pair(out) -> tuple[np.ndarray, ...]:
    hidden = out.last_hidden_state.float().numpy()
    return (hidden,) if out.pooler_output is None else (hidden, out.pooler_output.float().numpy())


def torch_dual(model):
    """transformers' logits_per_image, get_text_features and get_image_features."""
    images = dict(pixel_values=PIXELS)
    if "Siglip2" in type(model).__name__:
        images = dict(pixel_values=PATCHES, pixel_attention_mask=PATCH_MASK, spatial_shapes=SPATIAL)
    logits = torch_run(model, input_ids=IDS, attention_mask=MASK, **images).logits_per_image
    import torch

    given = {k: torch.tensor(v) for k, v in images.items()}
    given["pixel_values"] = given["pixel_values"].to(model.dtype)
    with torch.no_grad():
        texts = model.get_text_features(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK)).pooler_output
        pooled = model.get_image_features(**given).pooler_output
    return tuple(x.float().numpy() for x in (logits, texts, pooled))


def largest_error(ours, theirs) -> float:
    assert len(ours) == len(theirs)
    return max(float(np.abs(np.asarray(a, np.float32) - b).max()) for a, b in zip(ours, theirs, strict=True))


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
def test_text_tower_matches_transformers(twins, loaded, mesh):
    """The dual checkpoint's text tower (`mapping="siglip_text"`) over a padded batch with its mask:
    the last hidden state and the pooled output (the last token's, through the head)."""
    model, directory = twins("dual")
    text = loaded(directory, mesh, "siglip_text")
    ours = text_outputs(text, IDS, MASK)
    assert [o.shape for o in ours] == [(3, 8, 32), (3, 48)]
    theirs = pooled_pair(torch_run(model.text_model, input_ids=IDS, attention_mask=MASK))
    assert largest_error(ours, theirs) <= 1e-4
    if mesh == "1x1":  # one sequence without the batch axis is the batch of one
        alone = text_outputs(text, IDS[1], MASK[1])
        assert [o.shape for o in alone] == [(8, 32), (48,)]
        assert largest_error(alone, [o[1] for o in theirs]) <= 1e-4


@pytest.mark.parametrize("name, mesh", [("dual", "4x2"), ("headless-vision", "4x2")])
def test_vision_tower_matches_transformers(twins, loaded, name, mesh):
    """The dual checkpoint's vision tower (`vision_model.` keys) with its attention pooling head,
    and a `SiglipVisionModel` of bare keys built without one (exact GELU)."""
    model, directory = twins(name)
    ours = loaded(directory, mesh, "siglip_vision" if name == "dual" else None)
    assert type(ours) is SiglipVision
    outputs = vision_outputs(ours, PIXELS)
    theirs = pooled_pair(torch_run(getattr(model, "vision_model", model), pixel_values=PIXELS))
    assert [o.shape for o in outputs] == [t.shape for t in theirs] == [(3, 16, 48), (3, 48)][: len(theirs)]
    assert largest_error(outputs, theirs) <= 1e-4
    if name == "headless-vision":
        assert ours.head is None
        with pytest.raises(ValueError, match="no pooling head .*vision_use_head is false") as caught:
            ours.pooled(outputs[0])
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name, mesh", [("dual", "1x1"), ("dual", "4x2"), ("dual2", "4x2")])
def test_dual_model_matches_transformers(twins, loaded, name, mesh):
    """logits_per_image (images x texts), get_text_features and get_image_features."""
    model, directory = twins(name)
    ours = loaded(directory, mesh)
    assert type(ours) is {"dual": Siglip, "dual2": Siglip2}[name]
    outputs = (dual_outputs if name == "dual" else dual2_outputs)(ours)
    assert [o.shape for o in outputs] == [(3, 3), (3, 48), (3, 48)]
    theirs = torch_dual(model)
    assert np.exp(np.asarray(ours.logit_scale)) == pytest.approx([10.0]) and np.asarray(ours.logit_bias) == -2.0
    assert largest_error(outputs, theirs) <= 1e-4


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
def test_naflex_vision_tower_matches_transformers(twins, loaded, mesh):
    """Three images of 4 x 4, 2 x 7 and 3 x 5 patches in one batch of 16: every position's
    hidden state (padding's too) and the pooled output, which attends to no padding."""
    model, directory = twins("dual2")
    ours = loaded(directory, mesh, "siglip2_vision")
    assert type(ours) is Siglip2Vision
    outputs = naflex_outputs(ours, PATCHES, PATCH_MASK, SPATIAL)
    inputs = dict(pixel_values=PATCHES, pixel_attention_mask=PATCH_MASK, spatial_shapes=SPATIAL)
    theirs = pooled_pair(torch_run(model.vision_model, **inputs))
    assert largest_error(outputs, theirs) <= 1e-4
    # One image alone, unbatched, is the same image in the batch (its padding aside).
    alone = ours(PATCHES[1], PATCH_MASK[1], SPATIAL[1])
    assert alone.shape == (16, 48)
    assert np.abs(np.asarray(alone) - np.asarray(outputs[0][1])).max() <= 1e-5


def test_positions_resize_as_torch_interpolate():
    """resize_positions is F.interpolate(bilinear, align_corners=False, antialias=True) of the
    table to each image's grid, down, up and mixed; padding positions take position 0's."""
    transformers_or_skip()
    import torch

    table = torch.randn(5, 5, 3, generator=torch.Generator().manual_seed(0))
    for rows, columns in [(2, 3), (7, 3), (10, 10)]:
        image = table.permute(2, 0, 1)[None]
        theirs = torch.nn.functional.interpolate(
            image, size=(rows, columns), mode="bilinear", align_corners=False, antialias=True
        )
        theirs = theirs[0].permute(1, 2, 0).reshape(rows * columns, 3).numpy()
        ours = np.asarray(
            resize_positions(jnp.asarray(table.numpy()), jnp.array([[rows, columns]]), rows * columns + 2)
        )
        assert np.abs(ours[0, : rows * columns] - theirs).max() <= 1e-6, (rows, columns)
        assert np.abs(ours[0, rows * columns :] - theirs[0]).max() <= 1e-6


def test_bfloat16_compute_within_transformers_own_error(twins, loaded):
    """dtype=bfloat16 on float32 parameters: the logits and features off transformers' float32
    ones by no more than transformers' own bfloat16 model is, give or take rounding's luck: the
    mean error within 2 times its, the largest within 2.5 times (measured: 0.6-1.5 and 0.5-2.1)."""
    import torch

    model, directory = twins("dual")
    half = dual_outputs(loaded(directory, "4x2"), jnp.bfloat16)
    assert all(o.dtype == jnp.bfloat16 for o in half)
    full = torch_dual(model)
    theirs = torch_dual(copy.deepcopy(model).to(torch.bfloat16))
    for ours, exact, rounded in zip(half, full, theirs, strict=True):
        error, own = np.abs(np.asarray(ours, np.float32) - exact), np.abs(rounded - exact)
        assert error.mean() <= 2 * own.mean() and error.max() <= 2.5 * own.max(), (error.max(), own.max())


@pytest.mark.parametrize("name", ["dual", "dual2"])
def test_gradients_of_the_sigmoid_loss_match_pytorch(twins, loaded, name, tmp_path):
    """jax.grad of `sigmoid_loss` (transformers' `return_loss=True`) equals PyTorch's backward for
    every parameter, logit scale and bias, the pooling head's fused in_proj and SigLIP 2's
    resized position table included, by checkpoint name (through `port.export`)."""
    import torch

    model, directory = twins(name)
    model.zero_grad()
    images = (PIXELS,) if name == "dual" else (PATCHES, PATCH_MASK, SPATIAL)
    names = ("pixel_values",) if name == "dual" else ("pixel_values", "pixel_attention_mask", "spatial_shapes")
    given = dict(input_ids=IDS, attention_mask=MASK, **dict(zip(names, images, strict=True)))
    out = model(**{k: torch.tensor(v) for k, v in given.items()}, return_loss=True)
    out.loss.backward()
    ours = loaded(directory, "1x1")
    loss = eqx.filter_jit(lambda m: sigmoid_loss(m(IDS, *images, attention_mask=MASK).T))
    value, grads = eqx.filter_value_and_grad(loss)(ours)
    assert float(value) == pytest.approx(out.loss.item(), rel=1e-5)
    port.export(grads, tmp_path / "grads", directory)
    exported = getattr(transformers_or_skip(), CASES[name][0]).from_pretrained(tmp_path / "grads").state_dict()
    theirs = {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}
    assert {"logit_scale", "logit_bias", "vision_model.head.attention.in_proj_weight"} <= set(theirs)
    assert len(theirs) == len(list(model.parameters()))
    largest = max(np.abs(grad).max() for grad in theirs.values())
    for key, grad in theirs.items():
        np.testing.assert_allclose(
            exported[key].numpy(), grad, atol=1e-4 * np.abs(grad).max() + 1e-6 * largest, rtol=0, err_msg=key
        )


# ---------------------------------------------------------------- a tower of the dual checkpoint


@pytest.mark.parametrize("tower", ["siglip_vision", "siglip_text", "siglip2_vision", "siglip2_text"])
def test_a_tower_loads_from_the_dual_checkpoint(twins, loaded, tower):
    """mapping="siglip_vision" and the like: the dual model's tower, leaf for leaf, built from its
    sub-config; the other tower and the logit scale and bias are ignored."""
    _, directory = twins("dual2" if tower.startswith("siglip2") else "dual")
    alone = loaded(directory, "4x2", tower)
    dual = loaded(directory, "4x2")
    within = dual.text if tower.endswith("text") else dual.vision
    assert type(alone) is type(within) and alone.config == within.config
    for ours, theirs in zip(jax.tree.leaves(alone), jax.tree.leaves(within), strict=True):
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))
    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config, tower)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2}
        )
    other = "vision_model." if tower.endswith("text") else "text_model."
    assert {"logit_scale", "logit_bias"} <= set(recipe.ignored)
    assert all(k in recipe.ignored for k in ckpt.tensors if k.startswith(other))


def test_the_vision_tower_of_the_dual_checkpoint_exports_as_siglip_vision_model(twins, loaded, tmp_path):
    """`port export` of the tower writes a `SiglipVisionModel` checkpoint (config.json its
    vision_config, model_type siglip_vision_model) that transformers loads with nothing missing
    or unexpected, equal to the dual model's tower."""
    import torch

    transformers = transformers_or_skip()
    model, directory = twins("dual")
    tower = loaded(directory, "4x2", "siglip_vision")
    out = port.export(tower, tmp_path / "vision", directory, mapping="siglip_vision").out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "siglip_vision_model" and config["architectures"] == ["SiglipVisionModel"]
    assert config["hidden_size"] == 48 and "text_config" not in config
    exported, info = transformers.SiglipVisionModel.from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    theirs = model.vision_model.state_dict()
    assert exported.state_dict().keys() == theirs.keys()
    assert all(torch.equal(exported.state_dict()[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("name", ["dual", "headless-vision", "dual2"])
def test_export_round_trip(twins, loaded, name, tmp_path):
    """port.load on 4x2 -> port.export: the same tensors, bit for bit, under the same names, that
    the checkpoint's own class loads with no key missing or unexpected."""
    from safetensors import safe_open

    transformers = transformers_or_skip()
    _, directory = twins(name)
    out = port.export(loaded(directory, "4x2"), tmp_path / "hf", directory).out
    with safe_open(directory / "model.safetensors", "np") as src, safe_open(out / "model.safetensors", "np") as dst:
        assert set(src.keys()) == set(dst.keys())
        for key in src.keys():
            a, b = src.get_tensor(key), dst.get_tensor(key)
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), key
    _, info = getattr(transformers, CASES[name][0]).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


# ---------------------------------------------------------------- port verify, through the command line


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, reference",
    [
        ("headless-vision", "SiglipVisionModel.last_hidden_state (float32 [2, 16, 48]"),
        ("dual", "SiglipModel.logits_per_image"),
        ("dual2", "Siglip2Model.logits_per_image"),
        ("dual2 --mapping siglip2_vision", "Siglip2VisionModel.last_hidden_state (float32 [2, 16, 48]"),
    ],
)
def test_verify_through_the_command_line(twins, name, reference):
    """The installed `port verify --mesh 4x2`: pixels drawn for the vision tower; ids and pixels
    (its `__call__`'s inputs without a default) for the dual model; SigLIP 2's NaFlex patches,
    their mask and each image's grid drawn together (a full grid and a smaller, padded one)."""
    name, *flags = name.split()
    _, directory = twins(name)
    result = run_port("verify", directory, "--mesh", "4x2", "--length", "8", *flags)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output
    assert f"vs {reference}" in output and ": ok (tolerance" in output, output
    assert float(output.split("max abs difference ")[1].split()[0]) <= 1e-4


# ---------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def zeros():
    """A SigLIP vision tower (16 x 16 pixels) and a SigLIP 2 one, of zeros (the checks read shapes only)."""

    def build(cls, config):
        shapes = eqx.filter_eval_shape(cls.from_config, config, key=jax.random.key(0))
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    return build(SiglipVision, VISION), build(Siglip2Vision, NAFLEX)


@pytest.mark.parametrize(
    "shape, dtype, error, match",
    [
        ((2, 3, 16, 12), jnp.float32, ValueError, r"image of 16x12 pixels, but config.json's image_size is 16x16"),
        ((2, 4, 16, 16), jnp.float32, ValueError, r"has 4 channels .*num_channels is 3"),
        ((16, 16), jnp.float32, ValueError, r"must have shape \(batch, channels, height, width\)"),
        ((2, 3, 16, 16), jnp.int32, TypeError, "must have a floating dtype, got int32"),
    ],
)
def test_bad_pixels_are_one_line(zeros, shape, dtype, error, match):
    vision, _ = zeros
    run = eqx.filter_jit(lambda model, pixels: model(pixels))
    for call in (vision, lambda pixels: run(vision, pixels)):  # eager and under filter_jit
        with pytest.raises(error, match=match) as caught:
            call(jnp.zeros(shape, dtype))
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "inputs, error, match",
    [
        (((2, 16, 47), (2, 16), (2, 2)), ValueError, r"`pixel_values` must have shape \(batch, patches, 48\)"),
        (((2, 3, 16, 16), (2, 16), (2, 2)), ValueError, r"`pixel_values` must have shape"),
        (((2, 16, 48), (2, 15), (2, 2)), ValueError, r"`pixel_attention_mask` must have shape \(2, 16\)"),
        (((2, 16, 48), (2, 16), (2, 3)), ValueError, r"`spatial_shapes` must have shape \(2, 2\)"),
        (((2, 16, 48), (2, 16), (2, 2), "float32"), TypeError, "`spatial_shapes` must have an integer dtype"),
    ],
)
def test_bad_naflex_inputs_are_one_line(zeros, inputs, error, match):
    _, vision = zeros
    pixels, mask, spatial = jnp.zeros(inputs[0]), jnp.ones(inputs[1], jnp.int32), jnp.ones(inputs[2], jnp.int32)
    if len(inputs) > 3:
        spatial = spatial.astype(inputs[3])
    run = eqx.filter_jit(lambda model, *args: model(*args))
    for call in (vision, lambda *args: run(vision, *args)):
        with pytest.raises(error, match=match) as caught:
            call(pixels, mask, spatial)
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "read, config, match",
    [
        (TextConfig.from_hf, {**TEXT, "hidden_act": "mish"}, "'hidden_act' 'mish' is not supported"),
        (TextConfig.from_hf, {**TEXT, "hidden_size": 30}, r"'hidden_size' \(30\) must be divisible by"),
        (TextConfig.from_hf, {**TEXT, "model_type": "clip_text_model"}, "not supported by port.models.siglip"),
        (VisionConfig.from_hf, {**VISION, "image_size": [16, 16]}, "'image_size' must be a positive integer"),
        (VisionConfig.from_hf, {**VISION, "image_size": 2}, r"'image_size' \(2\) is smaller than 'patch_size'"),
        (VisionConfig.from_hf, {**VISION, "vision_use_head": 1}, "'vision_use_head' must be a boolean"),
        (NaFlexConfig.from_hf, {**NAFLEX, "num_patches": 12}, r"'num_patches' \(12\) must be a square"),
        (NaFlexConfig.from_hf, {**NAFLEX, "model_type": "siglip_vision_model"}, "not supported by port.models.sig"),
        (
            lambda c: eqx.filter_eval_shape(Siglip.from_config, c, key=jax.random.key(0)),
            {"model_type": "siglip", "text_config": TEXT, "vision_config": {**VISION, "vision_use_head": False}},
            "vision_use_head false: SiglipModel pools by the head",
        ),
        (
            lambda c: eqx.filter_eval_shape(Siglip2.from_config, c, key=jax.random.key(0)),
            {"model_type": "siglip2", "text_config": TEXT, "vision_config": "big"},
            "'vision_config' must be a table of the tower's config, got 'big'",
        ),
    ],
)
def test_config_refused_in_one_line(read, config, match):
    with pytest.raises(ConfigError, match=match) as caught:
        read(config)
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_port_convert_refuses_a_config_it_cannot_run_before_reading(twins, tmp_path):
    """A dual checkpoint whose text_config names an activation port lacks: `port convert` says so
    in one line, exit 1, nothing written (the config is checked before any tensor byte is read)."""
    _, directory = twins("dual")
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["hidden_act"] = "mish"
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").symlink_to(directory / "model.safetensors")
    out = tmp_path / "out"
    result = run_port("convert", bad, "--out", out)
    assert result.returncode == 1
    one_line(result, "port: error:", "'hidden_act' 'mish' is not supported")
    assert not out.exists()


def test_a_dual_models_mapping_names_its_towers_sizes_by_dotted_keys():
    """A SiglipModel's config.json keeps its towers' sizes in `text_config` / `vision_config`;
    `=default` stands for a size it leaves out (null too), never for one it gives."""
    config = {"text_config": {"num_attention_heads": 4, "hidden_size": 32, "vocab_size": None}, "vision_config": 7}
    reshape = Reshape(("text_config.num_attention_heads", -1, "text_config.hidden_size")).resolve(config)
    assert reshape.target == (4, -1, 32)
    for missing in ("vision_config.hidden_size", "text_config.vocab_size", "text_config"):
        with pytest.raises(ConfigError, match=f"config.json has no integer '{missing}'"):
            Reshape((missing, -1)).resolve(config)
    defaults = ("text_config.num_attention_heads=12", "text_config.vocab_size=9", "vision_config.x=5", "nothing=3")
    assert Reshape(defaults).resolve(config).target == (4, 9, 5, 3)
    assert Reshape(("nothing=3",)).render() == '{ reshape = ["nothing=3"] }'


SPARSE = {  # google/siglip-base-patch16-224's config.json: every size transformers' default
    "architectures": ["SiglipModel"],
    "initializer_factor": 1.0,
    "model_type": "siglip",
    "text_config": {"model_type": "siglip_text_model"},
    "vision_config": {"model_type": "siglip_vision_model"},
}


@pytest.mark.parametrize("mapping", [None, "siglip_vision"])
def test_plan_of_a_config_that_leaves_the_sizes_out(tmp_path, mapping):
    """A Hub config.json whose towers give no sizes plans at transformers' defaults (base:
    768 wide, 12 heads of 64, 196 patches), the whole model or one tower, no byte read."""
    transformers = transformers_or_skip()
    import torch

    from helpers import write_sparse_checkpoint

    with torch.device("meta"):
        model = transformers.SiglipModel(transformers.SiglipConfig(**SPARSE))
    shapes = {k: list(v.shape) for k, v in sorted(model.state_dict().items())}
    write_sparse_checkpoint(tmp_path / "base", SPARSE, shapes, dtype="F32")
    with port.open_checkpoint(tmp_path / "base") as ckpt:
        found = port.mapping_for(ckpt.config, mapping)
        recipe = port.plan(port.skeleton(found, ckpt.config), found, ckpt.tensors, ckpt.config, {"data": 4, "model": 2})
        assert ckpt.bytes_read == 0
    leaves = {leaf.path: leaf for leaf in recipe.leaves}
    prefix = "" if mapping else "vision."
    assert leaves[f"{prefix}layers.attn.wq"].shape == (12, 12, 64, 768)
    assert leaves[f"{prefix}head.attn.wo"].shape == (768, 12, 64)
    assert leaves[f"{prefix}position_embeddings"].shape == (196, 768)
    if mapping is None:
        assert leaves["text.token_embeddings"].shape == (32000, 768)
