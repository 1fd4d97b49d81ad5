"""Benchmark: one Llama checkpoint loaded into port's Equinox Llama and into the Flax NNX example (issue 34).

    python bench/targets.py [--size 400mb] [--mesh 4x2] [--repeats 5] [--workdir DIR] [--out FILE]

One Llama-shaped checkpoint of random bfloat16 weights (written once; its config.json
as bench/quantized.py writes a Llama's) is loaded onto `--mesh` (8 simulated CPU
devices) four ways, in alternating rounds, each run in a fresh process after the page
cache was warmed (bench/bench.py's way, with bench/_measure.py's helpers), and the
median is reported:

  equinox     `port.convert(dir, mesh=...)`: port's own `port.models.llama.Llama`, the
              shipped mapping, its layers stacked on a leading axis, weights (out, in)
  nnx         `port.convert(dir, mapping="examples/nnx_llama/llama.toml", mesh=...)`: the
              Flax NNX Llama of examples/nnx_llama (layers in an `nnx.List`, one leaf per
              layer and weight, `nnx.Linear` kernels (in, out): the mapping transposes),
              built by the mapping's factory `llama:build` under `nnx.eval_shape`, its
              leaves sharded by the module's own annotations
  dict-nnx    the NNX module's leaves as a plain dict of `ShapeDtypeStruct`s given as the
              skeleton (made by the driver), the same mapping with the module's sharding
              names written out: the nnx row without the NNX module
  dict-torch  the same dict with the kernels (out, in), as the checkpoint stores them, and
              no transposes: the dict-nnx row without the transposes

So equinox -> dict-torch is the cost of one leaf per layer, less that of building port's
skeleton (the placing column shows the first alone), dict-torch -> dict-nnx that of the
transposes, dict-nnx -> nnx that of the NNX module (building its skeleton, the merge). Flax, the example module and port's model families are imported before the
clock starts (start-up, not the load); building the skeleton (for the equinox and nnx
rows), planning, reading and placing are timed.

Columns: seconds (the median run; the range of all runs beside it); of which placing
(the report's `place_seconds`: reading the blocks into the device buffers; the rest is
opening the checkpoint, the mapping, the skeleton, the plan and the fill); peak anonymous
memory (`RssAnon`, sampled every 2 ms) above its value when the load started, and that
peak minus the arrays the load produced (on CPU the arrays live in host memory: what is
left is the load's own working memory); bytes read and the plan's bytes to read; the
bytes the most loaded device holds; the leaves filled. Under the table: the NNX load's
time and memory above the arrays against the Equinox load's, and each step between them.

Sizes: "400mb" (hidden 1024, SwiGLU 2816, 16 / 4 heads, 12 layers, vocab 32000: 201M
parameters, 402 MB), "tiny" (the smoke test's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# bench/bench.py's median and cache warming, bench/quantized.py's Llama config and tensor shapes
import quantized

import bench

import _measure

EXAMPLE = HERE.parent / "examples" / "nnx_llama"
MAPPING = EXAMPLE / "llama.toml"
TARGETS = {
    "equinox": "port.models.llama (Equinox, layers stacked)",
    "nnx": "examples/nnx_llama (Flax NNX, layers in an nnx.List)",
    "dict-nnx": "dict of the NNX leaves, kernels (in, out)",
    "dict-torch": "dict of the NNX leaves, kernels (out, in)",
}
# The Llama, by --size, in bench/quantized.py's terms (LLAMA).
SIZES = {
    "400mb": dict(hidden_size=1024, intermediate_size=2816, heads=16, kv_heads=4, vocab_size=32000, layers=12),
    "tiny": quantized.LLAMA["tiny"],
}


# ---------------------------------------------------------------- the checkpoint


def write_llama(directory: Path, size: str) -> None:
    """A Llama of `SIZES[size]` with random bfloat16 weights (norms ones) at `directory`, one file."""
    import torch
    from safetensors.torch import save_file

    config = quantized.llama_config(SIZES[size])
    generator = torch.Generator().manual_seed(0)
    tensors = {
        key: torch.ones(shape, dtype=torch.bfloat16)
        if len(shape) == 1
        else (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for key, shape in quantized.llama_shapes(config).items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def model_words(size: str) -> str:
    c = SIZES[size]
    return (
        f"Llama, hidden {c['hidden_size']}, SwiGLU {c['intermediate_size']}, {c['heads']} / {c['kv_heads']} heads, "
        f"{c['layers']} layers, vocab {c['vocab_size']}, bfloat16"
    )


# ---------------------------------------------------------------- measured process


def dict_layout(config: dict, layout: str) -> dict:
    """The NNX example's variables as a dict target, in JSON: each leaf's shape and dtype by its
    state path (so the example's mapping names it), and each mapping entry's axes (the module's
    sharding names, written out) and whether it drops its transform. `layout` "nnx" keeps the
    kernels (in, out), as nnx.Linear does (the mapping's transposes); "torch" keeps them (out, in),
    as the checkpoint does: no transpose, the axes reversed.

    Made in the driver, not in the measured process: building the NNX skeleton there would warm
    JAX's tracing before the clock, which the equinox and nnx rows pay for within it.
    """
    sys.path.insert(0, str(EXAMPLE))
    import port
    from port._targets import target_of

    mapping = port.load_mapping(MAPPING)
    module = port.skeleton(mapping, config)
    shapes, axes = target_of(module).leaves(module), target_of(module).axes(module)
    leaves, entries = {}, []
    for param in mapping.params:
        paths = [path for path in shapes if mapping.entry(path) is param]
        flipped = layout == "torch" and bool(param.transforms)  # every transform here is a 2-D transpose
        for path in paths:
            shape = list(shapes[path].shape)
            leaves[path] = [shape[::-1] if flipped else shape, str(shapes[path].dtype)]
        names = list(axes[paths[0]][::-1] if flipped else axes[paths[0]]) if paths else None
        entries.append({"axes": names, "flipped": flipped})  # None: an optional entry the module lacks
    return {"leaves": leaves, "entries": entries}


def dict_target(layout: dict) -> tuple[dict, Any]:
    """The skeleton (a flat dict of `ShapeDtypeStruct`s) and the mapping `dict_layout` describes."""
    import dataclasses

    import jax

    import port

    mapping = port.load_mapping(MAPPING)
    skeleton = {path: jax.ShapeDtypeStruct(tuple(shape), dtype) for path, (shape, dtype) in layout["leaves"].items()}
    params = tuple(
        param
        if entry["axes"] is None
        else dataclasses.replace(
            param, axes=tuple(entry["axes"]), transforms=() if entry["flipped"] else param.transforms
        )
        for param, entry in zip(mapping.params, layout["entries"])
    )
    return skeleton, dataclasses.replace(mapping, params=params)


def measure(spec: dict) -> dict:
    """Load `spec["dir"]` into `spec["target"]` once (`port.convert`) in this fresh process: its figures."""
    mesh = _measure.started(spec["mesh"])
    import port

    skeleton, mapping = None, None
    if spec["target"] != "equinox":
        sys.path.insert(0, str(EXAMPLE))
        # The example and Flax NNX imported before the clock: start-up, as port's own models are.
        import llama  # noqa: F401  # pyright: ignore[reportMissingImports]
        from flax import nnx  # noqa: F401

        mapping = str(MAPPING)
    if spec["target"].startswith("dict-"):
        skeleton, mapping = dict_target(spec["layout"])
    _measure.back_memory(2 * sum(path.stat().st_size for path in quantized.files_of(Path(spec["dir"]))))
    os.sync()
    stop = _measure.peak_memory(0.002)
    start = time.perf_counter()
    run = port.convert(spec["dir"], skeleton, mapping, mesh)  # returns once its arrays are ready
    seconds = time.perf_counter() - start
    peak = stop()
    return {
        "seconds": seconds,
        "place_seconds": run.report.place_seconds,
        "peak_above_start": peak,
        "bytes_read": run.report.bytes_read,
        "plan_read_bytes": run.plan.read_bytes,
        "device_bytes": max(run.report.device_bytes.values()),
        "total_device_bytes": sum(run.report.device_bytes.values()),
        "leaves": len(run.plan.leaves),
    }


# ---------------------------------------------------------------- driver


def _mb(n: float) -> str:
    return _measure.mb(n)


def _more(n: float) -> str:
    """A difference in MB, signed: `+67 MB`, `-2 MB`, `0 MB`."""
    return f"{round(n / 1e6):+,d} MB" if round(n / 1e6) else "0 MB"


def table(size: str, results: dict, spread: dict, checkpoint: int, largest: int, mesh: str) -> str:
    """The Markdown section: a row per target, then the NNX load against the Equinox load."""
    header = [
        "target",
        "seconds (range)",
        "of which placing",
        "peak anon memory above start",
        "memory above the arrays",
        "bytes read",
        "plan: bytes to read",
        "bytes per device",
        "leaves",
    ]
    rows = []
    for name, r in results.items():
        if not isinstance(r, dict):
            rows.append([TARGETS[name], f"failed: {r}"])
            continue
        low, high = spread[name]
        rows.append(
            [
                TARGETS[name],
                f"{r['seconds']:.3f} ({low:.3f}-{high:.3f})",
                f"{r['place_seconds']:.3f}",
                _mb(r["peak_above_start"]),
                _mb(r["peak_above_start"] - r["total_device_bytes"]),
                _mb(r["bytes_read"]),
                _mb(r["plan_read_bytes"]),
                _mb(r["device_bytes"]),
                str(r["leaves"]),
            ]
        )
    title = f"### {model_words(size)}, {_mb(checkpoint)} in one file, mesh {mesh}"
    lines = [title, "", _measure.markdown(header, rows)]
    eqx_run, nnx_run = results["equinox"], results["nnx"]
    if isinstance(eqx_run, dict) and isinstance(nnx_run, dict):
        above = {name: r["peak_above_start"] - r["total_device_bytes"] for name, r in results.items()}
        same_reads = nnx_run["bytes_read"] == eqx_run["bytes_read"] == eqx_run["plan_read_bytes"]
        same_arrays = all(nnx_run[k] == eqx_run[k] for k in ("total_device_bytes", "device_bytes"))
        lines += [
            "",
            f"nnx: {nnx_run['seconds'] / eqx_run['seconds']:.2f} x the Equinox load's time "
            f"({nnx_run['seconds'] - eqx_run['seconds']:+.3f} s); memory above the arrays "
            f"{_mb(above['nnx'])} against {_mb(above['equinox'])} ({_more(above['nnx'] - above['equinox'])}; "
            f"the largest tensor {_mb(largest)}); bytes read {'the same, the plan' if same_reads else 'DIFFERENT'}"
            f"'s; bytes on the devices (in all, on the most loaded) {'the same' if same_arrays else 'DIFFERENT'}.",
        ]
    steps = [
        ("one leaf per layer, no skeleton to build", "equinox", "dict-torch"),
        ("the transposes", "dict-torch", "dict-nnx"),
        ("the NNX module: its skeleton built, the merge", "dict-nnx", "nnx"),
    ]
    for what, before, after in steps:
        if isinstance(results.get(before), dict) and isinstance(results.get(after), dict):
            a, b = results[before], results[after]
            memory = (b["peak_above_start"] - b["total_device_bytes"]) - (
                a["peak_above_start"] - a["total_device_bytes"]
            )
            lines += [
                "",
                f"{what} ({before} -> {after}): {b['seconds'] - a['seconds']:+.3f} s "
                f"(placing {b['place_seconds'] - a['place_seconds']:+.3f} s), {_more(memory)} above the arrays.",
            ]
    return "\n".join(lines)


def measured(size: str, mesh: str, repeats: int, work: Path) -> str:
    """The checkpoint (written once under `work`) loaded `repeats` times into each target: its section."""
    directory = work / f"llama-{size}"
    if not quantized.files_of(directory):
        clock = time.perf_counter()
        write_llama(directory, size)
        print(f"wrote {directory} in {time.perf_counter() - clock:.1f} s", file=sys.stderr, flush=True)
    bench.warm(*quantized.files_of(directory))
    config = json.loads((directory / "config.json").read_text())
    specs = {name: {"dir": str(directory), "mesh": mesh, "target": name} for name in TARGETS}
    for name in ("dict-nnx", "dict-torch"):
        specs[name]["layout"] = dict_layout(config, name.removeprefix("dict-"))
    runs: dict[str, list] = {name: [] for name in TARGETS}
    before = os.getloadavg()[0]
    for _ in range(repeats):
        for name in TARGETS:
            r = _measure.isolated(__file__, specs[name], timeout=900)
            runs[name].append(r)
            shown = r if isinstance(r, str) else f"{r['seconds']:.3f} s, {_mb(r['peak_above_start'])} above start"
            print(f"  {name}: {shown}", file=sys.stderr, flush=True)
    results = {name: bench.median_run(rs, ("peak_above_start",)) for name, rs in runs.items()}
    spread = {}
    for name, rs in runs.items():
        seconds = [r["seconds"] for r in rs if isinstance(r, dict)] or [0.0]
        spread[name] = (min(seconds), max(seconds))
    checkpoint = sum(path.stat().st_size for path in quantized.files_of(directory))
    load = f"Load average (1 minute) before the runs {before:.2f}, after {os.getloadavg()[0]:.2f}."
    return table(size, results, spread, checkpoint, quantized.largest_tensor(directory), mesh) + "\n\n" + load


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="400mb", choices=tuple(SIZES))
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, help="where to write the checkpoint, kept (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="also write the table as Markdown here")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one run, in a fresh process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure))))
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="port-bench-targets-"))
    try:
        section = measured(args.size, args.mesh, args.repeats, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(section + "\n", flush=True)
    if args.out:
        notes = [
            "Each figure is the median of the repeats (peak memory: the largest), each run a fresh process "
            "after the page cache was warmed, the rows in alternating rounds; seconds cover "
            "`port.convert` alone (not JAX start-up, nor importing Flax, the example or port's models)."
        ]
        _measure.write(args.out, "Loading into an Equinox and a Flax NNX target", "targets.py", [section], notes)


if __name__ == "__main__":
    main()
