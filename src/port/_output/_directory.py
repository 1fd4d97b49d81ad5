"""The directory `save` writes: checked before anything is read, and what `force` may replace there.

No JAX here: `port convert` refuses its `--out` before JAX is imported.

```python
check_out("out/gpt2", force=True, inputs=("ckpt/gpt2",))   # Path('/abs/out/gpt2')
```
"""

from __future__ import annotations

import os
from pathlib import Path

from .._destination import check_destination
from .._paths import check_path
from ._layout import is_output

OUTPUT_KIND = "a port output (Orbax's checkpoint of params/ and port/ only)"
"""What `force` may replace at `save`'s directory, as messages say it (see `is_output`)."""


def check_out(
    directory: str | os.PathLike, force: bool = False, inputs: tuple[str | os.PathLike, ...] = (), name: str = "out"
) -> Path:
    """The absolute output path, refusing any target that writing or replacing would harm.

    `check_destination` for port's output: `force` replaces only an earlier port output
    (`is_output`), and never a directory that is or contains one of `inputs`. A path port
    cannot write or record (not UTF-8, a name or the whole too long: `check_path`) is refused first.

    **Arguments:**

    - `directory`: the output directory.
    - `force`: allow replacing an earlier port output there.
    - `inputs`: what the run reads (the checkpoint): a directory that is or contains one is refused.
    - `name`: the caller's parameter, as messages name it (`out=...: ...`).

    ```python
    check_out("out/gpt2", force=True, inputs=("ckpt/gpt2",))   # Path('/abs/out/gpt2')
    ```
    """
    check_path(directory, name, written=True)
    return check_destination(directory, force, inputs, ours=is_output, what=OUTPUT_KIND, name=name)
