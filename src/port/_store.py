"""The run's key-value store: small strings the processes of a run exchange.

Process 0 serves it on the port after the coordinator's (`--coordinator
HOST:1234` -> HOST:1235); every process, process 0 included, connects as a client.
It carries what JAX's collectives cannot: each process's settings before anything is
read (when processes may disagree even on the mesh, so no collective would match),
and, at exit, whether each process has ended. JAX keeps a store of its own in its
coordinator, but offers no public way to reach it.

The service knows which process each connection belongs to: when one closes before
its process said it ended, the store records that process as `lost`, so the others
learn at once that it will not come, instead of waiting out their timeout.

Messages are lines of JSON, each at most `MAX_LINE` bytes. Like JAX's own
coordinator, the service trusts the network it listens on.

```python
store = Store.connect("10.0.0.1:1234", process_id=1, num_processes=2, timeout=60)
store.set("port/agree/1/1", '{"--mesh": "4x2"}')
store.get("port/agree/1/0", seconds=5.0)        # the value, or None after 5 s
```
"""

from __future__ import annotations

import errno
import json
import os
import socket
import socketserver
import threading
import time
from typing import Any

from ._errors import RunError

MAX_LINE = 64 << 20  # a message: settings hold the mapping's text, at most a few MB
MAX_KEYS = 100_000
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
        super().__init__(address, _Connection, bind_and_activate=False)
        if family == socket.AF_INET6:  # IPv4 clients too, where the host has both
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            self.server_bind()
            self.server_activate()
        except BaseException:
            self.server_close()
            raise

    def put(self, key: str, value: str, overwrite: bool = True) -> None:
        with self.changed:
            if key in self.values and not overwrite:
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
    server: _Service

    def handle(self) -> None:
        process = None
        try:
            while line := self.rfile.readline(MAX_LINE + 1):
                if len(line) > MAX_LINE or not line.endswith(b"\n"):
                    return
                request = json.loads(line)
                reply = self._answer(request, process)
                if request.get("op") == "hello":
                    process = request["process"]
                    with self.server.changed:
                        self.server.connected.add(process)
                self.wfile.write(json.dumps(reply).encode() + b"\n")
                self.wfile.flush()
        except (OSError, ValueError, KeyError, TypeError):
            return
        finally:
            if process is not None:
                self.server.put(ENDED + str(process), "lost", overwrite=False)
                with self.server.changed:
                    self.server.connected.discard(process)
                    self.server.changed.notify_all()

    def _answer(self, request: Any, process: int | None) -> dict:
        op = request["op"]
        if op == "hello":
            who = request["process"]
            if not isinstance(who, int) or not 0 <= who < self.server.num_processes or process is not None:
                raise ValueError("bad hello")
            if request.get("num_processes") != self.server.num_processes:
                return {"error": f"this run has {self.server.num_processes} processes"}
            return {"ok": True}
        if process is None:
            raise ValueError("hello first")
        key = request["key"]
        if not isinstance(key, str):
            raise ValueError("bad key")
        if op == "set":
            if not isinstance(request["value"], str):
                raise ValueError("bad value")
            self.server.put(key, request["value"], bool(request.get("overwrite", False)))
            return {"ok": True}
        if op == "get":
            seconds = request["seconds"]
            if not isinstance(seconds, (int, float)) or not 0 <= seconds <= 86400:
                raise ValueError("bad wait")
            return {"value": self.server.wait(key, float(seconds))}
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


def serve(coordinator: str, num_processes: int) -> _Service:
    """Start process 0's store beside the coordinator; `RunError` if its port is taken.

    It listens where JAX's coordinator does (every address, or the host in
    `JAX_COORDINATOR_BIND_ADDRESS`), on the next port.
    """
    host, port = store_address(coordinator)
    error: OSError | None = None
    for family, address in bind_addresses():
        try:
            service = _Service((address, port), family, num_processes)
            break
        except OSError as e:
            error = e
    else:
        in_use = error is not None and error.errno == errno.EADDRINUSE
        reason = "already in use on this host" if in_use else f"cannot listen ({error})"
        raise RunError(
            f"--coordinator {coordinator}: port {port} (the coordinator's port + 1, where port's processes "
            f"exchange settings) is {reason}; choose another --coordinator port"
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
    def connect(cls, coordinator: str, process_id: int, num_processes: int, timeout: float) -> "Store":
        """Connect to the store of the run at `coordinator`, retrying for up to `timeout` seconds."""
        host, port = store_address(coordinator)
        where = f"{host}:{port}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                connection = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise RunError(
                        f"--coordinator {coordinator}: process 0's settings exchange at {where} did not answer "
                        f"within {timeout:g} s ({e.strerror or e})"
                    ) from None
                time.sleep(0.1)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.settimeout(None)
        store = cls(connection, where)
        reply = store._ask({"op": "hello", "process": process_id, "num_processes": num_processes})
        if "error" in reply:
            store.close()
            raise RunError(f"--coordinator {coordinator}: {reply['error']}, not --num-processes {num_processes}")
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
        return json.loads(line)

    def set(self, key: str, value: str, overwrite: bool = False) -> None:
        """Set `key` (kept as it was if already set, unless `overwrite`)."""
        self._ask({"op": "set", "key": key, "value": value, "overwrite": overwrite})

    def get(self, key: str, seconds: float = 0.0) -> str | None:
        """The value of `key`, waiting up to `seconds` for it to be set; None if it was not."""
        seconds = max(0.0, seconds)
        return self._ask({"op": "get", "key": key, "seconds": seconds}, seconds)["value"]

    def close(self) -> None:
        try:
            self._file.close()
            self._socket.close()
        except OSError:
            pass
