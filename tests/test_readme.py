"""The README stays a short front page whose fresh-machine blocks are what CI runs, and whose
links (and the docs' links) lead somewhere. Every block of code in it runs in test_docs.py."""

import re
import subprocess
from pathlib import Path

import pytest

from helpers import run_port
from test_docs import blocks

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def ci_block(name: str) -> str:
    """The block `.ci/run` extracts for `name`, by its own `block` function."""
    script = (REPO / ".ci" / "run").read_text()
    (function,) = re.findall(r"^block\(\) \{.*?^\}\n", script, re.S | re.M)
    result = subprocess.run(
        ["bash", "-c", f"{function}\nblock {name}"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_fresh_machine_blocks_are_the_ones_ci_runs():
    marked = {b.marker: b for b in blocks(README) if b.marker.startswith("<!-- ci:")}
    assert set(marked) == {"<!-- ci: run -->", "<!-- ci: test -->"}
    for name in ("run", "test"):
        block = marked[f"<!-- ci: {name} -->"]
        assert block.language == "bash" and ci_block(name) == block.text
    run, test = marked["<!-- ci: run -->"].text, marked["<!-- ci: test -->"].text
    assert run.startswith("pip install -e . && port convert examples/tiny-gpt2 --mesh 4x2 --out ")
    assert test.rstrip().endswith("&& python -m pytest -q -n 2")


def test_the_test_block_pins_the_torch_the_suite_runs_against():
    """`torch==X` is the installed version (its CPU build's local label aside), from PyTorch's CPU index
    first, and inside the range pyproject.toml declares."""
    import torch

    (test,) = [b.text for b in blocks(README) if b.marker == "<!-- ci: test -->"]
    (pinned,) = re.findall(r"pip install torch==(\S+) ", test)
    assert pinned == torch.__version__.split("+")[0]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in test
    (low, high) = re.findall(r'"torch>=([\d.]+),<([\d.]+)"', (REPO / "pyproject.toml").read_text())[0]
    version = tuple(map(int, pinned.split(".")))
    assert tuple(map(int, low.split("."))) <= version < tuple(map(int, high.split(".")))


@pytest.mark.slow
def test_the_run_block_converts_offline(tmp_path):
    """The run block's `port convert` from the repository root, as it says (its output under tmp_path)."""
    (run,) = [b.text for b in blocks(README) if b.marker == "<!-- ci: run -->"]
    command = run.split("&&")[1].split()
    assert command[:2] == ["port", "convert"]
    out = tmp_path / "quickstart"
    args = [str(out) if before == "--out" else word for before, word in zip(command, command[1:])]
    result = run_port(*args, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert (out / "port" / "metadata").is_file() and (out / "params").is_dir()


def test_the_readme_is_a_front_page():
    """About 150-200 lines: what port is, install, the fresh-machine blocks, the quickstart,
    the families, links; the reference lives in docs/."""
    assert len(README.read_text().splitlines()) <= 200
    headings = re.findall(r"^## (.+)$", README.read_text(), re.M)
    assert headings == ["Install", "On a fresh machine", "Quickstart", "Architectures", "Documentation", "Status"]


def test_every_shipped_mapping_is_in_the_families_table():
    text = README.read_text()
    for mapping in sorted((REPO / "mappings").glob("*.toml")):
        assert f"`mappings/{mapping.name}`" in text, mapping.name


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_slugs_are_githubs():
    assert slug("`port info DIR --json`: `port.info/1`") == "port-info-dir---json-portinfo1"
    assert slug("How the bytes are read: memory and speed") == "how-the-bytes-are-read-memory-and-speed"


def test_every_link_between_the_pages_leads_somewhere():
    """Relative links of README.md and docs/*.md: the file exists, and its #anchor is one of its headings."""
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
                assert anchor in {slug(h) for h in headings}, f"{page.name}: {target}"
