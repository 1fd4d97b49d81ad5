"""Remote checkpoints: a checkpoint directory named by a URL, read in place by byte range.

`http(s)://host/dir`, `hf://org/name[@revision]` (the Hub, without its local cache),
`s3://bucket/prefix`, `gs://bucket/prefix`, and any other file system fsspec knows.
Nothing is downloaded whole: `config.json` and the shard index are read bounded in
size; each safetensors file costs two small range requests (its 8-byte header length,
with the file's size, then the header), validated by the same code as a local file
(`_safetensors`); and `read_into` fetches the byte ranges of the requested regions
(`runs()`), runs that lie end to end merged into one request, at most `requests`
requests in flight, over HTTP straight into the destination buffers. Where a gap
between two stretches is small beside the stretch after it, one request spans both
and the gap's bytes are discarded (`max_over_read`, default `MAX_OVER_READ`: a read
fetches at most that many times the bytes it needs; 1 asks for exact ranges; see
`_ranges.plan_ranges`).

`RemoteCheckpoint` is composed around a `Transport` (`transport_for` picks it by the
URL's scheme: `_http`, `_hub`, `_fsspec`), which sorts failures into transient and
permanent; transient ones are retried with exponential backoff (`retried`), and what
still fails is one `CheckpointError` naming the file's URL and the byte range.
`bytes_read` counts the bytes transferred (headers, config, retried partial bodies
included) but the discarded gaps, which `bytes_over_read` counts.

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
ckpt.bytes_over_read                      # 0: one region, no gap
```
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar, final
from urllib.parse import urlsplit

import numpy as np

from .._errors import CheckpointError, PortError
from .._text import quoted
from ._checkpoint import Checkpoint, Region, TensorInfo, check_buffer
from ._fsspec import FsspecTransport
from ._http import DEFAULT_PORTS, grouped, http_transport
from ._hub import hub_transport
from ._ranges import Ranges, iovecs, plan_ranges
from ._runs import batches, runs
from ._safetensors import (
    INDEX,
    MAX_CONFIG,
    MAX_HEADERS,
    MAX_INDEX,
    MAX_SHARDS,
    SINGLE,
    header_length_of,
    header_tensors,
    load_json,
    parse_header,
    plain_name,
    shard_names_in,
)
from ._transport import Missing, OneRangeOnly, RemoteFile, Transport, retried
from ._urls import redact, scheme_of

REQUESTS = 16
"""Range requests in flight at once, per checkpoint."""
NEIGHBOUR = 256 * 2**10
"""A tensor read whole and smaller than this may share a request with its neighbours in the file."""
NEIGHBOURS = 4 * 2**20
"""Bytes of neighbouring small tensors one request asks for at most."""
MAX_OVER_READ = 2.0
"""A remote read fetches at most this many times the bytes it needs, unless told otherwise (`max_over_read`)."""
_T = TypeVar("_T")


def over_read_ratio(value: Any, name: str = "max_over_read") -> float:
    """`value` as a `max_over_read` ratio, a number >= 1 (infinity allowed: any gap up to
    `_ranges.MAX_GAP`); else a one-line PortError naming `name`.

    ```python
    over_read_ratio(2), over_read_ratio(1.5)   # (2.0, 1.5)
    over_read_ratio(0.5)                       # PortError: max_over_read=0.5: expected a number >= 1 ...
    ```
    """
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        ratio = float("nan")
    if isinstance(value, bool) or not ratio >= 1:  # nan too
        raise PortError(
            f"{name}={value!r}: expected a number >= 1, the most bytes a remote read may fetch per byte it "
            "needs (1: exact ranges)"
        )
    return ratio


def transport_for(url: str) -> Transport:
    """The transport that reads `url`'s scheme: HTTP(S) and the Hub by `http.client`, the
    rest by fsspec.

    ```python
    transport_for("s3://bucket/gpt2")    # FsspecTransport
    ```
    """
    scheme = scheme_of(url)
    try:
        urlsplit(url)
    except ValueError as e:  # an unclosed IPv6 bracket, a port that is no number
        raise CheckpointError(f"{redact(url)}: not a URL port can read ({e})") from None
    if scheme in DEFAULT_PORTS:
        return http_transport(url)
    if scheme == "hf":
        return hub_transport(url)
    return FsspecTransport(url)


@final
@dataclass
class RemoteCheckpoint(Checkpoint):
    """A checkpoint read in place from a URL: `directory` is the URL (no credentials),
    each `TensorInfo.file` a `RemoteFile`; `read_into` fetches the regions' byte ranges
    through `transport`, at most `requests` at once, on its own threads (`close` stops
    them and closes the transport's connections); fetching at most `max_over_read` times
    the bytes each read needs, the gaps discarded and counted in `bytes_over_read`.

    ```python
    with open_remote("s3://bucket/gpt2") as ckpt:
        ckpt.read("wte.weight", ((0, 8), (0, 768)))
    ```
    """

    directory: str
    config: dict
    tensors: dict[str, TensorInfo]
    transport: Transport = field(repr=False)
    requests: int = REQUESTS
    max_over_read: float = MAX_OVER_READ
    bytes_read: int = 0
    bytes_over_read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _pool: ThreadPoolExecutor = field(init=False, repr=False)
    _together: dict[str, _Neighbours] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(self.requests, thread_name_prefix="port-remote")
        self.transport.count = self._count

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def _discarded(self, n: int) -> None:
        """`n` bytes counted in `bytes_read` were a bridged gap's: counted in `bytes_over_read` instead."""
        with self._lock:
            self.bytes_read -= n
            self.bytes_over_read += n

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
            if not future.cancelled() and (error := future.exception()) is not None:
                raise error
        return [future.result() for future in futures]

    def expect(self, reads: Mapping[str, Collection[Region]]) -> None:
        """Group the small tensors the load reads whole (its regions of each cover it) that lie
        end to end in a file (a layer's norms and biases), up to `NEIGHBOURS` bytes (and the
        transport's `chunk`, which bounds fsspec's scratch memory): the first
        read of one of them fetches the group in one request, and the others are copied from
        it (each byte still fetched once)."""
        self._together = {}
        small = sorted(
            (
                self.tensors[k]
                for k, regions in reads.items()
                if 0 < self.tensors[k].nbytes < NEIGHBOUR and _covers(self.tensors[k].shape, regions)
            ),
            key=lambda info: (info.file.name, info.offset),
        )
        group: list[TensorInfo] = []
        for info in [*small, None]:
            last = group[-1] if group else None
            if (
                info is None
                or last is None
                or info.file is not last.file
                or info.offset != last.offset + last.nbytes
                or info.offset + info.nbytes - group[0].offset > min(NEIGHBOURS, self.transport.chunk)
            ):
                if len(group) > 1:
                    together = _Neighbours(
                        _file(group[0]), group[0].offset, group[-1].offset + group[-1].nbytes, {i.key for i in group}
                    )
                    self._together.update(dict.fromkeys(together.keys, together))
                group = []
            if info is not None:
                group.append(info)

    def read_into(self, key: str, requests: Sequence[tuple[Region, np.ndarray]]) -> None:
        """Read regions of tensor `key` into their buffers (see `Checkpoint.read_into`): one
        request per stretch of runs lying end to end in the file (and the gaps `max_over_read`
        allows between them), in parallel; a small tensor `expect`ed whole, with its
        neighbours (`expect`)."""
        info = self.tensors[key]
        for region, out in requests:
            check_buffer(info, region, out)
        together = self._together.get(key)
        if together is not None and together.copy(self, info, requests):
            return
        for offsets, lengths, addresses in batches(info, requests):
            ranges = plan_ranges(offsets, lengths, addresses, self.transport.chunk, self.max_over_read)
            if self.transport.multipart:
                groups = grouped(ranges)
            else:
                groups = [(i, i + 1) for i in range(len(ranges))]
            self.parallel([functools.partial(self._fetch_parts, info, ranges.part(lo, hi)) for lo, hi in groups])

    def _fetch(self, info: TensorInfo, ranges: Ranges, i: int) -> None:
        start, stop = int(ranges.starts[i]), int(ranges.stops[i])
        what = f"{info.file}: bytes {start}-{stop - 1} (tensor {quoted(info.key, 200)})"
        retried(what, lambda: self.transport.read(_file(info), start, ranges.pieces_of(i)))

    def _fetch_parts(self, info: TensorInfo, group: Ranges) -> None:
        """Ranges in one request where the server answers several ranges, else one by one; their
        bridged gaps counted as over-read once they are in."""
        if len(group) > 1 and self.transport.multipart:
            what = (
                f"{info.file}: {len(group)} ranges in bytes {int(group.starts[0])}-{int(group.stops[-1]) - 1} "
                f"(tensor {quoted(info.key, 200)})"
            )
            try:
                retried(what, lambda: self.transport.read_parts(_file(info), group))
                self._discarded(group.over_read)
                return
            except OneRangeOnly:
                pass
        for i in range(len(group)):
            self._fetch(info, group, i)
        self._discarded(group.over_read)

    def close(self) -> None:
        """Stop the request threads and close the connections."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.transport.close()


def _file(info: TensorInfo) -> RemoteFile:
    """The remote file a tensor of a `RemoteCheckpoint` lives in."""
    assert isinstance(info.file, RemoteFile)  # open_remote makes every TensorInfo.file a RemoteFile
    return info.file


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
                what = (
                    f"{self.file}: bytes {self.start}-{self.stop - 1} (tensor {quoted(info.key, 200)} "
                    f"and {len(self.keys) - 1} small ones beside it)"
                )
                retried(
                    what, lambda: ckpt.transport.read(self.file, self.start, iovecs([data.ctypes.data], [data.size]))
                )
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


def small_file(transport: Transport, name: str, limit: int, what: str) -> bytes | None:
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
    except Missing:
        raise _Absent from None


def _shards(ckpt: RemoteCheckpoint) -> tuple[list[str], dict[str, tuple[bytes, int, str | None]]]:
    """The safetensors files: the index's, else `model.safetensors`, else those a listing shows;
    and the first bytes of any file already asked for."""
    t = ckpt.transport
    raw = small_file(t, INDEX, MAX_INDEX, "safetensors index")
    if raw is not None:
        return shard_names_in(raw, t.url(INDEX)), {}
    try:
        return [SINGLE], {SINGLE: retried(f"{t.url(SINGLE)}: bytes 0-7", lambda: _present(t.start, SINGLE))}
    except _Absent:
        pass
    listed = sorted(n for n in (t.listing() or []) if n.endswith(".safetensors") and plain_name(n))
    if len(listed) > MAX_SHARDS:
        raise CheckpointError(f"{t.display}: {len(listed)} safetensors files, more than {MAX_SHARDS}")
    if not listed:
        raise CheckpointError(f"{t.display}: no safetensors weights ({SINGLE} or {INDEX})")
    return listed, {}


def remote_headers(ckpt: RemoteCheckpoint, names: list[str], known: dict) -> dict[str, TensorInfo]:
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


def open_remote(url: str, requests: int = REQUESTS, max_over_read: float = MAX_OVER_READ) -> RemoteCheckpoint:
    """Open the checkpoint directory at `url`, reading only `config.json`, the index and the headers.

    **Arguments:**

    - `url`: `http(s)://host/dir`, `hf://org/name[@revision]`, `s3://bucket/prefix`,
      `gs://bucket/prefix` (or any fsspec URL).
    - `requests`: range requests in flight at once.
    - `max_over_read`: a read fetches at most this many times the bytes it needs (a number
      >= 1; 1 asks for exact ranges), see `over_read_ratio`.

    ```python
    with open_remote("hf://openai-community/gpt2") as ckpt:
        ckpt.config["n_layer"]
    ```
    """
    ratio = over_read_ratio(max_over_read)
    transport = transport_for(url)
    ckpt = RemoteCheckpoint(transport.display, {}, {}, transport=transport, requests=requests, max_over_read=ratio)
    try:
        raw = small_file(transport, "config.json", MAX_CONFIG, "config.json")
        if raw is None:
            raise CheckpointError(f"{transport.display}: no config.json")
        config = load_json(raw, transport.url("config.json"))
        if not isinstance(config, dict):
            raise CheckpointError(f"{transport.url('config.json')}: expected a JSON object")
        names, known = _shards(ckpt)
        ckpt.config, ckpt.tensors = config, remote_headers(ckpt, names, known)
        transport.setup(max((info.nbytes for info in ckpt.tensors.values()), default=0))
        return ckpt
    except BaseException:
        ckpt.close()
        raise
