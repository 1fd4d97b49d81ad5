"""URLs of remote checkpoints: which names are URLs, and URLs as port shows them (no credentials).

A URL may carry credentials (`https://user:password@host/dir?token=...`); port never
prints or records them: `redact` removes the user info, the query and the fragment,
`shown` does it to anything that is a URL, and `reason` to an exception's text.

```python
is_url("s3://bucket/gpt2"), is_url("gpt2")             # True, False
redact("https://me:secret@host/dir/?token=x")          # 'https://host/dir'
```
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .._paths import URL_SCHEME
from .._paths import is_url as is_url  # there, so that the command line tells a URL without this package
from .._text import described, one_line


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


def reason(error: BaseException) -> str:
    """An exception as a few words: its type, and its scrubbed first line.

    ```python
    reason(TimeoutError("timed out"))   # 'TimeoutError: timed out'
    ```
    """
    return _scrub(described(error))


def scheme_of(url: str) -> str:
    """The scheme of the URL `url` (one `is_url` accepts), in lower case.

    ```python
    scheme_of("HTTPS://host/gpt2")   # 'https'
    ```
    """
    match = URL_SCHEME.match(url)
    assert match is not None  # `url` is one `is_url` accepts
    return match.group(1).lower()
