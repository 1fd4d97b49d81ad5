"""Remote checkpoints read in place by byte range: HTTP, the Hub's URLs, S3 (moto), two processes.

Everything runs on 127.0.0.1: a threaded `http.server` that serves the GPT-2
checkpoints, honours `Range`, counts the body bytes it sends and misbehaves on
request (503s, connections dropped mid-body, lying lengths, shifted ranges, stalls);
and moto's S3 server. A remote load must equal the local load bit for bit and move
the file's bytes about once.
"""

import base64
import json
import re
import shutil
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest

import port
from port._sources import _fsspec, _http, _hub, _ranges, _remote, _transport, _urls

from helpers import assert_same, run_port
from test_multiprocess import expected_reads, free_port, run_processes

EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny-gpt2"


# ---------------------------------------------------------------------------- the HTTP server


class Handler(BaseHTTPRequestHandler):
    """GET of the served root's files: `Range: bytes=A-B` answered 206, faults as the state says."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        state: Served = self.server.state
        state.count()
        with state.track():
            time.sleep(state.delay)
            self._answer(state)

    def _empty(self, status: int, **headers: str) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": "0", **headers}.items():
            self.send_header(name, value)
        self.end_headers()

    def _answer(self, state: "Served") -> None:
        parts = urlsplit(self.path)
        if not state.authorized(self.headers.get("Authorization"), parts):
            return self._empty(401)
        path = state.mapped(parts.path)
        if path.startswith("/redirect/"):  # to the same files, on another host name
            return self._empty(302, Location=f"{state.cdn or self.server.base}{path[9:]}")
        file = state.root / path.lstrip("/")
        if not file.is_file():
            return self._empty(404)
        size = file.stat().st_size  # the file is read only where asked: it may be a 234 GB hole
        asked = self.headers.get("Range") or ""
        if "," in asked:
            return self._parts(state, file, size, asked)
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", asked)
        fault = state.fault(parts.path, match and (int(match[1]), int(match[2])))
        if fault == "503":
            return self._empty(503)
        if match is None or state.ignore_range:
            return self._send(200, file.read_bytes(), {}, fault)
        first, last = int(match[1]), min(int(match[2]), size - 1)
        if first >= size:
            return self._empty(416, **{"Content-Range": f"bytes */{size}"})
        if fault == "shifted":  # another range than asked, announced truthfully
            first, last = first + 1, min(last + 1, size - 1)
        with open(file, "rb") as f:
            f.seek(first)
            body = f.read(last + 1 - first)
        self._send(206, body, {"Content-Range": f"bytes {first}-{last}/{size}"}, fault)

    def _parts(self, state: "Served", file: Path, size: int, asked: str) -> None:
        """Several ranges: a multipart/byteranges answer as nginx writes it, unless the state says
        to answer as a server that takes one range only (`one_range`: the first range alone), or
        otherwise as RFC 9110 allows (`parts`: "reordered", the parts last first; "coalesced", each
        two neighbouring ranges one part with the gap between them, last first; "single", one
        range from the first byte asked to the last, not multipart), or as it does not
        ("unasked": each part one byte later than asked)."""
        spans = [tuple(map(int, part.split("-"))) for part in asked.removeprefix("bytes=").split(",")]
        state.multipart_requests += 1
        with open(file, "rb") as f:

            def data(first, last):
                f.seek(first)
                return f.read(last + 1 - first)

            if state.one_range or state.parts == "single":
                first, last = spans[0] if state.one_range else (spans[0][0], spans[-1][1])
                return self._send(206, data(first, last), {"Content-Range": f"bytes {first}-{last}/{size}"}, None)
            if state.parts == "reordered":
                spans = spans[::-1]
            elif state.parts == "coalesced":
                spans = [(spans[i][0], spans[min(i + 1, len(spans) - 1)][1]) for i in range(0, len(spans), 2)][::-1]
            elif state.parts == "unasked":
                spans = [(first + 1, min(last + 1, size - 1)) for first, last in spans]
            boundary = "00000000042"
            data_bytes = sum(last + 1 - first for first, last in spans)
            body = (
                b"".join(
                    f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n"
                    f"Content-Range: bytes {first}-{last}/{size}\r\n\r\n".encode()
                    + data(first, last)
                    for first, last in spans
                )
                + f"\r\n--{boundary}--\r\n".encode()
            )
        self._send(206, body, {"Content-Type": f"multipart/byteranges; boundary={boundary}"}, None)
        state.add(data_bytes - len(body))  # `sent` counts the file's bytes, not the parts' headers

    def _send(self, status: int, body: bytes, headers: dict, fault: str | None) -> None:
        length = len(body) // 2 if fault == "short" else len(body)  # "short": a lying Content-Length
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(length)}.items():
            self.send_header(name, value)
        self.end_headers()
        if fault in ("drop", "short"):  # half the body, then the connection goes
            body, self.close_connection = body[: len(body) // 2], True
        if fault == "stall":
            self.wfile.flush()
            time.sleep(1.0)
        if fault == "dribble":  # the body in writes of 1 to 13 bytes: receives end anywhere in a piece
            sizes, at = [1, 13, 2, 7, 5, 11, 3], 0
            for i in range(len(body)):
                if at >= len(body):
                    break
                self.wfile.write(body[at : at + sizes[i % len(sizes)]])
                self.wfile.flush()
                at += sizes[i % len(sizes)]
            self.server.state.add(len(body))
            return
        if fault == "trickle":  # 64 bytes every 20 ms (3.2 KB/s) until done or the client gives up
            for start in range(0, len(body), 64):
                self.wfile.write(body[start : start + 64])
                self.wfile.flush()
                time.sleep(0.02)
            self.server.state.add(len(body))
            return
        self.wfile.write(body)
        self.server.state.add(len(body))


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # a client that hung up (as port does on a stalled answer) is no error of the server's


class Served:
    """What the server serves, how it misbehaves, and what it saw."""

    def __init__(self, root: Path):
        self.root = root
        self.sent = self.requests = 0
        self.active = self.most_active = 0
        self.faults: list[str | None] = []  # the first request for each (file, range) gets the next fault
        self.always: tuple[str, str] | None = None  # (path suffix, fault): every data request for it
        self.ignore_range = False
        self.delay = 0.0  # seconds before each answer
        self.one_range = False  # answer a request for several ranges with the first range only
        self.parts: str | None = None  # how else to answer several ranges (see `Handler._parts`)
        self.multipart_requests = 0
        self.cdn: str | None = None  # where /redirect/ sends: another server (host, port), sharing this state
        self.credentials: tuple[str, str] | None = None  # (Authorization, query token) required
        self.hub: tuple[str, Path] | None = None  # ("/org/name/resolve/main/", directory under root)
        self.seen: set = set()
        self.served_faults: dict[str | None, int] = {}
        self.lock = threading.Lock()

    def track(self):
        state = self

        class Active:
            def __enter__(self):
                with state.lock:
                    state.active += 1
                    state.most_active = max(state.most_active, state.active)

            def __exit__(self, *exc):
                with state.lock:
                    state.active -= 1

        return Active()

    def count(self) -> None:
        with self.lock:
            self.requests += 1

    def add(self, n: int) -> None:
        with self.lock:
            self.sent += n

    def fault(self, path: str, span: tuple[int, int] | None) -> str | None:
        if self.always and path.endswith(self.always[0]) and span and span[0] > 8:
            with self.lock:
                self.served_faults[self.always[1]] = self.served_faults.get(self.always[1], 0) + 1
            return self.always[1]
        with self.lock:
            if not self.faults or (path, span) in self.seen:
                return None
            self.seen.add((path, span))
            fault = self.faults[len(self.seen) % len(self.faults)]
            self.served_faults[fault] = self.served_faults.get(fault, 0) + 1
            return fault

    def authorized(self, header: str | None, parts) -> bool:
        if parts.path.startswith("/cdn/"):  # the Hub's redirect target: never sent the token
            return header is None
        if self.hub and parts.path.startswith(self.hub[0]):
            return header == "Bearer hf_secret_token"
        if self.credentials is None:
            return True
        return header == self.credentials[0] and parse_qs(parts.query).get("token") == [self.credentials[1]]

    def mapped(self, path: str) -> str:
        if path.startswith("/cdn/"):
            return path[4:]
        if self.hub and path.startswith(self.hub[0]):
            return f"/{self.hub[1]}/{path[len(self.hub[0]) :]}"
        return path


@pytest.fixture(scope="module")
def server(gpt2_checkpoints):
    """The server over the GPT-2 checkpoints (`/lm`, `/base`, `/sharded`) and `/tiny` (the example)."""
    directories, _ = gpt2_checkpoints
    root = directories["lm"].parent
    if not (root / "tiny").exists():
        shutil.copytree(EXAMPLE, root / "tiny")
    httpd = start_server(root)
    yield httpd
    httpd.shutdown()


def start_server(root: Path, state: Served | None = None) -> Server:
    """A server on 127.0.0.1 over `root`, answering in a thread until `shutdown()`."""
    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.base, httpd.root = f"http://127.0.0.1:{httpd.server_port}", root
    httpd.state = state or Served(root)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture
def served(server, monkeypatch):
    """The server's state, fresh for each test; retries without waiting."""
    server.state = Served(server.root)
    monkeypatch.setattr(_transport, "BACKOFF", 0.001)
    return server.state


def files_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


# ---------------------------------------------------------------------------- HTTP


@pytest.mark.parametrize("layout", ["lm", "sharded"])
def test_http_load_matches_local_and_moves_the_file_once(server, served, gpt2_checkpoints, layout):
    directory = gpt2_checkpoints[0][layout]
    run = port.convert(f"{server.base}/{layout}", mesh="4x2")
    assert_same(run.model, port.load(directory, mesh="4x2"))
    size = files_size(directory)
    assert run.report.bytes_read == served.sent  # what the client counts is what crossed the wire
    assert served.sent <= 1.02 * size, (served.sent, size)
    print(f"\nremote {layout}, 1 process x 8 devices: {served.sent} bytes in {served.requests} requests, files {size}")
    with port.open_checkpoint(f"{server.base}/{layout}") as ckpt:
        info = next(iter(ckpt.tensors.values()))
        assert str(info.file).startswith(f"{server.base}/{layout}/") and info.file.name.endswith(".safetensors")
        assert ckpt.directory == f"{server.base}/{layout}"


def test_http_faults_are_retried_and_a_short_body_is_never_data(server, served, gpt2_checkpoints, monkeypatch):
    monkeypatch.setattr(_http, "TIMEOUT", 0.3)  # "stall" waits 1 s mid-body
    served.faults = [None, "503", "drop", "short", "shifted", "stall"]
    run = port.convert(f"{server.base}/sharded", mesh="4x2")
    assert_same(run.model, port.load(gpt2_checkpoints[0]["sharded"], mesh="4x2"))
    assert all(served.served_faults.get(fault, 0) >= 5 for fault in served.faults), served.served_faults
    assert run.report.bytes_read >= files_size(gpt2_checkpoints[0]["sharded"])  # partial bodies count too


def test_a_server_slower_than_the_minimum_rate_is_retried_then_refused(server, served, gpt2_checkpoints, monkeypatch):
    """A body that trickles in (3.2 KB/s here) is given up once the request has run GRACE seconds
    below MIN_RATE: retried (a fault on one request costs nothing), and where every answer
    trickles, one line after ATTEMPTS tries instead of a run that never ends."""
    monkeypatch.setattr(_http, "GRACE", 0.3)
    monkeypatch.setattr(_http, "MIN_RATE", 1 << 20)
    served.faults = [None, "trickle"]
    run = port.convert(f"{server.base}/sharded", mesh="2x2")
    assert_same(run.model, port.load(gpt2_checkpoints[0]["sharded"], mesh="2x2"))
    assert served.served_faults.get("trickle", 0) >= 1
    served.faults, served.always = [], ("model.safetensors", "trickle")
    began = time.monotonic()
    with pytest.raises(port.CheckpointError) as caught:
        port.load(f"{server.base}/lm", mesh="1x1")
    message = str(caught.value)
    assert re.search(
        r"model\.safetensors: bytes \d+-\d+ \(tensor '[\w.]+'( and \d+ small ones beside it)?\): \d+ of \d+ bytes in [\d.]+ s, "
        r"slower than 1024 KiB/s "
        rf"\(gave up after {_transport.ATTEMPTS} attempts\)$",
        message,
    ), message
    assert "\n" not in message and time.monotonic() - began < 60


def test_requests_in_flight_are_bounded(server, served, monkeypatch):
    monkeypatch.setattr(_http, "HTTP_CHUNK", 4096)  # many requests for one tensor
    with _remote.open_remote(f"{server.base}/tiny", requests=3) as ckpt:
        served.most_active, served.delay = 0, 0.01
        info = ckpt.tensors["transformer.wte.weight"]
        block = ckpt.read(info.key, tuple((0, n) for n in info.shape))
        assert info.nbytes // 4096 > 20 and 2 <= served.most_active <= 3
    with port.open_checkpoint(EXAMPLE) as local:
        assert np.array_equal(block, local.read(info.key, tuple((0, n) for n in info.shape)))


@pytest.mark.slow
def test_a_permanent_failure_is_one_line_naming_the_url_and_range(server, served, tmp_path, monkeypatch):
    served.always = ("model.safetensors", "503")
    monkeypatch.setattr(_transport, "BACKOFF", 0.001)  # in this process; the command below waits as users do
    with pytest.raises(port.CheckpointError) as caught:
        port.load(f"{server.base}/lm", mesh="1x1")
    message = str(caught.value)
    assert "\n" not in message
    assert re.match(
        rf"{re.escape(server.base)}/lm/model\.safetensors: bytes \d+-\d+ \(tensor '[\w.]+'( and \d+ small ones beside it)?\): "
        rf"HTTP 503 Service Unavailable \(gave up after {_transport.ATTEMPTS} attempts\)$",
        message,
    ), message

    result = run_port("convert", f"{server.base}/lm", "--out", tmp_path / "out")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.match(rf"port: error: {re.escape(server.base)}/lm/model\.safetensors: bytes \d+-\d+ ", lines[0])
    assert not (tmp_path / "out").exists()


def test_missing_files_and_servers_without_ranges_are_refused(server, served):
    with pytest.raises(port.CheckpointError, match=rf"^{re.escape(server.base)}/nowhere: no config.json$"):
        port.open_checkpoint(f"{server.base}/nowhere")
    changing = served.root / "changing"
    shutil.rmtree(changing, ignore_errors=True)
    shutil.copytree(EXAMPLE, changing)
    with port.open_checkpoint(f"{server.base}/changing") as ckpt:
        size = ckpt.tensors["transformer.wte.weight"].file.size
        with open(changing / "model.safetensors", "ab") as f:
            f.write(b"\0" * 8)
        with pytest.raises(
            port.CheckpointError,
            match=rf"^{re.escape(server.base)}/changing/model.safetensors: "
            rf"bytes \d+-\d+ \(tensor 'transformer.wte.weight'\): changed since its header was read "
            rf"\(now {size + 8} bytes, was {size}\)$",
        ):
            ckpt.read("transformer.wte.weight", ((0, 1), (0, 64)))
    served.ignore_range = True
    with pytest.raises(
        port.CheckpointError, match=r"/lm/model\.safetensors: bytes 0-7: the server does not honour Range"
    ):
        port.open_checkpoint(f"{server.base}/lm")


def corrupt(directory: Path, how: str) -> None:
    """Rewrite `directory/model.safetensors` with a header broken in one way."""
    path = directory / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    if how == "length":
        data = (len(data)).to_bytes(8, "little") + data[8:]
    elif how == "gap":
        key = next(k for k in header if k != "__metadata__")
        header[key]["data_offsets"] = [o + 4 for o in header[key]["data_offsets"]]
    elif how == "dtype":
        header[next(k for k in header if k != "__metadata__")]["dtype"] = "Q7"
    if how != "length":
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        data = len(raw).to_bytes(8, "little") + raw + data[8 + n :]
    path.write_bytes(data)


@pytest.mark.parametrize("how", ["length", "gap", "dtype"])
def test_remote_headers_are_validated_as_local_ones(server, served, tmp_path, how):
    bad = served.root / f"bad-{how}"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(EXAMPLE, bad)
    corrupt(bad, how)
    with pytest.raises(port.CheckpointError) as local:
        port.open_checkpoint(bad)
    with pytest.raises(port.CheckpointError) as remote_error:
        port.open_checkpoint(f"{server.base}/bad-{how}")
    assert str(remote_error.value) == f"{server.base}/bad-{how}/{local.value}"


@pytest.mark.slow
def test_credentials_are_used_and_never_shown(server, served, tmp_path):
    served.credentials = ("Basic " + base64.b64encode(b"me:s3cret-pass").decode(), "t0ken-value")
    url = f"http://me:s3cret-pass@127.0.0.1:{server.server_port}/tiny?token=t0ken-value"
    secrets = ("s3cret-pass", "t0ken-value")
    run = port.convert(url, mesh="2x2", out=tmp_path / "out")
    assert_same(run.model, port.load(EXAMPLE, mesh="2x2"))
    with port.open_checkpoint(url) as ckpt:
        shown = [ckpt.directory, repr(ckpt), repr(ckpt.tensors), str(next(iter(ckpt.tensors.values())).file)]
    written = [p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()]
    served.always = ("model.safetensors", "503")
    with pytest.raises(port.CheckpointError) as caught:
        port.load(url)
    shown.append(str(caught.value))
    assert f"http://127.0.0.1:{server.server_port}/tiny/model.safetensors: bytes" in shown[-1]
    for secret in secrets:
        assert not any(secret in text for text in shown)
        assert not any(secret.encode() in data for data in written)
    with pytest.raises(port.CheckpointError, match=r"HTTP 401 Unauthorized\): check the credentials"):
        port.open_checkpoint(f"{server.base}/tiny?token=wrong")
    # Through the real command line: what it prints and the --report it writes.
    served.always = None
    converted = run_port("convert", url, "--mesh", "2x2", "--out", tmp_path / "cli", "--report", tmp_path / "r.json")
    planned = run_port("plan", url, "--mesh", "2x2")
    for result in (converted, planned):
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"http://127.0.0.1:{server.server_port}/tiny" in result.stdout + result.stderr
    report = (tmp_path / "r.json").read_text()
    assert json.loads(report)["model"] == f"http://127.0.0.1:{server.server_port}/tiny"
    for secret in secrets:
        for text in (converted.stdout, converted.stderr, planned.stdout, planned.stderr, report):
            assert secret not in text


def test_redirects_are_followed_and_credentials_stay_with_the_first_host(server, served, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.base)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
    served.hub = ("/someone/tiny/resolve/v1.0/", Path("redirect/cdn/tiny"))  # Hub -> 302 -> "CDN"
    cdn = start_server(served.root, served)  # another origin: the token is not sent there
    served.cdn = cdn.base
    with port.open_checkpoint("hf://someone/tiny@v1.0") as ckpt:
        assert ckpt.directory == "hf://someone/tiny@v1.0"
        assert str(ckpt.tensors["transformer.wte.weight"].file) == "hf://someone/tiny@v1.0/model.safetensors"
        block = ckpt.read("transformer.wte.weight", ((3, 9), (0, 64)))
    with port.open_checkpoint(EXAMPLE) as local:
        assert np.array_equal(block, local.read("transformer.wte.weight", ((3, 9), (0, 64))))
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(port.CheckpointError, match=r"^hf://someone/tiny@v1.0/config.json: access denied"):
        port.open_checkpoint("hf://someone/tiny@v1.0")
    cdn.shutdown()


def test_urls_are_parsed_and_shown_without_credentials():
    assert _hub.hf_location("hf://org/name") == ("org/name", "main", "")
    assert _hub.hf_location("hf://org/name@refs%2Fpr%2F1/sub") == ("org/name", "refs/pr/1", "sub")
    assert _hub.hf_location("hf://gpt2@abc") == ("gpt2", "abc", "")
    with pytest.raises(port.CheckpointError, match="not a Hugging Face repo URL"):
        _hub.hf_location("hf://org/name/../x")
    assert _hub.hf_location(f"hf://{'o' * 96}/{'n' * 96}") == (f"{'o' * 96}/{'n' * 96}", "main", "")
    for url in (f"hf://{'a' * 256}", f"hf://org/{'n' * 97}@v1"):  # the Hub's names have at most 96 characters
        with pytest.raises(port.CheckpointError, match=r"^hf://.*: 'a{40}'\.\.\. is 256 |: 'n{40}'\.\.\. is 97 "):
            _hub.hf_location(url)
    assert _urls.redact("https://u:p@h:8/a/b/?q=1#f") == "https://h:8/a/b"
    assert _urls.redact("s3://key:secret@bucket/p") == "s3://bucket/p"
    assert _urls.is_url("gs://b/x") and not _urls.is_url("org/name") and not _urls.is_url(Path("a"))
    assert _urls.shown("https://u:p@h/x?t=1") == "https://h/x" and _urls.shown("org/name") == "org/name"
    with pytest.raises(port.CheckpointError, match=r"^https://h/x: a remote checkpoint; this needs a local"):
        port._sources.resolve("https://u:p@h/x")
    with pytest.raises(port.CheckpointError, match=r"needs another package|not a URL port can read"):
        port.open_checkpoint("nosuchscheme://bucket/x")


@pytest.mark.slow
def test_hub_urls_with_user_info_and_broken_urls_are_refused_without_their_secret():
    assert _urls.redact("hf://me:SECRET@org/name") == "hf://org/name"
    assert _urls.redact("hf://org/name@v1") == "hf://org/name@v1"  # a revision stays
    for url, words in [
        ("hf://me:SECRET@org/name", "not a Hugging Face repo URL"),
        ("http://u:SECRET@[::1/x", "not a URL port can read (Invalid IPv6 URL)"),
    ]:
        result = run_port("plan", url, "--mesh", "1x1")
        assert result.returncode == 1 and words in result.stderr, result.stderr
        assert "SECRET" not in result.stdout + result.stderr
        assert "internal error" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_worker_is_not_given_the_url_in_its_argv(server, served, tmp_path):
    """`ps` shows every user a process's argv: port's worker gets the command line through its
    environment (readable by the same user only), so a URL's credentials are not in it."""
    import subprocess
    import time

    from helpers import port_command, port_env

    served.credentials = ("Basic " + base64.b64encode(b"me:s3cret-pass").decode(), "t0ken-value")
    served.delay = 0.3  # every answer slowed: the run lasts long enough to look at
    url = f"http://me:s3cret-pass@127.0.0.1:{server.server_port}/tiny?token=t0ken-value"
    process = subprocess.Popen(
        [*port_command(), "plan", url, "--mesh", "1x1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=port_env(),
    )
    try:
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
        deadline = time.monotonic() + 30
        while not children.read_text().split() and time.monotonic() < deadline:
            time.sleep(0.02)
        worker = children.read_text().split()[0]
        argv = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")
        assert argv[-2:] == [b"from port._cli import main; main()", b""], argv
        assert not any(b"s3cret" in part or b"t0ken" in part for part in argv)
    finally:
        out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert "s3cret" not in out + err and "t0ken" not in out + err


def _tallest_column_block(checkpoint):
    """The 2-D tensor with the most rows, its row count, and a block of its columns: one range a row."""
    key = max(
        (k for k, t in checkpoint.tensors.items() if len(t.shape) == 2), key=lambda k: checkpoint.tensors[k].shape[0]
    )
    rows, cols = checkpoint.tensors[key].shape
    return key, rows, ((0, rows), (cols // 4, cols // 2))


@pytest.mark.parametrize("one_range", [False, True])
def test_separate_ranges_share_a_request_or_go_one_by_one(server, served, gpt2_checkpoints, one_range):
    """A column block's rows are separate ranges: asked for several to a request and read part by
    part from the multipart answer; a server that answers such a request with one range is asked
    range by range from then on. Either way the bytes are the file's."""
    served.one_range = one_range
    directory = gpt2_checkpoints[0]["lm"]
    with port.open_checkpoint(f"{server.base}/lm") as ckpt, port.open_checkpoint(directory) as local:
        key, rows, region = _tallest_column_block(local)
        before = served.requests
        np.testing.assert_array_equal(ckpt.read(key, region), local.read(key, region))
        asked = served.requests - before
        assert ckpt.transport.multipart is not one_range
        groups = -(-rows // _http.MAX_PARTS)  # asked at once, on the request threads
        assert 1 <= served.multipart_requests <= groups, served.multipart_requests
        # One server answered with one range: each range then has a request of its own.
        assert asked == (served.multipart_requests + rows if one_range else groups), (asked, rows)


@pytest.mark.parametrize("parts", ["reordered", "coalesced", "single"])
def test_ranges_answered_reordered_or_coalesced_are_taken(server, served, gpt2_checkpoints, parts):
    """A server may answer several ranges in another order, coalesce neighbouring ones into one
    part (the gap between them sent too), or into one range not sent as multipart (RFC 9110
    14.3): each range's bytes are found by the parts' Content-Range, in one request a group, no
    retry and no fallback; every 2-D tensor's column block is the local one bit for bit."""
    served.parts = parts
    directory = gpt2_checkpoints[0]["lm"]
    with port.open_checkpoint(f"{server.base}/lm") as ckpt, port.open_checkpoint(directory) as local:
        before, groups = served.requests, 0
        for key, info in local.tensors.items():
            if len(info.shape) == 2 and info.shape[0] > 1:  # a column block: one range a row
                rows, cols = info.shape
                region = ((0, rows), (cols // 4, cols // 2))
                np.testing.assert_array_equal(ckpt.read(key, region), local.read(key, region))
                groups += -(-rows // _http.MAX_PARTS)
        assert served.requests - before == served.multipart_requests == groups and ckpt.transport.multipart
        assert ckpt.bytes_read == served.sent  # the file's bytes that crossed the wire, gaps included


def test_parts_that_do_not_hold_the_ranges_asked_are_asked_for_one_by_one(server, served, gpt2_checkpoints):
    """A multipart answer whose parts are not the ranges asked (one byte later here) is never data,
    and not retried: the server is asked range by range from then on."""
    served.parts = "unasked"
    directory = gpt2_checkpoints[0]["lm"]
    with port.open_checkpoint(f"{server.base}/lm") as ckpt, port.open_checkpoint(directory) as local:
        key, rows, region = _tallest_column_block(local)
        before = served.requests
        np.testing.assert_array_equal(ckpt.read(key, region), local.read(key, region))
        assert not ckpt.transport.multipart
        groups = -(-rows // _http.MAX_PARTS)  # asked at once, on the request threads: each declined once
        assert 1 <= served.multipart_requests <= groups
        assert served.requests - before == served.multipart_requests + rows


def test_a_multipart_answer_must_hold_the_ranges_asked():
    """Parts in any order, or coalesced (one part holding several ranges and the gap between
    them), are found by their Content-Range. Parts for another range, overlapping, or one more
    than asked are a server answering otherwise (`OneRangeOnly`: asked range by range, not
    retried); a missing delimiter or header end, a part cut short, bytes after the last part are
    transient, another file size permanent: never data."""
    ranges = [(10, 14), (30, 32)]

    def part(first, last, data, size=100, delimiter=b"--B"):
        return (
            b"\r\n"
            + delimiter
            + f"\r\nContent-Type: x\r\nContent-Range: bytes {first}-{last}/{size}\r\n\r\n".encode()
            + data
        )

    gap = bytes(range(14, 30))
    for good, held in [
        (part(10, 13, b"abcd") + part(30, 31, b"ef") + b"\r\n--B--\r\n", 6),
        (part(30, 31, b"ef") + part(10, 13, b"abcd") + b"\r\n--B--\r\n", 6),  # reordered
        (part(10, 31, b"abcd" + gap + b"ef") + b"\r\n--B--\r\n", 22),  # coalesced
        (part(30, 31, b"ef") + part(8, 13, b"XYabcd") + b"\r\n--B--\r\n", 8),  # a range's part begins before it
    ]:
        offsets, count = _http.part_offsets(good, b"B", ranges, 100)
        assert [good[o : o + stop - start] for o, (start, stop) in zip(offsets, ranges)] == [b"abcd", b"ef"]
        assert count == held
    for body, message in [
        (part(10, 13, b"abcd") + part(31, 31, b"f") + b"\r\n--B--\r\n", "no part holds bytes 30-31 whole"),
        (part(10, 13, b"abcd") + b"\r\n--B--\r\n", "no part holds bytes 30-31 whole"),
        (part(10, 13, b"abcd") + part(30, 31, b"ef") + part(50, 50, b"g") + b"\r\n--B--\r\n", "more parts than"),
        (part(10, 13, b"abcd") + part(40, 41, b"gh") + part(30, 31, b"ef") + b"\r\n--B--\r\n", "more parts than"),
        (part(10, 13, b"abcd") + part(40, 41, b"gh") + b"\r\n--B--\r\n", "no part holds bytes 30-31"),
        (part(10, 31, b"abcd" + gap + b"ef") + part(30, 31, b"ef") + b"\r\n--B--\r\n", "overlap"),
        (part(10, 13, b"abcd") + part(20, 21, b"xx") + b"\r\n--B--\r\n", "no part holds bytes 30-31"),
    ]:
        with pytest.raises(_transport.OneRangeOnly, match=message):
            _http.part_offsets(body, b"B", ranges, 100)
    three = [(10, 14), (20, 22), (30, 32)]  # the first two coalesced, and a third part for none of them
    body = part(10, 21, bytes(12)) + part(30, 31, b"ef") + part(40, 41, b"gh") + b"\r\n--B--\r\n"
    with pytest.raises(_transport.OneRangeOnly, match="a part for bytes 40-41, not asked for"):
        _http.part_offsets(body, b"B", three, 100)
    for body, message in [
        (b"\r\n--B--\r\n", "closing delimiter"),
        (part(10, 13, b"abcd") + part(99, 100, b"ef") + b"\r\n--B--\r\n", "for bytes 99-100 of 100"),
        (part(10, 13, b"abcd", delimiter=b"--C") + part(30, 31, b"ef") + b"\r\n--B--\r\n", "without the delimiter"),
        (part(10, 13, b"abcd") + part(30, 31, b"ef", size=99) + b"\r\n--B--\r\n", "changed since its header"),
        (part(10, 13, b"abcd") + part(30, 31, b"e"), "ends within a part"),
        (part(10, 13, b"abcd") + part(30, 31, b"ef") + b"\r\n--B--\r\nmore", "closing delimiter"),
        (part(10, 13, b"abcd") + part(30, 31, b"ef") + b"\r\n--B\r\n", "without the end of its headers"),
        (b"\r\n--B\r\nContent-Type: x\r\n\r\nabcd" + part(30, 31, b"ef"), "without a valid Content-Range"),
        (b"\r\n--B\r\nContent-Range: bytes 10-13/100" + b" " * 5000, "without the end of its headers"),
    ]:
        with pytest.raises((_transport.Transient, _transport.Permanent), match=message):
            _http.part_offsets(body, b"B", ranges, 100)


def test_ranges_merge_when_adjacent_and_stop_at_the_chunk():
    offsets, lengths = np.array([40, 0, 8, 16, 100]), np.array([8, 8, 8, 8, 30])
    addresses = np.array([1000, 0, 8, 16, 2000], np.uint64)
    ranges = _ranges.plan_ranges(offsets, lengths, addresses, chunk=20)
    assert list(zip(ranges.starts.tolist(), ranges.stops.tolist())) == [
        (0, 20),
        (20, 24),
        (40, 48),
        (100, 120),
        (120, 130),
    ]
    pieces = [ranges.pieces_of(i).tolist() for i in range(len(ranges))]
    assert pieces == [[[0, 8], [8, 8], [16, 4]], [[20, 4]], [[1000, 8]], [[2000, 20]], [[2020, 10]]]
    # A run across several chunk boundaries is cut at each; an empty plan has no ranges.
    ranges = _ranges.plan_ranges(np.array([5]), np.array([50]), np.array([0], np.uint64), chunk=20)
    assert ranges.pieces.tolist() == [[0, 20], [20, 20], [40, 10]] and ranges.stops.tolist() == [25, 45, 55]
    assert len(_ranges.plan_ranges(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint64), 20)) == 0


def test_a_body_in_odd_bits_lands_where_its_pieces_say(server, served, gpt2_checkpoints):
    """Plain HTTP is received with `readv` straight into the blocks: a body whose bytes come a few
    at a time (each receive ending anywhere in a row, most of them waiting for bytes) fills a
    column block's rows exactly, and the bytes are counted once."""
    served.always = ("model.safetensors", "dribble")
    directory = gpt2_checkpoints[0]["lm"]
    with port.open_checkpoint(f"{server.base}/lm") as ckpt, port.open_checkpoint(directory) as local:
        key = "transformer.h.0.mlp.c_fc.weight"
        rows, cols = local.tensors[key].shape
        region = ((1, rows - 1), (0, cols))  # one range of the file; its rows land apart in `out`
        wide = np.full((rows - 2, cols + 5), -1.0, np.float32)
        out = wide[:, 2 : 2 + cols]
        before = ckpt.bytes_read
        ckpt.read(key, region, out=out)
        np.testing.assert_array_equal(out, local.read(key, region))
        assert (wide[:, :2] == -1).all() and (wide[:, 2 + cols :] == -1).all()
        assert ckpt.bytes_read - before == (rows - 2) * cols * 4
    assert served.served_faults == {"dribble": 1}  # one request, its answer in odd bits


def test_parts_are_copied_to_their_pieces():
    """`_Ranges.scatter`: each range's bytes, found at its offset in a multipart body, go to its
    pieces: equal rows of two blocks alternating across parts (gathered, then strided), and
    pieces of unequal lengths one by one; nothing else is written."""
    rng = np.random.default_rng(0)
    body = rng.integers(0, 255, 4000, dtype=np.uint8)
    for width, counts in [(8, [2, 2, 2, 2, 2]), (8, [1, 3, 1]), (5, [1, 1])]:
        a, b = np.full(200, 7, np.uint8), np.full(200, 9, np.uint8)
        dests = [(a if i % 2 == 0 else b)[(i // 2) * 16 :][:width] for i in range(sum(counts))]
        lengths = [width] * len(dests)
        if counts == [1, 3, 1]:
            lengths[1] = 3  # unequal: copied piece by piece
            dests[1] = dests[1][:3]
        firsts = np.concatenate(([0], np.cumsum(counts)))
        offsets = np.array([37 + 300 * i + (i % 3) for i in range(len(counts))])  # part heads of varying length
        starts = np.arange(len(counts)) * 1000
        ranges = _ranges.Ranges(
            starts,
            starts + np.add.reduceat(lengths, firsts[:-1]),
            firsts,
            _ranges.iovecs([d.ctypes.data for d in dests], lengths),
        )
        want_a, want_b = a.copy(), b.copy()
        for r in range(len(counts)):
            at = offsets[r]
            for i in range(firsts[r], firsts[r + 1]):
                target = want_a if i % 2 == 0 else want_b
                target[(i // 2) * 16 :][: lengths[i]] = body[at : at + lengths[i]]
                at += lengths[i]
        ranges.scatter(body, offsets)
        np.testing.assert_array_equal(a, want_a)
        np.testing.assert_array_equal(b, want_b)


def test_small_tensors_read_whole_share_a_request(server, served, gpt2_checkpoints, monkeypatch):
    """`expect`: small tensors a load reads whole that lie end to end in the file (a layer's norms
    and biases) are fetched in one request by the first read of one of them; each byte is still
    fetched once, a later read of one asks for its own bytes, and tensors not expected whole, or
    large, are read as before."""
    monkeypatch.setattr(_remote, "NEIGHBOURS", 60_000)  # the test model is small: several groups
    directory = gpt2_checkpoints[0]["lm"]
    with port.open_checkpoint(f"{server.base}/lm") as ckpt, port.open_checkpoint(directory) as local:
        infos = sorted(ckpt.tensors.values(), key=lambda i: i.offset)
        small = [i.key for i in infos if i.nbytes < _remote.NEIGHBOUR and i.shape and i.shape[0] > 1]
        whole = {k: {tuple((0, n) for n in ckpt.tensors[k].shape)} for k in small}
        first_row = {k: {((0, 1),) + r[1:] for r in whole[k]} for k in small}
        partial, small = small[:3], small[3:]
        ckpt.expect({**whole, **{k: first_row[k] for k in partial}})  # 3 read in part: never grouped
        assert not set(partial) & set(ckpt._together)
        rest = {k: {((1, ckpt.tensors[k].shape[0]),) + r[1:] for r in whole[k]} for k in small}
        ckpt.expect({k: first_row[k] | rest[k] for k in small})  # whole, in two regions: grouped
        assert set(ckpt._together) <= set(small) and len(ckpt._together) > len(small) // 2
        groups = {id(g): g for g in ckpt._together.values()}.values()
        assert len(groups) >= 2 and all(len(g.keys) > 1 and g.stop - g.start <= _remote.NEIGHBOURS for g in groups)
        for g in groups:  # end to end in the file, and nothing else
            members = sorted((ckpt.tensors[k] for k in g.keys), key=lambda i: i.offset)
            assert members[0].offset == g.start and members[-1].offset + members[-1].nbytes == g.stop
            assert all(a.offset + a.nbytes == b.offset for a, b in zip(members, members[1:]))
        before, asked = ckpt.bytes_read, served.requests
        for key in small:
            whole = tuple((0, n) for n in ckpt.tensors[key].shape)
            np.testing.assert_array_equal(ckpt.read(key, whole), local.read(key, whole))
        alone = [k for k in small if k not in ckpt._together]
        assert served.requests - asked == len(groups) + len(alone)
        assert ckpt.bytes_read - before == sum(ckpt.tensors[k].nbytes for k in small)
        key = next(iter(ckpt._together))
        asked = served.requests
        ckpt.read(key, ((0, 1),) + tuple((0, n) for n in ckpt.tensors[key].shape[1:]))  # again, a part: its own
        assert served.requests - asked == 1


def test_groups_keep_every_limit():
    """`_grouped`: small ranges share a request up to MAX_PARTS, the scratch and the header's
    length; a large range and a range continuing the one before start groups of their own."""
    starts = np.arange(0, 1000 * 100, 100)
    ranges = _ranges.Ranges(starts, starts + 10, np.arange(len(starts) + 1), _ranges.iovecs(starts, starts * 0 + 10))
    groups = _http.grouped(ranges)
    assert groups[0] == (0, _http.MAX_PARTS) and groups[-1][1] == 1000
    assert all(b - a <= _http.MAX_PARTS for a, b in groups) and all(
        b == c for (_, b), (c, _) in zip(groups, groups[1:])
    )
    for a, b in groups:
        assert len(",".join(f"{s}-{s + 9}" for s in starts[a:b].tolist())) <= _http.MAX_RANGE_HEADER
    starts, stops = np.array([0, 100, 200, 210, 1000]), np.array([10, 110, 210, 220, 1000 + _http.PART])
    ranges = _ranges.Ranges(starts, stops, np.arange(6), _ranges.iovecs(starts, stops - starts))
    assert _http.grouped(ranges) == [(0, 3), (3, 4), (4, 5)]


@pytest.mark.parametrize(
    "blocks, rows, width, shuffle",
    [
        (2, 50, 24, False),  # two column blocks: rows alternate A, B, A, B
        (3, 7, 8, False),  # three
        (1, 9, 16, False),  # one block's rows, strided in its buffer
        (2, 6, 8, True),  # no pattern: piece by piece
        (70, 3, 4, False),  # more blocks than _MAX_INTERLEAVE: piece by piece
    ],
)
def test_scatter_puts_every_byte_where_its_piece_says(blocks, rows, width, shuffle):
    """`_scatter` (an HTTP answer's small pieces out of the scratch buffer): each block gets its rows,
    as strided copies when the rows interleave regularly, else one by one, and nothing else is written."""
    rng = np.random.default_rng(blocks * rows)
    outs = [np.full((rows, width + 3), 7, np.uint8) for _ in range(blocks)]  # 3 bytes of padding per row
    pieces = [(outs[b][r].ctypes.data, width) for r in range(rows) for b in range(blocks)]
    expected = [out.copy() for out in outs]
    source = rng.integers(0, 255, len(pieces) * width, dtype=np.uint8)
    order = rng.permutation(len(pieces)) if shuffle else np.arange(len(pieces))
    pieces = [pieces[i] for i in order]
    for i, (address, n) in enumerate(pieces):
        b, r = next((b, r) for b in range(blocks) for r in range(rows) if outs[b][r].ctypes.data == address)
        expected[b][r, :n] = source[i * width : (i + 1) * width]
    _ranges.scatter(source.ctypes.data, _ranges.iovecs([a for a, _ in pieces], [n for _, n in pieces]))
    for out, want in zip(outs, expected):
        np.testing.assert_array_equal(out, want)


# ---------------------------------------------------------------------------- S3 (moto)


@pytest.fixture(scope="module")
def s3(gpt2_checkpoints):
    """A moto S3 server on 127.0.0.1 holding the GPT-2 checkpoints under s3://models/; counts GET bodies."""
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port_number = server.get_host_and_port()
    counter = {"sent": 0}
    app = server._server.app

    def counting(environ, start_response):  # bytes of every response body
        for chunk in app(environ, start_response):
            counter["sent"] += len(chunk)
            yield chunk

    server._server.app = counting
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port_number}",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir("models")
        for name in ("lm", "sharded"):
            fs.put(f"{gpt2_checkpoints[0][name]}/", f"models/{name}/", recursive=True)
        yield counter, fs
    server.stop()


def test_s3_load_matches_local_moves_the_file_once_and_retries(s3, gpt2_checkpoints, monkeypatch):
    counter, fs = s3
    directory = gpt2_checkpoints[0]["sharded"]
    monkeypatch.setattr(_transport, "BACKOFF", 0.001)
    monkeypatch.setattr(_fsspec, "MIN_SCRATCH", 4096)  # scratch bounded by half the largest tensor
    counter["sent"] = 0
    run = port.convert("s3://models/sharded", mesh="4x2")
    assert_same(run.model, port.load(directory, mesh="4x2"))
    assert counter["sent"] <= 1.05 * files_size(directory), (counter["sent"], files_size(directory))

    real, seen, held = _fsspec.FsspecTransport._fetch, set(), {"now": 0, "most": 0}
    lock = threading.Lock()

    def flaky(self, path, start, stop):  # the first try of each range fails, one way or another
        with lock:
            first = (path, start) not in seen
            seen.add((path, start))
            held["now"] += stop - start
            held["most"] = max(held["most"], held["now"])
        try:
            if first and len(seen) % 3 == 0:
                raise ConnectionResetError("connection reset by peer")
            data = real(self, path, start, stop)
            return data[:-1] if first and len(seen) % 3 == 1 else data
        finally:
            with lock:
                held["now"] -= stop - start

    monkeypatch.setattr(_fsspec.FsspecTransport, "_fetch", flaky)
    run = port.convert("s3://models/lm", mesh="4x2")
    assert_same(run.model, port.load(gpt2_checkpoints[0]["lm"], mesh="4x2"))
    assert len(seen) > 20  # about a third of the ranges failed once each way
    with port.open_checkpoint(gpt2_checkpoints[0]["lm"]) as local:
        largest = max(t.nbytes for t in local.tensors.values())
    assert held["most"] <= max(4096, largest // 2) < 1.5 * largest


def test_s3_failures_name_the_url(s3, monkeypatch):
    counter, fs = s3
    monkeypatch.setattr(_transport, "BACKOFF", 0.001)
    with pytest.raises(port.CheckpointError, match=r"^s3://models/nothing: no config.json$"):
        port.open_checkpoint("s3://models/nothing")
    fs.copy("models/lm/", "models/gone/", recursive=True)
    with port.open_checkpoint("s3://models/gone") as ckpt:
        fs.rm("models/gone/model.safetensors")
        with pytest.raises(port.CheckpointError) as caught:
            ckpt.read("transformer.wte.weight", ((0, 2), (0, 64)))
    assert re.match(
        r"^s3://models/gone/model\.safetensors: bytes \d+-\d+ \(tensor 'transformer\.wte\.weight'\): "
        r"not found$",
        str(caught.value),
    ), caught.value


# ---------------------------------------------------------------------------- two processes


@pytest.mark.slow
def test_two_processes_each_transfer_their_share(server, served, gpt2_checkpoints, tmp_path, record_property):
    directory, url = gpt2_checkpoints[0]["sharded"], f"{server.base}/sharded"
    address = f"127.0.0.1:{free_port()}"
    command = [
        sys.executable,
        "-m",
        "port",
        "convert",
        url,
        "--mesh",
        "4x2",
        "--out",
        str(tmp_path / "out"),
        "--report",
        str(tmp_path / "run.json"),
    ]
    run_processes(lambda i: command + ["--coordinator", address, "--num-processes", "2", "--process-id", str(i)])
    reports = [json.loads((tmp_path / f"run.{i}.json").read_text()) for i in range(2)]
    with port.open_checkpoint(url) as ckpt:
        opening = ckpt.bytes_read  # config.json, the index and the headers: each process reads them
    shares = expected_reads(directory, port.mesh_shape("4x2"))
    moved = [r["bytes_read"] for r in reports]
    over = [r["bytes_over_read"] for r in reports]
    record_property("bytes per process", moved)
    print(
        f"\nremote, 2 processes x 4 devices: bytes transferred {moved} and over-read {over}, shares {shares}, "
        f"opening {opening}, files {files_size(directory)}, {served.requests} requests"
    )
    assert moved == [share + opening for share in shares]  # the bytes each needed; the gaps apart
    assert served.sent == sum(moved) + sum(over) + opening
    # Each process's rows alternate with the other's: one request spans them (max_over_read 2 by
    # default), the other's discarded: at most as many bytes as its own.
    assert all(0 < o <= share for o, share in zip(over, shares)) and served.requests < 200, (over, served.requests)
    assert all(m < 0.6 * files_size(directory) for m in moved)
    assert_same(port.restore(tmp_path / "out", port.make_mesh("4x2")), port.load(directory, mesh="4x2"))


@pytest.mark.slow
def test_a_whole_run_deadline_stops_a_slow_remote_convert(server, served, tmp_path):
    """Issue 21 row 7: `--deadline` bounds the whole run, whatever each request does: a server that
    answers every request, slowly (2 s each, within every per-request limit; opening alone takes
    four in turn, 8 s, so the run cannot finish within the deadline however fast this machine), is
    stopped at the deadline with one line and exit 1, and nothing is left at --out or beside it.
    (The deadline leaves room for a slow start on a busy machine: the run must have been talking to
    the server when it was stopped.)"""
    from helpers import one_line, run_port

    served.delay = 2.0
    began = time.monotonic()
    result = run_port("convert", f"{server.base}/lm", "--out", tmp_path / "out", "--deadline", "6")
    took = time.monotonic() - began
    one_line(result, "--deadline 6: the run had not finished after 6 s; stopped, and what it was writing removed")
    assert took < 30 and served.requests >= 1
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.slow
def test_deadline_must_be_a_positive_number(tmp_path):
    from helpers import run_port, usage_error

    for value in ("0", "-3", "nan", "inf", "soon"):
        result = run_port("convert", EXAMPLE, "--out", tmp_path / "out", "--deadline", value)
        usage_error(result, "Invalid value for '--deadline': expected a number of seconds > 0")


@pytest.mark.slow
def test_a_server_claiming_a_huge_checkpoint_is_refused_before_its_data(tmp_path):
    """Issue 21 row 8: a server states a 234 GB file (gpt-oss-120b's real shapes, served from a
    sparse file whose data is a hole): the plan's memory is checked against the host before any
    tensor byte is asked for, and the run is one line, exit 1, with nothing at --out."""
    from test_gpt_oss import GPT_OSS_120B, gpt_oss_shapes

    from helpers import one_line, run_port, write_sparse_checkpoint

    root = tmp_path / "served"
    root.mkdir()
    assert write_sparse_checkpoint(root / "big", GPT_OSS_120B, gpt_oss_shapes(GPT_OSS_120B)) > 230e9
    httpd = start_server(root)
    try:
        result = run_port("convert", f"{httpd.base}/big", "--out", tmp_path / "out")
        one_line(result, "its blocks take 233.7 GB of host memory (1 CPU device x 233.7 GB each), more than the")
        assert httpd.state.sent < 2 << 20, httpd.state.sent  # config.json and the header, no tensor data
    finally:
        httpd.shutdown()
    assert not (tmp_path / "out").exists()
