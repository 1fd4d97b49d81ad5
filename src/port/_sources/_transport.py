"""Transports: how one kind of URL is read, and how its failures are sorted and retried.

`Transport` is the abstract interface a remote checkpoint reads through: a small file
whole, a file's first bytes and size, and byte ranges straight into the caller's
memory. Its final classes are `HttpTransport` (`http(s)://`, and the Hub's URLs) and
`FsspecTransport` (`s3://`, `gs://`, any file system fsspec knows).

A transport's methods fail with `Transient` (worth retrying: a dropped connection, a
503, a short body), `Permanent` (no retry mends it: access denied, a file that
changed) or `Missing` (the file is not there); `retried` retries the first with
exponential backoff, `ATTEMPTS` attempts in all, and turns what still fails into one
`CheckpointError` line naming the URL and the byte range.

```python
first, size, etag = retried("https://host/m.safetensors: bytes 0-7", lambda: transport.start("m.safetensors"))
```
"""

from __future__ import annotations

import abc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from .._errors import CheckpointError
from ._ranges import Ranges

ATTEMPTS = 6
"""Tries of one request before its failure is reported."""
BACKOFF = 0.1
"""Seconds before the first retry; doubled each time, with jitter (about 3 s in all)."""
RETRIED = {408, 425, 429}
"""HTTP statuses worth retrying, besides the 5xx ones."""
_T = TypeVar("_T")


class Transient(Exception):
    """A failure worth retrying (the message says what happened)."""


class Permanent(Exception):
    """A failure no retry will mend."""


class Missing(Permanent):
    """The file is not there."""


class OneRangeOnly(Exception):
    """The server answered a request for several ranges otherwise than part by part."""


def retried(what: str, attempt: Callable[[], _T]) -> _T:
    """`attempt()`, retried with exponential backoff while it fails transiently.

    Failures become one `CheckpointError` line: `what` (the URL and byte range), then why.

    ```python
    retried("https://host/m.safetensors: bytes 0-7", lambda: transport.start("m.safetensors"))
    ```
    """
    last: Transient | None = None  # set: ATTEMPTS > 0
    for i in range(ATTEMPTS):
        try:
            return attempt()
        except Transient as e:
            last = e
            if i + 1 < ATTEMPTS:
                time.sleep(BACKOFF * 2**i * random.uniform(0.5, 1.0))
        except Permanent as e:
            raise CheckpointError(f"{what}: {e}") from None
    raise CheckpointError(f"{what}: {last} (gave up after {ATTEMPTS} attempts)")


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


class Transport(abc.ABC):
    """How one kind of URL is read: small whole files, a file's first bytes and size, byte ranges.

    Methods raise `Transient`, `Permanent` or `Missing`; `retried` turns them into
    one line. Every byte received is passed to `count` (the checkpoint reading through
    the transport sets it), and every request sent is counted in `sent`.

    ```python
    transport = transport_for("https://host/gpt2")     # an HttpTransport
    transport.small("config.json", 8 << 20, "config.json")
    ```
    """

    display: str
    """The URL of the directory as port shows it (no credentials)."""
    count: Callable[[int], None] = staticmethod(lambda n: None)
    sent = 0
    """Requests sent so far (retries and redirects included)."""
    multipart = False
    """Whether `read_parts` may be asked for several ranges in one request (HTTP, until a server declines)."""

    def url(self, name: str) -> str:
        """The URL of file `name` as port shows it (no credentials)."""
        return f"{self.display}/{name}"

    @property
    @abc.abstractmethod
    def chunk(self) -> int:
        """Bytes one request asks for at most."""

    @abc.abstractmethod
    def small(self, name: str, limit: int, what: str) -> bytes:
        """The whole of a small file, refused unread past `limit` bytes."""

    @abc.abstractmethod
    def start(self, name: str) -> tuple[bytes, int, str | None]:
        """A file's first (up to) 8 bytes, its size and its ETag if the server gives a strong one."""

    @abc.abstractmethod
    def read(self, file: RemoteFile, start: int, pieces: np.ndarray) -> None:
        """Fill `pieces` (an `iovecs` array: the caller's memory, in order) with the file's bytes from `start` on."""

    @abc.abstractmethod
    def read_parts(self, file: RemoteFile, ranges: Ranges) -> None:
        """Fill several ranges' pieces from one request; `OneRangeOnly` where the transport or server will not."""

    @abc.abstractmethod
    def listing(self) -> list[str] | None:
        """The directory's file names, or None where the protocol cannot list (HTTP)."""

    @abc.abstractmethod
    def setup(self, largest: int) -> None:
        """Told the largest tensor's size once the headers are read."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections."""
