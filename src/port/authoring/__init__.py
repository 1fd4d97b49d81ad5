"""Authoring: what a mapping's author runs: draft a mapping, check it, compare with PyTorch.

- `scaffold` (and `draft`, the same as data): a draft mapping from a checkpoint's
  headers and a module's skeleton; private modules split it by job: `_names`
  (tokens of keys and paths), `_keys` (prefix, `{layer}` and `{expert}` groups, buffers),
  `_pairing` (keys to leaves, transform chains, orientation), `_axes` (logical axes
  from `config.json`, rules), `_fused` (fused tensors, ties), `_render` (the TOML).
- `check`: the mapping against a checkpoint and its model, every problem listed.
- `verify`: the converted model against the PyTorch reference; above the tolerance, its
  `Verification.first_divergence` (a `Divergence`) names where the two first part, each
  module of the reference named a `Suspect` (`_divergence`).

```python
text = port.scaffold("tinylm-checkpoint", TinyLM, "tinylm:TinyLM")
recipe = port.check("draft.toml", "tinylm-checkpoint", mesh="4x2")   # or port.PlanError
result = port.verify("tinylm-checkpoint", "4x2", mapping="draft.toml")
result.first_divergence      # None, or a Divergence: .modules, each a Suspect
```
"""

from ._check import check as check
from ._divergence import Divergence as Divergence
from ._divergence import Suspect as Suspect
from ._draft import Draft as Draft
from ._render import render as render
from ._scaffold import draft as draft
from ._scaffold import scaffold as scaffold
from ._verify import Verification as Verification
from ._verify import verify as verify
