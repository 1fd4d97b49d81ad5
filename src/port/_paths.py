"""Names of checkpoints and files as users give them: a URL told from a local path, and a path
checked for what the system and port's own records can hold, so that one that cannot work is
refused in one line before any work (no JAX, no NumPy here: the command line checks its paths
while parsing).

- Every path is UTF-8: port records paths as JSON text (an output's metadata, a run report,
  `--json`), and a name holding bytes that are not UTF-8 (Python's lone surrogates for them)
  is not text.
- No name in a path is longer than `NAME_MAX` bytes; a name port writes leaves room for the
  hidden sibling it writes first (`.NAME.port-partial-TOKEN.owner`).
- The absolute path is shorter than `PATH_MAX` bytes.

```python
is_url("s3://bucket/gpt2"), is_url("ckpt/gpt2")    # True, False
path_problem("out/gpt2")                           # None
path_problem("out/" + "a" * 256)                   # "its name 'aaaa...' is 256 bytes, more than ..."
check_path("out/\\udcff", "out")                   # PortError: out=out/\\udcff: not UTF-8 (byte 0xff) ...
```
"""

from __future__ import annotations

import os
import re

from ._errors import PortError
from ._leftovers import OWNER
from ._text import quoted, shortened

URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
"""The start of a URL (`scheme://`): what tells a URL from a local path or a repo id."""

NAME_MAX = 255
"""Bytes in one name of a path (Linux's, and that of the file systems people use)."""
PATH_MAX = 4096
"""Bytes in a path the system takes, its terminating NUL included (Linux's)."""
WRITTEN_NAME_MAX = NAME_MAX - len(f"..port-partial-{'0' * 16}{OWNER}")
"""Bytes in the name of what port writes: it writes `.NAME.port-partial-TOKEN` (and its `.owner`) first."""


def is_url(model: object) -> bool:
    """Whether `model` is a URL (`scheme://...`) rather than a local path or a repo id.

    ```python
    is_url("s3://bucket/gpt2"), is_url("gpt2"), is_url("ckpt/gpt2")   # True, False, False
    ```
    """
    return isinstance(model, str) and URL_SCHEME.match(model) is not None


def _not_utf8(text: str) -> str | None:
    """What in `text` is not UTF-8, or None: a byte the system decoded as a lone surrogate
    (`os.fsdecode`'s surrogateescape), or a lone surrogate given as such."""
    for ch in text:
        if "\ud800" <= ch <= "\udfff":
            if "\udc80" <= ch <= "\udcff":
                return f"byte 0x{ord(ch) - 0xDC00:02x}"
            return f"lone surrogate {ascii(ch)[1:-1]}"
    return None


def path_problem(path: str | os.PathLike[str], *, written: bool = False, local: bool = True) -> str | None:
    """What makes `path` one port cannot use, as the words after its name in a message; None if nothing.

    **Arguments:**

    - `path`: the path (or, with `local=False`, a URL) given.
    - `written`: port writes it (an output, a report): its last name leaves room for the
      hidden sibling port writes first (`WRITTEN_NAME_MAX`).
    - `local`: a local path; False for a URL, which is checked for UTF-8 alone.

    ```python
    path_problem("ckpt/gpt2")                               # None
    path_problem("x" * 230, written=True)                   # "its name 'xxx...' is 230 bytes; ..."
    ```
    """
    text = os.fspath(path)
    bad = _not_utf8(text)
    if bad is not None:
        return f"not UTF-8 ({bad}); port records paths as JSON text: give a name that is UTF-8"
    if not local:
        return None
    names = [name for name in text.split("/") if name]
    for i, name in enumerate(names):
        size = len(name.encode())
        last = written and i == len(names) - 1
        if size > NAME_MAX or (last and size > WRITTEN_NAME_MAX):
            limit = (
                f"more than the {NAME_MAX} a name may have"
                if size > NAME_MAX
                else f"port writes it under a hidden name {NAME_MAX - WRITTEN_NAME_MAX} bytes longer first, "
                f"and a name may have {NAME_MAX}: at most {WRITTEN_NAME_MAX}"
            )
            return f"its name {quoted(name, 40)} is {size} bytes, {limit}"
    try:
        size = len(os.path.abspath(text).encode())
    except OSError:  # no working directory (removed): the system says so when the path is used
        return None
    if size >= PATH_MAX:
        return f"{size} bytes as an absolute path, more than the {PATH_MAX - 1} a path may have"
    return None


def check_path(path: str | os.PathLike[str], name: str, *, written: bool = False, local: bool = True) -> None:
    """Refuse `path` (the parameter `name`, as messages name it: `out=...: ...`) with a one-line
    `PortError` if `path_problem` finds a problem with it."""
    problem = path_problem(path, written=written, local=local)
    if problem is not None:
        raise PortError(f"{name}={shortened(os.fspath(path), 200)}: {problem}")
