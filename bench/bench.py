"""Benchmark: port against the usual ways of loading a GPT-2 checkpoint into JAX.

    python bench/bench.py [--sizes small,medium,large] [--dtypes float32,bfloat16]
                          [--mesh 4x2] [--repeats 3] [--out docs/benchmarks.md]

For each size and dtype it writes a random GPT-2 checkpoint (bench/make_gpt2.py),
warms the page cache, then runs each method `--repeats` times, each time in a fresh
process on 8 simulated CPU devices, and reports the median:

  (a) port       `port.load(dir, mesh=...)`: sharded model, blocks read under their sharding;
                 "port-convert" is the `port convert` command (in the measured process),
                 which also writes the Orbax checkpoint
  (b) recipe     `safetensors.numpy.load_file` of the whole file, rename / split / reshape /
                 stack in NumPy, `jax.device_put` with the shardings, `eqx.tree_at`
  (c) floor-per-tensor  every tensor read into a new NumPy array once and kept
                 (`safetensors.numpy.load_file`, pread backend); "floor-per-tensor-streamed" reads
                 each tensor and drops it before the next. Not the host's floor: that is
                 bench/host.py's `floor` (every byte of the files once, `readinto` fresh buffers)
  (d) flax       transformers 4.x `FlaxGPT2LMHeadModel.from_pretrained(..., from_pt=True)`,
                 where installed
  (e) floor-rw   each tensor read (streamed, as floor-per-tensor-streamed) and its bytes written to one
                 new file; "floor-rw+fsync" also fsyncs the file: port-convert's floors
  (f) port-restore  `port.restore(out, mesh=...)` of a `port convert` output that the
                 driver writes once, untimed, beside the checkpoint (`<dir>-out`);
                 "floor-restore" reads the same array chunk files into NumPy, its floor

Under each table, one line per port command compares its time with its floor (bound
1.5x) and its peak memory minus the arrays it produced with 1.5x the largest tensor.

Memory is this script's own sampling of `RssAnon` (/proc/self/status) in the
measured process, above its value just before the method starts. The result table
goes to stdout and, with --out, to a Markdown file with the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _measure  # bench/ is the script's directory, first on sys.path
from _measure import peak_memory

HERE = Path(__file__).resolve().parent
METHODS = (
    "port",
    "port-convert",
    "port-restore",
    "recipe",
    "floor-per-tensor",
    "floor-per-tensor-streamed",
    "floor-rw",
    "floor-rw+fsync",
    "floor-restore",
    "read+put",
    "put",
    "flax",
)
RESTORE_METHODS = ("port-restore", "floor-restore")
BOUND = 1.5

# Run by measure() after the clock stops: clean-up the methods leave (temp outputs).
_AFTER: list[Callable[[], None]] = []


# ---------------------------------------------------------------- measured process


def _port(directory: Path, mesh):
    import jax

    import port

    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        skeleton = port.skeleton(mapping, ckpt.config)
        recipe = port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, mesh.shape)
        model = port.fill(skeleton, port.place(recipe, ckpt, mesh))
        jax.block_until_ready(model)
        return model, ckpt.bytes_read


def _recipe(directory: Path, mesh):
    """What users write today: whole state dict in NumPy, reshape by hand, then shard."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from safetensors.numpy import load_file

    import port

    config = json.loads((directory / "config.json").read_text())
    path = directory / "model.safetensors"
    state = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    e, h, n = config["n_embd"], config["n_head"], config["n_layer"]

    def stack(name, fn=lambda x: x):
        return np.stack([fn(state[f"h.{i}.{name}"]) for i in range(n)])

    arrays = {
        "wte": state["wte.weight"],
        "wpe": state["wpe.weight"],
        "ln_f.weight": state["ln_f.weight"],
        "ln_f.bias": state["ln_f.bias"],
    }
    for ln in ("ln_1", "ln_2"):
        arrays[f"blocks.{ln}.weight"] = stack(f"{ln}.weight")
        arrays[f"blocks.{ln}.bias"] = stack(f"{ln}.bias")
    for i, x in enumerate("qkv"):
        arrays[f"blocks.attn.w{x}"] = stack("attn.c_attn.weight", lambda w: w[:, i * e : (i + 1) * e].reshape(e, h, -1))
        arrays[f"blocks.attn.b{x}"] = stack("attn.c_attn.bias", lambda b: b[i * e : (i + 1) * e].reshape(h, -1))
    arrays["blocks.attn.wo"] = stack("attn.c_proj.weight", lambda w: w.reshape(h, -1, e))
    arrays["blocks.attn.bo"] = stack("attn.c_proj.bias")
    arrays["blocks.mlp.w_fc"] = stack("mlp.c_fc.weight")
    arrays["blocks.mlp.b_fc"] = stack("mlp.c_fc.bias")
    arrays["blocks.mlp.w_proj"] = stack("mlp.c_proj.weight")
    arrays["blocks.mlp.b_proj"] = stack("mlp.c_proj.bias")
    state.clear()  # the whole state dict freed, as the recipe does
    # The shardings port would use: the recipe gets them for free.
    mapping = port.mapping_for(config)
    axes = {p.path: p.axes for p in mapping.params}
    placed = {}
    for leaf in list(arrays):
        spec, _ = port._plan.partition(arrays[leaf].shape, axes[leaf], mapping.rules, mesh.shape)
        placed[leaf] = jax.device_put(arrays.pop(leaf), NamedSharding(mesh, spec))
    skeleton = port.skeleton(mapping, config)
    model = port.fill(skeleton, placed)
    jax.block_until_ready(model)
    return model, path.stat().st_size


def _port_convert(directory: Path, mesh):
    import port._cli

    out = Path(tempfile.mkdtemp(prefix="port-bench-out-")) / "out"
    report = out.parent / "report.json"
    mesh_spec = "x".join(str(n) for n in mesh.shape.values())
    # `run`, not `main`: the command in this (measured) process, without the supervisor.
    code = port._cli.run(
        ["convert", str(directory), "--mesh", mesh_spec, "--out", str(out), "--report", str(report), "--no-progress"]
    )
    if code:
        raise RuntimeError(f"port convert exited {code}")
    figures = json.loads(report.read_text())
    _AFTER.append(lambda: shutil.rmtree(out.parent))  # not timed, as for the floor-rw rows
    return None, figures["bytes_read"], figures


def _floor_rw(directory: Path, mesh, fsync: bool = False):
    """Read each tensor (streamed) and write its bytes to one new file; port convert's floor."""
    from safetensors import safe_open

    scratch = Path(tempfile.mkdtemp(prefix="port-bench-rw-"))
    _AFTER.append(lambda: shutil.rmtree(scratch))
    total = 0
    with (
        safe_open(directory / "model.safetensors", "np", backend="pread") as f,
        open(scratch / "tensors.bin", "wb") as out,
    ):
        for key in f.keys():
            tensor = f.get_tensor(key)
            total += tensor.nbytes
            out.write(tensor.reshape(-1).view("uint8"))
            del tensor
        if fsync:
            out.flush()
            os.fsync(out.fileno())
    return None, total


def _floor_rw_fsync(directory: Path, mesh):
    return _floor_rw(directory, mesh, fsync=True)


def output_of(directory: Path) -> Path:
    """Where the driver writes the `port convert` output that the restore rows read."""
    return directory.parent / (directory.name + "-out")


def chunk_files(out: Path) -> list[Path]:
    """The array chunk files of a port output: regular files under params/, not metadata."""
    params = out / "params"
    return sorted(
        path
        for path in params.rglob("*")
        if path.is_file()
        and not path.is_symlink()
        and not path.name.startswith((".", "_"))
        and "array_metadatas" not in path.relative_to(params).parts
    )


def _port_restore(directory: Path, mesh):
    import jax

    import port

    out = output_of(directory)
    model = port.restore(out, mesh)
    jax.block_until_ready(model)
    return model, sum(path.stat().st_size for path in chunk_files(out))


def _floor_restore(directory: Path, mesh):
    """Read the chunk files port.restore reads into NumPy, kept until the clock stops."""
    import numpy as np

    arrays = [np.fromfile(path, dtype=np.uint8) for path in chunk_files(output_of(directory))]
    _AFTER.append(arrays.clear)
    return None, sum(a.nbytes for a in arrays)


def _floor_per_tensor(directory: Path, mesh):
    from safetensors.numpy import load_file

    # backend="pread": the bytes land in NumPy memory (the default "mmap" returns views
    # of the file that read nothing until touched).
    tensors = load_file(directory / "model.safetensors", backend="pread")
    return None, sum(t.nbytes for t in tensors.values())


def _floor_per_tensor_streamed(directory: Path, mesh):
    from safetensors import safe_open

    total = 0
    with safe_open(directory / "model.safetensors", "np", backend="pread") as f:
        for key in f.keys():
            total += f.get_tensor(key).nbytes
    return None, total


def _read_put(directory: Path, mesh):
    """The plain load onto a device: each tensor read (pread) and `jax.device_put` on the mesh's
    first device, in turn (no sharding, no renaming: the least a loader does)."""
    import jax
    from safetensors import safe_open

    device, arrays, total = mesh.devices.flat[0], [], 0
    with safe_open(directory / "model.safetensors", "np", backend="pread") as f:
        for key in f.keys():
            tensor = f.get_tensor(key)
            total += tensor.nbytes
            arrays.append(jax.device_put(tensor, device))
    jax.block_until_ready(arrays)
    return arrays, total


def _put(tensors: dict, mesh):
    """The transfers alone: the tensors, already in host memory (read before the clock), put on
    the mesh's first device with `jax.device_put`."""
    import jax

    device = mesh.devices.flat[0]
    arrays = [jax.device_put(tensor, device) for tensor in tensors.values()]
    jax.block_until_ready(arrays)
    return arrays, 0


def _read_for_put(directory: Path):
    from safetensors.numpy import load_file

    return load_file(directory / "model.safetensors", backend="pread")


# What a method's function takes instead of the directory, made before the clock.
_BEFORE: dict[str, Callable[[Path], object]] = {"put": _read_for_put}


def _flax(directory: Path, mesh):
    import jax
    from transformers import FlaxGPT2LMHeadModel  # transformers 4.x only

    model = FlaxGPT2LMHeadModel.from_pretrained(directory, from_pt=True)
    jax.block_until_ready(model.params)
    return model.params, (directory / "model.safetensors").stat().st_size


def measure(method: str, directory: Path, mesh_spec: str) -> dict:
    """Run one method once in this (fresh) process and return its figures."""
    # port's modules load lazily: imported here, before the clock, like JAX itself (start-up, not the method).
    mesh = _measure.started(mesh_spec)
    import port._cli  # noqa: F401  (port-convert runs the command)

    fn = {
        "port": _port,
        "port-convert": _port_convert,
        "port-restore": _port_restore,
        "recipe": _recipe,
        "floor-per-tensor": _floor_per_tensor,
        "floor-per-tensor-streamed": _floor_per_tensor_streamed,
        "floor-rw": _floor_rw,
        "floor-rw+fsync": _floor_rw_fsync,
        "floor-restore": _floor_restore,
        "read+put": _read_put,
        "put": _put,
        "flax": _flax,
    }[method]
    given = _BEFORE[method](directory) if method in _BEFORE else directory
    if method == "flax":
        from transformers import FlaxGPT2LMHeadModel  # noqa: F401  (transformers 4.x only)
    _measure.back_memory(2 * (directory / "model.safetensors").stat().st_size)
    # Every method starts with nothing waiting to be written: otherwise one that left gigabytes
    # in the page cache (floor-rw) makes the next one's writes wait behind them.
    os.sync()
    stop = peak_memory(0.002)  # RssAnon sampled by another process every 2 ms
    try:
        start = time.perf_counter()
        result, bytes_read, *report = fn(given, mesh)
        seconds = time.perf_counter() - start
        peak = stop()
    finally:
        while _AFTER:  # clean-up, not timed (and done when the method failed)
            _AFTER.pop()()
    if report:  # port convert: the arrays are gone once written; its report has the device bytes
        per_device, total_device = max(report[0]["device_bytes"].values()), sum(report[0]["device_bytes"].values())
    elif result is not None and method != "flax":
        per_device, total_device = _measure.device_bytes(result)
    else:
        per_device, total_device = 0, 0
    return {
        "seconds": seconds,
        "peak_above_start": peak,
        "bytes_read": bytes_read,
        "device_bytes": per_device,
        "total_device_bytes": total_device,
    }


# ---------------------------------------------------------------- driver


def run_method(method: str, directory: Path, mesh: str) -> dict | str:
    command = [sys.executable, __file__, "--measure", method, str(directory), mesh]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        missing = "ImportError" in done.stderr or "ModuleNotFoundError" in done.stderr
        return "not installed (transformers 5 has no Flax models)" if missing else last[:80]
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> str:
    """This machine as the tables name it: `2 CPU cores (AMD EPYC ...), 24 GiB`."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPU cores ({cpu}), {memory:.0f} GiB"


def median_run(runs: list, peaks: tuple[str, ...]) -> dict | str:
    """The run of median time, with each of `peaks` the largest of all runs; a failed run's message if all failed."""
    ok = [r for r in runs if isinstance(r, dict)]
    if not ok:
        return runs[0]
    median = statistics.median(r["seconds"] for r in ok)
    chosen = min(ok, key=lambda r: abs(r["seconds"] - median))
    return dict(chosen, **{name: max(r[name] for r in ok) for name in peaks})


def warm(*paths: Path) -> None:
    """Read each file once, so that every method finds it in the page cache."""
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def convert_for_restore(directory: Path, mesh: str) -> str | None:
    """Write `port convert`'s output for the restore rows (untimed); an error line if it failed."""
    command = [
        sys.executable,
        "-m",
        "port",
        "convert",
        str(directory),
        "--out",
        str(output_of(directory)),
        "--mesh",
        mesh,
        "--force",
        "--no-progress",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return f"port convert failed: {last}"[:80]
    return None


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def table(size: str, dtype: str, results: dict, largest: int) -> str:
    rows = [
        f"### GPT-2 {size}, {dtype}, mesh {MESH}",
        "",
        "| method | seconds | peak anon memory above start | bytes read | bytes per device "
        "| x recipe (time) | x floor-per-tensor (time) | x floor-per-tensor-streamed (time) | x recipe (memory) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base, floor, streamed = (
        results.get("recipe"),
        results.get("floor-per-tensor"),
        results.get("floor-per-tensor-streamed"),
    )
    for method in METHODS:
        r = results.get(method)
        if not isinstance(r, dict):
            rows.append(f"| {method} | {r or 'skipped'} | | | | | | | |")
            continue
        vs_recipe = f"{r['seconds'] / base['seconds']:.2f}" if isinstance(base, dict) else ""
        vs_floor = f"{r['seconds'] / floor['seconds']:.2f}" if isinstance(floor, dict) else ""
        vs_streamed = f"{r['seconds'] / streamed['seconds']:.2f}" if isinstance(streamed, dict) else ""
        mem = f"{r['peak_above_start'] / base['peak_above_start']:.2f}" if isinstance(base, dict) else ""
        per_device = _mb(r["device_bytes"]) if r["device_bytes"] else "-"
        rows.append(
            f"| {method} | {r['seconds']:.3f} | {_mb(r['peak_above_start'])} | {_mb(r['bytes_read'])} | "
            f"{per_device} | {vs_recipe} | {vs_floor} | {vs_streamed} | {mem} |"
        )
    rows += _convert_line(results, largest) + _restore_line(results, largest) + _overlap_line(results)
    p = results.get("port")
    if isinstance(p, dict) and isinstance(floor, dict):
        overhead = p["peak_above_start"] - p["total_device_bytes"]
        rows += [
            "",
            f"port: peak above start minus the arrays it produced ({_mb(p['total_device_bytes'])} on 8 "
            f"devices) = {_mb(overhead)}; the bound is 1.5 x the largest source tensor = {_mb(1.5 * largest)} "
            f"({'holds' if overhead <= 1.5 * largest else 'EXCEEDED'}). Time vs floor-per-tensor: "
            f"{p['seconds'] / floor['seconds']:.2f} (bound 1.5: "
            f"{'holds' if p['seconds'] <= 1.5 * floor['seconds'] else 'EXCEEDED'}).",
        ]
    return "\n".join(rows)


def _holds(value: float, bound: float) -> str:
    return "holds" if value <= bound else "EXCEEDED"


def _vs(r: dict, floor: dict | str | None, name: str) -> str:
    """`vs NAME 1.234 s: 1.05 (bound 1.5: holds)`, or why there is no ratio."""
    if not isinstance(floor, dict):
        return f"vs {name}: no figure ({floor or 'not run'})"
    ratio = r["seconds"] / floor["seconds"]
    return f"vs {name} {floor['seconds']:.3f} s: {ratio:.2f} (bound {BOUND}: {_holds(ratio, BOUND)})"


def _memory(r: dict, largest: int) -> str:
    overhead = r["peak_above_start"] - r["total_device_bytes"]
    return (
        f"memory: peak above start minus the arrays ({_mb(r['total_device_bytes'])} on 8 devices) = "
        f"{_mb(overhead)}, bound {BOUND} x the largest tensor = {_mb(BOUND * largest)} "
        f"({_holds(overhead, BOUND * largest)})"
    )


def _convert_line(results: dict, largest: int) -> list[str]:
    r = results.get("port-convert")
    if not isinstance(r, dict):
        return []
    return [
        "",
        f"port-convert: {r['seconds']:.3f} s; {_vs(r, results.get('floor-rw'), 'floor-rw')}; "
        f"{_vs(r, results.get('floor-rw+fsync'), 'floor-rw+fsync')} (the like-for-like floor: "
        f"port fsyncs its output); {_memory(r, largest)}.",
    ]


def _overlap_line(results: dict) -> list[str]:
    """How much of the reading and the transfers port does at once: floor-per-tensor (reading alone) plus
    put (the transfers alone) against port."""
    p, floor, put = results.get("port"), results.get("floor-per-tensor"), results.get("put")
    if not all(isinstance(r, dict) for r in (p, floor, put)):
        return []
    both = floor["seconds"] + put["seconds"]
    return [
        "",
        f"overlap: reading alone (floor-per-tensor) {floor['seconds']:.3f} s + the transfers alone (put) "
        f"{put['seconds']:.3f} s = {both:.3f} s, against port {p['seconds']:.3f} s: "
        f"{max(0.0, both - p['seconds']):.3f} s done at once.",
    ]


def _restore_line(results: dict, largest: int) -> list[str]:
    r = results.get("port-restore")
    if not isinstance(r, dict):
        return []
    return [
        "",
        f"port-restore: {r['seconds']:.3f} s; {_vs(r, results.get('floor-restore'), 'floor-restore')}; "
        f"{_memory(r, largest)}.",
    ]


MESH = "4x2"


def main() -> None:
    global MESH
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        print(json.dumps(measure(sys.argv[2], Path(sys.argv[3]), sys.argv[4])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,medium,large")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"from {', '.join(METHODS)}")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--workdir", type=Path, help="where to write checkpoints (default: a temp dir)")
    args = parser.parse_args()
    MESH = args.mesh
    sys.path.insert(0, str(HERE))
    import make_gpt2

    work = args.workdir or Path(tempfile.mkdtemp(prefix="port-bench-"))
    sections = []
    try:
        for size in args.sizes.split(","):
            for dtype in args.dtypes.split(","):
                directory = work / f"gpt2-{size}-{dtype}"
                if not (directory / "model.safetensors").exists():
                    make_gpt2.write(size, directory, dtype)
                from safetensors import safe_open

                with safe_open(directory / "model.safetensors", "np") as f:
                    largest = max(
                        f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape() + [1])[1] for k in f.keys()
                    ) * (2 if dtype == "bfloat16" else 4)
                methods = args.methods.split(",")
                failed = None
                if any(m in RESTORE_METHODS for m in methods):
                    failed = convert_for_restore(directory, args.mesh)
                    if failed is None:
                        warm(*chunk_files(output_of(directory)))
                warm(directory / "model.safetensors")
                runs: dict = {m: [] for m in methods}
                for _ in range(args.repeats):
                    for method in methods:
                        if failed and method in RESTORE_METHODS:
                            r = failed
                        else:
                            r = run_method(method, directory, args.mesh)
                        runs[method].append(r)
                results = {method: median_run(rs, ("peak_above_start",)) for method, rs in runs.items()}
                section = table(size, dtype, results, largest)
                print(section + "\n", flush=True)
                sections.append(section)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        header = [
            "# Benchmarks",
            "",
            f"Machine: {machine()}, no accelerator; 8 simulated CPU devices; Python {platform.python_version()}.",
            "",
            "Command: `python bench/bench.py " + " ".join(sys.argv[1:]) + "`",
            "",
            "Each figure is the median of the repeats (peak memory: the largest), each run in a fresh "
            "process after the page cache was warmed, twice the checkpoint's size of memory was touched "
            "and freed (the VM backs fresh guest memory slowly on first touch), and every dirty page was "
            "written (`os.sync`, so no run waits behind an earlier one's writes). Seconds cover the method "
            "alone (not JAX start-up, nor importing port's modules). "
            "Peak memory is anonymous resident memory (`RssAnon`) sampled every 2 ms, above its value "
            "when the method started; on CPU the produced arrays themselves live in host memory.",
            "",
            "Reading the tables:",
            "",
            "- `port` is the conversion: a sharded model, every parameter on its final `NamedSharding`. "
            "Its peak memory is the arrays it produces (the line under each table gives what is left "
            "over) and it is compared with reading every tensor into a new NumPy array (`floor-per-tensor`; "
            "the host's floor, every byte once into fresh buffers, is bench/host.py's). `floor-per-tensor-streamed` "
            "reads each tensor and drops it before the next, so it never holds the model and reuses "
            "one warm buffer: a lower bound no conversion that produces the model can reach.",
            "- `port-convert` is the whole `port convert` command: the same conversion, each leaf's "
            "chunk files written (and flushed to disk) by a pool of threads straight from the device "
            "buffers while the next leaves are placed, then the metadata and the rename into place.",
            "- `floor-rw` reads each tensor (as `floor-per-tensor-streamed`) and writes its bytes to one new file "
            "with a plain buffered write; `floor-rw+fsync` also fsyncs that file before the clock stops. "
            "port writes its output to disk and fsyncs it before renaming it into place, so "
            "`floor-rw+fsync` is `port-convert`'s like-for-like floor; the line under each table gives "
            "both ratios and port-convert's memory above the arrays it wrote.",
            "- `port-restore` is `port.restore(out, mesh=...)` of a `port convert` output written once "
            "before the repeats (untimed, its chunk files then read once to warm the page cache). "
            "`floor-restore` reads the same chunk files into NumPy and keeps them: its floor. The line "
            "under each table compares the two and gives port-restore's memory above the arrays.",
            "- `recipe` gets the shardings from port for free; in practice users also build a randomly "
            "initialised model first, which costs another copy.",
            "- `flax` (transformers 4.x `FlaxGPT2LMHeadModel.from_pretrained(..., from_pt=True)`) runs "
            "only where transformers 4.x is installed; transformers 5 removed its Flax models.",
            "",
        ]
        args.out.write_text("\n".join(header) + "\n" + "\n\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
