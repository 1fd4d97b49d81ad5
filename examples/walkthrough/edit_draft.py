"""The edits docs/adding-an-architecture.md makes to the TinyLM draft, as a script.

    python examples/walkthrough/edit_draft.py draft.toml tinylm.toml
"""

import re
import sys
from pathlib import Path


def edit(draft: str) -> str:
    lines = []
    for line in draft.splitlines():
        # 1. Use the drafted split entries for the fused qkv: uncomment them.
        if re.match(r"# (\[\[params\]\]|key = |path = |transforms = |axes = )", line):
            line = line[2:]
        lines.append(line)
    text = "\n".join(lines) + "\n"
    # 2. Name the axis scaffold could not: pos.weight's first axis is the position.
    text = text.replace('"dim64"', '"positions"').replace("dim64 = []", "positions = []")
    # 3. Tell port verify which PyTorch model to compare with.
    text = text.replace(
        'model_types = ["tinylm"]',
        'model_types = ["tinylm"]\nreference = { class = "torch_tinylm:TinyLM", output = "logits" }',
    )
    return text


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(edit(Path(sys.argv[1]).read_text()))
