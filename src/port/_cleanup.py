"""Cleanup marks: what a run is writing, for the `port` supervisor to remove if it is stopped.

Code that writes marks what to remove, and the step that makes the result final:

```python
with removing(partial):          # removed if the run is interrupted meanwhile
    write(partial)
    with final():                # an interrupt waits until the rename is done
        os.rename(partial, out)
```

`putting_back(aside, out, new)` marks an earlier output moved out of `out`'s way: put back
if the run stops before the new one (`new`) is at `out`, removed if after.

In a worker the command line's supervisor started (`attach`), each mark is a note on
a pipe to the supervisor (`port._interrupt`), which acts on Ctrl-C and SIGTERM.
Outside one (port used as a library) both are plain context managers: Python raises
`KeyboardInterrupt` as usual and the caller's `finally` blocks clean up. Nothing here
prints or reads the command line.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SUPERVISOR_FDS = "PORT_SUPERVISOR_FDS"  # "NOTES,LIFELINE,SIGNALS": a worker's ends of the three pipes

_lock = threading.RLock()
_notes: int | None = None  # the worker's end of the pipe to the supervisor


def _note(kind: str, *paths: str | int) -> None:
    if _notes is not None:
        os.write(_notes, (json.dumps([kind, *paths]) + "\n").encode())


@contextmanager
def removing(path: str | os.PathLike, create: Callable[[Path], object] | None = None) -> Iterator[Path]:
    """Within the block, an interrupt removes `path`, a file or directory this run creates.

    `create(path)` makes it (and must fail if something is already there); it runs
    before `path` is registered, and no interrupt is acted on in between, so nothing
    that was there before is ever removed. If the block raises, `path` stays
    registered: the supervisor removes it after the worker has ended, since threads
    of a failed write (Orbax's) may still create files there after any `finally`.
    """
    path = Path(path).absolute()
    with final():
        if create is not None:
            create(path)
        _note("+", str(path))
    yield path  # on an exception it stays registered: the supervisor removes it once the
    with _lock:  # worker has ended, when no thread of the worker can write there any more
        _note("-", str(path))


@contextmanager
def putting_back(aside: str | os.PathLike, out: str | os.PathLike, new: str | os.PathLike) -> Iterator[Path]:
    """Within the block, an interrupt or the worker's death puts `aside` back at `out` if nothing is
    there, removes it if the new output (made at `new`, which must exist, and renamed to `out`: the
    same device and inode) is at `out`, and leaves it otherwise (another run wrote `out` meanwhile):
    `aside` is where this run moves an earlier output while it renames `new` to `out`, so there is
    always an output at `out`, the earlier one or the new one, and the earlier one is removed only
    for the new one.

    As with `removing`, if the block raises `aside` stays registered until the worker has ended.
    """
    aside, out = Path(aside).absolute(), Path(out).absolute()
    made = os.lstat(new)
    with final():
        _note("<", str(aside), str(out), made.st_dev, made.st_ino)
    yield aside
    with _lock:
        _note("-", str(aside))


@contextmanager
def final() -> Iterator[None]:
    """An interrupt arriving within the block is acted on when the block is done."""
    with _lock:
        _note("[")
        try:
            yield
        finally:
            _note("]")


def finished() -> None:
    """The run's work is done (its output in place): a `--deadline` passing from now on, while the
    worker reports and ends, stops nothing. (Signals still do.)"""
    _note("=")


def attach() -> bool:
    """In a worker started by `supervise`: report to it from now on; False elsewhere.

    The worker leaves SIGINT and SIGTERM to the supervisor: one sent to the worker's
    pid is written (its number, one byte) to the supervisor's signal pipe by Python's
    C-level handler at once, even while the main thread is inside JAX, and changes
    nothing here. It ends itself if the supervisor disappears.
    """
    global _notes
    fds = os.environ.pop(SUPERVISOR_FDS, None)
    if fds is None:
        return False
    notes, lifeline, signals = (int(fd) for fd in fds.split(","))
    _notes = notes
    os.set_blocking(signals, False)
    signal.set_wakeup_fd(signals, warn_on_full_buffer=False)
    for s in SIGNALS:
        signal.signal(s, _passed_on)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # blocked by `supervise` until now

    def orphaned() -> None:
        while os.read(lifeline, 1):
            pass
        os._exit(1)

    threading.Thread(target=orphaned, name="port-lifeline", daemon=True).start()
    return True


def _passed_on(signum: int, frame: object) -> None:
    """The worker's handler: nothing (the wakeup fd told the supervisor, which decides)."""
