"""`port` and `python -m port`: the command line, with Ctrl-C and SIGTERM held before anything else.

`python -m port` puts the working directory first on `sys.path`; it is taken off again
before anything is imported, so a `signal.py`, `json.py` or `typer.py` lying there is
never run (the worker runs with `-P`, the `port` script has its own directory first).
Only what the interpreter imported before port's code runs comes from there: run
`python -P -m port`, or set `PYTHONSAFEPATH`, to be safe from that too.

The signals are blocked first thing, before `port._cli` and what it imports load (tens of
milliseconds), so a Ctrl-C at any moment after the interpreter starts ends in `port:
interrupted` and 130, never a `KeyboardInterrupt` traceback; `supervise` unblocks them.
"""

import os  # loaded before any code of port's runs (runpy imported it): taken from sys.modules, no search
import sys  # built in


def _working_directory() -> str:
    try:
        return os.getcwd()
    except OSError:  # removed: then `python -m` put nothing on the path
        return ""


if __name__ == "__main__" and not sys.flags.safe_path and sys.path and sys.path[0] in ("", _working_directory()):
    del sys.path[0]  # `python -m` put it first ('' where `runpy` is called from `python -c`)

import signal  # noqa: E402 (after the working directory is off the path)


def main() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    from ._cli import main as run

    run()


if __name__ == "__main__":
    main()
