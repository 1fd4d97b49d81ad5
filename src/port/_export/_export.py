"""Export: the way back, a sharded model -> a Hugging Face directory, by the same mapping.

The plan is walked backwards (`_invert`): every source tensor becomes one output tensor,
with the source's name, shape and dtype. Each is assembled on the host from the device
shards that hold it (a replicated block once, `_blocks`), inverted, and written at its
offset in its safetensors file (`_safetensors`) by a background thread while the next
is assembled, in a fixed ring of host memory (`_staging`, 1.25x the largest tensor).
In a multi-process run each process writes the blocks its devices hold. With
`quantize="fp8"` the Linear weights are written in FP8 with block scales (`_quantize`),
each quantized as it is assembled.

```python
model = port.load("gpt2", mesh="4x2")
...                                              # train it
port.export(model, "gpt2-hf", "gpt2")            # the source: names, shapes, dtypes
port.export(port.restore("gpt2-jax"), "gpt2-hf", "gpt2-jax", force=True)
port.export(model, "gpt2-fp8", "gpt2", quantize="fp8", quantize_block=(128, 128))
```

The output directory is written under a hidden temporary name and renamed into place
when complete (`_destination`), as `port convert`'s is: a failed or interrupted export
leaves nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Callable
from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._adapters._kept import plain
from .._convert import Progress
from .._destination import check_destination, check_free, make_partial, partial_path, put_in_place, writing
from .._dtypes import dtype as dtype_named
from .._errors import CheckpointError, ConfigError, OutputError, PlanError, PortError, RunError
from .._mapping import CARRIED, Mapping, TextExport, mapping_for
from .._memory import PeakMemory
from .._model import is_model
from .._output import Output, port_version, read_output
from .._output._restore import model_class
from .._plan import Plan, is_none, plan
from .._runtime import exchange, num_processes
from .._skeleton import describe_model, skeleton
from .._sources import Checkpoint, TensorInfo, open_checkpoint, raw_header
from .._targets import is_nnx, leaves, target_of
from .._text import quoted
from ..nn._lora import merged
from ._blocks import Block, block_data, blocks, extent, gather, local_shards
from ._derive import derive
from ._invert import Inverse, invert
from ._quantize import Quantization, Target, plan_fp8, scales_reader, write_quantized
from ._quantize_args import DEFAULT_BLOCK, check_method, parse_block
from ._report import ExportReport, blocks_held, mesh_of
from ._safetensors import INDEX, SINGLE, OutTensor, Writer, parse_size
from ._staging import Staging

PRODUCER = "port"  # safetensors metadata `producer`: how `force` knows an export is port's
_EXPORT = "a port export (config.json and port's safetensors files only)"
"""What `force` may replace at `export`'s `out`, as messages say it (see `is_export`)."""


class _Written:
    """Bytes and blocks written so far, counted on the writing thread, reported as `Progress` on the caller's."""

    def __init__(self, total: int, steps: int, progress: Callable[[Progress], None] | None):
        self.total, self.steps, self.bytes, self.count = total, steps, 0, 0
        self._progress, self._lock, self._reported = progress, threading.Lock(), None
        self.report()

    def __call__(self, written: tuple[int, int]) -> None:
        with self._lock:
            self.bytes, self.count = self.bytes + written[0], self.count + written[1]

    def report(self) -> None:
        with self._lock:
            now = (self.bytes, self.count)
        if self._progress is not None and now != self._reported:
            self._reported = now
            self._progress(Progress("write", now[0], self.total, now[1], self.steps))


def _write_whole(writer: Writer, key: str, data: np.ndarray, blocks: int) -> tuple[int, int]:
    writer.write(key, data)
    return data.nbytes, blocks


def _write_box(writer: Writer, key: str, region: tuple, data: np.ndarray) -> tuple[int, int]:
    return writer.write_region(key, region, data), 1


def _write_quantized_whole(
    writer: Writer, target: Target, data: np.ndarray, kept: np.ndarray | None, blocks: int
) -> tuple[int, int]:
    return write_quantized(writer, target, data, tuple((0, n) for n in data.shape), kept)[0], blocks


def _write_blocks(
    mine: list[Block],
    inverse: Inverse,
    arrays: AnyMapping[str, Any],
    writer: Writer,
    written: _Written,
    quantization: Quantization | None = None,
    read_scales: Callable[[Target, tuple], np.ndarray | None] | None = None,
) -> None:
    """Write this process's blocks, assembling the next output while a thread writes the last.

    A tensor this process holds all of is assembled whole and written in one go; its
    share of a tensor other processes hold the rest of, block by block. Either way the
    output is assembled in `Staging` memory of 1.25x the largest (so host memory stays
    within that, whatever the model's size), and straight in the output dtype. A tensor
    `quantization` writes in FP8 is quantized on the writing thread, a row of blocks at
    a time, from the assembled tensor (or box); the source's scales it may keep
    (`read_scales`) are read here first.
    """
    specs = {t.key: t for t in inverse.tensors}
    targets = {} if quantization is None else quantization.targets
    by_key: dict[str, list[Block]] = {}
    for block in mine:
        by_key.setdefault(block.key, []).append(block)
    whole = {key: sum(extent(b.regions[0]) for b in own) == math.prod(specs[key].shape) for key, own in by_key.items()}
    largest = max(
        (
            specs[key].nbytes if whole[key] else max(extent(b.regions[0]) for b in own) * specs[key].dtype.itemsize
            for key, own in by_key.items()
        ),
        default=0,
    )
    shards: dict[str, dict[tuple, Any]] = {}  # references to each leaf's local blocks: no copies
    with Staging(largest + largest // 4, done=written) as staging:
        for key, own in by_key.items():
            spec, source_dtype, target = specs[key], inverse.source_dtypes[key], targets.get(key)
            for block in own:
                if block.part.leaf.path not in shards:
                    shards[block.part.leaf.path] = local_shards(arrays[block.part.leaf.path])
            if whole[key]:
                buffer = staging.take(spec.nbytes)
                out = buffer.view(spec.dtype).reshape(spec.shape)
                for block in own:
                    data = block_data(block, shards[block.part.leaf.path], source_dtype)
                    out[tuple(slice(a, b) for a, b in block.regions[0])] = data
                if target is None:
                    staging.submit(buffer, _write_whole, writer, key, out, len(own))
                else:
                    kept = _kept(read_scales, target, tuple((0, n) for n in spec.shape))
                    staging.submit(buffer, _write_quantized_whole, writer, target, out, kept, len(own))
            else:
                for block in own:
                    region = block.regions[0]
                    buffer = staging.take(extent(region) * spec.dtype.itemsize)
                    out = buffer.view(spec.dtype).reshape(tuple(b - a for a, b in region))
                    out[...] = block_data(block, shards[block.part.leaf.path], source_dtype)
                    if target is None:
                        staging.submit(buffer, _write_box, writer, key, region, out)
                    else:
                        kept = _kept(read_scales, target, region)
                        staging.submit(buffer, write_quantized, writer, target, out, region, kept)
            written.report()
    written.report()


def _kept(read_scales: Callable[[Target, tuple], np.ndarray | None] | None, target: Target, region: tuple):
    """The source's scales of the blocks `region` covers, where the target may keep them; else None."""
    return None if read_scales is None else read_scales(target, target.scales_of(region))


def is_export(directory: str | os.PathLike) -> bool:
    """Whether `directory` is what `export` writes: `config.json` and port's safetensors files,
    `model.safetensors` alone or numbered shards with their index. (What `force` may replace.)

    ```python
    is_export("gpt2-hf")    # True once `port.export(model, "gpt2-hf", ...)` has finished
    ```
    """
    directory = Path(directory)
    if directory.is_symlink() or not directory.is_dir():
        return False
    try:
        entries = list(directory.iterdir())
    except OSError:
        return False
    if any(p.is_symlink() or not p.is_file() for p in entries):
        return False
    names = {p.name for p in entries}
    tensors = {n for n in names if n.endswith(".safetensors")}
    single = names == {"config.json", SINGLE}
    sharded = bool(tensors) and SINGLE not in tensors and names == {"config.json", INDEX, *tensors}
    if not (single or sharded):
        return False
    for name in tensors:
        try:
            meta = raw_header(directory / name).get("__metadata__")
        except CheckpointError:  # not a safetensors file at all
            return False
        if not isinstance(meta, dict) or meta.get("producer") != PRODUCER:
            return False
    return True


@dataclass(frozen=True)
class _Source:
    """What export takes from its source: each tensor's shape and the dtype it is written in
    unquantized (a quantized tensor's: the checkpoint's dtype, as it loads), the config, the
    output (for a port output), and the checkpoint's own tensors (None for an output) with
    the checkpoint, while it is kept open to read its FP8 scales. `derived`: there is no
    source to take the headers from (a model trained from scratch, a `port.save` output
    recording no `sources`; `headers` is empty): `_export` derives them from the model."""

    headers: dict[str, tuple[tuple[int, ...], np.dtype]]
    config: AnyMapping[str, Any]
    output: Output | None = None
    tensors: AnyMapping[str, TensorInfo] | None = None
    checkpoint: Checkpoint | None = None
    derived: bool = False


def read_source(source: Any, opened: contextlib.ExitStack | None, *, derive: bool = False) -> _Source:
    """The source's headers and config (see `_Source`); a checkpoint it opens is closed at once,
    or kept open in `opened`. With `derive` (an export, which can derive the headers from the
    model), no source (None) and an output without source tensors give `derived` ones (no
    headers; no config for None: the caller's); without, an output without them is refused."""
    if source is None:
        if not derive:
            raise PortError("`source`: expected a checkpoint, a port output or a Checkpoint, got None")
        return _Source({}, {}, derived=True)
    if isinstance(source, Checkpoint):
        return _Source(_loaded(source), source.config, None, source.tensors, source)
    path = Path(source) if isinstance(source, (str, os.PathLike)) else None
    if isinstance(source, Output) or (
        path is not None and (path / "port").is_dir() and not (path / "config.json").exists()
    ):
        output = source if isinstance(source, Output) else read_output(source)
        if output.sources is None and not derive:
            raise OutputError(
                f"{output.directory}: records no source tensors (written by port.save without `sources`); pass "
                "the checkpoint it was converted from as the source"
            )
        if output.sources is None:  # port.save's of a model built from scratch: derived
            return _Source({}, output.config, output, derived=True)
        return _Source(output.sources, output.config, output)
    if path is None and not isinstance(source, str):
        raise PortError(f"`source`: expected a checkpoint, a port output or a Checkpoint, got {quoted(source)}")
    if opened is None:
        with open_checkpoint(source) as ckpt:
            return _Source(_loaded(ckpt), ckpt.config, None, ckpt.tensors)
    ckpt = opened.enter_context(open_checkpoint(source))
    return _Source(_loaded(ckpt), ckpt.config, None, ckpt.tensors, ckpt)


def _loaded(checkpoint: Checkpoint) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each tensor's shape and the dtype it loads as (a quantized one's: the checkpoint's dtype, not float32)."""
    return {k: (t.shape, t.load_dtype) for k, t in checkpoint.tensors.items()}


def _expected(model: Any, mapping: Mapping, config: AnyMapping[str, Any], output: Output | None) -> tuple[dict, str]:
    """The leaves `model` is checked against, and how messages name where they come from: the module
    the mapping's model builds from the config, where the caller gave the mapping or it is port's own
    for the config; where it is the one a port `output` keeps (untrusted), `model`'s own class if it
    has from_config, the leaves the output lists for a Flax NNX module (its class is not what built
    it), else one of port's models the output names (`model_class`): nothing else an output names
    is imported, as `restore` imports nothing else."""
    if output is None:
        built: Any = mapping.model_object()
    elif is_model(type(model)):
        built = model_class(output, type(model))
    elif is_nnx(model):  # built by a factory the output names but does not hand over: its leaves are the check
        return dict(output.leaves), f"the output {output.directory}"
    else:
        built = model_class(output)
    built_from = mapping.model_config(config)  # a wrapper's language model: its text_config
    expected = {p: leaf for p, leaf in leaves(skeleton(built, built_from)).items() if hasattr(leaf, "shape")}
    return expected, f"the module {describe_model(built)} that the config builds"


def _check_fits(model: Any, mapping: Mapping, config: AnyMapping[str, Any], source: Any, output: Output | None) -> None:
    """`PlanError` naming the first leaf where `model` differs from the module the source's config builds."""
    expected, where = _expected(model, mapping, config, output)
    where = f"{where} of {quoted(str(source))}" if output is None and source is not None else where
    target = target_of(model)
    own = target.own(model)
    actual = {
        p: leaf
        for p, leaf in target.leaves(model).items()
        if hasattr(leaf, "shape") and (p not in own or p in expected)  # an NNX module's own state: not written
    }
    problems = []
    for path in actual.keys() - expected.keys():
        problems.append(f"model leaf '{path}' is not in {where}")
    for path in expected.keys() - actual.keys():
        entry = mapping.entry(path)
        if path in own and entry is None:
            continue
        if not is_none(model, path):
            problems.append(f"model has no leaf '{path}', which {where} has")
        elif entry is None or not entry.optional:  # an optional leaf the model lacks (a BERT without pooler) is fine
            problems.append(
                f"model leaf '{path}' is None (a partial load, include=PATTERNS?): an export writes "
                "every tensor of the checkpoint, so it needs every leaf"
            )
    for path in actual.keys() & expected.keys():
        if tuple(actual[path].shape) != tuple(expected[path].shape):
            problems.append(
                f"model leaf '{path}' is {list(actual[path].shape)}, but {list(expected[path].shape)} in {where}"
            )
    if problems:
        raise PlanError(sorted(problems))


def _planned(
    model: Any, mapping: Mapping, tensors: AnyMapping[str, TensorInfo], config: AnyMapping[str, Any], derived: bool
) -> Plan:
    """The forward plan of `model` from the source's headers; for derived ones, the check that
    they give back every leaf (a `PlanError` then is port's derivation's, and says so)."""
    try:
        return plan(model, mapping, tensors, config, _mesh_axes(mapping))
    except PlanError as e:
        if not derived:
            raise
        raise PlanError(
            [
                f"the tensors derived from the model do not plan back to it (a bug in port's derivation: pass "
                f"the checkpoint it came from as the source): {problem}"
                for problem in e.problems
            ]
        ) from None


def _mesh_axes(mapping: Mapping) -> dict[str, int]:
    """A one-device mesh shape with every axis the mapping's rules name: the plan is only walked backwards."""
    axes = {"data": 1, "model": 1}
    for names in mapping.rules.values():
        axes.update({name: 1 for name in names})
    return axes


def export(
    model: Any,
    out: str | os.PathLike,
    source: str | os.PathLike | Checkpoint | Output | None = None,
    *,
    config: AnyMapping[str, Any] | None = None,
    mapping: str | os.PathLike | Mapping | None = None,
    max_shard_size: str | int = "5GB",
    dtype: str | np.dtype | None = None,
    quantize: str | None = None,
    quantize_block: str | int | tuple[int, int] | None = None,
    force: bool = False,
    progress: Callable[[Progress], None] | None = None,
) -> ExportReport:
    """Write `model` as a Hugging Face checkpoint directory: `config.json` and safetensors, by the mapping.

    **Arguments:**

    - `model`: the module to write, as `port.load` or `port.restore` made it (and as
      training may have changed it); its arrays may be sharded over any mesh. Adapters
      attached to it (`port.nn.LoRA`) are merged into their weights (`port.nn.merged`)
      and written so; `port.export_adapter` writes the adapters alone.
    - `out`: the directory to write (`config.json`, `model.safetensors` or numbered
      shards with `model.safetensors.index.json`, as `save_pretrained` writes them).
    - `source`: where the tensors' names, shapes and dtypes come from (no tensor data
      is read): the checkpoint the model was converted from (a directory, a repo id or
      an open `Checkpoint`) or a `port convert` output, which records them (its directory,
      or the `Output` `read_output` read from it). A quantized source's tensors are
      written in the checkpoint's dtype, and its `quantization_config` left out, unless
      `quantize` says otherwise. None (a model trained from scratch, `Llama.from_config`):
      each tensor's name, shape and dtype is derived from the mapping, `config` and the
      model's leaves (`_export._derive` gives the rule; a transform whose inverse is
      ambiguous, such as DINOv2's `cls_token` reshape, is refused in one line naming it),
      then checked by planning the model from them. A `port.save` output that records no
      source tensors (a from-scratch model's) is derived from in the same way.
    - `config`: the Hugging Face config written as `config.json` (default: the source's);
      required without a `source`: the config the model was built from.
    - `mapping`: a `Mapping` or a mapping file; default: the output's own (for a `port
      convert` output), else the shipped one for the config's `model_type`.
    - `max_shard_size`: the largest file, as `"5GB"`, `"500MB"` or bytes; a tensor larger
      than it gets a file of its own.
    - `dtype`: write floating tensors in this dtype (`"bfloat16"`, ...); default: the source's.
    - `quantize`: `"fp8"`: write the Linear weights in FP8 e4m3 with block scales
      (`weight_scale_inv`) and a `quantization_config`, DeepSeek's and Qwen's layout
      (`_export._quantize` says which tensors, and when the source's own scales are kept:
      where the source is an FP8 checkpoint, a model exported unchanged writes its bytes back).
    - `quantize_block`: the block, `(rows, columns)`, `"128x128"` or one size for a square;
      default 128x128. Only with `quantize`.
    - `force`: replace an earlier `port export` at `out`, and nothing else.
    - `progress`: called with a `Progress` (phase "write", bytes this process wrote of its
      share) as writing starts and after each block (or whole tensor) written.

    **Returns:** an `ExportReport`: the output directory (`.out`, absolute), the files, bytes,
    tensors and params written, this process's share (`bytes_written`), seconds and peak
    host memory, as `port export` prints them. It is `os.PathLike` for the directory, so
    `Path(report)` and `transformers...from_pretrained(report)` take it as the path `export`
    returned before. A one-line `PortError` for bad input: `PlanError`
    for a model that does not fit the mapping or a mapping that cannot be inverted (a
    fused tensor with a part no entry keeps), `OutputError` for `out`.

    ```python
    model = port.load("gpt2", mesh="4x2")
    report = port.export(model, "gpt2-hf", "gpt2", max_shard_size="200MB")
    report.out, report.files             # Path('/.../gpt2-hf'), ('model-00001-of-00003.safetensors', ...)
    port.export(port.load("tiny-deepseek-fp8"), "again-fp8", "tiny-deepseek-fp8", quantize="fp8")
    port.export(Llama.from_config(config, key=jax.random.key(0)), "llama-hf", config=config)  # from scratch
    ```
    """
    model = merged(model)  # a model with adapters attached (port.nn.LoRA): written merged
    limit = parse_size(max_shard_size)
    if quantize is None and quantize_block is not None:
        raise PortError(f"quantize_block={quoted(quantize_block, 40)} needs quantize='fp8'")
    if quantize is not None:
        check_method(quantize)
    block = None if quantize is None else parse_block(DEFAULT_BLOCK if quantize_block is None else quantize_block)
    start = time.perf_counter()
    # The source checkpoint, open while its FP8 scales may be read; host memory sampled throughout.
    with PeakMemory() as peak, contextlib.ExitStack() as opened:
        found = read_source(source, opened if block is not None else None, derive=True)
        source = source.directory if isinstance(source, Output) else source  # as messages name it
        report = _export(model, out, source, found, config, mapping, limit, dtype, block, force, progress)
    return dataclasses.replace(report, seconds=round(time.perf_counter() - start, 3), peak_host_bytes=peak.bytes)


def _export(
    model: Any,
    out: str | os.PathLike,
    source: Any,
    found: _Source,
    config: AnyMapping[str, Any] | None,
    mapping: str | os.PathLike | Mapping | None,
    limit: int,
    dtype: str | np.dtype | None,
    block: tuple[int, int] | None,
    force: bool,
    progress: Callable[[Progress], None] | None,
) -> ExportReport:
    """`export` once its arguments are checked and its source read; the report's `seconds` and
    `peak_host_bytes` are left for `export`, which measures the whole call."""
    if source is None and config is None:
        raise PortError(
            "`config`: a model exported without a `source` (trained from scratch) needs the config it was "
            "built from, config=..."
        )
    derived = found.derived  # no source tensors to take: derived from the model
    config = dict(found.config if config is None else config)
    kept = found.output if mapping is None else None  # the output's own mapping: its `model` is not imported
    # Without a mapping, the shipped one whose model this is (an encoder alone exports as one).
    keys = None if derived else found.headers
    mapping = mapping_for(config, mapping if kept is None else kept.mapping, keys=keys, built=type(model))
    mapping, headers, config = plain(mapping, found.headers, config)  # an adapter kept: the merged model's base
    inputs = (source,) if isinstance(source, (str, os.PathLike)) and Path(source).exists() else ()
    out = check_destination(out, force, inputs, ours=is_export, what=_EXPORT)
    _check_fits(model, mapping, config, source, kept)
    if derived:
        headers = derive(model, mapping, config)
    nowhere = Path("<source>")  # no tensor data is read: one path for every header
    tensors = {k: TensorInfo(k, nowhere, np.dtype(d), tuple(s), 0) for k, (s, d) in headers.items()}
    recipe = _planned(model, mapping, tensors, config, derived)
    arrays = leaves(model)
    for leaf in recipe.leaves:
        array = arrays.get(leaf.path)
        if not isinstance(array, jax.Array):
            raise PlanError([f"model leaf '{leaf.path}' is {type(array).__name__}, not an array to write"])
    dtype = None if dtype is None else dtype_named(dtype)
    inverse = invert(recipe, headers, mapping.source, dtype)
    text_only = mapping.export.get(str(config.get("model_type")))  # a wrapper's language model: written text-only
    source_tensors = found.tensors
    # Whether the head is tied, as this model holds it: the tied keys (lm_head) written or not.
    tied_head = bool(mapping.tied) and not {mapping.key_name(t.key) for t in inverse.tensors} & set(mapping.tied)
    if text_only is not None:
        inverse = inverse.renamed(text_only.key, mapping.source)
        source_tensors = None if found.tensors is None else {text_only.key(k): t for k, t in found.tensors.items()}
    quantization = None
    if block is not None:
        tied = [*mapping.tied, *mapping.tied.values()]
        quantization = plan_fp8(inverse, block, config, tied, source_tensors)
    layout = inverse.tensors if quantization is None else quantization.layout(inverse.tensors)
    nbytes = sum(t.nbytes for t in layout)
    own = mapping.written_config(config)  # a tower, an encoder alone: config.json says the class it is
    written_config = (
        (config if own is None else own) if text_only is None else _text_only_config(config, text_only, tied_head)
    )
    written_config = {k: v for k, v in written_config.items() if k != "quantization_config"}  # the tensors are not
    if quantization is not None:
        written_config["quantization_config"] = quantization.settings
    if dtype is not None:
        for name in ("torch_dtype", "dtype"):
            if name in written_config:
                written_config[name] = dtype.name
    me, processes = jax.process_index(), jax.process_count()
    if processes > 1 and num_processes() is None:
        raise RunError("port export in several processes needs the run joined by port.initialize (or port's flags)")
    found_blocks = blocks(inverse, arrays)
    if found_blocks is None and processes > 1:
        raise PlanError(
            [
                f"{mapping.source}: a block of some leaf is not one box of its checkpoint tensor on this mesh, "
                "so it cannot be written by the process holding it; export it from one process"
            ]
        )
    if found_blocks is not None and quantization is not None:
        _check_quantized_blocks(found_blocks, quantization)
    mine = None if found_blocks is None else [b for b in found_blocks if b.owner == me]
    specs = {t.key: t for t in inverse.tensors}
    total = nbytes if mine is None else _share_bytes(mine, specs, quantization)
    if me == 0:
        check_free(out, nbytes)
    read_scales = scales_reader(found.checkpoint)
    partial = partial_path(out)
    metadata = {"format": "pt", "producer": PRODUCER, "port_version": port_version()}
    with contextlib.ExitStack() as cleanup, writing(out, partial, "the export"):
        writer = None
        if me == 0:
            make_partial(partial, cleanup)
            (partial / "config.json").write_text(json.dumps(written_config, indent=2, sort_keys=True) + "\n")
            writer = cleanup.enter_context(Writer(partial, layout, limit, metadata=metadata))
        exchange("export-created", "", "word that the files exist")
        if writer is None:  # the other processes: open the files process 0 made
            writer = cleanup.enter_context(Writer(partial, layout, limit, metadata=metadata, create=False))
        steps = len(inverse.tensors) if mine is None else len(mine)
        written = _Written(total, steps, progress)
        if mine is None:  # one process; some tensor is assembled whole, then written
            targets = {} if quantization is None else quantization.targets
            for tensor in inverse.tensors:
                parts = inverse.parts[tensor.key]
                pieces = [(p.leaf.chain, gather(arrays[p.leaf.path], p.index)) for p in parts]
                (chain, first), siblings = pieces[0], pieces[1:]
                data = chain.inverse(first, inverse.source_dtypes[tensor.key], siblings=siblings)
                del pieces, first, siblings
                data = data.astype(tensor.dtype, copy=False)
                target = targets.get(tensor.key)
                if target is None:
                    writer.write(tensor.key, data)
                    written((tensor.nbytes, 1))
                else:
                    whole = tuple((0, n) for n in tensor.shape)
                    written(write_quantized(writer, target, data, whole, read_scales(target, target.scales_of(whole))))
                del data
                written.report()
        else:
            _write_blocks(mine, inverse, arrays, writer, written, quantization, read_scales)
        done = written.bytes
        writer.close(check=processes == 1)
        wrote = exchange("export-written", str(done), "what it wrote")
        if me == 0:
            if sum(int(n) for n in wrote.values()) != nbytes:
                raise OutputError(f"out={out}: the processes wrote {wrote}, not the {nbytes} bytes laid out")
            put_in_place(partial, out, force, ours=is_export, what=_EXPORT)
        exchange("export-done", "", "word that the export is in place")
    return ExportReport(
        out=out,
        process=me,
        num_processes=processes,
        mesh=mesh_of(arrays),
        dtype=None if dtype is None else dtype.name,
        quantize=None if block is None else "fp8",
        files=tuple(sorted(writer.sizes)),
        bytes=sum(writer.sizes.values()),
        tensors=len(layout),
        params=recipe.params,
        bytes_held=blocks_held(model),
        bytes_written=done,
        seconds=0.0,
        peak_host_bytes=0,
        port_version=port_version(),
    )


def _text_only_config(config: AnyMapping[str, Any], text_only: TextExport, tied_head: bool) -> dict[str, Any]:
    """The config.json of the text-only checkpoint a wrapper's language model is written as: the
    wrapper's text config, saying the text-only class's `model_type` and `architectures`, and
    `tie_word_embeddings` as the model holds its head (a wrapper's own flag, which Mistral 3's
    head follows, is not the text config's).

    ```python
    _text_only_config({"model_type": "gemma3", "dtype": "bfloat16", "text_config": {"hidden_size": 8}},
                      mapping.export["gemma3"], tied_head=True)
    # {"dtype": "bfloat16", "hidden_size": 8, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
    #  "tie_word_embeddings": True}
    ```
    """
    text = config.get(text_only.config)
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: {text_only.config!r} must be a dict, got {quoted(text)}")
    model_type, architectures = text_only.written(text)
    carried = {k: config[k] for k in CARRIED if k in config}
    return {
        **carried,
        **text,
        "model_type": model_type,
        "tie_word_embeddings": tied_head,
    } | ({"architectures": architectures} if architectures else {})  # none the text config or mapping names


def _share_bytes(mine: list[Block], specs: AnyMapping[str, OutTensor], quantization: Quantization | None) -> int:
    """Bytes this process writes of its blocks: a tensor it holds all of as laid out, the boxes
    of the others each with its values (in FP8, and their blocks' scales, where quantized)."""
    by_key: dict[str, list[Block]] = {}
    for block in mine:
        by_key.setdefault(block.key, []).append(block)
    total = 0
    for key, own in by_key.items():
        spec = specs[key]
        if sum(extent(b.regions[0]) for b in own) == math.prod(spec.shape):
            own_regions = [tuple((0, n) for n in spec.shape)]
        else:
            own_regions = [b.regions[0] for b in own]
        for region in own_regions:
            plain = extent(region) * spec.dtype.itemsize
            total += plain if quantization is None else quantization.nbytes(key, region, spec.dtype)
    return total


def _check_quantized_blocks(found: list[Block], quantization: Quantization) -> None:
    """`PlanError` naming each quantized tensor whose processes would each write a box of it
    that cuts its blocks (their scales would need values another process holds)."""
    owners: dict[str, set[int]] = {}
    for block in found:
        owners.setdefault(block.key, set()).add(block.owner)
    problems = {}
    for block in found:
        target = quantization.targets.get(block.key)
        if target is None or block.key in problems or len(owners[block.key]) == 1 or target.aligned(block.regions[0]):
            continue
        problems[block.key] = (
            f"tensor {quoted(block.key, 200)}: a process holds its box {[list(r) for r in block.regions[0]]}, "
            f"which cuts its {target.block[0]}x{target.block[1]} blocks; export with quantize from one "
            "process, or on a mesh whose blocks hold whole ones"
        )
    if problems:
        raise PlanError(list(problems.values()))
