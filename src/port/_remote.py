"""Remote checkpoints: a checkpoint directory named by a URL, read in place by byte range.

`http(s)://host/dir`, `hf://org/name[@revision]` (the Hub, without its local cache),
`s3://bucket/prefix`, `gs://bucket/prefix`, and any other file system fsspec knows.
Nothing is downloaded whole: `config.json` and the shard index are read bounded in
size; each safetensors file costs two small range requests (its 8-byte header length,
with the file's size, then the header), validated by the same code as a local file;
and `read_into` fetches exactly the byte ranges of the requested regions (`runs()`),
runs that lie end to end merged into one request, at most `requests` requests in
flight, over HTTP straight into the destination buffers.

Transient failures (HTTP 408/429/5xx, a connection dropped mid-body, a timeout, a
body shorter than asked) are retried with exponential backoff, `ATTEMPTS` attempts
in all (a few seconds); a short body is never taken as data. What still fails is one
`CheckpointError` naming the file's URL and the byte range. `bytes_read` counts the
bytes transferred (headers, config, retried partial bodies included).

Credentials come from the usual places: the Hub token (`HF_TOKEN`, `hf auth login`),
sent to the Hub's host only; the cloud SDKs' environment (`AWS_*`, `FSSPEC_S3_*`,
Google's application default credentials); or a URL's user info (HTTP basic auth).
The URLs this module prints or records are `redact`ed: no user info, no query (`shown`
does the same for the command line's messages).

```python
ckpt = open_remote("https://example.com/models/gpt2")
str(ckpt.tensors["wte.weight"].file)     # 'https://example.com/models/gpt2/model.safetensors'
ckpt.read("wte.weight", ((0, 10), (0, 768)))
ckpt.bytes_read                           # config + headers + 30720
```
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import functools
import http
import http.client
import os
import random
import re
import select
import ssl
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urljoin, urlsplit, urlunsplit

import numpy as np

from ._text import described, one_line, quoted
from ._errors import CheckpointError
from ._source import (
    _INDEX,
    _IOV_MAX,
    _MAX_RUNS,
    _SINGLE,
    MAX_CONFIG,
    MAX_HEADERS,
    MAX_INDEX,
    MAX_SHARDS,
    Checkpoint,
    Region,
    TensorInfo,
    _check_out,
    _load_json,
    _pieces,
    _plain_name,
    header_length_of,
    header_tensors,
    libc_function,
    parse_header,
    runs,
    shard_names_in,
)

ATTEMPTS = 6
"""Tries of one request before its failure is reported."""
BACKOFF = 0.1
"""Seconds before the first retry; doubled each time, with jitter (about 3 s in all)."""
TIMEOUT = 15.0
"""Seconds a connection may wait for the server (connect, or the next bytes)."""
MIN_RATE = 64 * 2**10
"""Bytes per second below which a request that has run `GRACE` seconds is given up and retried."""
GRACE = 10.0
"""Seconds a request may take before `MIN_RATE` applies (a connection's start, a slow first byte)."""
REQUESTS = 16
"""Range requests in flight at once, per checkpoint."""
HTTP_CHUNK = 16 * 2**20
"""Bytes one HTTP request asks for at most."""
DIRECT = 256 * 2**10
"""Over TLS, an answer's piece this large is read straight into its destination; smaller ones through `SCRATCH`
(plain HTTP reads every piece straight into its destination, with `readv`)."""
SCRATCH = 2**20
"""Bytes of each request thread's buffer: a TLS answer's small pieces, a whole multipart answer."""
MAX_PARTS = 128
"""Byte ranges one HTTP request asks for at most (`Range: bytes=a-b,c-d,...`, answered part by part)."""
PART = 64 * 2**10
"""A range smaller than this may share a request with others (larger ones are a request each)."""
PART_HEADERS = 256
"""Bytes of a multipart answer's delimiter and headers allowed for each part (nginx: about 100)."""
MAX_RANGE_HEADER = 4000
"""Characters of a `Range` header at most (servers take about 8 KB of request headers)."""
NEIGHBOUR = 256 * 2**10
"""A tensor read whole and smaller than this may share a request with its neighbours in the file."""
NEIGHBOURS = 4 * 2**20
"""Bytes of neighbouring small tensors one request asks for at most."""
SCRATCH_CHUNK = 8 * 2**20
"""Bytes one fsspec request asks for at most (its answer is copied into the destination)."""
MIN_SCRATCH = 4 * 2**20
"""Scratch memory fsspec answers may always take; else half the largest tensor."""
MAX_REDIRECTS = 5

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_REPO = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)\s*$", re.IGNORECASE)
_REDIRECTS = {301, 302, 303, 307, 308}
_RETRIED = {408, 425, 429}
_DEFAULT_PORTS = {"http": 80, "https": 443}
_PERMANENT = {  # the cloud SDKs' errors that no retry mends (anything else an fsspec call raises is retried)
    "NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError", "RefreshError",
    "NoRegionError", "ParamValidationError", "InvalidRegionError",
}
_T = TypeVar("_T")


# ---------------------------------------------------------------------------- URLs


def is_url(model: Any) -> bool:
    """Whether `model` is a URL (`scheme://...`) rather than a local path or a repo id.

    ```python
    is_url("s3://bucket/gpt2"), is_url("gpt2"), is_url("ckpt/gpt2")   # True, False, False
    ```
    """
    return isinstance(model, str) and _SCHEME.match(model) is not None


def redact(url: str) -> str:
    """`url` without its credentials: no user info, no query, no fragment (nor trailing `/`).

    ```python
    redact("https://me:secret@host/dir/?token=x")   # 'https://host/dir'
    redact("hf://org/name@v1")                       # 'hf://org/name@v1' (a revision, not a user)
    redact("hf://me:secret@org/name")                # 'hf://org/name' (a repo id has no ':')
    ```
    """
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed IPv6 bracket: show the scheme alone
        return url.partition("://")[0] + "://..."
    user_info = parts.scheme.lower() != "hf" or ":" in parts.netloc.partition("@")[0]
    netloc = parts.netloc.rpartition("@")[2] if user_info else parts.netloc
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")


def shown(model: Any) -> str:
    """`model` as port may print or record it: a URL by `redact`, anything else as given.

    ```python
    shown("https://me:secret@host/gpt2"), shown("gpt2")   # ('https://host/gpt2', 'gpt2')
    ```
    """
    return redact(model) if is_url(model) else str(model)


def _scrub(text: str) -> str:
    """A library's error text with any URL's user info and query removed, on one line."""
    text = re.sub(r"(\w+://)[^/@\s]*@", r"\1", text)
    return one_line(re.sub(r"\?[^\s'\"]*", "", text), 200)


def _reason(error: BaseException) -> str:
    """An exception as a few words: its type, and its scrubbed first line."""
    return _scrub(described(error))


# ---------------------------------------------------------------------------- failures


class _Transient(Exception):
    """A failure worth retrying (the message says what happened)."""


class _Permanent(Exception):
    """A failure no retry will mend."""


class _Missing(_Permanent):
    """The file is not there."""


class _OneRangeOnly(Exception):
    """The server answered a request for several ranges otherwise than part by part."""


def retried(what: str, attempt: Callable[[], _T]) -> _T:
    """`attempt()`, retried with exponential backoff while it fails transiently.

    Failures become one `CheckpointError` line: `what` (the URL and byte range), then why.

    ```python
    retried("https://host/m.safetensors: bytes 0-7", lambda: transport.start("m.safetensors"))
    ```
    """
    for i in range(ATTEMPTS):
        try:
            return attempt()
        except _Transient as e:
            last = e
            if i + 1 < ATTEMPTS:
                time.sleep(BACKOFF * 2**i * random.uniform(0.5, 1.0))
        except _Permanent as e:
            raise CheckpointError(f"{what}: {e}") from None
    raise CheckpointError(f"{what}: {last} (gave up after {ATTEMPTS} attempts)")


# ---------------------------------------------------------------------------- files


@dataclass(frozen=True)
class RemoteFile:
    """A remote file, as `TensorInfo.file` names it: its URL (no credentials) and size.

    `name` is the plain file name (as a local path's); `str()` is the URL.

    ```python
    RemoteFile("s3://bucket/gpt2/model.safetensors", "model.safetensors", 548105171).name
    ```
    """

    url: str
    name: str
    size: int
    etag: str | None = None

    def __str__(self) -> str:
        return self.url


def _view(address: int, length: int) -> memoryview:
    """A writeable byte view of `length` bytes of memory at `address` (a buffer of the caller's)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


class _Budget:
    """Bytes of scratch memory requests may hold at once: `take(n)` waits until `n` are free."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free = capacity
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def take(self, n: int) -> Iterator[None]:
        n = min(n, self.capacity)
        with self._changed:
            self._changed.wait_for(lambda: self._free >= n)
            self._free -= n
        try:
            yield
        finally:
            with self._changed:
                self._free += n
                self._changed.notify_all()


# ---------------------------------------------------------------------------- transports


class Transport:
    """How one kind of URL is read: small whole files, a file's first bytes and size, byte ranges.

    Methods raise `_Transient`, `_Permanent` or `_Missing`; `retried` turns them into
    one line. Every byte received is passed to `count`.
    """

    display: str
    count: Callable[[int], None] = staticmethod(lambda n: None)
    sent = 0
    """Requests sent so far (retries and redirects included)."""

    @property
    def chunk(self) -> int:
        """Bytes one request asks for at most."""
        return HTTP_CHUNK

    def url(self, name: str) -> str:
        """The URL of file `name` as port shows it (no credentials)."""
        return f"{self.display}/{name}"

    def small(self, name: str, limit: int, what: str) -> bytes:
        """The whole of a small file, refused unread past `limit` bytes."""
        raise NotImplementedError

    def start(self, name: str) -> tuple[bytes, int, str | None]:
        """A file's first (up to) 8 bytes, its size and its ETag if the server gives a strong one."""
        raise NotImplementedError

    def read(self, file: RemoteFile, start: int, pieces: np.ndarray) -> None:
        """Fill `pieces` (an `iovecs` array: the caller's memory, in order) with the file's bytes from `start` on."""
        raise NotImplementedError

    multipart = False
    """Whether `read_parts` may be asked for several ranges in one request (HTTP, until a server declines)."""

    def read_parts(self, file: RemoteFile, ranges: _Ranges) -> None:
        """Fill several ranges' pieces from one request; `_OneRangeOnly` where the server will not."""
        raise _OneRangeOnly

    def listing(self) -> list[str] | None:
        """The directory's file names, or None where the protocol cannot list (HTTP)."""
        return None

    def setup(self, largest: int) -> None:
        """Told the largest tensor's size once the headers are read."""

    def close(self) -> None:
        """Release connections."""


def _phrase(status: int) -> str:
    try:
        return f"HTTP {status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"HTTP {status}"


def _content_range(value: str | None) -> tuple[int | None, int | None, int | None] | None:
    """`Content-Range: bytes A-B/TOTAL` as (A, B, TOTAL); None where absent or malformed."""
    match = _CONTENT_RANGE.match(value or "")
    if not match:
        return None
    a, b, total = match.groups()
    return (
        None if a is None else int(a), None if b is None else int(b), None if total == "*" else int(total)
    )


def _receive(response: http.client.HTTPResponse, view: memoryview) -> int:
    """Up to `len(view)` body bytes into `view` with at most one receive: `readinto1` on the
    response's buffered socket itself (`HTTPResponse.readinto1` reads into a new bytes object,
    then copies), the response's count of bytes to come kept as `HTTPResponse.readinto` keeps it."""
    if response.chunked or response.fp is None or response.length is None:
        return response.readinto1(view)
    if len(view) > response.length:
        view = view[: response.length]
    n = response.fp.readinto1(view)
    response.length -= n
    return n


_MAX_INTERLEAVE = 64  # blocks whose rows alternate in one request that `_scatter` copies as strided arrays
_READV = libc_function("readv", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int])


def iovecs(addresses: np.ndarray | Sequence[int], lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """Pieces of memory as one answer fills them, in order: a C-contiguous uint64 array of
    (address, length) rows, a `struct iovec` each (what `readv` takes).

    ```python
    iovecs([out.ctypes.data], [out.nbytes])    # array([[140..., 4096]], dtype=uint64)
    ```
    """
    iov = np.empty((len(addresses), 2), np.uint64)
    iov[:, 0], iov[:, 1] = addresses, lengths
    return iov


def _scatter(source: int, pieces: np.ndarray) -> None:
    """Copy the bytes at `source`, in order, to `pieces` (an `iovecs` array).

    The rows of column blocks arrive interleaved (block A's row, block B's row, A's next
    row, ...): equal pieces whose destinations advance by one stride every `k` pieces are
    `k` strided copies, each one numpy assignment of a [rows, length] array, not one call
    per row. Anything else is copied piece by piece.
    """
    n = len(pieces)
    if n > 2:
        addresses, lengths = pieces[:, 0].astype(np.int64), pieces[:, 1]
        length = int(lengths[0])
        k = _interleave(addresses) if (lengths == lengths[0]).all() else None
        if k is not None:
            for r in range(min(k, n)):
                rows = addresses[r::k]
                stride = int(rows[1] - rows[0]) if len(rows) > 1 else length
                target = _strided(int(rows[0]), len(rows), length, stride)
                target[...] = _strided(source + r * length, len(rows), length, k * length)
            return
    for address, size in pieces.tolist():
        ctypes.memmove(address, source, size)
        source += size


class _Body:
    """An answer's bytes counted as they come: each receive passed to `count`, and the rate
    checked (a body that ends early, or comes slower than `MIN_RATE` once `GRACE` has
    passed, is transient)."""

    def __init__(self, wanted: int, count: Callable[[int], None]):
        self.wanted, self.received, self._count, self._began = wanted, 0, count, time.monotonic()

    def got(self, n: int) -> None:
        if not n:
            raise _Transient(f"the body ended after {self.received} of {self.wanted} bytes")
        self.received += n
        self._count(n)
        elapsed = time.monotonic() - self._began
        if elapsed > GRACE and self.received < MIN_RATE * elapsed and self.received < self.wanted:
            raise _Transient(
                f"{self.received} of {self.wanted} bytes in {elapsed:.1f} s, slower than {MIN_RATE // 1024} KiB/s"
            )

    def broke(self, error: BaseException) -> _Transient:
        return _Transient(f"the body broke off after {self.received} of {self.wanted} bytes ({_reason(error)})")


def _advance(iov: np.ndarray, first: int, count: int, got: int) -> int:
    """`got` bytes landed in `iov[first:first + count]`: the index of the first piece not
    yet full, that piece's row moved past the bytes it already has."""
    done = np.cumsum(iov[first : first + count, 1])
    full = int(np.searchsorted(done, got, side="right"))
    used = got - (int(done[full - 1]) if full else 0)
    if used:
        iov[first + full, 0] += np.uint64(used)
        iov[first + full, 1] -= np.uint64(used)
    return first + full


def _readv(sock: Any, iov: np.ndarray, body: _Body) -> None:
    """Receive from the plain socket `sock` straight into the pieces of `iov` (advanced in
    place), `IOV_MAX` pieces a `readv`, the socket's timeout kept while waiting for bytes:
    the kernel copies each byte once, into its destination."""
    fd, timeout = sock.fileno(), sock.gettimeout()
    waiting = select.poll()
    waiting.register(fd, select.POLLIN)
    first = 0
    while first < len(iov):
        count = min(len(iov) - first, _IOV_MAX)
        got = _READV(fd, iov.ctypes.data + first * iov.strides[0], count)
        if got < 0:
            code = ctypes.get_errno()
            if code in (errno.EAGAIN, errno.EWOULDBLOCK):  # a socket with a timeout is non-blocking
                if not waiting.poll(None if timeout is None else timeout * 1000):
                    raise body.broke(TimeoutError("timed out"))
                continue
            if code == errno.EINTR:
                continue
            raise body.broke(OSError(code, os.strerror(code)))
        body.got(got)
        first = _advance(iov, first, count, got)


def _held(response: Any, iov: np.ndarray, body: _Body) -> int:
    """Copy the body bytes the response's buffered reader already holds (read with the
    head; one receive if it holds none) into the first pieces of `iov`, advanced past
    them: the index of the first piece not yet full."""
    held = len(response.fp.peek(1)[: body.wanted])
    data = response.fp.read(held) if held else b""
    body.got(len(data))
    reached = iov[: len(data) + 1].copy()  # the pieces these bytes reach, as they were
    first = _advance(iov, 0, len(reached), len(data))
    if first < len(iov):  # the piece not yet full: only its part these bytes fill (maybe none)
        reached[first, 1] -= iov[first, 1]
    filled = reached[: first + 1]
    _scatter(np.frombuffer(data, np.uint8).ctypes.data, filled[filled[:, 1] > 0])
    return first


def _interleave(addresses: np.ndarray) -> int | None:
    """The smallest `k` (up to `_MAX_INTERLEAVE`) such that every `k`-th destination advances by one stride."""
    for k in range(1, min(_MAX_INTERLEAVE, len(addresses) - 1) + 1):
        steps = addresses[k:] - addresses[:-k]  # one stride for every k-th piece: k strided arrays
        if (steps == steps[0]).all() and steps[0] > 0:
            return k
    return None


def _strided(address: int, rows: int, length: int, stride: int) -> np.ndarray:
    """A [rows, length] uint8 array over memory at `address`, rows `stride` bytes apart."""
    span = (rows - 1) * stride + length
    flat = np.frombuffer(_view(address, span), np.uint8)
    return np.lib.stride_tricks.as_strided(flat, (rows, length), (stride, 1))


class HttpTransport(Transport):
    """HTTP(S) with the standard library's `http.client`: exact `Range` requests, the
    answer checked (`206`, `Content-Range`, `Content-Length`, size, ETag) and read with
    `readinto1` into the destination (small pieces through a scratch buffer); keep-alive connections, one per thread
    and host; redirects followed (credentials sent to the first host only).

    ```python
    t = HttpTransport("https://host/gpt2", lambda name: f"https://host/gpt2/{name}")
    t.start("model.safetensors")       # (b'...8 bytes', 548105171, '"etag"')
    ```
    """

    def __init__(self, display: str, locate: Callable[[str], str], auth: dict[str, str] | None = None):
        self.display = display
        self._locate = locate
        self._auth = auth or {}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()

    # connections

    def _connection(self, key: tuple[str, str, int], fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        pool = self._local.__dict__.setdefault("pool", {})
        if key in pool and not fresh:
            return pool[key], True
        if key in pool:
            self._drop(key, pool[key])
        scheme, host, port = key
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, port, timeout=TIMEOUT, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
        pool[key] = conn
        with self._lock:
            self._open.add(conn)
        return conn, False

    def _drop(self, key: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
        pool = self._local.__dict__.get("pool", {})
        if pool.get(key) is conn:
            del pool[key]
        with self._lock:
            self._open.discard(conn)
        conn.close()

    def close(self) -> None:
        with self._lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            conn.close()

    # one exchange

    def _send(self, key: tuple[str, str, int], target: str, headers: dict[str, str]) -> tuple[Any, Any]:
        """Send a GET and read the response's head; a pooled connection the server closed
        meanwhile is replaced once, at no cost to the retries."""
        for fresh in (False, True):
            conn, reused = self._connection(key, fresh)
            try:
                with self._lock:
                    self.sent += 1
                conn.request("GET", target, headers=headers)
                return conn.getresponse(), conn
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                self._drop(key, conn)
                if not reused:
                    raise _Transient(f"connection failed ({_reason(e)})") from None
            except (OSError, http.client.HTTPException) as e:
                self._drop(key, conn)
                raise _Transient(f"connection failed ({_reason(e)})") from None
        raise AssertionError("unreachable")

    def _get(self, name: str, headers: dict[str, str]) -> tuple[Any, Any, tuple[str, str, int]]:
        """GET file `name`, following redirects: (response, connection, connection key)."""
        url = self._locate(name)
        origin = None
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            scheme = parts.scheme.lower()
            if scheme not in _DEFAULT_PORTS or not parts.hostname:
                raise _Permanent("redirected to a URL that is not HTTP(S)")
            try:
                key = (scheme, parts.hostname, parts.port or _DEFAULT_PORTS[scheme])
            except ValueError:
                raise _Permanent("a URL with an invalid port") from None
            origin = origin or key
            sent = {"Accept-Encoding": "identity", "User-Agent": "port", **headers}
            if key == origin:
                sent.update(self._auth)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            response, conn = self._send(key, target, sent)
            location = response.getheader("Location")
            if response.status not in _REDIRECTS or not location:
                return response, conn, key
            self._drop(key, conn)  # the redirect's body is not read
            url = urljoin(url, location)
        raise _Permanent(f"more than {MAX_REDIRECTS} redirects")

    def _judge(self, response: Any, conn: Any, key: tuple[str, str, int]) -> None:
        """Accept 200/206; anything else drops the connection and says what it means."""
        status = response.status
        if status in (200, 206):
            encoding = (response.getheader("Content-Encoding") or "identity").strip().lower()
            if encoding != "identity":
                self._drop(key, conn)
                raise _Permanent(f"the server encoded the body ({quoted(encoding, 20)}), asked for identity")
            return
        self._drop(key, conn)
        if status in (404, 410):
            raise _Missing(f"not found ({_phrase(status)})")
        if status in (401, 403):
            raise _Permanent(f"access denied ({_phrase(status)}): check the credentials")
        if status in _RETRIED or status >= 500:
            raise _Transient(_phrase(status))
        raise _Permanent(_phrase(status))

    def _fill(self, response: Any, conn: Any, pieces: np.ndarray) -> None:
        """Read the body into `pieces` (an `iovecs` array), all of them.

        Over plain HTTP the socket is read with `readv` straight into the pieces (the bytes
        the response's reader took with the head copied first). Over TLS a piece of
        `DIRECT` bytes or more is read straight into its memory; runs of smaller ones (a
        column block's rows: a few KB each, interleaved with the other blocks') are read
        `SCRATCH` bytes at a time into this thread's scratch buffer and copied out. Each
        read is one receive, so the rate is checked as the bytes come (`_Body`).
        """
        lengths = pieces[:, 1]
        body = _Body(int(lengths.sum()), self.count)
        if not body.wanted:
            return
        sock = getattr(conn, "sock", None)
        if (_READV is not None and sock is not None and not isinstance(sock, ssl.SSLSocket)
                and not response.chunked and response.length is not None and body.wanted <= response.length):
            iov = np.array(pieces, np.uint64, order="C")
            try:
                first = _held(response, iov, body)
            except (OSError, http.client.HTTPException) as e:
                raise body.broke(e) from None
            _readv(sock, iov[first:], body)
            response.length -= body.wanted  # read past http.client: what it expects to come
            return

        def take(address: int, n: int) -> None:  # the next n body bytes into memory at address
            view, got = _view(address, n), 0
            while got < n:
                try:
                    k = _receive(response, view[got:])
                except (OSError, http.client.HTTPException) as e:
                    raise body.broke(e) from None
                body.got(k)
                got += k

        ends = np.concatenate(([0], np.cumsum(lengths)))
        large = np.flatnonzero(lengths >= DIRECT)
        i = 0
        while i < len(pieces):
            if lengths[i] >= DIRECT:
                take(int(pieces[i, 0]), int(lengths[i]))
                i += 1
                continue
            after = int(np.searchsorted(large, i))
            j = min(int(np.searchsorted(ends, ends[i] + SCRATCH, side="right")) - 1,  # what fits the scratch
                    int(large[after]) if after < len(large) else len(pieces))  # up to the next large piece
            scratch = self._scratch()
            take(scratch, int(ends[j] - ends[i]))
            _scatter(scratch, pieces[i:j])
            i = j

    def _scratch(self) -> int:
        """The address of this thread's `SCRATCH` bytes (kept for the thread's later requests)."""
        buffer = getattr(self._local, "scratch", None)
        if buffer is None:
            buffer = self._local.scratch = np.empty(SCRATCH, np.uint8)
        return buffer.ctypes.data

    def _finish(self, response: Any, conn: Any, key: tuple[str, str, int]) -> None:
        """The body must end where the range does; then the connection serves the next request."""
        if response.length is None and not response.isclosed():  # no Content-Length: see that it ends
            try:
                extra = response.read(1)
            except (OSError, http.client.HTTPException) as e:
                raise _Transient(f"the body did not end cleanly ({_reason(e)})") from None
            if extra:
                raise _Permanent("the server sent more bytes than the range asked for")
        response.close()  # read to its end: the connection may send the next request
        if response.will_close:
            self._drop(key, conn)

    # what a transport answers

    def small(self, name: str, limit: int, what: str) -> bytes:
        response, conn, key = self._get(name, {})
        try:
            self._judge(response, conn, key)
            length = response.getheader("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > limit:
                raise _Permanent(f"{int(length)} bytes, more than a {what} may have ({limit})")
            data = bytearray()
            while len(data) <= limit:
                try:
                    chunk = response.read(min(1 << 16, limit + 1 - len(data)))
                except (OSError, http.client.HTTPException) as e:
                    raise _Transient(f"the body broke off after {len(data)} bytes ({_reason(e)})") from None
                if not chunk:
                    break
                self.count(len(chunk))
                data += chunk
            if len(data) > limit:
                raise _Permanent(f"more than a {what} may have ({limit} bytes)")
            if length is not None and length.strip().isdigit() and len(data) != int(length):
                raise _Transient(f"the body ended after {len(data)} of {int(length)} bytes")
            self._finish(response, conn, key)
            return bytes(data)
        except BaseException:
            self._drop(key, conn)
            raise

    def start(self, name: str) -> tuple[bytes, int, str | None]:
        response, conn, key = self._get(name, {"Range": "bytes=0-7"})
        try:
            if response.status == 416:  # shorter than one byte asked for: an empty file
                found = _content_range(response.getheader("Content-Range"))
                self._drop(key, conn)
                return b"", (found[2] or 0) if found else 0, None
            self._judge(response, conn, key)
            first, last, size = self._answered(response)
            if first != 0 or last is None or last > 7 or last >= size:
                raise _Transient(f"asked for bytes 0-7, the server answered bytes {first}-{last}/{size}")
            prefix = np.empty(last + 1, np.uint8)
            self._fill(response, conn, iovecs([prefix.ctypes.data], [prefix.size]))
            self._finish(response, conn, key)
            return prefix.tobytes(), size, _strong(response.getheader("ETag"))
        except BaseException:
            self._drop(key, conn)
            raise

    def _answered(self, response: Any) -> tuple[int, int | None, int]:
        """(first, last, file size) of the answer to `Range: bytes=0-7`."""
        length = response.getheader("Content-Length")
        if response.status == 200:  # the whole file: fine only when it is that small
            if length is None or not length.strip().isdigit() or int(length) > 8:
                raise _Permanent(_NO_RANGES)
            return 0, int(length) - 1, int(length)
        found = _content_range(response.getheader("Content-Range"))
        if found is None or found[2] is None:
            raise _Permanent("the server does not give the file's size (Content-Range bytes A-B/SIZE)")
        return found

    def read(self, file: RemoteFile, start: int, pieces: np.ndarray) -> None:
        stop = start + int(pieces[:, 1].sum())
        response, conn, key = self._get(file.name, {"Range": f"bytes={start}-{stop - 1}"})
        try:
            self._judge(response, conn, key)
            self._check_range(response, file, start, stop)
            self._fill(response, conn, pieces)
            self._finish(response, conn, key)
        except BaseException:
            self._drop(key, conn)
            raise

    multipart = True  # until a server answers several ranges otherwise than part by part

    def read_parts(self, file: RemoteFile, ranges: _Ranges) -> None:
        """Several ranges of one file in one request, each filling its pieces.

        The server's `multipart/byteranges` answer (at most `SCRATCH` bytes: `_grouped`
        keeps the ranges' total under it) is received whole into this thread's scratch
        buffer, its parts found there (`part_offsets`: each part's `Content-Range` the
        next range asked for) and copied out. A server that answers otherwise (the whole
        file, one range, ranges merged, a longer answer) is not asked for several ranges
        again: `_OneRangeOnly`, and the caller asks range by range.
        """
        spans = list(zip(ranges.starts.tolist(), ranges.stops.tolist()))
        header = "bytes=" + ",".join(f"{start}-{stop - 1}" for start, stop in spans)
        response, conn, key = self._get(file.name, {"Range": header})
        try:
            self._judge(response, conn, key)
            boundary = _boundary(response.getheader("Content-Type"))
            length = response.length
            if response.status != 206 or boundary is None or length is None or length > SCRATCH:
                self.multipart = False
                self._drop(key, conn)
                raise _OneRangeOnly
            _check_etag(response, file)
            scratch = self._scratch()
            self._fill(response, conn, iovecs([scratch], [length]))
            self._finish(response, conn, key)
        except BaseException:
            self._drop(key, conn)
            raise
        body = np.frombuffer(_view(scratch, length), np.uint8)
        offsets = part_offsets(body.tobytes(), boundary, spans, file.size)
        self.count(int((ranges.stops - ranges.starts).sum()) - length)  # the file's bytes, not the parts' framing
        ranges.scatter(body, np.array(offsets, np.int64))

    def _check_range(self, response: Any, file: RemoteFile, start: int, stop: int) -> None:
        """The answer is bytes [start, stop) of the same file, announced so."""
        if response.status == 200:
            if not (start == 0 and stop == file.size):
                raise _Permanent(_NO_RANGES)
        else:
            found = _content_range(response.getheader("Content-Range"))
            if found is None:
                raise _Transient("a partial answer without a valid Content-Range")
            first, last, total = found
            if total is not None and total != file.size:
                raise _Permanent(f"changed since its header was read (now {total} bytes, was {file.size})")
            if (first, last) != (start, stop - 1):
                raise _Transient(f"the server answered bytes {first}-{last}")
        length = response.getheader("Content-Length")
        if length is not None and (not length.strip().isdigit() or int(length) != stop - start):
            raise _Transient(f"the server announced {quoted(length.strip(), 20)} bytes of {stop - start}")
        _check_etag(response, file)


_NO_RANGES = "the server does not honour Range requests (it answered with the whole file); port reads remote files by byte range"


def part_offsets(body: bytes, boundary: bytes, spans: Sequence[tuple[int, int]], size: int) -> list[int]:
    """Where each span's bytes (start, stop) start in a `multipart/byteranges` body: its parts
    in order, each part's `Content-Range` the next span asked for, of a file of `size` bytes,
    and the closing delimiter after the last; anything else is transient (never data).

    A part whose head is the previous part's with the next span's numbers in its
    `Content-Range` (servers write every part's head alike) is taken by one comparison;
    any other is read line by line.

    ```python
    part_offsets(b"\\r\\n--B\\r\\nContent-Range: bytes 0-3/9\\r\\n\\r\\nabcd\\r\\n--B--\\r\\n", b"B", [(0, 4)], 9)
    # [37]
    ```
    """
    delimiter = b"--" + boundary
    offsets, at = [], 0
    alike: tuple[bytes, bytes] | None = None  # the last head, cut around its numbers `first-last`
    for start, stop in spans:
        numbers = f"{start}-{stop - 1}".encode()
        if alike is not None and body.startswith(head := alike[0] + numbers + alike[1], at):
            offsets.append(at + len(head))
            at += len(head) + stop - start
            if at > len(body):
                raise _Transient("a multipart answer that ends within a part")
            continue
        begins = body.find(delimiter, at, at + 64)
        if begins < 0 or body[at:begins].strip():
            raise _Transient("a multipart answer without the delimiter where a part should begin")
        ends = body.find(b"\r\n\r\n", begins, begins + 4096)
        if ends < 0:
            raise _Transient("a multipart answer's part without the end of its headers")
        found, cut, line_at = None, None, begins + len(delimiter)
        for line in body[begins + len(delimiter) : ends].split(b"\r\n"):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-range":
                found, k = _content_range(value), line.find(numbers, len(name) + 1)
                cut = line_at + k if k >= 0 else None
            line_at += len(line) + 2
        if found is None:
            raise _Transient("a multipart answer's part without a valid Content-Range")
        first, last, total = found
        if total is not None and total != size:
            raise _Permanent(f"changed since its header was read (now {total} bytes, was {size})")
        if (first, last) != (start, stop - 1):
            raise _Transient(f"the server answered bytes {first}-{last} for {start}-{stop - 1}")
        alike = None if cut is None else (body[at:cut], body[cut + len(numbers) : ends + 4])
        offsets.append(ends + 4)
        at = ends + 4 + (stop - start)
        if at > len(body):
            raise _Transient("a multipart answer that ends within a part")
    if body[at:].strip() != delimiter + b"--":
        raise _Transient("a multipart answer without its closing delimiter where the last part ends")
    return offsets


_BOUNDARY = re.compile(r'^\s*multipart/byteranges\s*;.*\bboundary="?([0-9A-Za-z\'()+_,./:=?-]{1,70})"?\s*$', re.IGNORECASE)


def _boundary(content_type: str | None) -> bytes | None:
    """The boundary of a `multipart/byteranges` answer (RFC 2046's characters, at most 70), else None."""
    match = _BOUNDARY.match(content_type or "")
    return match.group(1).encode() if match else None


def _check_etag(response: Any, file: RemoteFile) -> None:
    """An answer's strong ETag, if any, is the one the file had when its header was read."""
    etag = _strong(response.getheader("ETag"))
    if file.etag and etag and etag != file.etag:
        raise _Permanent("changed since its header was read (its ETag differs)")


def _strong(etag: str | None) -> str | None:
    """A strong ETag (weak ones, `W/"..."`, say nothing about the bytes)."""
    return etag.strip() if etag and not etag.strip().startswith("W/") else None


class FsspecTransport(Transport):
    """Any file system fsspec knows (`s3://`, `gs://`, ...): `info` for the size, `cat_file`
    with a byte range for the data, copied into the destination. Answers in flight take
    at most `MIN_SCRATCH` bytes, or half the largest tensor, of scratch memory.

    ```python
    t = FsspecTransport("s3://bucket/gpt2")
    t.start("model.safetensors")       # (b'...', 548105171, None)
    ```
    """

    def __init__(self, url: str):
        import fsspec

        self.display = redact(url)
        scheme = _SCHEME.match(url).group(1).lower()
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except ImportError as e:
            extra = {"s3": "port[s3]", "gs": "port[gcs]", "gcs": "port[gcs]"}.get(scheme)
            hint = f"pip install '{extra}'" if extra else _reason(e)
            raise CheckpointError(f"{self.display}: reading {scheme}:// URLs needs another package ({hint})") from None
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{self.display}: not a URL port can read ({_reason(e)})") from None
        self._root = root.rstrip("/")
        self._budget = _Budget(MIN_SCRATCH)
        self._lock = threading.Lock()

    def _path(self, name: str) -> str:
        return f"{self._root}/{name}"

    def _call(self, function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """A file system call, its exceptions sorted into missing, permanent and transient."""
        try:
            return function(*args, **kwargs)
        except FileNotFoundError:
            raise _Missing("not found") from None
        except PermissionError as e:
            raise _Permanent(f"access denied ({_reason(e)}): check the credentials") from None
        except (IsADirectoryError, NotADirectoryError, ImportError, NotImplementedError, TypeError, ValueError) as e:
            raise _Permanent(_reason(e)) from None
        except Exception as e:  # noqa: BLE001 - each library raises its own network errors
            status = _status_of(e)
            settled = status is not None and not (status in _RETRIED or status >= 500)
            if settled or _PERMANENT & {cls.__name__ for cls in type(e).__mro__}:
                raise _Permanent(_reason(e)) from None
            raise _Transient(_reason(e)) from None

    def _size(self, name: str) -> int:
        info = self._call(self.fs.info, self._path(name))
        if info.get("type", "file") != "file" or not isinstance(info.get("size"), int):
            raise _Permanent("not a file")
        return info["size"]

    def _cat(self, name: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of file `name`, exactly, counted."""
        with self._lock:
            self.sent += 1
        data = self._call(self._fetch, self._path(name), start, stop)
        self.count(len(data))
        if len(data) != stop - start:
            raise _Transient(f"the answer holds {len(data)} of {stop - start} bytes")
        return data

    def _fetch(self, path: str, start: int, stop: int) -> bytes:
        from fsspec.asyn import AsyncFileSystem

        if isinstance(self.fs, AsyncFileSystem):  # s3fs, gcsfs: one ranged GET
            return self.fs.cat_file(path, start=start, end=stop)
        with self.fs.open(path, "rb", cache_type="none") as f:  # no read-ahead: exactly the range
            f.seek(start)
            return f.read(stop - start)

    def small(self, name: str, limit: int, what: str) -> bytes:
        size = self._size(name)
        if size > limit:
            raise _Permanent(f"{size} bytes, more than a {what} may have ({limit})")
        return self._cat(name, 0, size) if size else b""

    def start(self, name: str) -> tuple[bytes, int, str | None]:
        size = self._size(name)
        return (self._cat(name, 0, min(8, size)) if size else b""), size, None

    def read(self, file: RemoteFile, start: int, pieces: np.ndarray) -> None:
        size = int(pieces[:, 1].sum())
        with self._budget.take(size):
            data = np.frombuffer(self._cat(file.name, start, start + size), np.uint8)
            _scatter(data.ctypes.data, pieces)

    def listing(self) -> list[str]:
        try:
            names = self._call(self.fs.ls, self._root, detail=False)
        except _Missing:
            return []
        return [str(name).rstrip("/").rsplit("/", 1)[-1] for name in names]

    @property
    def chunk(self) -> int:
        return min(SCRATCH_CHUNK, self._budget.capacity)

    def setup(self, largest: int) -> None:
        self._budget = _Budget(max(MIN_SCRATCH, largest // 2))


def _status_of(error: BaseException) -> int | None:
    """The HTTP status a library's exception carries, if any (httpx, requests, aiohttp, botocore)."""
    response = getattr(error, "response", None)
    for value in (
        getattr(response, "status_code", None),
        getattr(error, "status", None),
        (response or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None,
    ):
        if isinstance(value, int):
            return value
    return None


def _http_transport(url: str) -> HttpTransport:
    """`http(s)://[user:password@]host/dir[?query]`: the query goes with every request, the
    user info as basic authentication to that host only; neither is ever shown."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise CheckpointError(f"{redact(url)}: no host in the URL")
    netloc = parts.netloc.rpartition("@")[2]
    base = parts.path.rstrip("/")

    def locate(name: str) -> str:
        return urlunsplit((parts.scheme, netloc, f"{base}/{quote(name)}", parts.query, ""))

    auth = {}
    if parts.username is not None:
        token = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        auth["Authorization"] = "Basic " + base64.b64encode(token).decode()
    return HttpTransport(redact(url), locate, auth)


def hf_location(url: str) -> tuple[str, str, str]:
    """`hf://org/name[@revision][/folder]` as (repo id, revision, folder).

    A revision with a `/` is written escaped (`@refs%2Fpr%2F1`); a one-part repo id
    (`hf://gpt2`) takes no folder.

    ```python
    hf_location("hf://org/name@v1.0/weights")   # ('org/name', 'v1.0', 'weights')
    ```
    """
    rest = urlsplit(url)
    segments = [s for s in (rest.netloc + rest.path).split("/") if s]
    if not segments:
        raise CheckpointError(f"{redact(url)}: no repo id (expected hf://org/name[@revision])")
    count = 1 if len(segments) == 1 or "@" in segments[0] else 2
    repo, _, revision = "/".join(segments[:count]).partition("@")
    folder = segments[count:]
    if not _REPO.match(repo) or any(not _plain_name(s) for s in folder) or (revision == "" and "@" in url):
        raise CheckpointError(f"{redact(url)}: not a Hugging Face repo URL (expected hf://org/name[@revision][/folder])")
    return repo, unquote(revision) or "main", "/".join(folder)


def _hub_transport(url: str) -> HttpTransport:
    """`hf://org/name[@revision]`: the Hub's resolve URLs (`HF_ENDPOINT`), read by range with
    the Hub token (`HF_TOKEN`, `hf auth login`) sent to the Hub only; no local cache."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers

    repo, revision, folder = hf_location(url)
    display = redact(url)
    if constants.HF_HUB_OFFLINE:
        raise CheckpointError(f"{display}: HF_HUB_OFFLINE is set; reading the Hub in place needs the network")

    base = f"{constants.ENDPOINT.rstrip('/')}/{repo}/resolve/{quote(revision, safe='')}"

    def locate(name: str) -> str:  # as huggingface_hub.hf_hub_url, with the endpoint read now
        return f"{base}/{quote(f'{folder}/{name}' if folder else name)}"

    try:
        headers = {k: v for k, v in build_hf_headers().items() if k.lower() == "authorization"}
    except Exception as e:  # noqa: BLE001 - a token source that failed (OIDC exchange, a token file)
        raise CheckpointError(f"{display}: cannot get the Hugging Face token ({_reason(e)})") from None
    return HttpTransport(display, locate, headers)


def transport_for(url: str) -> Transport:
    """The transport that reads `url`'s scheme: HTTP(S) and the Hub by `http.client`, the
    rest by fsspec.

    ```python
    transport_for("s3://bucket/gpt2")    # FsspecTransport
    ```
    """
    scheme = _SCHEME.match(url).group(1).lower()
    try:
        urlsplit(url)
    except ValueError as e:  # an unclosed IPv6 bracket, a port that is no number
        raise CheckpointError(f"{redact(url)}: not a URL port can read ({e})") from None
    if scheme in _DEFAULT_PORTS:
        return _http_transport(url)
    if scheme == "hf":
        return _hub_transport(url)
    return FsspecTransport(url)


# ---------------------------------------------------------------------------- reading regions


@dataclass(frozen=True)
class _Ranges:
    """Byte ranges of one file, each asked for as a whole: range `i` is bytes
    [`starts[i]`, `stops[i]`), landing in `pieces[firsts[i]:firsts[i + 1]]` (an `iovecs`
    array, in file order). `part(lo, hi)` is ranges `lo` to `hi` (views, no copy).

    ```python
    r = plan_ranges(offsets, lengths, addresses, 1 << 20)
    r.starts[0], r.stops[0], r.pieces_of(0)
    ```
    """

    starts: np.ndarray
    stops: np.ndarray
    firsts: np.ndarray
    pieces: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    def part(self, lo: int, hi: int) -> _Ranges:
        return _Ranges(self.starts[lo:hi], self.stops[lo:hi], self.firsts[lo : hi + 1], self.pieces)

    def pieces_of(self, i: int) -> np.ndarray:
        return self.pieces[self.firsts[i] : self.firsts[i + 1]]

    def scatter(self, body: np.ndarray, offsets: np.ndarray) -> None:
        """Copy each range's bytes, found in `body` (bytes as uint8) from `offsets[i]` on, to its pieces.

        Equal pieces (one process's rows of its column blocks, one or a few a range) are
        gathered into one contiguous array first (a row a copy, inside numpy), then copied
        out as `_scatter` copies (strided where the rows interleave); others one by one.
        """
        counts = np.diff(self.firsts)
        pieces = self.pieces[self.firsts[0] : self.firsts[-1]]
        lengths = pieces[:, 1].astype(np.int64)
        begins = np.cumsum(lengths) - lengths  # each piece's place in its range's bytes
        begins -= np.repeat(begins[self.firsts[:-1] - self.firsts[0]], counts)
        sources = np.repeat(offsets, counts) + begins
        if len(pieces) > 2 and (lengths == lengths[0]).all():
            width = int(lengths[0])
            rows = np.lib.stride_tricks.as_strided(body, (len(body) - width + 1, width), (1, 1), writeable=False)
            gathered = rows[sources]
            _scatter(gathered.ctypes.data, pieces)
            return
        for (address, size), at in zip(pieces.tolist(), (sources + body.ctypes.data).tolist()):
            ctypes.memmove(address, at, size)


def _grouped(ranges: _Ranges) -> list[tuple[int, int]]:
    """Ranges (in file order) in groups `(lo, hi)`, one request each: consecutive ranges
    under `PART` bytes together, up to `MAX_PARTS` of them, a `Range` header of
    `MAX_RANGE_HEADER` characters and an answer that fits `SCRATCH` (`PART_HEADERS` bytes
    of part headers allowed for each); a larger range alone, and ranges that continue one
    another (a run split at `HTTP_CHUNK`, to be fetched in parallel) apart.

    Two processes reading one file each ask for their own rows, which alternate with the
    other's: hundreds of thousands of ranges of a few KB, a few thousand requests this way.
    """
    n = len(ranges)
    sizes = ranges.stops - ranges.starts
    small = sizes < PART
    alone = ~small  # a range no group may take in after its first
    alone[1:] |= ranges.starts[1:] == ranges.stops[:-1]
    breaks = np.flatnonzero(alone)
    text = _digits(ranges.starts) + _digits(ranges.stops - 1) + 2  # "a-b,"
    sized = np.concatenate(([0], np.cumsum(sizes)))
    written = np.concatenate(([0], np.cumsum(text)))
    groups, i = [], 0
    while i < n:
        if not small[i]:
            groups.append((i, i + 1))
            i += 1
            continue
        after = int(np.searchsorted(breaks, i, side="right"))
        j = min(
            i + MAX_PARTS,
            int(breaks[after]) if after < len(breaks) else n,
            int(np.searchsorted(sized, sized[i] + SCRATCH - MAX_PARTS * PART_HEADERS, side="right")) - 1,
            int(np.searchsorted(written, written[i] + MAX_RANGE_HEADER, side="right")) - 1,
        )
        groups.append((i, max(j, i + 1)))
        i = max(j, i + 1)
    return groups


def _digits(values: np.ndarray) -> np.ndarray:
    """The decimal digits of each non-negative integer."""
    digits = np.ones(len(values), np.int64)
    for power in range(1, 20):
        digits += values >= 10**power
    return digits


def plan_ranges(offsets: np.ndarray, lengths: np.ndarray, addresses: np.ndarray, chunk: int) -> _Ranges:
    """The requests that read runs (file offset, length, destination address): runs that lie
    end to end in the file share one request, and no request asks for more than `chunk`
    bytes (a run across a `chunk` boundary is cut there).

    ```python
    r = plan_ranges(np.array([0, 8, 32]), np.array([8, 8, 8]), np.array([a, a + 8, b]), 1 << 20)
    # two ranges: bytes 0-16 into (a, 8), (a + 8, 8); bytes 32-40 into (b, 8)
    ```
    """
    order = np.argsort(offsets, kind="stable")
    offsets, lengths = offsets[order].astype(np.int64), lengths[order].astype(np.int64)
    addresses = addresses[order].astype(np.int64)
    ends = offsets + lengths
    new = np.ones(len(offsets), bool)  # a run that does not continue the one before starts a stretch
    new[1:] = offsets[1:] != ends[:-1]
    base = np.maximum.accumulate(np.where(new, offsets, 0))  # each run's stretch starts here
    first, last = (offsets - base) // chunk, (ends - 1 - base) // chunk
    cuts = last - first + 1
    if (cuts > 1).any():  # runs across a chunk boundary of their stretch: one piece per chunk
        run = np.repeat(np.arange(len(offsets)), cuts)
        k = np.arange(len(run)) - np.repeat(np.cumsum(cuts) - cuts, cuts)
        begin = np.maximum(offsets[run], base[run] + (first[run] + k) * chunk)
        end = np.minimum(ends[run], base[run] + (first[run] + k + 1) * chunk)
        addresses = addresses[run] + (begin - offsets[run])
        offsets, ends, base, new = begin, end, base[run], new[run] & (k == 0)
    which = (offsets - base) // chunk
    begins = new.copy()
    begins[1:] |= which[1:] != which[:-1]
    firsts = np.concatenate((np.flatnonzero(begins), [len(offsets)]))
    stops = ends[np.maximum(firsts[1:] - 1, 0)] if len(offsets) else ends
    return _Ranges(offsets[firsts[:-1]], stops, firsts, iovecs(addresses, ends - offsets))


def _batches(info: TensorInfo, requests: Sequence[tuple[Region, np.ndarray]]) -> Iterator[tuple[np.ndarray, ...]]:
    """The runs of all `requests` as (offsets, lengths, addresses), at most about `_MAX_RUNS` at a time."""
    batch: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    count = 0
    for region, out in requests:
        for piece_region, piece_out in _pieces(info, region, out):
            found = runs(info, piece_region, piece_out)
            if count and count + len(found[0]) > _MAX_RUNS:
                yield tuple(np.concatenate(parts) for parts in zip(*batch))
                batch, count = [], 0
            batch.append(found)
            count += len(found[0])
    if count:
        yield tuple(np.concatenate(parts) for parts in zip(*batch))


# ---------------------------------------------------------------------------- the checkpoint


@dataclass
class RemoteCheckpoint(Checkpoint):
    """A checkpoint read in place from a URL: `directory` is the URL (no credentials),
    each `TensorInfo.file` a `RemoteFile`; `read_into` fetches the regions' byte ranges.

    ```python
    with open_remote("s3://bucket/gpt2") as ckpt:
        ckpt.read("wte.weight", ((0, 8), (0, 768)))
    ```
    """

    transport: Transport | None = field(default=None, repr=False)
    requests: int = REQUESTS
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)
    _together: dict[str, _Neighbours] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(self.requests, thread_name_prefix="port-remote")
        self.transport.count = self._count

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def parallel(self, jobs: Sequence[Callable[[], _T]]) -> list[_T]:
        """Run `jobs` on the request threads; the first failure is raised once none is running."""
        futures: list[Future] = [self._pool.submit(job) for job in jobs]
        interrupted = None
        try:
            _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException as e:  # interrupted: no thread may go on writing into a caller's buffer
            interrupted, pending = e, set(futures)
        if pending:  # a job failed: those not started never start, those running finish
            for future in pending:
                future.cancel()
            wait(futures)
        if interrupted is not None:
            raise interrupted
        for future in futures:
            if not future.cancelled() and future.exception() is not None:
                raise future.exception()
        return [future.result() for future in futures]

    def expect(self, reads: Mapping[str, Collection[Region]]) -> None:
        """Group the small tensors the load reads whole (its regions of each cover it) that lie
        end to end in a file (a layer's norms and biases), up to `NEIGHBOURS` bytes (and the
        transport's `chunk`, which bounds fsspec's scratch memory): the first
        read of one of them fetches the group in one request, and the others are copied from
        it (each byte still fetched once)."""
        self._together = {}
        small = sorted((self.tensors[k] for k, regions in reads.items()
                        if 0 < self.tensors[k].nbytes < NEIGHBOUR and _covers(self.tensors[k].shape, regions)),
                       key=lambda info: (info.file.name, info.offset))
        group: list[TensorInfo] = []
        for info in [*small, None]:
            last = group[-1] if group else None
            if (info is None or last is None or info.file is not last.file or info.offset != last.offset + last.nbytes
                    or info.offset + info.nbytes - group[0].offset > min(NEIGHBOURS, self.transport.chunk)):
                if len(group) > 1:
                    together = _Neighbours(group[0].file, group[0].offset, last.offset + last.nbytes,
                                           {i.key for i in group})
                    self._together.update(dict.fromkeys(together.keys, together))
                group = []
            if info is not None:
                group.append(info)

    def read_into(self, key: str, requests: Sequence[tuple[Region, np.ndarray]]) -> None:
        """Read regions of tensor `key` into their buffers (see `Checkpoint.read_into`): one
        request per stretch of runs lying end to end in the file, in parallel; a small tensor
        `expect`ed whole, with its neighbours (`expect`)."""
        info = self.tensors[key]
        for region, out in requests:
            _check_out(info, region, out)
        together = self._together.get(key)
        if together is not None and together.copy(self, info, requests):
            return
        for offsets, lengths, addresses in _batches(info, requests):
            ranges = plan_ranges(offsets, lengths, addresses, self.transport.chunk)
            if self.transport.multipart:
                groups = _grouped(ranges)
            else:
                groups = [(i, i + 1) for i in range(len(ranges))]
            self.parallel([functools.partial(self._fetch_parts, info, ranges.part(lo, hi)) for lo, hi in groups])

    def _fetch(self, info: TensorInfo, ranges: _Ranges, i: int) -> None:
        start, stop = int(ranges.starts[i]), int(ranges.stops[i])
        what = f"{info.file}: bytes {start}-{stop - 1} (tensor {quoted(info.key, 200)})"
        retried(what, lambda: self.transport.read(info.file, start, ranges.pieces_of(i)))

    def _fetch_parts(self, info: TensorInfo, group: _Ranges) -> None:
        """Ranges in one request where the server answers several ranges, else one by one."""
        if len(group) > 1 and self.transport.multipart:
            what = (f"{info.file}: {len(group)} ranges in bytes {int(group.starts[0])}-{int(group.stops[-1]) - 1} "
                    f"(tensor {quoted(info.key, 200)})")
            try:
                return retried(what, lambda: self.transport.read_parts(info.file, group))
            except _OneRangeOnly:
                pass
        for i in range(len(group)):
            self._fetch(info, group, i)

    def close(self) -> None:
        """Stop the request threads and close the connections."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.transport.close()


@dataclass(eq=False)
class _Neighbours:
    """Small tensors lying end to end in `file`, bytes [start, stop): fetched together by the first
    read of one of them, kept until each has been read once."""

    file: RemoteFile
    start: int
    stop: int
    keys: set[str]
    waiting: set[str] = field(default_factory=set)
    data: np.ndarray | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.waiting = set(self.keys)

    def copy(self, ckpt: RemoteCheckpoint, info: TensorInfo, requests: Sequence[tuple[Region, np.ndarray]]) -> bool:
        """Fill `requests` from the group's bytes (fetched now if not yet); False once `info`
        was read from them before (a later read asks for its own bytes)."""
        with self.lock:
            if info.key not in self.waiting:
                return False
            if self.data is None:
                data = np.empty(self.stop - self.start, np.uint8)
                what = (f"{self.file}: bytes {self.start}-{self.stop - 1} (tensor {quoted(info.key, 200)} "
                        f"and {len(self.keys) - 1} small ones beside it)")
                retried(what, lambda: ckpt.transport.read(self.file, self.start, iovecs([data.ctypes.data], [data.size])))
                self.data = data
            for region, out in requests:
                offsets, lengths, addresses = runs(info, region, out)
                _scatter_from(self.data.ctypes.data - self.start, offsets, lengths, addresses)
            self.waiting.discard(info.key)
            if not self.waiting:
                self.data = None
        return True


def _covers(shape: tuple[int, ...], regions: Collection[Region]) -> bool:
    """Whether `regions` together cover every element of a (small) tensor of `shape`."""
    covered = np.zeros(shape, bool)
    for region in regions:
        covered[tuple(slice(a, b) for a, b in region)] = True
    return bool(covered.all())


def _scatter_from(base: int, offsets: np.ndarray, lengths: np.ndarray, addresses: np.ndarray) -> None:
    """Copy runs (file offset, length, destination) out of a file's bytes held at `base + offset`."""
    for offset, length, address in zip(offsets.tolist(), lengths.tolist(), addresses.tolist()):
        ctypes.memmove(address, base + offset, length)


def _small(transport: Transport, name: str, limit: int, what: str) -> bytes | None:
    """A small file whole, or None when it is not there."""
    try:
        return retried(transport.url(name), lambda: _present(transport.small, name, limit, what))
    except _Absent:
        return None


class _Absent(Exception):
    pass


def _present(function: Callable[..., _T], *args: Any) -> _T:
    """`function(*args)`, a missing file raised as `_Absent` (past `retried`, for the caller)."""
    try:
        return function(*args)
    except _Missing:
        raise _Absent from None


def _shards(ckpt: RemoteCheckpoint) -> tuple[list[str], dict[str, tuple[bytes, int, str | None]]]:
    """The safetensors files: the index's, else `model.safetensors`, else those a listing shows;
    and the first bytes of any file already asked for."""
    t = ckpt.transport
    raw = _small(t, _INDEX, MAX_INDEX, "safetensors index")
    if raw is not None:
        return shard_names_in(raw, t.url(_INDEX)), {}
    try:
        return [_SINGLE], {_SINGLE: retried(f"{t.url(_SINGLE)}: bytes 0-7", lambda: _present(t.start, _SINGLE))}
    except _Absent:
        pass
    listed = sorted(n for n in (t.listing() or []) if n.endswith(".safetensors") and _plain_name(n))
    if len(listed) > MAX_SHARDS:
        raise CheckpointError(f"{t.display}: {len(listed)} safetensors files, more than {MAX_SHARDS}")
    if not listed:
        raise CheckpointError(f"{t.display}: no safetensors weights ({_SINGLE} or {_INDEX})")
    return listed, {}


def _headers(ckpt: RemoteCheckpoint, names: list[str], known: dict) -> dict[str, TensorInfo]:
    """Every file's tensors: all header lengths checked (each, and their total) before any header is read."""
    t = ckpt.transport

    def first(name: str) -> tuple[bytes, int, str | None]:
        return known.get(name) or retried(f"{t.url(name)}: bytes 0-7", lambda: t.start(name))

    starts = ckpt.parallel([functools.partial(first, name) for name in names])
    lengths = [header_length_of(prefix, size, t.url(name)) for name, (prefix, size, _) in zip(names, starts)]
    if sum(lengths) > MAX_HEADERS:
        raise CheckpointError(
            f"{t.display}: the safetensors headers of its {len(names)} files take {sum(lengths)} bytes, "
            f"more than {MAX_HEADERS} in all"
        )
    files = [RemoteFile(t.url(name), name, size, etag) for name, (_, size, etag) in zip(names, starts)]
    raws = ckpt.parallel([functools.partial(_header_bytes, t, f, n) for f, n in zip(files, lengths)])
    tensors: dict[str, TensorInfo] = {}
    for file, n, raw in zip(files, lengths, raws):
        for key, info in header_tensors(parse_header(raw, file.url), n, file.size, file, file.url).items():
            if key in tensors:
                raise CheckpointError(f"{file.url}: tensor {quoted(key, 200)} is also in {tensors[key].file.name}")
            tensors[key] = info
    return tensors


def _header_bytes(t: Transport, file: RemoteFile, n: int) -> bytes:
    """The `n` header bytes after a file's length field."""
    raw = np.empty(n, np.uint8)
    if n:
        retried(f"{file.url}: bytes 8-{8 + n - 1}", lambda: t.read(file, 8, iovecs([raw.ctypes.data], [n])))
    return raw.tobytes()


def open_remote(url: str, requests: int = REQUESTS) -> RemoteCheckpoint:
    """Open the checkpoint directory at `url`, reading only `config.json`, the index and the headers.

    **Arguments:**

    - `url`: `http(s)://host/dir`, `hf://org/name[@revision]`, `s3://bucket/prefix`,
      `gs://bucket/prefix` (or any fsspec URL).
    - `requests`: range requests in flight at once.

    ```python
    with open_remote("hf://openai-community/gpt2") as ckpt:
        ckpt.config["n_layer"]
    ```
    """
    transport = transport_for(url)
    ckpt = RemoteCheckpoint(transport.display, {}, {}, transport=transport, requests=requests)
    try:
        raw = _small(transport, "config.json", MAX_CONFIG, "config.json")
        if raw is None:
            raise CheckpointError(f"{transport.display}: no config.json")
        config = _load_json(raw, transport.url("config.json"))
        if not isinstance(config, dict):
            raise CheckpointError(f"{transport.url('config.json')}: expected a JSON object")
        names, known = _shards(ckpt)
        ckpt.config, ckpt.tensors = config, _headers(ckpt, names, known)
        transport.setup(max((info.nbytes for info in ckpt.tensors.values()), default=0))
        return ckpt
    except BaseException:
        ckpt.close()
        raise
