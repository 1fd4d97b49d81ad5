"""Ctrl-C and SIGTERM: `port: interrupted`, exit 130 (143), and nothing left behind.

A conversion of a GPT-2 small sized checkpoint (124M parameters, 498 MB) is
interrupted at random points from start-up to the end of the write, through the
real `port` entry point. Whatever the moment, the process ends at once with one
line and 130, and leaves no output directory and no hidden partial one; an earlier
output that `--force` was replacing is untouched. A signal that arrives after the
output was made final leaves that complete output.
"""

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import hooked, port_command, port_env

REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.slow  # every test interrupts `port` subprocesses


@pytest.fixture(scope="module")
def gpt2_small(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2-small") / "ckpt"
    subprocess.run([sys.executable, REPO / "bench" / "make_gpt2.py", "small", directory], check=True, timeout=300)
    return directory


def start(*args, env=None):
    return subprocess.Popen(
        [*port_command(), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=port_env(env),
    )


PAUSE_IN_SAVE = """
import os, time
if "PORT_SUPERVISOR_FDS" in os.environ:  # the worker: a minute's pause once its output directory is made
    _mkdir = os.mkdir
    def mkdir(path, *rest, **kw):
        _mkdir(path, *rest, **kw)
        if ".port-partial-" in str(path) and str(path).endswith("/port"):
            time.sleep(60)
    os.mkdir = mkdir
"""


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def complete(out: Path) -> bool:
    names = ["_CHECKPOINT_METADATA", "commit_success.txt", "params", "port"]
    return sorted(p.name for p in out.iterdir()) == names and "leaves" in json.loads(
        (out / "port" / "metadata").read_text()
    )


def interrupt_at(delay: float, *args, signum=signal.SIGINT):
    process = start(*args)
    time.sleep(delay)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=60)
    return process.returncode, stdout + stderr


def test_interrupt_at_random_points_leaves_nothing(gpt2_small, tmp_path):
    args = ("convert", gpt2_small, "--mesh", "4x2", "--out")
    began = time.perf_counter()
    whole = start(*args, tmp_path / "whole")
    assert whole.wait(timeout=300) == 0, whole.stderr.read()
    duration = time.perf_counter() - began

    rng = random.Random(7)
    interrupted = 0
    # Spread over the whole run: start-up, reading, placing, writing, finishing.
    for i, fraction in enumerate((0.05, 0.25, 0.45, 0.6, 0.75, 0.9)):
        out = tmp_path / f"out{i}"
        # Not within the interpreter's own start-up (~0.1 s), before port's code runs.
        delay = max(0.5, duration * rng.uniform(fraction - 0.05, fraction + 0.05))
        code, output = interrupt_at(delay, *args, out)
        assert "Traceback" not in output and "Check failure" not in output, output
        assert leftovers(tmp_path) == [], (fraction, output)
        if code == 0:  # finished before the signal came
            assert complete(out)
            continue
        assert code == 130, output
        assert output.strip().splitlines()[-1] == "port: interrupted", output
        assert not out.exists() or complete(out), output  # only once the output was final
        interrupted += 1
    assert interrupted >= 3


def test_interrupted_force_keeps_the_earlier_output(gpt2_small, tmp_path):
    out = tmp_path / "out"
    began = time.perf_counter()
    first = start("convert", gpt2_small, "--mesh", "2x2", "--out", out)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    duration = time.perf_counter() - began
    code, output = interrupt_at(0.5 * duration, "convert", gpt2_small, "--mesh", "2x2", "--out", out, "--force")
    assert code == 130, output
    assert complete(out)  # the earlier output, or (signal after the swap) the new one: never neither
    assert leftovers(tmp_path) == []


PAUSE_IN_EXPORT = """
import os, time
if "PORT_SUPERVISOR_FDS" in os.environ:  # the worker: a minute's pause once its first tensor file is open
    _open = os.open
    def open(path, flags, *rest, **kw):
        fd = _open(path, flags, *rest, **kw)
        if str(path) == "model.safetensors" and kw.get("dir_fd") is not None:
            time.sleep(60)
        return fd
    os.open = open
"""


def test_interrupted_export_leaves_nothing_and_keeps_the_earlier_export(gpt2_small, tmp_path):
    """`port export` of the 124M output, interrupted while a --force replacement writes its tensors
    (a hook holds the worker there, so the signal never races the swap under load): the earlier
    export untouched, nothing hidden left."""
    converted, out = tmp_path / "jax", tmp_path / "hf"
    assert start("convert", gpt2_small, "--out", converted).wait(timeout=300) == 0
    first = start("export", converted, "--out", out)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    process = start("export", converted, "--out", out, "--force", env=hooked(tmp_path / "hook", PAUSE_IN_EXPORT))
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".hf.port-partial-*/model.safetensors")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(".hf.port-partial-*/model.safetensors")), "the export never began writing"
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    output = stdout + stderr
    assert process.returncode == 130, output
    assert output.strip().splitlines()[-1] == "port: interrupted", output
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # the earlier export, untouched
    assert leftovers(tmp_path) == []


def test_sigterm_exits_143(gpt2_small, tmp_path):
    """SIGTERM while the run writes (a hook holds the worker there, so the signal never races the
    run's end under load): 143, `port: terminated`, no output and nothing hidden left."""
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    process = start("convert", gpt2_small, "--mesh", "4x2", "--out", out, env=hooked(tmp_path / "hook", PAUSE_IN_SAVE))
    deadline = time.monotonic() + 60
    while not list(out.parent.glob(".out.port-partial-*/port")) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    output = stdout + stderr
    assert process.returncode == 143, output
    assert output.strip().splitlines()[-1] == "port: terminated"
    assert not out.exists() and leftovers(out.parent) == []


def test_interrupt_while_starting(tmp_path):
    """Within the first second the worker is still importing JAX: still one line, 130, nothing left."""
    code, output = interrupt_at(0.3, "convert", REPO / "examples" / "tiny-gpt2", "--out", tmp_path / "out")
    assert code == 130, output
    assert output.strip().splitlines() == ["port: interrupted"]
    assert list(tmp_path.iterdir()) == []


def test_interrupt_while_port_itself_loads(tmp_path):
    """Issue 23 row 8: a Ctrl-C that lands while the command line's own modules load (here: sent by
    the process to itself as `port._cli` is first imported, before any of port's code has run)
    still ends in one line and 130, never a KeyboardInterrupt traceback or death by signal."""
    marker = tmp_path / "interrupted"
    hook = (
        "import importlib.abc, os, signal, sys\n"
        "class Interrupt(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name == 'port._cli' and not os.path.exists({str(marker)!r}):\n"
        f"            open({str(marker)!r}, 'w').close()\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Interrupt())\n"
    )
    example = REPO / "examples" / "tiny-gpt2"
    for command in (["port"], [sys.executable, "-m", "port"]):
        marker.unlink(missing_ok=True)
        env = port_env(hooked(tmp_path / "hook", hook))
        result = subprocess.run(
            [*command, "convert", example, "--out", tmp_path / "out"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert marker.exists()
        assert result.returncode == 130, (result.returncode, result.stderr)
        assert (result.stdout + result.stderr).strip().splitlines() == ["port: interrupted"]
        assert not (tmp_path / "out").exists()


def test_ctrl_c_in_a_terminal_clears_the_progress_bar(gpt2_small, tmp_path):
    """Issue 24 row 10: in a terminal, Ctrl-C while the bar is drawn leaves `port: interrupted` on a
    line of its own, the bar's line cleared and the cursor shown again, and 130."""
    import pty

    master, terminal = pty.openpty()
    process = subprocess.Popen(
        [*port_command(), "convert", gpt2_small, "--mesh", "4x2", "--out", tmp_path / "out"],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=port_env(),
    )
    os.close(terminal)
    seen, began = b"", time.monotonic()
    while b"tensors" not in seen and time.monotonic() - began < 120:  # the bar is drawn: placing
        if select.select([master], [], [], 1)[0]:
            seen += os.read(master, 1 << 16)
    process.send_signal(signal.SIGINT)
    while select.select([master], [], [], 10)[0]:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # the terminal's other end closed with the last process
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert process.wait(timeout=60) == 130, seen[-2000:]
    assert b"tensors" in seen and b"\x1b[2K" in seen, seen[-2000:]
    after = seen.rsplit(b"\x1b[2K", 1)[1]  # what follows the last line cleared
    assert after.replace(b"\x1b[?25h", b"").strip() == b"port: interrupted", seen[-2000:]
    assert not (tmp_path / "out").exists()


def test_signals_after_the_worker_ended_change_nothing(tmp_path):
    """Ctrl-C repeated while the supervisor exits (after its worker finished) never kills it.

    Python's finalization puts a handled signal back to its default action; a
    signal then would end the supervisor by SIGINT (-2) with a complete output.
    """
    script = tmp_path / "supervisor.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "from port._interrupt import supervise\n"
        "code = supervise([sys.executable, '-c', 'pass'], print)\n"
        "pelt = f'i=0; while [ $i -lt 200000 ] && kill -INT {os.getpid()} 2>/dev/null; do i=$((i+1)); done'\n"
        "subprocess.Popen(['sh', '-c', pelt], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "time.sleep(0.2)\n"
        "sys.exit(code)\n"
    )
    for _ in range(3):
        result = subprocess.run([sys.executable, script], capture_output=True, text=True, env=port_env(), timeout=60)
        assert result.returncode == 0, (result.returncode, result.stderr)


def worker_of(supervisor: subprocess.Popen, within: float = 30.0) -> int:
    """The pid of the worker `port` started (its only child)."""
    deadline = time.monotonic() + within
    children = Path(f"/proc/{supervisor.pid}/task/{supervisor.pid}/children")
    while time.monotonic() < deadline:
        pids = children.read_text().split()
        if pids:
            return int(pids[0])
        time.sleep(0.02)
    raise AssertionError("port started no worker")


@pytest.mark.parametrize(
    "signum, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_signal_sent_to_the_worker_stops_the_run_as_one_sent_to_port(gpt2_small, tmp_path, signum, code, word):
    """`kill WORKER_PID` (not port's own pid) is honoured: the same status, line and cleanup."""
    import os

    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    process = start("convert", gpt2_small, "--mesh", "4x2", "--out", out, env=hooked(tmp_path / "hook", PAUSE_IN_SAVE))
    worker = worker_of(process)
    deadline = time.monotonic() + 60
    while not list(out.parent.glob(".out.port-partial-*/port")) and time.monotonic() < deadline:
        time.sleep(0.05)  # the run under way, writing (the hook holds it there: the signal comes first)
    os.kill(worker, signum)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == code, stdout + stderr
    assert stderr.strip().splitlines()[-1] == f"port: {word}", stderr
    assert "Traceback" not in stderr and "converted" not in stderr
    assert not out.exists() and leftovers(out.parent) == []


@pytest.mark.slow
@pytest.mark.parametrize("finished", [True, False])
def test_the_deadline_stops_a_run_only_until_its_work_is_finished(tmp_path, finished):
    """A worker that says its work is `finished` (port does once its output is in place, before its
    report) and then takes past the deadline to end is let end: its own status, no line. One that
    has not said so is stopped at the deadline: exit 1, the one line."""
    script = tmp_path / "supervisor.py"
    worker = "from port._cleanup import attach, finished; import time; attach(); "
    worker += ("finished(); " if finished else "") + "time.sleep(2.5); print('ended')"
    script.write_text(
        "import sys\n"
        "from port._interrupt import supervise\n"
        f"sys.exit(supervise([sys.executable, '-c', {worker!r}], lambda m: print('port: ' + m), deadline=1.0))\n"
    )
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, env=port_env(), timeout=60)
    if finished:
        assert (result.returncode, result.stdout) == (0, "ended\n"), (result.returncode, result.stdout, result.stderr)
    else:
        assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
        assert result.stdout == (
            "port: error: --deadline 1: the run had not finished after 1 s; stopped, and what it was writing removed\n"
        )


@pytest.mark.slow
def test_a_conversion_done_before_its_deadline_is_not_stopped_while_it_ends(tmp_path):
    """`port convert --deadline 8` whose worker has converted well within the deadline but, at exit,
    takes until past it to end (a hook sleeps in its atexit): the output stays, `converted`, exit 0.
    (Before, the deadline killed such a worker after it had said `converted`, and said it had not
    finished.)"""
    linger = (
        "import atexit, os, time\n"
        "if os.environ.get('PORT_SUPERVISOR_FDS'):  # the worker: ends 9.5 s after it started\n"
        "    began = time.monotonic()\n"
        "    atexit.register(lambda: time.sleep(max(0.0, began + 9.5 - time.monotonic())))\n"
    )
    out = tmp_path / "out"
    result = subprocess.run(
        [*port_command(), "convert", REPO / "examples" / "tiny-gpt2", "--out", out, "--deadline", "8"],
        capture_output=True,
        text=True,
        env=port_env(hooked(tmp_path / "hook", linger)),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "port: converted " in result.stderr and "error" not in result.stderr, result.stderr
    assert (out / "port" / "metadata").is_file()
