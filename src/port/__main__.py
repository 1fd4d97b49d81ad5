"""`port` and `python -m port`: the command line, with Ctrl-C and SIGTERM held before anything else.

The signals are blocked first thing, before `port._cli` and what it imports load (tens of
milliseconds), so a Ctrl-C at any moment after the interpreter starts ends in `port:
interrupted` and 130, never a `KeyboardInterrupt` traceback; `supervise` unblocks them.
"""

import signal


def main() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    from ._cli import main as run

    run()


if __name__ == "__main__":
    main()
