"""The `port` command line: its parser, and `main`, which parses, then runs the command
(`_commands`) in a worker process under the supervisor (`_interrupt`).

```
port convert gpt2 --mesh 4x2 --out gpt2-jax [--dtype bfloat16] [--report run.json]
port plan gpt2 --mesh 4x2
```

Exit status: 0 done, 1 bad input or a failed check (one line on stderr naming the
file, key or flag, and no output left behind), 2 a usage error (with the usage
message), 130 interrupted (Ctrl-C; 143 for SIGTERM), removing what the run wrote.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from ._cleanup import attach
from ._commands import DEFAULT_TIMEOUT, check, convert, export_command, info_command, plan_command, scaffold, verify
from ._console import clear_line, quiet_libraries, say, show
from ._errors import PlanError, PortError
from ._flags import with_flags
from ._interrupt import hold_signals, supervise
from ._text import described, plural, printable, quoted, shortened

MESH_HELP = "device mesh: 4x2 (data x model) or named axes, data=2,expert=2,model=2 (default: 1x1)"


# ---------------------------------------------------------------------------- parser


def _version() -> str:
    import port

    return port.__version__


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=min(100, shutil.get_terminal_size((80, 24)).columns))

    def _format_action(self, action: argparse.Action) -> str:
        text = super()._format_action(action)
        if isinstance(action, argparse._SubParsersAction):  # drop the bare "COMMAND" line above the list
            text = text.split("\n", 1)[1]
        return text


def parser() -> argparse.ArgumentParser:
    """The command line's parser: one sub-command per step users run."""
    root = argparse.ArgumentParser(
        prog="port",
        description="Stream PyTorch / Hugging Face safetensors checkpoints into sharded Equinox models.",
        epilog="Run `port COMMAND --help` for a command's options.\n"
        "Exit status: 0 done, 1 bad input or a failed check, 2 usage error, 130 interrupted.",
        formatter_class=_Formatter,
    )
    root.add_argument("--version", action="version", version=f"port {_version()}")
    commands = root.add_subparsers(title="commands", dest="command", metavar="COMMAND")

    def command(name: str, run: Callable[[argparse.Namespace], int], summary: str, details: str = ""):
        sub = commands.add_parser(
            name, help=summary, description=summary + ("\n\n" + details if details else ""), formatter_class=_Formatter
        )
        sub.set_defaults(run=run)
        return sub

    def model(sub) -> None:
        sub.add_argument(
            "model",
            metavar="MODEL",
            help="checkpoint directory, Hugging Face repo id (e.g. gpt2) or URL (http(s)://, hf://, s3://, gs://)",
        )

    from ._dtypes import CASTS

    def json_flag(sub) -> None:
        sub.add_argument(
            "--json", action="store_true", help="print one JSON object instead of text (schemas: docs/cli.md)"
        )

    def deadline_flag(sub) -> None:
        sub.add_argument(
            "--deadline",
            type=_seconds,
            metavar="SECONDS",
            help="stop the whole run if it has not finished by then, removing what it wrote (exit 1); "
            "default: none (each remote request has its own timeouts)",
        )

    def run_flags(sub) -> None:
        sub.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address, for a multi-process run")
        sub.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
        sub.add_argument("--process-id", type=int, metavar="I", help="this process, 0 to N-1")
        sub.add_argument(
            "--timeout",
            type=float,
            default=DEFAULT_TIMEOUT,
            metavar="SECONDS",
            help=f"how long processes wait for each other (default: {DEFAULT_TIMEOUT:g})",
        )

    def module_flag(sub, required: bool = False, what: str | None = None) -> None:
        many = what is None
        sub.add_argument(
            "--module",
            required=required,
            metavar="MODULE:CLASS",
            action="append" if many else "store",
            help=(what or "a class the mapping names (its model, or its reference), repeatable")
            + ", imported from the working directory if not installed (e.g. mymodel:MyModel); "
            "nothing else is imported from there",
        )

    def options(sub, mapping: bool = True) -> None:
        sub.add_argument("--mesh", default="1x1", metavar="SPEC", help=MESH_HELP)
        sub.add_argument("--dtype", choices=CASTS, help="cast floating parameters (default: keep the checkpoint's)")
        if mapping:
            sub.add_argument(
                "--mapping", type=Path, metavar="FILE", help="mapping file (default: the shipped one for model_type)"
            )
            module_flag(sub)

    sub = command(
        "convert",
        convert,
        "Convert MODEL into a sharded Equinox model and save it to --out, an Orbax checkpoint.",
        "For a multi-process run, start the same command in every process, adding --coordinator,\n"
        "--num-processes and --process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,\n"
        "JAX_PROCESS_ID): each process reads only what its devices hold.",
    )
    model(sub)
    sub.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory (an Orbax checkpoint)")
    options(sub)
    sub.add_argument("--report", type=Path, metavar="FILE", help="write the run summary as JSON")
    json_flag(sub)
    deadline_flag(sub)
    sub.add_argument(
        "--include",
        metavar="PATHS",
        help="convert only these leaves: module paths, dotted prefixes or globs, comma-separated (e.g. wte,blocks)",
    )
    sub.add_argument(
        "--layers",
        metavar="START:STOP",
        help="convert only the checkpoint's layers START to STOP-1 (e.g. 0:12); the output's config says how many",
    )
    sub.add_argument(
        "--force", action="store_true", help="replace --out (and --report) if it is an earlier port output"
    )
    sub.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: on a terminal)",
    )
    run_flags(sub)

    sub = command(
        "export",
        export_command,
        "Write a port convert output DIR back as a Hugging Face checkpoint in --out.",
        "config.json and model.safetensors (or numbered shards and model.safetensors.index.json), with the\n"
        "checkpoint's own tensor names, shapes and dtypes, as transformers' save_pretrained writes them.",
    )
    sub.add_argument("dir", type=Path, metavar="DIR", help="a port convert output")
    sub.add_argument("--out", type=Path, required=True, metavar="HF_DIR", help="output directory")
    sub.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="largest file (default: 5GB)")
    sub.add_argument("--dtype", choices=CASTS, help="write floating tensors in this dtype (default: the checkpoint's)")
    sub.add_argument("--mesh", default="1x1", metavar="SPEC", help="mesh to restore DIR onto first (default: 1x1)")
    sub.add_argument(
        "--force", action="store_true", help="replace --out (and --report) if it is an earlier port export"
    )
    module_flag(sub, what="DIR's model class, when not one of port's (an output's word imports nothing else)")
    sub.add_argument("--report", type=Path, metavar="FILE", help="write the run summary as JSON")
    json_flag(sub)
    deadline_flag(sub)
    sub.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: on a terminal)",
    )
    run_flags(sub)

    sub = command(
        "info",
        info_command,
        "Describe a port convert output DIR: model, mapping, mesh, leaves.",
        "Reads only DIR's metadata (bounded, checked, importing nothing), no array.",
    )
    sub.add_argument("dir", type=Path, metavar="DIR", help="a port convert output")
    json_flag(sub)

    sub = command("plan", plan_command, "Print how MODEL maps onto the mesh, reading no tensor data.")
    model(sub)
    options(sub)
    json_flag(sub)

    sub = command("check", check, "Check a mapping against a checkpoint and its model, reading no tensor data.")
    sub.add_argument("mapping", type=Path, metavar="MAPPING", help="the mapping file to check")
    model(sub)
    sub.add_argument("--mesh", default="1x1", metavar="SPEC", help=MESH_HELP)
    module_flag(sub)
    json_flag(sub)

    sub = command(
        "verify",
        verify,
        "Convert MODEL, run it and the PyTorch reference on the same inputs, and compare.",
        "Exits 1 when the largest difference is above the tolerance.",
    )
    model(sub)
    options(sub)
    sub.add_argument(
        "--tolerance",
        type=float,
        metavar="X",
        help="largest allowed difference (default: 1e-4, or 2e-2 for 16-bit, x max(1, max |reference|))",
    )
    sub.add_argument(
        "--batch", type=_positive, default=2, metavar="N", help="sequences (or images) compared (default: 2)"
    )
    sub.add_argument("--length", type=_positive, default=16, metavar="N", help="tokens per sequence (default: 16)")
    sub.add_argument(
        "--padding",
        choices=("left", "right"),
        help="pad each sequence after the first by more positions, with the attention mask",
    )
    sub.add_argument(
        "--roundtrip",
        action="store_true",
        help="also export the converted model back and compare every tensor bit for bit",
    )
    json_flag(sub)

    sub = command("scaffold", scaffold, "Write a draft mapping pairing MODEL's keys with your module's leaves.")
    model(sub)
    module_flag(sub, required=True, what="your Equinox module's class")
    sub.add_argument("--out", type=Path, metavar="FILE", help="write the draft here (default: stdout)")
    sub.add_argument("--force", action="store_true", help="replace --out if it is an earlier scaffold draft")
    return root


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse's type for --deadline)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, not {quoted(text, 40)}")
    return value


def _positive(text: str) -> int:
    """A positive integer (argparse's type for --batch, --length)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {quoted(text, 40)}")
    return int(text)


def _parse(cli: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse, or exit 2 with the usage of the command at fault."""
    args, extra = cli.parse_known_args(argv)
    if extra:  # the command's own usage, not the top level's
        commands = next(a for a in cli._actions if isinstance(a, argparse._SubParsersAction))
        (commands.choices[args.command] if args.command else cli).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line on `argv` and return its exit status (usage errors exit 2 from argparse)."""
    cli = parser()
    args = _parse(cli, argv)
    if args.command is None:
        cli.print_help()
        return 2
    try:
        return args.run(args)
    except BrokenPipeError:  # `port plan ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except PlanError as e:  # every problem on stdout, as `port check` lists them; the error line names the first
        problems = [with_flags(problem) for problem in e.problems]
        n = len(problems)
        if n > 1:
            show("".join(f"{shortened(printable(problem))}\n" for problem in problems))
            say(f"error: {problems[0]} (and {plural(n - 1, 'more problem')}: all {n} listed above)")
        else:
            say("error: " + with_flags(str(e)))
        return 1
    except PortError as e:
        say("error: " + with_flags(str(e)))
        return 1
    except Exception as e:  # noqa: BLE001 - the command line promises no traceback
        if os.environ.get("PORT_DEBUG"):
            raise
        where = _authors_frame(e)
        if where is not None:  # the author's module failed (a --module class, a mapping's model): where in it
            say(f"error: {where}: {described(e)} (PORT_DEBUG=1 shows the traceback)")
        else:
            say(f"internal error: {described(e)} (PORT_DEBUG=1 shows the traceback)")
        return 1


def _authors_frame(error: BaseException) -> str | None:
    """`file:line in function` of the innermost frame of `error`'s traceback in code that is
    neither port's nor an installed package's nor Python's own: the user's module, shown
    relative to the working directory where it lies below it; None when there is none."""
    import sysconfig
    import traceback

    package = Path(__file__).resolve().parent
    installed = {
        Path(p).resolve()
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename.startswith("<"):
            continue
        path = Path(frame.filename).resolve()
        if package in path.parents or any(root in path.parents for root in installed):
            continue
        try:
            shown_path = path.relative_to(Path.cwd().resolve())
        except ValueError:
            shown_path = path
        return f"{printable(str(shown_path))}:{frame.lineno} in {printable(frame.name)}"
    return None


_ARGV = "PORT_WORKER_ARGV"  # the command line, for the worker (JSON)


class _Said(logging.Handler):
    """The library's warnings and progress (the `port` logger, INFO and above), said on the user's
    stderr as `port: ...` lines, its parameters as flags."""

    def emit(self, record: logging.LogRecord) -> None:
        say(with_flags(record.getMessage()))


def _tell_what_port_logs() -> None:
    logger = logging.getLogger("port")
    logger.addHandler(_Said(logging.INFO))
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main() -> NoReturn:
    """The `port` entry point.

    Parses the command line here (usage errors, `--help` and `--version` answer at
    once), then runs the command in a worker process under `supervise`, which turns
    Ctrl-C and SIGTERM into `port: interrupted`, 130 (143), and removes what the
    worker was writing.
    """
    if attach():  # the worker
        # Its arguments come through the environment (readable by this user only), not its argv,
        # which any user can read in `ps`: a URL's credentials are not shown twice.
        sys.argv[1:] = json.loads(os.environ.pop(_ARGV, "[]"))
        quiet_libraries()
        _tell_what_port_logs()
        code = run()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        sys.exit(code)
    hold_signals()  # before parsing: a Ctrl-C from now on ends in `port: interrupted`
    args = _parse(parser(), sys.argv[1:])
    if args.command is None:
        parser().print_help()
        sys.exit(2)
    os.environ[_ARGV] = json.dumps(sys.argv[1:])
    worker = [sys.executable, "-P", "-c", "from port._cli import main; main()"]
    sys.exit(supervise(worker, _over_the_bar, deadline=getattr(args, "deadline", None)))


def _over_the_bar(message: str) -> None:
    """The supervisor's words (interrupted, terminated, the deadline), said where the worker's
    progress bar may still be drawn: the line cleared first."""
    clear_line()
    say(message)
