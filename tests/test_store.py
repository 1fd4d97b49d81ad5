"""The run's key-value store against a process that is not the run's.

A third local process can reach process 0's store (the coordinator's port + 1). Whatever
it sends, it cannot make a process of the run write outside its output, read another
process's settings as its own, pass a check it should fail or grow process 0's memory
without bound: each case here is an attack, and what the run does about it.
"""

import json
import socket
import subprocess
import sys
import time

import pytest
from test_multiprocess_cli import TINY, convert, run_all, the_error

import port._store as store_module
from port._errors import RunError
from port._store import MAX_HELLO, MAX_STRANGERS, Store, serve

from helpers import port_env
from test_multiprocess import free_port


@pytest.fixture
def service():
    """A store for a run of 2 processes on 127.0.0.1, and its coordinator's address."""
    address = f"127.0.0.1:{free_port()}"
    running = serve(address, 2)
    running.address = address
    yield running
    running.shutdown()
    running.server_close()


def raw(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port) + 1), timeout=5)


def ask(connection: socket.socket, request: dict) -> dict | None:
    """Send one request line; its reply, or None when the service closed the connection."""
    connection.sendall(json.dumps(request).encode() + b"\n")
    line = connection.makefile("rb").readline()
    return json.loads(line) if line else None


def test_a_coordinator_on_loopback_keeps_the_store_on_loopback(service):
    assert service.server_address[0] == "127.0.0.1"


def test_a_stranger_that_claims_a_process_first_stops_the_real_one(service):
    stranger = raw(service.address)
    assert ask(stranger, {"op": "hello", "process": 1, "num_processes": 2}) == {"ok": True}
    with pytest.raises(
        RunError,
        match=r"process 1 is already connected to this run \(two processes with the "
        r"same process_id=, or a process that is not the run's\)",
    ):
        Store.connect(service.address, 1, 2, timeout=5)
    stranger.close()
    time.sleep(0.2)
    # Gone, its id stays claimed: a process that was connected never comes back as another.
    with pytest.raises(RunError, match="process 1 is already connected"):
        Store.connect(service.address, 1, 2, timeout=5)


def test_a_process_sets_only_its_own_keys(service):
    one = Store.connect(service.address, 1, 2, timeout=5)
    # The attack of the finding: process 0's run name, made a path.
    with pytest.raises(RunError, match=r"process 1 may set only its own keys, not 'port/token/2/0'"):
        one.set("port/token/2/0", "x/../../evil-partial")
    with pytest.raises(RunError, match="process 1 may set only its own keys, not 'port/ended/0'"):
        one.set("port/ended/0", "gone", overwrite=True)
    with pytest.raises(RunError, match="may set only its own keys"):
        one.set("elsewhere", "x")
    one.set("port/agree/1/1", '{"--dtype": "float32"}')
    assert one.get("port/agree/1/1") == '{"--dtype": "float32"}'
    one.close()


def test_a_value_is_never_replaced_unasked(service):
    zero = Store.connect(service.address, 0, 2, timeout=5)
    zero.set("port/agree/1/0", "a")
    zero.set("port/agree/1/0", "a")  # the same value again: fine
    with pytest.raises(RunError, match="port/agree/1/0 is already set to another value"):
        zero.set("port/agree/1/0", "b")
    assert zero.get("port/agree/1/0") == "a"
    zero.set("port/ended/0", "ended", overwrite=True)
    zero.set("port/ended/0", "gone", overwrite=True)
    assert zero.get("port/ended/0") == "gone"
    zero.close()


def test_a_connection_stores_a_bounded_amount(service, monkeypatch):
    monkeypatch.setattr(store_module, "MAX_CONNECTION_BYTES", 10_000)
    zero = Store.connect(service.address, 0, 2, timeout=5)
    for round_ in range(3):
        zero.set(f"port/agree/{round_}/0", "x" * 3000)
    with pytest.raises(RunError, match="process 0 stored more than 10000 bytes"):
        zero.set("port/agree/9/0", "x" * 3000)
    zero.close()


def test_before_hello_a_line_is_short_and_the_first_request_is_hello(service):
    flood = raw(service.address)
    flood.sendall(b"x" * (MAX_HELLO + 10))  # no newline: the service reads no further than MAX_HELLO
    assert flood.makefile("rb").readline() == b""
    flood.close()
    early = raw(service.address)
    assert ask(early, {"op": "get", "key": "port/agree/1/0", "seconds": 0}) is None
    early.close()


def test_connections_past_the_run_and_a_few_strangers_are_refused(service):
    held = [raw(service.address) for _ in range(2 + MAX_STRANGERS)]
    time.sleep(0.3)
    extra = raw(service.address)
    assert extra.makefile("rb").readline() == b""  # closed at once
    for connection in held:
        connection.close()
    time.sleep(0.3)
    again = raw(service.address)
    assert ask(again, {"op": "hello", "process": 0, "num_processes": 2}) == {"ok": True}
    again.close()


def test_run_token_takes_only_hex(monkeypatch):
    import port._runtime as runtime

    monkeypatch.setattr(runtime, "_current", lambda: object())
    monkeypatch.setattr(runtime, "exchange", lambda *a, **k: {0: "x/../../evil-partial", 1: "00" * 8})
    with pytest.raises(
        RunError,
        match=r"process 0 sent 'x/\.\./\.\./evil-partial' as the run's name, "
        r"not 16 hex digits",
    ):
        runtime.run_token()
    monkeypatch.setattr(runtime, "exchange", lambda *a, **k: {0: "0123456789abcdef"})
    assert runtime.run_token() == "0123456789abcdef"


STRANGER = """
import json, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 30
while True:
    try:
        s = socket.create_connection((host, port), timeout=1)
        if s.getsockname() != s.getpeername():
            break
        s.close()  # TCP's self-connect: nothing listened yet and the kernel gave it the port itself
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(2)
    time.sleep(0.02)
f = s.makefile("rb")
def ask(request):
    s.sendall(json.dumps(request).encode() + b"\\n")
    return json.loads(f.readline())
print(json.dumps(ask({"op": "hello", "process": 1, "num_processes": 2})), flush=True)
print(json.dumps(ask({"op": "set", "key": "port/token/2/1", "value": "x/../../evil"})), flush=True)
print(json.dumps(ask({"op": "set", "key": "port/token/2/0", "value": "x/../../evil"})), flush=True)
print(json.dumps(ask({"op": "set", "key": "port/ended/0", "value": "gone", "overwrite": True})), flush=True)
time.sleep(40)
"""


@pytest.mark.slow
def test_a_third_process_cannot_make_the_run_write_outside_or_succeed(tmp_path):
    """The finding's attack with real processes: a third process connects to process 0's store
    first, as process 1, and tries to set process 0's run name to a path and its end. Process 1
    stops with one line; process 0 stops after --timeout; nothing is written anywhere."""
    address = f"127.0.0.1:{free_port()}"
    host, port = address.split(":")
    work = tmp_path / "work"
    work.mkdir()
    stranger = subprocess.Popen(
        [sys.executable, "-c", STRANGER, host, str(int(port) + 1)], stdout=subprocess.PIPE, text=True, env=port_env()
    )
    try:
        out = work / "out"
        results = run_all(
            [convert(out, address, 0, "--timeout", "8"), convert(out, address, 1, "--timeout", "8")], delays=[0.0, 1.0]
        )
    finally:
        stranger.kill()
        said = stranger.communicate()[0].splitlines()
    assert json.loads(said[0]) == {"ok": True}  # it got in first, as process 1...
    assert all("may set only its own keys" in json.loads(line)["error"] for line in said[2:4])  # ...not as 0
    (code0, err0, _), (code1, err1, _) = results
    assert "process 1 is already connected to this run" in the_error(code1, err1)
    the_error(code0, err0)
    assert "converted" not in err0 + err1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"] and list(work.iterdir()) == []
    assert TINY.is_dir()


def test_an_output_missing_a_chunk_is_never_made_final(tmp_path, monkeypatch):
    """Whatever the processes report, process 0 looks: a chunk file that never reached this
    output's directory (written elsewhere, as the finding's process 1 was made to) stops the
    save with one line, and nothing is left."""
    import port
    import port._output._save as save

    real = save._write_chunk

    def astray(file, shard, chunks):  # says it wrote the chunk, and wrote it somewhere else
        stray = file.name == "0.0" and file.parent.name == "wte"
        return real(tmp_path / "elsewhere" if stray else file, shard, chunks)

    monkeypatch.setattr(save, "_write_chunk", astray)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(
        port.OutputError,
        match=r"^out=.*/out: leaf 'wte': 1 of its 2 chunk files are missing "
        r"\(first 0\.0\); the output is not complete$",
    ):
        port.convert(TINY, mesh="2x2", out=work / "out")
    assert list(work.iterdir()) == []
