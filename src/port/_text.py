"""Text for one-line messages: untrusted names quoted and escaped, sizes and counts as people read them.

Pure functions, used by the library's errors and by the command line alike; nothing here prints.

```python
quoted("h.0.attn")       # "'h.0.attn'"
size_text(678_100)       # '678.1 KB'
plural(2, "key")         # '2 keys'
```
"""

from __future__ import annotations

import unicodedata

MAX_LINE = 1000
"""Characters one line port says may have, whatever it quotes: a longer one keeps its beginning and end."""
_ESCAPED = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})  # control, format, surrogate, private, unassigned


def printable(text: str) -> str:
    """`text` with every character a terminal could act on written as its Python escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch == " " or unicodedata.category(ch) not in _ESCAPED else ascii(ch)[1:-1] for ch in text)


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
