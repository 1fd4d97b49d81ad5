"""`--force` replaces only an earlier port output, and nothing port did not write.

Every refusal is one line, exit 1, and leaves every file of a decoy tree (checkpoints,
the user's own files) exactly as it was.
"""

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from conftest import run_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root`: a file's digest, a link's target, or 'dir'."""
    found = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            found[name] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[name] = "dir"
        else:
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture
def decoys(tmp_path):
    """ck/victim and ck/victim2 (checkpoints), notes/ (the user's files), a file, a port output."""
    ck = tmp_path / "ck"
    shutil.copytree(EXAMPLE, ck / "victim")
    shutil.copytree(EXAMPLE, ck / "victim2")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    (tmp_path / "notes" / "sub").mkdir()
    (tmp_path / "afile").write_text("not a directory")
    made = run_port("convert", EXAMPLE, "--out", tmp_path / "earlier")
    assert made.returncode == 0, made.stderr
    return tmp_path


def refused(result, *substrings):
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("port: error:"), output
    for s in substrings:
        assert s in lines[0], f"{s!r} not in {lines[0]!r}"


@pytest.mark.parametrize(
    "model, out, cwd, home, expected",
    [
        ("ck/victim", "ck/victim", ".", None, "is the input"),
        ("ck/victim2", "ck", ".", None, "contains the input"),
        ("ck/victim", ".", "notes", None, "is the working directory"),
        ("ck/victim", "..", "notes/sub", None, "containing the working directory"),
        ("ck/victim", "HOME", ".", "notes", "is your home directory"),
        ("ck/victim", "/", ".", None, "is the root directory"),
        ("ck/victim", "notes", ".", None, "not a port output"),
        ("ck/victim", "afile", ".", None, "is a file"),
        ("ck/victim", "link", ".", None, "symbolic link"),
    ],
)
def test_force_refuses_what_port_did_not_write(decoys, model, out, cwd, home, expected):
    (decoys / "link").symlink_to(decoys / "earlier")
    before = snapshot(decoys)
    env = {"HOME": str(decoys / home)} if home else None
    target = str(decoys / home) if out == "HOME" else out
    result = run_port(
        "convert", decoys / model, "--mesh", "2x2", "--out", target, "--force", cwd=decoys / cwd, env=env
    )
    refused(result, expected, "--out")
    assert snapshot(decoys) == before


def test_force_refuses_a_port_output_holding_other_files(decoys):
    (decoys / "earlier" / "my-notes.txt").write_text("keep me")
    before = snapshot(decoys)
    result = run_port("convert", decoys / "ck" / "victim", "--out", decoys / "earlier", "--force")
    refused(result, "not a port output", "--force replaces only")
    assert snapshot(decoys) == before


def test_force_replaces_an_earlier_output(decoys):
    before = snapshot(decoys)
    result = run_port("convert", decoys / "ck" / "victim", "--mesh", "2x2", "--out", decoys / "earlier", "--force")
    assert result.returncode == 0, result.stderr
    after = snapshot(decoys)
    assert {k: v for k, v in after.items() if not k.startswith("earlier")} == {
        k: v for k, v in before.items() if not k.startswith("earlier")
    }
    assert sorted(p.name for p in (decoys / "earlier").iterdir()) == ["params", "port.json"]
    assert not [p for p in decoys.iterdir() if p.name.startswith(".")]


def test_without_force_nothing_is_replaced(decoys):
    before = snapshot(decoys)
    refused(run_port("convert", decoys / "ck" / "victim", "--out", decoys / "earlier"), "already exists", "--force")
    assert snapshot(decoys) == before


def test_report_is_replaced_only_if_port_wrote_it(decoys):
    report = decoys / "notes" / "todo.txt"
    before = snapshot(decoys)
    result = run_port("convert", decoys / "ck" / "victim", "--out", decoys / "new", "--report", report, "--force")
    refused(result, "--report", "not a run report port wrote")
    assert snapshot(decoys) == before
    result = run_port("convert", decoys / "ck" / "victim", "--out", decoys / "new", "--report", decoys / "run.json")
    assert result.returncode == 0, result.stderr
    again = run_port(
        "convert", decoys / "ck" / "victim", "--out", decoys / "new", "--report", decoys / "run.json", "--force"
    )
    assert again.returncode == 0, again.stderr
