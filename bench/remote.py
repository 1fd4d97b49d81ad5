"""Remote reads against the wire: `port.load` from a URL served by nginx, beside `curl` of the same bytes.

    python bench/remote.py [--checkpoints gpt2-medium] [--mesh 4x2] [--repeats 3] [--processes 2]
                           [--hub] [--s3] [--max-over-read R] [--workdir DIR] [--out FILE]

Checkpoints (written once into the work directory, random weights): `gpt2-small`,
`gpt2-medium`, `gpt2-large` (`bench/make_gpt2.py`, one file), `gpt2-medium-x4` (the same in 4
files with an index), `bert-base` (`bench/make_bert.py`: 199 tensors, many of them small),
and `gpt2-tiny`, `bert-tiny` for smoke runs. The benchmark starts nginx (from the
distribution's packages: `apt-get install nginx-light`) on 127.0.0.1 over them with
sendfile on and logging off, warms the page cache and the server, and measures, each in a
fresh process, best of `--repeats`:

- `curl`: `curl -s -o /dev/null` of every safetensors file of the checkpoint, in turn;
- `port.load` of the local file, the same way, for what is not the wire's;
- `port.load`: `port.load(URL, mesh=...)` onto the mesh (8 simulated CPU devices for
  4x2), port and JAX imported before the clock (`_measure.started`), the arrays ready when it stops; with
  its peak anonymous memory above the start (`RssAnon`, sampled; the arrays are in it,
  since CPU devices hold them in host memory), the bytes it read (`bytes_read`), the bytes it
  fetched over those (`bytes_over_read`, gaps between stretches it spanned, `--max-over-read`,
  default port's: 2) as "fetched / needed", and the CPU seconds it and the server (nginx's
  workers) spent: on this machine both share its cores.

With `--hub`, nginx also serves the checkpoints as the Hub does (`/bench/NAME/resolve/main/FILE`,
with `ETag` and `X-Repo-Commit`), and `port.load("hf://bench/NAME")` (`HF_ENDPOINT` set to it)
is measured beside `huggingface_hub.snapshot_download` of the same files into an empty cache.

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
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the revision the Hub layout answers with
MAKERS = {"gpt2": "make_gpt2.py", "bert": "make_bert.py"}
TITLES = {"gpt2": "GPT-2", "bert": "BERT"}

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
        location ~ ^/bench/([^/]+)/resolve/main/(.+)$ {{  # the Hub's resolve URLs, for hf://bench/NAME
            alias {root}/$1/$2;
            add_header X-Repo-Commit {commit};
        }}
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
    conf.write_text(NGINX.format(work=work, port=port, root=root, commit=COMMIT))
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

    import port

    mesh = _measure.started(spec["mesh"])
    _measure.back_memory(2 * spec["bytes"])
    stop = _measure.peak_memory()
    cpu, began = time.process_time(), time.perf_counter()
    with port.open_checkpoint(spec["url"], spec.get("max_over_read")) as ckpt:
        model = port.load(ckpt, mesh=mesh)
        jax.block_until_ready(jax.tree.leaves(model))
        read, sent = ckpt.bytes_read, getattr(getattr(ckpt, "transport", None), "sent", 0)
        over = ckpt.bytes_over_read
        largest = max(info.nbytes for info in ckpt.tensors.values())
    seconds = time.perf_counter() - began
    _, arrays = _measure.device_bytes(model)  # shards sharing one host buffer counted once
    return {
        "seconds": seconds,
        "cpu": time.process_time() - cpu,
        "peak": stop(),
        "bytes_read": read,
        "over_read": over,
        "arrays": arrays,
        "largest": largest,
        "requests": sent,
    }


def measure_process(spec: dict) -> dict:
    """One process of a two-process `port.load` of the URL: joined first, then timed."""
    import jax

    import port

    port.initialize(spec["coordinator"], 2, spec["process"], local_devices=4)
    mesh = _measure.started(spec["mesh"], devices=None)
    _measure.back_memory(spec["bytes"])
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("start")  # both processes start the clock together
    cpu, began = time.process_time(), time.perf_counter()
    with port.open_checkpoint(spec["url"], spec.get("max_over_read")) as ckpt:
        model = port.load(ckpt, mesh=mesh)
        jax.block_until_ready(jax.tree.leaves(model))
        read, sent = ckpt.bytes_read, getattr(getattr(ckpt, "transport", None), "sent", 0)
        over = ckpt.bytes_over_read
    return {
        "seconds": time.perf_counter() - began,
        "cpu": time.process_time() - cpu,
        "bytes_read": read,
        "over_read": over,
        "requests": sent,
    }


def two_processes(spec: dict) -> dict | str:
    """`port.load(url)` in two processes (4 simulated devices each): the slower one's seconds, bytes each read."""
    coordinator = f"127.0.0.1:{free_port()}"
    specs = [spec | {"coordinator": coordinator, "process": i} for i in range(2)]
    runs = [
        subprocess.Popen(
            [sys.executable, __file__, "--measure-process", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for spec in specs
    ]
    outs = [r.communicate(timeout=1800) for r in runs]
    if any(r.returncode for r in runs):
        return next(err.strip().splitlines()[-1] for (_, err), r in zip(outs, runs) if r.returncode)[:160]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    return {
        "seconds": max(r["seconds"] for r in results),
        "cpu": sum(r["cpu"] for r in results),
        "bytes_read": [r["bytes_read"] for r in results],
        "over_read": [r["over_read"] for r in results],
        "requests": [r["requests"] for r in results],
    }


def fetch_s3(spec: dict) -> dict:
    """s3fs's download of every safetensors file of the checkpoint (`cat_file`), in this fresh process."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    began = time.perf_counter()
    total = sum(len(fs.cat_file(path)) for path in spec["s3"])
    return {"seconds": time.perf_counter() - began, "bytes": total}


def fetch_hub(spec: dict) -> dict:
    """`huggingface_hub.hf_hub_download` of every safetensors file into an empty cache, in this fresh process."""
    from huggingface_hub import hf_hub_download

    with tempfile.TemporaryDirectory() as cache:
        began = time.perf_counter()
        paths = [hf_hub_download(spec["repo"], name, cache_dir=cache) for name in spec["hub"]]
        seconds = time.perf_counter() - began
        total = sum(Path(p).stat().st_size for p in paths)
    return {"seconds": seconds, "bytes": total}


def server_cpu(server: subprocess.Popen | None) -> float:
    """CPU seconds nginx's worker processes have spent so far (0 for a server that is not ours)."""
    if server is None:
        return 0.0
    try:
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
    except OSError:
        return 0.0
    ticks = 0
    for pid in children:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def make(name: str, www: Path) -> Path:
    """The checkpoint `name` (`gpt2-medium`, `gpt2-medium-x4`, `bert-base`) in `www`, written once."""
    directory = www / name
    family, size, *rest = name.split("-")
    if family not in MAKERS or not size or len(rest) > 1 or (rest and not rest[0].startswith("x")):
        raise SystemExit(f"--checkpoints: {name!r} is not gpt2-SIZE[-xN] or bert-SIZE")
    if not directory.exists():
        shards = ["--shards", rest[0][1:]] if rest else []
        subprocess.run([sys.executable, HERE / MAKERS[family], size, directory, *shards], check=True)
    return directory


def title(name: str) -> str:
    family, size, *rest = name.split("-")
    return f"{TITLES[family]} {size}" + (f", {rest[0][1:]} files" if rest else "")


class Table:
    """Rows of the side-by-side table: a baseline and port.load of the same bytes."""

    HEADER = [
        "checkpoint",
        "file bytes",
        "baseline s",
        "port.load s",
        "x baseline",
        "port.load of the local file s",
        "port CPU s",
        "server CPU s",
        "port peak anon memory above the arrays (x largest tensor)",
        "port bytes read",
        "fetched / needed",
        "port requests",
    ]

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def add(
        self,
        what: str,
        total: int,
        baseline: float,
        how: str,
        loads: list,
        server: float | None = None,
        local: float | None = None,
    ) -> None:
        done = [r for r in loads if isinstance(r, dict)]
        if not done:
            self.rows.append([what, _measure.mb(total), f"{baseline:.3f} ({how})", f"failed: {loads[0]}"])
            return
        best = min(done, key=lambda r: r["seconds"])
        read = best["bytes_read"]
        self.rows.append(
            [
                what,
                _measure.mb(total),
                f"{baseline:.3f} ({how})",
                f"{best['seconds']:.3f}",
                f"{best['seconds'] / baseline:.2f}",
                "" if local is None else f"{local:.3f}",
                f"{best['cpu']:.2f}",
                "" if server is None else f"{server:.2f}",
                _above(best),
                " + ".join(map(_measure.mb, read)) if isinstance(read, list) else _measure.mb(read),
                _fetched(read, best.get("over_read", 0)),
                " + ".join(map(str, best["requests"]))
                if isinstance(best.get("requests"), list)
                else str(best.get("requests", "")),
            ]
        )
        print(f"{what}: {how} {baseline:.3f} s, port.load {best['seconds']:.3f} s", file=sys.stderr, flush=True)


def _fetched(read: int | list[int], over: int | list[int]) -> str:
    """Bytes fetched over bytes needed (`bytes_read`, the opening's included), for each process."""
    reads, overs = (read, over) if isinstance(read, list) else ([read], [over])
    assert isinstance(overs, list)
    return " + ".join(f"{(r + o) / r:.2f}" if r else "" for r, o in zip(reads, overs))


def _above(result: dict) -> str:
    """Peak memory above the arrays the load made (CPU devices hold them in host memory), and
    that as a multiple of the largest tensor."""
    if "peak" not in result:
        return ""
    above = result["peak"] - result["arrays"]
    return f"{_measure.mb(above)} ({above / result['largest']:.2f})"


def timed(server: subprocess.Popen | None, run) -> tuple[dict | str, float]:
    """`run()` and the CPU seconds the server spent meanwhile."""
    before = server_cpu(server)
    result = run()
    return result, server_cpu(server) - before


def best_of(repeats: int, server: subprocess.Popen | None, run) -> tuple[list, float | None]:
    """`run()` `repeats` times: the results, and the server's CPU seconds during the fastest."""
    pairs = [timed(server, run) for _ in range(repeats)]
    done = [(r, cpu) for r, cpu in pairs if isinstance(r, dict)]
    return [r for r, _ in pairs], (min(done, key=lambda p: p[0]["seconds"])[1] if done else None)


def s3_rows(table: Table, names: list[str], www: Path, mesh: str, repeats: int) -> None:
    """The same checkpoints in a moto S3 server on 127.0.0.1: port.load of s3://... beside s3fs's download."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        }
    )
    try:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir("models")
        for name in names:
            directory = www / name
            fs.put(f"{directory}/", f"models/{name}/", recursive=True)
            paths = [f"models/{name}/{p.name}" for p in sorted(directory.glob("*.safetensors"))]
            total = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
            fetches = [_measure.isolated(__file__, {"s3": paths}) for _ in range(repeats)]
            loads = [
                _measure.isolated(__file__, {"url": f"s3://models/{name}", "mesh": mesh, "bytes": total})
                for _ in range(repeats)
            ]
            got = [r["seconds"] for r in fetches if isinstance(r, dict)]
            if not got:
                table.rows.append([f"{title(name)}, S3 (moto)", _measure.mb(total), f"failed: {fetches[0]}"])
                continue
            table.add(f"{title(name)}, S3 (moto)", total, min(got), "s3fs", loads)
    finally:
        server.stop()


def curl(urls: list[str]) -> float:
    began = time.perf_counter()
    for url in urls:
        subprocess.run(["curl", "-s", "-f", "-o", "/dev/null", url], check=True)
    return time.perf_counter() - began


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        spec = json.loads(sys.argv[2])
        kind = fetch_s3 if "s3" in spec else fetch_hub if "hub" in spec else measure
        print(json.dumps(kind(spec)))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--measure-process":
        print(json.dumps(measure_process(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoints",
        default="gpt2-medium",
        help="from gpt2-small, gpt2-medium, gpt2-large, gpt2-medium-x4 (4 files), bert-base; "
        "gpt2-tiny, bert-tiny for a smoke run",
    )
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    parser.add_argument(
        "--hub",
        action="store_true",
        help="also hf://bench/NAME through nginx as the Hub, beside huggingface_hub's download",
    )
    parser.add_argument(
        "--s3",
        action="store_true",
        help="also through a moto S3 server on 127.0.0.1, beside s3fs's download of the file",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        choices=(1, 2),
        help="2: also load the URL in two processes (4 devices each), each its share",
    )
    parser.add_argument(
        "--max-over-read",
        type=float,
        metavar="R",
        help="a read may fetch up to R times the bytes it needs (default: port's, 2; 1: exact ranges)",
    )
    args = parser.parse_args()
    if shutil.which("nginx") is None or shutil.which("curl") is None:
        print("bench/remote.py needs nginx and curl (apt-get install nginx-light curl)", file=sys.stderr)
        raise SystemExit(2)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="port-remote-"))
    www = work / "www"
    www.mkdir(parents=True, exist_ok=True)
    names = args.checkpoints.split(",")
    table = Table()
    server, base = start_nginx(www, work)
    try:
        for name in names:
            directory = make(name, www)
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            total = sum((directory / f).stat().st_size for f in files)
            urls = [f"{base}/{name}/{f}" for f in files]
            curl(urls)  # the page cache and the server warm
            best_curl = min(curl(urls) for _ in range(args.repeats))
            spec = {"url": f"{base}/{name}", "mesh": args.mesh, "bytes": total, "max_over_read": args.max_over_read}
            loads, cpu = best_of(args.repeats, server, lambda: _measure.isolated(__file__, spec))
            local = [_measure.isolated(__file__, spec | {"url": str(directory)}) for _ in range(args.repeats)]
            local_best = min((r["seconds"] for r in local if isinstance(r, dict)), default=float("nan"))
            table.add(title(name), total, best_curl, "curl", loads, cpu, local_best)
            if args.processes == 2:
                pairs, cpu = best_of(args.repeats, server, lambda: two_processes(spec))
                table.add(f"{title(name)}, 2 processes", total, best_curl, "curl", pairs, cpu)
            if args.hub:
                os.environ.update(
                    {
                        "HF_ENDPOINT": base,
                        "HF_HUB_OFFLINE": "0",
                        "HF_HUB_DISABLE_TELEMETRY": "1",
                        "HF_HUB_DISABLE_XET": "1",
                    }
                )
                fetches = [
                    _measure.isolated(__file__, {"repo": f"bench/{name}", "hub": files}) for _ in range(args.repeats)
                ]
                got = [r["seconds"] for r in fetches if isinstance(r, dict)]
                loads, cpu = best_of(
                    args.repeats, server, lambda: _measure.isolated(__file__, spec | {"url": f"hf://bench/{name}"})
                )
                if got:
                    table.add(f"{title(name)}, hf://", total, min(got), "huggingface_hub", loads, cpu)
                else:
                    table.rows.append([f"{title(name)}, hf://", _measure.mb(total), f"failed: {fetches[0]}"])
    finally:
        server.terminate()
        server.wait()
    if args.s3:
        s3_rows(table, names, www, args.mesh, args.repeats)
    title_line = (
        f"### Remote reads from 127.0.0.1 (mesh {args.mesh}), best of {args.repeats}: "
        f"`python bench/remote.py {' '.join(sys.argv[1:])}`\n\n"
    )
    text = title_line + _measure.markdown(Table.HEADER, table.rows) + f"\n{_measure.machine()}\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
