"""The errors port raises for bad input, one base class and a subclass per kind.

Every one is a `PortError`: its message is one line naming the file, key or parameter
and what is wrong, which the command line prints as `port: error: ...` (exit 1). A
parameter is named in Python's keyword form, `mesh='2x3': ...` or mid-sentence
`num_processes=2`; the command line shows it as its flag (`--mesh '2x3': ...`).
Callers that need to tell them apart catch a subclass:

```python
try:
    model = port.load("ckpt/", mesh="4x2")
except port.PlanError as e:        # the mapping does not fit this checkpoint or model
    for problem in e.problems:
        print(problem)
except port.CheckpointError:       # a missing, unreadable or malformed checkpoint
    raise
```
"""

from __future__ import annotations

from collections.abc import Sequence


class PortError(Exception):
    """A problem with the user's input: one line naming the file, key or parameter and what is wrong."""


class CheckpointError(PortError):
    """A checkpoint (its files, headers, index or `config.json`) is missing, unreadable or malformed."""


class MappingError(PortError):
    """A mapping file is not valid: its TOML, a key, a transform or a rule."""


class ConfigError(PortError):
    """A model's config holds a value its module cannot build (a missing key, a wrong type or size)."""


class PlanError(PortError):
    """The mapping does not fit the checkpoint, the module or the mesh.

    `problems` lists every problem found (the message names the first and counts the rest).
    """

    def __init__(self, problems: Sequence[str]):
        self.problems = tuple(problems)
        extra = len(self.problems) - 1
        more = f" (and {extra} more problem{'s' if extra > 1 else ''})" if extra else ""
        super().__init__(self.problems[0] + more if self.problems else "the plan failed")


class OutputError(PortError):
    """An output directory cannot be written, replaced or restored (`out=`, `port.restore`)."""


class RunError(PortError):
    """A multi-process run cannot start or go on: joining, agreeing on settings, a lost peer."""
