"""Export: a sharded model written back as a Hugging Face checkpoint directory, by its mapping.

`_invert` walks the plan backwards to the checkpoint's tensors; `_blocks` turns each
device block into its box of one of them; `_safetensors` writes the files (headers,
offsets, index, as `save_pretrained` lays them out); `_staging` assembles the next
tensor while a thread writes the last; `_export` drives it (`export`, `is_export`).

```python
port.export(model, "gpt2-hf", "gpt2")
```
"""

from ._export import export as export
from ._export import is_export as is_export
from ._invert import Inverse as Inverse
from ._invert import invert as invert
from ._safetensors import parse_size as parse_size
