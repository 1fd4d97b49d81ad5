"""Cold local reads: `port.load` of a checkpoint not in the page cache, beside `dd` reading the file.

    python bench/cold.py [--sizes medium] [--mesh 4x2] [--repeats 3] [--workdir DIR] [--out FILE] [--warm]

Before each measured run the checkpoint's files are evicted from the page cache
(`posix_fadvise(POSIX_FADV_DONTNEED)` on each, after `fsync`; no root needed, and the Python
and JAX libraries stay cached, so a run pays for the checkpoint's bytes only), and `mincore`
confirms that under 1% of them is left; where it is not, the benchmark says so and labels the
table warm. Each run is a fresh process: `dd if=FILE of=/dev/null bs=16M` (sequential, one
reader), and `port.load(DIR, mesh=...)` with port and JAX imported before the clock (the arrays
ready when it stops; `_measure.started`), then the same load again with the file now cached:
the difference is the time the cold read adds, compared with dd's; best of `--repeats`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _measure

HERE = Path(__file__).resolve().parent


def evict(files: list[Path]) -> bool:
    """Evict `files` from the page cache; whether under 1% of their pages is still cached."""
    cached = total = 0
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            pages, resident = _resident(fd)
        finally:
            os.close(fd)
        cached, total = cached + resident, total + pages
    return cached <= total // 100


def _resident(fd: int) -> tuple[int, int]:
    """(pages, pages in the page cache) of the open file `fd`, by `mincore` over a read-only map."""
    import numpy as np

    size = os.fstat(fd).st_size
    if not size:
        return 0, 0
    pages = -(-size // mmap.PAGESIZE)
    vector = np.zeros(pages, np.uint8)
    view = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    try:
        mapped = np.frombuffer(view, np.uint8)
        done = _MINCORE(mapped.ctypes.data, size, vector.ctypes.data)
        del mapped
    finally:
        view.close()
    return pages, pages if done != 0 else int((vector & 1).sum())


_MINCORE = ctypes.CDLL(None, use_errno=True).mincore
_MINCORE.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def measure(spec: dict) -> dict:
    """One `port.load` of the directory, in this fresh process."""
    import jax

    import port

    mesh = _measure.started(spec["mesh"])
    _measure.back_memory(2 * spec["bytes"])
    began = time.perf_counter()
    model = port.load(spec["directory"], mesh=mesh)
    jax.block_until_ready(jax.tree.leaves(model))
    return {"seconds": time.perf_counter() - began}


def dd(files: list[Path]) -> float:
    began = time.perf_counter()
    for file in files:
        subprocess.run(["dd", f"if={file}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    return time.perf_counter() - began


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="medium", help="GPT-2 sizes, from tiny, small, medium, large")
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    parser.add_argument("--warm", action="store_true", help="never drop the page cache (a smoke run)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="port-cold-"))
    work.mkdir(parents=True, exist_ok=True)
    cold = not args.warm
    rows = []
    for size in args.sizes.split(","):
        directory = work / f"gpt2-{size}"
        if not directory.exists():
            subprocess.run([sys.executable, HERE / "make_gpt2.py", size, directory], check=True)
        files = sorted(directory.glob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)
        dds, loads, warms = [], [], []
        spec = {"directory": str(directory), "mesh": args.mesh, "bytes": total}
        for _ in range(args.repeats):
            cold = cold and evict(files)
            dds.append(dd(files))
            cold = cold and evict(files)
            loads.append(_measure.isolated(__file__, spec))
            warms.append(_measure.isolated(__file__, spec))  # the same load with the file now cached
        done = [r["seconds"] for r in loads if isinstance(r, dict)]
        warm = [r["seconds"] for r in warms if isinstance(r, dict)]
        if not done or not warm:
            rows.append([f"GPT-2 {size}", _measure.mb(total), f"{min(dds):.3f}", f"failed: {(loads + warms)[0]}"])
            continue
        best_dd, best, best_warm = min(dds), min(done), min(warm)
        rows.append(
            [
                f"GPT-2 {size}",
                _measure.mb(total),
                f"{best_dd:.3f}",
                f"{total / best_dd / 1e9:.2f}",
                f"{best:.3f}",
                f"{best_warm:.3f}",
                f"{best - best_warm:.3f}",
                f"{best / best_dd:.2f}",
                f"{(best - best_warm) / best_dd:.2f}",
            ]
        )
        print(f"gpt2-{size}: dd {best_dd:.3f} s, port.load {best:.3f} s", file=sys.stderr, flush=True)
    if not cold and not args.warm:
        print("the page cache kept the checkpoint's pages: the table is of warm reads", file=sys.stderr)
    state = "the checkpoint evicted from the page cache before each run" if cold else "page cache WARM"
    header = [
        "checkpoint",
        "file bytes",
        "dd s",
        "dd GB/s",
        f"port.load s (mesh {args.mesh})",
        "port.load, cache warm s",
        "the difference: reading s",
        "x dd",
        "reading x dd",
    ]
    text = f"### Local reads, {state}, best of {args.repeats}\n\n" + _measure.markdown(header, rows)
    text += f"\n{_measure.machine()}\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
