"""Export: a sharded model written back as a Hugging Face checkpoint directory, by its mapping.

`_invert` walks the plan backwards to the checkpoint's tensors; `_blocks` turns each
device block into its box of one of them; `_safetensors` writes the files (headers,
offsets, index, as `save_pretrained` lays them out); `_staging` assembles the next
tensor while a thread writes the last; `_quantize` writes Linear weights in FP8 with
block scales (`quantize="fp8"`, whose arguments `_quantize_args` checks without NumPy);
`_export` drives it (`export`, `is_export`) and `_report` says what it did (`ExportReport`).

Names are imported when first used, each from its own module: `parse_size` imports no
JAX, so `port export` refuses a bad `--max-shard-size` without starting it.

```python
port.export(model, "gpt2-hf", "gpt2")
```
"""

from typing import TYPE_CHECKING

from .._lazy import lazy

_EXPORTS = {
    "ExportReport": "._report",
    "blocks_held": "._report",
    "export": "._export",
    "is_export": "._export",
    "Inverse": "._invert",
    "invert": "._invert",
    "parse_size": "._safetensors",
}

if TYPE_CHECKING:  # what the names are, for type checkers; at run time they are imported when first used
    from ._export import export, is_export
    from ._invert import Inverse, invert
    from ._report import ExportReport, blocks_held
    from ._safetensors import parse_size

__all__ = [
    "ExportReport",
    "Inverse",
    "blocks_held",
    "export",
    "invert",
    "is_export",
    "parse_size",
]  # the names of _EXPORTS, sorted

__getattr__, __dir__ = lazy(globals(), _EXPORTS)
