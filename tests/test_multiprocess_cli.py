"""Multi-process runs that cannot go ahead end in one line and exit status 1 on every process.

Processes started with different settings stop before reading any tensor, naming the
difference; a process whose peers never join stops after `--timeout`. Never a C++
abort (`Check failure`, exit 134), a traceback or a hang. Every case starts real
processes (fresh interpreters, never a fork) and runs in seconds.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import port_command, port_env
from test_multiprocess import free_port

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt2"
LIMIT = 60  # seconds any one process may take


def run_all(commands: list[list[str]], delays: list[float] | None = None) -> list[tuple[int, str, float]]:
    """Start each command (after its delay), wait for all; (exit status, stderr, seconds) of each."""
    delays = delays or [0.0] * len(commands)
    started, procs = time.monotonic(), []
    try:
        for command, delay in sorted(zip(commands, delays), key=lambda c: c[1]):
            time.sleep(max(0.0, started + delay - time.monotonic()))
            procs.append(
                (
                    command,
                    time.monotonic(),
                    subprocess.Popen(
                        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=port_env()
                    ),
                )
            )
        results = {}
        for command, start, p in procs:
            _, err = p.communicate(timeout=max(1.0, start + LIMIT - time.monotonic()))
            results[id(command)] = (p.returncode, err, time.monotonic() - start)
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [results[id(command)] for command in commands]


def the_error(code: int, err: str) -> str:
    """The one `port: error:` line of a process that stopped cleanly with status 1."""
    assert code == 1, err
    assert "Traceback" not in err and "Check failure" not in err and "internal error" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("port: error:")]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------- port convert


@pytest.fixture(scope="module")
def wired():
    """Skip until `port convert` takes --timeout (and so joins, agrees and times out)."""
    result = subprocess.run(
        [*port_command(), "convert", "--help"], capture_output=True, text=True, env=port_env(), timeout=LIMIT
    )
    if "--timeout" not in result.stdout:
        pytest.skip("port convert has no --timeout yet")


def convert(out: Path, address: str, process: int, *extra: str) -> list[str]:
    return [
        *port_command(),
        "convert",
        str(TINY),
        "--mesh",
        "4x2",
        "--out",
        str(out),
        "--coordinator",
        address,
        "--num-processes",
        "2",
        "--process-id",
        str(process),
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, first, second, expected",
    [
        ("--dtype", [], ["--dtype", "bfloat16"], ["process 0 has", "process 1 has bfloat16"]),
        ("--dtype", ["--dtype", "float32"], ["--dtype", "bfloat16"], ["process 0 has float32, process 1 has bfloat16"]),
        (
            "--mesh",
            [],
            ["--mesh", "2x4"],
            ["process 0 has data=4,model=2, process 1 has data=2,model=4"],
        ),  # same device count
        ("--out", [], ["--out", "{tmp}/other"], ["process 0 has {tmp}/out", "process 1 has {tmp}/other"]),
    ],
)
def test_processes_that_disagree_stop_before_reading(wired, tmp_path, flag, first, second, expected):
    out, address = tmp_path / "out", f"127.0.0.1:{free_port()}"
    # A later flag wins: process 1's --mesh 2x4 / --out other replaces the shared one.
    extras = [[a.format(tmp=tmp_path) for a in first], [a.format(tmp=tmp_path) for a in second]]
    results = run_all([convert(out, address, i, *extras[i]) for i in range(2)])
    for code, err, _ in results:
        line = the_error(code, err)
        assert line.startswith(f"port: error: processes disagree on {flag}: "), line
        for part in expected:
            assert part.format(tmp=tmp_path) in line, line
        assert "converted" not in err
    assert sorted(os.listdir(tmp_path)) == [], "no output, no hidden partial output"


@pytest.mark.slow
def test_the_stores_port_in_use_stops_port_convert(wired, tmp_path):
    import socket

    port = free_port()
    out, address = tmp_path / "out", f"127.0.0.1:{port}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        [(code, err, _)] = run_all([convert(out, address, 0)])
    assert the_error(code, err) == (
        f"port: error: --coordinator {address}: port {port + 1} (the coordinator's port + 1, where port's "
        "processes exchange settings) is already in use on this host; choose another --coordinator port"
    )
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.parametrize("process", [0, 1])
def test_a_process_alone_stops_after_the_timeout(wired, tmp_path, process):
    out, address = tmp_path / "out", f"127.0.0.1:{free_port()}"
    [(code, err, seconds)] = run_all([convert(out, address, process, "--timeout", "3")])
    assert re.search(rf"waiting for 2 processes at .*{re.escape(address)}", err), err
    line = the_error(code, err)
    assert f"--coordinator {address}" in line and "3 s" in line and "--timeout" in line, line
    if process == 0:
        assert "not all 2 processes joined" in line, line
    else:
        assert "no coordinator answered" in line, line
    assert seconds < LIMIT
    assert not out.exists()


# ---------------------------------------------------------------- the functions, in a small driver

DRIVER = textwrap.dedent("""
    import json, logging, os, sys, time
    from port import _console
    from port._runtime import agree, initialize, on_stuck
    from port._console import say
    from port._errors import PortError

    def stuck(error):  # a program that owns its process ends it, as the command line does
        if not _console.failed:
            say(f"error: {error}")
        os._exit(1)

    on_stuck(stuck)
    shown = logging.StreamHandler()  # the library's progress, as the command line shows it
    shown.setFormatter(logging.Formatter("port: %(message)s"))
    logging.getLogger("port").addHandler(shown)
    logging.getLogger("port").setLevel(logging.INFO)
    address, process, timeout, settings, then = sys.argv[1:6]
    try:
        initialize(address, 2, int(process), timeout=float(timeout))
        print("joined", file=sys.stderr, flush=True)
        if then == "leave":  # ends at once, without agreeing
            sys.exit(0)
        if then == "crash":  # vanishes at once: no exit handlers run
            os._exit(3)
        agree(json.loads(settings))
        print("agreed", file=sys.stderr, flush=True)
        if then.startswith("sleep"):  # keeps working while the other ends
            time.sleep(float(then[5:]))
    except PortError as e:
        say(f"error: {e}")
        sys.exit(1)
""")


@pytest.fixture
def driver(tmp_path):
    path = tmp_path / "driver.py"
    path.write_text(DRIVER)
    address = f"127.0.0.1:{free_port()}"

    def command(process, settings=None, timeout=5, then="-"):
        return [sys.executable, str(path), address, str(process), str(timeout), json.dumps(settings or {}), then]

    command.address = address
    return command


@pytest.mark.slow
def test_agree_passes_and_process_1_may_start_first(driver):
    settings = {"--mesh": "4x2", "--dtype": None, "--force": False}
    results = run_all([driver(0, settings), driver(1, settings)], delays=[2.0, 0.0])
    for code, err, _ in results:
        assert code == 0 and "agreed" in err and "port:" not in err, err


@pytest.mark.slow
def test_agree_names_the_first_difference_on_every_process(driver):
    first = {"mesh": "4x2", "dtype": "float32", "out": "/a", "force": True}
    second = {"mesh": "4x2", "dtype": "bfloat16", "out": "/b", "force": False}
    for code, err, _ in run_all([driver(0, first), driver(1, second)]):
        assert the_error(code, err) == (
            "port: error: processes disagree on dtype=: process 0 has float32, process 1 has bfloat16"
        )


@pytest.mark.slow
def test_agree_stops_when_the_other_process_ended_without_agreeing(driver):
    (code0, err0, seconds), (code1, err1, _) = run_all([driver(0, timeout=30), driver(1, timeout=30, then="leave")])
    assert the_error(code0, err0) == "port: error: process 1 ended before sending its settings: see its output"
    assert seconds < 25  # at once, not after --timeout
    assert code1 == 0 and "Check failure" not in err1, err1


@pytest.mark.slow
def test_agree_stops_at_once_when_the_other_process_vanished(driver):
    (code0, err0, seconds), (code1, _, _) = run_all([driver(0, timeout=30), driver(1, timeout=30, then="crash")])
    assert the_error(code0, err0) == "port: error: process 1 ended before sending its settings: see its output"
    assert seconds < 25 and code1 == 3  # its connection to the store closed: not after --timeout


@pytest.mark.slow
def test_a_process_waits_at_exit_for_a_slower_one(driver):
    results = run_all([driver(0, then="sleep3"), driver(1)])
    for code, err, _ in results:
        assert code == 0 and "Check failure" not in err, err
    assert "port: process 1/2: waiting up to 5 s (timeout=) for process 0 to end" in results[1][1]


@pytest.mark.slow
def test_a_process_alone_stops_after_the_timeout_from_python(driver):
    [(code, err, seconds)] = run_all([driver(1, timeout=3)])
    assert the_error(code, err) == (
        f"port: error: coordinator={driver.address}: no coordinator answered within 3 s (timeout=3); "
        "start process 0 (process_id=0) on that host, or check HOST:PORT"
    )
    assert seconds < 30


@pytest.mark.slow
def test_the_coordinators_port_in_use(driver):
    import socket

    host, port = driver.address.split(":")
    with socket.socket() as taken:
        taken.bind((host, int(port)))
        taken.listen()
        [(code, err, _)] = run_all([driver(0)])
    assert the_error(code, err) == (
        f"port: error: coordinator={driver.address}: port {port} is already in use on this host "
        "(another run's coordinator?); choose a free port"
    )


@pytest.mark.slow
def test_the_stores_port_in_use(driver):
    import socket

    host, port = driver.address.split(":")
    with socket.socket() as taken:
        taken.bind((host, int(port) + 1))
        taken.listen()
        [(code, err, _)] = run_all([driver(0)])
    assert the_error(code, err) == (
        f"port: error: coordinator={driver.address}: port {int(port) + 1} (the coordinator's port + 1, where "
        "port's processes exchange settings) is already in use on this host; choose another coordinator= port"
    )


def test_one_process_agrees_with_itself():
    from port._runtime import agree

    agree({"--dtype": "bfloat16"})  # not a multi-process run: nothing to compare


def test_disagreements_read_as_settings():
    from port._runtime import _MISSING, _disagreement

    assert _disagreement("dtype", {0: None, 1: "bfloat16"}) == (
        "processes disagree on dtype=: process 0 has no dtype=, process 1 has bfloat16"
    )
    assert _disagreement("force", {0: True, 1: False, 2: True}) == (
        "processes disagree on force=: processes 0, 2 have force=, process 1 has no force="
    )
    assert _disagreement("mapping", {0: "gpt2.toml", 1: _MISSING}) == (
        "processes disagree on mapping=: process 0 has gpt2.toml, process 1 has no mapping="
    )
    long = _disagreement("mapping text", {0: "a = 1\n" * 20, 1: "a = 2\n" * 20})
    assert "\n" not in long and "process 0 has 120 characters with sha256 " in long


def test_a_wait_past_its_timeout_goes_to_the_on_stuck_handler_then_raises():
    """A wait port cannot abandon (inside JAX's C++) never prints or exits from the library: past its
    timeout the handler gets the RunError (the command line's ends the process), and once the wait
    returns the caller gets it too."""
    from port._errors import RunError
    from port._runtime import _within, on_stuck

    seen = []
    previous = on_stuck(seen.append)
    try:
        with pytest.raises(RunError, match="^coordinator=h:1: late$"):
            _within(0.2, lambda: "coordinator=h:1: late", lambda: time.sleep(1.0))
        assert [str(e) for e in seen] == ["coordinator=h:1: late"]
        _within(5.0, lambda: "never", lambda: None)  # in time: nothing
        assert len(seen) == 1
    finally:
        on_stuck(previous)


def test_the_default_on_stuck_handler_logs_on_the_port_logger(caplog):
    from port._errors import RunError
    from port._runtime import _within, on_stuck

    previous = on_stuck(None)
    try:
        with caplog.at_level("ERROR", logger="port"), pytest.raises(RunError, match="^late$"):
            _within(0.2, lambda: "late", lambda: time.sleep(1.0))
    finally:
        on_stuck(previous)
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [("port", "ERROR", "late")]
