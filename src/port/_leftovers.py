"""Leftovers: what a run killed outright (SIGKILL, a power cut) left beside its output, found and undone later.

Port writes an output into a hidden sibling, `.OUT.port-partial-TOKEN`, and `--force`
moves the earlier output aside to `.OUT.port-old-TOKEN` for the moment of the rename
(`_destination.make_partial`, `_destination.put_in_place`). An interrupt or an error removes them; a
SIGKILL to the whole process group cannot. So each is *claimed* first: a small file
`.OUT.port-partial-TOKEN.owner` beside it says which process made it (host, pid, the
machine's boot and the process's start time, so a reused pid is not mistaken for it),
and is removed only after the directory is gone.

The next run at the same `OUT` calls `recover` before it checks `OUT`, and undoes a
leftover only when every one of these holds: its owner file is there and well formed,
both belong to this user, neither is a link, the owner ran on this host, and that
process has ended. Then a `port-partial` is removed, and a `port-old` is renamed back
to `OUT` if `OUT` is missing (the run died between moving the old output aside and
putting the new one in place) or removed if `OUT` is a finished output of the same
kind (the run died just before removing it). Anything else is left as it is and said:
a leftover of a run on another host (once its owner file is an hour old: until then it
may be the partial output of a process of this very run), one without an owner file (an
earlier port), a `port-old` beside something that is not an output of that kind.

```python
with claimed(partial):                       # .OUT.port-partial-TOKEN.owner, first
    with removing(partial, create=os.mkdir):
        ...
recover(Path("/abs/out/gpt2"), is_output)    # ["removed .gpt2.port-partial-... (a run killed ...)"]
```
"""

from __future__ import annotations

import contextlib
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

from ._cleanup import removing

OWNER = ".owner"  # the claim's suffix: `.OUT.port-partial-TOKEN.owner`
MAX_OWNER_BYTES = 4096  # an owner file is about 150 bytes
QUIET_SECONDS = 3600  # a leftover of another host younger than this may be a run's of now (a process of this run)
log = logging.getLogger("port")


def _boot() -> str | None:
    """This boot of the machine (Linux's boot id); None where the system does not say."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
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
    """Whether process `pid`, started at `start`, still runs on this machine (not another given its pid since).

    A zombie (ended, not yet reaped by its parent) has ended.
    """
    if pid <= 0:
        return False
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


def _me() -> dict[str, object]:
    pid = os.getpid()
    return {"port": "owner", "host": socket.gethostname(), "pid": pid, "boot": _boot(), "start": _started(pid)}


@contextlib.contextmanager
def claimed(path: Path) -> Iterator[None]:
    """Within the block, `path` (a hidden file or directory this run makes next) is marked as this process's.

    The owner file `path.owner` is created before the block (never over an existing
    one) and removed after it, so it outlives `path` itself; an interrupt removes it
    too (through the supervisor, as `removing` does).
    """
    owner = Path(str(path) + OWNER)

    def create(p: Path) -> None:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.write(fd, json.dumps(_me()).encode())
        finally:
            os.close(fd)

    with removing(owner, create=create):
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                owner.unlink()


def _owner(path: Path) -> dict | None:
    """The claim on `path` if its owner file is well formed and this user's: a regular file, no link."""
    owner = Path(str(path) + OWNER)
    try:
        fd = os.open(owner, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size > MAX_OWNER_BYTES:
            return None
        claim = json.loads(os.read(fd, MAX_OWNER_BYTES + 1))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not (
        isinstance(claim, dict)
        and claim.get("port") == "owner"
        and isinstance(claim.get("host"), str)
        and type(claim.get("pid")) is int
        and (claim.get("start") is None or type(claim["start"]) is int)
    ):
        return None
    return claim


def _ended(claim: dict) -> bool:
    """Whether the process a claim names (on this host) has ended: another boot, or no such process now."""
    boot = _boot()
    if claim.get("boot") is not None and boot is not None and claim["boot"] != boot:
        return True
    return not _alive(claim["pid"], claim.get("start"))


def _age(path: Path) -> float:
    """Seconds since the owner file of `path` was written."""
    try:
        return time.time() - os.lstat(str(path) + OWNER).st_mtime
    except OSError:
        return 0.0


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


def recover(out: Path, ours: Callable[[Path], bool]) -> list[str]:
    """Undo what a run at `out` killed outright left (see the module's text); what was done or left, as lines.

    `ours(path)` says whether a directory is a finished output of the kind written at
    `out` (`_output.is_output`, or export's own): a `port-old` is put back or removed
    only if it is one. Each line is also logged (the `port` logger, level WARNING).
    Never raises for what it finds: a leftover it cannot undo is left and said.

    ```python
    recover(Path("/abs/out/gpt2"), is_output)
    ```
    """
    said: list[str] = []

    def tell(line: str) -> None:
        log.warning(line)
        said.append(line)

    host = socket.gethostname()
    kind = _kind(out)
    found, orphans = _beside(out)
    for path in found:
        try:
            info = os.lstat(path)
        except OSError:
            continue
        claim = _owner(path)
        if claim is None or info.st_uid != os.getuid() or stat.S_ISLNK(info.st_mode):
            tell(f"left {path}: not claimed by a port run of this user; remove it yourself if no run is writing it")
            continue
        if claim["host"] != host:  # its process cannot be seen from here: said once it is an hour old
            if _age(path) > QUIET_SECONDS:
                tell(
                    f"left {path}: made by process {claim['pid']} on host {claim['host']}; "
                    "remove it once that run has ended"
                )
            continue
        if not _ended(claim):
            continue  # a run writing now
        old = kind.fullmatch(path.name).group(1) == "old"
        try:
            if not old:
                _remove(path)
                tell(f"removed {path.name}, left by process {claim['pid']} (a run killed before it finished)")
            elif not os.path.lexists(out) and ours(path):
                os.rename(path, out)
                tell(
                    f"restored {out} from {path.name}: a run replacing it was killed before the new output was in place"
                )
            elif os.path.lexists(out) and ours(out) and ours(path):
                _remove(path)
                tell(
                    f"removed {path.name}, the earlier output a finished run had replaced (it was killed before removing it)"
                )
            else:
                tell(f"left {path}: the earlier output a killed run had moved aside; {out} is not one port wrote")
                continue
        except OSError as e:
            tell(f"left {path}: could not undo it ({e.strerror or e})")
            continue
        with contextlib.suppress(OSError):
            os.unlink(str(path) + OWNER)
    for name in orphans:  # owner files whose leftover is gone: a run killed between the two removals
        claim = _owner(name)
        if claim is not None and claim["host"] == host and _ended(claim):
            with contextlib.suppress(OSError):
                os.unlink(str(name) + OWNER)
    return said
