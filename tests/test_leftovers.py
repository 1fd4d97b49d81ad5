"""A run killed outright (SIGKILL to the supervisor and the worker) leaves hidden siblings of
its output; the next run at that `--out` removes them, or puts the earlier output back, and
touches nothing that is not a dead run's own (issue 21, row 6).

The kill is made deterministic by a `sitecustomize` hook in the worker: at the final rename
of the partial output (before or after it), it SIGKILLs the supervisor and then itself, as
`kill -9` to the process group would.
"""

import json
import os
import shutil
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


def identity(path: Path) -> list[int] | None:
    """What an owner file records of what its run made: device and inode (None if nothing is there)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return [info.st_dev, info.st_ino]


def claim(path: Path, **fields) -> None:
    """An owner file beside `path`, of this host, boot and PID namespace (`fields` overriding), naming `path`."""
    owner = {
        "port": "owner",
        "host": socket.gethostname(),
        "pid": 0,
        "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "start": None,
        "pidns": os.readlink("/proc/self/ns/pid"),
        "made": identity(path),
    } | fields
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


def tree(root: Path) -> dict[str, str]:
    """A directory of the user's, with a file and a subdirectory: what recovery must never touch; its snapshot."""
    root.mkdir()
    (root / "data.txt").write_text("the user's")
    (root / "sub").mkdir()
    (root / "sub" / "more.txt").write_text("also the user's")
    return snapshot(root)


@pytest.mark.slow
def test_a_tree_renamed_to_a_dead_runs_partial_is_left(tmp_path):
    """Someone who may rename entries in the output's parent (group-writable, no sticky bit) swaps the
    user's tree in under the name of a dead run's partial: the next run removes only the directory
    that run made, and says so once (issue 32, rows 1 and 11)."""
    root = tmp_path / "work"
    root.mkdir()
    killed(tmp_path, "before", "convert", EXAMPLE, "--out", root / "gpt2")
    partial = root / hidden(root)[0]
    os.rename(partial, tmp_path / "moved-away")
    before = tree(root / "important")
    os.rename(root / "important", partial)
    result = run_port("convert", EXAMPLE, "--out", root / "gpt2")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(f"port: left {partial}: not what process ") == 1, result.stderr
    assert "removed" not in result.stderr
    assert snapshot(partial) == before


@pytest.mark.slow
def test_an_output_renamed_to_a_dead_runs_moved_aside_one_is_left(tmp_path):
    """As above for a `port-old`: another port output of the user's, swapped in under the name of the
    earlier output a killed `--force` run moved aside, is neither removed nor put back (issue 32, row 1)."""
    root = tmp_path / "work"
    root.mkdir()
    assert run_port("convert", EXAMPLE, "--out", root / "gpt2", "--dtype", "bfloat16").returncode == 0
    shutil.copytree(root / "gpt2", root / "other")  # the user's other output
    killed(tmp_path, "after", "convert", EXAMPLE, "--out", root / "gpt2", "--force")
    (aside,) = [root / n for n in hidden(root) if ".gpt2.port-old-" in n and not n.endswith(".owner")]
    os.rename(aside, tmp_path / "moved-away")
    before = snapshot(root / "other")
    os.rename(root / "other", aside)
    result = run_port("convert", EXAMPLE, "--out", root / "gpt2", "--force")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(f"port: left {aside}: not what process ") == 1, result.stderr
    assert snapshot(aside) == before


@pytest.mark.slow
def test_leftovers_whose_owner_port_cannot_judge_are_left_and_said_once(tmp_path):
    """A run in another PID namespace (a container sharing this host's name and kernel), one of another
    boot of a host of this name (shared storage), and owner files made to break the reader (JSON nested
    2,040 deep, a pid of 2**70): each left as it is, said once, and the run goes on (issue 32, rows 3, 7, 11)."""
    root = tmp_path / "work"
    root.mkdir()
    dead = 1 << 22  # above any pid Linux gives
    names = {"pidns": "a1", "boot": "a2", "deep": "a3", "huge": "a4", "start": "a5"}
    paths = {k: root / f".gpt2.port-partial-00000000000000{v}" for k, v in names.items()}
    before = {k: tree(p) for k, p in paths.items()}
    claim(paths["pidns"], pid=dead, pidns="pid:[1]")
    claim(paths["boot"], pid=dead, boot="00000000-0000-0000-0000-000000000000")
    Path(str(paths["deep"]) + ".owner").write_text("[" * 2040 + "]" * 2040)
    claim(paths["huge"], pid=2**70)
    claim(paths["start"], pid=dead, start=2**70)
    for key in ("pidns", "boot"):  # an hour old: a leftover whose process cannot be seen is said from then on
        os.utime(str(paths[key]) + ".owner", (1_000_000, 1_000_000))
    result = run_port("convert", EXAMPLE, "--out", root / "gpt2")
    assert result.returncode == 0, result.stderr
    assert {k: snapshot(p) for k, p in paths.items()} == before
    said = {
        "pidns": f"left {paths['pidns']}: made by process {dead} in another PID namespace",
        "boot": f"left {paths['boot']}: made by process {dead} on host {socket.gethostname()} before",
        "deep": f"left {paths['deep']}: not claimed",
        "huge": f"left {paths['huge']}: not claimed",
        "start": f"left {paths['start']}: not claimed",
    }
    assert {k: result.stderr.count(line) for k, line in said.items()} == dict.fromkeys(said, 1), result.stderr
    assert all(os.path.exists(str(p) + ".owner") for p in paths.values())


CRAFTED = {
    "nested 2,040 deep": "[" * 2040 + "]" * 2040,
    "nested in an object": '{"port": "owner", "host": ' + "[" * 2000 + "]" * 2000 + "}",
    "a pid of 2**70": {"pid": 2**70},
    "a negative pid": {"pid": -1},
    "a pid of 0": {"pid": 0},
    "a start of 2**70": {"start": 2**70},
    "a boot as a list": {"boot": ["x"]},
    "a PID namespace as a number": {"pidns": 5},
    "an identity of three numbers": {"made": [1, 2, 3]},
    "an identity of 2**70": {"made": [2**70, 1]},
    "an identity as text": {"made": "1 2"},
    "a pid of 4,000 digits": json.dumps({"port": "owner", "host": socket.gethostname()})[:-1]
    + ', "pid": '
    + "9" * 4000
    + "}",
}


@pytest.mark.parametrize("what", CRAFTED)
def test_recover_leaves_what_a_crafted_owner_file_claims(tmp_path, what):
    """A malformed owner file claims nothing: its leftover is left and said, and recovery never raises
    (issue 32, row 7)."""
    from port._leftovers import recover
    from port._output import is_output

    partial = tmp_path / ".gpt2.port-partial-0123456789abcdef"
    before = tree(partial)
    crafted = CRAFTED[what]
    if isinstance(crafted, dict):
        claim(partial, **({"pid": 1 << 22} | crafted))
    else:
        owner = Path(str(partial) + ".owner")
        owner.write_text(crafted)
    assert recover(tmp_path / "gpt2", is_output) == [
        f"left {partial}: not claimed by a port run of this user; remove it yourself if no run is writing it"
    ]
    assert snapshot(partial) == before


def test_recover_says_each_line_once_a_process(tmp_path, caplog):
    """The destination is checked more than once in a run (the command line's check, the library's,
    `put_in_place`'s): each recovery returns what it left, but logs a line only once (issue 32, row 11)."""
    from port._leftovers import recover
    from port._output import is_output

    unclaimed = tmp_path / ".gpt2.port-partial-0123456789abcdef"
    unclaimed.mkdir()
    with caplog.at_level("WARNING", logger="port"):
        first, second = recover(tmp_path / "gpt2", is_output), recover(tmp_path / "gpt2", is_output)
    assert first == second and len(first) == 1 and first[0].startswith(f"left {unclaimed}: not claimed")
    assert [r.getMessage() for r in caplog.records] == first


def test_recover_leaves_what_an_owner_file_without_its_identity_claims(tmp_path):
    """An earlier port's owner file (no PID namespace, no identity), or one whose run was killed before
    it recorded what it made, cannot say what that run made: left and said (issue 32, row 1)."""
    from port._leftovers import recover
    from port._output import is_output

    earlier = tmp_path / ".gpt2.port-partial-00000000000000e1"
    unrecorded = tmp_path / ".gpt2.port-partial-00000000000000e2"
    before = {p: tree(p) for p in (earlier, unrecorded)}
    earlier_format = {"port": "owner", "host": socket.gethostname(), "pid": 1 << 22, "boot": None, "start": None}
    Path(str(earlier) + ".owner").write_text(json.dumps(earlier_format))
    claim(unrecorded, pid=1 << 22, made=None)
    assert recover(tmp_path / "gpt2", is_output) == [
        f"left {earlier}: claimed by an earlier port, which did not record what it made; "
        "remove it yourself if no run is writing it",
        f"left {unrecorded}: its owner file does not say what process {1 << 22} made; "
        "remove it yourself if no run is writing it",
    ]
    assert {p: snapshot(p) for p in before} == before
