"""The library's parameter names as the command line's flags: `with_flags` turns a library
message (`mesh='2x3': ...`) into the command line's words (`--mesh '2x3': ...`).
"""

import re

FLAGS = {
    "mesh": "--mesh",
    "dtype": "--dtype",
    "out": "--out",
    "force": "--force",
    "mapping": "--mapping",
    "include": "--include",
    "layers": "--layers",
    "max_shard_size": "--max-shard-size",
    "coordinator": "--coordinator",
    "num_processes": "--num-processes",
    "process_id": "--process-id",
    "timeout": "--timeout",
    "checkpoint": "MODEL",
}
"""The library's parameter names, as its messages write them (`mesh=`), and what the command line
calls them. Where the two differ in more than spelling:

- `checkpoint` (`port.convert`'s first argument) is the positional MODEL.
- `layers=range(0, 12)` is `--layers 0:12`: `convert` rewrites a message that starts with the
  range in the flag's form; `include=['wte', 'blocks']` is `--include wte,blocks`.
- `strict`, `skeleton`, `local_devices`, `progress` have no flag (the command line is always
  strict, builds the mapping's model or `--module`'s class, and simulates the devices `--mesh`
  needs), so they stay as they are; nor does `model` (a word in mesh specs, `model=2`).
- `--report`, `--deadline`, `--progress`, `--module` are the command line's own.
"""

_TO_FLAG = re.compile(
    r"""(?<!\w)('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""  # a quoted segment (port quotes names with repr): kept
    r"|(?<![^\s(\[`])(" + "|".join(FLAGS) + r")="  # a known parameter at a word start
)
_NO_VALUE = ("", " ", "\t", ",", ";", ":", ")", "]", "`")


def with_flags(message: str) -> str:
    """A library message as the command line says it: each known parameter `name=` (at a word
    start, outside quoted text) becomes its flag, followed by a space when a value follows.

    ```python
    with_flags("mesh='2x3': expected DATAxMODEL")           # "--mesh '2x3': expected DATAxMODEL"
    with_flags("start every process with the same coordinator= and num_processes=2")
    # 'start every process with the same --coordinator and --num-processes 2'
    with_flags("tensor 'mesh=1' is not used")                # unchanged: inside quotes
    ```
    """

    def flag(match: re.Match) -> str:
        if match.group(1) is not None:
            return match.group(1)
        after = message[match.end() : match.end() + 2]  # a value follows unless a space, the end or punctuation
        follows = after[:1] not in _NO_VALUE and after not in (".", ". ")
        return FLAGS[match.group(2)] + (" " if follows else "")

    return _TO_FLAG.sub(flag, message)
