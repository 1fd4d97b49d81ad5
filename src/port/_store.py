"""The run's key-value store: small strings the processes of a run exchange.

Process 0 serves it on the port after the coordinator's (`coordinator=
HOST:1234` -> HOST:1235); every process, process 0 included, connects as a client.
It carries what JAX's collectives cannot: each process's settings before anything is
read (when processes may disagree even on the mesh, so no collective would match),
and, at exit, whether each process has ended. JAX keeps a store of its own in its
coordinator, but offers no public way to reach it.

The service knows which process each connection belongs to: when one closes before
its process said it ended, the store records that process as `lost`, so the others
learn at once that it will not come, instead of waiting out their timeout.

Messages are lines of JSON, each at most `MAX_LINE` bytes (a connection's first, its
`hello`, at most `MAX_HELLO`). What the service trusts, and what it does not:

- It listens where JAX's coordinator does, and only on the loopback interface when the
  coordinator's host is a loopback address (`coordinator=127.0.0.1:P`).
- Each process id may connect once: a second `hello` as a process that is, or was,
  connected is refused (so a stranger that connects first as process 1 makes the real
  process 1 stop with one line, never the other way round unnoticed).
- A connection sets only its own process's keys (`port/NAME/ROUND/ID`,
  `port/ended/ID`), never overwrites a value with another unless it asks to, and sets
  at most `MAX_CONNECTION_BYTES` in all; at most `num_processes + MAX_STRANGERS`
  connections are open at once.
- The clients validate what they read before using it (`_runtime.run_token` takes only
  16 hex digits).

Like JAX's own coordinator, it has no password: a process that can reach the port
first can claim an id that no process of the run has claimed yet, and so stop the run;
it cannot make a process write outside its output or pass a check it should fail.

```python
store = Store.connect("10.0.0.1:1234", process_id=1, num_processes=2, timeout=60)
store.set("port/agree/1/1", '{"mesh": "4x2"}')
store.get("port/agree/1/0", seconds=5.0)        # the value, or None after 5 s
```
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import re
import socket
import socketserver
import threading
import time
from typing import Any

from ._errors import RunError

MAX_LINE = 64 << 20  # a message: settings hold the mapping's text, at most a few MB
MAX_HELLO = 4096  # a connection's first line, before it says which process it is
MAX_CONNECTION_BYTES = 2 * MAX_LINE  # what one connection may store, all its values together
MAX_STRANGERS = 4  # connections beyond one per process that may be open at once
MAX_KEYS = 100_000
_OWN_KEY = re.compile(r"port/(?:[a-z0-9-]+/[0-9]+|ended)/([0-9]+)")  # ...its last part: the process that sets it
ENDED = "port/ended/"  # + process id: "ended" at exit, "gone" if it left without the others, "lost" if it vanished


def store_address(coordinator: str) -> tuple[str, int]:
    """Where the store of the run coordinated at `coordinator` (`HOST:PORT`) listens: HOST, PORT + 1."""
    host, _, port = coordinator.rpartition(":")
    return host.strip("[]"), int(port) + 1


# ---------------------------------------------------------------------------- the service, in process 0


class _Service(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True  # a closed run's TIME_WAIT is fine

    def __init__(self, address: tuple[str, int], family: int, num_processes: int):
        self.address_family = family
        self.num_processes = num_processes
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()
        self.connected: set[int] = set()
        self.claimed: set[int] = set()  # every process id that said hello, connected or not
        self.open = 0  # connections open now
        super().__init__(address, _Connection, bind_and_activate=False)
        if family == socket.AF_INET6:  # IPv4 clients too, where the host has both
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            self.server_bind()
            self.server_activate()
        except BaseException:
            self.server_close()
            raise

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Refuse a connection past `num_processes + MAX_STRANGERS` open ones."""
        with self.changed:
            if self.open >= self.num_processes + MAX_STRANGERS:
                return False
            self.open += 1
            return True

    def shutdown_request(self, request: Any) -> None:
        with self.changed:
            self.open -= 1
        super().shutdown_request(request)

    def claim(self, process: int) -> bool:
        """Mark `process` connected; False if it is, or was, already."""
        with self.changed:
            if process in self.claimed:
                return False
            self.claimed.add(process)
            self.connected.add(process)
            return True

    def put(self, key: str, value: str, overwrite: bool = True) -> None:
        """Set `key`; an existing different value stays, and is an error, unless `overwrite`."""
        with self.changed:
            if key in self.values and not overwrite:
                if self.values[key] != value:
                    raise ValueError(f"{key} is already set to another value")
                return
            if key not in self.values and len(self.values) >= MAX_KEYS:
                raise ValueError("too many keys")
            self.values[key] = value
            self.changed.notify_all()

    def wait(self, key: str, seconds: float) -> str | None:
        deadline = time.monotonic() + seconds
        with self.changed:
            while key not in self.values:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.changed.wait(left)
            return self.values[key]

    def wait_disconnected(self, seconds: float) -> None:
        """Wait up to `seconds` until no client but process 0 is connected."""
        deadline = time.monotonic() + seconds
        with self.changed:
            while self.connected - {0} and (left := deadline - time.monotonic()) > 0:
                self.changed.wait(left)


class _Connection(socketserver.StreamRequestHandler):
    @property
    def service(self) -> _Service:
        """The store this connection talks to (`self.server`, typed as the base class has it)."""
        assert isinstance(self.server, _Service)  # _Service makes a _Connection per client
        return self.server

    def handle(self) -> None:
        process, stored = None, 0
        try:
            while line := self.rfile.readline((MAX_LINE if process is not None else MAX_HELLO) + 1):
                if len(line) > (MAX_LINE if process is not None else MAX_HELLO) or not line.endswith(b"\n"):
                    return
                request = json.loads(line)
                if not isinstance(request, dict):
                    return
                if process is None:  # the first line says which process this is, or the connection ends
                    reply = self._hello(request)
                    if "ok" in reply:
                        process = request["process"]
                else:
                    reply, stored = self._answer(request, process, stored)
                self.wfile.write(json.dumps(reply).encode() + b"\n")
                self.wfile.flush()
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return
        finally:
            if process is not None:
                try:
                    self.service.put(ENDED + str(process), "lost", overwrite=False)
                except ValueError:  # it had said how it ended
                    pass
                with self.service.changed:
                    self.service.connected.discard(process)
                    self.service.changed.notify_all()

    def _hello(self, request: dict) -> dict:
        if request.get("op") != "hello":
            raise ValueError("hello first")
        who = request.get("process")
        if type(who) is not int or not 0 <= who < self.service.num_processes:
            raise ValueError("bad hello")
        if request.get("num_processes") != self.service.num_processes:
            return {"error": f"this run has {self.service.num_processes} processes"}
        if not self.service.claim(who):
            return {
                "error": f"process {who} is already connected to this run (two processes with the same "
                "process_id=, or a process that is not the run's)"
            }
        return {"ok": True}

    def _answer(self, request: dict, process: int, stored: int) -> tuple[dict, int]:
        """The reply to a request of `process`'s connection, and what it has stored since."""
        op = request["op"]
        key = request["key"]
        if not isinstance(key, str):
            raise ValueError("bad key")
        if op == "set":
            value = request["value"]
            if not isinstance(value, str):
                raise ValueError("bad value")
            own = _OWN_KEY.fullmatch(key)
            if own is None or int(own.group(1)) != process:
                return {"error": f"process {process} may set only its own keys, not {key[:80]!r}"}, stored
            stored += len(key) + len(value)
            if stored > MAX_CONNECTION_BYTES:
                return {"error": f"process {process} stored more than {MAX_CONNECTION_BYTES} bytes"}, stored
            try:
                self.service.put(key, value, request.get("overwrite", False) is True)
            except ValueError as e:
                return {"error": str(e)}, stored
            return {"ok": True}, stored
        if op == "get":
            seconds = request["seconds"]
            if not isinstance(seconds, (int, float)) or not 0 <= seconds <= 86400:
                raise ValueError("bad wait")
            return {"value": self.service.wait(key, float(seconds))}, stored
        raise ValueError("bad op")


def bind_addresses() -> list[tuple[int, str]]:
    """Where JAX's coordinator listens, as (address family, host) to try in order.

    Every address (IPv6, and IPv4 with it, or IPv4 alone where there is no IPv6),
    unless `JAX_COORDINATOR_BIND_ADDRESS` names a host.
    """
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
    host = bind.rpartition(":")[0].strip("[]") if bind else ""
    if host in ("", "::"):
        return [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    return [(socket.AF_INET6 if ":" in host else socket.AF_INET, host)]


def _loopback(host: str) -> list[tuple[int, str]] | None:
    """Where to listen for a coordinator on a loopback host (`127.0.0.1`, `::1`, `localhost`);
    None for any other host."""
    if host == "localhost":
        return [(socket.AF_INET, "127.0.0.1")]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not address.is_loopback:
        return None
    return [(socket.AF_INET6 if address.version == 6 else socket.AF_INET, host)]


def serve(coordinator: str, num_processes: int) -> _Service:
    """Start process 0's store beside the coordinator; `RunError` if its port is taken.

    It listens where JAX's coordinator does (every address, or the host in
    `JAX_COORDINATOR_BIND_ADDRESS`), on the next port; only on the loopback interface
    when the coordinator's host is a loopback address.
    """
    host, port = store_address(coordinator)
    error: OSError | None = None
    for family, address in _loopback(host) or bind_addresses():
        try:
            service = _Service((address, port), family, num_processes)
            break
        except OSError as e:
            error = e
    else:
        in_use = error is not None and error.errno == errno.EADDRINUSE
        reason = "already in use on this host" if in_use else f"cannot listen ({error})"
        raise RunError(
            f"coordinator={coordinator}: port {port} (the coordinator's port + 1, where port's processes "
            f"exchange settings) is {reason}; choose another coordinator= port"
        )
    threading.Thread(target=service.serve_forever, name="port-store", daemon=True).start()
    return service


# ---------------------------------------------------------------------------- the client, in every process


class Store:
    """One process's connection to the run's store (see the module's docstring)."""

    def __init__(self, connection: socket.socket, where: str):
        self._socket = connection
        self._file = connection.makefile("rb")
        self._lock = threading.Lock()
        self.where = where

    @classmethod
    def connect(cls, coordinator: str, process_id: int, num_processes: int, timeout: float) -> Store:
        """Connect to the store of the run at `coordinator`, retrying for up to `timeout` seconds."""
        host, port = store_address(coordinator)
        where = f"{host}:{port}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                connection = socket.create_connection(
                    (host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))
                )
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise RunError(
                        f"coordinator={coordinator}: process 0's settings exchange at {where} did not answer "
                        f"within {timeout:g} s ({e.strerror or e})"
                    ) from None
                time.sleep(0.1)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.settimeout(None)
        store = cls(connection, where)
        reply = store._ask({"op": "hello", "process": process_id, "num_processes": num_processes})
        if "error" in reply:
            store.close()
            error = str(reply["error"])[:300]
            if error.startswith("this run has"):
                error += f", not num_processes={num_processes}"
            raise RunError(f"coordinator={coordinator}: {error}")
        return store

    def _ask(self, request: dict, seconds: float | None = None) -> dict:
        data = json.dumps(request).encode() + b"\n"
        if len(data) > MAX_LINE:
            raise RunError(f"settings of {len(data)} bytes: more than the run's store takes ({MAX_LINE})")
        with self._lock:
            try:
                self._socket.settimeout(None if seconds is None else seconds + 30)
                self._socket.sendall(data)
                line = self._file.readline(MAX_LINE + 1)
            except OSError as e:
                raise RunError(f"the run's store at {self.where}: connection lost ({e.strerror or e})") from None
        if not line.endswith(b"\n"):
            raise RunError(f"the run's store at {self.where}: connection lost (process 0 ended?)")
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise RunError(f"the run's store at {self.where}: an answer that is not port's")
        return reply

    def set(self, key: str, value: str, overwrite: bool = False) -> None:
        """Set `key` (an error if it holds another value, unless `overwrite`)."""
        reply = self._ask({"op": "set", "key": key, "value": value, "overwrite": overwrite})
        if "error" in reply:
            raise RunError(f"the run's store at {self.where}: {str(reply['error'])[:300]}")

    def get(self, key: str, seconds: float = 0.0) -> str | None:
        """The value of `key`, waiting up to `seconds` for it to be set; None if it was not."""
        seconds = max(0.0, seconds)
        value = self._ask({"op": "get", "key": key, "seconds": seconds}, seconds).get("value")
        if value is not None and not isinstance(value, str):
            raise RunError(f"the run's store at {self.where}: an answer that is not port's")
        return value

    def close(self) -> None:
        try:
            self._file.close()
            self._socket.close()
        except OSError:
            pass
