"""The code checks the README's test command runs with the suite (issue 23 row 6): ruff's lint
rules and its formatter, and basedpyright's type check of the library, all clean. Their settings
are pyproject.toml's `[tool.ruff]` and `[tool.basedpyright]`; run them alone with
`ruff check . && ruff format --check . && basedpyright`."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # each check is a subprocess over the whole tree


def check(*command: str) -> None:
    result = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"


def test_ruff_lint_is_clean():
    check("ruff", "check", "--no-cache", ".")


def test_ruff_format_leaves_every_file_as_it_is():
    check("ruff", "format", "--no-cache", "--check", ".")


def test_basedpyright_finds_no_error_in_the_library():
    check("basedpyright")
