"""`--force` replaces only an earlier port output, and nothing port did not write.

Every refusal is one line, exit 1, and leaves every file of a decoy tree (checkpoints,
the user's own files) exactly as it was.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import hooked, one_line, run_port, snapshot

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A `port convert` output, made once (what --force may replace is read from its files alone)."""
    out = tmp_path_factory.mktemp("converted") / "out"
    made = run_port("convert", EXAMPLE, "--out", out)
    assert made.returncode == 0, made.stderr
    return out


@pytest.fixture
def decoys(converted, tmp_path):
    """ck/victim and ck/victim2 (checkpoints), notes/ (the user's files), a file, a port output."""
    ck = tmp_path / "ck"
    shutil.copytree(EXAMPLE, ck / "victim")
    shutil.copytree(EXAMPLE, ck / "victim2")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    (tmp_path / "notes" / "sub").mkdir()
    (tmp_path / "afile").write_text("not a directory")
    shutil.copytree(converted, tmp_path / "earlier")
    return tmp_path


@pytest.mark.slow
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
    result = run_port("convert", decoys / model, "--mesh", "2x2", "--out", target, "--force", cwd=decoys / cwd, env=env)
    one_line(result, expected, "--out")
    assert snapshot(decoys) == before


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        "my-notes.txt",
        "port/my-notes.txt",
        "port.json",
        "params/my-notes.txt",
        "params/wte/my-notes.txt",
        "params/wte/0.0.bak",
        "params/my dir/x",
    ],
)
def test_force_refuses_a_port_output_holding_other_files(decoys, extra):
    (decoys / "earlier" / extra).parent.mkdir(exist_ok=True)
    (decoys / "earlier" / extra).write_text("keep me")
    before = snapshot(decoys)
    result = run_port("convert", decoys / "ck" / "victim", "--out", decoys / "earlier", "--force")
    one_line(result, "not a port output", "--force replaces only")
    assert snapshot(decoys) == before


@pytest.mark.slow
@pytest.mark.parametrize("where", ["params/wte/0.0", "params/_sharding", "params/wte"])
def test_force_refuses_an_output_with_a_link_in_params(decoys, where):
    """A link inside params/ (to the user's file, or directory) is not what port writes: refused."""
    target = decoys / "earlier" / where
    if target.is_dir():
        shutil.rmtree(target)
        target.symlink_to(decoys / "notes", target_is_directory=True)
    else:
        target.unlink()
        target.symlink_to(decoys / "notes" / "todo.txt")
    before = snapshot(decoys)
    result = run_port("convert", decoys / "ck" / "victim", "--out", decoys / "earlier", "--force")
    one_line(result, "not a port output", "--force replaces only")
    assert snapshot(decoys) == before and (decoys / "notes" / "todo.txt").read_text() == "mine"


def format_1_output(directory: Path, meta: str) -> None:
    """What port wrote before format 3: port.json and params/."""
    (directory / "params" / "d").mkdir(parents=True)
    (directory / "params" / "_METADATA").write_text("{}")
    (directory / "port.json").write_text(meta)


@pytest.mark.slow
@pytest.mark.parametrize(
    "meta, extra",
    [('{"format": 1, "leaves": {}}', None), ('{"format": 1}', "notes.txt"), ('{"format": 2}', None), ("[1]", None)],
)
def test_force_refuses_what_only_looks_like_an_earlier_output(tmp_path, meta, extra):
    """Port 0.1.0 writes and replaces format 3 only: an output of another format is not one `--force` replaces."""
    format_1_output(tmp_path / "old", meta)
    if extra:
        (tmp_path / "old" / extra).write_text("keep me")
    before = snapshot(tmp_path)
    result = run_port("convert", EXAMPLE, "--out", tmp_path / "old", "--force")
    one_line(result, "not a port output", "--force replaces only")
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_force_replaces_an_earlier_output(decoys):
    before = snapshot(decoys)
    result = run_port("convert", decoys / "ck" / "victim", "--mesh", "2x2", "--out", decoys / "earlier", "--force")
    assert result.returncode == 0, result.stderr
    after = snapshot(decoys)
    assert {k: v for k, v in after.items() if not k.startswith("earlier")} == {
        k: v for k, v in before.items() if not k.startswith("earlier")
    }
    assert sorted(p.name for p in (decoys / "earlier").iterdir()) == [
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "params",
        "port",
    ]
    assert not [p for p in decoys.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_without_force_nothing_is_replaced(decoys):
    before = snapshot(decoys)
    one_line(run_port("convert", decoys / "ck" / "victim", "--out", decoys / "earlier"), "already exists", "--force")
    assert snapshot(decoys) == before


@pytest.mark.slow
def test_report_is_replaced_only_if_port_wrote_it(decoys):
    report = decoys / "notes" / "todo.txt"
    before = snapshot(decoys)
    result = run_port("convert", decoys / "ck" / "victim", "--out", decoys / "new", "--report", report, "--force")
    one_line(result, "--report", "not a run report port wrote")
    assert snapshot(decoys) == before
    result = run_port("convert", decoys / "ck" / "victim", "--out", decoys / "new", "--report", decoys / "run.json")
    assert result.returncode == 0, result.stderr
    again = run_port(
        "convert", decoys / "ck" / "victim", "--out", decoys / "new", "--report", decoys / "run.json", "--force"
    )
    assert again.returncode == 0, again.stderr


KILL_THE_WORKER = """
import os, shutil, signal
if "PORT_SUPERVISOR_FDS" in os.environ:  # the worker alone gets SIGKILL (the OOM killer's pick) at one step of the swap
    step = os.environ["PORT_TEST_KILL_AT"]
    _rename, _rmtree = os.rename, shutil.rmtree
    def named(path, prefix):
        return os.path.basename(os.fspath(path)).startswith(prefix)
    def rename(source, target, *args, **kwargs):
        _rename(source, target, *args, **kwargs)
        if (step == "aside" and named(target, ".out.port-old-")) or (step == "new" and named(source, ".out.port-partial-")):
            os.kill(os.getpid(), signal.SIGKILL)
    def rmtree(path, *args, **kwargs):
        if step == "removing" and named(path, ".out.port-old-"):  # one file of the earlier output removed, then killed
            root, _, files = next(w for w in os.walk(path) if w[2])
            os.unlink(os.path.join(root, files[0]))
            os.kill(os.getpid(), signal.SIGKILL)
        _rmtree(path, *args, **kwargs)
    os.rename, shutil.rmtree = rename, rmtree
"""


def unstamped(tree: dict[str, str]) -> dict[str, str]:
    """A `snapshot` without the files Orbax stamps with the time of writing."""
    return {k: v for k, v in tree.items() if Path(k).name not in ("commit_success.txt", "_CHECKPOINT_METADATA")}


@pytest.fixture(scope="module")
def replaced(converted, tmp_path_factory):
    """For convert and export: the arguments of a run, the earlier output it replaces and, made by
    a run of those arguments, the new output it writes (different bytes)."""
    root = tmp_path_factory.mktemp("replaced")
    runs = {
        "convert": (("convert", EXAMPLE, "--mesh", "2x2"), converted),
        "export": (("export", converted, "--dtype", "bfloat16"), root / "earlier-export"),
    }
    assert run_port("export", converted, "--out", root / "earlier-export").returncode == 0
    made = {}
    for command, (args, earlier) in runs.items():
        new = run_port(*args, "--out", root / f"new-{command}")
        assert new.returncode == 0, new.stderr
        made[command] = (args, earlier, unstamped(snapshot(root / f"new-{command}")))
    return made


@pytest.mark.slow
@pytest.mark.parametrize("step", ["aside", "new", "removing"])
@pytest.mark.parametrize("command", ["convert", "export"])
def test_force_keeps_an_output_when_its_worker_is_killed(replaced, tmp_path, command, step):
    """Issue 32 row 2: `--force` whose worker alone is killed (SIGKILL) once the earlier output is
    moved aside, once the new one is renamed into place, or while the earlier one is being removed:
    `--out` holds the earlier output, byte for byte, or the complete new one, never nothing, and
    nothing is left beside it; 137 and one line."""
    args, earlier, new = replaced[command]
    out = tmp_path / "work" / "out"
    shutil.copytree(earlier, out)
    before = snapshot(out)
    env = hooked(tmp_path / "hook", KILL_THE_WORKER) | {"PORT_TEST_KILL_AT": step}
    result = run_port(*args, "--out", out, "--force", env=env)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("port: no accelerator")]
    assert (result.returncode, lines) == (137, ["port: stopped by signal 9 (SIGKILL)"]), result.stderr
    if step == "aside":
        assert snapshot(out) == before
    else:
        assert unstamped(snapshot(out)) == new != unstamped(before)
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]


ANOTHER_RUN_WRITES = """
import os
if "PORT_SUPERVISOR_FDS" in os.environ:  # in the worker: another run's output appears at --out once it is moved aside
    _rename = os.rename
    def rename(source, target, *args, **kwargs):
        _rename(source, target, *args, **kwargs)
        if os.path.basename(os.fspath(target)).startswith(".out.port-old-"):
            os.mkdir(source)
            with open(os.path.join(source, "theirs.txt"), "w") as f:
                f.write("theirs")
    os.rename = rename
"""


@pytest.mark.slow
def test_force_keeps_the_earlier_output_when_another_run_writes_out_meanwhile(replaced, tmp_path):
    """`--force` moved the earlier output aside and another run wrote `--out` before the new one
    was renamed in: theirs stays at `--out`, and the earlier output is kept aside, byte for byte,
    and said; the supervisor, which removes an aside only for the new output, leaves it."""
    args, earlier, _ = replaced["convert"]
    out = tmp_path / "work" / "out"
    shutil.copytree(earlier, out)
    before = snapshot(out)
    result = run_port(*args, "--out", out, "--force", env=hooked(tmp_path / "hook", ANOTHER_RUN_WRITES))
    line = one_line(result, "another run wrote it meanwhile; the earlier one is kept at ")
    (aside,) = [p for p in out.parent.iterdir() if p.name != "out"]
    assert line.endswith(str(aside)) and aside.name.startswith(".out.port-old-")
    assert snapshot(aside) == before
    assert list(snapshot(out)) == ["theirs.txt"] and (out / "theirs.txt").read_text() == "theirs"


# In Python: the moments between writing and the output being final.


@pytest.fixture(scope="module")
def loaded_tiny():
    """The tiny GPT-2 loaded on a 2x2 mesh, its mapping and config, for `port.save`."""
    import port

    with port.open_checkpoint(EXAMPLE) as ckpt:
        return port.load(EXAMPLE, mesh="2x2"), port.mapping_for(ckpt.config), ckpt.config


def test_a_failed_finalisation_keeps_the_earlier_output(loaded_tiny, tmp_path, monkeypatch):
    """The final rename fails (an I/O error) after `--force` moved the earlier output aside: it is put back."""
    import port
    import port._output._save
    from port._errors import OutputError

    model, mapping, config = loaded_tiny
    out = tmp_path / "out"
    port.save(model, out, mapping, config)
    before = snapshot(tmp_path)
    rename = os.rename

    def failing(source, target):
        if ".port-partial-" in str(source):
            raise OSError(5, "Input/output error")
        rename(source, target)

    monkeypatch.setattr(port._output._save.os, "rename", failing)
    with pytest.raises(OutputError, match=r"^directory=.*: writing the checkpoint failed: Input/output error$"):
        port.save(model, out, mapping, config, force=True)
    assert snapshot(tmp_path) == before


def test_an_output_another_run_wrote_meanwhile_is_kept(loaded_tiny, tmp_path, monkeypatch):
    """Without `--force`, a directory that appears while port writes is never replaced."""
    import port
    import port._output._save
    from port._errors import OutputError

    checked = port._output._save.check_out

    def racing(directory, force=False, **kwargs):
        out = checked(directory, force, **kwargs)
        out.mkdir()  # the other run's output, after port checked
        (out / "theirs.txt").write_text("theirs")
        return out

    model, mapping, config = loaded_tiny
    monkeypatch.setattr(port._output._save, "check_out", racing)
    with pytest.raises(OutputError, match="another run wrote it meanwhile"):
        port.save(model, tmp_path / "out", mapping, config)
    assert sorted(snapshot(tmp_path)) == ["out", "out/theirs.txt"]
    assert (tmp_path / "out" / "theirs.txt").read_text() == "theirs"


@pytest.mark.slow
def test_missing_parents_of_out_are_made_and_removed_again_on_failure(tmp_path):
    """Issue 24 row 12: `--out a/b/out` makes `a/b` as `mkdir -p` would, only once writing starts;
    a run that fails leaves none of them; a file where a parent should be is one line."""
    done = run_port("convert", EXAMPLE, "--out", tmp_path / "a" / "b" / "out")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "a" / "b" / "out" / "port" / "metadata").is_file()

    failed = run_port("convert", EXAMPLE, "--mesh", "data=2,foo=2", "--out", tmp_path / "x" / "y" / "out")
    assert failed.returncode == 1 and not (tmp_path / "x").exists()

    import port

    made = []

    def stop(progress):  # fails once the output's directory (and its parents) exist
        made.append((tmp_path / "p" / "q").is_dir())
        raise RuntimeError("stopped by the test")

    with pytest.raises(RuntimeError, match="stopped by the test"):
        port.convert(EXAMPLE, out=tmp_path / "p" / "q" / "out", progress=stop)
    assert made == [True] and sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # p/q made, then removed

    report = tmp_path / "r" / "s" / "run.json"  # --report's parents too
    done = run_port("convert", EXAMPLE, "--out", tmp_path / "a" / "b" / "out2", "--report", report)
    assert done.returncode == 0, done.stderr
    assert json.loads(report.read_text())["bytes_read"] > 0
    draft = run_port(
        "scaffold", EXAMPLE, "--module", "port.models.gpt2:GPT2", "--out", tmp_path / "d" / "e" / "draft.toml"
    )
    assert draft.returncode == 0 and (tmp_path / "d" / "e" / "draft.toml").is_file(), draft.stderr
    (tmp_path / "file").write_text("not a directory")
    blocked = run_port("convert", EXAMPLE, "--out", tmp_path / "file" / "sub" / "out")
    one_line(blocked, f"--out {tmp_path / 'file' / 'sub' / 'out'}: {tmp_path / 'file'} is a file, not a directory")
    blocked = run_port("convert", EXAMPLE, "--out", tmp_path / "out3", "--report", tmp_path / "file" / "run.json")
    one_line(blocked, f"--report {tmp_path / 'file' / 'run.json'}: {tmp_path / 'file'} is a file, not a directory")
    assert not (tmp_path / "out3").exists()
    assert (tmp_path / "file").read_text() == "not a directory"
