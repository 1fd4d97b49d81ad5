"""docs/adding-an-architecture.md, run as written: its marked blocks, through the real `port` command.

A block after `<!-- walkthrough: STEP -->` holds `$ command` lines, each followed by
the output it shows (`...` skips lines or, within a line, text; decimal numbers
may differ). The commands run one by one in subprocesses, from an empty directory
(`cd` moves between them), with `$PORT_REPO` set to this checkout. A block marked
`in draft.toml` (`in the edited draft.toml`) must appear in the draft as `port
scaffold` wrote it (after the edit step).
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path
from string import Template

import pytest

import port

from helpers import logits, port_command, port_env

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "adding-an-architecture.md"
WALKTHROUGH = REPO / "examples" / "walkthrough"
SHIPPED = WALKTHROUGH / "tinylm.toml"
STEPS = ["setup", "scaffold", "check the unedited draft", "edit", "check", "verify", "convert", "export"]

PORT = port_command()
ENV = port_env({"PORT_REPO": str(REPO)})

BLOCK = re.compile(r"^<!-- walkthrough: (.+?) -->\n```[a-z]*\n(.*?)^```", re.M | re.S)
NUMBER = re.compile(r"(\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)")
ANY_NUMBER = r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?"


def doc_blocks():
    """[(marker, block text)] in document order."""
    return BLOCK.findall(DOC.read_text())


def commands(block):
    """[(command, [shown output lines])] of a command block."""
    out = []
    for line in block.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        else:
            assert out, f"output before any command: {line!r}"
            out[-1][1].append(line)
    return out


def shown(line):
    """A regex for one output line the doc shows: `...` is any text, decimal numbers any number."""
    pieces = []
    for piece in line.split("..."):
        parts = NUMBER.split(piece)
        pieces.append("".join(ANY_NUMBER if i % 2 else re.escape(p) for i, p in enumerate(parts)))
    return ".*".join(pieces)


def argv(command):
    tokens = [Template(t).substitute(ENV) for t in shlex.split(command, comments=True)]
    assert not {"&&", "||", "|", ";", ">", "<"} & set(tokens), f"not a shell: one command a line ({command})"
    return tokens


def run(tokens, cwd):
    program = {"port": PORT, "python": [sys.executable]}.get(tokens[0], tokens[:1])
    result = subprocess.run(
        [*program, *tokens[1:]],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return result.returncode, result.stdout + result.stderr


def repo_state():
    """Untracked files git reports, and every file under examples/walkthrough (ignored ones too)."""
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = status.stdout.splitlines()
    untracked = {Path(line[3:]) for line in lines if line.startswith("??")} if status.returncode == 0 else None
    return untracked, set(WALKTHROUGH.rglob("*"))


def test_every_command_works_on_the_readers_draft():
    """The doc checks, verifies, plans and converts with the draft the reader made, never a shipped file."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", DOC.read_text(), re.S)
    lines = [line.removeprefix("$ ") for block in blocks for line in block.splitlines()]
    port_commands = [shlex.split(line, comments=True) for line in lines if line.startswith("port ")]
    used = {tokens[1] for tokens in port_commands}
    assert {"scaffold", "check", "verify", "plan", "convert"} <= used
    for tokens in port_commands:
        if tokens[1] == "check":
            assert tokens[2] == "draft.toml", tokens
        if tokens[1] in ("verify", "plan", "convert"):
            assert tokens[tokens.index("--mapping") + 1] == "draft.toml", tokens
        assert not any("/tmp" in t or t.endswith("tinylm.toml") for t in tokens), tokens
    assert [marker for marker, _ in doc_blocks() if not marker.startswith("in ")] == STEPS


def test_shipped_mapping_is_clean():
    text = SHIPPED.read_text()
    for leftover in ("TODO", "CHECK", "/tmp", "dim64"):
        assert leftover not in text
    lines = text.splitlines()
    # Each entry with transforms says why: a comment right above the first entry for its key.
    for key in {m for m in re.findall(r'^key = "(.+)"\n(?:path = .*\n)transforms', text, re.M)}:
        first = lines.index(f'key = "{key}"')
        assert lines[first - 1] == "[[params]]" and lines[first - 2].startswith("# "), key
    assert lines[lines.index('reference = { class = "torch_tinylm:TinyLM", output = "logits" }') - 1].startswith("# ")


@pytest.mark.slow
def test_walkthrough(tmp_path, monkeypatch):
    untracked_before, files_before = repo_state()
    cwd, results, snapshots, expected_text = tmp_path, [], {}, []
    for marker, block in doc_blocks():
        if marker.startswith("in "):
            expected_text.append((marker, block))
            continue
        for command, output_lines in commands(block):
            tokens = argv(command)
            if tokens[0] == "cd":
                cwd = (cwd / tokens[1]).resolve()
                assert cwd.is_dir() and cwd.is_relative_to(tmp_path), command
                continue
            draft = cwd / "draft.toml"
            before = draft.read_text() if draft.exists() else None
            code, output = run(tokens, cwd)
            results.append((marker, tokens, code, output, before))
            # The exit code the doc implies: 1 where it shows an error line, else 0.
            wanted = 1 if any(line.startswith("port: error:") for line in output_lines) else 0
            assert code == wanted, f"{command} exited {code}\n{output}"
            for line in output_lines:
                if line.strip() != "...":
                    assert re.search(shown(line), output), f"{command}: {line!r} not in\n{output}"
        snapshots[marker] = (cwd / "draft.toml").read_text() if (cwd / "draft.toml").exists() else None

    work = cwd
    assert work != tmp_path and (work / "tinylm-checkpoint" / "model.safetensors").exists()
    step = {}  # the first command of each block
    for marker, *result in results:
        step.setdefault(marker, result)

    # The doc's quotes of the draft are in the draft.
    for marker, block in expected_text:
        text = snapshots["scaffold"] if marker == "in draft.toml" else snapshots["edit"]
        assert block.strip() in text, f"{marker}:\n{block}"

    # Unedited, the draft fails the check, naming what is left to do.
    tokens, code, output, before = step["check the unedited draft"]
    assert tokens[:3] == ["port", "check", "draft.toml"] and code == 1
    # Issue 24 row 6: TinyLM's own `max_positions` names the axis; no TODO is left for it.
    assert before == snapshots["scaffold"] and "dim64" not in before and "TODO: name this axis" not in before
    assert "leaf 'blocks.wq' of tinylm:TinyLM has no mapping entry" in output
    assert "tensor 'blocks.0.qkv.weight' is not used" in output

    # check and verify run on the reader's edited draft: ok.
    edited = snapshots["edit"]
    assert edited != snapshots["scaffold"]
    assert snapshots["convert"] == edited  # nothing after the edit step changed it
    tokens, code, output, before = step["check"]
    assert tokens[:3] == ["port", "check", "draft.toml"] and before == edited
    assert code == 0 and "draft.toml: ok: 20 leaves" in output, output
    tokens, code, output, before = step["verify"]
    assert tokens[:2] == ["port", "verify"] and tokens[tokens.index("--mapping") + 1] == "draft.toml"
    assert before == edited and code == 0 and re.search(r"TinyLM\.logits .*: ok \(tolerance", output), output
    assert port._output.is_output(work / "tinylm-jax")
    assert not list(tmp_path.rglob("tinylm.toml"))  # the shipped mapping was never needed

    # The edited draft is the shipped mapping, comments aside.
    mine, shipped = port.load_mapping(work / "draft.toml"), port.load_mapping(SHIPPED)
    fields = ("model", "model_types", "prefixes", "ignore", "tied", "aliases", "rules", "reference")
    assert [getattr(mine, f) for f in fields] == [getattr(shipped, f) for f in fields]
    by_path = lambda params: sorted(params, key=lambda p: p.path)  # noqa: E731
    assert by_path(mine.params) == by_path(shipped.params)
    assert mine.reference == {"class": "torch_tinylm:TinyLM", "output": "logits"}

    # The shipped mapping passes check too, and loads TinyLM equal to PyTorch's on two meshes.
    code, output = run(
        ["port", "check", str(SHIPPED), "tinylm-checkpoint", "--mesh", "4x2", "--module", "tinylm:TinyLM"], work
    )
    assert code == 0 and "ok: 20 leaves" in output, output
    import numpy as np
    import torch

    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    from torch_tinylm import TinyLM

    ids = np.random.default_rng(3).integers(0, 97, (2, 20))
    with torch.no_grad():
        expected = TinyLM.from_pretrained(work / "tinylm-checkpoint")(torch.tensor(ids)).logits.numpy()
    for mesh in ("1x1", "4x2"):
        model = port.load(work / "tinylm-checkpoint", mesh=port.make_mesh(mesh), mapping=SHIPPED)
        ours = np.asarray(logits(model, ids))
        assert np.abs(ours - expected).max() < 1e-4, mesh

    # Nothing was written into the repository.
    untracked_after, files_after = repo_state()
    assert files_after == files_before
    if untracked_before is not None:
        # Others may add files meanwhile; ours bear the names the walkthrough writes.
        written = {Path(t).name for _, tokens, *_ in results for t in tokens[1:] if not t.startswith("-")}
        written |= {p.name for p in tmp_path.rglob("*")} | {"__pycache__"}
        new = untracked_after - untracked_before
        assert not [path for path in new if written & set(path.parts)], new
