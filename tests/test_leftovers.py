"""A run killed outright (SIGKILL to the supervisor and the worker) leaves hidden siblings of
its output; the next run at that `--out` removes them, or puts the earlier output back, and
touches nothing that is not a dead run's own (issue 21, row 6).

The kill is made deterministic by a `sitecustomize` hook in the worker: at the final rename
of the partial output (before or after it), it SIGKILLs the supervisor and then itself, as
`kill -9` to the process group would.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import hooked, run_port, snapshot

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"

KILL = """
import os, signal
if "PORT_SUPERVISOR_FDS" in os.environ:  # the worker only
    _rename = os.rename
    def rename(a, b, *rest, **kw):
        mode = os.environ.get("PORT_TEST_KILL")
        final = ".port-partial-" in str(a) and not str(b).endswith(".port-partial-")
        if final and mode == "before":
            os.kill(os.getppid(), signal.SIGKILL); os.kill(os.getpid(), signal.SIGKILL)
        _rename(a, b, *rest, **kw)
        if final and mode == "after":
            os.kill(os.getppid(), signal.SIGKILL); os.kill(os.getpid(), signal.SIGKILL)
    os.rename = rename
"""


def killed(tmp_path, when, *args):
    env = hooked(tmp_path / "hook", KILL) | {"PORT_TEST_KILL": when}
    result = run_port(*args, env=env)
    assert result.returncode == -9, result.stdout + result.stderr
    return result


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def params(out: Path) -> dict[str, str]:
    """The digests of the arrays' files (not Orbax's commit file, which holds the time)."""
    return {k: v for k, v in snapshot(out / "params").items() if not k.endswith("commit_success.txt")}


@pytest.mark.slow
def test_a_killed_convert_leaves_a_partial_the_next_run_removes(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    killed(tmp_path, "before", "convert", EXAMPLE, "--out", root / "gpt2")
    left = hidden(root)
    assert not (root / "gpt2").exists()
    assert len(left) == 2 and left[0].startswith(".gpt2.port-partial-") and left[1] == left[0] + ".owner", left
    assert (root / left[0] / "params").is_dir()  # a whole output, short of its rename
    again = run_port("convert", EXAMPLE, "--out", root / "gpt2")
    assert again.returncode == 0, again.stderr
    assert f"port: removed {left[0]}, left by process" in again.stderr, again.stderr
    assert hidden(root) == []


@pytest.mark.slow
def test_a_run_killed_mid_replacement_gets_the_earlier_output_back(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    assert run_port("convert", EXAMPLE, "--out", root / "gpt2", "--dtype", "bfloat16").returncode == 0
    before = params(root / "gpt2")
    killed(tmp_path, "before", "convert", EXAMPLE, "--out", root / "gpt2", "--force")
    assert not (root / "gpt2").exists()  # moved aside, the new one not yet in place
    assert any(".gpt2.port-old-" in n for n in hidden(root)), hidden(root)
    # Without --force: the earlier output is put back first, then the run refuses to replace it.
    again = run_port("convert", EXAMPLE, "--out", root / "gpt2")
    assert again.returncode == 1, again.stderr
    assert "port: restored" in again.stderr and "already exists (use --force" in again.stderr, again.stderr
    assert params(root / "gpt2") == before
    assert hidden(root) == []


@pytest.mark.slow
def test_a_run_killed_after_its_rename_leaves_the_old_output_the_next_run_removes(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    assert run_port("convert", EXAMPLE, "--out", root / "gpt2", "--dtype", "bfloat16").returncode == 0
    killed(tmp_path, "after", "convert", EXAMPLE, "--out", root / "gpt2", "--force")
    new = params(root / "gpt2")
    assert any(".gpt2.port-old-" in n for n in hidden(root)), hidden(root)
    again = run_port("convert", EXAMPLE, "--out", root / "other")  # another --out: this one is untouched
    assert again.returncode == 0 and any(".gpt2.port-old-" in n for n in hidden(root))
    again = run_port("convert", EXAMPLE, "--out", root / "gpt2", "--force")
    assert again.returncode == 0, again.stderr
    assert "the earlier output a finished run had replaced" in again.stderr, again.stderr
    assert hidden(root) == [] and params(root / "gpt2") == new


@pytest.mark.slow
def test_a_killed_export_is_cleaned_up_by_the_next_export(tmp_path):
    out = tmp_path / "jax"
    assert run_port("convert", EXAMPLE, "--out", out).returncode == 0
    killed(tmp_path, "before", "export", out, "--out", tmp_path / "hf")
    assert any(n.startswith(".hf.port-partial-") for n in hidden(tmp_path))
    again = run_port("export", out, "--out", tmp_path / "hf")
    assert again.returncode == 0, again.stderr
    assert "port: removed .hf.port-partial-" in again.stderr
    assert [n for n in hidden(tmp_path) if n.startswith(".hf")] == []


def claim(path: Path, **fields) -> None:
    owner = {"port": "owner", "host": socket.gethostname(), "pid": 0, "boot": None, "start": None} | fields
    Path(str(path) + ".owner").write_text(json.dumps(owner))


@pytest.mark.slow
def test_only_a_dead_runs_own_leftovers_are_touched(tmp_path):
    """Live owner, another host, no owner file, a link, a file of the user's named like one: all left."""
    root = tmp_path / "work"
    root.mkdir()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("the user's")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        live = root / ".gpt2.port-partial-00000000000000aa"
        live.mkdir()
        (live / "x").write_text("a run writing now")
        with open(f"/proc/{sleeper.pid}/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19])
        claim(live, pid=sleeper.pid, start=start)
        elsewhere = root / ".gpt2.port-partial-00000000000000bb"
        elsewhere.mkdir()
        claim(elsewhere, host="another-host", pid=1)
        os.utime(str(elsewhere) + ".owner", (1_000_000, 1_000_000))  # old: said, not silently kept
        recent = root / ".gpt2.port-partial-00000000000000ff"  # another host's, of now: kept without a word
        recent.mkdir()
        claim(recent, host="another-host", pid=2)
        unclaimed = root / ".gpt2.port-partial-00000000000000cc"
        unclaimed.mkdir()
        link = root / ".gpt2.port-partial-00000000000000dd"
        link.symlink_to(mine)
        claim(link, pid=1 << 22)
        reused = root / ".gpt2.port-partial-00000000000000ee"  # the pid lives on, but it is another process
        reused.mkdir()
        claim(reused, pid=sleeper.pid, start=start + 1)
        before = snapshot(tmp_path / "mine")
        result = run_port("convert", EXAMPLE, "--out", root / "gpt2")
        assert result.returncode == 0, result.stderr
        left = hidden(root)
        assert live.name in left and elsewhere.name in left and unclaimed.name in left and link.name in left
        assert reused.name not in left and reused.name + ".owner" not in left
        assert "made by process 1 on host another-host" in result.stderr and recent.name in left
        assert "process 2 on host" not in result.stderr
        assert f"left {unclaimed}: not claimed" in result.stderr
        assert f"left {link}: not claimed" in result.stderr  # a link is never followed nor removed
        assert (live / "x").read_text() == "a run writing now"
        assert snapshot(tmp_path / "mine") == before
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.slow
def test_a_moved_aside_output_is_not_put_back_unless_it_is_a_port_output(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    aside = root / ".gpt2.port-old-0000abcd"
    aside.mkdir()
    (aside / "notes.txt").write_text("the user's")
    claim(aside, pid=1 << 22)
    result = run_port("convert", EXAMPLE, "--out", root / "gpt2")
    assert result.returncode == 0, result.stderr
    assert f"left {aside}" in result.stderr
    assert (aside / "notes.txt").read_text() == "the user's"


def test_recover_as_a_library_logs_what_it_did(tmp_path, caplog):
    from port._leftovers import recover
    from port._output import is_output

    partial = tmp_path / ".gpt2.port-partial-0123456789abcdef"
    partial.mkdir()
    claim(partial, pid=1 << 22)
    orphan = tmp_path / ".gpt2.port-old-89abcdef"
    claim(orphan, pid=1 << 22)  # its directory already gone: only the owner file is left
    with caplog.at_level("WARNING", logger="port"):
        said = recover(tmp_path / "gpt2", is_output)
    assert said == [f"removed {partial.name}, left by process {1 << 22} (a run killed before it finished)"]
    assert [r.getMessage() for r in caplog.records] == said
    assert os.listdir(tmp_path) == []
