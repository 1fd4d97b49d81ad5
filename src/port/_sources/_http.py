"""HTTP(S): a checkpoint's files read by exact `Range` requests with the standard library's `http.client`.

Each answer is checked (`206`, `Content-Range`, `Content-Length`, the file's size and
ETag) before a byte of it is taken as data, and read straight into the caller's
memory: over plain HTTP with `readv` on the socket, over TLS piece by piece (small
pieces through a scratch buffer). Keep-alive connections, one per thread and host;
redirects followed, credentials sent to the first host only. Ranges under `PART`
bytes share a request (`grouped`: `Range: bytes=a-b,c-d,...`, answered as
`multipart/byteranges`, each range found by its part's `Content-Range` with
`part_offsets`, the parts in any order or coalesced) until a server answers otherwise. A request
that has run `GRACE` seconds below `MIN_RATE` is given up and retried.

```python
t = http_transport("https://host/gpt2")
t.start("model.safetensors")       # (b'...8 bytes', 548105171, '"etag"')
```
"""

from __future__ import annotations

import base64
import ctypes
import errno
import http
import http.client
import os
import re
import select
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, final
from urllib.parse import quote, unquote, urljoin, urlsplit, urlunsplit

import numpy as np

from .._errors import CheckpointError
from .._files import IOV_MAX, libc_function
from .._text import quoted
from ._ranges import Ranges, iovecs, memory_at, scatter
from ._transport import RETRIED, Missing, OneRangeOnly, Permanent, RemoteFile, Transient, Transport
from ._urls import reason, redact

TIMEOUT = 15.0
"""Seconds a connection may wait for the server (connect, or the next bytes)."""
MIN_RATE = 64 * 2**10
"""Bytes per second below which a request that has run `GRACE` seconds is given up and retried."""
GRACE = 10.0
"""Seconds a request may take before `MIN_RATE` applies (a connection's start, a slow first byte)."""
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
MAX_REDIRECTS = 5
DEFAULT_PORTS = {"http": 80, "https": 443}
"""The schemes this transport reads, and the port each connects to by default."""
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)\s*$", re.IGNORECASE)
_REDIRECTS = {301, 302, 303, 307, 308}


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
    return (None if a is None else int(a), None if b is None else int(b), None if total == "*" else int(total))


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


_READV = libc_function("readv", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int])


class _Body:
    """An answer's bytes counted as they come: each receive passed to `count`, and the rate
    checked (a body that ends early, or comes slower than `MIN_RATE` once `GRACE` has
    passed, is transient)."""

    def __init__(self, wanted: int, count: Callable[[int], None]):
        self.wanted, self.received, self._count, self._began = wanted, 0, count, time.monotonic()

    def got(self, n: int) -> None:
        if not n:
            raise Transient(f"the body ended after {self.received} of {self.wanted} bytes")
        self.received += n
        self._count(n)
        elapsed = time.monotonic() - self._began
        if elapsed > GRACE and self.received < MIN_RATE * elapsed and self.received < self.wanted:
            raise Transient(
                f"{self.received} of {self.wanted} bytes in {elapsed:.1f} s, slower than {MIN_RATE // 1024} KiB/s"
            )

    def broke(self, error: BaseException) -> Transient:
        return Transient(f"the body broke off after {self.received} of {self.wanted} bytes ({reason(error)})")


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
    assert _READV is not None  # called only where libc has readv (`_fill` checks)
    fd, timeout = sock.fileno(), sock.gettimeout()
    waiting = select.poll()
    waiting.register(fd, select.POLLIN)
    first = 0
    while first < len(iov):
        count = min(len(iov) - first, IOV_MAX)
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
    scatter(np.frombuffer(data, np.uint8).ctypes.data, filled[filled[:, 1] > 0])
    return first


@final
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

    @property
    def chunk(self) -> int:
        """Bytes one request asks for at most: `HTTP_CHUNK`."""
        return HTTP_CHUNK

    def listing(self) -> None:
        """None: HTTP cannot list a directory."""
        return None

    def setup(self, largest: int) -> None:
        """Nothing to size: each request's pieces land in the caller's memory (or the thread's `SCRATCH`)."""

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
                    raise Transient(f"connection failed ({reason(e)})") from None
            except (OSError, http.client.HTTPException) as e:
                self._drop(key, conn)
                raise Transient(f"connection failed ({reason(e)})") from None
        raise AssertionError("unreachable")

    def _get(self, name: str, headers: dict[str, str]) -> tuple[Any, Any, tuple[str, str, int]]:
        """GET file `name`, following redirects: (response, connection, connection key)."""
        url = self._locate(name)
        origin = None
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            scheme = parts.scheme.lower()
            if scheme not in DEFAULT_PORTS or not parts.hostname:
                raise Permanent("redirected to a URL that is not HTTP(S)")
            try:
                key = (scheme, parts.hostname, parts.port or DEFAULT_PORTS[scheme])
            except ValueError:
                raise Permanent("a URL with an invalid port") from None
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
        raise Permanent(f"more than {MAX_REDIRECTS} redirects")

    def _judge(self, response: Any, conn: Any, key: tuple[str, str, int]) -> None:
        """Accept 200/206; anything else drops the connection and says what it means."""
        status = response.status
        if status in (200, 206):
            encoding = (response.getheader("Content-Encoding") or "identity").strip().lower()
            if encoding != "identity":
                self._drop(key, conn)
                raise Permanent(f"the server encoded the body ({quoted(encoding, 20)}), asked for identity")
            return
        self._drop(key, conn)
        if status in (404, 410):
            raise Missing(f"not found ({_phrase(status)})")
        if status in (401, 403):
            raise Permanent(f"access denied ({_phrase(status)}): check the credentials")
        if status in RETRIED or status >= 500:
            raise Transient(_phrase(status))
        raise Permanent(_phrase(status))

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
        if (
            _READV is not None
            and sock is not None
            and not isinstance(sock, ssl.SSLSocket)
            and not response.chunked
            and response.length is not None
            and body.wanted <= response.length
        ):
            iov = np.array(pieces, np.uint64, order="C")
            try:
                first = _held(response, iov, body)
            except (OSError, http.client.HTTPException) as e:
                raise body.broke(e) from None
            _readv(sock, iov[first:], body)
            response.length -= body.wanted  # read past http.client: what it expects to come
            return

        def take(address: int, n: int) -> None:  # the next n body bytes into memory at address
            view, got = memory_at(address, n), 0
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
            j = min(
                int(np.searchsorted(ends, ends[i] + SCRATCH, side="right")) - 1,  # what fits the scratch
                int(large[after]) if after < len(large) else len(pieces),
            )  # up to the next large piece
            scratch = self._scratch()
            take(scratch, int(ends[j] - ends[i]))
            scatter(scratch, pieces[i:j])
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
                raise Transient(f"the body did not end cleanly ({reason(e)})") from None
            if extra:
                raise Permanent("the server sent more bytes than the range asked for")
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
                raise Permanent(f"{int(length)} bytes, more than a {what} may have ({limit})")
            data = bytearray()
            while len(data) <= limit:
                try:
                    chunk = response.read(min(1 << 16, limit + 1 - len(data)))
                except (OSError, http.client.HTTPException) as e:
                    raise Transient(f"the body broke off after {len(data)} bytes ({reason(e)})") from None
                if not chunk:
                    break
                self.count(len(chunk))
                data += chunk
            if len(data) > limit:
                raise Permanent(f"more than a {what} may have ({limit} bytes)")
            if length is not None and length.strip().isdigit() and len(data) != int(length):
                raise Transient(f"the body ended after {len(data)} of {int(length)} bytes")
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
                raise Transient(f"asked for bytes 0-7, the server answered bytes {first}-{last}/{size}")
            prefix = np.empty(last + 1, np.uint8)
            self._fill(response, conn, iovecs([prefix.ctypes.data], [prefix.size]))
            self._finish(response, conn, key)
            return prefix.tobytes(), size, _strong(response.getheader("ETag"))
        except BaseException:
            self._drop(key, conn)
            raise

    def _answered(self, response: Any) -> tuple[int | None, int | None, int]:
        """(first, last, file size) of the answer to `Range: bytes=0-7`; first and last None for `bytes */SIZE`."""
        length = response.getheader("Content-Length")
        if response.status == 200:  # the whole file: fine only when it is that small
            if length is None or not length.strip().isdigit() or int(length) > 8:
                raise Permanent(_NO_RANGES)
            return 0, int(length) - 1, int(length)
        first, last, size = _content_range(response.getheader("Content-Range")) or (None, None, None)
        if size is None:
            raise Permanent("the server does not give the file's size (Content-Range bytes A-B/SIZE)")
        return first, last, size

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

    def read_parts(self, file: RemoteFile, ranges: Ranges) -> None:
        """Several ranges of one file in one request, each filling its pieces.

        The server's answer (at most `SCRATCH` bytes: `grouped` keeps the ranges' total
        under it) is received whole into this thread's scratch buffer, each range found
        there and copied out: in a `multipart/byteranges` answer by its part's
        `Content-Range` (`part_offsets`: parts in any order, neighbouring ranges coalesced
        into one part, as RFC 9110 allows), or in a single range holding them all (every
        range coalesced into one). A server that answers otherwise (the whole file, a range
        that leaves one out, parts that are not the ranges asked, a longer answer) is not
        asked for several ranges again: `OneRangeOnly`, and the caller asks range by range.
        """
        spans = list(zip(ranges.starts.tolist(), ranges.stops.tolist()))
        header = "bytes=" + ",".join(f"{start}-{stop - 1}" for start, stop in spans)
        response, conn, key = self._get(file.name, {"Range": header})
        try:
            self._judge(response, conn, key)
            boundary = _boundary(response.getheader("Content-Type"))
            length = response.length
            whole = None if boundary is not None else _holding(response, spans, file.size)
            if response.status != 206 or (boundary is None and whole is None) or length is None or length > SCRATCH:
                self._decline(key, conn)
            _check_etag(response, file)
            scratch = self._scratch()
            self._fill(response, conn, iovecs([scratch], [length]))
            self._finish(response, conn, key)
        except BaseException:
            self._drop(key, conn)
            raise
        body = np.frombuffer(memory_at(scratch, length), np.uint8)
        if boundary is None:  # one range holding every range asked, from byte `whole` on
            offsets, held = [start - whole for start, _ in spans], length
        else:
            try:
                offsets, held = part_offsets(body.tobytes(), boundary, spans, file.size)
            except OneRangeOnly:
                self.multipart = False
                raise
        self.count(held - length)  # the file's bytes (a coalesced part's gap too), not the parts' framing
        ranges.scatter(body, np.array(offsets, np.int64))

    def _decline(self, key: tuple[str, str, int], conn: Any) -> NoReturn:
        """The server answered several ranges in a way port cannot use: ask it for one range a request from now on."""
        self.multipart = False
        self._drop(key, conn)
        raise OneRangeOnly

    def _check_range(self, response: Any, file: RemoteFile, start: int, stop: int) -> None:
        """The answer is bytes [start, stop) of the same file, announced so."""
        if response.status == 200:
            if not (start == 0 and stop == file.size):
                raise Permanent(_NO_RANGES)
        else:
            found = _content_range(response.getheader("Content-Range"))
            if found is None:
                raise Transient("a partial answer without a valid Content-Range")
            first, last, total = found
            if total is not None and total != file.size:
                raise Permanent(f"changed since its header was read (now {total} bytes, was {file.size})")
            if (first, last) != (start, stop - 1):
                raise Transient(f"the server answered bytes {first}-{last}")
        length = response.getheader("Content-Length")
        if length is not None and (not length.strip().isdigit() or int(length) != stop - start):
            raise Transient(f"the server announced {quoted(length.strip(), 20)} bytes of {stop - start}")
        _check_etag(response, file)


def _holding(response: Any, spans: Sequence[tuple[int, int]], size: int) -> int | None:
    """The first byte of a single-range answer to a request for several `spans` (a `206` that is
    not multipart) whose `Content-Range` and `Content-Length` hold them all, coalesced into one
    range of the file of `size` bytes; None if it does not (another size is permanent)."""
    first, last, total = _content_range(response.getheader("Content-Range")) or (None, None, None)
    if first is None or last is None:
        return None
    if total is not None and total != size:
        raise Permanent(f"changed since its header was read (now {total} bytes, was {size})")
    holds = first <= spans[0][0] and spans[-1][1] - 1 <= last < size
    return first if holds and response.length == last + 1 - first else None


_NO_RANGES = (
    "the server does not honour Range requests (it answered with the whole file); port reads remote files by byte range"
)


def part_offsets(body: bytes, boundary: bytes, spans: Sequence[tuple[int, int]], size: int) -> tuple[list[int], int]:
    """Where each span's bytes (start, stop; in file order) start in a `multipart/byteranges`
    body of a file of `size` bytes, and how many of the file's bytes its parts hold.

    A server may send the parts in any order and coalesce neighbouring spans into one part
    (RFC 9110 14.3): each span is found in the one part whose `Content-Range` holds it whole,
    wherever that part lies. The parts' framing (`_parts`) must be exact, or the answer is
    transient (never data); parts that overlap, hold no span, or leave a span not held whole
    are a server answering otherwise than asked: `OneRangeOnly`.

    ```python
    part_offsets(b"\\r\\n--B\\r\\nContent-Range: bytes 0-3/9\\r\\n\\r\\nabcd\\r\\n--B--\\r\\n", b"B", [(0, 4)], 9)
    # ([37], 4)
    ```
    """
    parts = sorted(_parts(body, boundary, spans, size))  # (first, last, offset), in file order
    for (a, b, _), (c, d, _) in zip(parts, parts[1:]):
        if c <= b:
            raise OneRangeOnly(f"parts that overlap (bytes {a}-{b} and {c}-{d})")
    offsets, p = [0] * len(spans), 0
    held = [False] * len(parts)
    for i in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        start, stop = spans[i]
        while p < len(parts) and parts[p][1] < start:
            p += 1
        if p == len(parts) or parts[p][0] > start or parts[p][1] < stop - 1:
            raise OneRangeOnly(f"no part holds bytes {start}-{stop - 1} whole")
        offsets[i] = parts[p][2] + start - parts[p][0]
        held[p] = True
    if not all(held):
        first, last, _ = parts[held.index(False)]
        raise OneRangeOnly(f"a part for bytes {first}-{last}, not asked for")
    return offsets, sum(last + 1 - first for first, last, _ in parts)


def _parts(body: bytes, boundary: bytes, spans: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int, int]]:
    """The parts of a `multipart/byteranges` body, in its order: (first byte, last byte, where the
    part's bytes start in `body`), each announced by its `Content-Range` (of a file of `size`
    bytes: another size is permanent), then the closing delimiter; at most one part per span.
    Anything else in the framing is transient.

    A part whose head is the previous part's with the next span's numbers in its
    `Content-Range` (servers write every part's head alike, and the parts in the order asked)
    is taken by one comparison; any other is read line by line.
    """
    delimiter = b"--" + boundary
    parts: list[tuple[int, int, int]] = []
    at = 0
    alike: tuple[bytes, bytes] | None = None  # the last head, cut around its numbers `first-last`
    while True:
        if alike is not None and len(parts) < len(spans):
            start, stop = spans[len(parts)]
            head = alike[0] + f"{start}-{stop - 1}".encode() + alike[1]
            if body.startswith(head, at):
                parts.append((start, stop - 1, at + len(head)))
                at += len(head) + stop - start
                if at > len(body):
                    raise Transient("a multipart answer that ends within a part")
                continue
        begins = body.find(delimiter, at, at + 64)
        if begins < 0 or body[at:begins].strip():
            raise Transient("a multipart answer without the delimiter where a part should begin")
        if body.startswith(b"--", begins + len(delimiter)):  # the closing delimiter
            if not parts or body[begins + len(delimiter) + 2 :].strip():
                raise Transient("a multipart answer without its closing delimiter where the last part ends")
            return parts
        ends = body.find(b"\r\n\r\n", begins, begins + 4096)
        if ends < 0:
            raise Transient("a multipart answer's part without the end of its headers")
        found, cut, line_at = None, None, begins + len(delimiter)
        for line in body[begins + len(delimiter) : ends].split(b"\r\n"):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-range":
                found = _content_range(value)
                if found is not None and found[0] is not None:
                    k = line.find(f"{found[0]}-{found[1]}".encode(), len(name) + 1)
                    cut = (line_at + k, line_at + k + len(f"{found[0]}-{found[1]}")) if k >= 0 else None
            line_at += len(line) + 2
        first, last, total = found or (None, None, None)
        if first is None or last is None:
            raise Transient("a multipart answer's part without a valid Content-Range")
        if total is not None and total != size:
            raise Permanent(f"changed since its header was read (now {total} bytes, was {size})")
        if first > last or last >= size:
            raise Transient(f"a multipart answer's part for bytes {first}-{last} of {size}")
        alike = None if cut is None else (body[at : cut[0]], body[cut[1] : ends + 4])
        parts.append((first, last, ends + 4))
        at = ends + 4 + (last + 1 - first)
        if at > len(body):
            raise Transient("a multipart answer that ends within a part")
        if len(parts) > len(spans):
            raise OneRangeOnly(f"more parts than the {len(spans)} ranges asked for")


_BOUNDARY = re.compile(
    r'^\s*multipart/byteranges\s*;.*\bboundary="?([0-9A-Za-z\'()+_,./:=?-]{1,70})"?\s*$', re.IGNORECASE
)


def _boundary(content_type: str | None) -> bytes | None:
    """The boundary of a `multipart/byteranges` answer (RFC 2046's characters, at most 70), else None."""
    match = _BOUNDARY.match(content_type or "")
    return match.group(1).encode() if match else None


def _check_etag(response: Any, file: RemoteFile) -> None:
    """An answer's strong ETag, if any, is the one the file had when its header was read."""
    etag = _strong(response.getheader("ETag"))
    if file.etag and etag and etag != file.etag:
        raise Permanent("changed since its header was read (its ETag differs)")


def _strong(etag: str | None) -> str | None:
    """A strong ETag (weak ones, `W/"..."`, say nothing about the bytes)."""
    return etag.strip() if etag and not etag.strip().startswith("W/") else None


def http_transport(url: str) -> HttpTransport:
    """`http(s)://[user:password@]host/dir[?query]`: the query goes with every request, the
    user info as basic authentication to that host only; neither is ever shown.

    ```python
    http_transport("https://me:secret@host/gpt2").display    # 'https://host/gpt2'
    ```
    """
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


def grouped(ranges: Ranges) -> list[tuple[int, int]]:
    """Ranges (in file order) in groups `(lo, hi)`, one request each: consecutive ranges
    under `PART` bytes together, up to `MAX_PARTS` of them, a `Range` header of
    `MAX_RANGE_HEADER` characters and an answer that fits `SCRATCH` (`PART_HEADERS` bytes
    of part headers allowed for each); a larger range alone, and ranges that continue one
    another (a run split at `HTTP_CHUNK`, to be fetched in parallel) apart.

    Two processes reading one file each ask for their own rows, which alternate with the
    other's: hundreds of thousands of ranges of a few KB, a few thousand requests this way.

    ```python
    grouped(plan_ranges(offsets, lengths, addresses, HTTP_CHUNK))   # [(0, 128), (128, 131), ...]
    ```
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
