"""Benchmark: `port.load` against the host floor, Orbax v1 and the recipe (issue 40).

    python bench/host.py [--checkpoints gpt2-medium,llama-2b] [--rounds 7] [--mesh 4x2]
                         [--device cpu|gpu] [--methods port,orbax,recipe,floor,floor-threads]
                         [--workdir DIR] [--out FILE]

Each contender runs once per round in a fresh process, the rounds alternating (round 1: port,
orbax, recipe, floor, ...; round 2: the same again), and the table gives the medians. Before
every clock: the page cache warm (each file read once by the driver), the process started
(JAX, port's modules imported, the mesh made), twice the checkpoint's bytes of memory touched
and freed (the VM's first touch of guest memory paid by every contender alike), `os.sync()`.

  port           `port.convert(dir, mesh=...)`: what `port.load` returns, arrays ready
  orbax          Orbax v1 `ocp.load(dir, abstract_state=...)` in a context whose
                 `checkpoint_layout` is SAFETENSORS; the abstract tree (made before the clock)
                 names the source tensors, each with a `NamedSharding` that gives it the bytes
                 per device port's plan gives the leaves it feeds (the leaf's `PartitionSpec`
                 carried back through the transform chain; a stacked leaf's split without its
                 layer axis)
  recipe         `safetensors.numpy.load_file` of every file, each leaf built in NumPy from
                 port's plan (slice, reshape, transpose, stack), `jax.device_put` with the leaf's
                 `NamedSharding`, `port.fill`
  read+put       each tensor read (`readinto`, a fresh buffer) and `jax.device_put` on the
                 first device of the mesh in turn: the plain load onto an accelerator
  floor          every byte of the files once, with `readinto`, into fresh `np.empty`
                 buffers (one per tensor), kept until the clock stops: the memcpy floor
  floor-threads  the same bytes into the same buffers, the files' bytes split evenly over
                 `os.cpu_count()` threads (`os.preadv`)
  h2d            the host-to-device copy rate: the checkpoint's bytes as one array in pinned
                 host memory (`memory_kind="pinned_host"`, made and copied once before the
                 clock), `jax.device_put` to the device's memory: the link's floor on a GPU

Peak memory is `RssAnon` sampled every 2 ms above its value at the start; "above the arrays"
subtracts the bytes of what the method produced when that lives in host memory (the arrays on
the CPU backend; the floors' buffers on any).
Bytes read is `rchar` of /proc/self/io over the clock (every `read`/`pread` of the process).
Checkpoints: gpt2-tiny, gpt2-medium (float32, one file, bench/make_gpt2.py), llama-tiny,
llama-2b, llama-4b (bfloat16, four files, bench/make_llama.py); written once into --workdir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import _measure  # bench/ is the script's directory, first on sys.path

HERE = Path(__file__).resolve().parent
METHODS = ("port", "orbax", "recipe", "read+put", "floor", "floor-threads", "h2d")
DEFAULTS = {"cpu": "port,orbax,recipe,floor,floor-threads", "gpu": "port,read+put,orbax,recipe,h2d,floor"}
CHECKPOINTS = {  # name -> (maker, size, files)
    "gpt2-tiny": ("gpt2", "tiny", 1),
    "gpt2-medium": ("gpt2", "medium", 1),
    "llama-tiny": ("llama", "tiny", 4),
    "llama-2b": ("llama", "2b", 4),
    "llama-4b": ("llama", "4b", 4),
}
TITLES = {
    "gpt2-tiny": "GPT-2 tiny, float32, 1 file",
    "gpt2-medium": "GPT-2 medium (355M), float32, 1 file",
    "llama-tiny": "Llama-shaped tiny, bfloat16, 4 files",
    "llama-2b": "Llama-shaped 2B (hidden 2048, 42 layers), bfloat16, 4 files",
    "llama-4b": "Llama-shaped 4B (hidden 4096, 21 layers), bfloat16, 4 files",
}


# ---------------------------------------------------------------- the checkpoint's files


def files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files, in order."""
    return sorted(directory.glob("*.safetensors"))


def header(path: Path) -> tuple[int, dict]:
    """(where the data section starts, the header's tensors) of one safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entries = json.loads(f.read(n))
    entries.pop("__metadata__", None)
    return 8 + n, entries


def make(name: str, work: Path) -> Path:
    """The checkpoint `name` in `work` (written once)."""
    maker, size, shards = CHECKPOINTS[name]
    directory = work / name
    if not (directory / "config.json").exists():
        sys.path.insert(0, str(HERE))
        if maker == "gpt2":
            import make_gpt2

            make_gpt2.write(size, directory, "float32", shards)
        else:
            import make_llama

            make_llama.write(size, directory, shards)
    return directory


def warm(directory: Path) -> None:
    """Read every file once, so that every contender finds it in the page cache."""
    for path in files(directory):
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass


# ---------------------------------------------------------------- measured process


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _plan(directory: Path, mesh):
    import port

    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config)
        skeleton = port.skeleton(mapping, ckpt.config)
        return port.plan(skeleton, mapping, ckpt.tensors, ckpt.config, mesh.shape), skeleton, dict(ckpt.tensors)


def source_specs(recipe, mesh_shape: dict[str, int]) -> dict[str, tuple]:
    """Each source tensor's `PartitionSpec` entries: every sharded dimension of a leaf carried back
    through its chain onto the source axis its first shard narrows (a stacked leaf's stack axes left
    out), kept where that mesh split divides the source axis; the first leaf that names a key decides."""
    specs: dict[str, tuple] = {}
    for leaf in recipe.leaves:
        k = len(leaf.stack)
        shape = leaf.chain.shape
        inner = (tuple(leaf.spec) + (None,) * len(leaf.shape))[k : len(leaf.shape)]
        full = tuple((0, n) for n in shape)
        whole = leaf.chain.regions(full)[0]
        source = leaf.chain.shapes[0]
        entries: list = [None] * len(source)
        for d, entry in enumerate(inner):
            if entry is None:
                continue
            names = (entry,) if isinstance(entry, str) else tuple(entry)
            count = math.prod(mesh_shape[n] for n in names)
            box = tuple((0, n // count) if i == d else (0, n) for i, n in enumerate(shape))
            narrowed = [
                a for a, (r, w) in enumerate(zip(leaf.chain.regions(box)[0], whole)) if r[1] - r[0] < w[1] - w[0]
            ]
            if len(narrowed) == 1 and source[narrowed[0]] % count == 0 and entries[narrowed[0]] is None:
                entries[narrowed[0]] = entry
        for key in leaf.keys:
            specs.setdefault(key, tuple(entries))
    return specs


def _orbax_tree(directory: Path, mesh):
    """The abstract tree Orbax loads: every source tensor the plan reads, sharded as `source_specs` says."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    recipe, _, tensors = _plan(directory, mesh)
    specs = source_specs(recipe, dict(mesh.shape))
    return {
        key: jax.ShapeDtypeStruct(
            tensors[key].shape, tensors[key].dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec))
        )
        for key, spec in specs.items()
    }


def _port(directory: Path, mesh, _):
    import jax

    import port

    conversion = port.convert(str(directory), mesh=mesh)
    jax.block_until_ready(conversion.model)
    return conversion.model


def _orbax(directory: Path, mesh, tree):
    import jax
    from orbax.checkpoint import v1 as ocp

    context = ocp.Context()
    context.checkpoint_layout = ocp.options.CheckpointLayout.SAFETENSORS
    with context:
        loaded = ocp.load(directory, abstract_state=tree)
    jax.block_until_ready(loaded)
    return loaded


def _recipe(directory: Path, mesh, planned):
    """Whole files into NumPy, each leaf made from them by hand (port's plan says how), then sharded."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from safetensors.numpy import load_file

    import port

    recipe, skeleton = planned
    state: dict = {}
    for path in files(directory):
        state.update(load_file(path))
    arrays = {}
    for leaf in recipe.leaves:
        full = tuple((0, n) for n in leaf.chain.shape)
        regions = leaf.chain.regions(full)
        where = tuple(slice(a, b) for a, b in regions[0])
        parts = [leaf.chain.apply(state[key][where], regions).astype(leaf.dtype, copy=False) for key in leaf.keys]
        arrays[leaf.path] = np.stack(parts).reshape(leaf.shape) if leaf.stack else parts[0]
    state.clear()  # the whole state dict freed, as the recipe does
    placed = {}
    for leaf in recipe.leaves:
        placed[leaf.path] = jax.device_put(arrays.pop(leaf.path), NamedSharding(mesh, leaf.spec))
    model = port.fill(skeleton, placed)
    jax.block_until_ready(model)
    return model


def _buffers(directory: Path) -> list[tuple[Path, list[tuple[int, object, str, list]]]]:
    """For each file: (path, [(file offset, a fresh uint8 buffer, dtype, shape) per tensor, in file order])."""
    import numpy as np

    out = []
    for path in files(directory):
        start, entries = header(path)
        tensors = sorted(entries.values(), key=lambda e: e["data_offsets"][0])
        out.append(
            (
                path,
                [
                    (
                        start + e["data_offsets"][0],
                        np.empty(e["data_offsets"][1] - e["data_offsets"][0], np.uint8),
                        e["dtype"],
                        e["shape"],
                    )
                    for e in tensors
                ],
            )
        )
    return out


def _readinto(f, view: memoryview) -> None:
    while view:  # one read returns at most 2 GiB - 4 KiB on Linux
        n = f.readinto(view)
        if not n:
            raise EOFError(f"{f.name}: the file ends before its header's last tensor")
        view = view[n:]


def _floor(directory: Path, mesh, _):
    """Every byte of every file once, `readinto` fresh buffers (one per tensor), all kept."""
    import numpy as np

    kept = []
    for path in files(directory):
        with open(path, "rb", buffering=0) as f:
            (n,) = struct.unpack("<Q", f.read(8))
            entries = json.loads(f.read(n))
            entries.pop("__metadata__", None)
            for e in sorted(entries.values(), key=lambda e: e["data_offsets"][0]):
                a, b = e["data_offsets"]
                f.seek(8 + n + a)
                buffer = np.empty(b - a, np.uint8)
                _readinto(f, memoryview(buffer))
                kept.append(buffer)
    return kept


def _floor_threads(directory: Path, mesh, _):
    """The floor's reads, the files' bytes split evenly over `os.cpu_count()` threads (`os.preadv`)."""
    import numpy as np

    pieces = []  # (fd, offset, buffer view)
    kept = []
    fds = []
    try:
        for path in files(directory):
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            with open(fd, "rb", buffering=0, closefd=False) as f:
                (n,) = struct.unpack("<Q", f.read(8))
                entries = json.loads(f.read(n))
            entries.pop("__metadata__", None)
            for e in sorted(entries.values(), key=lambda e: e["data_offsets"][0]):
                a, b = e["data_offsets"]
                buffer = np.empty(b - a, np.uint8)
                kept.append(buffer)
                pieces.append((fd, 8 + n + a, memoryview(buffer)))
        workers = os.cpu_count() or 1
        total = sum(len(v) for _, _, v in pieces)
        shares: list[list] = [[] for _ in range(workers)]
        at = 0
        for fd, offset, view in pieces:  # cut the byte stream into `workers` equal stretches
            while view:
                w = min(at * workers // total, workers - 1)
                end = (w + 1) * total // workers
                take = min(len(view), max(end - at, 1))
                shares[w].append((fd, offset, view[:take]))
                offset, view, at = offset + take, view[take:], at + take

        def read(share):
            for fd, offset, view in share:
                while view:
                    n = os.preadv(fd, [view], offset)
                    if not n:
                        raise EOFError(f"fd {fd}: the file ends before its header's last tensor")
                    offset, view = offset + n, view[n:]

        threads = [threading.Thread(target=read, args=(s,)) for s in shares]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for fd in fds:
            os.close(fd)
    return kept


def _read_put(directory: Path, mesh, _):
    """Each tensor read into a fresh buffer and `jax.device_put` on the mesh's first device, in turn."""
    import jax
    import ml_dtypes
    import numpy as np

    names = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64}
    device, arrays = mesh.devices.flat[0], []
    for path, tensors in _buffers(directory):
        with open(path, "rb", buffering=0) as f:
            for offset, buffer, dtype, shape in tensors:
                f.seek(offset)
                _readinto(f, memoryview(buffer))
                arrays.append(jax.device_put(buffer.view(names[dtype]).reshape(shape), device))
    jax.block_until_ready(arrays)
    return arrays


def _staged(directory: Path, mesh):
    """The checkpoint's bytes as one array in the first device's pinned host memory (copied once to the
    device and dropped, so that the measured copy finds the transfer path set up)."""
    import jax
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    device = mesh.devices.flat[0]
    nbytes = sum(path.stat().st_size for path in files(directory))
    host = np.ones(nbytes, np.uint8)
    staged = jax.device_put(host, SingleDeviceSharding(device, memory_kind="pinned_host"))
    del host
    jax.block_until_ready(staged)
    jax.block_until_ready(jax.device_put(staged, SingleDeviceSharding(device, memory_kind="device"))).delete()
    return staged


def _h2d(directory: Path, mesh, staged):
    import jax
    from jax.sharding import SingleDeviceSharding

    return jax.block_until_ready(
        jax.device_put(staged, SingleDeviceSharding(mesh.devices.flat[0], memory_kind="device"))
    )


def measure(spec: dict) -> dict:
    """Run one contender once in this (fresh) process: its figures."""
    method, directory = spec["method"], Path(spec["dir"])
    mesh = _measure.started(
        spec["mesh"], None if spec["device"] == "gpu" else math.prod(map(int, spec["mesh"].split("x")))
    )
    import jax

    if spec["device"] == "gpu" and jax.default_backend() != "gpu":
        raise SystemExit(f"--device gpu: JAX's backend here is {jax.default_backend()}, not gpu")
    given = None
    if method == "orbax":
        from orbax.checkpoint import v1  # noqa: F401  (imported before the clock, as port is)

        given = _orbax_tree(directory, mesh)
    elif method == "recipe":
        import safetensors.numpy  # noqa: F401

        recipe, skeleton, _ = _plan(directory, mesh)
        given = (recipe, skeleton)
    elif method == "h2d":
        given = _staged(directory, mesh)
    fn = {
        "port": _port,
        "orbax": _orbax,
        "recipe": _recipe,
        "read+put": _read_put,
        "floor": _floor,
        "floor-threads": _floor_threads,
        "h2d": _h2d,
    }[method]
    nbytes = sum(path.stat().st_size for path in files(directory))
    _measure.back_memory(2 * nbytes)
    os.sync()
    stop = _measure.peak_memory(0.002)
    read_before = _rchar()
    start = time.perf_counter()
    result = fn(directory, mesh, given)
    seconds = time.perf_counter() - start
    read = _rchar() - read_before
    peak = stop()
    if method.startswith("floor"):  # its buffers are what it produces, in host memory on any backend
        per_device, total_device, on_host = 0, sum(buffer.nbytes for buffer in result), True
    else:
        per_device, total_device = _measure.device_bytes(result)
        on_host = jax.default_backend() == "cpu" and method != "h2d"
    return {
        "seconds": seconds,
        "peak": peak,
        "above_arrays": peak - (total_device if on_host else 0),
        "bytes_read": read,
        "per_device": per_device,
        "file_bytes": nbytes,
        "device": f"{jax.default_backend()}: {jax.devices()[0].device_kind}",
    }


# ---------------------------------------------------------------- driver


def summarize(runs: list) -> dict | str:
    """Medians of the rounds (peak memory: the largest); a failed contender's first message."""
    ok = [r for r in runs if isinstance(r, dict)]
    if not ok:
        return runs[0]
    out = dict(ok[0])
    out["seconds"] = statistics.median(r["seconds"] for r in ok)
    out["spread"] = (min(r["seconds"] for r in ok), max(r["seconds"] for r in ok))
    out["rounds"] = len(ok)
    for key in ("peak", "above_arrays", "bytes_read"):
        out[key] = max(r[key] for r in ok)
    return out


def table(name: str, results: dict, mesh: str) -> str:
    mb = _measure.mb
    floor, port = results.get("floor"), results.get("port")
    lines = [
        f"### {TITLES[name]}, mesh {mesh}",
        "",
        "| method | seconds (median) | min-max | x floor | x port | GB/s | peak anon memory above start "
        "| memory above the arrays | bytes read | bytes per device (max) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, r in results.items():
        if not isinstance(r, dict):
            lines.append(f"| {method} | failed: {r} | | | | | | | | |")
            continue
        x_floor = f"{r['seconds'] / floor['seconds']:.2f}" if isinstance(floor, dict) else ""
        x_port = f"{r['seconds'] / port['seconds']:.2f}" if isinstance(port, dict) else ""
        lines.append(
            f"| {method} | {r['seconds']:.3f} | {r['spread'][0]:.3f}-{r['spread'][1]:.3f} | {x_floor} | {x_port} | "
            f"{r['file_bytes'] / r['seconds'] / 1e9:.2f} | {mb(r['peak'])} | {mb(r['above_arrays'])} | "
            f"{mb(r['bytes_read'])} | {mb(r['per_device']) if r['per_device'] else '-'} |"
        )
    orbax = results.get("orbax")
    if isinstance(port, dict) and isinstance(orbax, dict):
        same = "equal" if port["per_device"] == orbax["per_device"] else "NOT EQUAL"
        lines += [
            "",
            f"bytes on the fullest device: port {port['per_device']:,}, orbax {orbax['per_device']:,} ({same}).",
        ]
    h2d = results.get("h2d")
    if isinstance(port, dict) and isinstance(h2d, dict):
        lines += [
            "",
            f"port: {port['file_bytes'] / port['seconds'] / 1e9:.2f} GB/s, {100 * h2d['seconds'] / port['seconds']:.0f}% "
            f"of the host-to-device rate from pinned memory ({h2d['file_bytes'] / h2d['seconds'] / 1e9:.2f} GB/s) "
            f"on {h2d['device']}.",
        ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--measure":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", default="gpt2-medium,llama-2b", help=f"from {', '.join(CHECKPOINTS)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--methods", help=f"from {', '.join(METHODS)} (default: {DEFAULTS})")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one contender may take")
    parser.add_argument("--workdir", type=Path, help="where the checkpoints are written (default: a temp dir)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--every-round", action="store_true", help="print the table so far after each round too")
    args = parser.parse_args()
    methods = (args.methods or DEFAULTS[args.device]).split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: {', '.join(unknown)} unknown (from {', '.join(METHODS)})")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="port-host-"))
    sections = []
    for name in args.checkpoints.split(","):
        if name not in CHECKPOINTS:
            parser.error(f"--checkpoints: {name} unknown (from {', '.join(CHECKPOINTS)})")
        directory = make(name, work)
        warm(directory)
        runs: dict = {m: [] for m in methods}
        for done in range(1, args.rounds + 1):
            for method in methods:
                spec = {"method": method, "dir": str(directory), "mesh": args.mesh, "device": args.device}
                runs[method].append(_measure.isolated(__file__, spec, timeout=args.timeout))
            if args.every_round and done < args.rounds:  # what a time-boxed run has so far
                print(f"after round {done}:\n" + table(name, {m: summarize(rs) for m, rs in runs.items()}, args.mesh))
        section = table(name, {m: summarize(rs) for m, rs in runs.items()}, args.mesh)
        print(section + "\n", flush=True)
        sections.append(section)
    if args.out:
        note = (
            f"Each contender ran in a fresh process, {args.rounds} rounds alternating, medians (peak memory: the "
            "largest); page cache warm; the VM's first touch of memory paid before every clock."
        )
        _measure.write(
            args.out, "port.load against the host floor, Orbax v1 and the recipe", "host.py", sections, [note]
        )


if __name__ == "__main__":
    main()
