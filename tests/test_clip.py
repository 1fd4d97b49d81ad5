"""CLIP: the text tower, the vision tower and the dual model (`port.models.clip`), against transformers.

Tiny random checkpoints written by `save_pretrained` (a `CLIPTextModel`, a `CLIPVisionModel`
and a `CLIPModel`), norms and biases perturbed, eager attention. Each tower's last hidden
state and pooled output (the text's at its end-of-text token, over a right-padded batch;
the legacy `eos_token_id` 2 too) and the dual model's `logits_per_image` and features equal
transformers' on meshes 1x1 and 4x2; bfloat16 compute is as near float32 as transformers'
own bfloat16 model; the gradients of the contrastive loss equal PyTorch's per parameter. A
tower loads from the dual checkpoint (`mapping="clip_vision"`, `"clip_text"`) and exports as
the tower's class; every module's export round trips bit for bit; `port verify` runs the
towers and the dual model through the command line. The tests that build a `transformers`
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
from test_vit import READ_RECORDER

import port
from port._errors import ConfigError
from port.models.clip import (
    CLIP,
    CLIPText,
    CLIPTextConfig,
    CLIPTextWithProjection,
    CLIPVision,
    CLIPVisionConfig,
    CLIPVisionWithProjection,
    contrastive_loss,
)

from helpers import hooked, one_line, perturbed, run_port, transformers_or_skip

TEXT = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=16,
    projection_dim=24,
    bos_token_id=98,
    eos_token_id=99,
    pad_token_id=0,
)
VISION = dict(
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=16,
    patch_size=4,
    projection_dim=24,
)
# Right-padded texts ending at the end-of-text id 99 (the last one fills its row); token
# ids above 99 never occur, so the legacy rule (largest id) pools the same token.
IDS = np.array(
    [
        [98, 5, 6, 7, 99, 0, 0, 0],
        [98, 8, 99, 0, 0, 0, 0, 0],
        [98, 1, 2, 3, 4, 5, 6, 99],
    ]
)
MASK = np.array([[1] * 5 + [0] * 3, [1] * 3 + [0] * 5, [1] * 8])
PIXELS = np.random.default_rng(1).standard_normal((3, 3, 16, 16)).astype(np.float32)

# name: (the transformers class, the config's arguments)
CASES = {
    "text": ("CLIPTextModel", TEXT),
    "text-legacy-eos": ("CLIPTextModel", {**TEXT, "eos_token_id": 2, "hidden_act": "gelu"}),
    "vision": ("CLIPVisionModel", VISION),
    "text-projection": ("CLIPTextModelWithProjection", TEXT),
    "vision-projection": ("CLIPVisionModelWithProjection", VISION),
    "dual": ("CLIPModel", dict(text_config=TEXT, vision_config=VISION, projection_dim=24)),
}


def torch_clip(name: str):
    """A seeded transformers model of the case, norms and biases perturbed, eager attention."""
    transformers = transformers_or_skip()
    import torch

    class_name, arguments = CASES[name]
    config_class = {"CLIPModel": "CLIPConfig"}.get(class_name, class_name.split("Model")[0] + "Config")
    config = getattr(transformers, config_class)(**arguments, initializer_factor=4.0)
    config._attn_implementation = "eager"
    for sub in ("text_config", "vision_config"):
        if hasattr(config, sub):
            getattr(config, sub)._attn_implementation = "eager"
    torch.manual_seed(0)
    return perturbed(getattr(transformers, class_name)(config), lambda n: "norm" in n or n.endswith("bias"), 0.3)


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """get(name): the case's transformers model and the directory it saved."""
    made = {}

    def get(name):
        if name not in made:
            model = torch_clip(name)
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
def text_outputs(model, ids, mask, dtype=None):
    hidden = model(ids, mask, dtype=dtype)
    return hidden, model.pooled(hidden, ids)


@eqx.filter_jit
def vision_outputs(model, pixels, dtype=None):
    hidden = model(pixels, dtype=dtype)
    return hidden, model.pooled(hidden)


@eqx.filter_jit
def dual_outputs(model, ids, mask, pixels, dtype=None):
    logits = model(ids, pixels, attention_mask=mask, dtype=dtype)
    return logits, model.text_features(ids, mask, dtype=dtype), model.image_features(pixels, dtype=dtype)


def torch_text(model):
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK))
    return out.last_hidden_state.float().numpy(), out.pooler_output.float().numpy()


def torch_vision(model):
    import torch

    with torch.no_grad():
        out = model(pixel_values=torch.tensor(PIXELS).to(model.dtype))
    return out.last_hidden_state.float().numpy(), out.pooler_output.float().numpy()


def torch_dual(model):
    """transformers' logits_per_image, get_text_features and get_image_features."""
    import torch

    ids, mask, pixels = torch.tensor(IDS), torch.tensor(MASK), torch.tensor(PIXELS).to(model.dtype)
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels, attention_mask=mask).logits_per_image
        texts = model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
        images = model.get_image_features(pixel_values=pixels).pooler_output
    return tuple(x.float().numpy() for x in (logits, texts, images))


def largest_error(ours, theirs) -> float:
    return max(float(np.abs(np.asarray(a, np.float32) - b).max()) for a, b in zip(ours, theirs, strict=True))


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("name, mesh", [("text", "1x1"), ("text", "4x2"), ("text-legacy-eos", "1x1")])
def test_text_tower_matches_transformers(twins, loaded, name, mesh):
    """Every position, padded ones included (transformers masks keys only), and the pooled
    end-of-text state: the first 99, or with the legacy eos_token_id 2 the largest id."""
    model, directory = twins(name)
    ours = text_outputs(loaded(directory, mesh), IDS, MASK)
    assert type(loaded(directory, mesh)) is CLIPText
    assert ours[0].shape == (3, 8, 32) and ours[1].shape == (3, 32)
    assert largest_error(ours, torch_text(model)) <= 1e-4


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
def test_vision_tower_matches_transformers(twins, loaded, mesh):
    model, directory = twins("vision")
    ours = vision_outputs(loaded(directory, mesh), PIXELS)
    assert type(loaded(directory, mesh)) is CLIPVision
    assert ours[0].shape == (3, 17, 48) and ours[1].shape == (3, 48)
    assert largest_error(ours, torch_vision(model)) <= 1e-4
    unbatched = loaded(directory, mesh)(PIXELS[1])
    np.testing.assert_allclose(np.asarray(unbatched), np.asarray(ours[0][1]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("mesh", ["1x1", "4x2"])
def test_dual_model_matches_transformers(twins, loaded, mesh):
    """logits_per_image (images x texts) and the projected, un-normalised features."""
    model, directory = twins("dual")
    ours = loaded(directory, mesh)
    assert type(ours) is CLIP
    outputs = dual_outputs(ours, IDS, MASK, PIXELS)
    assert [o.shape for o in outputs] == [(3, 3), (3, 24), (3, 24)]
    theirs = torch_dual(model)
    assert np.abs(theirs[0]).max() > 1  # the logit scale is applied
    assert largest_error(outputs, theirs) <= 1e-4


@pytest.mark.parametrize("name, mesh", [("text-projection", "4x2"), ("vision-projection", "1x1")])
def test_a_tower_with_its_projection_matches_transformers(twins, loaded, name, mesh):
    """A `CLIP*ModelWithProjection` checkpoint gets the projection's mapping by its architectures,
    and returns transformers' text_embeds / image_embeds."""
    import torch

    model, directory = twins(name)
    ours = loaded(directory, mesh)
    text = name.startswith("text")
    assert type(ours) is (CLIPTextWithProjection if text else CLIPVisionWithProjection)
    with torch.no_grad():
        if text:
            theirs = model(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK)).text_embeds
            embeds = eqx.filter_jit(lambda m: m(IDS, MASK))(ours)
        else:
            theirs = model(pixel_values=torch.tensor(PIXELS)).image_embeds
            embeds = eqx.filter_jit(lambda m: m(PIXELS))(ours)
    assert embeds.shape == (3, 24)
    assert np.abs(np.asarray(embeds) - theirs.numpy()).max() <= 1e-4


def test_bfloat16_compute_within_transformers_own_error(twins, loaded):
    """dtype=bfloat16 on float32 parameters: the logits and features off transformers' float32
    ones by no more than 1.5 times what transformers' own bfloat16 model is."""
    import torch

    model, directory = twins("dual")
    half = dual_outputs(loaded(directory, "4x2"), IDS, MASK, PIXELS, jnp.bfloat16)
    assert all(o.dtype == jnp.bfloat16 for o in half)
    full = torch_dual(model)
    theirs = torch_dual(copy.deepcopy(model).to(torch.bfloat16))
    for ours, exact, rounded in zip(half, full, theirs, strict=True):
        assert np.abs(np.asarray(ours, np.float32) - exact).max() <= 1.5 * np.abs(rounded - exact).max()


def test_gradients_of_the_contrastive_loss_match_pytorch(twins, loaded, tmp_path):
    """jax.grad of `contrastive_loss` (transformers' `return_loss=True`) equals PyTorch's backward
    for every parameter, the logit scale included, by checkpoint name (through `port.export`)."""
    import torch

    model, directory = twins("dual")
    model.zero_grad()
    out = model(
        input_ids=torch.tensor(IDS),
        pixel_values=torch.tensor(PIXELS),
        attention_mask=torch.tensor(MASK),
        return_loss=True,
    )
    out.loss.backward()
    ours = loaded(directory, "1x1")
    loss = eqx.filter_jit(lambda m: contrastive_loss(m(IDS, PIXELS, attention_mask=MASK)))
    value, grads = eqx.filter_value_and_grad(loss)(ours)
    assert float(value) == pytest.approx(out.loss.item(), rel=1e-5)
    port.export(grads, tmp_path / "grads", directory)
    exported = transformers_or_skip().CLIPModel.from_pretrained(tmp_path / "grads").state_dict()
    theirs = {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}
    assert "logit_scale" in theirs and len(theirs) == len(list(model.parameters()))
    largest = max(np.abs(grad).max() for grad in theirs.values())
    for key, grad in theirs.items():
        np.testing.assert_allclose(
            exported[key].numpy(), grad, atol=1e-4 * np.abs(grad).max() + 1e-6 * largest, rtol=0, err_msg=key
        )


def test_contrastive_loss_is_transformers():
    """The loss alone, on logits of images x texts: transformers' image_text_contrastive_loss."""
    transformers_or_skip()
    import torch
    from transformers.models.clip.modeling_clip import image_text_contrastive_loss

    logits = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32) * 3
    theirs = image_text_contrastive_loss(torch.tensor(logits).T).item()  # it takes logits_per_text
    assert float(contrastive_loss(logits)) == pytest.approx(theirs, rel=1e-6)
    with pytest.raises(ValueError, match=r"must be square \(one text per image\), got \(4, 3\)"):
        contrastive_loss(logits[:, :3])


# ---------------------------------------------------------------- a tower of the dual checkpoint


TOWERS = {  # a tower's mapping: its class, and what of the dual model it holds
    "clip_vision": (CLIPVision, lambda dual: dual.vision),
    "clip_text": (CLIPText, lambda dual: dual.text),
    "clip_vision_projection": (CLIPVisionWithProjection, lambda dual: (dual.vision, dual.visual_projection)),
    "clip_text_projection": (CLIPTextWithProjection, lambda dual: (dual.text, dual.text_projection)),
}


@pytest.mark.parametrize("tower", TOWERS)
def test_a_tower_loads_from_the_dual_checkpoint(twins, loaded, tower):
    """mapping="clip_vision" / "clip_text" (or their `_projection`s): the dual model's tower
    (and projection), leaf for leaf, built from its sub-config; the rest is ignored."""
    _, directory = twins("dual")
    cls, part = TOWERS[tower]
    alone = loaded(directory, "4x2", tower)
    within = part(loaded(directory, "4x2"))
    assert type(alone) is cls
    for ours, theirs in zip(jax.tree.leaves(alone), jax.tree.leaves(within), strict=True):
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))
    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config, tower)
        recipe = port.plan(
            port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, {"data": 4, "model": 2}
        )
    vision = "vision" in tower
    held = {"visual_projection.weight" if vision else "text_projection.weight"} if "projection" in tower else set()
    other = "text_model." if vision else "vision_model."
    assert {"logit_scale", "text_projection.weight", "visual_projection.weight"} - held == set(recipe.ignored) - {
        k for k in ckpt.tensors if k.startswith(other)
    }
    assert all(k in recipe.ignored for k in ckpt.tensors if k.startswith(other))


@pytest.mark.parametrize(
    "tower, arch", [("clip_vision", "CLIPVisionModel"), ("clip_text_projection", "CLIPTextModelWithProjection")]
)
def test_a_tower_of_the_dual_checkpoint_exports_as_its_class(twins, loaded, tower, arch, tmp_path):
    """`port export` of a tower writes its class's checkpoint: config.json the tower's sub-config
    with its model_type and architectures [the class], which transformers loads with no key
    missing or unexpected, every tensor the dual model's."""
    import torch

    transformers = transformers_or_skip()
    model, directory = twins("dual")
    out = port.export(loaded(directory, "4x2", tower), tmp_path / tower, directory, mapping=tower).out
    config = json.loads((out / "config.json").read_text())
    vision = "vision" in tower
    assert config["model_type"] == ("clip_vision_model" if vision else "clip_text_model")
    assert config["architectures"] == [arch]
    assert config["hidden_size"] == (48 if vision else 32) and "text_config" not in config
    exported, info = getattr(transformers, arch).from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"
    dual = model.state_dict()
    theirs = exported.state_dict()
    prefix = "vision_model." if vision else ""  # CLIPVisionModel's keys are its vision_model's
    assert theirs and all(torch.equal(tensor, dual[prefix + key]) for key, tensor in theirs.items())


@pytest.mark.parametrize("name", ["text", "vision", "dual", "text-projection", "vision-projection"])
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
    [("vision", "CLIPVisionModel.last_hidden_state (float32 [2, 17, 48]"), ("dual", "CLIPModel.logits_per_image")],
)
def test_verify_through_the_command_line(twins, name, reference):
    """The installed `port verify --mesh 4x2`: pixels drawn for the vision tower; ids and pixels
    (its `__call__`'s inputs without a default) for the dual model."""
    _, directory = twins(name)
    result = run_port("verify", directory, "--mesh", "4x2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output
    assert f"vs {reference}" in output and ": ok (tolerance" in output, output
    assert float(output.split("max abs difference ")[1].split()[0]) <= 1e-4


# ---------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def zeros_vision():
    """A vision tower of zeros, 16 x 16 pixels (the checks read shapes only)."""
    shapes = eqx.filter_eval_shape(CLIPVision.from_config, VISION, key=jax.random.key(0))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@pytest.mark.parametrize(
    "shape, dtype, error, match",
    [
        ((2, 3, 16, 12), jnp.float32, ValueError, r"image of 16x12 pixels, but config.json's image_size is 16x16"),
        ((2, 4, 16, 16), jnp.float32, ValueError, r"has 4 channels .*num_channels is 3"),
        ((16, 16), jnp.float32, ValueError, r"must have shape \(batch, channels, height, width\)"),
        ((2, 3, 16, 16), jnp.int32, TypeError, "must have a floating dtype, got int32"),
    ],
)
def test_bad_pixels_are_one_line(zeros_vision, shape, dtype, error, match):
    run = eqx.filter_jit(lambda model, pixels: model(pixels))
    for call in (zeros_vision, lambda pixels: run(zeros_vision, pixels)):  # eager and under filter_jit
        with pytest.raises(error, match=match) as caught:
            call(jnp.zeros(shape, dtype))
        assert "\n" not in str(caught.value)


def test_the_dual_model_needs_batches():
    model = eqx.filter_eval_shape(
        CLIP.from_config, dict(model_type="clip", text_config=TEXT, vision_config=VISION), key=jax.random.key(0)
    )
    with pytest.raises(ValueError, match=r"`input_ids` must have a batch axis \(2 dimensions\), got \(8,\)"):
        model(jnp.zeros((8,), jnp.int32), jnp.zeros((1, 3, 16, 16)))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden_act="mish"), "'hidden_act' 'mish' is not supported"),
        (dict(eos_token_id=[2, 99]), "'eos_token_id' must be one token id"),
        (dict(hidden_size=30), "'hidden_size' \\(30\\) must be divisible by 'num_attention_heads' \\(4\\)"),
        (dict(model_type="bert"), "'model_type' 'bert' is not supported by port.models.clip"),
    ],
)
def test_text_config_refused_in_one_line(change, match):
    with pytest.raises(ConfigError, match=match) as caught:
        CLIPTextConfig.from_hf({"model_type": "clip_text_model", **TEXT, **change})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(image_size=[16, 16]), "'image_size' must be a positive integer"),
        (dict(image_size=2), "'image_size' \\(2\\) is smaller than 'patch_size' \\(4\\)"),
    ],
)
def test_vision_config_refused_in_one_line(change, match):
    with pytest.raises(ConfigError, match=match) as caught:
        CLIPVisionConfig.from_hf({"model_type": "clip_vision_model", **VISION, **change})
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_port_convert_refuses_a_config_it_cannot_run_before_reading(twins, tmp_path):
    """A dual checkpoint whose vision_config names an activation port lacks: `port convert` says so
    in one line, exit 1, nothing written (the config is checked before any tensor byte is read)."""
    _, directory = twins("dual")
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((directory / "config.json").read_text())
    config["vision_config"]["hidden_act"] = "mish"
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").symlink_to(directory / "model.safetensors")
    out, reads = tmp_path / "out", tmp_path / "reads.json"
    env = hooked(tmp_path / "recorder", READ_RECORDER) | {"READS_FILE": str(reads)}
    result = run_port("convert", bad, "--out", out, env=env)
    one_line(result, "config.json", "'hidden_act' 'mish' is not supported", out=out)
    assert json.loads(reads.read_text()) == []  # the recorder ran, and saw no read
