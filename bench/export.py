"""Benchmark: `port.export` of a sharded GPT-2 against writing the same bytes with safetensors.

    python bench/export.py [--sizes medium,large] [--dtypes float32,bfloat16] [--mesh 4x2]
                           [--repeats 3] [--workdir DIR] [--out FILE]

For each size and dtype it writes a random GPT-2 checkpoint (bench/make_gpt2.py), then
runs each method `--repeats` times, each time in a fresh process on 8 simulated CPU
devices, and reports the median:

  port         `port.load(dir, mesh=...)` first (not timed), then `port.export(model, out, dir)`:
               every tensor gathered from the device shards, inverted (q|k|v fused back, layers
               unstacked), written at its offset, and the files flushed to disk (`fdatasync`)
  floor        `safetensors.numpy.save_file` of the same tensors, already in host memory as a
               dict of NumPy arrays (read before the clock starts: the floor gets them for free)
  floor+fsync  the same, then `fsync` of the file: the same durability as port's export

The output goes to the same file system as the checkpoint (`--workdir`) and is removed
after each run; `sync` runs before each, so no run pays for another's dirty pages.
Memory is anonymous resident memory (`RssAnon`) of the measured process above its value
when the method starts (for port: with the model loaded), sampled every 2 ms by another
process as bench/bench.py does (a thread stalls while a library holds the GIL), and, for
comparison, by `port._memory.PeakMemory` (a thread in the process, every 5 ms).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _measure

HERE = Path(__file__).resolve().parent
METHODS = ("port", "floor", "floor+fsync")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_bench = _module("bench")  # the sampler, memory backing and cache warming bench.py uses


# ---------------------------------------------------------------- measured process


def _written(out: Path) -> int:
    return sum(p.stat().st_size for p in out.iterdir() if p.name.endswith(".safetensors"))


def measure(method: str, directory: Path, mesh_spec: str, out: Path) -> dict:
    """Run one method once in this (fresh) process and return its figures."""
    from port._memory import PeakMemory, rss_anon

    source = directory / "model.safetensors"
    if method == "port":
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
        import port

        model = port.load(directory, mesh=mesh_spec)
        jax.block_until_ready(model)
        run = lambda: port.export(model, out, directory)  # noqa: E731
    else:
        import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, which safetensors.numpy needs)
        from safetensors.numpy import load_file, save_file

        tensors = load_file(source, backend="pread")  # in host memory before the clock starts

        def run():
            out.mkdir()
            save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
            if method == "floor+fsync":
                fd = os.open(out / "model.safetensors", os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    _bench._back_memory(source.stat().st_size)
    stop = _measure.peak_memory()
    base = rss_anon()
    with PeakMemory() as thread:  # its `bytes`: the largest value sampled
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
    peak = stop()
    return {
        "seconds": seconds,
        "peak_above_start": peak,
        "peak_thread_above_start": max(0, thread.bytes - base),
        "bytes_written": _written(out),
        "files": sorted(p.name for p in out.iterdir()),
    }


# ---------------------------------------------------------------- driver


def run_method(method: str, directory: Path, mesh: str, out: Path) -> dict | str:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    command = [sys.executable, __file__, "--measure", method, str(directory), mesh, str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    if done.returncode != 0:
        return ((done.stderr.strip().splitlines() or ["failed"])[-1])[:120]
    return json.loads(done.stdout.strip().splitlines()[-1])


def largest_tensor(directory: Path) -> tuple[int, int]:
    """(bytes of the largest tensor, bytes of all tensors) of the checkpoint, from its header."""
    from safetensors import safe_open

    sizes = []
    with safe_open(directory / "model.safetensors", "np") as f:
        for key in f.keys():
            s = f.get_slice(key)
            n = 1
            for d in s.get_shape():
                n *= d
            sizes.append(n * {"F32": 4, "BF16": 2, "F16": 2}[s.get_dtype()])
    return max(sizes), sum(sizes)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


HEAD = (
    "| size | dtype | port export s | floor s | x floor | floor+fsync s | x floor+fsync "
    "| peak anon above model (2 ms sampler / PeakMemory) | largest tensor | bytes written |"
)


def row(size: str, dtype: str, results: dict, largest: int) -> str:
    p, f, fs = (results.get(m) for m in METHODS)
    if not isinstance(p, dict):
        return f"| {size} | {dtype} | {p} | | | | | | {_mb(largest)} | |"
    floor = f"{f['seconds']:.2f}" if isinstance(f, dict) else str(f)
    vs_floor = f"{p['seconds'] / f['seconds']:.2f}" if isinstance(f, dict) else ""
    synced = f"{fs['seconds']:.2f}" if isinstance(fs, dict) else str(fs)
    vs_synced = f"{p['seconds'] / fs['seconds']:.2f}" if isinstance(fs, dict) else ""
    return (
        f"| {size} | {dtype} | {p['seconds']:.2f} | {floor} | {vs_floor} | {synced} | {vs_synced} | "
        f"{_mb(p['peak_above_start'])} / {_mb(p['peak_thread_above_start'])} | {_mb(largest)} | "
        f"{p['bytes_written']:,} |"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        print(json.dumps(measure(sys.argv[2], Path(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="medium,large", help="from small, medium, large (large: ~3.1 GB in float32)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"from {', '.join(METHODS)}")
    parser.add_argument("--workdir", type=Path, help="where checkpoints and outputs go (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="also write the table, machine and command to this Markdown file")
    args = parser.parse_args()
    make_gpt2 = _module("make_gpt2")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="port-bench-export-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, notes = [], []
    print(HEAD + "\n|" + "---|" * HEAD.count(" | ") + "---|", flush=True)
    try:
        for size in args.sizes.split(","):
            for dtype in args.dtypes.split(","):
                directory = work / f"gpt2-{size}-{dtype}"
                if not (directory / "model.safetensors").exists():
                    make_gpt2.write(size, directory, dtype)
                largest, total = largest_tensor(directory)
                _bench.warm(*sorted(directory.glob("*.safetensors")))
                methods = args.methods.split(",")
                runs: dict = {m: [] for m in methods}
                for _ in range(args.repeats):
                    for method in methods:
                        runs[method].append(run_method(method, directory, args.mesh, work / "out"))
                peaks = ("peak_above_start", "peak_thread_above_start")
                results = {method: _bench.median_run(rs, peaks) for method, rs in runs.items()}
                p, f = results.get("port"), results.get("floor")
                if isinstance(p, dict) and isinstance(f, dict):
                    # Same tensors either way: the safetensors files differ only in their headers.
                    notes.append(
                        f"{size} {dtype}: port wrote {', '.join(p['files'])}: "
                        f"{p['bytes_written'] - f['bytes_written']:+,} safetensors bytes vs the floor's "
                        f"file ({total:,} bytes of tensors)"
                    )
                rows.append(row(size, dtype, results, largest))
                print(rows[-1], flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    for note in notes:
        print(note)
    if args.out:
        text = [
            "# port export benchmark",
            "",
            f"Machine: {_bench.machine()}; 8 simulated CPU devices, mesh {args.mesh}; "
            f"Python {platform.python_version()}.",
            "",
            "Command: `python bench/export.py " + " ".join(sys.argv[1:]) + "`",
            "",
            f"Median of {args.repeats} runs, each in a fresh process (peak memory: the largest).",
            "",
            HEAD,
            "|" + "---|" * (HEAD.count(" | ") + 1),
            *rows,
            "",
            *notes,
            "",
        ]
        args.out.write_text("\n".join(text))


if __name__ == "__main__":
    main()
