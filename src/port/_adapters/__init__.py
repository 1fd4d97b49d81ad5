"""PEFT LoRA adapters: read onto a base checkpoint, merged as they are read or kept as `port.nn.LoRA` leaves.

The modules, one idea each:

- `_peft`: `open_adapter`, an adapter directory (or Hub id, or URL) read and checked
  against the base's headers before any tensor byte is read: `Adapter`, `Target`.
- `_merged`: `MergedCheckpoint`, the base read as if the adapter were merged into it
  (each block from only the factor rows and columns it needs).

```python
model = port.load("tiny-llama", adapter="tiny-llama-lora", mesh="4x2")   # merged
```
"""

from ._merged import MergedCheckpoint as MergedCheckpoint
from ._peft import Adapter as Adapter
from ._peft import Target as Target
from ._peft import open_adapter as open_adapter
