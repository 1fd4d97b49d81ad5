"""The review docs/adding-an-architecture.md does to the TinyLM draft, as a script.

Edits the draft in place (run it where the draft is):

    python $PORT_REPO/examples/walkthrough/edit_draft.py draft.toml
"""

import re
import sys
from pathlib import Path

REFERENCE = 'reference = { class = "torch_tinylm:TinyLM", output = "logits" }'
DRAFTED = re.compile(r"# (\[\[params\]\]|key = |path = |transforms = |axes = )")


def edit(draft: str) -> str:
    lines = []
    for line in draft.splitlines():
        # 1. Use the split entries drafted for the fused qkv: uncomment them.
        if DRAFTED.match(line):
            line = line[2:]
        # 2. Every CHECK and TODO is resolved: drop scaffold's comments.
        lines.append("" if line.startswith("#") else line)
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines).strip() + "\n")
    # 3. Tell port verify which PyTorch model to compare with. `reference` is a
    #    top-level key: it goes before the first [table] or [[array]] header, since
    #    a key after a header belongs to that table.
    header = re.search(r"^\[", text, re.M)
    return text[: header.start()].rstrip("\n") + "\n" + REFERENCE + "\n\n" + text[header.start() :]


if __name__ == "__main__":
    path = Path(sys.argv[1])
    path.write_text(edit(path.read_text()))
