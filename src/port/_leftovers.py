"""Leftovers: what a run killed outright (SIGKILL, a power cut) left beside its output, found and undone later.

Port writes an output into a hidden sibling, `.OUT.port-partial-TOKEN`, and `--force`
moves the earlier output aside to `.OUT.port-old-TOKEN` for the moment of the rename
(`_destination.make_partial`, `_destination.put_in_place`). An interrupt or an error removes them; a
SIGKILL to the whole process group cannot. So each is *claimed* first: a small file
`.OUT.port-partial-TOKEN.owner` beside it says which process made it (host, pid, the
machine's boot, the process's PID namespace and start time, so a reused pid is not
mistaken for it), and is removed only after the directory is gone. Once the directory is
made (or, for a `port-old`, as the output about to be moved there is found) the owner
file is rewritten with its identity, device and inode: a leftover's name says nothing,
since anyone who may rename entries in `OUT`'s parent can put any directory at it.

The next run at the same `OUT` calls `recover` before it checks `OUT`, and undoes a
leftover only when every one of these holds: its owner file is there and well formed,
both belong to this user, neither is a link, the owner ran on this host, in this boot
of it and in this PID namespace, that process has ended, and the leftover is still the
very file or directory it made (`lstat`, device and inode, checked just before acting).
Then a `port-partial` is removed, and a `port-old` is renamed back to `OUT` if `OUT` is
missing (the run died between moving the old output aside and putting the new one in
place) or removed if `OUT` is a finished output of the same kind (the run died just
before removing it). Anything else is left as it is and said: a leftover whose process
port cannot see (another host, another boot of a host of this name, another PID
namespace: a container) once its owner file is an hour old (until then it may be the
partial output of a process of this very run), one without a well-formed owner file, one
whose owner file an earlier port wrote (no identity), one that is not what its run made,
a `port-old` beside something that is not an output of that kind.

```python
with claimed(partial, os.mkdir):             # .OUT.port-partial-TOKEN.owner, then the directory
    ...
recover(Path("/abs/out/gpt2"), is_output)    # ["removed .gpt2.port-partial-... (a run killed ...)"]
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeGuard

from ._cleanup import removing
from ._text import one_line

OWNER = ".owner"  # the claim's suffix: `.OUT.port-partial-TOKEN.owner`
MAX_OWNER_BYTES = 4096  # an owner file is about 250 bytes
QUIET_SECONDS = 3600  # a leftover whose process cannot be seen, younger than this, may be a run's of now
MAX_PID = 2**31 - 1  # a pid is a C int
MAX_STAT = 2**64 - 1  # a start time, device or inode number
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
log = logging.getLogger("port")
_said: set[str] = set()  # the lines this process has logged: each once, however often the destination is checked


def _boot() -> str | None:
    """This boot of the machine (Linux's boot id); None where the system does not say."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _pid_namespace() -> str | None:
    """This process's PID namespace, as Linux names it (`pid:[4026531836]`); None where the system does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _stat(pid: int) -> list[str] | None:
    """Linux's `/proc/PID/stat` fields after the command name (state first); None if gone or not Linux."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses


def _started(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux); None if it is gone or the system does not say."""
    fields = _stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 and fields[19].isdigit() else None


def _alive(pid: int, start: int | None) -> bool:
    """Whether process `pid` (1 to `MAX_PID`), started at `start`, still runs in this PID namespace
    (not another given its pid since). A zombie (ended, not yet reaped by its parent) has ended."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process holds the pid now, or the owner under another uid
        pass
    fields = _stat(pid)
    if fields and fields[0] in ("Z", "X"):
        return False
    now = _started(pid)
    return start is None or now is None or now == start


def _identity(info: os.stat_result) -> list[int]:
    """What names one file or directory on this machine: its device and inode (a rename keeps both)."""
    return [info.st_dev, info.st_ino]


def _me() -> dict[str, object]:
    pid = os.getpid()
    return {
        "port": "owner",
        "host": socket.gethostname(),
        "pid": pid,
        "boot": _boot(),
        "start": _started(pid),
        "pidns": _pid_namespace(),
    }


def _record(owner: Path, written: os.stat_result, claim: dict[str, object]) -> None:
    """Rewrite the owner file `owner` (the very one written, `written`) as `claim`, which holds what it
    wrote and more: one write of under a page at its start, so a kill leaves the old claim or the new
    one, never a mix. If it fails (or a power cut tears it) the claim says nothing of what was made,
    and a leftover it claims is left, never removed."""
    try:
        fd = os.open(owner, os.O_WRONLY | _NOFOLLOW)
    except OSError:
        return
    try:
        if _identity(os.fstat(fd)) == _identity(written):
            data = json.dumps(claim).encode()
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def claimed(
    path: Path, create: Callable[[Path], object] | None = None, *, moved_from: Path | None = None
) -> Iterator[None]:
    """Within the block, `path` (a hidden file or directory this run makes next) is marked as this process's.

    The owner file `path.owner` is created before the block (never over an existing
    one) and removed after it, so it outlives `path` itself; an interrupt removes it
    too (through the supervisor, as `removing` does). It also names what this run put at
    `path`, so that recovery removes nothing else put there since: with `create`, `path`
    is made here (`create(path)`, after the owner file, under `removing`) and its
    identity recorded at once; with `moved_from`, `path` is where this run is about to
    rename `moved_from`, whose identity is recorded now. With neither, a leftover at
    `path` is never undone, only said.

    ```python
    with claimed(partial, os.mkdir):
        ...                                          # write into partial
    with claimed(aside, moved_from=out):
        os.rename(out, aside)
    ```
    """
    owner = Path(str(path) + OWNER)
    claim = _me()
    written: list[os.stat_result] = []

    def write(p: Path) -> None:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        try:
            os.write(fd, json.dumps(claim).encode())
            written.append(os.fstat(fd))
        finally:
            os.close(fd)

    if moved_from is not None:
        with contextlib.suppress(OSError):  # nothing there: nothing will be moved
            claim["made"] = _identity(os.lstat(moved_from))
    with removing(owner, create=write):
        try:
            if create is None:
                yield
            else:
                with removing(path, create=create):
                    with contextlib.suppress(OSError):  # gone already: the block fails on it
                        _record(owner, written[0], claim | {"made": _identity(os.lstat(path))})
                    yield
        finally:
            with contextlib.suppress(OSError):
                owner.unlink()


@dataclasses.dataclass(frozen=True)
class _Claim:
    """A well-formed owner file: who made a leftover, and what it made (`made`: device and inode,
    None if not recorded). `earlier`: written by a port that recorded neither that nor the PID namespace."""

    host: str
    pid: int
    boot: str | None
    start: int | None
    pidns: str | None
    made: tuple[int, int] | None
    earlier: bool


def _number(value: object, low: int, high: int) -> TypeGuard[int]:
    return type(value) is int and low <= value <= high


def _text(value: object) -> TypeGuard[str | None]:
    return value is None or isinstance(value, str)


def _identity_in(value: object) -> TypeGuard[list[int] | None]:
    return value is None or (
        isinstance(value, list) and len(value) == 2 and all(_number(n, 0, MAX_STAT) for n in value)
    )


def _parsed(claim: object) -> _Claim | None:
    """The claim an owner file's JSON makes, if it is one: every field of its type and within its bounds."""
    if not (isinstance(claim, dict) and claim.get("port") == "owner"):
        return None
    host, pid, boot, start, pidns, made = (claim.get(k) for k in ("host", "pid", "boot", "start", "pidns", "made"))
    if not (isinstance(host, str) and _number(pid, 1, MAX_PID) and _text(boot) and _text(pidns)):
        return None
    if not ((start is None or _number(start, 0, MAX_STAT)) and _identity_in(made)):
        return None
    pair = None if made is None else (made[0], made[1])
    return _Claim(host, pid, boot, start, pidns, pair, earlier="pidns" not in claim)


def _owner(path: Path) -> _Claim | None:
    """The claim on `path` if its owner file is well formed and this user's: a regular file, no link."""
    owner = Path(str(path) + OWNER)
    try:
        fd = os.open(owner, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size > MAX_OWNER_BYTES:
            return None
        return _parsed(json.loads(os.read(fd, MAX_OWNER_BYTES + 1)))
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python's stack
        return None
    finally:
        os.close(fd)


def _unseen(claim: _Claim) -> str | None:
    """Where the process a claim names ran, if port cannot tell from here whether it has ended: another
    host, another boot (of this host, or of another host of this name sharing the storage), another
    PID namespace (a container sharing this host's name and kernel); None if it can."""
    if claim.host != socket.gethostname():
        return f"on host {one_line(claim.host, 100)}"
    if claim.boot != _boot():
        return f"on host {claim.host} before it last started, or on another host of that name"
    if claim.pidns != _pid_namespace():
        return "in another PID namespace on this host (a container?)"
    return None


def _age(path: Path) -> float:
    """Seconds since the owner file of `path` was written."""
    try:
        return time.time() - os.lstat(str(path) + OWNER).st_mtime
    except OSError:
        return 0.0


def _is(path: Path, made: tuple[int, int] | None) -> bool:
    """Whether `path` (not followed if a link) is still the file or directory a claim says its run made."""
    try:
        return made is not None and tuple(_identity(os.lstat(path))) == made
    except OSError:
        return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _kind(out: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(out.name)}\.port-(partial|old)-[0-9a-f]{{8,16}}")


def _beside(out: Path) -> tuple[list[Path], list[Path]]:
    """From one listing of `out`'s directory: the hidden `.OUT.port-partial-*` and `.OUT.port-old-*`
    there, claimed or not; and the leftovers named by owner files there whose leftover is gone."""
    pattern = _kind(out)
    try:
        with os.scandir(out.parent) as entries:
            names = {e.name for e in entries}
    except OSError:
        return [], []
    found = sorted(out.parent / n for n in names if pattern.fullmatch(n))
    orphans = sorted(
        out.parent / n.removesuffix(OWNER)
        for n in names
        if n.endswith(OWNER) and pattern.fullmatch(n.removesuffix(OWNER)) and n.removesuffix(OWNER) not in names
    )
    return found, orphans


_YOURS = "remove it yourself if no run is writing it"


def _undo(path: Path, out: Path, ours: Callable[[Path], bool]) -> str | None:
    """Undo the one leftover `path` if it is a dead run's own (see the module's text), its owner file
    last; what was done or left, or None (a run writing now, or one not to name yet)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    claim = _owner(path)
    if claim is None or info.st_uid != os.getuid() or stat.S_ISLNK(info.st_mode):
        return f"left {path}: not claimed by a port run of this user; {_YOURS}"
    if claim.earlier:
        return f"left {path}: claimed by an earlier port, which did not record what it made; {_YOURS}"
    where = _unseen(claim)
    if where is not None:  # its process cannot be seen from here: said once it is an hour old
        if _age(path) <= QUIET_SECONDS:
            return None
        return (
            f"left {path}: made by process {claim.pid} {where}; "
            "port cannot tell whether that run has ended: remove it once it has"
        )
    if _alive(claim.pid, claim.start):
        return None  # a run writing now
    old = _kind(out).fullmatch(path.name).group(1) == "old"
    if old and not (ours(path) and (not os.path.lexists(out) or ours(out))):
        return f"left {path}: the earlier output a killed run had moved aside; {out} is not one port wrote"
    if not _is(path, claim.made):  # checked last, just before acting
        if claim.made is None:
            return f"left {path}: its owner file does not say what process {claim.pid} made; {_YOURS}"
        return (
            f"left {path}: not what process {claim.pid} made there (something was put at that name since); "
            "port leaves it as it is"
        )
    if not old:
        _remove(path)
        done = f"removed {path.name}, left by process {claim.pid} (a run killed before it finished)"
    elif not os.path.lexists(out):
        os.rename(path, out)
        done = f"restored {out} from {path.name}: a run replacing it was killed before the new output was in place"
    else:
        _remove(path)
        done = f"removed {path.name}, the earlier output a finished run had replaced (it was killed before removing it)"
    with contextlib.suppress(OSError):
        os.unlink(str(path) + OWNER)
    return done


def recover(out: Path, ours: Callable[[Path], bool]) -> list[str]:
    """Undo what a run at `out` killed outright left (see the module's text); what was done or left, as lines.

    `ours(path)` says whether a directory is a finished output of the kind written at
    `out` (`_output.is_output`, or export's own): a `port-old` is put back or removed
    only if it is one. Each line is also logged (the `port` logger, level WARNING), once
    a process: a run checks its destination more than once. Never raises for what it
    finds: a leftover it cannot undo is left and said.

    ```python
    recover(Path("/abs/out/gpt2"), is_output)
    ```
    """
    said: list[str] = []
    found, orphans = _beside(out)
    for path in found:
        try:
            line = _undo(path, out, ours)
        except OSError as e:
            line = f"left {path}: could not undo it ({e.strerror or e})"
        if line is not None:
            said.append(line)
            if line not in _said:
                _said.add(line)
                log.warning(line)
    for name in orphans:  # owner files whose leftover is gone: a run killed between the two removals
        claim = _owner(name)
        if claim is not None and not claim.earlier and _unseen(claim) is None and not _alive(claim.pid, claim.start):
            with contextlib.suppress(OSError):
                os.unlink(str(name) + OWNER)
    return said
