"""The `port` command line: its parser (a typer app), and `main`, which parses, then runs the
command (`_commands`) in a worker process under the supervisor (`_interrupt`).

```
port convert gpt2 --mesh 4x2 --out gpt2-jax [--dtype bfloat16] [--report run.json]
port plan gpt2 --mesh 4x2
```

Exit status: 0 done, 1 bad input or a failed check (one line on stderr naming the
file, key or flag, and no output left behind), 2 a usage error (with the usage
message), 130 interrupted (Ctrl-C; 143 for SIGTERM), removing what the run wrote.

Each typer command only gathers its flags into an `argparse.Namespace` (one attribute
per flag, and `run`, the `_commands` function doing the work): parsing answers usage
errors, `--help`, `--version` and shell completion in the supervisor, which imports
neither JAX nor NumPy, and the worker parses the same words again and runs the command.
typer runs on the click it vendors (`typer._click`), not on an installed `click`: its
errors are caught as that click's classes, or a usage error would pass for an internal one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import typer
import typer.core
from typer import _click as click
from typer._click import exceptions as clicks

from ._cleanup import attach
from ._commands import DEFAULT_TIMEOUT, check, convert, export_command, info_command, plan_command, scaffold, verify
from ._console import clear_line, quiet_libraries, say, show
from ._errors import PlanError, PortError
from ._flags import with_flags
from ._interrupt import hold_signals, supervise
from ._paths import is_url, path_problem
from ._text import described, plural, printable, quoted, shortened

MESH_HELP = "device mesh: 4x2 (data x model) or named axes, data=2,expert=2,model=2 (default: 1x1)"
WIDTH = 100  # help and usage lines, at most (fewer on a narrower terminal)
MAX_LISTED = 1000  # problems a failed plan lists; the rest are counted ("... and N more problems")
Shell = Literal["bash", "zsh", "fish", "powershell", "pwsh"]  # what --show-completion / --install-completion take
SHELLS = typing.get_args(Shell)
COMPLETE_VAR = "_PORT_COMPLETE"  # set (to complete_bash, complete_zsh, ...), `port` answers a completion request

# `_dtypes.CASTS` (a test checks), spelled here: importing `_dtypes` imports NumPy, and `--help` must not.
Cast = Literal["float32", "bfloat16", "float16"]
CASTS = ", ".join(typing.get_args(Cast)[:-1]) + " or " + typing.get_args(Cast)[-1]
Quantize = Literal["fp8"]  # `_export._quantize_args.METHODS` (a test checks)
AdapterMode = Literal["merge", "keep"]  # `_convert.ADAPTER_MODES` (a test checks)


P = typing.TypeVar("P", bound="click.Parameter | None")

# ---------------------------------------------------------------------------- parser


def _version() -> str:
    import port

    return port.__version__


def _fit_help() -> None:
    """typer's rich help and error panels: as wide as the terminal, at most `WIDTH` columns."""
    from typer import rich_utils

    rich_utils.MAX_WIDTH = min(WIDTH, shutil.get_terminal_size((80, 24)).columns)


@contextlib.contextmanager
def _in(ctx: click.Context) -> Iterator[None]:
    """A usage error raised within: its command's, so that its usage is shown (click's parser raises
    some, `--mesh` without its value, with no command)."""
    try:
        yield
    except clicks.UsageError as e:
        if e.ctx is None:
            e.ctx = ctx
        raise


class _Group(typer.core.TyperGroup):
    def get_help_option(self, ctx: click.Context) -> typer.core.TyperOption | None:
        return _plain(super().get_help_option(ctx))

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # A bare `--show-completion` / `--install-completion` (last, without SHELL) means the shell
        # running port: click's options take a value always, or never.
        if args and args[-1] in ("--show-completion", "--install-completion") and not ctx.resilient_parsing:
            args = [*args, _running_shell(ctx)]
        with _in(ctx):
            return super().parse_args(ctx, args)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _fit_help()
        super().format_help(ctx, formatter)


class _Command(typer.core.TyperCommand):
    def get_help_option(self, ctx: click.Context) -> typer.core.TyperOption | None:
        return _plain(super().get_help_option(ctx))

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        with _in(ctx):
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        _check_paths(self, ctx)
        return super().invoke(ctx)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _fit_help()
        super().format_help(ctx, formatter)


WRITTEN = ("out", "report")  # the path flags naming what port writes


def _check_paths(command: click.Command, ctx: click.Context) -> None:
    """Refuse, with a one-line `PortError` naming the flag or argument, a path that port could
    not use (`_paths.path_problem`): told while parsing, before any work. MODEL may be a URL,
    checked as text alone, and not shown (it may hold credentials)."""
    for param in command.params:
        value = ctx.params.get(param.name or "")
        if param.name in ("model", "source") and isinstance(value, str):
            local = not is_url(value)
            problem = path_problem(value, local=local)
        elif isinstance(value, Path):
            local = True
            problem = path_problem(value, written=param.name in WRITTEN)
        else:
            continue
        if problem is not None:
            name = param.opts[0] if param.opts[0].startswith("-") else param.metavar  # --out, --source, or MODEL
            shown = f" {shortened(str(value), 120)}" if local else ""
            raise PortError(f"{name}{shown}: {problem}")


def _seconds(text: Any) -> float:
    """A positive, finite number of seconds (the type of --deadline)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise typer.BadParameter(f"expected a number of seconds > 0, not {quoted(str(text), 40)}")
    return value


def _number(text: Any) -> float:
    """A number (the type of --timeout, --tolerance)."""
    try:
        return float(text)
    except ValueError:
        raise typer.BadParameter(f"expected a number, not {quoted(str(text), 40)}") from None


def _ratio(text: Any) -> float:
    """A number >= 1 (the type of --max-over-read)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 1:
        raise typer.BadParameter(f"expected a number >= 1 (1: exact ranges), not {quoted(str(text), 40)}")
    return value


def _positive(text: Any) -> int:
    """A positive integer (the type of --batch, --length)."""
    text = str(text)  # the default is an int
    if not text.isdigit() or int(text) < 1:
        raise typer.BadParameter(f"expected a positive integer, not {quoted(str(text), 40)}")
    return int(text)


def _block(text: Any) -> str:
    """A block of `--quantize-block` (`128x128`, or `128` for a square), checked as `port.export` checks it."""
    from ._export._quantize_args import parse_block  # no NumPy: the supervisor parses

    try:
        parse_block(str(text), "")
    except PortError:
        raise typer.BadParameter(
            f"expected positive sizes ROWSxCOLS, as 128x128, or one size, not {quoted(str(text), 40)}"
        ) from None
    return str(text)


def _said_version(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:  # a completion request (`port --version <TAB>`) prints nothing
        print(f"port {_version()}")
        raise typer.Exit(0)


def _running_shell(ctx: click.Context) -> str:
    """The shell running `port`, as typer finds it (shellingham), else $SHELL's name."""
    from typer._completion_shared import _get_shell_name

    try:
        found = _get_shell_name()
    except Exception:  # noqa: BLE001 - no shell found is said below
        found = None
    found = found or Path(os.environ.get("SHELL", "")).name
    if found not in SHELLS:
        shown = f" ({quoted(found, 40)})" if found else ""
        raise clicks.UsageError(f"cannot tell which shell runs port{shown}: name one of {', '.join(SHELLS)}", ctx)
    return found


def _show_completion(ctx: typer.Context, value: str | None) -> None:
    if value is None or ctx.resilient_parsing:
        return
    from typer._completion_shared import get_completion_script

    print(get_completion_script(prog_name="port", complete_var=COMPLETE_VAR, shell=value))
    raise typer.Exit(0)


def _install_completion(ctx: typer.Context, value: str | None) -> None:
    if value is None or ctx.resilient_parsing:
        return
    from typer._completion_shared import install

    shell, path = install(shell=value, prog_name="port", complete_var=COMPLETE_VAR)
    print(f"{shell} completion installed in {path}; a new shell has it")
    raise typer.Exit(0)


CONVERT = "Convert and export"
INSPECT = "Inspect"
AUTHOR = "Author a mapping"
PROCESSES = "Multi-process run"
ADAPTERS = "PEFT adapter"

app = typer.Typer(
    name="port",
    cls=_Group,
    help="Stream PyTorch / Hugging Face safetensors checkpoints into sharded Equinox models.",
    epilog="Run `port COMMAND --help` for a command's options.\n\n"
    "Exit status: 0 done, 1 bad input or a failed check, 2 usage error, 130 interrupted.",
    no_args_is_help=True,
    add_completion=False,  # port's own --show-completion / --install-completion (below) take the shell
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_said_version, help="print port's version and exit")
    ] = False,
    show_completion: Annotated[
        Shell | None,
        typer.Option(
            "--show-completion",
            metavar="[SHELL]",
            is_eager=True,
            expose_value=False,
            callback=_show_completion,
            help="print the shell completion script (default: for the shell running port)",
        ),
    ] = None,
    install_completion: Annotated[
        Shell | None,
        typer.Option(
            "--install-completion",
            metavar="[SHELL]",
            is_eager=True,
            expose_value=False,
            callback=_install_completion,
            help="install shell completion (default: for the shell running port)",
        ),
    ] = None,
) -> None:
    pass


# The types of the flags several commands share.
Model = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        show_default=False,
        help="checkpoint directory, Hugging Face repo id (e.g. gpt2) or URL (http(s)://, hf://, s3://, gs://)",
    ),
]
Mesh = Annotated[str, typer.Option("--mesh", metavar="SPEC", show_default=False, help=MESH_HELP)]
DtypeFlag = Annotated[
    Cast | None,
    typer.Option(
        "--dtype", metavar="DTYPE", help=f"cast floating parameters to {CASTS} (default: keep the checkpoint's)"
    ),
]
MappingFlag = Annotated[
    Path | None,
    typer.Option(
        "--mapping",
        metavar="FILE",
        help="mapping file, or a shipped mapping's name such as t5_encoder (default: the shipped one for model_type)",
    ),
]
_MODULE_TAIL = (
    ", imported from the working directory if not installed (e.g. mymodel:MyModel); nothing else is imported from there"
)
Modules = Annotated[
    list[str] | None,
    typer.Option(
        "--module",
        metavar="MODULE:CLASS",
        help="a class the mapping names (its model, or its reference), repeatable" + _MODULE_TAIL,
    ),
]
Json = Annotated[bool, typer.Option("--json", help="print one JSON object instead of text (schemas: docs/cli.md)")]
ReportFlag = Annotated[Path | None, typer.Option("--report", metavar="FILE", help="write the run summary as JSON")]
Deadline = Annotated[
    float | None,
    typer.Option(
        "--deadline",
        metavar="SECONDS",
        parser=_seconds,
        help="stop the whole run if it has not finished by then, removing what it wrote (exit 1); "
        "default: none (each remote request has its own timeouts)",
    ),
]
ProgressFlag = Annotated[
    bool | None, typer.Option("--progress/--no-progress", help="progress bar (default: on a terminal)")
]
Coordinator = Annotated[
    str | None,
    typer.Option(
        "--coordinator",
        metavar="HOST:PORT",
        help="process 0's address, for a multi-process run",
        rich_help_panel=PROCESSES,
    ),
]
NumProcesses = Annotated[
    int | None,
    typer.Option("--num-processes", metavar="N", help="processes in the run", rich_help_panel=PROCESSES),
]
ProcessId = Annotated[
    int | None, typer.Option("--process-id", metavar="I", help="this process, 0 to N-1", rich_help_panel=PROCESSES)
]
Timeout = Annotated[
    float,
    typer.Option(
        "--timeout",
        metavar="SECONDS",
        parser=_number,
        show_default=False,
        help=f"how long processes wait for each other (default: {DEFAULT_TIMEOUT:g})",
        rich_help_panel=PROCESSES,
    ),
]


def _args(run: Callable[[argparse.Namespace], int], flags: dict[str, Any]) -> argparse.Namespace:
    """What a command's flags parsed to, as `_commands` takes them (an empty `--module` list: None)."""
    if flags.get("module") == []:
        flags["module"] = None
    return argparse.Namespace(run=run, **flags)


def _command(name: str, panel: str, summary: str, details: str = ""):
    return app.command(
        name,
        cls=_Command,
        help=summary + ("\n\n" + details if details else ""),
        short_help=summary,
        rich_help_panel=panel,
    )


@_command(
    "convert",
    CONVERT,
    "Convert MODEL into a sharded Equinox model and save it to --out, an Orbax checkpoint.",
    "For a multi-process run, start the same command in every process, adding --coordinator, "
    "--num-processes and --process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
    "JAX_PROCESS_ID): each process reads only what its devices hold.",
)
def _convert(
    model: Model,
    out: Annotated[
        Path, typer.Option("--out", metavar="DIR", show_default=False, help="output directory (an Orbax checkpoint)")
    ],
    mesh: Mesh = "1x1",
    dtype: DtypeFlag = None,
    mapping: MappingFlag = None,
    module: Modules = None,
    report: ReportFlag = None,
    deadline: Deadline = None,
    include: Annotated[
        str | None,
        typer.Option(
            "--include",
            metavar="PATHS",
            help="convert only these leaves: module paths, dotted prefixes or globs, comma-separated (e.g. wte,blocks)",
        ),
    ] = None,
    layers: Annotated[
        str | None,
        typer.Option(
            "--layers",
            metavar="START:STOP",
            help="convert only the checkpoint's layers START to STOP-1 (e.g. 0:12); the output's config says how many",
        ),
    ] = None,
    adapter: Annotated[
        str | None,
        typer.Option(
            "--adapter",
            metavar="ADAPTER",
            help="a PEFT LoRA adapter for MODEL (directory, repo id or URL): merged into the weights as they are "
            "read, or kept with --adapter-mode keep",
            rich_help_panel=ADAPTERS,
        ),
    ] = None,
    adapter_mode: Annotated[
        AdapterMode | None,
        typer.Option(
            "--adapter-mode",
            metavar="MODE",
            help="merge (default: the adapter merged into the weights) or keep (the factors as trainable "
            "port.nn.LoRA leaves); needs --adapter",
            rich_help_panel=ADAPTERS,
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="replace --out (and --report) if it is an earlier port output")
    ] = False,
    max_over_read: Annotated[
        float | None,
        typer.Option(
            "--max-over-read",
            metavar="RATIO",
            parser=_ratio,
            help="a URL's reads may fetch up to RATIO times the bytes they need, one request spanning the gaps "
            "between the stretches wanted (default: 2 for a URL, 1 for local files: exact ranges)",
        ),
    ] = None,
    progress: ProgressFlag = None,
    json: Json = False,
    coordinator: Coordinator = None,
    num_processes: NumProcesses = None,
    process_id: ProcessId = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> argparse.Namespace:
    if adapter_mode is not None and adapter is None:
        raise clicks.UsageError("--adapter-mode needs --adapter")
    return _args(convert, locals())


@_command(
    "export",
    CONVERT,
    "Write a port output DIR (port convert's, or port.save's of a model trained from scratch) back as a "
    "Hugging Face checkpoint in --out.",
    "config.json and model.safetensors (or numbered shards and model.safetensors.index.json), with the "
    "checkpoint's own tensor names, shapes and dtypes, as transformers' save_pretrained writes them (derived "
    "from the mapping, the config and the leaves where DIR records no source checkpoint).",
)
def _export(
    dir: Annotated[Path, typer.Argument(metavar="DIR", show_default=False, help="a port convert or port.save output")],
    out: Annotated[Path, typer.Option("--out", metavar="HF_DIR", show_default=False, help="output directory")],
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", metavar="SIZE", show_default=False, help="largest file (default: 5GB)")
    ] = "5GB",
    dtype: Annotated[
        Cast | None,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help=f"write floating tensors in this dtype, {CASTS} (default: the checkpoint's)",
        ),
    ] = None,
    quantize: Annotated[
        Quantize | None,
        typer.Option(
            "--quantize",
            metavar="FORMAT",
            help="write the Linear weights quantized: fp8 (e4m3 with weight_scale_inv block scales, "
            "DeepSeek's and Qwen's layout)",
        ),
    ] = None,
    quantize_block: Annotated[
        str | None,
        typer.Option(
            "--quantize-block",
            metavar="ROWSxCOLS",
            parser=_block,
            help="--quantize's block, e.g. 64x64, or one size for a square (default: 128x128)",
        ),
    ] = None,
    source: Annotated[
        str | None,
        typer.Option(
            "--source",
            metavar="MODEL",
            show_default=False,
            help="the checkpoint DIR was converted from (directory, repo id or URL): the tensors' names, shapes "
            "and dtypes, and with --quantize fp8 its FP8 scales, kept where they give the weights back exactly "
            "(default: what DIR records, else derived from its mapping and config)",
        ),
    ] = None,
    mesh: Annotated[
        str | None,
        typer.Option(
            "--mesh",
            metavar="SPEC",
            show_default=False,
            help="mesh to restore DIR onto first (default: every device of the run on the model axis, 1xN; "
            "1x1 for one process on one device)",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="replace --out if it is an earlier port export")] = False,
    adapter_only: Annotated[
        bool,
        typer.Option(
            "--adapter-only",
            help="write only DIR's adapter (converted with --adapter-mode keep) as a PEFT adapter: "
            "adapter_config.json and adapter_model.safetensors",
        ),
    ] = False,
    module: Annotated[
        str | None,
        typer.Option(
            "--module",
            metavar="MODULE:CLASS",
            help="DIR's model class, when not one of port's (an output's word imports nothing else)" + _MODULE_TAIL,
        ),
    ] = None,
    report: ReportFlag = None,
    deadline: Deadline = None,
    progress: ProgressFlag = None,
    json: Json = False,
    coordinator: Coordinator = None,
    num_processes: NumProcesses = None,
    process_id: ProcessId = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
) -> argparse.Namespace:
    if quantize_block is not None and quantize is None:
        raise clicks.UsageError("--quantize-block needs --quantize")
    if adapter_only:
        for given, flag in ((quantize, "--quantize"), (dtype, "--dtype")):
            if given is not None:
                raise clicks.UsageError(f"--adapter-only writes the adapter as it is: it takes no {flag}")
    return _args(export_command, locals())


@_command(
    "info",
    INSPECT,
    "Describe a port convert output DIR: model, mapping, mesh, leaves.",
    "Reads only DIR's metadata (bounded, checked, importing nothing), no array.",
)
def _info(
    dir: Annotated[Path, typer.Argument(metavar="DIR", show_default=False, help="a port convert output")],
    json: Json = False,
) -> argparse.Namespace:
    return _args(info_command, locals())


@_command(
    "plan",
    INSPECT,
    "Print how MODEL maps onto the mesh, reading no tensor data.",
    "MODEL may also be a port convert output, to plan its restore onto --mesh.",
)
def _plan(
    model: Annotated[
        str,
        typer.Argument(
            metavar="MODEL",
            show_default=False,
            help="checkpoint directory, Hugging Face repo id (e.g. gpt2) or URL (http(s)://, hf://, s3://, gs://), "
            "or a port convert output, to plan its restore",
        ),
    ],
    mesh: Mesh = "1x1",
    dtype: DtypeFlag = None,
    mapping: MappingFlag = None,
    module: Modules = None,
    json: Json = False,
) -> argparse.Namespace:
    return _args(plan_command, locals())


@_command(
    "scaffold",
    AUTHOR,
    "Write a draft mapping pairing MODEL's keys with your module's leaves.",
)
def _scaffold(
    model: Model,
    module: Annotated[
        str,
        typer.Option(
            "--module",
            metavar="MODULE:CLASS",
            show_default=False,
            help="your module's class (Equinox, or Flax NNX) or a factory function building it from config.json"
            + _MODULE_TAIL,
        ),
    ],
    out: Annotated[
        Path | None, typer.Option("--out", metavar="FILE", help="write the draft here (default: stdout)")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="replace --out if it is an earlier scaffold draft")] = False,
) -> argparse.Namespace:
    return _args(scaffold, locals())


@_command("check", AUTHOR, "Check a mapping against a checkpoint and its model, reading no tensor data.")
def _check(
    mapping: Annotated[Path, typer.Argument(metavar="MAPPING", show_default=False, help="the mapping file to check")],
    model: Model,
    mesh: Mesh = "1x1",
    module: Modules = None,
    json: Json = False,
) -> argparse.Namespace:
    return _args(check, locals())


@_command(
    "verify",
    AUTHOR,
    "Convert MODEL, run it and the PyTorch reference on the same inputs, and compare.",
    "Exits 1 when the largest difference is above the tolerance.",
)
def _verify(
    model: Model,
    mesh: Mesh = "1x1",
    dtype: DtypeFlag = None,
    mapping: MappingFlag = None,
    module: Modules = None,
    tolerance: Annotated[
        float | None,
        typer.Option(
            "--tolerance",
            metavar="X",
            parser=_number,
            help="largest allowed difference (default: 1e-4, or 2e-2 for 16-bit, x max(1, max |reference|))",
        ),
    ] = None,
    batch: Annotated[
        int,
        typer.Option(
            "--batch",
            metavar="N",
            parser=_positive,
            show_default=False,
            help="sequences (or images) compared (default: 2)",
        ),
    ] = 2,
    length: Annotated[
        int,
        typer.Option(
            "--length", metavar="N", parser=_positive, show_default=False, help="tokens per sequence (default: 16)"
        ),
    ] = 16,
    padding: Annotated[
        Literal["left", "right"] | None,
        typer.Option(
            "--padding",
            metavar="left|right",
            help="pad each sequence after the first by more positions, with the attention mask",
        ),
    ] = None,
    roundtrip: Annotated[
        bool,
        typer.Option("--roundtrip", help="also export the converted model back and compare every tensor bit for bit"),
    ] = False,
    json: Json = False,
) -> argparse.Namespace:
    return _args(verify, locals())


class _Argument(typer.core.TyperArgument):
    """An argument shown plainly: `MODEL`, not typer's `{MODEL}` and `<str>`."""

    def display_type_rich(self, ctx: click.Context) -> str | None:
        return None

    def _usage_display_name(self) -> str:
        return self.display_name_raw


class _Option(typer.core.TyperOption):
    """An option shown plainly: a flag (`--force`) without typer's `<bool>`."""

    def display_type_rich(self, ctx: click.Context) -> str | None:
        return None if self.is_flag and self.metavar is None else super().display_type_rich(ctx)


def command() -> click.Command:
    """The command line as the click command tree typer builds: `port`, and one sub-command per
    step users run (`.commands`), each with its `.params`.

    ```python
    >>> sorted(command().commands)
    ['check', 'convert', 'export', 'info', 'plan', 'scaffold', 'verify']
    ```
    """
    root = typer.main.get_command(app)
    for each in (root, *getattr(root, "commands", {}).values()):
        for param in each.params:
            _plain(param)
    return root


def _plain(param: P) -> P:
    """`param` shown plainly (typer takes no class per parameter: it is set here)."""
    if type(param) is typer.core.TyperArgument:
        param.__class__ = _Argument
    elif type(param) is typer.core.TyperOption:
        param.__class__ = _Option
    return param


def _usage_error(error: clicks.UsageError) -> None:
    """A usage error on stderr: the command's usage, then the error (typer's panel on a terminal)."""
    if sys.stderr.isatty():
        from typer import rich_utils

        _fit_help()
        rich_utils.rich_format_error(error)
    else:
        error.show()


def _plain_message(error: clicks.UsageError) -> clicks.UsageError:
    """`error` without the "Value error, " typer's checks (pydantic's) put before a choice's message."""
    error.message = error.message.replace("Value error, ", "", 1)
    return error


def _completion_problem(instruction: str) -> str | None:
    """What is wrong with a shell completion request (`_PORT_COMPLETE` is `instruction`, the rest in
    the variables its shell's script sets), or None: typer reads them unchecked, and a missing or
    malformed one ends in a traceback, or in a completion of nothing."""
    verb, _, shell = instruction.partition("_")
    if verb not in ("complete", "source") or shell not in SHELLS:
        expected = "complete_SHELL or source_SHELL, SHELL one of " + ", ".join(SHELLS)
        return f"{COMPLETE_VAR} {quoted(instruction, 40)}: expected {expected}"
    if verb == "source":
        return None
    if shell == "bash" and "COMP_WORDS" not in os.environ:
        return f"{COMPLETE_VAR}={instruction}: COMP_WORDS is not set (the words of the command line being completed)"
    checks = {
        "bash": (
            "COMP_CWORD",
            lambda v: v.isascii() and v.isdigit() and len(v) <= 9,  # a command line's word count
            "the index of the word completed, an integer from 0 to 999999999",
        ),
        "fish": ("_TYPER_COMPLETE_FISH_ACTION", lambda v: v in ("get-args", "is-args"), "get-args or is-args"),
    }
    if shell not in checks:  # zsh and PowerShell: their variables may be unset (nothing typed yet)
        return None
    name, valid, expected = checks[shell]
    value = os.environ.get(name)
    if value is None:
        return f"{COMPLETE_VAR}={instruction}: {name} is not set ({expected})"
    if not valid(value):
        return f"{COMPLETE_VAR}={instruction}: {name} {quoted(value, 40)}: expected {expected}"
    return None


def parse(argv: Sequence[str]) -> argparse.Namespace | int:
    """`argv` parsed: the command's flags (`run` the function to run with them), or the exit status
    when parsing was all there was to do (`--help`, `--version`: 0; a usage error, said: 2).
    A shell completion request (`_PORT_COMPLETE` set) is answered and exits here (a malformed one,
    said: 1).

    ```python
    >>> parse(["plan", "gpt2", "--mesh", "4x2"]).mesh
    '4x2'
    ```
    """
    root = command()
    instruction = os.environ.get(COMPLETE_VAR)
    if instruction:  # typer's completion classes (bash, zsh, fish, powershell), registered
        problem = _completion_problem(instruction)
        if problem is not None:
            say("error: " + problem)
            return 1
        from typer._completion_classes import completion_init

        completion_init()
    try:
        parsed = root.main(list(argv), prog_name="port", complete_var=COMPLETE_VAR, standalone_mode=False)
    except clicks.NoArgsIsHelpError as e:  # bare `port`: the help (typer's rich one printed it), 2
        if e.message:
            print(e.message)
        return 2
    except clicks.UsageError as e:
        _usage_error(_plain_message(e))
        return 2
    except PortError as e:  # a path port could not use (`_check_paths`)
        say("error: " + str(e))
        return 1
    except clicks.ClickException as e:
        e.show()
        return e.exit_code
    return parsed if isinstance(parsed, (argparse.Namespace, int)) else 0


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line on `argv` (default: `sys.argv[1:]`) in this process and return its exit
    status (a usage error: 2, said with the usage)."""
    args = parse(sys.argv[1:] if argv is None else argv)
    if isinstance(args, int):
        return args
    try:
        return args.run(args)
    except BrokenPipeError:  # `port plan ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except PlanError as e:  # the problems on stdout, MAX_LISTED at most; the error line names the first
        problems = [with_flags(problem) for problem in e.problems[:MAX_LISTED]]
        n, rest = len(e.problems), len(e.problems) - len(problems)
        if n > 1:
            show(
                "".join(f"{shortened(printable(problem))}\n" for problem in problems)
                + (f"... and {plural(rest, 'more problem')}\n" if rest else "")
            )
            listed = f"the first {len(problems)}" if rest else f"all {n}"
            say(f"error: {problems[0]} (and {plural(n - 1, 'more problem')}: {listed} listed above)")
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
    args = parse(sys.argv[1:])  # a completion request is answered (and exits) here, as --help is
    if isinstance(args, int):
        sys.exit(args)
    os.environ[_ARGV] = json.dumps(sys.argv[1:])
    worker = [sys.executable, "-P", "-c", "from port._cli import main; main()"]
    sys.exit(supervise(worker, _over_the_bar, deadline=getattr(args, "deadline", None)))


def _over_the_bar(message: str) -> None:
    """The supervisor's words (interrupted, terminated, the deadline), said where the worker's
    progress bar may still be drawn: the line cleared first."""
    clear_line()
    say(message)
