"""The runtime: meshes, simulated CPU devices, and multi-process runs, in one place.

**Meshes.** A mesh spec is read by `port._meshes` (no JAX); `make_mesh` builds the
mesh. `"4x2"` is the short form of `"data=4,model=2"` (and `"8"` of
`"data=8,model=1"`); the named form gives a mesh of any rank with any axis names,
which mapping rules may then name (`expert = "expert"`). On a machine with no
accelerator, a mesh needing more devices than there are is simulated with host CPU
devices, which JAX allows only before it starts; in a multi-process run each process
simulates its share (`devices_per_process`).

```python
mesh = make_mesh("4x2")                    # Mesh(data=4, model=2)
mesh_shape("8")                            # {"data": 8, "model": 1}
mesh_shape("data=2,expert=2,model=2")      # {"data": 2, "expert": 2, "model": 2}
```

**Multi-process runs** are JAX's own (`jax.distributed`). Every process runs the
same conversion; the mesh spans all their devices, and `jax.make_array_from_callback`
asks each process only for the blocks of its own devices, so each reads only what its
devices hold, and each writes the chunk files of those blocks into the one output
(`port._output`: process 0 writes the metadata and renames it into place once all have).

```python
port.initialize("10.0.0.1:1234", num_processes=2, process_id=0)   # before any JAX work
mesh = port.make_mesh("4x2")                                         # all processes' devices
model = port.load("gpt2", mesh=mesh)
```

The same from the environment: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`.

`agree` checks, before any tensor is read, that every process was given the same
settings, through the run's own key-value store (`port._store`, served by process 0
on the coordinator's port + 1). Joining, agreeing and, at exit, waiting for the others
to end each take at most `timeout` seconds. JAX's own deadlines for the same waits end
in a C++ abort (`Check failure`, exit 134), so port sets them later than its own.
(A process killed before it agreed is noticed at once, by the store; one killed later,
mid-run, only by JAX's heartbeat, after 100 s, and that still aborts the others: JAX
offers no hook for it.)

**When a wait cannot be abandoned.** Agreeing and exchanging are port's own waits: past
`timeout` they raise a `RunError`. Two kinds of wait are not: joining (a thread blocked
in JAX's C++, which no Python exception or signal interrupts) and, at exit, waiting for
the other processes to end (an `atexit` hook, where an exception is only printed, and
after which JAX's own exit would wait again and abort). There port calls a handler with
the `RunError` that says why (`on_stuck`), from a watchdog thread or the exit hook. The
library itself never prints and never ends the process: by default the handler logs the
error on the `port` logger, and `initialize` raises it once JAX's wait returns (if JAX
does not abort first). A program that owns its process installs a handler that ends it;
the command line's says `port: error: ...` and exits with status 1 at once, so a run
that cannot go on never hangs. The progress line of the exit wait ("waiting up to N s
for process K to end") is logged on the `port` logger at level INFO.

```python
def stuck(error: port.RunError) -> None:
    print(f"error: {error}", file=sys.stderr)
    os._exit(1)

port._runtime.on_stuck(stuck)
port.initialize("10.0.0.1:1234", num_processes=2, process_id=1, timeout=60)
```

Messages name the Python parameters (`mesh='2x3': ...`, `coordinator=HOST:PORT: ...`,
`timeout=60`); the command line shows them as its flags.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import logging
import math
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Mapping as AnyMapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import jax
import numpy as np
from jax.sharding import Mesh

from ._errors import PortError, RunError
from ._meshes import devices_per_process, env_int, mesh_shape, mesh_spec
from ._store import ENDED as _ENDED
from ._store import Store, bind_addresses, serve
from ._text import quoted

log = logging.getLogger("port")

MAX_SIMULATED = 512  # CPU devices port simulates in one process (JAX's start-up grows with them)


def _user_count() -> str | None:
    """The environment variable through which the user set the CPU device count, if any."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return "XLA_FLAGS"
    if os.environ.get("JAX_NUM_CPU_DEVICES"):
        return "JAX_NUM_CPU_DEVICES"
    return None


def simulate_devices(count: int) -> bool:
    """Ask JAX for `count` host CPU devices if it has not started; True when it applied.

    Only the CPU platform is affected; an accelerator backend keeps its devices. A
    device count the user set (`XLA_FLAGS`, `JAX_NUM_CPU_DEVICES`) is kept.
    """
    if _user_count():
        return False
    if count > MAX_SIMULATED:
        raise PortError(
            f"mesh= needs {count} devices in this process; port simulates at most {MAX_SIMULATED} CPU "
            "devices (on accelerators, JAX's own devices are used)"
        )
    if jax.config.jax_num_cpu_devices >= count:  # pyright: ignore[reportAttributeAccessIssue]  # jax's Config stub lacks its options
        return False
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # JAX has started: its devices are what they are
        return False
    return True


def make_mesh(spec: str | dict[str, int], devices: list | None = None) -> Mesh:
    """A mesh from a spec or axis sizes, over the first devices JAX has.

    On a host with no accelerator, the CPU devices the mesh needs are simulated if JAX
    has not started yet (in a multi-process run, each process its share).

    **Arguments:**

    - `spec`: `"4x2"` (axes `data` x `model`), `"8"`, named axes of any rank such as
      `"data=2,expert=2,model=2"`, or a dict of axis sizes.
    - `devices`: the devices to lay out (default: `jax.devices()`, in order).

    ```python
    mesh = port.make_mesh("4x2")
    mesh = port.make_mesh({"data": 2, "expert": 2, "model": 2})
    ```
    """
    shape = mesh_shape(spec) if isinstance(spec, str) else dict(spec)
    needed = math.prod(shape.values())
    label = spec if isinstance(spec, str) else mesh_spec(shape)
    if devices is None:
        if not jax.distributed.is_initialized():
            simulate_devices(needed)
        else:  # every process adds its share, in a run port joined (one JAX joined alone sets its own)
            if (processes := num_processes()) is not None:
                simulate_devices(devices_per_process(shape, processes, label))
        devices = jax.devices()
    if len(devices) < needed:
        platform = devices[0].platform if devices else "no"
        if platform != "cpu":
            hint = " (JAX_PLATFORMS=cpu simulates them on the host)"
        elif _user_count():
            hint = f" (the CPU device count is set by {_user_count()})"
        else:
            hint = (
                " (JAX started before port could add CPU devices: call port.make_mesh first, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={needed})"
            )
        raise PortError(f"mesh={label} needs {needed} devices but JAX has {len(devices)} {platform}{hint}")
    grid = np.array(devices[:needed]).reshape(tuple(shape.values()))
    return Mesh(grid, tuple(shape))


def _sizes(mesh: Any) -> dict[str, int]:
    """The axis sizes of a mesh given as a spec, as axis sizes, or None (one device); checked as a spec is."""
    if mesh is None:
        return mesh_shape("1x1")
    if isinstance(mesh, str):
        return mesh_shape(mesh)
    if isinstance(mesh, AnyMapping) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in mesh.items()
    ):
        return mesh_shape(mesh_spec(dict(mesh)))
    raise PortError(
        f"`mesh`: expected a jax.sharding.Mesh, a spec such as '4x2', or axis sizes such as {{'data': 2}}; "
        f"got {quoted(mesh)}"
    )


def as_shape(mesh: Mesh | str | AnyMapping[str, int] | None) -> dict[str, int]:
    """The axis sizes of `mesh`, given as any of the forms `as_mesh` takes; needs no device."""
    return dict(mesh.shape) if isinstance(mesh, Mesh) else _sizes(mesh)


def as_mesh(mesh: Mesh | str | AnyMapping[str, int] | None) -> Mesh:
    """`mesh` itself, or the mesh `make_mesh` builds from a spec (`"2x4"`) or axis sizes; None is one device."""
    if isinstance(mesh, Mesh):
        return mesh
    return make_mesh(mesh if isinstance(mesh, str) else _sizes(mesh))  # a spec is named in messages as given


# ---------------------------------------------------------------------------- multi-process runs

DEFAULT_TIMEOUT = 300.0
# JAX's own deadlines, set past port's so that port's always run out first.
_JAX_JOIN_MARGIN = 30  # jax aborts about 5 s after its initialization_timeout
_JAX_SHUTDOWN_TIMEOUT = 300  # jax's default; raised to stay past a longer timeout


@dataclass
class _Run:
    coordinator: str
    num_processes: int
    process_id: int
    timeout: float
    store: Store | None = None  # the run's key-value store (more than one process)
    rounds: int = 0  # agree() calls so far: each round has its own keys


_run: _Run | None = None
_service = None  # process 0's store service (port._store)


def _store() -> Store:
    """This process's connection to the run's key-value store (see `port._store`)."""
    if _run is None or _run.store is None:
        raise RunError("not in a multi-process run: call port.initialize first")
    return _run.store


Stuck = Callable[[RunError], object]
"""What `on_stuck` takes: called with the `RunError` that says why a run cannot go on."""


def _logged(error: RunError) -> None:
    """The default `on_stuck` handler: the error on the `port` logger; the process is the caller's."""
    log.error("%s", error)


_on_stuck: Stuck = _logged


def on_stuck(handler: Stuck | None) -> Stuck:
    """Set what port does when a wait of a multi-process run that it cannot abandon runs past
    its `timeout`; returns the handler it replaces. None restores the default.

    Such waits are joining the run (inside JAX's C++, which no exception interrupts) and,
    at exit, waiting for the other processes to end (an `atexit` hook). `handler` is
    called with the `RunError` that says why, from a watchdog thread or the exit hook. A
    program that owns its process ends it there (the command line says `port: error:
    ...` and exits with status 1); if the handler returns, port goes on as it can:
    `initialize` raises the error once JAX's wait returns (JAX's own timeout, later than
    port's, may abort the process first), and the exit hook stops waiting. The default
    logs the error on the `port` logger.

    **Arguments:**

    - `handler`: a function of one `RunError`, or None for the default.

    ```python
    def stuck(error):
        print(f"error: {error}", file=sys.stderr)
        os._exit(1)

    on_stuck(stuck)
    ```
    """
    global _on_stuck
    previous, _on_stuck = _on_stuck, handler or _logged
    return previous


def _stuck(error: RunError) -> None:
    """Hand `error` to the `on_stuck` handler; what it raises is logged, never lost in a thread."""
    try:
        _on_stuck(error)
    except Exception:  # noqa: BLE001 - a watchdog thread or an exit hook has no caller to raise to
        log.exception("the on_stuck handler failed on: %s", error)


def _within(seconds: float, message: Callable[[], str], step: Callable[[], Any]) -> None:
    """Run `step`; if it has not returned after `seconds`, hand `RunError(message())` to the
    `on_stuck` handler (from a watchdog thread: `step` waits inside JAX's C++, which no
    Python exception can interrupt), and raise it here once `step` returns."""
    done, lock = threading.Event(), threading.Lock()
    late: list[RunError] = []

    def watch() -> None:
        if done.wait(seconds):
            return
        error = RunError(message())
        with lock:  # never once `step` has returned: the handler may end the process
            if not done.is_set():
                late.append(error)
                _stuck(error)

    threading.Thread(target=watch, name="port-timeout", daemon=True).start()
    try:
        step()
    except Exception:
        if not late:
            raise
    finally:
        with lock:
            done.set()
    if late:
        raise late[0]


def _listening(coordinator: str) -> bool:
    """Whether anything accepts connections at HOST:PORT (within a second)."""
    host, _, port = coordinator.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def _port_taken(coordinator: str) -> bool:
    """Whether process 0 cannot serve at HOST:PORT because the port is in use here.

    JAX would log the failed bind and go on, to crash later; a probe bind where JAX
    binds (every address, unless JAX_COORDINATOR_BIND_ADDRESS says otherwise) tells first.
    """
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or "[::]:" + coordinator.rpartition(":")[2]
    port = bind.rpartition(":")[2]
    for family, address in bind_addresses():
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed run's TIME_WAIT is fine
                probe.bind((address, int(port)))
            return False
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
        except ValueError:
            return False
    return False


def _not_joined(coordinator: str, num_processes: int, process_id: int, timeout: float) -> str:
    limit = f"within {timeout:g} s (timeout={timeout:g})"
    if process_id != 0 and not _listening(coordinator):
        return (
            f"coordinator={coordinator}: no coordinator answered {limit}; start process 0 "
            "(process_id=0) on that host, or check HOST:PORT"
        )
    where = "" if process_id == 0 else "reached the coordinator, but "
    return (
        f"coordinator={coordinator}: {where}not all {num_processes} processes joined {limit}; start every "
        f"process with the same coordinator= and num_processes={num_processes}, process_id=0 to "
        f"{num_processes - 1}"
    )


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_devices: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> bool:
    """Join a multi-process run, from the arguments or JAX's environment variables.

    Returns False (and does nothing) when neither names a run. On a machine with no
    accelerator, each process simulates `local_devices` CPU devices, and processes
    exchange data through gloo. Call it before JAX starts (before any JAX operation).

    **Arguments:**

    - `coordinator`: `HOST:PORT` of process 0, where it serves the run's coordinator.
    - `num_processes`, `process_id`: the run's size, and this process, 0 to N-1.
    - `local_devices`: CPU devices this process simulates (no accelerator only).
    - `timeout`: seconds to wait for all processes to join. Past it, port hands a
      `RunError` (`coordinator=HOST:PORT: ...`) to the `on_stuck` handler, since JAX
      cannot abandon a half-made connection (its own timeout, set later than this one,
      would abort the process), and raises it once JAX's wait returns; the command
      line's handler says it and exits with status 1. The same bound applies to
      `agree` and, at exit, to waiting for the other processes to end.

    ```python
    port.initialize("10.0.0.1:1234", num_processes=2, process_id=1, timeout=60)
    ```
    """
    global _run
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes if num_processes is not None else env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else env_int("JAX_PROCESS_ID")
    if coordinator is None or num_processes is None or process_id is None:
        if coordinator is None and num_processes is None and process_id is None:
            return False
        raise RunError(
            "a multi-process run needs all of coordinator=HOST:PORT, num_processes=N and "
            "process_id=I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)"
        )
    if ":" not in coordinator:
        raise RunError(f"coordinator={coordinator!r}: expected HOST:PORT")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise RunError(f"process_id={process_id}: expected 0 <= I < num_processes={num_processes}")
    if not timeout > 0 or math.isinf(timeout):
        raise RunError(f"timeout={timeout:g}: expected a positive number of seconds")
    if local_devices:
        simulate_devices(local_devices)
    if process_id == 0 and _port_taken(coordinator):
        raise RunError(
            f"coordinator={coordinator}: port {coordinator.rpartition(':')[2]} is already in use on this "
            "host (another run's coordinator?); choose a free port"
        )
    global _service
    if process_id == 0 and num_processes > 1 and _service is None:
        _service = serve(coordinator, num_processes)  # before JAX: the others connect once they have joined
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

    def join() -> None:
        try:
            jax.distributed.initialize(
                coordinator,
                num_processes,
                process_id,
                initialization_timeout=math.ceil(timeout) + _JAX_JOIN_MARGIN,
                shutdown_timeout_seconds=max(_JAX_SHUTDOWN_TIMEOUT, math.ceil(timeout) + 2 * _JAX_JOIN_MARGIN),
            )
        except (RuntimeError, ValueError) as e:
            raise RunError(f"coordinator={coordinator}: could not join the run ({_first(e)})") from None

    _within(timeout, lambda: _not_joined(coordinator, num_processes, process_id, timeout), join)
    _run = _Run(coordinator, num_processes, process_id, float(timeout))
    if num_processes > 1:
        # Every process starts its devices here, together (JAX exchanges their list), so that one
        # that stops from here on leaves the others a wait this bounds, not one inside JAX's C++.
        _within(
            timeout,
            lambda: (
                f"coordinator={coordinator}: the other processes did not start their devices within {timeout:g} s "
                f"(timeout={timeout:g}): see their output"
            ),
            jax.devices,
        )
        try:
            _run.store = Store.connect(coordinator, process_id, num_processes, timeout)
        except RunError as e:  # joined JAX already: its exit would wait for the others, then abort
            _stuck(e)
            raise
        atexit.register(_leave)  # after JAX's own exit hook was registered: runs before it
    return True


def num_processes() -> int | None:
    """The number of processes in the run `initialize` joined; None outside one (or in one JAX started alone)."""
    return _run.num_processes if _run is not None and jax.distributed.is_initialized() else None


def _current() -> _Run | None:
    """This process's run, as `initialize` joined it (None in a run started with `jax.distributed` alone)."""
    return _run if _run is not None and jax.distributed.is_initialized() else None


def exchange(name: str, value: str, what: str = "its part", timeout: float | None = None) -> dict[int, str]:
    """Every process's `value`, by process: each publishes its own and waits for the others'.

    Through the run's key-value store; `{0: value}` outside a multi-process run. Call it
    the same number of times, with the same `name`, in every process. A process that
    ends before sending, or does not send within `timeout` (default: the run's), is a
    `RunError` naming it and `what` it should have sent.

    **Arguments:**

    - `name`: the exchange's name (each call gets its own round of keys).
    - `value`: this process's text.
    - `what`: how messages name the value (`"its settings"`).
    - `timeout`: seconds to wait for the others.

    ```python
    counts = exchange("export-written", str(bytes_written))   # {0: "123", 1: "456"}
    ```
    """
    run = _current()
    if run is None or run.num_processes < 2:
        return {0: value}
    timeout = run.timeout if timeout is None else timeout
    run.rounds += 1
    store = _store()
    prefix = f"port/{name}/{run.rounds}/"
    texts = {run.process_id: value}
    deadline = time.monotonic() + timeout
    store.set(prefix + str(run.process_id), value)
    for process in range(run.num_processes):
        if process == run.process_id:
            continue
        while (text := store.get(prefix + str(process), min(1.0, deadline - time.monotonic()))) is None:
            if store.get(_ENDED + str(process)) is not None:
                raise RunError(f"process {process} ended before sending {what}: see its output")
            if time.monotonic() >= deadline:
                raise RunError(
                    f"process {process} did not send {what} within {timeout:g} s (timeout={timeout:g}): see its output"
                )
        texts[process] = text
    return dict(sorted(texts.items()))


def run_token() -> str:
    """Random hex naming this run's temporary files: process 0's, the same in every process of the run.

    ```python
    partial = out.parent / f".{out.name}.port-partial-{run_token()}"
    ```
    """
    mine = secrets.token_bytes(8)
    if _current() is not None:  # a run port joined: through its store
        token = exchange("token", mine.hex(), "the run's name")[0]
        if not re.fullmatch(r"[0-9a-f]{16}", token):  # it names a directory: a plain name, never a path
            raise RunError(f"process 0 sent {quoted(token, 40)} as the run's name, not 16 hex digits")
        return token
    if jax.process_count() > 1:  # a run JAX joined alone: through a collective
        from jax.experimental import multihost_utils

        shared = multihost_utils.broadcast_one_to_all(np.frombuffer(mine, np.uint32))
        return np.asarray(shared).astype(np.uint32).tobytes().hex()
    return mine.hex()


_MISSING = object()  # a key one process's settings lack


def _shown(key: str, value: object) -> str:
    """A setting as a user reads it: `bfloat16`, `no dtype=`, `force=` (True), a digest for long text."""
    if value is _MISSING or value is None or value is False:
        return f"no {key}="
    if value is True:
        return f"{key}="
    if isinstance(value, str):
        if len(value) <= 80 and "\n" not in value:
            return value
        digest = hashlib.sha256(value.encode(errors="replace")).hexdigest()[:12]
        return f"{len(value)} characters with sha256 {digest}"
    return json.dumps(value)


def _disagreement(key: str, values: dict[int, object]) -> str:
    """`processes disagree on KEY=: process 0 has A, process 1 has B` (equal values grouped)."""
    groups: dict[str, list[int]] = {}
    for process, value in values.items():
        same = "\0" if value is _MISSING else json.dumps(value, sort_keys=True)
        groups.setdefault(same, []).append(process)
    parts = []
    for processes in groups.values():
        shown = _shown(key, values[processes[0]])
        if len(processes) == 1:
            parts.append(f"process {processes[0]} has {shown}")
        else:
            parts.append(f"processes {', '.join(map(str, processes))} have {shown}")
    return f"processes disagree on {key}=: {', '.join(parts)}"


JsonValue: TypeAlias = "str | int | float | bool | None | Sequence[JsonValue] | AnyMapping[str, JsonValue]"
"""A value `json.dumps` writes: a setting `agree` compares."""


def agree(settings: dict[str, JsonValue], timeout: float | None = None) -> None:
    """Check that every process of the run was given the same settings; a no-op in one process.

    Each process publishes its `settings` through the run's key-value store
    (`port._store`: no device collective, so it works even when the processes disagree
    on the mesh) and reads everyone else's. A run joined with `jax.distributed`
    alone, not `initialize`, has no such store: there this is a no-op. On every process, the first key whose values differ
    raises `RunError("processes disagree on KEY=: process 0 has A, process 1 has B")`.
    Call it before reading any tensor data, the same number of times in every process.

    **Arguments:**

    - `settings`: parameter names (`"dtype"`, as messages name them: `dtype=`) to JSON values.
    - `timeout`: seconds to wait for the other processes' settings (default: the
      `timeout` given to `initialize`); past it, a `PortError` names the missing process.

    ```python
    agree({"mesh": "4x2", "dtype": "bfloat16", "out": "/shared/gpt2-jax"})
    ```
    """
    mine = json.dumps(settings, default=str)
    texts = exchange("agree", mine, "its settings", timeout)
    if len(texts) < 2:
        return
    everyone = {process: json.loads(texts[process]) for process in sorted(texts)}
    keys = list(dict.fromkeys(key for values in everyone.values() for key in values))
    for key in keys:
        values = {process: values.get(key, _MISSING) for process, values in everyone.items()}
        if len({"\0" if v is _MISSING else json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            raise RunError(_disagreement(key, values))


def _first(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _leave() -> None:
    """At exit: wait up to the run's timeout for the other processes to end too, then leave.

    JAX's own exit waits for every process as well, and ends in a C++ abort of every
    process when one never comes. This wait comes first: when a process will not come,
    it hands a `RunError` saying why to the `on_stuck` handler (the command line's ends
    the process with one line) and stops waiting. A process that leaves this way says so
    in the store, so that the others do not wait in JAX's exit for it. Process 0, which
    serves the store, leaves last.
    """
    run = _run
    if run is None or run.store is None or not jax.distributed.is_initialized():
        return
    store = run.store
    try:
        store.set(_ENDED + str(run.process_id), "ended", overwrite=True)
    except PortError:  # no store left: nothing to wait for
        return
    deadline = time.monotonic() + run.timeout
    error = _others_ended(run, store, deadline)
    if error is not None:
        _stuck(error)
        return
    store.close()
    if _service is not None:  # the others read their last answers before the store goes
        _service.wait_disconnected(max(0.0, deadline - time.monotonic()))


def _others_ended(run: _Run, store: Store, deadline: float) -> RunError | None:
    """Wait until every other process has said it ended, or `deadline`; the `RunError` saying
    which will not come, if one will not. The wait is logged once on the `port` logger (INFO)."""
    said = False
    for process in range(run.num_processes):
        while process != run.process_id:
            try:
                state = store.get(_ENDED + str(process), min(1.0, deadline - time.monotonic()))
            except PortError as e:
                return RunError(f"{e} while waiting for process {process} to end")
            if state == "gone":
                return RunError(f"process {process} ended without waiting for process {run.process_id}: see its output")
            if state == "lost":
                return RunError(f"process {process} stopped before the end of the run: see its output")
            if state is not None:
                break
            if time.monotonic() >= deadline:
                try:
                    store.set(_ENDED + str(run.process_id), "gone", overwrite=True)
                except PortError:  # leaving anyway
                    pass
                return RunError(
                    f"process {process} did not end within {run.timeout:g} s (timeout={run.timeout:g}) of "
                    f"process {run.process_id}: see its output"
                )
            if not said:
                said = True
                log.info(
                    "process %d/%d: waiting up to %g s (timeout=) for process %d to end",
                    run.process_id,
                    run.num_processes,
                    run.timeout,
                    process,
                )
    return None
