"""Remote reads against the wire: `port.load` from a URL served by nginx, beside `curl` of the same bytes.

    python bench/remote.py [--sizes medium] [--mesh 4x2] [--repeats 3] [--processes 2] [--s3] [--workdir DIR] [--out FILE]

The benchmark writes GPT-2 checkpoints (`bench/make_gpt2.py`), starts nginx (from the
distribution's packages: `apt-get install nginx-light`) on 127.0.0.1 over them with
sendfile on and logging off, warms the page cache and the server, and measures, each
in a fresh process, best of `--repeats`:

- `curl`: `curl -s -o /dev/null` of every safetensors file of the checkpoint, in turn;
- `port.load` of the local file, the same way, for what is not the wire's;
- `port.load`: `port.load(URL, mesh=...)` onto the mesh (8 simulated CPU devices for
  4x2), port and JAX imported before the clock, the arrays ready when it stops; with
  its peak anonymous memory above the start (`RssAnon`, sampled; the arrays are in it,
  since CPU devices hold them in host memory) and the bytes it read (`bytes_read`).

With `--s3`, the same checkpoints are also put in a moto S3 server on 127.0.0.1 and
`port.load("s3://...")` is measured beside s3fs's download of the files (`cat_file`),
each in a fresh process: the same server either way (moto's own speed bounds both).

With `--processes 2`, also two processes joined by `port.initialize` on 127.0.0.1 (4 simulated
devices each, the same mesh) load the URL, each its own share, their clocks started together
after joining: the slower one's seconds, and the bytes each read.

Without nginx the benchmark says so and exits 2: Python's `http.server` is no
stand-in for a production server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _measure

HERE = Path(__file__).resolve().parent

NGINX = """
daemon off;
worker_processes 2;
user root;
pid {work}/nginx.pid;
error_log {work}/error.log;
events {{ worker_connections 256; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nginx(root: Path, work: Path) -> tuple[subprocess.Popen, str]:
    """nginx over `root` on a free loopback port: (process, base URL)."""
    port = free_port()
    conf = work / "nginx.conf"
    conf.write_text(NGINX.format(work=work, port=port, root=root))
    server = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(work)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise SystemExit(f"nginx did not start: {server.stderr.read().decode()[-500:]}")


def measure(spec: dict) -> dict:
    """One `port.load` from the URL, in this fresh process."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import port

    mesh = port.make_mesh(spec["mesh"])
    stop = _measure.peak_memory()
    began = time.perf_counter()
    with port.open_checkpoint(spec["url"]) as ckpt:
        model = port.load(ckpt, mesh=mesh)
        jax.block_until_ready(jax.tree.leaves(model))
        read = ckpt.bytes_read
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "peak": stop(), "bytes_read": read}


def measure_process(spec: dict) -> dict:
    """One process of a two-process `port.load` of the URL: joined first, then timed."""
    import jax

    import port

    port.initialize(spec["coordinator"], 2, spec["process"], local_devices=4)
    mesh = port.make_mesh(spec["mesh"])
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("start")  # both processes start the clock together
    began = time.perf_counter()
    with port.open_checkpoint(spec["url"]) as ckpt:
        model = port.load(ckpt, mesh=mesh)
        jax.block_until_ready(jax.tree.leaves(model))
        read = ckpt.bytes_read
    return {"seconds": time.perf_counter() - began, "bytes_read": read}


def two_processes(url: str, mesh: str) -> dict | str:
    """`port.load(url)` in two processes (4 simulated devices each): the slower one's seconds, bytes each read."""
    coordinator = f"127.0.0.1:{free_port()}"
    runs = [subprocess.Popen([sys.executable, __file__, "--measure-process",
                              json.dumps({"url": url, "mesh": mesh, "coordinator": coordinator, "process": i})],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [r.communicate(timeout=1800) for r in runs]
    if any(r.returncode for r in runs):
        return next(err.strip().splitlines()[-1] for (_, err), r in zip(outs, runs) if r.returncode)[:160]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    return {"seconds": max(r["seconds"] for r in results), "bytes_read": [r["bytes_read"] for r in results]}


def fetch_s3(spec: dict) -> dict:
    """s3fs's download of every safetensors file of the checkpoint (`cat_file`), in this fresh process."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    began = time.perf_counter()
    total = sum(len(fs.cat_file(path)) for path in spec["s3"])
    return {"seconds": time.perf_counter() - began, "bytes": total}


def s3_rows(sizes: list[str], www: Path, mesh: str, repeats: int) -> list[list[str]]:
    """The same checkpoints in a moto S3 server on 127.0.0.1: port.load of s3://... beside s3fs's download."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"})
    rows = []
    try:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir("models")
        for size in sizes:
            directory = www / f"gpt2-{size}"
            fs.put(f"{directory}/", f"models/gpt2-{size}/", recursive=True)
            paths = [f"models/gpt2-{size}/{p.name}" for p in sorted(directory.glob("*.safetensors"))]
            total = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
            fetches = [_measure.isolated(__file__, {"s3": paths}) for _ in range(repeats)]
            loads = [_measure.isolated(__file__, {"url": f"s3://models/gpt2-{size}", "mesh": mesh})
                     for _ in range(repeats)]
            got = [r["seconds"] for r in fetches if isinstance(r, dict)]
            done = [r for r in loads if isinstance(r, dict)]
            if not got or not done:
                rows.append([f"GPT-2 {size}, S3 (moto)", _measure.mb(total), f"failed: {(fetches + loads)[0]}"])
                continue
            best = min(done, key=lambda r: r["seconds"])
            rows.append([f"GPT-2 {size}, S3 (moto)", _measure.mb(total), f"{min(got):.3f} (s3fs)",
                         f"{best['seconds']:.3f}", f"{best['seconds'] / min(got):.2f}", "", _measure.mb(best["peak"]),
                         _measure.mb(best["bytes_read"])])
    finally:
        server.stop()
    return rows


def curl(urls: list[str]) -> float:
    began = time.perf_counter()
    for url in urls:
        subprocess.run(["curl", "-s", "-f", "-o", "/dev/null", url], check=True)
    return time.perf_counter() - began


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        spec = json.loads(sys.argv[2])
        print(json.dumps(fetch_s3(spec) if "s3" in spec else measure(spec)))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--measure-process":
        print(json.dumps(measure_process(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="medium", help="GPT-2 sizes, from small, medium, large")
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    parser.add_argument("--s3", action="store_true",
                        help="also through a moto S3 server on 127.0.0.1, beside s3fs's download of the file")
    parser.add_argument("--processes", type=int, default=1, choices=(1, 2),
                        help="2: also load the URL in two processes (4 devices each), each its share")
    args = parser.parse_args()
    if shutil.which("nginx") is None or shutil.which("curl") is None:
        print("bench/remote.py needs nginx and curl (apt-get install nginx-light curl)", file=sys.stderr)
        raise SystemExit(2)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="port-remote-"))
    www = work / "www"
    www.mkdir(parents=True, exist_ok=True)
    rows = []
    server, base = start_nginx(www, work)
    try:
        for size in args.sizes.split(","):
            directory = www / f"gpt2-{size}"
            if not directory.exists():
                subprocess.run([sys.executable, HERE / "make_gpt2.py", size, directory], check=True)
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            total = sum((directory / f).stat().st_size for f in files)
            urls = [f"{base}/gpt2-{size}/{f}" for f in files]
            curl(urls)  # the page cache and the server warm
            curls = [curl(urls) for _ in range(args.repeats)]
            loads = [_measure.isolated(__file__, {"url": f"{base}/gpt2-{size}", "mesh": args.mesh})
                     for _ in range(args.repeats)]
            local = [_measure.isolated(__file__, {"url": str(directory), "mesh": args.mesh}) for _ in range(args.repeats)]
            local_best = min((r["seconds"] for r in local if isinstance(r, dict)), default=float("nan"))
            done = [r for r in loads if isinstance(r, dict)]
            best_curl = min(curls)
            if not done:
                rows.append([f"GPT-2 {size}", _measure.mb(total), f"{best_curl:.3f}", f"failed: {loads[0]}"])
                continue
            best = min(done, key=lambda r: r["seconds"])
            rows.append([f"GPT-2 {size}", _measure.mb(total), f"{best_curl:.3f}", f"{best['seconds']:.3f}",
                         f"{best['seconds'] / best_curl:.2f}", f"{local_best:.3f}", _measure.mb(best["peak"]),
                         _measure.mb(best["bytes_read"])])
            print(f"gpt2-{size}: curl {best_curl:.3f} s, port.load {best['seconds']:.3f} s", file=sys.stderr, flush=True)
            if args.processes == 2:
                pairs = [two_processes(f"{base}/gpt2-{size}", args.mesh) for _ in range(args.repeats)]
                done = [r for r in pairs if isinstance(r, dict)]
                if not done:
                    rows.append([f"GPT-2 {size}, 2 processes", _measure.mb(total), f"{best_curl:.3f}",
                                 f"failed: {pairs[0]}"])
                    continue
                pair = min(done, key=lambda r: r["seconds"])
                rows.append([f"GPT-2 {size}, 2 processes", _measure.mb(total), f"{best_curl:.3f}",
                             f"{pair['seconds']:.3f}", f"{pair['seconds'] / best_curl:.2f}", "", "",
                             " + ".join(_measure.mb(b) for b in pair["bytes_read"])])
    finally:
        server.terminate()
        server.wait()
    if args.s3:
        rows += s3_rows(args.sizes.split(","), www, args.mesh, args.repeats)
    header = ["checkpoint", "file bytes", "curl s", f"port.load s (mesh {args.mesh})", "x curl",
              "port.load of the local file s", "port peak anon memory above start", "port bytes read"]
    title = f"### HTTP from nginx on 127.0.0.1, best of {args.repeats}\n\n"
    text = title + _measure.markdown(header, rows) + f"\n{_measure.machine()}\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
