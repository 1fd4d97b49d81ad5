"""Verify: the converted JAX model against the PyTorch reference on the same inputs.

The mapping's `reference` names the `transformers` class (loaded with
`from_pretrained` from the config and weight files port converted) and the output attribute
to compare. What the checkpoint's config and the arguments ask is bounded before anything is
built: positions, quantization, and memory (`_check_labels`, `_check_memory`).
The inputs suit the model: its class declares what it takes as `input_kind`, a key of
`INPUTS` (default `"input_ids"`: random token ids; `"pixel_values"`: random images of
config.json's `num_channels` x `image_size`). port's model gets them as its first
argument, the reference by that name.

```python
result = verify("path/to/checkpoint", "4x2")
result.max_abs_diff, result.shape        # e.g. 4.3e-06, (2, 16, 50257)

class MyViT(eqx.Module):
    input_kind: ClassVar[str] = "pixel_values"   # verify feeds (2, C, H, W) float32 pixels
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from .._dtypes import CASTS
from .._errors import ConfigError, MappingError, PortError
from .._mapping import Mapping, import_object, mapping_for
from .._memory import available_host_bytes
from .._model import input_kind as declared_input_kind
from .._sources import Checkpoint
from .._text import quoted, size_text
from ._divergence import Divergence, first_divergence

INSTALL_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install transformers"
"""The CPU-only build of PyTorch (a plain `pip install torch` takes the CUDA one on Linux), then transformers."""


@dataclass(frozen=True)
class Verification:
    """What `verify` found: the largest absolute difference of the outputs, and what was compared.

    **Arguments:** (its fields)

    - `max_abs_diff`: the largest `|port - reference|` over every output element.
    - `max_abs_reference`: the largest `|reference|`, the scale `tolerance` is relative to.
    - `shape`, `dtype`: of port's output (`(2, 16, 50257)`, `"float32"`).
    - `reference`: the class and output compared with, `"GPT2LMHeadModel.logits"`.
    - `reference_error`: in a 16-bit dtype, how far the reference's own output in that
      dtype is from the reference in float32 (None in float32): the rounding noise two
      independent 16-bit runs each carry.
    - `roundtrip`: with `verify(roundtrip=True)`, the export compared bit for bit (`Roundtrip`).
    - `first_divergence`: where the outputs differ beyond the tolerance, the first module of
      the reference whose result port's model does not reproduce, each value judged against
      its own scale (`port.authoring.Divergence`: its `.modules`, each a
      `port.authoring.Suspect`: the reference's module, port's path, the layer); None when
      the outputs agree.
    - `bound`: the `tolerance` verify was given (None: the default, see `.tolerance`).

    ```python
    result = port.verify("gpt2", "4x2")
    ok = result.max_abs_diff <= result.tolerance
    if not ok:
        print(result.first_divergence)   # model.layers.0.input_layernorm -> blocks.mlp_norm (layer 0): ...
    ```
    """

    max_abs_diff: float
    max_abs_reference: float
    shape: tuple[int, ...]
    dtype: str
    reference: str
    reference_error: float | None = None
    roundtrip: Roundtrip | None = None
    first_divergence: Divergence | None = None
    bound: float | None = None

    @property
    def tolerance(self) -> float:
        """The bound `verify` was given as `tolerance`, else the default: 1e-4 (float32) or 2e-2 (16-bit)
        relative to max(1, max |reference|); in 16 bits at least twice `reference_error` (port's run and
        the reference's each round about that much)."""
        if self.bound is not None:
            return self.bound
        relative = (1e-4 if self.dtype == "float32" else 2e-2) * max(1.0, self.max_abs_reference)
        return max(relative, 2 * self.reference_error) if self.reference_error is not None else relative


@dataclass(frozen=True)
class Roundtrip:
    """`verify(roundtrip=True)`: the converted model exported back (`port.export`) and compared,
    tensor by tensor, bit for bit, with the checkpoint it came from.

    - `same`: tensors written back with the checkpoint's exact bytes, name, dtype and shape.
    - `differing`: the keys written back otherwise (empty when the round trip is exact).
    - `not_written`: checkpoint keys the export does not write (ignored or tied by the mapping).
    """

    same: int
    differing: tuple[str, ...]
    not_written: tuple[str, ...]

    @property
    def exact(self) -> bool:
        return not self.differing


def _torch():
    try:
        import torch
        import transformers
    except ImportError:
        raise PortError(f"port verify needs PyTorch and transformers: {INSTALL_TORCH}") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return torch


def positions(config: dict) -> tuple[str, int] | None:
    """The model's limit on positions: config.json's key that gives it (`n_positions`, else
    `max_position_embeddings`) and its value; None when it gives none."""
    for key in ("n_positions", "max_position_embeddings"):
        value = config.get(key)
        if value is not None:
            if type(value) is not int or value < 1:
                raise ConfigError(f"config.json: {key!r} must be a positive integer (the model's positions)")
            return key, value
    return None


def language(config: dict) -> dict:
    """The config of the language model: config.json itself, or a multimodal wrapper's
    `text_config` (Gemma 3, Llama 4, Mistral 3) when config.json has no `vocab_size` of its own."""
    text = config.get("text_config")
    return text if "vocab_size" not in config and isinstance(text, dict) else config


def token_shape(config: dict, batch: int, seq: int) -> tuple[int, int]:
    """The shape of `input_ids`' tokens, `(batch, seq)`, once `config` (or its `text_config`) has
    an integer `vocab_size` and `seq` is within its positions (`length=`, as verify's argument,
    names a `seq` beyond them)."""
    config = language(config)
    if type(config.get("vocab_size")) is not int:
        raise ConfigError("config.json: no integer 'vocab_size' to draw input ids from")
    limit = positions(config)
    if limit is not None and seq > limit[1]:
        raise PortError(f"length={seq}: more than the model's {limit[1]} positions (config.json's {limit[0]!r})")
    return batch, seq


def input_ids(config: dict, batch: int = 2, seq: int = 16, seed: int = 0) -> np.ndarray:
    """Random token ids within the vocabulary of `config`, `(batch, seq)`; `seq` within its positions."""
    shape = token_shape(config, batch, seq)
    return np.random.default_rng(seed).integers(0, language(config)["vocab_size"], shape)


def _size_pair(config: dict, key: str, default: int) -> tuple[int, int]:
    value = config.get(key, default)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, value
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        return value[0], value[1]
    raise ConfigError(f"config.json: {key!r} must be a positive integer or a list of two to draw pixel values")


def vision(config: dict) -> dict:
    """The config of the vision model: config.json itself, or a dual model's `vision_config`
    (CLIP, SigLIP) when config.json has no `image_size` of its own."""
    tower = config.get("vision_config")
    return tower if "image_size" not in config and isinstance(tower, dict) else config


def pixel_shape(config: dict, batch: int) -> tuple[int, int, int, int]:
    """The shape of `pixel_values`' images: (batch, num_channels, height, width) of `config`
    (or its `vision_config`)."""
    config = vision(config)
    channels = config.get("num_channels", 3)
    if not isinstance(channels, int) or isinstance(channels, bool) or channels <= 0:
        raise ConfigError("config.json: 'num_channels' must be a positive integer to draw pixel values")
    height, width = _size_pair(config, "image_size", 224)
    return batch, channels, height, width


def pixel_values(config: dict, batch: int = 2, seed: int = 0) -> np.ndarray:
    """Random float32 images, (batch, num_channels, height, width) of config's `image_size`.

    Standard normal values, the scale of normalised images. `image_size` is one integer
    (square) or [height, width]; `num_channels` defaults to 3, `image_size` to 224, as
    in transformers' `ViTConfig`.

    ```python
    pixel_values({"image_size": 16, "num_channels": 1}).shape   # (2, 1, 16, 16)
    ```
    """
    rng = np.random.default_rng(seed)
    return rng.standard_normal(pixel_shape(config, batch)).astype(np.float32)


def _positive(config: dict, key: str, what: str) -> int:
    value = config.get(key)
    if type(value) is not int or value < 1:
        raise ConfigError(f"config.json: {key!r} must be a positive integer to draw {what}")
    return value


def feature_shape(config: dict, batch: int) -> tuple[int, int, int]:
    """The shape of Whisper's `input_features`: (batch, num_mel_bins, 2 * max_source_positions),
    the only length its encoder takes."""
    mels = _positive(config, "num_mel_bins", "input features")
    return batch, mels, 2 * _positive(config, "max_source_positions", "input features")


def input_features(config: dict, batch: int = 2, seed: int = 0) -> np.ndarray:
    """Random float32 log-mel features, (batch, num_mel_bins, 2 * max_source_positions) of `config`.

    ```python
    input_features({"num_mel_bins": 8, "max_source_positions": 16}).shape   # (2, 8, 32)
    ```
    """
    return np.random.default_rng(seed).standard_normal(feature_shape(config, batch)).astype(np.float32)


def decoder_input_ids(config: dict, batch: int = 2, seq: int = 16, seed: int = 1) -> np.ndarray:
    """Random decoder token ids of an encoder-decoder, `(batch, seq)`, within its `vocab_size`;
    `seq` no more than its decoder's positions (`max_target_positions`, where it has them)."""
    shape = decoder_shape(config, batch, seq)
    return np.random.default_rng(seed).integers(0, _positive(config, "vocab_size", "decoder ids"), shape)


def decoder_shape(config: dict, batch: int, seq: int) -> tuple[int, int]:
    """The shape of an encoder-decoder's `decoder_input_ids`: `seq` no more than its decoder's positions."""
    limit = config.get("max_target_positions")
    return batch, min(seq, limit) if type(limit) is int and limit > 0 else seq


INPUTS: dict[str, Callable[..., np.ndarray]] = {
    "input_ids": input_ids,
    "pixel_values": pixel_values,
    "input_features": input_features,
    "decoder_input_ids": decoder_input_ids,
}
"""The inputs verify can draw, by the name a model class gives as `input_kind` (and the reference
takes), or a parameter of its call without a default (an encoder-decoder's `decoder_input_ids`,
a dual model's `pixel_values`)."""
INPUT_DTYPES = {"input_ids": np.int64, "pixel_values": np.float32, "input_features": np.float32,
                "decoder_input_ids": np.int64, "pixel_attention_mask": np.int32, "spatial_shapes": np.int64}  # fmt: skip
"""The dtype of each of `INPUTS`."""
TOKENS = ("input_ids", "decoder_input_ids")
"""The `INPUTS` that are token ids (drawn `length` long)."""


NAFLEX = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
"""SigLIP 2's variable-resolution image inputs: patches, which of them are real, each image's grid."""


def naflex_shape(config: dict, batch: int) -> tuple[int, int, int]:
    """The shape of NaFlex `pixel_values`: (batch, num_patches, num_channels * patch_size**2) of
    `config` (or its `vision_config`)."""
    config = vision(config)
    patches = _positive(config, "num_patches", "NaFlex patches") if "num_patches" in config else 256
    patch = _positive(config, "patch_size", "NaFlex patches") if "patch_size" in config else 16
    channels = _positive(config, "num_channels", "NaFlex patches") if "num_channels" in config else 3
    return batch, patches, channels * patch * patch


def naflex(config: dict, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random NaFlex images: the first a full square grid of `num_patches`, each next one a
    smaller grid of another aspect, its patches after the real ones zero and masked.

    ```python
    drawn = naflex({"num_patches": 16, "patch_size": 2}, batch=2)
    drawn["spatial_shapes"]                 # [[4, 4], [3, 2]]
    drawn["pixel_attention_mask"].sum(-1)   # [16, 6]
    ```
    """
    batch, patches, pixels = naflex_shape(config, batch)
    side = max(1, math.isqrt(patches))
    grids = [(side, side)] + [(max(1, side - i), max(1, side // (i + 1))) for i in range(1, batch)]
    mask = np.zeros((batch, patches), np.int32)
    for i, (rows, columns) in enumerate(grids):
        mask[i, : rows * columns] = 1
    values = np.random.default_rng(seed).standard_normal((batch, patches, pixels)).astype(np.float32)
    return {
        "pixel_values": values * mask[..., None],
        "pixel_attention_mask": mask,
        "spatial_shapes": np.asarray(grids, np.int64),
    }


def input_shape(kind: str, config: dict, batch: int, length: int, together: bool) -> tuple[int, ...]:
    """The shape of the input `kind` verify draws for `config`, `together` where the images are
    NaFlex's; a one-line `ConfigError` for a config that cannot give it (nothing drawn yet)."""
    if together and kind in NAFLEX:
        shape = naflex_shape(config, batch)
        return {"pixel_values": shape, "pixel_attention_mask": shape[:2], "spatial_shapes": (batch, 2)}[kind]
    shapes = {
        "input_ids": lambda: token_shape(config, batch, length),
        "decoder_input_ids": lambda: decoder_shape(config, batch, length),
        "pixel_values": lambda: pixel_shape(config, batch),
        "input_features": lambda: feature_shape(config, batch),
    }
    return shapes[kind]()


def draw(kind: str, config: dict, batch: int, length: int) -> np.ndarray:
    """Random inputs of `kind` (one of `INPUTS`) for `config`."""
    return INPUTS[kind](config, batch, length) if kind in TOKENS else INPUTS[kind](config, batch)


def also_taken(call: Callable, first: str) -> list[str]:
    """The `INPUTS` a model's call takes besides its `first` (`input_kind`): its parameters
    without a default named as one of them (T5's `decoder_input_ids`, CLIP's `pixel_values`)."""
    params = list(inspect.signature(call).parameters.values())[1:]  # self
    known = {*INPUTS, *NAFLEX}
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.name in known and p.name != first]


def input_kind(model_class: type) -> str:
    """The input a model class takes first (`port.Model`'s `input_kind`, by default `"input_ids"`),
    one of `INPUTS`."""
    kind = declared_input_kind(model_class)
    if kind not in INPUTS:
        raise PortError(
            f"{model_class.__module__}:{model_class.__qualname__}.input_kind is {kind!r}; "
            f"port verify draws {' or '.join(map(repr, INPUTS))}"
        )
    return kind


LABEL_BYTES = 700
"""What transformers' config takes for each label it builds from config.json's `num_labels`
(`id2label`, `label2id`, and the copies parsing makes): about 700 bytes, measured."""


def _refuse_quantized(config: dict) -> None:
    """Refuse a config.json with a `quantization_config`: transformers would quantize the reference
    (importing the method's packages), port would not."""
    quantization = config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ConfigError(
            f"config.json: 'quantization_config' (quant_method {quoted(method)}): "
            "port verify does not handle quantized checkpoints"
        )


def _check_labels(config: dict, available: int | None) -> None:
    """Refuse config.json's `num_labels` (without `id2label`: transformers then builds one label for
    each) when it is not an integer >= 0 or its labels take more memory than is `available`."""
    if "num_labels" not in config or config.get("id2label") is not None:
        return
    labels = config["num_labels"]
    if type(labels) is not int or labels < 0:
        raise ConfigError("config.json: 'num_labels' must be an integer >= 0 (the labels transformers builds)")
    need = labels * LABEL_BYTES
    if available is not None and need > available:
        raise ConfigError(
            f"config.json: 'num_labels' is {labels}: transformers would build that many labels, about "
            f"{size_text(need)}, more than the {size_text(available)} available"
        )


def _check_memory(
    ckpt: Checkpoint,
    mesh: Mesh,
    config: dict,
    inputs: tuple[int, ...],
    output: tuple[int, ...],
    named: str,
    padded: bool,
    available: int | None,
) -> None:
    """Refuse, before anything is allocated, a verify whose models and arrays take more memory than
    is `available`: the reference's parameters in float32 and port's model (where its devices are the
    host's CPUs), estimated from the checkpoint's headers; then the inputs of shape `inputs`, each
    model's `output` in float32 with the reference's own float32 run and their difference, and eager
    attention's scores of one layer. `named` starts a refusal of the second kind (`batch=2 and length=16`).
    """
    if available is None:
        return
    elements = sum(math.prod(info.shape) for info in ckpt.tensors.values())
    ours = sum(info.nbytes for info in ckpt.tensors.values())
    models = 4 * elements + (ours if any(d.platform == "cpu" for d in mesh.devices.flat) else 0)
    if models > available:
        raise PortError(
            f"{ckpt.directory}: the reference's parameters in float32 ({size_text(4 * elements)}) and port's "
            f"model take about {size_text(models)}, more than the {size_text(available)} available"
        )
    tokens = len(inputs) == 2
    batch, length = inputs[0], inputs[-1]
    heads = next((config[k] for k in ("num_attention_heads", "n_head") if type(config.get(k)) is int), 0)
    arrays = (
        2 * math.prod(inputs) * (8 * (3 if padded else 1) if tokens else 4)  # NumPy's and PyTorch's
        + 5 * 4 * math.prod(output)  # each model's, the reference's float32 run, the difference, its size
        + (2 * 4 * batch * heads * length**2 if tokens else 0)  # one layer's scores and their softmax
    )
    if arrays > available - models:
        raise PortError(
            f"{named}: the inputs {list(inputs)} and each model's outputs {list(output)} take about "
            f"{size_text(arrays)} with their copies, more than the {size_text(available - models)} available "
            "besides the models"
        )


@contextlib.contextmanager
def _weights_port_reads(ckpt: Checkpoint, config: dict) -> Iterator[Path]:
    """A temporary directory for the reference's `from_pretrained`: `config` as config.json, and links
    to the files `ckpt`'s tensors come from under the names transformers loads (with an index of them
    when there are several). Its reference is built from the weights port converted, whatever else
    the checkpoint's directory holds (a `pytorch_model.bin` beside a safetensors file of another
    name, both a `model.safetensors` and an index) or its config.json names (`transformers_weights`).
    """
    files: dict[Path, list[str]] = {}
    for key, info in ckpt.tensors.items():
        files.setdefault(Path(str(info.file)), []).append(key)
    pickled = any(path.suffix == ".bin" for path in files)
    suffix, single, index = (
        (".bin", "pytorch_model.bin", "pytorch_model.bin.index.json")
        if pickled
        else (".safetensors", "model.safetensors", "model.safetensors.index.json")
    )
    with tempfile.TemporaryDirectory(prefix="port-reference-") as temporary:
        root = Path(temporary)
        written = {k: v for k, v in config.items() if k != "transformers_weights"}
        (root / "config.json").write_text(json.dumps(written))
        if len(files) == 1:
            (root / single).symlink_to(next(iter(files)).absolute())
        else:
            names = {path: f"part-{i:05d}-of-{len(files):05d}{suffix}" for i, path in enumerate(files, 1)}
            for path, name in names.items():
                (root / name).symlink_to(path.absolute())
            weight_map = {key: names[path] for path, keys in files.items() for key in keys}
            (root / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        yield root


def _output(given: Any, mapping: Mapping, reference_cls: type, torch: Any) -> Any:
    """The tensor the mapping's `reference.output` names in the reference's output `given`."""
    name = mapping.reference["output"]
    value = getattr(given, name, None)
    if not isinstance(value, torch.Tensor):
        fields = ", ".join(map(repr, given.keys())) if hasattr(given, "keys") else type(given).__name__
        raise MappingError(
            f"{mapping.source}: 'reference.output' {quoted(name)} is not a tensor of "
            f"{reference_cls.__name__}'s output (it gives {fields})"
        )
    return value


def verify(
    model: str | os.PathLike,
    mesh: Mesh | str | dict[str, int] | None = None,
    mapping: str | os.PathLike | Mapping | None = None,
    dtype: str | None = None,
    *,
    batch: int = 2,
    length: int = 16,
    padding: str | None = None,
    roundtrip: bool = False,
    tolerance: float | None = None,
    locate: bool | None = None,
) -> Verification:
    """Convert a checkpoint onto a mesh, run it and the PyTorch reference on the same inputs, compare.

    Needs PyTorch and `transformers`; the inputs are random token ids (`input_ids`), or
    random images (`pixel_values`) or log-mel features (`input_features`) for a model class
    whose `input_kind` says so; and, given to both models, every other of those its call
    takes without a default (an encoder-decoder's `decoder_input_ids`, a dual model's
    `pixel_values`).

    **Arguments:**

    - `model`: a checkpoint directory or a Hugging Face repo id.
    - `mesh`: a `Mesh`, a spec such as `"4x2"` or `"data=2,model=4"`, or axis sizes
      (default: one device).
    - `mapping`: a `Mapping` or a mapping file naming a `reference`; default: the
      shipped one for `model_type`.
    - `dtype`: cast floating parameters (`"bfloat16"`, ...), and run the reference in it.
    - `batch`, `length`: the inputs' batch size and sequence length (token inputs, at most
      the model's positions); what they take is checked against the memory available.
    - `padding`: `"left"` or `"right"`: each sequence after the first padded by more
      positions, given to both models as `attention_mask` (and to a decoder's reference
      the positions `generate` would give, as port's decoders number them); only
      positions that are not padding are compared.
    - `roundtrip`: also export the converted model back (`port.export`, to a temporary
      directory) and compare every tensor with the checkpoint's, bit for bit (`.roundtrip`).
    - `tolerance`: the bound on the largest absolute difference (default: `.tolerance`'s).
    - `locate`: find the first module whose result differs (`.first_divergence`), by running
      both models again with their modules recorded: True always, False never, None (the
      default) when the outputs differ beyond the tolerance.

    Returns a `Verification`: `.max_abs_diff`, and its default bound `.tolerance`.

    ```python
    result = port.verify("gpt2", "4x2")
    result.max_abs_diff <= result.tolerance     # True: e.g. 4.3e-06, under 1e-4 x max |logit|
    ```
    """
    import equinox as eqx
    import jax

    from .._convert import convert
    from .._meshes import mesh_shape
    from .._runtime import as_mesh
    from .._skeleton import skeleton
    from .._sources import open_checkpoint, resolve

    if isinstance(mesh, str):
        mesh_shape(mesh)  # a bad spec is told before PyTorch loads
    for name, value in (("batch", batch), ("length", length)):
        if type(value) is not int or value < 1:
            raise PortError(f"{name}={value!r}: expected a positive integer")
    if tolerance is not None and (
        isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0
    ):
        raise PortError(f"tolerance={tolerance!r}: expected a number >= 0")
    if padding not in (None, "left", "right"):
        raise PortError(f"padding={padding!r}: expected 'left' or 'right'")
    if roundtrip and dtype is not None:
        raise PortError(f"roundtrip compares bit for bit: it cannot with dtype={dtype!r} (a cast)")
    torch = _torch()
    mesh = as_mesh(mesh)  # before JAX starts: it simulates the CPU devices the mesh needs
    directory = resolve(model)
    with open_checkpoint(directory) as ckpt:
        config = ckpt.config
        mapping = mapping_for(config, mapping, keys=ckpt.tensors)
        if not mapping.reference:
            raise MappingError(f"{mapping.source}: no 'reference' (the PyTorch class to compare with)")
        _refuse_quantized(config)
        _check_labels(config, available_host_bytes())
        built = mapping.model_object()
        kind = input_kind(built)
        own = dict(mapping.model_config(config))  # a tower's own config, of a dual model's
        # A bad config, and what the flags ask of memory, are told before anything is allocated.
        if kind == "input_ids":
            shape, named = token_shape(own, batch, length), f"batch={batch} and length={length}"
        else:
            if padding is not None:
                raise PortError(f"padding={padding!r}: {mapping.model} takes {kind}, not token ids")
            shapes = {"pixel_values": pixel_shape, "input_features": feature_shape}
            shape, named = shapes[kind](own, batch), f"batch={batch}"
        skel = skeleton(mapping, config)
        if not callable(skel):
            raise PortError(
                f"{mapping.source}: model {mapping.model} builds a {type(skel).__name__}, which verify cannot call"
            )
        takes = inspect.signature(type(skel).__call__).parameters
        if padding is not None and "attention_mask" not in takes:
            raise PortError(f"padding={padding!r}: {mapping.model} takes no attention_mask")
        taken = also_taken(type(skel).__call__, kind)
        together = {*NAFLEX} <= {kind, *taken}  # SigLIP 2's images: patches, their mask, each image's grid
        shape = input_shape(kind, own, batch, length, together) if together else shape

        def abstract(name: str) -> jax.ShapeDtypeStruct:  # int32 without x64
            dtype = jax.dtypes.canonicalize_dtype(INPUT_DTYPES[name])
            return jax.ShapeDtypeStruct(input_shape(name, own, batch, length, together), dtype)

        given = jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(INPUT_DTYPES[kind]))
        output = eqx.filter_eval_shape(lambda m, x, e: m(x, **e), skel, given, {n: abstract(n) for n in taken}).shape
        _check_memory(ckpt, mesh, own, shape, output, named, padding is not None, available_host_bytes())
        drawn = naflex(own, batch) if together else {}
        extras = {name: drawn[name] if name in drawn else draw(name, own, batch, length) for name in taken}
        inputs = drawn[kind] if kind in drawn else draw(kind, own, batch, length)
        mask = None if padding is None else padding_mask(inputs.shape, padding)
        # A decoder numbers a padded batch's positions as transformers' `generate` does (the mask's
        # cumulative sum, less one); its reference is given the same, which its forward alone would not.
        positions = None if mask is None or "positions" not in takes else np.where(mask, np.cumsum(mask, -1) - 1, 0)
        conversion = convert(ckpt, skel, mapping, mesh, dtype=dtype)
        converted = conversion.model
        written = _roundtrip(converted, ckpt, mapping) if roundtrip else None
        # Eager attention and experts: the reference code as written, in any dtype (torch's grouped
        # matmul for experts refuses bfloat16 weights whose strides are not multiples of 16 bytes).
        # Built from the files port read, with the config port read: it compares the same weights.
        reference_cls = import_object(mapping.reference["class"], f"{mapping.source}: reference")
        with _weights_port_reads(ckpt, config) as weights:
            reference = reference_cls.from_pretrained(
                weights, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
            ).eval()

    # Full float32 matrix products: an accelerator's default (TF32 on NVIDIA GPUs since Ampere,
    # bfloat16 passes on TPU) differs from PyTorch's CPU float32 by about 1e-2 of the logits,
    # which would hide a wrong mapping at the tolerance verify applies.
    def call_model(model) -> np.ndarray:
        with jax.default_matmul_precision("highest"):
            if mask is None:
                return np.asarray(eqx.filter_jit(lambda m, x, e: m(x, **e))(model, inputs, extras))
            return np.asarray(
                eqx.filter_jit(lambda m, x, a, e: m(x, attention_mask=a, **e))(model, inputs, mask, extras)
            )

    ours = call_model(converted)
    torch_dtype = getattr(torch, str(ours.dtype)) if str(ours.dtype) in CASTS else torch.float32

    def run() -> np.ndarray:
        with torch.no_grad():
            first = torch.tensor(inputs)  # features in the reference's dtype: Whisper's conv1d does not cast them
            first = first.to(next(reference.parameters()).dtype) if first.is_floating_point() else first
            given = {kind: first} | ({} if mask is None else {"attention_mask": torch.tensor(mask)})
            given |= {name: torch.tensor(value) for name, value in extras.items()}
            given |= {} if positions is None else {"position_ids": torch.tensor(positions)}
            return _output(reference(**given), mapping, reference_cls, torch).float().numpy()

    theirs, reference_error = run(), None
    if torch_dtype != torch.float32:  # the reference rounded as port's run is, and how far that is from float32
        exact = theirs
        reference.to(torch_dtype)
        theirs = run()
        reference_error = float(np.abs(theirs - exact).max())
    if theirs.shape != ours.shape:
        raise PortError(f"output shapes differ: port {list(ours.shape)}, {reference_cls.__name__} {list(theirs.shape)}")
    shape, dtype_name = ours.shape, str(ours.dtype)
    if mask is not None:  # padding's positions carry no meaning: compared are the others
        kept = mask.astype(bool)
        ours, theirs = ours[kept], theirs[kept]
    result = Verification(
        float(np.abs(ours.astype(np.float32) - theirs).max()),
        float(np.abs(theirs).max()),
        shape,
        dtype_name,
        f"{reference_cls.__name__}.{mapping.reference['output']}",
        reference_error,
        written,
        bound=None if tolerance is None else float(tolerance),
    )
    if locate is False or (locate is None and result.max_abs_diff <= result.tolerance):
        return result
    found = first_divergence(
        converted,
        conversion.plan,
        mapping,
        reference,
        call_model,
        run,
        (result.max_abs_diff, result.max_abs_reference),
        result.tolerance / max(1.0, result.max_abs_reference),
        mask,
        (available_host_bytes(), named),
    )
    return dataclasses.replace(result, first_divergence=found)


def padding_mask(shape: tuple[int, ...], side: str) -> np.ndarray:
    """An `attention_mask` for token inputs of `shape` (batch, length): sequence `i` padded by
    `i * length // (2 * batch)` positions on `side` (the first not at all, none padded whole).

    ```python
    padding_mask((2, 8), "left")   # [[1 1 1 1 1 1 1 1], [0 0 0 1 1 1 1 1]]
    ```
    """
    batch, length = shape
    mask = np.ones(shape, np.int64)
    for i in range(batch):
        pad = min(length - 1, i * length // (2 * batch) + (1 if i else 0))
        if pad:
            mask[i, :pad] = 0 if side == "left" else 1
            if side == "right":
                mask[i, length - pad :] = 0
    return mask


def _roundtrip(model, ckpt, mapping: Mapping) -> Roundtrip:
    """Export `model` to a temporary directory and compare each tensor written with `ckpt`'s."""
    import tempfile
    from pathlib import Path

    from .._export import export
    from .._sources import open_checkpoint

    with tempfile.TemporaryDirectory(prefix="port-roundtrip-") as temporary:
        out = export(model, Path(temporary) / "export", ckpt, mapping=mapping)
        with open_checkpoint(out) as back:
            same, differing = 0, []
            for key, info in back.tensors.items():
                original = ckpt.tensors.get(key)
                whole = tuple((0, n) for n in info.shape)
                if (
                    original is None
                    or original.dtype != info.dtype
                    or original.shape != info.shape
                    or ckpt.read(key, whole).tobytes() != back.read(key, whole).tobytes()
                ):
                    differing.append(key)
                else:
                    same += 1
            not_written = tuple(sorted(set(ckpt.tensors) - set(back.tensors)))
    return Roundtrip(same, tuple(differing), not_written)
