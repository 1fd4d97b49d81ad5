"""What `quantize=` and `quantize_block=` of `port.export` (`--quantize`, `--quantize-block`) accept.

Checked here without NumPy, so that the command line's parser refuses a bad value (a usage
error) before any work; `_quantize` does the quantizing.

```python
check_method("fp8")                                   # 'fp8'
parse_block("128x128"), parse_block("64"), parse_block((64, 128))   # (128, 128), (64, 64), (64, 128)
```
"""

from __future__ import annotations

import re
from typing import Any

from .._errors import PortError
from .._text import quoted

METHODS = ("fp8",)
"""The formats `port export` writes: `fp8`, e4m3 with block scales (DeepSeek / Qwen's layout)."""

DEFAULT_BLOCK = (128, 128)
"""The block of `quantize="fp8"` unless `quantize_block` says otherwise: DeepSeek-V3's and Qwen3's."""

MAX_BLOCK = 2**31 - 1
"""The largest block side: a block larger than every tensor is one scale per tensor already."""

_BLOCK = re.compile(r"([0-9]{1,10})(?:[xX]([0-9]{1,10}))?")


def check_method(method: Any, name: str = "quantize") -> str:
    """`method` when it is one of `METHODS`, else a one-line `PortError` naming `name`."""
    if not isinstance(method, str) or method not in METHODS:
        raise PortError(f"{name}={quoted(method, 40)}: expected {' or '.join(METHODS)}")
    return method


def parse_block(value: Any, name: str = "quantize_block") -> tuple[int, int]:
    """A block `(rows, columns)` from `"128x128"`, `"128"` (square), `128` or `(128, 64)`; each side
    from 1 to `MAX_BLOCK`, else a one-line `PortError` naming `name`.

    ```python
    parse_block("64x128")     # (64, 128)
    ```
    """
    sides: Any = None
    if isinstance(value, str):
        found = _BLOCK.fullmatch(value.strip())
        if found is not None:
            sides = (int(found[1]), int(found[2] or found[1]))
    elif isinstance(value, int) and not isinstance(value, bool):
        sides = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        if all(isinstance(n, int) and not isinstance(n, bool) for n in value):
            sides = (value[0], value[1])
    if sides is None or not all(1 <= n <= MAX_BLOCK for n in sides):
        raise PortError(
            f"{name}={quoted(str(value) if isinstance(value, str) else value, 40)}: expected a block of "
            f"positive sizes ROWSxCOLUMNS, as 128x128, or one size for a square block"
        )
    return sides
