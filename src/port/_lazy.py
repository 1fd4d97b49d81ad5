"""Names a package imports from its own modules when first used (PEP 562), so importing one
name imports only the module that defines it: `port._output` and `port._export` refuse bad
input before JAX is imported.

```python
# in a package's __init__.py, beside `if TYPE_CHECKING:` imports of the same names
__getattr__, __dir__ = lazy(globals(), {"save": "._save", "read_output": "._read"})
```
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy(namespace: dict[str, Any], names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's `__getattr__` and `__dir__`: each of `names` (name -> the relative module it
    is imported from) imported when first asked for and kept in `namespace` (the package's
    `globals()`); any other name an `AttributeError`, as for a module without it."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(names[name], package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
