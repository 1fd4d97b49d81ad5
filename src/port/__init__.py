"""port: stream PyTorch / Hugging Face safetensors checkpoints into sharded Equinox models.

The pipeline: source -> mapping -> skeleton -> plan -> place -> fill -> save.

```python
import port

mesh = port.make_mesh("4x2")                 # axes data x model
model = port.load("gpt2", mesh=mesh)          # every leaf a sharded jax.Array
port.save(model, "out/gpt2", port.mapping_for(config), config)
model = port.restore("out/gpt2", port.make_mesh("2x4"))
```
"""

from ._distributed import initialize as initialize
from ._errors import PortError as PortError
from ._fill import fill as fill
from ._load import convert as convert, load as load
from ._mapping import (
    Mapping as Mapping,
    Param as Param,
    load_mapping as load_mapping,
    mapping_for as mapping_for,
    parse_mapping as parse_mapping,
)
from ._mesh import make_mesh as make_mesh, mesh_shape as mesh_shape
from ._place import place as place
from ._plan import LeafPlan as LeafPlan, Plan as Plan, plan as plan
from ._save import restore as restore, save as save
from ._scaffold import scaffold as scaffold
from ._skeleton import skeleton as skeleton
from ._source import Checkpoint as Checkpoint, open_checkpoint as open_checkpoint
from ._verify import Verification as Verification, verify as verify

__version__ = "0.1.0"
