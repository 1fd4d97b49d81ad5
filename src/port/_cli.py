"""The `port` command line: `port convert` and `port plan`.

```
port convert gpt2 --mesh 4x2 --out gpt2-jax [--dtype bfloat16] [--report run.json]
port plan gpt2 --mesh 4x2
```

Bad input ends with one line on stderr naming the problem, exit status 1, and no
output directory.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import click
import typer

from ._errors import PortError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Stream PyTorch / Hugging Face safetensors checkpoints into sharded Equinox models.",
)

Model = Annotated[str, typer.Argument(help="Checkpoint directory or Hugging Face repo id (e.g. gpt2).")]
MeshOpt = Annotated[str, typer.Option("--mesh", help="Device mesh DATAxMODEL, e.g. 4x2.")]
DtypeOpt = Annotated[
    Optional[str], typer.Option("--dtype", help="Cast floating parameters (float32, bfloat16, float16).")
]
MappingOpt = Annotated[
    Optional[Path], typer.Option("--mapping", help="Mapping file (default: the shipped one for model_type).")
]


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _say(message: str) -> None:
    print(f"port: {message}", file=sys.stderr)


def _dtype_name(dtype: str | None) -> str | None:
    from ._mapping import dtype as dtype_named

    if dtype is None:
        return None
    if dtype not in ("float32", "bfloat16", "float16", "float64"):
        raise PortError(f"--dtype '{dtype}': expected float32, bfloat16 or float16")
    return dtype_named(dtype).name


def _open(model: str, mapping_file: Path | None):
    from ._mapping import mapping_for
    from ._skeleton import skeleton
    from ._source import open_checkpoint

    ckpt = open_checkpoint(model)
    mapping = mapping_for(ckpt.config, mapping_file)
    return ckpt, mapping, skeleton(mapping, ckpt.config)


def _progress(enabled: bool | None, total_leaves: int, total_bytes: int):
    """A rich progress bar over tensors and bytes, or None when not wanted."""
    if enabled is None:
        enabled = sys.stderr.isatty()
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
        console=Console(stderr=True),
        transient=True,
    )
    bar.add_task(f"0/{total_leaves} tensors", total=total_bytes)
    return bar


@app.command()
def convert(
    model: Model,
    out: Annotated[Path, typer.Option("--out", help="Output directory (an Orbax checkpoint).")],
    mesh: MeshOpt = "1x1",
    dtype: DtypeOpt = None,
    mapping: MappingOpt = None,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write the run summary as JSON.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
    progress: Annotated[
        Optional[bool], typer.Option("--progress/--no-progress", help="Progress bar (default: on a terminal).")
    ] = None,
    coordinator: Annotated[
        Optional[str], typer.Option("--coordinator", help="HOST:PORT of process 0, for a multi-process run.")
    ] = None,
    num_processes: Annotated[Optional[int], typer.Option("--num-processes", help="Processes in the run.")] = None,
    process_id: Annotated[Optional[int], typer.Option("--process-id", help="This process, 0 to N-1.")] = None,
) -> None:
    """Convert MODEL into a sharded Equinox model and save it with Orbax to --out.

    For a multi-process run, start the same command in every process, adding
    --coordinator, --num-processes and --process-id (or JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID): each process reads only what its devices hold.
    """
    from ._distributed import _env_int, initialize
    from ._mesh import make_mesh, mesh_shape, simulate_devices
    from ._memory import PeakMemory
    from ._save import check_out

    start = time.perf_counter()
    shape = mesh_shape(mesh)
    processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES") or 1
    total = shape["data"] * shape["model"]
    if processes < 1 or total % processes:
        raise PortError(f"--mesh {mesh} ({total} devices) does not split evenly over {processes} processes")
    simulated = simulate_devices(total // processes)
    initialize(coordinator, num_processes, process_id)
    target = _dtype_name(dtype)
    check_out(out, force)
    if report is not None and not report.absolute().parent.is_dir():
        raise PortError(f"--report {report}: parent directory does not exist")
    with PeakMemory() as peak:
        import jax

        from ._fill import fill
        from ._place import place
        from ._plan import plan
        from ._save import save

        ckpt, mapping_, skel = _open(model, mapping)
        with ckpt:
            recipe = plan(skel, mapping_, ckpt.tensors, ckpt.config, shape, target)
            device_mesh = make_mesh(mesh)
            if simulated and jax.default_backend() == "cpu":
                each = f" in each of {processes} processes" if processes > 1 else ""
                _say(f"no accelerator: simulating {total // processes} CPU devices{each} for --mesh {mesh}")
            bar = _progress(progress, len(recipe.leaves), recipe.read_bytes)

            placed = 0

            def advance(leaf) -> None:
                nonlocal placed
                placed += 1
                if bar is not None:
                    bar.update(0, completed=ckpt.bytes_read, description=f"{placed}/{len(recipe.leaves)} tensors")

            if bar is not None:
                bar.start()
            placing = time.perf_counter()
            try:
                arrays = place(recipe, ckpt, device_mesh, advance)
            finally:
                if bar is not None:
                    bar.stop()
            filled = fill(skel, arrays)
            jax.block_until_ready(arrays)
            writing = time.perf_counter()
            written = save(filled, out, mapping_, ckpt.config, force=force)
            done = time.perf_counter()
    device_bytes: dict[str, int] = {}
    for array in arrays.values():
        for shard in array.addressable_shards if array is not None else ():
            key = str(shard.device.id)
            device_bytes[key] = device_bytes.get(key, 0) + shard.data.nbytes
    seconds = time.perf_counter() - start
    summary = {
        "process": jax.process_index(),
        "num_processes": jax.process_count(),
        "model": model,
        "out": str(written),
        "mesh": dict(device_mesh.shape),
        "dtype": target,
        "seconds": round(seconds, 3),
        "place_seconds": round(writing - placing, 3),
        "save_seconds": round(done - writing, 3),
        "params": recipe.params,
        "bytes_read": ckpt.bytes_read,
        "device_bytes": device_bytes,
        "peak_host_bytes": peak.bytes,
    }
    who = f"process {jax.process_index()}/{jax.process_count()}: " if jax.process_count() > 1 else ""
    _say(
        f"{who}converted {model}: {_count(recipe.params)} params onto mesh {mesh} in {seconds:.1f} s "
        f"(placing {writing - placing:.1f} s, writing {done - writing:.1f} s); "
        f"read {_size(ckpt.bytes_read)}, {_size(max(device_bytes.values()))} per device, "
        f"peak host memory {_size(peak.bytes)} -> {written}"
    )
    if report is not None:
        if jax.process_count() > 1:  # each process reports its own reads: run.json -> run.1.json
            report = report.with_name(f"{report.stem}.{jax.process_index()}{report.suffix}")
        report.write_text(json.dumps(summary, indent=1) + "\n")


@app.command("plan")
def plan_command(
    model: Model,
    mesh: MeshOpt = "1x1",
    dtype: DtypeOpt = None,
    mapping: MappingOpt = None,
) -> None:
    """Print how MODEL maps onto the mesh, reading no tensor data."""
    from rich.console import Console
    from rich.table import Table

    from ._mesh import mesh_shape
    from ._plan import plan

    shape = mesh_shape(mesh)
    ckpt, mapping_, skel = _open(model, mapping)
    with ckpt:
        recipe = plan(skel, mapping_, ckpt.tensors, ckpt.config, shape, _dtype_name(dtype))
    rows = recipe.table()
    table = Table(title=f"{model} -> {mapping_.model} on mesh {mesh} ({mapping_.source})")
    for column in rows[0]:
        table.add_column(column, justify="right" if column == "bytes/device" else "left", overflow="fold")
    for row in rows:
        table.add_row(*row.values())
    console = Console(width=max(160, Console().width))
    console.print(table)
    for key in recipe.ignored:
        console.print(f"ignored: {key}")
    for key, copy_of in recipe.tied:
        console.print(f"tied: {key} = {copy_of}, not read")
    for path in recipe.empty:
        console.print(f"absent: {path} (optional, not in the checkpoint: None)")
    console.print(
        f"{_count(recipe.params)} params in {len(recipe.leaves)} leaves; "
        f"{_size(recipe.read_bytes)} to read, {_size(recipe.device_bytes)} per device"
    )


@app.command()
def check(
    mapping: Annotated[Path, typer.Argument(help="The mapping file to check.")],
    model: Model,
    mesh: MeshOpt = "1x1",
) -> None:
    """Check a mapping against a checkpoint and its model, reading no tensor data."""
    from ._mapping import load_mapping
    from ._mesh import mesh_shape
    from ._plan import Plan, plan_problems
    from ._skeleton import skeleton
    from ._source import open_checkpoint

    shape = mesh_shape(mesh)
    parsed = load_mapping(mapping)
    with open_checkpoint(model) as ckpt:
        result = plan_problems(skeleton(parsed, ckpt.config), parsed, ckpt.tensors, ckpt.config, shape)
    if isinstance(result, Plan):
        print(
            f"{mapping}: ok: {len(result.leaves)} leaves from {model} ({_count(result.params)} params), "
            f"{len(result.ignored)} keys ignored, {len(result.tied)} tied, {len(result.empty)} optional absent"
        )
        return
    for problem in result:
        print(problem)
    raise PortError(f"{mapping}: {len(result)} problem{'s' if len(result) > 1 else ''} with {model}")


@app.command()
def verify(
    model: Model,
    mesh: MeshOpt = "1x1",
    dtype: DtypeOpt = None,
    mapping: MappingOpt = None,
    tolerance: Annotated[
        Optional[float],
        typer.Option(help="Largest allowed difference (default 1e-4, or 2e-2 for 16-bit, x max(1, max |reference|))."),
    ] = None,
) -> None:
    """Convert MODEL, run it and the PyTorch reference on the same inputs, compare."""
    from ._mesh import make_mesh, mesh_shape, simulate_devices
    from ._verify import _torch, verify as run_verify

    shape = mesh_shape(mesh)
    _torch()
    simulate_devices(shape["data"] * shape["model"])
    result = run_verify(model, make_mesh(mesh), mapping, _dtype_name(dtype))
    bound = result.tolerance if tolerance is None else tolerance
    verdict = "ok" if result.max_abs_diff <= bound else "FAILED"
    print(
        f"{model}: max abs difference {result.max_abs_diff:.3g} vs {result.reference} "
        f"({result.dtype} {list(result.shape)}, max |reference| {result.max_abs_reference:.3g}) "
        f"on mesh {mesh}: {verdict} (tolerance {bound:.3g})"
    )
    if verdict != "ok":
        raise typer.Exit(1)


@app.command()
def scaffold(
    model: Model,
    module: Annotated[str, typer.Option("--module", help="Your Equinox module, package.module:Class.")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Write the draft here (default: stdout).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")] = False,
) -> None:
    """Write a draft mapping file pairing MODEL's keys with your module's leaves."""
    from ._mapping import import_object
    from ._scaffold import scaffold as draft
    from ._skeleton import skeleton
    from ._source import open_checkpoint

    if out is not None and out.exists() and not force:
        raise PortError(f"--out {out}: already exists (use --force to replace it)")
    cls = import_object(module, "--module")
    with open_checkpoint(model) as ckpt:
        text = draft(ckpt, skeleton(cls, ckpt.config), module)
    if out is None:
        print(text, end="")
    else:
        out.write_text(text)
        _say(f"wrote {out}: review the entries marked CHECK and TODO, then run port check {out} {model}")


def main() -> None:
    """Entry point: run the app, turning bad input into one line and a non-zero exit."""
    try:
        app(standalone_mode=False)
    except PortError as e:
        _say("error: " + str(e).replace("\n", "\\n"))
        sys.exit(1)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _say("interrupted")
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the CLI promises no traceback
        if os.environ.get("PORT_DEBUG"):
            raise
        message = str(e).splitlines()[0] if str(e) else ""
        _say(f"internal error: {type(e).__name__}: {message} (PORT_DEBUG=1 shows the traceback)")
        sys.exit(1)
