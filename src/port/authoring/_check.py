"""Check: a mapping against a checkpoint and its model, on a mesh's shape, reading no tensor data.

Everything `plan` checks (every leaf filled once, every key used, ignored or tied,
shapes, dtypes, rules and mesh axes) is checked, and every problem found is
reported, not only the first; so is every `# CHECK` comment `port scaffold` left
(a guess the author has not yet confirmed). No device is needed: the mesh is only its axis sizes.

```python
try:
    recipe = check("draft.toml", "tinylm-checkpoint", mesh="4x2")
except port.PlanError as e:
    print("\\n".join(e.problems))
```
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections import Counter
from collections.abc import Iterable
from collections.abc import Mapping as AnyMapping

import numpy as np
from jax.sharding import Mesh

from .._errors import PlanError
from .._export import invert
from .._mapping import Mapping, load_mapping, mapping_for
from .._plan import Plan, plan_problems
from .._runtime import as_shape
from .._skeleton import skeleton
from .._sources import Checkpoint, open_checkpoint
from .._text import plural, quoted
from .._transforms import toml_inline


def check(
    mapping: str | os.PathLike | Mapping | None,
    checkpoint: str | os.PathLike | Checkpoint,
    mesh: str | AnyMapping[str, int] | Mesh | None = None,
    dtype: str | np.dtype | None = None,
) -> Plan:
    """Check a mapping against a checkpoint and the model it names, listing every problem.

    Reads the mapping, the checkpoint's `config.json` and tensor headers, and builds
    the model's skeleton; reads no tensor data and needs no device.

    **Arguments:**

    - `mapping`: a mapping file or a parsed `Mapping`; None: the shipped mapping for the
      checkpoint's `model_type` (what `port plan` shows).
    - `checkpoint`: a checkpoint directory, a Hugging Face repo id, or an opened
      `Checkpoint` (one this opens, it closes).
    - `mesh`: the mesh to plan for: a spec such as `"4x2"` or `"data=2,model=2"`, axis
      sizes such as `{"data": 2, "model": 2}`, or a `Mesh` (only its shape is used);
      default: `"1x1"`.
    - `dtype`: plan a cast of the floating parameters to it (`"bfloat16"`, ...).

    Returns the `Plan` when the mapping fits, and can be walked backwards by `port export`
    (a fused tensor needs an entry for each of its parts). Raises `PlanError` otherwise, whose
    `problems` list every problem found, each naming its entry or key.

    ```python
    recipe = port.check("mappings/gpt2.toml", "gpt2", mesh="data=2,model=2")
    len(recipe.leaves), recipe.params         # 20, 124439808
    ```
    """
    shape = as_shape(mesh)
    parsed = None if mapping is None else mapping if isinstance(mapping, Mapping) else load_mapping(mapping)
    owned = not isinstance(checkpoint, Checkpoint)
    ckpt = open_checkpoint(checkpoint) if owned else checkpoint
    try:
        parsed = mapping_for(ckpt.config, parsed, keys=ckpt.tensors)
        result = plan_problems(skeleton(parsed, ckpt.config), parsed, ckpt.tensors, ckpt.config, shape, dtype)
        headers = {key: (info.shape, info.dtype) for key, info in ckpt.tensors.items()}
    finally:
        if owned:
            ckpt.close()
    marked = unresolved(parsed)
    if not isinstance(result, Plan) or marked:
        hint = [] if isinstance(result, Plan) else missing_prefix(parsed, headers)
        raise PlanError([*hint, *([] if isinstance(result, Plan) else result), *marked])
    invert(result, headers, parsed.source)  # `port export` walks it backwards: every entry must invert
    return result


def unresolved(mapping: Mapping) -> list[str]:
    """A problem for each `# CHECK` comment `port scaffold` left in the mapping's text: a guess
    (an orientation, one of several candidates, an axis) the author has not yet confirmed.

    ```python
    unresolved(load_mapping("draft.toml"))   # ["draft.toml:31: a CHECK of port scaffold's is still there: ..."]
    ```
    """
    problems = []
    for number, line in enumerate((mapping.text or "").splitlines(), 1):
        at = line.find("# CHECK")
        if at >= 0:
            problems.append(
                f"{mapping.source}:{number}: a CHECK of port scaffold's is still there "
                f"({line[at + 2 :].strip()[:160]}): decide, then delete the comment"
            )
    return problems


def missing_prefix(mapping: Mapping, keys: Iterable[str]) -> list[str]:
    """One problem suggesting the key prefix that would let the mapping's entries match
    keys they now miss (`decoder.` of OPT's `decoder.layers.0.fc1.weight`), or none.

    A key no entry, `ignore` pattern or `tied` name takes, once the mapping's own
    `prefixes` are stripped, counts for the leading segments whose removal makes an
    entry match it; the prefix counted most is suggested.

    ```python
    missing_prefix(load_mapping("opt.toml"), ["decoder.layers.0.fc1.weight", ...])
    # ["opt.toml: 32 keys begin with 'decoder.' and match entries without it: add prefixes = [\"decoder.\"]?"]
    ```
    """
    alternatives = [param.regex(named=False) for param in mapping.params]
    entries = re.compile("|".join(alternatives)) if alternatives else None  # one match a name, not one an entry

    def taken(name: str) -> bool:
        return entries is not None and entries.fullmatch(name) is not None

    counts: Counter[str] = Counter()
    for key in keys:
        name = mapping.key_name(key)
        if taken(name) or name in mapping.tied or any(fnmatch.fnmatchcase(name, p) for p in mapping.ignore):
            continue
        segments = key.split(".")
        for n in range(1, len(segments)):
            if taken(".".join(segments[n:])):
                counts[".".join(segments[:n]) + "."] += 1
                break
    if not counts:
        return []
    prefix, count = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    prefixes = sorted({*mapping.prefixes, prefix}, key=lambda p: (-len(p), p))  # the longest is stripped first
    return [
        f"{mapping.source}: {plural(count, 'key')} begin with {quoted(prefix)} and match entries without it: "
        f"add prefixes = {toml_inline(prefixes)}?"
    ]
