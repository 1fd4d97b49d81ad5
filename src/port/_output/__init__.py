"""Port's output: the directory `port convert` writes, restorable onto any mesh.

`_layout` defines the format once (its files, port's metadata fields, the zarr chunk
files, the bounds it is read back under, `is_output`); `_save` writes it (`save`, and
`Saving` for `convert`, which writes each leaf while the next is placed); `_restore`
reads it back, untrusted (`read_output`, `restore`, and `restore_plan`: where each leaf
would land on a mesh, from the metadata alone).

```python
port.save(model, "gpt2-jax", mapping, config)
model = port.restore("gpt2-jax", "2x4")
```
"""

from ._layout import FORMAT as FORMAT
from ._layout import claims_output as claims_output
from ._layout import is_output as is_output
from ._layout import port_version as port_version
from ._restore import LeafPlacement as LeafPlacement
from ._restore import (
    Output as Output,
)
from ._restore import RestorePlan as RestorePlan
from ._restore import (
    describe as describe,
)
from ._restore import (
    read_output as read_output,
)
from ._restore import (
    restore as restore,
)
from ._restore import restore_plan as restore_plan
from ._restore import (
    written_mesh as written_mesh,
)
from ._save import Saving as Saving
from ._save import check_out as check_out
from ._save import save as save
