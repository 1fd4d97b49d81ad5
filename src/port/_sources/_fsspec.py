"""Any file system fsspec knows (`s3://`, `gs://`, ...): a checkpoint's files read by byte range.

`info` gives a file's size, `cat_file` with a byte range (or a seek and a read, with
no read-ahead) its bytes, copied into the caller's memory. The answers in flight take
at most `MIN_SCRATCH` bytes, or half the largest tensor, of scratch memory (`_Budget`).
Each library's errors are sorted: a missing file, access denied, a request no retry
mends (the cloud SDKs' credential and region errors, a 4xx), and the rest, retried.

```python
t = FsspecTransport("s3://bucket/gpt2")
t.start("model.safetensors")       # (b'...', 548105171, None)
```
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, final

import numpy as np

from .._errors import CheckpointError
from ._ranges import Ranges, scatter
from ._transport import RETRIED, Missing, OneRangeOnly, Permanent, RemoteFile, Transient, Transport
from ._urls import reason, redact, scheme_of

SCRATCH_CHUNK = 8 * 2**20
"""Bytes one fsspec request asks for at most (its answer is copied into the destination)."""
MIN_SCRATCH = 4 * 2**20
"""Scratch memory fsspec answers may always take; else half the largest tensor."""
_PERMANENT = {  # the cloud SDKs' errors that no retry mends (anything else an fsspec call raises is retried)
    "NoCredentialsError",
    "PartialCredentialsError",
    "DefaultCredentialsError",
    "RefreshError",
    "NoRegionError",
    "ParamValidationError",
    "InvalidRegionError",
}
_T = TypeVar("_T")


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


@final
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
        scheme = scheme_of(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except ImportError as e:
            extra = {"s3": "port[s3]", "gs": "port[gcs]", "gcs": "port[gcs]"}.get(scheme)
            hint = f"pip install '{extra}'" if extra else reason(e)
            raise CheckpointError(f"{self.display}: reading {scheme}:// URLs needs another package ({hint})") from None
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{self.display}: not a URL port can read ({reason(e)})") from None
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
            raise Missing("not found") from None
        except PermissionError as e:
            raise Permanent(f"access denied ({reason(e)}): check the credentials") from None
        except (IsADirectoryError, NotADirectoryError, ImportError, NotImplementedError, TypeError, ValueError) as e:
            raise Permanent(reason(e)) from None
        except Exception as e:  # noqa: BLE001 - each library raises its own network errors
            status = _status_of(e)
            settled = status is not None and not (status in RETRIED or status >= 500)
            if settled or _PERMANENT & {cls.__name__ for cls in type(e).__mro__}:
                raise Permanent(reason(e)) from None
            raise Transient(reason(e)) from None

    def _size(self, name: str) -> int:
        info = self._call(self.fs.info, self._path(name))
        if info.get("type", "file") != "file" or not isinstance(info.get("size"), int):
            raise Permanent("not a file")
        return info["size"]

    def _cat(self, name: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of file `name`, exactly, counted."""
        with self._lock:
            self.sent += 1
        data = self._call(self._fetch, self._path(name), start, stop)
        self.count(len(data))
        if len(data) != stop - start:
            raise Transient(f"the answer holds {len(data)} of {stop - start} bytes")
        return data

    def _fetch(self, path: str, start: int, stop: int) -> bytes:
        from fsspec.asyn import AsyncFileSystem

        if isinstance(self.fs, AsyncFileSystem):  # s3fs, gcsfs: one ranged GET
            return self.fs.cat_file(path, start=start, end=stop)  # pyright: ignore[reportReturnType]  # fsspec is untyped: its inferred str counts text mode; a ranged cat_file is bytes
        with self.fs.open(path, "rb", cache_type="none") as f:  # no read-ahead: exactly the range
            f.seek(start)
            return f.read(stop - start)

    def small(self, name: str, limit: int, what: str) -> bytes:
        size = self._size(name)
        if size > limit:
            raise Permanent(f"{size} bytes, more than a {what} may have ({limit})")
        return self._cat(name, 0, size) if size else b""

    def start(self, name: str) -> tuple[bytes, int, str | None]:
        size = self._size(name)
        return (self._cat(name, 0, min(8, size)) if size else b""), size, None

    def read(self, file: RemoteFile, start: int, pieces: np.ndarray) -> None:
        size = int(pieces[:, 1].sum())
        with self._budget.take(size):
            data = np.frombuffer(self._cat(file.name, start, start + size), np.uint8)
            scatter(data.ctypes.data, pieces)

    def listing(self) -> list[str]:
        try:
            names = self._call(self.fs.ls, self._root, detail=False)
        except Missing:
            return []
        return [str(name).rstrip("/").rsplit("/", 1)[-1] for name in names]

    @property
    def chunk(self) -> int:
        return min(SCRATCH_CHUNK, self._budget.capacity)

    def setup(self, largest: int) -> None:
        self._budget = _Budget(max(MIN_SCRATCH, largest // 2))

    def read_parts(self, file: RemoteFile, ranges: Ranges) -> None:
        """Never several ranges in one request: each range is a `cat_file` of its own."""
        raise OneRangeOnly

    def close(self) -> None:
        """Nothing to release: fsspec keeps its file systems' sessions itself."""


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
