"""DINOv2 (with and without registers): `mappings/dinov2*.toml` -> `port.models.dinov2.DINOv2`, against transformers.

Parity goes through the converter: a `Dinov2Model` / `Dinov2WithRegistersModel` written by
`save_pretrained` (every parameter perturbed, so register tokens, LayerScale and biases
count), loaded by `port` onto 1x1 and 4x2, gives transformers' last hidden state at the
config's image size and at other sizes, whose position embeddings both resize by torch's
bicubic (plain for `dinov2`, antialiased for `dinov2_with_registers`; `port.nn._resize`
is held to `torch.nn.functional.interpolate` directly). Tiny awkward configs: SwiGLU
(fused `weights_in`, hidden size rounded to 8), 3 heads the `model` axis of 2 cannot
split, no q/k/v biases, no mask token. Gradients per parameter by checkpoint name,
bfloat16 within transformers' own bfloat16 error, the export bit for bit, `port verify`
through the command line; bad pixels and configs in one line. Skips without PyTorch.
"""

import json
import shutil

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from test_vit import READ_RECORDER

import port
from port._errors import ConfigError
from port.models.dinov2 import DINOv2, DINOv2Config, swiglu_size
from port.nn._resize import bicubic_resize, bicubic_weights

from helpers import hooked, one_line, perturbed, run_port, transformers_or_skip

# name: (transformers model class, config class, config)
CASES = {
    "swiglu": (
        "Dinov2Model",
        "Dinov2Config",
        dict(hidden_size=32, num_attention_heads=4, image_size=28, patch_size=7, use_swiglu_ffn=True),
    ),
    "plain": (  # 3 heads of 16: not split over model=2; no q/k/v biases, no mask token
        "Dinov2Model",
        "Dinov2Config",
        dict(hidden_size=48, num_attention_heads=3, image_size=30, patch_size=6, qkv_bias=False, use_mask_token=False),
    ),
    "registers": (
        "Dinov2WithRegistersModel",
        "Dinov2WithRegistersConfig",
        dict(hidden_size=32, num_attention_heads=4, image_size=28, patch_size=7, num_register_tokens=2),
    ),
}
OTHER_SIZE = {"swiglu": (35, 21), "plain": (18, 44), "registers": (42, 16)}  # grids 5x3, 3x7, 6x2
PARITY = [
    ("swiglu", "1x1", "config"),
    ("swiglu", "4x2", "other"),
    ("plain", "4x2", "config"),
    ("plain", "1x1", "other"),
    ("registers", "4x2", "config"),
    ("registers", "1x1", "other"),
]


def size_of(case: str, which: str) -> tuple[int, int]:
    image = CASES[case][2]["image_size"]
    return (image, image) if which == "config" else OTHER_SIZE[case]


def pixels(case: str, which: str) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((2, 3, *size_of(case, which))).astype(np.float32)


def torch_dinov2(case: str):
    """A seeded transformers model of the case, every parameter perturbed, eager attention."""
    transformers = transformers_or_skip()
    import torch

    class_name, config_name, overrides = CASES[case]
    config = getattr(transformers, config_name)(num_hidden_layers=2, initializer_range=0.2, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return perturbed(getattr(transformers, class_name)(config), lambda name: True, 0.2)


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """get(case): the case's transformers model and its checkpoint directory (written once)."""
    made = {}

    def get(case):
        if case not in made:
            model = torch_dinov2(case)
            directory = tmp_path_factory.mktemp(case)
            model.save_pretrained(directory)
            made[case] = model, directory
        return made[case]

    return get


@pytest.fixture(scope="module")
def loaded(twins):
    """get(case, mesh): port.load of the case's checkpoint onto the mesh (one load each)."""
    made = {}

    def get(case, mesh):
        if (case, mesh) not in made:
            made[case, mesh] = port.load(twins(case)[1], mesh=port.make_mesh(mesh))
        return made[case, mesh]

    return get


def torch_out(model, x: np.ndarray):
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(x).to(model.dtype))


run = eqx.filter_jit(lambda model, x, dtype=None: model(x, dtype=dtype))


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("case, mesh, which", PARITY)
def test_hidden_states_match_transformers(twins, loaded, case, mesh, which):
    model, _ = twins(case)
    x = pixels(case, which)
    theirs = torch_out(model, x)
    ours = run(loaded(case, mesh), x)
    (h, w), (ph, pw) = x.shape[2:], (CASES[case][2]["patch_size"],) * 2
    registers = CASES[case][2].get("num_register_tokens", 0)
    assert (
        ours.shape
        == theirs.last_hidden_state.shape
        == (2, 1 + registers + (h // ph) * (w // pw), model.config.hidden_size)
    )
    assert np.abs(np.asarray(ours) - theirs.last_hidden_state.numpy()).max() <= 1e-4
    np.testing.assert_array_equal(np.asarray(loaded(case, mesh).pooled(ours)), np.asarray(ours)[:, 0])
    assert np.abs(np.asarray(ours)[:, 0] - theirs.pooler_output.numpy()).max() <= 1e-4


def test_leaves_of_each_case(loaded):
    """SwiGLU's fused weights_in split into gate and up of the rounded size; the absent pieces None;
    3 heads replicated on model=2, the MLP split on it."""
    swiglu, plain, registers = (loaded(case, "4x2") for case in ("swiglu", "plain", "registers"))
    assert swiglu.layers.mlp is None and swiglu.layers.swiglu is not None
    assert (
        swiglu.layers.swiglu.gate.shape == swiglu.layers.swiglu.up.shape == (2, swiglu_size(32, 4), 32) == (2, 88, 32)
    )
    assert plain.layers.swiglu is None and plain.mask_token is None and plain.register_tokens is None
    assert plain.layers.attn.bq is None and plain.layers.attn.wq.sharding.spec[1] is None
    assert plain.layers.mlp.up.sharding.spec[1] == "model"
    assert registers.register_tokens.shape == (2, 32) and registers.mask_token.shape == (32,)


def test_unbatched_pixels_give_the_batch_of_one(twins, loaded):
    x = pixels("registers", "other")
    ours = loaded("registers", "1x1")
    np.testing.assert_allclose(np.asarray(run(ours, x[1])), np.asarray(run(ours, x))[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("antialias", [False, True], ids=["plain", "antialias"])
@pytest.mark.parametrize("before, after", [((4, 4), (7, 5)), ((9, 9), (3, 6)), ((5, 5), (5, 5))])
def test_bicubic_resize_is_torchs(antialias, before, after):
    """Up, down, mixed and the same size, against torch.nn.functional.interpolate itself (float32)."""
    transformers_or_skip()
    import torch

    table = np.random.default_rng(0).standard_normal((*before, 8)).astype(np.float32)
    expected = (
        torch.nn.functional.interpolate(
            torch.from_numpy(table).permute(2, 0, 1)[None],
            size=after,
            mode="bicubic",
            align_corners=False,
            antialias=antialias,
        )[0]
        .permute(1, 2, 0)
        .numpy()
    )
    ours = bicubic_resize(jnp.asarray(table), after, antialias=antialias)
    assert ours.shape == expected.shape and ours.dtype == jnp.float32
    assert np.abs(np.asarray(ours) - expected).max() <= 1e-5
    np.testing.assert_allclose(bicubic_weights(before[0], after[0], antialias=antialias).sum(1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("case", ["registers"])
def test_bfloat16_compute_within_transformers_own_error(twins, loaded, case):
    """dtype=bfloat16 on float32 parameters at a resized grid: off transformers' float32 states by no
    more than 1.5 times what transformers' own bfloat16 model is."""
    import copy

    import torch

    model, _ = twins(case)
    x = pixels(case, "other")
    full = torch_out(model, x).last_hidden_state.numpy()
    theirs = torch_out(copy.deepcopy(model).to(torch.bfloat16), x).last_hidden_state.float().numpy()
    half = run(loaded(case, "1x1"), x, jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    assert np.abs(np.asarray(half, np.float32) - full).max() <= 1.5 * np.abs(theirs - full).max()


@pytest.mark.parametrize("case", ["registers"])
def test_gradients_match_pytorch(twins, loaded, case, tmp_path):
    """jax.grad of the sum of squares of the last hidden state at a resized grid equals PyTorch's
    backward for every parameter that gets one, by checkpoint name (through port.export), within
    1e-4 of its largest entry (and 1e-6 of the largest of all)."""
    import torch

    model, directory = twins(case)
    x = pixels(case, "other")
    model.zero_grad()
    loss = (model(torch.from_numpy(x)).last_hidden_state ** 2).sum()
    loss.backward()
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, x: jnp.sum(m(x) ** 2)))(loaded(case, "1x1"), x)
    assert float(value) == pytest.approx(loss.item(), rel=1e-5)
    port.export(grads, tmp_path / "grads", directory)
    exported = type(model).from_pretrained(tmp_path / "grads").state_dict()
    theirs = {k: p.grad.numpy() for k, p in model.named_parameters() if p.grad is not None}
    assert theirs and set(theirs) <= set(exported)
    assert any("register_tokens" in k for k in theirs)
    largest = max(np.abs(grad).max() for grad in theirs.values())
    for key, grad in theirs.items():
        np.testing.assert_allclose(
            exported[key].numpy(), grad, atol=1e-4 * np.abs(grad).max() + 1e-6 * largest, rtol=0, err_msg=key
        )


@pytest.mark.parametrize("case", ["swiglu", "registers", "plain"])
def test_export_round_trip(twins, loaded, case, tmp_path):
    """port.load on 4x2 -> port.export: the source file's tensors bit for bit (weights_in joined back),
    and from_pretrained finds no key missing, unexpected or mismatched."""
    from safetensors.numpy import load_file

    model, directory = twins(case)
    out = port.export(loaded(case, "4x2"), tmp_path / "hf", directory).out
    source, exported = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == source.keys()
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes(), key
    _, info = type(model).from_pretrained(out, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"


@pytest.mark.slow
@pytest.mark.parametrize("case, reference", [("swiglu", "Dinov2Model"), ("registers", "Dinov2WithRegistersModel")])
def test_verify_through_the_command_line(twins, case, reference):
    """The installed `port verify --mesh 4x2` draws pixels of the config's size and passes."""
    _, directory = twins(case)
    result = run_port("verify", directory, "--mesh", "4x2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"vs {reference}.last_hidden_state (float32 [2, " in output and ": ok (tolerance" in output
    assert float(output.split("max abs difference ")[1].split()[0]) <= 1e-4


# ---------------------------------------------------------------- bad input, in one line


@pytest.fixture(scope="module")
def zeros_model():
    """A registers model of zeros (the checks read shapes only; no init, no PyTorch)."""
    import jax

    config = {"model_type": "dinov2_with_registers", "num_hidden_layers": 1, **CASES["registers"][2]}
    shapes = eqx.filter_eval_shape(DINOv2.from_config, config, key=jax.random.key(0))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@pytest.mark.parametrize(
    "shape, dtype, error, match",
    [
        ((2, 3, 6, 28), jnp.float32, ValueError, r"image of 6x28 pixels, smaller than config.json's patch_size 7x7"),
        ((2, 4, 28, 28), jnp.float32, ValueError, r"has 4 channels .*num_channels is 3"),
        ((28, 28), jnp.float32, ValueError, r"must have shape \(batch, channels, height, width\)"),
        ((2, 3, 28, 28), jnp.int32, TypeError, "must have a floating dtype, got int32"),
    ],
)
def test_bad_pixels_are_one_line(zeros_model, shape, dtype, error, match):
    for call in (zeros_model, lambda x: run(zeros_model, x)):  # eager and under filter_jit
        with pytest.raises(error, match=match) as caught:
            call(jnp.zeros(shape, dtype))
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(image_size=[28, 35]), r"'image_size' \[28, 35\] over 'patch_size' \[7, 7\] is not a square grid"),
        (dict(image_size=4), r"'image_size' \[4, 4\] is smaller than 'patch_size' \[7, 7\]"),
        (dict(hidden_size=30), r"'hidden_size' \(30\) must be divisible by 'num_attention_heads' \(4\)"),
        (dict(hidden_act="mish"), "'hidden_act' 'mish' is not supported"),
        (dict(mlp_ratio=0), "'mlp_ratio' must be a positive number"),
        (dict(use_swiglu_ffn="yes"), "'use_swiglu_ffn' must be a boolean"),
        (dict(model_type="dinov3"), "dinov3"),
    ],
)
def test_config_rejects_unsupported(change, match):
    with pytest.raises(ConfigError, match=match) as caught:
        DINOv2Config.from_hf({"model_type": "dinov2", "num_hidden_layers": 2, **CASES["swiglu"][2], **change})
    assert "\n" not in str(caught.value)


def test_register_count_is_read_for_the_registers_family_only():
    base = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_register_tokens": 3}
    assert DINOv2Config.from_hf({"model_type": "dinov2_with_registers", **base}).num_register_tokens == 3
    default = {k: v for k, v in base.items() if k != "num_register_tokens"}
    assert DINOv2Config.from_hf({"model_type": "dinov2_with_registers", **default}).num_register_tokens == 4
    assert DINOv2Config.from_hf({"model_type": "dinov2", **base}).num_register_tokens == 0  # transformers ignores it


@pytest.mark.slow
def test_convert_refuses_a_bad_config_before_reading(twins, tmp_path):
    """`port convert` of a checkpoint whose config.json asks for a non-square position grid: one
    line naming the field, no tensor byte read, nothing written."""
    _, directory = twins("swiglu")
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "image_size": [28, 35]}))
    env = hooked(tmp_path / "recorder", READ_RECORDER) | {"READS_FILE": str(tmp_path / "reads.json")}
    out = tmp_path / "out"
    one_line(run_port("convert", bad, "--out", out, env=env), "config.json: 'image_size' [28, 35]", out=out)
    assert json.loads((tmp_path / "reads.json").read_text()) == []
