"""Destination: the directory a run writes (convert's output, export's), never half there.

Before anything is read, `check_destination` refuses any target that writing or
replacing would harm. A run then writes into a hidden sibling, `.OUT.port-partial-TOKEN`
(`partial_path`, `make_partial`: claimed, registered with the supervisor, removed
unless it was renamed into place), and `put_in_place` renames it to `OUT` once it is
complete: the one place an existing directory is refused or, with `force`, replaced.
So a failed or interrupted run leaves nothing behind, and an earlier output being
replaced stays complete until the new one is.

Which earlier directory a run may replace is the caller's to say (`ours`: a port
output, or a port export), as is how its messages name the parameter (`name`).

```python
out = check_destination("out/gpt2", force=True, ours=is_output, what="a port output")
partial = partial_path(out)
with contextlib.ExitStack() as cleanup, writing(out, partial, "the checkpoint"):
    make_partial(partial, cleanup)
    ...                                              # write into partial
    put_in_place(partial, out, force=True, ours=is_output, what="a port output")
```
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from ._cleanup import final, putting_back
from ._disk import sync_directory
from ._errors import OutputError, PortError
from ._leftovers import claimed, recover
from ._text import one_line, size_text


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def check_destination(
    directory: str | os.PathLike,
    force: bool = False,
    inputs: tuple[str | os.PathLike, ...] = (),
    *,
    ours: Callable[[Path], bool],
    what: str,
    name: str = "out",
) -> Path:
    """The absolute path of `directory`, refusing any target that writing or replacing would harm.

    **Arguments:**

    - `directory`: the directory a run will write.
    - `force`: allow replacing an earlier directory of the caller's kind (`ours`), and
      nothing else: not a file, a symlink, a directory holding anything port did not
      write, the root, the home or working directory or one containing it.
    - `inputs`: what the run reads (the checkpoint): a directory that is or contains
      one is refused.
    - `ours`: whether a directory is one `force` may replace (`is_output`, `is_export`).
    - `what`: what `ours` accepts, as messages say it.
    - `name`: the caller's parameter, as messages name it (`out=...: ...`).

    Missing parent directories are fine: they are made when writing starts
    (`make_partial`), and removed again if the run fails. What a killed run left
    beside `directory` is undone first (`recover`). Raises `OutputError`, one line.

    ```python
    check_destination("out/gpt2", True, ("ckpt/gpt2",), ours=is_output, what="a port output")
    ```
    """
    out = Path(directory).absolute()
    real = out.resolve()
    here, home = Path.cwd().resolve(), Path.home().resolve()
    if real == Path(real.anchor) or real == home or _inside(here, real):
        kind = (
            "the root directory"
            if real == Path(real.anchor)
            else "your home directory"
            if real == home
            else ("the working directory" if real == here else "a directory containing the working directory")
        )
        raise OutputError(f"{name}={out}: is {kind}; port writes its output into a new directory")
    for given in inputs:
        source = Path(given).resolve()
        if _inside(source, real):
            verb = "is" if source == real else "contains"
            raise OutputError(f"{name}={out}: {verb} the input {given}; choose another directory")
    if out.parent.is_dir():
        recover(out, ours)  # what a killed run left beside it: removed, or the earlier output put back
    if out.is_symlink():
        raise OutputError(f"{name}={out}: is a symbolic link; give the directory itself")
    if out.exists():
        if not out.is_dir():
            raise OutputError(f"{name}={out}: is a file, not a directory; port will not replace it")
        if not force:
            raise OutputError(f"{name}={out}: already exists (use force= to replace an earlier port output)")
        if not ours(out):
            raise OutputError(f"{name}={out}: not {what}; force= replaces only a directory port wrote")
    base = existing_ancestor(out)  # missing parents are made when writing starts, as `mkdir -p` would
    if not base.is_dir():
        raise OutputError(f"{name}={out}: {base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OutputError(f"{name}={out}: cannot write in {base} (read-only or not permitted)")
    return out


def existing_ancestor(path: Path) -> Path:
    """The nearest ancestor of `path` that exists (its parent, when that exists)."""
    parent = path.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    return parent


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes free for an unprivileged writer on the file system that will hold `directory`."""
    return shutil.disk_usage(existing_ancestor(Path(directory).absolute())).free


def check_free(directory: Path, nbytes: int, name: str = "out") -> None:
    """Refuse, in one line, a run that needs more than the `directory`'s file system has free."""
    if nbytes > (free := free_bytes(directory)):
        raise OutputError(
            f"{name}={directory}: needs {size_text(nbytes)}, only {size_text(free)} free on its file system"
        )


def make_parents(directory: Path, cleanup: contextlib.ExitStack) -> None:
    """Make `directory` and its missing ancestors, as `mkdir -p` does; when `cleanup` closes, each
    one made here is removed again if it is empty (the run failed before its output was in
    place), deepest first. Never through a symbolic link made meanwhile: one `mkdir` per level."""
    missing = []
    while not os.path.lexists(directory) and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for made in reversed(missing):
        try:
            os.mkdir(made)
        except FileExistsError:  # another process of the run, or another run, made it meanwhile
            if not made.is_dir() or made.is_symlink():
                raise OutputError(f"{made}: appeared meanwhile and is not a directory") from None
            continue
        cleanup.callback(_remove_if_empty, made)


def _remove_if_empty(directory: Path) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def partial_path(directory: Path) -> Path:
    """`.OUT.port-partial-TOKEN` beside `directory`: where the run writes it, the same in every process of the run."""
    from ._runtime import run_token  # JAX's runs: imported once writing starts, so a refused target needs no JAX

    return directory.parent / f".{directory.name}.port-partial-{run_token()}"


def _remove_if_made(path: Path, made: os.stat_result) -> None:
    """Remove the directory `path` if it is still the one made here (not one put there since it was renamed)."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return
    if (now.st_dev, now.st_ino) == (made.st_dev, made.st_ino):
        shutil.rmtree(path, ignore_errors=True)


def make_partial(partial: Path, cleanup: contextlib.ExitStack) -> None:
    """Create `partial`, the directory a run writes its output into, registered with the supervisor.

    Never an existing directory nor through a symlink (a one-line `OutputError` if
    something is there). When `cleanup` closes, it is removed unless it was renamed into
    place meanwhile: only the directory made here, never one found at that name later.
    An interrupt removes it through the supervisor (`removing`).

    ```python
    with contextlib.ExitStack() as cleanup:
        make_partial(partial_path(out), cleanup)
    ```
    """
    make_parents(partial.parent, cleanup)
    try:
        cleanup.enter_context(claimed(partial, os.mkdir))  # the owner file first: removed after the directory
    except FileExistsError:
        raise OutputError(f"{partial}: exists; port writes only into a directory it creates") from None
    cleanup.callback(_remove_if_made, partial, os.lstat(partial))


def _reason(error: BaseException) -> str:
    """What went wrong, briefly: the operating system's words when the error carries its code."""
    text = str(error)
    code = re.search(r"os_error_code='?(\d+)", text)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if code:
        return os.strerror(int(code.group(1)))
    return one_line((text.strip().splitlines() or [type(error).__name__])[0], 200)


@contextlib.contextmanager
def writing(directory: Path, partial: Path, what: str, name: str = "out") -> Iterator[None]:
    """An `OSError` within becomes one `OutputError` line naming the destination (and the file,
    inside the run's `partial` directory): `out=DIR: writing WHAT failed: REASON (FILE)`."""
    try:
        yield
    except PortError:
        raise
    except OSError as e:
        inside = e.filename and partial in Path(e.filename).parents
        where = f" ({Path(e.filename).relative_to(partial)})" if inside else ""
        raise OutputError(f"{name}={directory}: writing {what} failed: {_reason(e)}{where}") from None


def put_in_place(
    partial: Path, directory: Path, force: bool, *, ours: Callable[[Path], bool], what: str, name: str = "out"
) -> None:
    """Rename the finished `partial` to `directory`: the one place an existing directory is refused or replaced.

    With `force`, an earlier directory there (checked again: still one of the caller's
    kind, `ours`, as when the run began) is moved aside first, put back if the rename
    fails, and removed once the new one is in place. Without it, or should another
    run have written `directory` meanwhile, nothing is replaced: a one-line
    `OutputError`. No interrupt is acted on until the rename is done; should the worker
    die meanwhile (the OOM killer), the supervisor puts the earlier directory back unless
    the new one is in place (`putting_back`). Any other failure is the `OSError` (for the
    caller's `writing`).

    ```python
    put_in_place(partial, out, force, ours=is_export, what="a port export")
    ```
    """
    aside = directory.parent / f".{directory.name}.port-old-{secrets.token_hex(4)}"
    with contextlib.ExitStack() as claim, putting_back(aside, directory, partial):
        with final():
            if force and os.path.lexists(directory):
                check_destination(directory, force, ours=ours, what=what, name=name)
                claim.enter_context(claimed(aside, moved_from=directory))  # its owner file: made first, removed last
                os.rename(directory, aside)
            try:
                os.rename(partial, directory)
            except OSError as e:
                if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    kept = f"; the earlier one is kept at {aside}" if os.path.lexists(aside) else ""
                    raise OutputError(f"{name}={directory}: another run wrote it meanwhile{kept}") from None
                raise
            finally:
                if os.path.lexists(aside) and not os.path.lexists(directory):
                    os.rename(aside, directory)
        if os.path.lexists(aside):
            shutil.rmtree(aside)
    sync_directory(directory.parent)
