"""Interrupts: Ctrl-C (SIGINT) or SIGTERM stops `port` at once and removes what it was writing.

The `port` command runs in two processes. The one the user started is a small
supervisor that never imports JAX: it starts the worker (the same command), passes
its exit status through, and handles SIGINT and SIGTERM. On a signal it kills the
worker outright (every thread with it: the threads writing the output's files, and
JAX's C++ threads, which no exception would stop), removes every path the worker registered
with `removing` (an earlier output `--force` had moved aside, registered with `putting_back`,
is put back instead, unless the new one is in place), says `port: interrupted`, and exits
with 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM). A worker that fails or dies
any other way (an error, a crash, the kernel's OOM killer) is cleaned up after the same way,
so `--out` holds the earlier output or the new one at every moment. The worker
runs in a process group of its own (a terminal's Ctrl-C reaches the supervisor only);
a SIGINT or SIGTERM sent to the worker's own pid is passed to the supervisor, which
acts on it as on its own.

The worker marks what it writes with `port._cleanup`'s `removing`, `putting_back` and `final`;
this module is the supervisor's side, part of the command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ._cleanup import SIGNALS, SUPERVISOR_FDS


def _remove(path: Path) -> None:
    """Remove a file or directory tree, never following a symlink at `path`."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def _put_back(aside: Path, out: Path, new: tuple[int, int]) -> None:
    """An earlier output the worker moved aside (`putting_back`): renamed back to `out` if nothing is
    there, removed if the new output is (`new`, its device and inode), else left as it is (another run
    wrote `out` meanwhile), as it is if the rename fails: the next run at `out` finds it
    (`port._leftovers`)."""
    try:
        there = os.lstat(out)
    except OSError:
        with contextlib.suppress(OSError):
            os.rename(aside, out)
        return
    if (there.st_dev, there.st_ino) == new:
        _remove(aside)


class _Worker:
    """What the worker has told the supervisor: paths to undo (removed, or an earlier output put back:
    `back`), whether it is in `final`, whether its work is `finished`."""

    def __init__(self, pipe: int) -> None:
        self.pipe = pipe
        self.paths: list[Path] = []
        # an earlier output moved aside -> where it goes back, and the new output's device and inode
        self.back: dict[Path, tuple[Path, tuple[int, int]]] = {}
        self.in_final = False
        self.finished = False
        self._buffer = b""

    def read(self, timeout: float | None) -> bool:
        """Take in what the worker wrote within `timeout`; False once it closed the pipe."""
        ready, _, _ = select.select([self.pipe], [], [], timeout)
        if not ready:
            return True
        chunk = os.read(self.pipe, 65536)
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            kind, *paths = json.loads(line)
            if kind in "+<":
                self.paths.append(Path(paths[0]))
                if kind == "<":  # aside, out, the new output's device and inode
                    self.back[Path(paths[0])] = (Path(paths[1]), (paths[2], paths[3]))
            elif kind == "-":
                self.paths.remove(Path(paths[0]))
                self.back.pop(Path(paths[0]), None)
            elif kind == "=":
                self.finished = True
            else:
                self.in_final = kind == "["
        return bool(chunk)

    def drain(self) -> bool:
        """Take in everything the worker has written so far; False once it closed the pipe."""
        while select.select([self.pipe], [], [], 0)[0]:
            if not self.read(0):
                return False
        return True


_received: list[int] = []


def _noted(signum: int, frame: object) -> None:
    _received.append(signum)


def hold_signals() -> None:
    """From now on, note SIGINT and SIGTERM for `supervise` instead of acting on them; call it first thing.

    Both stay blocked until the worker has started: it inherits the mask and
    ignores them before unblocking, so a Ctrl-C while it starts is never a
    KeyboardInterrupt there, and here a signal that came meanwhile is handled
    once `supervise` unblocks them. Setting the handler also undoes a parent's
    SIG_IGN (a shell's `cmd &`).
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    for s in SIGNALS:
        signal.signal(s, _noted)


def supervise(argv: Sequence[str], say: Callable[[str], None], deadline: float | None = None) -> int:
    """Run `argv` as the worker and return the exit status `port` should end with.

    With `deadline` (seconds), a worker still running then is stopped as an interrupt
    stops it (what it registered removed; a `final` block first finished), and the
    status is 1 with one line saying so; unless it said its work is `finished` (its
    output in place, only its report and its exit left).
    """
    received = _received
    ends = None if deadline is None else time.monotonic() + deadline
    late = False
    hold_signals()  # in case the caller did not
    notes_read, notes_write = os.pipe()
    lifeline_read, lifeline_write = os.pipe()
    signals_read, signals_write = os.pipe()
    env = os.environ | {SUPERVISOR_FDS: f"{notes_write},{lifeline_read},{signals_write}"}
    try:
        worker = subprocess.Popen(
            list(argv), env=env, pass_fds=(notes_write, lifeline_read, signals_write), process_group=0
        )
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    for fd in (notes_write, lifeline_read, signals_write):
        os.close(fd)
    os.set_blocking(signals_read, False)
    told = _Worker(notes_read)
    open_pipe = True
    while True:
        try:  # signals sent to the worker's pid, as its handler wrote them
            received.extend(n for n in os.read(signals_read, 64) if n in SIGNALS)
        except (BlockingIOError, OSError):
            pass
        if ends is not None and not late and time.monotonic() > ends and worker.poll() is None:
            if open_pipe:  # what it wrote before the deadline counts: a finished run is not late
                open_pipe = told.drain()
            late = not told.finished
        if (received and (not told.in_final or len(received) > 1)) or (late and not told.in_final and not received):
            worker.kill()
            worker.wait()
            while open_pipe:
                open_pipe = told.read(0)
            break
        if open_pipe:
            open_pipe = told.read(0.1)
        elif worker.poll() is None:
            try:
                worker.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
        if worker.poll() is not None and not open_pipe:
            break
    # Decided: a signal from now on changes nothing. Ignored rather than noted, since
    # Python's finalization puts a noted signal back to the default action, and one
    # arriving then would kill this process after the worker had finished.
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    for path in reversed(told.paths):
        if path in told.back:
            _put_back(path, *told.back[path])
        else:
            _remove(path)
    if received:
        say("interrupted" if received[0] == signal.SIGINT else "terminated")
        return 128 + received[0]
    code = worker.returncode
    if late and code == -signal.SIGKILL:
        say(
            f"error: --deadline {deadline:g}: the run had not finished after {deadline:g} s; stopped, "
            "and what it was writing removed"
        )
        return 1
    if code < 0:
        say(f"stopped by signal {-code} ({signal.Signals(-code).name})")
        return 128 - code
    return code
