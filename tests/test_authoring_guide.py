"""Issue 39 row 6: docs/adding-an-architecture.md's recipe for test checkpoints, run as written.

Its block marked `<!-- recipe: test checkpoint -->` makes a reference with larger weights and
perturbed norms, checks that its logits are far from uniform and its greedy tokens not one
repeated, and compares `port.generate` with transformers' `generate`, without and with an
end-of-sequence token. The same block with transformers' default initialisation fails its
own check: the check tells the two apart.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import port_env, transformers_or_skip

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "adding-an-architecture.md"
RECIPE = re.compile(r"^<!-- recipe: test checkpoint -->\n```python\n(.*?)^```", re.M | re.S)


def recipe() -> str:
    """The guide's recipe block (exactly one)."""
    found = RECIPE.findall(GUIDE.read_text())
    assert len(found) == 1, found
    return found[0]


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` run by a fresh interpreter in `cwd`, as a reader runs the block."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=port_env(), capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_the_guides_recipe_runs_and_its_generation_matches_transformers(tmp_path):
    transformers_or_skip()
    result = run_python(recipe(), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "test-checkpoint" / "config.json").is_file()


@pytest.mark.slow
def test_the_recipes_check_refuses_transformers_default_init(tmp_path):
    """With std 0.02 the logits are near uniform: the block stops at its check, before any comparison."""
    transformers_or_skip()
    default = recipe().replace("initializer_range=0.2,", "initializer_range=0.02,")
    assert default != recipe()
    result = run_python(default, tmp_path)
    assert result.returncode == 1 and result.stderr.rstrip().endswith("AssertionError"), result.stderr[-3000:]
    check = next(i for i, line in enumerate(default.splitlines(), 1) if "far from uniform" in line)
    assert f'File "<string>", line {check}, in <module>' in result.stderr
