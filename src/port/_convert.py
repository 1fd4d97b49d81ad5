"""Convert: the whole pipeline in one call, source -> mapping -> skeleton -> plan -> place -> fill -> save.

`convert` is the one chain of steps: the command line's `port convert` calls it and
only formats what it returns. Everything is checked before a tensor byte is read
(the plan, the output directory and its free space, and in a multi-process run
that every process was given the same settings).

```python
import port

run = port.convert("gpt2", mesh="4x2", out="gpt2-jax")   # a Conversion
run.model                     # a sharded port.models.gpt2.GPT2
run.report.bytes_read         # 497758208
model = port.load("gpt2", mesh="4x2")                     # just the model

skel = port.skeleton(MyModel, config)                       # your own module
model = port.convert("ckpt/", skel, "my_mapping.toml", "2x2").model
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._adapters import Adapter, MergedCheckpoint, open_adapter
from ._destination import check_free
from ._dtypes import floating
from ._errors import PortError
from ._fill import fill
from ._mapping import Mapping, mapping_for
from ._memory import PeakMemory, check_host_memory
from ._meshes import mesh_spec
from ._output import Saving, check_out, port_version
from ._place import place
from ._plan import LAYER_COUNTS, LeafPlan, Plan, layer_count_key, partition, plan
from ._runtime import agree, as_mesh
from ._skeleton import own_state
from ._skeleton import skeleton as make_skeleton
from ._sources import Checkpoint, open_checkpoint
from ._sources._quantized import describe
from ._sources._remote import over_read_ratio
from ._targets import leaves


@dataclass(frozen=True)
class Progress:
    """Where a conversion is: `phase` "read" (reading and placing) or "write", bytes done of total."""

    phase: str
    done: int
    total: int
    leaves_done: int
    leaves: int


@dataclass(frozen=True)
class Report:
    """What a conversion did: seconds per phase, bytes read, bytes per device, peak host memory,
    and the version of port that did it."""

    process: int
    num_processes: int
    out: str | None
    mesh: dict[str, int]
    dtype: str | None
    seconds: float
    place_seconds: float
    save_seconds: float
    params: int
    bytes_read: int
    device_bytes: dict[str, int]
    peak_host_bytes: int
    kept: tuple[str, ...] = ()  # leaves not filled from the checkpoint (strict=False): the model's own values
    unused: tuple[str, ...] = ()  # checkpoint keys the mapping does not use (strict=False)
    port_version: str = ""  # the version of port that ran it (and wrote `out`'s metadata)
    adapter: str | None = None  # the PEFT adapter loaded onto the checkpoint (`adapter=`), as named
    adapter_mode: str | None = None  # how: "merge" or "keep"
    adapter_bytes_read: int = 0  # of `bytes_read`, the bytes read from the adapter
    bytes_over_read: int = 0  # fetched beside `bytes_read` and discarded: a remote source's gaps (`max_over_read`)

    def to_json(self) -> dict[str, Any]:
        """The report as `port convert --report` writes it."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Conversion:
    """The result of `convert`: the sharded model, the plan it followed, and the report."""

    model: Any
    plan: Plan
    report: Report


def written_back(recipe: Plan, tensors: AnyMapping[str, Any]) -> dict[str, Any]:
    """The headers, in the checkpoint's order, of the tensors the plan reads: what an output
    records for `port export`, which writes back exactly those. Ignored buffers, tied
    duplicates and unused keys are left out (export leaves them out too), so the metadata
    grows with the model, not with what else the checkpoint holds (1.35M ignored tensors
    once made it larger than `restore` reads back).

    ```python
    written_back(recipe, ckpt.tensors)     # {"transformer.wte.weight": TensorInfo(...), ...}
    ```
    """
    used = {key for leaf in recipe.leaves for key in leaf.keys}
    return {key: info for key, info in tensors.items() if key in used}


def stored_as(recipe: Plan) -> dict[str, str]:
    """How each leaf the plan reads from a quantized source was stored there, by its path:
    what an output records for `port info`.

    ```python
    stored_as(recipe)     # {"blocks.mlp.down": "fp8 e4m3fn, 128x128 blocks, scales weight_scale_inv float32"}
    ```
    """
    described = {leaf.path: describe(leaf.source) for leaf in recipe.leaves}
    return {path: text for path, text in described.items() if text is not None}


def fingerprint(checkpoint: Checkpoint) -> str:
    """A digest of a checkpoint's config and tensor headers: equal for the same checkpoint on every host."""
    headers = sorted((k, t.dtype.name, list(t.shape)) for k, t in checkpoint.tensors.items())
    text = json.dumps([checkpoint.config, headers], sort_keys=True, default=str)
    return f"config and headers sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"


def convert(
    checkpoint: str | os.PathLike | Checkpoint,
    skeleton: Any = None,
    mapping: str | os.PathLike | Mapping | None = None,
    mesh: Mesh | str | None = None,
    *,
    dtype: str | np.dtype | None = None,
    out: str | os.PathLike | None = None,
    force: bool = False,
    progress: Callable[[Progress], None] | None = None,
    include: Sequence[str] | None = None,
    layers: range | None = None,
    strict: bool = True,
    adapter: str | os.PathLike | None = None,
    adapter_mode: str = "merge",
    max_over_read: float | None = None,
) -> Conversion:
    """Convert a checkpoint into a sharded model, and save it to `out` if given.

    **Arguments:**

    - `checkpoint`: a checkpoint directory, a Hugging Face repo id, or an opened `Checkpoint`.
    - `skeleton`: the module to fill (`port.skeleton(MyModel, config)`); default: the
      mapping's model built from the checkpoint's `config.json`.
    - `mapping`: a `Mapping` or a mapping file; default: the shipped one for `model_type`.
    - `mesh`: a `Mesh` or a spec such as `"4x2"` or `"data=2,model=4"` (default: one device).
    - `dtype`: cast floating parameters (`"bfloat16"`, ...); default: keep the checkpoint's.
    - `out`: write the model there as an Orbax checkpoint (`port.restore` reads it back);
      `force` replaces an earlier port output there, and nothing else.
    - `progress`: called with a `Progress` after each leaf is placed, and (phase
      "write") as each chunk of the output is written.
    - `include`: only the leaves these module-path patterns select (`["wte", "blocks"]`:
      a path, a dotted prefix, or a glob such as `"blocks.attn.*"`); the others are None
      and none of their bytes are read. An output records it, for `port.restore`.
    - `layers`: a contiguous range of the checkpoint's layers (`range(0, 12)`): the model
      is built with that many layers (its config, and the output's, says so) and only
      those layers' tensors are read.
    - `strict`: False fills a model (a concrete module of yours) from a checkpoint that
      covers part of it: leaves the mapping does not name, or whose keys the checkpoint
      lacks, keep their values (placed on the mesh: sharded by their mapping entry's
      axes if they have one, else replicated), and checkpoint keys the mapping does not
      use are allowed. `report.kept` and `report.unused` list both.
    - `adapter`: a PEFT LoRA adapter (a directory with `adapter_config.json` and
      `adapter_model.safetensors`, a Hub id or a URL) applied to the checkpoint; it is
      checked against the checkpoint's headers before any tensor byte is read.
    - `adapter_mode`: `"merge"` (default) reads each adapted weight's blocks merged,
      `base + scale * B @ A`, from only the factor rows and columns each block needs;
      `"keep"` gives the model `port.nn.LoRA` nodes at the adapted weights (the base
      frozen, the factors trainable). See docs/adapters.md.
    - `max_over_read`: a URL's reads may fetch up to this many times the bytes they need,
      one request spanning the gaps between the stretches wanted (a number >= 1; default 2;
      1: exact ranges); `report.bytes_over_read` counts the discarded bytes. Local files
      are read exactly unless it is given; a `Checkpoint` already opened keeps
      `open_checkpoint`'s setting.

    Returns a `Conversion`: `.model`, `.plan`, `.report`.

    ```python
    run = convert("gpt2", mesh="4x2", out="gpt2-jax", progress=print)
    ```
    """
    start = time.perf_counter()
    check_adapter_mode(adapter_mode)
    ratio = None if max_over_read is None else over_read_ratio(max_over_read)
    owned = not isinstance(checkpoint, Checkpoint)
    with PeakMemory() as peak, contextlib.ExitStack() as stack:
        ckpt = open_checkpoint(checkpoint, ratio) if owned else checkpoint
        base, opened = ckpt, None
        try:
            if adapter is not None:
                opened = open_adapter(adapter, base, base_name=str(checkpoint) if owned else None)
            mapping = mapping_for(ckpt.config, mapping, keys=ckpt.tensors)
            config = with_layers(ckpt.config, layers)
            built = skeleton is None
            if built:
                skeleton = make_skeleton(mapping, config)
            if opened is not None:
                mapping, ckpt, skeleton = with_adapter(mapping, config, base, opened, adapter_mode, skeleton)
                config = with_layers(ckpt.config, layers)  # a kept adapter is recorded in it, for restore
            if out is not None:
                inputs = (base.directory,) if opened is None else (base.directory, opened.checkpoint.directory)
                out = check_out(out, force, inputs=inputs)
            mesh = as_mesh(mesh)
            include = None if include is None else list(include)
            recipe = plan(
                skeleton,
                mapping,
                ckpt.tensors,
                config,
                mesh.shape,
                dtype,
                include=include,
                layers=layers,
                strict=strict,
            )
            kept = kept_values(skeleton, recipe)
            own = {} if built else own_values(skeleton, recipe)
            check_host_memory(recipe.device_bytes, mesh, f"mesh={mesh_spec(dict(mesh.shape))}")
            if out is not None:
                check_free(out, recipe.nbytes)
            agree(
                {
                    "mesh": mesh_spec(dict(mesh.shape)),
                    "dtype": None if dtype is None else str(dtype),
                    "out": None if out is None else str(out),
                    "force": force,
                    "mapping": mapping.text,  # its text: the file may sit at another path on each host
                    "include": include,
                    "layers": None if layers is None else [layers.start, layers.stop],
                    "strict": strict,
                    "checkpoint": fingerprint(base),
                    "adapter": None if opened is None else [adapter_mode, fingerprint(opened.checkpoint)],
                }
            )
            count, placed, writing = len(recipe.leaves), 0, None

            def wrote(done: int, total: int) -> None:  # reported once placing is over: the write's tail
                if progress is not None and writing is not None:
                    assert saving is not None  # this is its callback: called once it writes
                    progress(Progress("write", done, total, saving.leaves_written, count))

            saving = stack.enter_context(Saving(out, force, wrote)) if out is not None else None

            def advance(leaf: LeafPlan, array: jax.Array) -> None:
                nonlocal placed
                placed += 1
                if saving is not None:  # written while the next leaves are placed
                    saving.add(leaf.path, array)
                if progress is not None:  # the plan's total counts the base's bytes: a merged adapter's are apart
                    done = ckpt.base.bytes_read if isinstance(ckpt, MergedCheckpoint) else ckpt.bytes_read
                    progress(Progress("read", done, recipe.read_bytes, placed, count))

            if progress is not None:
                progress(Progress("read", 0, recipe.read_bytes, 0, count))
            placing = time.perf_counter()
            arrays = place(recipe, ckpt, mesh, advance)
            extra = place_kept(kept, mapping, mesh, dtype)
            if saving is not None:
                for path, array in extra.items():
                    saving.add(path, array)
            arrays |= extra
            count += len(extra)  # kept values are written too
            replicated = NamedSharding(mesh, PartitionSpec())
            state = own_state(mapping, config, list(recipe.own), replicated) if built and recipe.own else {}
            state |= place_kept(own, mapping, mesh)
            model = fill(skeleton, arrays | state | dict.fromkeys(recipe.excluded))
            jax.block_until_ready(arrays)
            writing = time.perf_counter()
            if saving is not None:
                out = saving.finish(
                    model,
                    mapping,
                    config,
                    sources=written_back(recipe, ckpt.tensors),
                    include=include,
                    quantized=stored_as(recipe),
                )
            done = time.perf_counter()
        finally:
            if opened is not None:
                opened.checkpoint.close()
            if owned:
                base.close()
    device_bytes: dict[str, int] = {}
    for array in arrays.values():
        for shard in array.addressable_shards if array is not None else ():
            device_bytes[str(shard.device.id)] = device_bytes.get(str(shard.device.id), 0) + shard.data.nbytes
    report = Report(
        process=jax.process_index(),
        num_processes=jax.process_count(),
        out=None if out is None else str(out),
        mesh=dict(mesh.shape),
        dtype=None if dtype is None else str(dtype),
        seconds=round(time.perf_counter() - start, 3),
        place_seconds=round(writing - placing, 3),
        save_seconds=round(done - writing, 3),
        params=recipe.params,
        bytes_read=ckpt.bytes_read,
        device_bytes=device_bytes,
        peak_host_bytes=peak.bytes,
        kept=recipe.kept,
        unused=recipe.unused,
        port_version=port_version(),
        adapter=None if opened is None else opened.source,
        adapter_mode=None if opened is None else adapter_mode,
        adapter_bytes_read=0 if opened is None else opened.checkpoint.bytes_read,
        bytes_over_read=base.bytes_over_read + (0 if opened is None else opened.checkpoint.bytes_over_read),
    )
    return Conversion(model, recipe, report)


ADAPTER_MODES = ("merge", "keep")
"""How `adapter=` is loaded: merged into the weights as they are read, or kept as `port.nn.LoRA` nodes."""


def check_adapter_mode(mode: Any) -> None:
    """A PortError naming `adapter_mode=` unless it is one of `ADAPTER_MODES`."""
    if mode not in ADAPTER_MODES:
        raise PortError(f"adapter_mode={mode!r}: expected 'merge' or 'keep'")


def with_adapter(
    mapping: Mapping, config: AnyMapping[str, Any], base: Checkpoint, adapter: Adapter, mode: str, skeleton: Any
) -> tuple[Mapping, Checkpoint, Any]:
    """The mapping, checkpoint and skeleton a load with `adapter` runs on: merged, the base's mapping and
    skeleton over a `MergedCheckpoint`; kept, the mapping extended with the factors (`keep`), the union of
    both checkpoints, and the skeleton with `port.nn.LoRA` nodes at the adapted leaves."""
    if mode == "merge":
        return mapping, MergedCheckpoint(base, adapter), skeleton
    from ._adapters._kept import keep

    kept = keep(mapping, config, base, adapter)
    return kept.mapping, kept.checkpoint, kept.skeleton(skeleton)


def with_layers(config: AnyMapping[str, Any], layers: range | None) -> dict[str, Any]:
    """`config` for a model of only `layers` (a contiguous range of the checkpoint's layers):
    its layer count set to their number, and per-layer lists (`layer_types`) cut to them.

    ```python
    with_layers({"n_layer": 12, "n_embd": 768}, range(0, 6))   # {"n_layer": 6, "n_embd": 768}
    ```
    """
    if layers is None:
        return dict(config)
    if not isinstance(layers, range) or layers.step != 1:
        raise PortError(f"layers={layers!r}: expected a contiguous range of layers, such as range(0, 12)")
    key = layer_count_key(config)
    if key is None:
        raise PortError(f"layers={layers!r}: config.json has no layer count ({', '.join(LAYER_COUNTS)})")
    n = config[key]
    if not 0 <= layers.start < layers.stop <= n:
        raise PortError(f"layers={layers!r}: outside the checkpoint's {n} layers (range(0, {n}) at most)")
    cut = {k: v[layers.start : layers.stop] for k, v in config.items() if isinstance(v, list) and len(v) == n}
    return {**config, **cut, key: len(layers)}


def kept_values(model: Any, recipe: Plan) -> dict[str, Any]:
    """The values of the leaves a non-strict plan keeps, refusing a skeleton's (it has none)."""
    by_path = leaves(model)
    kept = {path: by_path[path] for path in recipe.kept}
    for path, value in kept.items():
        if isinstance(value, jax.ShapeDtypeStruct):
            raise PortError(
                f"leaf '{path}' is not filled from the checkpoint and the model has no value for it: "
                "pass a concrete module (not a skeleton) with strict=False"
            )
    return kept


def own_values(model: Any, recipe: Plan) -> dict[str, Any]:
    """The values of the module's own state a plan does not fill (an NNX module's RNG key and count),
    from a module given as the skeleton: it must hold them (`nnx.eval_shape` leaves them shapes only)."""
    by_path = leaves(model)
    for path in recipe.own:
        if isinstance(by_path[path], jax.ShapeDtypeStruct):
            raise PortError(
                f"leaf '{path}' is the module's own state, which the checkpoint does not fill, and the skeleton "
                "has no value for it: name the module's class or factory in the mapping (model = ...) and let "
                "port build it, or pass a module whose non-parameter variables hold values"
            )
    return {path: by_path[path] for path in recipe.own}


def place_kept(
    kept: AnyMapping[str, Any], mapping: Mapping, mesh: Mesh, dtype: str | np.dtype | None = None
) -> dict[str, jax.Array]:
    """The kept leaves on `mesh`: sharded as their mapping entry's axes say, replicated without one;
    floating ones cast to `dtype` if given."""
    placed = {}
    for path, value in kept.items():
        spec = PartitionSpec()
        entry = mapping.entry(path)
        axes = () if entry is None or entry.axes is None else entry.axes
        if len(axes) == len(value.shape):
            spec, _ = partition(tuple(value.shape), axes, mapping.rules, mesh.shape)
        if dtype is not None and floating(np.dtype(value.dtype)):
            value = value.astype(dtype)
        placed[path] = jax.device_put(value, NamedSharding(mesh, spec))
    return placed


def load(
    model: str | os.PathLike,
    mesh: Mesh | str | None = None,
    dtype: str | np.dtype | None = None,
    mapping: str | os.PathLike | Mapping | None = None,
    *,
    include: Sequence[str] | None = None,
    layers: range | None = None,
    skeleton: Any = None,
    adapter: str | os.PathLike | None = None,
    adapter_mode: str = "merge",
    max_over_read: float | None = None,
) -> Any:
    """A pretrained model from a checkpoint, sharded on `mesh`: `convert(...).model`.

    **Arguments:**

    - `model`: a checkpoint directory or a Hugging Face repo id.
    - `mesh`: a `Mesh` or a spec such as `"4x2"` or `"data=2,model=4"` (default: one device).
    - `dtype`: cast floating parameters (`"bfloat16"`, ...); default: keep the checkpoint's.
    - `mapping`: a `Mapping` or a mapping file; default: the shipped one for `config.json`'s
      `model_type`, whose module is the model built.
    - `include`: only the leaves these module-path patterns select (the others None).
    - `layers`: only this contiguous range of the checkpoint's layers (a smaller model).
    - `skeleton`: the tree to fill, given directly: any pytree of `jax.ShapeDtypeStruct`
      (a Linen or MaxText parameter dict), an Equinox or Flax NNX module from `eval_shape`;
      its key paths are what the mapping's paths name. Default: what the mapping's `model`
      builds from `config.json`.
    - `adapter`: a PEFT LoRA adapter (directory, Hub id or URL) applied to the checkpoint.
    - `adapter_mode`: `"merge"` (default: merged into the weights as they are read) or
      `"keep"` (`port.nn.LoRA` nodes at the adapted weights, the factors trainable).
    - `max_over_read`: a URL's reads may fetch up to this many times the bytes they need
      (default 2; 1: exact ranges; local files are read exactly unless it is given).

    ```python
    model = load("gpt2", mesh="4x2")
    tuned = load("tiny-llama", mesh="4x2", adapter="tiny-llama-lora")              # merged
    stage = load("gpt2", mesh="4x2", layers=range(0, 6), include=["blocks"])
    params = load("ckpt/llama", "4x2", mapping="linen.toml", skeleton=shapes)   # the same dict, of arrays
    ```
    """
    return convert(
        model,
        skeleton,
        mapping=mapping,
        mesh=mesh,
        dtype=dtype,
        include=include,
        layers=layers,
        adapter=adapter,
        adapter_mode=adapter_mode,
        max_over_read=max_over_read,
    ).model
