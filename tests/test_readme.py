"""The README's examples run as written and its sample output matches what port prints."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import port_env, run_port

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


pytestmark = pytest.mark.slow  # every test runs the README's examples or `port` in a subprocess


def section(heading: str) -> str:
    start = README.index(f"\n## {heading}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def run_example(heading: str, tmp_path) -> None:
    """The one Python block of the README section `heading`, run from the checkout (TMPDIR: `tmp_path`)."""
    (code,) = fenced(section(heading), "python")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
        env=port_env({"TMPDIR": str(tmp_path)}),
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_python_example_runs_as_written(tmp_path):
    run_example("Python", tmp_path)
    assert list(tmp_path.iterdir()), "the example writes its output under TMPDIR"


def test_training_and_generation_example_runs_as_written(tmp_path):
    run_example("Training and generation", tmp_path)


def shape_of(line: str) -> str:
    """A line with its numbers, sizes and paths generalised: the format, not the figures."""
    line = re.sub(r"\S*/\S+", "PATH", line)
    line = re.sub(r"\d+(\.\d+)?[KMB]?\b", "N", line)  # 4.1, 124.4M, 169.5K
    return re.sub(r"\b[KMGT]?B\b", "UNIT", line)


def test_sample_output_matches(tmp_path):
    """The quickstart's conversion writes its output and prints lines shaped as the sample shows."""
    (sample,) = [block for block in fenced(section("Command line"), "") if block.startswith("$ port convert")]
    shown = [line for line in sample.splitlines() if line.startswith("port:")]
    # The quickstart's own command, from the repository root as it says.
    (quickstart,) = [block for block in fenced(section("On a fresh machine"), "bash") if "port convert" in block]
    assert "port convert examples/tiny-gpt2 --mesh 4x2 --out " in quickstart
    out = tmp_path / "out"
    result = run_port("convert", "examples/tiny-gpt2", "--mesh", "4x2", "--out", out, cwd=REPO)
    assert result.returncode == 0, result.stderr
    printed = result.stderr.strip().splitlines()
    assert [shape_of(line) for line in printed] == [shape_of(line) for line in shown]
    assert (out / "port" / "metadata").is_file() and (out / "params").is_dir()
