"""What each `port` command does, given its parsed flags (an `argparse.Namespace`-like object
with one attribute per flag): convert, export, info, plan, check, verify, scaffold.

Each returns the exit status (0 done, 1 a failed check) or raises `PortError`, which the
command line (`_cli`) says as one line; `_cli` parses the flags and runs these in the worker.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import math
import os
import secrets
import shutil
import sys
import textwrap
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from . import _console
from ._cleanup import final, finished
from ._console import say, show, stream
from ._errors import PlanError, PortError
from ._flags import with_flags
from ._leftovers import claimed, recover
from ._model import is_model
from ._text import count_text, plural, printable, quoted, shortened, size_text

if TYPE_CHECKING:
    from rich.progress import Progress


SCAFFOLD_MARK = "# Draft mapping made by port scaffold"


def _shown(model: str) -> str:
    """`model` as messages show it: a URL without its credentials. `_sources` (and NumPy with
    it) is imported here, when first needed, not when `port` starts: the command line holds
    Ctrl-C before anything slow is imported."""
    from ._sources import shown

    return shown(model)


DEFAULT_TIMEOUT = 300.0


def _progress(enabled: bool | None, total_leaves: int, total_bytes: int) -> Progress | None:
    """A rich progress bar over tensors and bytes, or None when not wanted."""
    if enabled is None:
        enabled = stream().isatty()
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        console=Console(file=stream()),
        transient=True,
    )
    bar.add_task(f"0/{total_leaves} tensors", total=total_bytes)
    return bar


REPORTS = ("port.convert/1", "port.export/1")  # the schemas of the run summaries --report writes


def _is_report(path: Path) -> bool:
    """Whether `path` is a run summary `port convert --report` or `port export --report` wrote
    (one written before reports named their schema has convert's figures)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and (
        data.get("schema") in REPORTS or {"bytes_read", "peak_host_bytes", "device_bytes"} <= set(data)
    )


def _check_report(args: argparse.Namespace) -> None:
    """`--report` is not `--out` nor inside it (which port replaces): told before anything runs."""
    if args.report is not None and args.out.absolute() in args.report.absolute().parents:
        raise PortError(f"--report {args.report}: inside --out {args.out}, which port replaces")
    if args.report is not None and args.report.absolute() == args.out.absolute():
        raise PortError(f"--report {args.report}: the same path as --out; give the run summary a file of its own")


def _report_file(args: argparse.Namespace) -> Path | None:
    """Where this process writes `--report` (each process of a multi-process run its own, `run.1.json`),
    checked as `--force` allows; None without the flag. Once the run is joined."""
    import jax

    report = args.report
    if report is None:
        return None
    if jax.process_count() > 1:  # each process reports its own figures
        report = report.with_name(f"{report.stem}.{jax.process_index()}{report.suffix}")
    return _check_file_out(report, args.force, "--report", _is_report, "a run report")


def _summarize(summary: dict, report: Path | None, out: object, as_json: bool) -> bool:
    """Write the run's `summary` to `report` if given; print it if `as_json`. Whether it was printed.
    The run's work is done: from here a `--deadline` passing stops nothing (`finished`)."""
    finished()
    if report is not None:
        try:
            _write_file(report, json.dumps(summary, indent=1) + "\n")
        except OSError as e:
            raise PortError(
                f"--report {report}: could not write the run summary ({e.strerror or e}); the output {out} is complete"
            ) from None
    if as_json:
        _json(summary)
    return as_json


def _check_file_out(path: Path, force: bool, flag: str, ours: Callable[[Path], bool], what: str) -> Path:
    """Refuse to write `path` over anything but a file port wrote (with `force`)."""
    path = path.absolute()
    if path.parent.is_dir():
        recover(path, ours)  # what a killed run left beside it
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise PortError(f"{flag} {path}: exists and is not a regular file")
    if path.exists():
        if not force:
            raise PortError(f"{flag} {path}: already exists (use --force to replace {what} port wrote)")
        if not ours(path):
            raise PortError(f"{flag} {path}: not {what} port wrote; --force replaces only those")
    from ._destination import existing_ancestor

    base = existing_ancestor(path)  # missing parents are made when the file is written, as `mkdir -p` would
    if not base.is_dir():
        raise PortError(f"{flag} {path}: {base} is a file, not a directory")
    return path


def _write_file(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a hidden sibling renamed into place (its missing parents
    made first, and removed again if the write fails)."""
    import contextlib

    from ._destination import make_parents

    partial = path.parent / f".{path.name}.port-partial-{secrets.token_hex(8)}"
    with contextlib.ExitStack() as parents:
        make_parents(path.parent, parents)
        with claimed(partial, lambda p: os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))):
            partial.write_text(text)
            with final():
                os.replace(partial, path)


class _Beside(importlib.abc.MetaPathFinder):
    """Finds one top-level module, `name`, in `directory`, and nothing else; asked after every installed one."""

    def __init__(self, name: str, directory: str):
        self.name, self.directory = name, directory

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [self.directory])


def _valid(spec: str) -> None:
    from ._mapping import MODEL_SPEC

    if not MODEL_SPEC.fullmatch(spec):
        raise PortError(f"--module {quoted(spec, 200)}: expected module:Class, such as mymodel:MyModel")


def _allow(spec: str) -> None:
    """Let `--module MODULE:CLASS`'s module (and its submodules) come from the working directory, if not installed."""
    _valid(spec)
    top = spec.partition(":")[0].split(".")[0]
    if not any(isinstance(f, _Beside) and f.name == top for f in sys.meta_path):
        sys.meta_path.append(_Beside(top, os.getcwd()))


def _model_class(spec: str | None, factory: bool = False) -> Any:
    """The class `--module MODULE:CLASS` names (see `_allow`); None without the flag. With `factory`,
    any class or function, as a mapping's `model` may name (a Flax NNX module class, a factory):
    building it (`port.skeleton`) says why one cannot be built."""
    import inspect

    from ._mapping import import_object

    if spec is None:
        return None
    _allow(spec)
    cls = import_object(spec, "--module")
    if factory and (isinstance(cls, type) or inspect.isfunction(cls)):
        return cls
    if not is_model(cls):
        kinds = ", a Flax NNX module class or a factory function" if factory else ""
        raise PortError(f"--module {spec}: not a model class (a class with from_config(config, *, key)){kinds}")
    return cls


def _mapping_named(args: argparse.Namespace, path: Path | None):
    """The mapping a command was given (`--mapping` or MAPPING); loaded here when `--module` flags name its classes.

    Only a module a `--module` flag names may come from the working directory, and each
    must be one the mapping names (its `model`, or its `reference` for `port verify`): a
    mapping file cannot make port import a module of the working directory on its own word.
    """
    from ._mapping import load_mapping

    specs = args.module or []
    if not specs:
        return path
    if path is None:
        raise PortError(
            f"--module {specs[0]}: give the mapping that names it (--mapping FILE); port's own mappings name port's models"
        )
    for spec in specs:
        _valid(spec)
    mapping = load_mapping(path)
    named = [mapping.model, *([mapping.reference["class"]] if mapping.reference.get("class") else [])]
    for spec in specs:
        if spec not in named:
            raise PortError(
                f"--module {quoted(spec, 200)}: {mapping.source} names "
                + " and ".join(f"{what} {quoted(n, 200)}" for what, n in zip(("model", "reference"), named))
                + "; --module names one of those"
            )
        _allow(spec)
    return mapping


# ---------------------------------------------------------------------------- commands


def _processes(args: argparse.Namespace) -> tuple[int, int]:
    """The run's process count and each process's share of --mesh's devices, the flags checked
    (no --mesh, `port export`'s default, the run's own devices: none simulated beyond one each)."""
    from ._meshes import devices_per_process, env_int, mesh_shape

    shape = None if args.mesh is None else mesh_shape(args.mesh)
    processes = args.num_processes if args.num_processes is not None else env_int("JAX_NUM_PROCESSES") or 1
    count = 1 if shape is None else devices_per_process(shape, processes, args.mesh)
    if args.timeout <= 0:
        raise PortError(f"--timeout {args.timeout:g}: expected a positive number of seconds")
    return processes, count


def _join(args: argparse.Namespace) -> tuple[int, int, bool]:
    """Simulate this process's devices and join the run the flags name: (processes, devices each, simulated)."""
    from ._runtime import initialize, on_stuck, simulate_devices

    processes, count = _processes(args)
    simulated = simulate_devices(count)
    coordinator = args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if processes > 1 and coordinator:
        who = args.process_id if args.process_id is not None else os.environ.get("JAX_PROCESS_ID", "?")
        say(f"process {who}: waiting for {processes} processes at {coordinator} (--timeout {args.timeout:g} s)")
    on_stuck(_stuck)  # this process is the command line's: a run that cannot go on ends it
    initialize(args.coordinator, args.num_processes, args.process_id, timeout=args.timeout)
    return processes, count, simulated


def _as_flags(error: PortError, *words: tuple[str, str]) -> None:
    """Raise `error` again in the command line's words where it begins with the library's: each of
    `words` is (the API's, `layers='0:2'`; the flag's, `--layers 0:2`), the first that begins it used."""
    said = str(error)
    for api, flag in words:
        if said.startswith(api + ": "):
            raise PortError(flag + said.removeprefix(api)) from None


def convert(args: argparse.Namespace) -> int:
    """Convert MODEL into a sharded Equinox model and save it to --out, an Orbax checkpoint."""
    _processes(args)  # flags checked before the output's
    layers = _layers(args.layers)
    from ._output import check_out  # NumPy's (the output's layout): after the flags

    inputs = tuple(name for name in (args.model, args.adapter) if name is not None and Path(name).exists())
    check_out(args.out, args.force, inputs=inputs)
    _check_report(args)
    processes, count, simulated = _join(args)

    import jax

    from ._convert import convert as run_convert

    mapping = _mapping_named(args, args.mapping)
    report = _report_file(args)
    bar: Progress | Literal[False] | None = None  # False: asked for once, not wanted

    def progress(at) -> None:
        nonlocal bar
        if bar is None:  # planned and checked: placing starts
            if simulated and count > 1 and jax.default_backend() == "cpu":
                each = f" in each of {processes} processes" if processes > 1 else ""
                say(f"no accelerator: simulating {count} CPU devices{each} for --mesh {args.mesh}")
            bar = _progress(args.progress, at.leaves, at.total) or False
            if bar:
                bar.start()
        if bar:
            what = f"{at.leaves_done}/{at.leaves} {'written' if at.phase == 'write' else 'tensors'}"
            bar.update(bar.task_ids[0], completed=at.done, total=at.total, description=what)

    try:
        result = run_convert(
            args.model,
            mapping=mapping,
            mesh=args.mesh,
            dtype=args.dtype,
            out=args.out,
            force=args.force,
            progress=progress,
            include=_patterns(args.include),
            layers=layers,
            adapter=args.adapter,
            adapter_mode=args.adapter_mode or "merge",
            max_over_read=args.max_over_read,
        )
    except PortError as e:  # the API's words for a range, as the flag was given
        if layers is not None:
            _as_flags(e, (f"layers={layers!r}", f"--layers {args.layers}"))
        raise
    finally:
        if bar:
            bar.stop()
    summary = {"schema": "port.convert/1", "model": _shown(args.model), **result.report.to_json()}
    if _summarize(summary, report, result.report.out, args.json):
        return 0
    figures = result.report
    who = f"process {figures.process}/{figures.num_processes}: " if figures.num_processes > 1 else ""
    adapted = ""
    if figures.adapter is not None:
        how = "merged" if figures.adapter_mode == "merge" else "kept"
        adapted = f" with adapter {figures.adapter} ({how}, {size_text(figures.adapter_bytes_read)} read from it)"
    over = f" (and {size_text(figures.bytes_over_read)} over-read)" if figures.bytes_over_read else ""
    say(
        f"{who}converted {_shown(args.model)}{adapted}: {count_text(figures.params)} params onto mesh {args.mesh} in "
        f"{figures.seconds:.1f} s (placing {figures.place_seconds:.1f} s, writing {figures.save_seconds:.1f} s); "
        f"read {size_text(figures.bytes_read)}{over}, "
        f"{size_text(max(figures.device_bytes.values(), default=0))} per device, "
        f"peak host memory {size_text(figures.peak_host_bytes)} -> {figures.out}"
    )
    return 0


def _layers(text: str | None) -> range | None:
    """`--layers 0:12` as `range(0, 12)`; None without the flag."""
    if text is None:
        return None
    start, colon, stop = text.partition(":")
    if not (colon and start.strip().isdigit() and stop.strip().isdigit() and int(start) < int(stop)):
        raise PortError(
            f"--layers {quoted(text, 200)}: expected START:STOP, the checkpoint's layers START to STOP-1, such as 0:12"
        )
    return range(int(start), int(stop))


def _patterns(text: str | None) -> list[str] | None:
    """`--include embed,blocks` as patterns; None without the flag."""
    if text is None:
        return None
    patterns = [p.strip() for p in text.split(",") if p.strip()]
    if not patterns:
        raise PortError(f"--include {quoted(text, 200)}: expected module paths or patterns, such as wte,blocks")
    return patterns


def info_command(args: argparse.Namespace) -> int:
    """Describe a port output: its model, mapping, source, the mesh it was written on, its leaves."""
    from ._output import FORMAT, describe, read_output, written_mesh

    output = read_output(args.dir)
    mesh = written_mesh(output)
    model_type = output.config.get("model_type")  # untrusted: any JSON value; the schema says a string or null
    model_type = model_type if isinstance(model_type, str) else None
    total = sum(leaf.nbytes for leaf in output.leaves.values())
    params = sum(leaf.size for leaf in output.leaves.values())
    sources = (
        None
        if output.sources is None
        else {
            "tensors": len(output.sources),
            "bytes": sum(math.prod(s) * d.itemsize for s, d in output.sources.values()),
        }
    )
    if args.json:
        return _json(
            {
                "schema": "port.info/1",
                "directory": str(output.directory),
                "format": FORMAT,
                "port_version": output.port_version,
                "class": output.mapping.model,
                "model_type": model_type,
                "mapping": output.mapping_source,
                "mesh": mesh,
                "params": params,
                "bytes": total,
                "source": sources,
                "include": output.include,
                "leaves": [
                    {
                        "path": path,
                        "shape": list(leaf.shape),
                        "dtype": leaf.dtype.name,
                        "axes": list(leaf.axes),
                        "bytes": leaf.nbytes,
                        "quantized": leaf.quantized,
                    }
                    for path, leaf in output.leaves.items()
                ],
            }
        )
    heading = [
        f"{printable(str(args.dir))}: a port output (format {FORMAT}), {count_text(params)} params in "
        f"{len(output.leaves)} {'leaf' if len(output.leaves) == 1 else 'leaves'}, {size_text(total)}",
        f"model: {printable(output.mapping.model)}"
        + (f" (model_type {quoted(model_type)})" if model_type is not None else ""),
        f"mapping: {printable(output.mapping_source)} (its text is kept in the output)",
        f"written on mesh: {','.join(f'{n}={k}' for n, k in mesh.items()) if mesh else 'not recorded'}",
        f"written by: port {printable(output.port_version)}"
        if output.port_version is not None
        else "written by: port, its version not recorded",
    ]
    if sources is not None:
        heading.append(f"source: {plural(sources['tensors'], 'tensor')}, {size_text(sources['bytes'])}")
    if output.include is not None:
        heading.append(f"partial: only the leaves matching {', '.join(map(quoted, output.include))}")
    stored = any(leaf.quantized for leaf in output.leaves.values())  # converted from a quantized checkpoint
    rows = [
        (
            printable(path),
            describe(leaf.shape, leaf.dtype),
            ", ".join(a or "-" for a in leaf.axes) or "-",
            size_text(leaf.nbytes),
            *((printable(leaf.quantized or "-"),) if stored else ()),
        )
        for path, leaf in output.leaves.items()
    ]
    head = ("leaf", "shape", "axes", "bytes", *(("quantized source",) if stored else ()))
    line = _columns([head, *rows])
    show("\n".join([*heading, "", *map(line, [head, *rows])]) + "\n")
    return 0


_REPORTED = ("process", "num_processes", "out", "mesh", "dtype", "quantize", "files", "bytes", "tensors", "params")
"""The `port.export/1` fields that are the `ExportReport`'s own, as it names them."""


def export_command(args: argparse.Namespace) -> int:
    """Write a `port convert` output back as a Hugging Face checkpoint directory."""
    import time

    from ._export import parse_size
    from ._memory import PeakMemory
    from ._output import read_output

    start = time.perf_counter()
    parse_size(args.max_shard_size)  # a bad size is told before anything is read
    _processes(args)
    _check_report(args)
    output = read_output(args.dir)  # not a port output: told before a model is built
    if args.adapter_only and not _adapted(output.leaves):
        raise PortError(
            f"{args.dir}: holds no adapter (convert with --adapter ADAPTER --adapter-mode keep): "
            "--adapter-only has nothing to write"
        )
    _join(args)
    from ._export import blocks_held, export  # JAX's, as restore is: after every check of the flags and the metadata
    from ._output import restore

    if args.mesh is None:  # the default, once the run is joined: all its devices
        args.mesh = _spanning_mesh()

    report = _report_file(args)
    bar: Progress | Literal[False] | None = None  # False: asked for once, not wanted

    def progress(at) -> None:
        nonlocal bar
        if bar is None:
            bar = _progress(args.progress, at.leaves, at.total) or False
            if bar:
                bar.start()
        if bar:
            bar.update(bar.task_ids[0], completed=at.done, total=at.total, description="writing")

    with PeakMemory() as peak:
        model = restore(
            output, args.mesh, model=_model_class(args.module, factory=True)
        )  # its metadata read once, here
        if args.adapter_only:
            return _export_adapter_only(args, output, model)
        try:
            exported = export(
                model,
                args.out,
                output if args.source is None else args.source,
                max_shard_size=args.max_shard_size,
                dtype=args.dtype,
                quantize=args.quantize,
                quantize_block=args.quantize_block,
                force=args.force,
                progress=progress,
            )
        finally:
            if bar:
                bar.stop()
    figures = exported.to_json()
    summary = {  # the report's figures; the time and the peak the whole command's, restore's included
        "schema": "port.export/1",
        "directory": str(output.directory),
        **{k: figures[k] for k in _REPORTED},
        "seconds": round(time.perf_counter() - start, 3),
        "bytes_read": blocks_held(model),  # DIR's blocks this process's devices hold: what restore read
        "bytes_written": exported.bytes_written,
        "peak_host_bytes": peak.bytes,
        "port_version": exported.port_version,
    }
    if _summarize(summary, report, exported.out, args.json):
        return 0
    who, share, written, files = "", "", exported.bytes_written, exported.files
    if exported.num_processes > 1:  # each process wrote the blocks its devices hold
        who = f"process {exported.process}/{exported.num_processes}: "
        share = f", this process wrote {size_text(written)} ({written} bytes)"
    say(
        f"{who}exported {args.dir}: {len(files)} safetensors file{'s' if len(files) > 1 else ''}, "
        f"{size_text(exported.bytes)}{share} -> {exported.out}"
    )
    return 0


def _spanning_mesh() -> str:
    """`port export`'s default --mesh, in a joined run: every device of every process on the
    model axis (`1x1` for one process on one device)."""
    import jax

    return f"1x{jax.device_count()}"


def _adapted(leaves: Collection[str]) -> bool:
    """Whether an output's leaves (paths) hold a kept adapter: a `P.base` beside its `P.a` and `P.b`."""
    return any(path.endswith(".base") and {path[:-4] + "a", path[:-4] + "b"} <= set(leaves) for path in leaves)


def _export_adapter_only(args: argparse.Namespace, output, model) -> int:
    """`port export DIR --adapter-only`: DIR's kept adapter written as a PEFT adapter directory."""
    from ._adapters._export import export_adapter

    out = export_adapter(model, args.out, output if args.source is None else args.source, force=args.force)
    files = sorted(p.name for p in out.iterdir())
    summary = {"schema": "port.export-adapter/1", "directory": str(output.directory), "out": str(out), "files": files}
    if _summarize(summary, _report_file(args), out, args.json):
        return 0
    say(f"exported the adapter of {args.dir}: {', '.join(files)} -> {out}")
    return 0


def _dtype_short(name: str) -> str:
    return name.replace("bfloat", "bf").replace("float", "f").replace("uint", "u").replace("int", "i")


def _columns(rows: Sequence[Sequence[str]]) -> Callable[[Sequence[str]], str]:
    """A row of `rows` as one aligned line: columns two spaces apart, the last (a size) to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join([*(c.ljust(w) for c, w in zip(cells[:-1], widths)), cells[-1].rjust(widths[-1])]).rstrip()

    return line


def _wrapped(text: str, width: int) -> list[str]:
    """`text` as indented lines below a plan's row, within `width` columns."""
    return textwrap.wrap(
        printable(text),
        max(width, 40),
        initial_indent="  ",
        subsequent_indent="      ",
        break_long_words=False,
        break_on_hyphens=False,
    )


_PLAN_HEAD = ("target", "shape", "spec", "per device")


def _leaf_table(leaves, below: Callable[[Any], list[str]], heading: Sequence[str], width: int) -> list[str]:
    """`heading`, then a row per leaf (target, shape, spec, bytes per device), each followed by
    what `below` says of it, wrapped within `width` columns: the table of both kinds of plan."""
    from ._plan import spec_text

    rows = [
        (
            printable(leaf.path),
            f"{_dtype_short(leaf.dtype.name)}[{','.join(map(str, leaf.shape))}]",
            spec_text(leaf.spec),
            size_text(leaf.device_bytes),
        )
        for leaf in leaves
    ]
    line = _columns([_PLAN_HEAD, *rows])
    lines = [*heading, "", line(_PLAN_HEAD)]
    for leaf, cells in zip(leaves, rows):
        lines.append(line(cells))
        for text in [*below(leaf), *(f"note: {note}" for note in leaf.notes)]:
            lines += _wrapped(text, width)
    return lines


def _totals(plan) -> str:
    """A plan's last line: params, leaves, bytes to read and per device."""
    return (
        f"{count_text(plan.params)} params in {len(plan.leaves)} leaves; "
        f"{size_text(plan.read_bytes)} to read, {size_text(plan.device_bytes)} per device"
    )


def plan_text(recipe, heading: Sequence[str], width: int) -> str:
    """`port plan`'s output: a row per leaf, its source and notes indented below, within `width` columns."""

    rows = {row["target"]: row for row in recipe.table()}

    def source(leaf) -> list[str]:
        row = rows[leaf.path]
        return [f"from {row['source']}" + ("" if row["transforms"] == "-" else f" > {row['transforms']}")]

    lines = _leaf_table(recipe.leaves, source, heading, width)
    lines.append("")
    named = {key for _, _, keys in recipe.ignored_by_rule for key in keys}
    lines += [
        f"ignored: {printable(resolved)} ({len(keys)} tensors, by the mapping's ignore '{printable(rule)}')"
        for rule, resolved, keys in recipe.ignored_by_rule
        if keys
    ]
    lines += [
        f"ignored: {printable(pattern)}" + (f" ({n} tensors)" if n > 1 else "")
        for pattern, n in _grouped(tuple(k for k in recipe.ignored if k not in named)).items()
    ]
    lines += [f"tied: {printable(key)} = {printable(copy_of)}, not read" for key, copy_of in recipe.tied]
    lines += [f"absent: {path} (optional, not in the checkpoint: None)" for path in recipe.empty]
    lines.append(_totals(recipe))
    return "\n".join(lines) + "\n"


def restore_plan_text(placement, heading: Sequence[str], width: int) -> str:
    """`port plan DIR`'s output for a port output: `plan_text`'s columns, each leaf's logical axes
    and notes below it, within `width` columns."""
    lines = _leaf_table(
        placement.leaves, lambda leaf: [f"axes: {', '.join(a or '-' for a in leaf.axes) or '-'}"], heading, width
    )
    lines.append("")
    lines += [f"absent: {printable(path)} (optional, not in the output: None)" for path in placement.absent]
    lines += [f"excluded: {printable(path)} (not in this partial output: None)" for path in placement.excluded]
    lines.append(_totals(placement))
    return "\n".join(lines) + "\n"


def _grouped(keys: tuple[str, ...]) -> dict[str, int]:
    """Keys that differ only in their integer segments, as one pattern with `*` and a count
    (`h.0.attn.bias`, `h.1.attn.bias` -> `h.*.attn.bias`: 2), in first-seen order."""
    counts: dict[str, int] = {}
    for key in keys:
        pattern = ".".join("*" if part.isdecimal() else part for part in key.split("."))
        counts[pattern] = counts.get(pattern, 0) + 1
    return counts


def plan_command(args: argparse.Namespace) -> int:
    """Print how MODEL maps onto the mesh, reading no tensor data (or, for a port output, how it restores)."""
    from ._output import claims_output

    if Path(args.model).is_dir() and claims_output(args.model):
        return _plan_output(args)
    from ._mapping import mapping_for
    from ._sources import open_checkpoint

    with open_checkpoint(args.model) as ckpt:
        mapping = mapping_for(ckpt.config, _mapping_named(args, args.mapping))
        from .authoring import check as run_check  # JAX's: after the checkpoint and its mapping are found

        recipe = run_check(mapping, ckpt, args.mesh, args.dtype)
    if args.json:
        return _json(
            _plan_document(
                _shown(args.model),
                "load",
                mapping.model,
                str(mapping.source),
                recipe,
                absent=recipe.empty,
                ignored=recipe.ignored,
                tied=recipe.tied,
                source=lambda leaf: {
                    "source": leaf.pattern,
                    "stack": list(leaf.stack),
                    "transforms": str(leaf.chain),
                },
            )
        )
    heading = [f"{_shown(args.model)} -> {mapping.model} on mesh {args.mesh}", f"mapping: {mapping.source}"]
    show(plan_text(recipe, heading, shutil.get_terminal_size((80, 24)).columns))
    return 0


def _plan_document(
    model: str,
    kind: str,
    cls: str,
    mapping: str,
    plan,
    *,
    absent: Sequence[str],
    ignored: Sequence[str] = (),
    tied: Sequence[tuple[str, str]] = (),
    source: Callable[[Any], dict[str, Any]],
) -> dict[str, Any]:
    """The `port.plan/1` object (docs/cli.md) of a checkpoint's plan (`kind` "load") or of a port
    output's restore (`kind` "restore"): the fields in the documented order, each leaf's
    `source`, `stack` and `transforms` as `source(leaf)` gives them."""
    return {
        "schema": "port.plan/1",
        "model": model,
        "kind": kind,
        "class": cls,
        "mapping": mapping,
        "mesh": dict(plan.mesh_shape),
        "params": plan.params,
        "read_bytes": plan.read_bytes,
        "bytes_per_device": plan.device_bytes,
        "absent": list(absent),
        "excluded": list(plan.excluded),
        "ignored": list(ignored),
        "tied": [list(pair) for pair in tied],
        "leaves": [
            {
                "path": leaf.path,
                "shape": list(leaf.shape),
                "dtype": leaf.dtype.name,
                "spec": [list(e) if isinstance(e, tuple) else e for e in leaf.spec],
                "bytes_per_device": leaf.device_bytes,
                **source(leaf),
                "notes": list(leaf.notes),
            }
            for leaf in plan.leaves
        ],
    }


def _plan_output(args: argparse.Namespace) -> int:
    """`port plan DIR` for a port output: how `port.restore` lays it out on --mesh, from its checked
    metadata alone (no array read, nothing imported)."""
    from ._errors import OutputError
    from ._meshes import mesh_shape
    from ._output import read_output

    directory = printable(str(args.model))
    for flag, value, why in (
        ("--mapping", args.mapping, "restored by the mapping it keeps"),
        ("--dtype", args.dtype, "restored in the dtypes it was written in (convert again with --dtype)"),
        ("--module", (args.module or [None])[0], "planned from its metadata alone, importing nothing"),
    ):
        if value is not None:
            raise PortError(f"{flag} {printable(str(value))}: {directory} is a port output, {why}")
    shape = mesh_shape(args.mesh)
    output = read_output(args.model)
    from ._output import restore_plan  # JAX's PartitionSpec: after the flags and the metadata are checked

    try:
        placement = restore_plan(output, shape)
    except OutputError as e:  # its rules name an axis the mesh lacks: the flag's fault
        raise PortError(f"--mesh {args.mesh}: {e}") from None
    if args.json:
        return _json(
            _plan_document(
                str(args.model),
                "restore",
                output.mapping.model,
                output.mapping_source,
                placement,
                absent=placement.absent,
                source=lambda leaf: {"source": f"params/{leaf.path}", "stack": [], "transforms": "-"},
            )
        )
    heading = [
        f"{directory} -> {printable(output.mapping.model)} on mesh {args.mesh}, restored from a port output",
        f"mapping: {printable(output.mapping_source)} (kept in the output)",
    ]
    show(restore_plan_text(placement, heading, shutil.get_terminal_size((80, 24)).columns))
    return 0


def _json(document: dict) -> int:
    """Print `document` as port's JSON output (one object, indented, keys in the documented order):
    strict JSON, never a NaN or an infinity (`allow_nan=False`); a value copied from an untrusted file
    is type-checked before it gets here."""
    sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=True, allow_nan=False) + "\n")
    return 0


def check(args: argparse.Namespace) -> int:
    """Check a mapping against a checkpoint and its model, reading no tensor data."""
    from .authoring import check as run_check

    document = {"schema": "port.check/1", "mapping": str(args.mapping), "model": _shown(args.model)}
    try:
        result = run_check(_mapping_named(args, args.mapping), args.model, args.mesh)
    except PlanError as e:
        problems = [with_flags(problem) for problem in e.problems]
        if args.json:
            _json(document | {"ok": False, "problems": problems})
        else:
            show("".join(f"{shortened(printable(problem))}\n" for problem in problems))
        raise PortError(f"{args.mapping}: {plural(len(e.problems), 'problem')} with {_shown(args.model)}") from None
    if args.json:
        return _json(
            document
            | {
                "ok": True,
                "problems": [],
                "leaves": len(result.leaves),
                "params": result.params,
                "ignored": list(result.ignored),
                "tied": [list(pair) for pair in result.tied],
                "absent": list(result.empty),
            }
        )
    show(
        f"{args.mapping}: ok: {len(result.leaves)} leaves from {_shown(args.model)} ({count_text(result.params)} params), "
        f"{plural(len(result.ignored), 'key')} ignored, {len(result.tied)} tied, {len(result.empty)} optional absent\n"
    )
    return 0


def verify(args: argparse.Namespace) -> int:
    """Convert MODEL, run it and the PyTorch reference on the same inputs, compare; exit 1 above the tolerance."""
    from .authoring import verify as run_verify

    if args.tolerance is not None and not args.tolerance >= 0:
        raise PortError(f"--tolerance {args.tolerance}: expected a number >= 0")
    if args.roundtrip and args.dtype is not None:
        raise PortError(f"--roundtrip compares bit for bit: drop --dtype {args.dtype}")
    try:
        result = run_verify(
            args.model,
            args.mesh,
            _mapping_named(args, args.mapping),
            args.dtype,
            batch=args.batch,
            length=args.length,
            padding=args.padding,
            roundtrip=args.roundtrip,
            tolerance=args.tolerance,
        )
    except PortError as e:  # the API's words for batch and length, as the flags were given
        _as_flags(
            e,
            (f"batch={args.batch} and length={args.length}", f"--batch {args.batch} and --length {args.length}"),
            (f"batch={args.batch}", f"--batch {args.batch}"),
            (f"length={args.length}", f"--length {args.length}"),
        )
        raise
    bound = result.tolerance
    trip, found = result.roundtrip, result.first_divergence
    ok = result.max_abs_diff <= bound and (trip is None or trip.exact)
    verdict = "ok" if result.max_abs_diff <= bound else "FAILED"
    if args.json:
        _json(
            {
                "schema": "port.verify/1",
                "model": _shown(args.model),
                "reference": result.reference,
                "mesh": args.mesh,
                "dtype": result.dtype,
                "shape": list(result.shape),
                "padding": args.padding,
                "max_abs_difference": result.max_abs_diff,
                "max_abs_reference": result.max_abs_reference,
                "reference_error": result.reference_error,
                "tolerance": bound,
                "roundtrip": None
                if trip is None
                else {"same": trip.same, "differing": list(trip.differing), "not_written": list(trip.not_written)},
                "first_divergence": None
                if found is None
                else {
                    "modules": [{"module": m.module, "path": m.path, "layer": m.layer} for m in found.modules],
                    "observed": found.observed,
                    "max_abs_difference": found.max_abs_diff,
                    "max_abs_reference": found.max_abs_reference,
                    "relative_difference": found.relative_diff,
                    "inputs_max_abs_difference": found.inputs_max_abs_diff,
                    "compared": found.compared,
                },
                "ok": ok,
            }
        )
        return 0 if ok else 1
    padded = "" if args.padding is None else f", {args.padding}-padded"
    lines = [
        f"{_shown(args.model)}: max abs difference {result.max_abs_diff:.3g} vs {result.reference} "
        f"({result.dtype} {list(result.shape)}{padded}, max |reference| {result.max_abs_reference:.3g}"
        + (
            ""
            if result.reference_error is None
            else f", the reference's own {result.dtype} error {result.reference_error:.3g}"
        )
        + ") "
        f"on mesh {args.mesh}: {verdict} (tolerance {bound:.3g})"
    ]
    if found is not None:
        lines.append(f"{_shown(args.model)}: first divergence: {found}")
    if trip is not None:
        kept = (
            ""
            if not trip.not_written
            else f"; {plural(len(trip.not_written), 'key')} not written back (ignored or tied)"
        )
        if trip.exact:
            lines.append(
                f"{_shown(args.model)}: round trip: {plural(trip.same, 'tensor')} exported back bit for bit{kept}: ok"
            )
        else:
            lines.append(
                f"{_shown(args.model)}: round trip: {plural(len(trip.differing), 'tensor')} differ, first "
                f"{quoted(trip.differing[0])} ({trip.same} the same){kept}: FAILED"
            )
    show("\n".join(lines) + "\n")
    return 0 if ok else 1


def _is_draft(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith(SCAFFOLD_MARK)
    except (OSError, UnicodeDecodeError):
        return False


def scaffold(args: argparse.Namespace) -> int:
    """Write a draft mapping file pairing MODEL's keys with your module's leaves."""
    from .authoring import scaffold as run_scaffold

    out = None if args.out is None else _check_file_out(args.out, args.force, "--out", _is_draft, "a scaffold draft")
    text = run_scaffold(args.model, _model_class(args.module, factory=True), args.module)
    if out is None:
        sys.stdout.write(text)
    else:
        _write_file(out, text)
        say(
            f"wrote {args.out}: review the entries marked CHECK and TODO, then run port check {args.out} {_shown(args.model)} --module {args.module}"
        )
    return 0


def _stuck(error: PortError) -> NoReturn:
    """The worker's `on_stuck` handler: a run that cannot go on (a wait inside JAX's C++ past
    --timeout, or a process that will not come at exit) ends the process at once, from any
    thread, with one `port: error: ...` line (none if this process has said an error) and 1."""
    if not _console.failed:
        say("error: " + with_flags(str(error)))
    os._exit(1)
