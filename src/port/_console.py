"""The console: port's own messages, kept apart from what the libraries print.

Everything port tells the user goes through `say` (stderr, `port: ...`) or `show`
(stdout), with text from checkpoints printed literally: a control or formatting
character in a tensor name (a terminal escape sequence, a right-to-left override)
is written as its escape, `\\x1b`, never acted on by the terminal.

The command line calls `quiet_libraries` first: from then on file descriptor 2
goes to /dev/null, and port's own messages (and its progress bar, through
`stream()`) to a duplicate of the user's stderr. JAX and the libraries it loads
print from C++ threads and from callbacks (absl logs) that no Python setting
reaches; a failure then reads as one line.
`PORT_DEBUG=1` leaves stderr as it is.

Untrusted text is escaped by `_text`'s pure functions, which the library uses too.

```python
say("converted gpt2")                     # port: converted gpt2
```
"""

from __future__ import annotations

import io
import os
import sys
from typing import TextIO

from ._text import printable, shortened

_fd = 2  # the user's stderr
_stream: TextIO | None = None


def stream() -> TextIO:
    """A text stream on the user's stderr, for port's own output (the progress bar)."""
    global _stream
    if _stream is None:
        opened: TextIO = (
            sys.stderr
            if _fd == 2
            else io.TextIOWrapper(io.FileIO(_fd, "w", closefd=False), line_buffering=True, errors="backslashreplace")
        )
        _stream = opened
    return _stream


failed = False  # whether this process has said an error: it says at most one


def say(message: str) -> None:
    """Print `port: MESSAGE` on the user's stderr, on one line, literally, at most `_text.MAX_LINE` characters."""
    global failed
    failed = failed or message.startswith(("error:", "internal error:"))
    line = shortened("port: " + printable(message.replace("\n", "\\n"))) + "\n"
    for s in (sys.stdout, stream()):
        try:
            s.flush()
        except (OSError, ValueError):
            pass
    os.write(_fd, line.encode("utf-8", errors="backslashreplace"))


def clear_line() -> None:
    """On a terminal, clear the line the cursor is on and show the cursor: what a worker's
    progress bar left there when the worker was stopped mid-draw."""
    try:
        if os.isatty(_fd):
            os.write(_fd, b"\r\x1b[2K\x1b[?25h")
    except OSError:
        pass


def show(text: str) -> None:
    """Print `text` (lines of port's own output) on stdout, literally."""
    sys.stdout.write("\n".join(printable(line) for line in text.split("\n")))


def quiet_libraries() -> None:
    """Send file descriptor 2 to /dev/null, keeping the user's stderr for `say` and `stream`."""
    global _fd, _stream
    if _fd != 2 or os.environ.get("PORT_DEBUG"):
        return
    sys.stderr.flush()
    _fd = os.dup(2)
    _stream = None
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
