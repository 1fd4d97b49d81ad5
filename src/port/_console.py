"""The console: port's own messages, kept apart from what the libraries print.

Everything port tells the user goes through `say` (stderr, `port: ...`) or `show`
(stdout), with text from checkpoints printed literally: a control or formatting
character in a tensor name (a terminal escape sequence, a right-to-left override)
is written as its escape, `\\x1b`, never acted on by the terminal.

The command line calls `quiet_libraries` first: from then on file descriptor 2
goes to /dev/null, and port's own messages (and its progress bar, through
`stream()`) to a duplicate of the user's stderr. JAX, Orbax and tensorstore print
from C++ threads and from callbacks (absl logs, "Event loop is closed"
tracebacks) that no Python setting reaches; a failure then reads as one line.
`PORT_DEBUG=1` leaves stderr as it is.

```python
say("converted gpt2")                     # port: converted gpt2
printable("h.0.\\x1b[2Jattn")              # 'h.0.\\\\x1b[2Jattn'
```
"""

from __future__ import annotations

import io
import os
import sys
import unicodedata
from typing import TextIO

MAX_LINE = 1000
"""Characters one line port says may have, whatever it quotes: a longer one keeps its beginning and end."""
_ESCAPED = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})  # control, format, surrogate, private, unassigned
_fd = 2  # the user's stderr
_stream: TextIO | None = None


def printable(text: str) -> str:
    """`text` with every character a terminal could act on written as its Python escape."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch == " " or unicodedata.category(ch) not in _ESCAPED else ascii(ch)[1:-1] for ch in text
    )


def quoted(value: object, limit: int = 80) -> str:
    """An untrusted name or value for a one-line message: quoted, escaped, cut to `limit` characters.

    ```python
    quoted("h.0.attn")        # "'h.0.attn'"
    quoted("a\x1b[2J" * 50)   # "'a\\x1b[2Ja\\x1b[2J...'..." (at most 80 characters quoted)
    quoted(3.5)               # '3.5'
    ```
    """
    text = value if isinstance(value, str) else repr(value)
    cut = text[:limit]
    shown = repr(cut) if isinstance(value, str) else printable(cut)
    return shown + ("..." if len(text) > limit else "")


def first_line(error: BaseException) -> str:
    """An exception's message as its first line, or its type's name when it has none.

    ```python
    first_line(ValueError("bad value\nmore"))   # 'bad value'
    first_line(KeyError())                       # 'KeyError'
    ```
    """
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def described(error: BaseException) -> str:
    """An exception as its type and first line: `KeyError: 'n_embd'`, or `KeyError` alone."""
    text = first_line(error)
    return type(error).__name__ if text == type(error).__name__ else f"{type(error).__name__}: {text}"


def one_line(text: str, limit: int = 500) -> str:
    """`text` (which may quote untrusted input) as one line of printable characters, at most `limit` of them."""
    text = printable(" ".join(text.split()))
    return text if len(text) <= limit else text[:limit] + "..."


def shortened(text: str, limit: int = MAX_LINE) -> str:
    """`text` in at most `limit` characters: its beginning and end, and how many were cut between them.

    ```python
    shortened("port: error: tensor 'h." + "x" * 5000 + "' is not used", 60)
    # "port: error: te ... (5007 characters cut) ... x' is not used"
    ```
    """
    if len(text) <= limit:
        return text
    marker = " ... ({} characters cut) ... "
    keep = max(0, limit - len(marker.format(len(text))))
    end = keep // 2
    return text[: keep - end] + marker.format(len(text) - keep) + text[len(text) - end :]


def size_text(n: float) -> str:
    """Bytes as people read them: `678.1 KB`, `497.8 MB` (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"


def plural(n: int, noun: str) -> str:
    """`n` and the noun, plural unless one: `plural(1, "key")` is `1 key`, `plural(2, "key")` `2 keys`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def count_text(n: int) -> str:
    """A parameter count as people read it: `169.5K`, `124.4M`, `7.24B`."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def stream() -> TextIO:
    """A text stream on the user's stderr, for port's own output (the progress bar)."""
    global _stream
    if _stream is None:
        _stream = sys.stderr if _fd == 2 else io.TextIOWrapper(
            io.FileIO(_fd, "w", closefd=False), line_buffering=True, errors="backslashreplace"
        )
    return _stream


failed = False  # whether this process has said an error: it says at most one


def say(message: str) -> None:
    """Print `port: MESSAGE` on the user's stderr, on one line, literally, at most `MAX_LINE` characters."""
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
