"""The command line's contract, through the real `port` entry point in a subprocess.

Exit status 0 done, 1 bad input or a failed check (one `port: error:` line), 2 a usage
error (with the usage message); never a traceback.
"""

import re
from importlib.metadata import version
from pathlib import Path

import pytest

from helpers import one_line, run_port, transformers_or_skip, usage_error

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"


@pytest.mark.slow
def test_bare_port_shows_help_and_exits_2():
    """The help on stdout, its commands grouped in typer's panels, and exit 2."""
    result = run_port()
    assert result.returncode == 2, result.stderr
    assert result.stdout.lstrip().startswith("Usage: port [OPTIONS] COMMAND [ARGS]...")
    panels = {}
    for line in result.stdout.splitlines():
        if line.startswith("╭─ "):
            panel = panels.setdefault(line.removeprefix("╭─ ").split(" ─")[0], [])
        elif line.startswith("│ ") and (line[2:3].isalpha() or line[2:4] == "--"):
            panel.append(line[2:].split()[0])
    assert panels == {
        "Options": ["--version", "--show-completion", "--install-completion", "--help"],
        "Convert and export": ["convert", "export"],
        "Inspect": ["info", "plan"],
        "Author a mapping": ["scaffold", "check", "verify"],
    }
    assert result.stderr == ""


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, expected",
    [
        (["convert"], ["Usage: port convert [OPTIONS] MODEL", "Error: Missing argument 'MODEL'."]),
        (["bogus"], ["Usage: port [OPTIONS] COMMAND", "Error: No such command 'bogus'."]),
        (["convert", "M", "--out", "x", "--bogus"], ["Usage: port convert", "Error: No such option: --bogus"]),
        (
            ["convert", "M", "--out", "x", "--dtype", "float64"],
            ["Invalid value for '--dtype': 'float64' is not one of 'float32', 'bfloat16', 'float16'."],
        ),
        (
            ["convert", "M", "--out", "x", "--timeout", "soon"],
            ["Invalid value for '--timeout': expected a number, not 'soon'"],
        ),
        (["plan"], ["Usage: port plan [OPTIONS] MODEL", "Missing argument 'MODEL'"]),
        (["plan", "M", "--mesh"], ["Usage: port plan [OPTIONS] MODEL", "Error: Option '--mesh' requires an argument."]),
        (["scaffold", "M"], ["Usage: port scaffold", "Missing option '--module'"]),
    ],
)
def test_usage_errors_exit_2_with_the_usage(args, expected, tmp_path):
    """typer's click is the vendored `typer._click`: its usage errors are caught as that click's
    classes (an installed `click`'s would let them pass as internal errors, as they once did)."""
    result = run_port(*args, cwd=tmp_path)
    usage_error(result, *expected)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, expected",
    [
        (["convert", "M"], ["Usage: port convert", "Error: Missing option '--out'."]),
        (["conver"], ["Error: No such command 'conver'. Did you mean 'convert'?"]),
        (["verify", "M", "--tolerance", "x"], ["Invalid value for '--tolerance': expected a number, not 'x'"]),
        (["convert", "M", "--out", "x", "--num-processes", "two"], ["Invalid value for '--num-processes'"]),
        (["info", "D", "extra"], ["Usage: port info", "Got unexpected extra argument(s) (extra)"]),
        (["--show-completion", "tcsh"], ["'tcsh' is not one of 'bash', 'zsh', 'fish', 'powershell', 'pwsh'"]),
        (["convert", "M", "--out", "x", "--progress=1"], ["Usage: port convert", "'--progress' does not take a value"]),
    ],
)
def test_more_usage_errors(args, expected, capsys):
    """As above, in this process (`run`, what `main` calls): the same usage and error, exit 2."""
    from port import _cli

    assert _cli.run(args) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err.startswith("Usage: port") and "\nError: " in said.err, said
    assert all(s in said.err for s in expected), said.err


def test_run_parses_in_this_process(capsys):
    """`port._cli.run` (tests, bench/bench.py): a usage error is 2, said with the usage; each command's
    flags reach `_commands` as the `argparse.Namespace` attributes it reads."""
    import argparse

    from port import _cli, _commands

    assert _cli.run(["convert", "M"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Usage: port convert") and "Missing option '--out'" in err
    args = _cli.parse(["convert", "M", "--out", "o", "--module", "a:B", "--module", "c:D", "--no-progress"])
    assert isinstance(args, argparse.Namespace) and args.run is _commands.convert
    assert vars(args) == {
        "run": _commands.convert,
        "model": "M",
        "out": Path("o"),
        "mesh": "1x1",
        "dtype": None,
        "mapping": None,
        "module": ["a:B", "c:D"],
        "report": None,
        "deadline": None,
        "include": None,
        "layers": None,
        "adapter": None,
        "adapter_mode": None,
        "max_over_read": None,
        "force": False,
        "progress": False,
        "json": False,
        "coordinator": None,
        "num_processes": None,
        "process_id": None,
        "timeout": 300.0,
    }
    assert _cli.parse(["plan", "M"]).module is None
    export = _cli.parse(["export", "D", "--out", "H", "--module", "a:B", "--report", "r.json", "--json", "--progress"])
    assert (export.dir, export.module, export.report, export.json, export.progress) == (
        Path("D"),
        "a:B",
        Path("r.json"),
        True,
        True,
    )
    assert export.max_shard_size == "5GB" and export.deadline is None and export.run is _commands.export_command
    verify = _cli.parse(["verify", "M", "--padding", "left", "--batch", "3"])
    assert (verify.batch, verify.length, verify.padding, verify.tolerance, verify.roundtrip) == (
        3,
        16,
        "left",
        None,
        False,
    )
    assert _cli.parse(["convert", "M", "--out", "o", "--deadline", "1.5"]).deadline == 1.5
    assert _cli.parse(["scaffold", "M", "--module", "a:B"]).module == "a:B"
    assert _cli.parse(["info", "D", "--json"]).run is _commands.info_command
    assert _cli.parse(["--version"]) == 0 and capsys.readouterr().out.startswith("port ")


def test_the_dtype_choices_are_the_dtype_tables():
    """`_cli` spells the casts out (importing `_dtypes` imports NumPy, which `--help` must not)."""
    import typing

    from port import _cli
    from port._dtypes import CASTS

    assert typing.get_args(_cli.Cast) == CASTS


@pytest.mark.slow
def test_a_plan_with_several_problems_lists_them_all():
    """Issue 24 row 11: every problem on stdout, one error line naming the first and the count."""
    result = run_port("plan", EXAMPLE, "--mesh", "data=2,foo=2")
    line = one_line(result, "names mesh axis 'model'", "(and 2 more problems: all 3 listed above)")
    listed = result.stdout.strip().splitlines()
    assert len(listed) == 3 and line.removeprefix("port: error: ").startswith(listed[0])
    assert [("rules." + p.split("rules.")[1].split()[0]) for p in listed] == ["rules.vocab", "rules.heads", "rules.mlp"]


@pytest.mark.slow
def test_version():
    result = run_port("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"port {version('port')}"


@pytest.mark.slow
def test_help_shows_flags_plainly():
    """typer's rich help, within 100 columns even on a wider terminal, each flag as users type it (no
    `<bool>`, `<str>` or `{MODEL}`), the multi-process flags in their own panel; `-h` as `--help`."""
    result = run_port("convert", "--help", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.split()[:5] == ["Usage:", "port", "convert", "[OPTIONS]", "MODEL"]
    assert "--force" in text
    assert re.search(r"--progress +--no-progress ", text) and re.search(r"--dtype +DTYPE ", text), text
    assert "<bool>" not in text and "<str>" not in text and "{" not in text, text
    words = " ".join(text.replace("│", " ").split())  # the help's words, however the columns wrap them
    assert "cast floating parameters to float32, bfloat16" in words
    assert "╭─ Multi-process run" in text and text.index("╭─ Multi-process run") < text.index("│ --coordinator")
    assert max(len(line) for line in text.splitlines()) == 100
    assert run_port("convert", "-h", env={"COLUMNS": "200"}).stdout == text
    narrow = run_port("verify", "--help")  # piped: 80 columns
    assert max(len(line) for line in narrow.stdout.splitlines()) == 80
    assert "--padding" in narrow.stdout and "left|right" in narrow.stdout


@pytest.mark.slow
def test_help_version_and_completion_import_neither_jax_nor_numpy(tmp_path):
    """The supervisor answers `--help`, `--version` and completion requests at once: one process
    (the worker never starts), importing none of JAX, NumPy or port's pipeline (`-X importtime`'s
    list, through the installed entry point)."""
    heavy = {"jax", "jaxlib", "numpy", "ml_dtypes", "equinox", "torch", "port._dtypes", "port._convert", "port._plan"}
    complete = {"_PORT_COMPLETE": "complete_bash", "COMP_WORDS": "port convert --dt", "COMP_CWORD": "2"}
    for args, env in (
        ([], None),
        (["--help"], None),
        (["convert", "--help"], None),
        (["--version"], None),
        ([], complete),
    ):
        result = run_port(*args, env={"PYTHONPROFILEIMPORTTIME": "1", **(env or {})}, cwd=tmp_path)
        imported = [
            line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
        ]
        assert imported.count("port._cli") == 1, (args, env)  # one process: no worker started
        assert not heavy & {name.strip() for name in imported}, (args, env, heavy & set(imported))
    assert result.returncode == 0 and result.stdout.split() == ["--dtype"]


@pytest.mark.slow
def test_refusals_from_flags_paths_and_metadata_import_no_jax(tmp_path):
    """A refusal decided from the flags, the paths and an output's metadata answers before JAX (or
    Equinox, or port's modules that import them) is imported: the one line, exit 1. `-X importtime`'s
    list of both processes, through the installed entry point (PORT_DEBUG=1 keeps the worker's stderr)."""
    import subprocess

    heavy = {"jax", "jaxlib", "equinox", "port._runtime", "port._convert", "port._output._restore"}
    heavy |= {"port._output._save", "port._export._export"}
    existing, claimed = tmp_path / "existing", tmp_path / "claimed"
    existing.mkdir()
    (claimed / "port").mkdir(parents=True)
    (claimed / "port" / "metadata").write_text('{"format": 2}')
    for args, expected in (
        (
            ["convert", EXAMPLE, "--mesh", "3x", "--out", tmp_path / "x"],
            "port: error: --mesh '3x': expected DATAxMODEL",
        ),
        (
            ["convert", EXAMPLE, "--out", existing],
            f"port: error: --out {existing}: already exists (use --force to replace an earlier port output)",
        ),
        (["export", EXAMPLE, "--out", tmp_path / "x"], f"port: error: {EXAMPLE}: not a port output (no port/metadata)"),
        (["info", tmp_path / "missing"], f"port: error: {tmp_path / 'missing'}: does not exist"),
        (
            ["plan", claimed],
            f"port: error: {claimed}/port/metadata: format 2 is not 3, the one this port reads",
        ),
    ):
        result = run_port(*args, env={"PYTHONPROFILEIMPORTTIME": "1", "PORT_DEBUG": "1"}, cwd=tmp_path)
        timed = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
        imported = {line.split("|")[-1].strip() for line in timed}
        said = "".join(line + "\n" for line in result.stderr.splitlines() if not line.startswith("import time:"))
        line = one_line(subprocess.CompletedProcess(result.args, result.returncode, result.stdout, said))
        assert line.startswith(expected), (args, line)
        assert [line.split("|")[-1].strip() for line in timed].count("port._cli") == 2, args  # the worker's too
        assert "port._commands" in imported and not heavy & imported, (args, heavy & imported)
    assert not (tmp_path / "x").exists() and not any(existing.iterdir())


@pytest.mark.slow
def test_shell_completion(tmp_path):
    """`_PORT_COMPLETE` (what the scripts `--show-completion SHELL` prints set) completes commands,
    flags and choices; `--install-completion SHELL` writes the script where the shell reads it."""

    def complete(words: str) -> list[str]:
        env = {"_PORT_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1)}
        result = run_port(env=env, cwd=tmp_path)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        return result.stdout.split()

    assert complete("port con") == ["convert"]
    assert complete("port convert M --dtype b") == ["bfloat16"]
    assert complete("port verify M --pad") == ["--padding"]
    zsh = run_port(env={"_PORT_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "port pl"}, cwd=tmp_path)
    assert '"plan":"Print how MODEL maps onto the mesh, reading no tensor data."' in zsh.stdout

    bash = run_port("--show-completion", "bash")
    assert bash.returncode == 0, bash.stderr
    assert "_PORT_COMPLETE=complete_bash $1" in bash.stdout
    assert bash.stdout.rstrip().endswith("complete -o default -F _port_completion port")
    assert "compdef _port_completion port" in run_port("--show-completion", "zsh").stdout

    installed = run_port("--install-completion", "bash", env={"HOME": str(tmp_path)}, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout.startswith("bash completion installed in ")
    script = tmp_path / ".bash_completions" / "port.sh"
    assert script.read_text().strip() == bash.stdout.strip()
    assert f"source '{script}'" in (tmp_path / ".bashrc").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"COMP_WORDS": "port co", "COMP_CWORD": "x"}, "COMP_CWORD 'x': expected the index of the word completed"),
        ({"COMP_WORDS": "port co", "COMP_CWORD": "-1"}, "COMP_CWORD '-1': expected the index"),
        ({"COMP_WORDS": "port co", "COMP_CWORD": "1" * 5000}, "COMP_CWORD '1111"),  # past int()'s 4300 digits
        ({"COMP_CWORD": "1"}, "COMP_WORDS is not set"),
        ({"COMP_WORDS": "port co"}, "COMP_CWORD is not set"),
        ({"_PORT_COMPLETE": "complete_fish2"}, "_PORT_COMPLETE 'complete_fish2': expected complete_SHELL or source_"),
        ({"_PORT_COMPLETE": "bash_complete"}, "_PORT_COMPLETE 'bash_complete': expected complete_SHELL"),
        ({"_PORT_COMPLETE": "complete_fish"}, "_TYPER_COMPLETE_FISH_ACTION is not set (get-args or is-args)"),
        (
            {"_PORT_COMPLETE": "complete_fish", "_TYPER_COMPLETE_FISH_ACTION": "list"},
            "_TYPER_COMPLETE_FISH_ACTION 'list': expected get-args or is-args",
        ),
    ],
)
def test_a_malformed_completion_request_is_refused_in_one_line(tmp_path, env, expected):
    """A completion request whose variables its shell's script would never set (bash's COMP_WORDS
    and COMP_CWORD, fish's action, an unknown shell) is refused naming the variable, exit 1."""
    result = run_port(env={"_PORT_COMPLETE": "complete_bash", **env}, cwd=tmp_path)
    assert one_line(result, expected) and result.stdout == ""


@pytest.mark.slow
def test_completion_requests_of_every_shell(tmp_path):
    """Each shell typer supports answers through its own variables; source_SHELL prints its script;
    an eager flag being completed (`port --version <TAB>`) does not run."""
    base = {"_TYPER_COMPLETE_ARGS": "port pl"}
    for env, expected in (
        ({"_PORT_COMPLETE": "complete_fish", "_TYPER_COMPLETE_FISH_ACTION": "get-args"} | base, "plan\tPrint how"),
        ({"_PORT_COMPLETE": "complete_powershell", "_TYPER_COMPLETE_WORD_TO_COMPLETE": "pl"} | base, "plan:::"),
        ({"_PORT_COMPLETE": "complete_pwsh", "_TYPER_COMPLETE_WORD_TO_COMPLETE": "pl"} | base, "plan:::"),
        ({"_PORT_COMPLETE": "complete_zsh"}, '"plan":"Print how'),  # nothing typed yet: every command
        ({"_PORT_COMPLETE": "source_fish"}, "complete --command port"),
        ({"_PORT_COMPLETE": "complete_bash", "COMP_WORDS": "port --version x", "COMP_CWORD": "2"}, ""),
    ):
        result = run_port(env=env, cwd=tmp_path)
        assert result.returncode == 0 and result.stderr == "", (env, result.stderr)
        assert expected in result.stdout and "port 0" not in result.stdout, (env, result.stdout)


@pytest.mark.slow
def test_verify_beyond_the_tolerance_exits_1():
    """(Within it, 0: test_check_verify.py; the text verdict, `FAILED (tolerance ...)` and the
    first divergence: test_verify_divergence.py.)"""
    transformers_or_skip()
    import json

    as_json = run_port("verify", EXAMPLE, "--tolerance", "1e-12", "--json")  # the verdict, as docs/cli.md says
    assert as_json.returncode == 1, as_json.stdout + as_json.stderr
    assert "Traceback" not in as_json.stdout + as_json.stderr
    document = json.loads(as_json.stdout)
    assert list(document) == documented_fields("port.verify/1")
    assert document["ok"] is False and document["tolerance"] == 1e-12 and 0 < document["max_abs_difference"] < 1e-3
    assert document["shape"] == [2, 16, 1021] and document["reference"].endswith(".logits")
    assert document["padding"] is None and document["roundtrip"] is None


@pytest.mark.slow
def test_verify_pads_sizes_and_round_trips():
    """Issue 24 row 7: --batch, --length, --padding (the mask to both models, padded positions not
    compared) and --roundtrip (exported back, every tensor bit for bit) through the command line."""
    import json

    transformers_or_skip()
    result = run_port(
        "verify", EXAMPLE, "--batch", "3", "--length", "12", "--padding", "left", "--roundtrip", "--mesh", "2x2"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    first, second = result.stdout.strip().splitlines()
    assert "(float32 [3, 12, 1021], left-padded, max |reference|" in first and first.endswith("(tolerance 0.0001)")
    assert ": ok (" in first
    assert second == f"{EXAMPLE}: round trip: 28 tensors exported back bit for bit: ok"
    as_json = run_port("verify", EXAMPLE, "--padding", "right", "--roundtrip", "--json")
    document = json.loads(as_json.stdout)
    assert as_json.returncode == 0 and list(document) == documented_fields("port.verify/1")
    assert document["padding"] == "right" and document["roundtrip"] == {"same": 28, "differing": [], "not_written": []}
    one_line(
        run_port("verify", EXAMPLE, "--roundtrip", "--dtype", "bfloat16"),
        "--roundtrip compares bit for bit: drop --dtype bfloat16",
    )
    for bad, said in (
        (["--batch", "0"], "Invalid value for '--batch': expected a positive integer, not '0'"),
        (["--length", "x"], "Invalid value for '--length': expected a positive integer, not 'x'"),
        (["--padding", "middle"], "Invalid value for '--padding': 'middle' is not one of 'left', 'right'."),
    ):
        usage_error(run_port("verify", EXAMPLE, *bad), "Usage: port verify [OPTIONS] MODEL", said)


@pytest.mark.slow
def test_scaffold_module_needs_a_class(tmp_path):
    result = run_port("scaffold", EXAMPLE, "--module", "port.models.gpt2")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "port: error: --module 'port.models.gpt2': expected module:Class, such as mymodel:MyModel"
    ]


@pytest.mark.slow
def test_scaffold_force_replaces_only_its_own_draft(tmp_path):
    mine = tmp_path / "notes.toml"
    mine.write_text("# my own notes\n")
    refused = run_port("scaffold", EXAMPLE, "--module", "port.models.gpt2:GPT2", "--out", mine, "--force")
    assert refused.returncode == 1 and "not a scaffold draft port wrote" in refused.stderr
    assert mine.read_text() == "# my own notes\n"

    draft = tmp_path / "draft.toml"
    first = run_port("scaffold", EXAMPLE, "--module", "port.models.gpt2:GPT2", "--out", draft)
    assert first.returncode == 0, first.stderr
    text = draft.read_text()
    again = run_port("scaffold", EXAMPLE, "--module", "port.models.gpt2:GPT2", "--out", draft)
    assert again.returncode == 1 and "already exists" in again.stderr
    forced = run_port("scaffold", EXAMPLE, "--module", "port.models.gpt2:GPT2", "--out", draft, "--force")
    assert forced.returncode == 0, forced.stderr
    assert draft.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft.toml", "notes.toml"]


@pytest.mark.slow
def test_one_device_is_not_simulated(tmp_path):
    result = run_port("convert", EXAMPLE, "--out", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert "simulating" not in result.stderr
    assert "converted" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("width", [80, 100])
def test_plan_fits_the_terminal(width):
    result = run_port("plan", EXAMPLE, "--mesh", "4x2", env={"COLUMNS": str(width)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= width, "\n".join(line for line in lines if len(line) > width)
    assert "\x1b" not in result.stdout  # no colour codes when piped
    header = next(i for i, line in enumerate(lines) if line.startswith("target"))
    assert lines[header].split() == ["target", "shape", "spec", "per", "device"]
    row = next(line for line in lines if line.startswith("wte "))
    assert row.split() == ["wte", "f32[1021,64]", "(-,", "data)", "65.3", "KB"]
    assert "  note: vocab 1021 not divisible by model=2: replicated on model" in lines
    assert "  from wte.weight" in lines
    assert lines[-1] == "169.5K params in 20 leaves; 678.1 KB to read, 121.3 KB per device"


def test_the_library_leaves_sys_path_alone(tmp_path, monkeypatch):
    import sys

    import port

    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    mapping = port.load_mapping(REPO / "mappings" / "gpt2.toml")
    mapping.model_class()
    assert sys.path == before


@pytest.mark.slow
def test_a_directory_named_like_a_module_does_not_shadow_it(tmp_path):
    """The command line appends the working directory: installed modules come first."""
    for name in ("port", "equinox"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise SystemExit('shadowed')\n")
    result = run_port("plan", EXAMPLE, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "shadowed" not in result.stdout + result.stderr


MYMODEL = """
from pathlib import Path
Path(__file__).with_name("imported").write_text("mymodel ran")
from port.models.gpt2 import GPT2 as MyGPT2
"""


@pytest.fixture
def beside(tmp_path):
    """`mymodel.py` (which says when it is imported) and `mine.toml` naming it, in the working directory."""
    (tmp_path / "mymodel.py").write_text(MYMODEL)
    mapping = (
        (REPO / "mappings" / "gpt2.toml")
        .read_text()
        .replace('model = "port.models.gpt2:GPT2"', 'model = "mymodel:MyGPT2"')
    )
    assert "mymodel:MyGPT2" in mapping
    (tmp_path / "mine.toml").write_text(mapping)
    return tmp_path


@pytest.mark.slow
def test_a_module_beside_the_user_is_found_when_named(beside):
    result = run_port("check", "mine.toml", EXAMPLE, "--module", "mymodel:MyGPT2", cwd=beside)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mine.toml: ok: 20 leaves" in result.stdout
    assert (beside / "imported").read_text() == "mymodel ran"


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["check", "mine.toml", EXAMPLE],
        ["plan", EXAMPLE, "--mapping", "mine.toml"],
        ["convert", EXAMPLE, "--mapping", "mine.toml", "--out", "out"],
    ],
)
def test_a_mapping_alone_imports_nothing_from_the_working_directory(beside, command):
    """Issue 21 row 17: the mapping's word is not enough; the command line says how to name it."""
    result = run_port(*command, cwd=beside)
    line = one_line(result, "mine.toml: model 'mymodel:MyGPT2' cannot be imported (No module named 'mymodel')")
    assert line.endswith(
        "mymodel.py in the working directory is imported only when named: "
        "`--module mymodel:MyGPT2` on the command line, or its directory on sys.path in Python"
    )
    assert not (beside / "imported").exists() and not (beside / "out").exists()


@pytest.mark.slow
def test_module_must_be_a_class_the_mapping_names(beside):
    (beside / "other.py").write_text(MYMODEL)
    result = run_port("check", "mine.toml", EXAMPLE, "--module", "other:MyGPT2", cwd=beside)
    one_line(
        result,
        "--module 'other:MyGPT2': mine.toml names model 'mymodel:MyGPT2' and reference "
        "'transformers:GPT2LMHeadModel'; --module names one of those",
    )
    result = run_port("plan", EXAMPLE, "--module", "mymodel:MyGPT2", cwd=beside)
    one_line(result, "--module mymodel:MyGPT2: give the mapping that names it (--mapping FILE)")
    result = run_port("check", "mine.toml", EXAMPLE, "--module", "../mymodel:MyGPT2", cwd=beside)
    one_line(result, "--module '../mymodel:MyGPT2': expected module:Class")
    assert not (beside / "imported").exists()


@pytest.mark.slow
def test_export_of_your_own_model_names_its_class(beside):
    """Issue 24 row 1: an output of your own module exports with `--module` (the output's word imports nothing)."""
    made = run_port(
        "convert", EXAMPLE, "--mapping", "mine.toml", "--module", "mymodel:MyGPT2", "--out", "out", cwd=beside
    )
    assert made.returncode == 0, made.stderr
    (beside / "imported").unlink()
    refused = run_port("export", "out", "--out", "hf", cwd=beside)
    one_line(refused, "model 'mymodel:MyGPT2' is not one of port's models", "`port export DIR --module mymodel:MyGPT2`")
    assert not (beside / "imported").exists() and not (beside / "hf").exists()
    done = run_port("export", "out", "--out", "hf", "--module", "mymodel:MyGPT2", cwd=beside)
    assert done.returncode == 0, done.stderr
    from safetensors.numpy import load_file

    ours = load_file(beside / "hf" / "model.safetensors")
    theirs = load_file(EXAMPLE / "model.safetensors")
    assert set(ours) <= set(theirs) and all((ours[k] == theirs[k]).all() for k in ours)


BROKEN = """
from port.models.gpt2 import GPT2


class MyGPT2(GPT2):
    @classmethod
    def from_config(cls, config, key=None):
        width = config["n_embd_typo"]
        return super().from_config(config, key=key)
"""


@pytest.mark.slow
def test_an_error_in_your_own_module_names_its_file_and_line(beside):
    """Issue 24 row 4: a bug in the author's module is one line at the author's frame (file, line,
    function), not `internal error` without a place; the line says how to see the traceback."""
    (beside / "mymodel.py").write_text(BROKEN)
    line_of = next(i for i, line in enumerate(BROKEN.splitlines(), 1) if "n_embd_typo" in line)
    result = run_port(
        "convert", EXAMPLE, "--mapping", "mine.toml", "--module", "mymodel:MyGPT2", "--out", "out", cwd=beside
    )
    one_line(result, f"mymodel.py:{line_of} in from_config: KeyError: 'n_embd_typo' (PORT_DEBUG=1 shows the traceback)")
    assert not (beside / "out").exists()


NO_FINAL_NORM = """
import equinox as eqx
from port.models.gpt2 import GPT2


class NoNorm(GPT2):  # a model whose final norm is a submodule that may be None
    @classmethod
    def from_config(cls, config, key=None):
        return eqx.tree_at(lambda m: m.ln_f, super().from_config(config, key=key), None, is_leaf=lambda x: x is None)
"""


@pytest.mark.slow
def test_optional_covers_a_leaf_whose_parent_module_is_none(tmp_path):
    """Issue 24 row 3: `optional = "model"` applies when a parent module is None (`ln_f` here),
    and without it the message says which parent is None and how to mark the entry."""
    (tmp_path / "nonorm.py").write_text(NO_FINAL_NORM)
    mapping = (
        (REPO / "mappings" / "gpt2.toml")
        .read_text()
        .replace('model = "port.models.gpt2:GPT2"', 'model = "nonorm:NoNorm"')
    )
    (tmp_path / "strict.toml").write_text(mapping)
    for name in ("weight", "bias"):
        entry = f'path = "ln_f.{name}"\naxes = ["embed"]\n'
        assert entry in mapping
        mapping = mapping.replace(entry, entry + 'optional = "model"\n')
    mapping = mapping.replace("ignore = [", 'ignore = ["ln_f.weight", "ln_f.bias", ', 1)
    assert mapping.count('optional = "model"') >= 2 and '"ln_f.weight", "ln_f.bias"' in mapping
    (tmp_path / "optional.toml").write_text(mapping)
    done = run_port("check", "optional.toml", EXAMPLE, "--module", "nonorm:NoNorm", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    refused = run_port("check", "strict.toml", EXAMPLE, "--module", "nonorm:NoNorm", cwd=tmp_path)
    assert refused.returncode == 1
    assert (
        "entry 'ln_f.weight': 'ln_f.weight' lies under 'ln_f', which is None in nonorm:NoNorm built from this "
        'config.json (mark the entry optional = "model" if the model may lack it)'
    ) in refused.stdout


@pytest.mark.slow
def test_info_describes_an_output(tmp_path):
    """Issue 24 row 8: `port info DIR` says what a `port convert` output holds, from its metadata
    alone; anything else is one line."""
    made = run_port("convert", EXAMPLE, "--mesh", "2x2", "--out", tmp_path / "out")
    assert made.returncode == 0, made.stderr
    result = run_port("info", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"{tmp_path / 'out'}: a port output (format 3), 169.5K params in 20 leaves, 678.1 KB"
    assert lines[1] == "model: port.models.gpt2:GPT2 (model_type 'gpt2')"
    assert lines[2] == f"mapping: {REPO / 'mappings' / 'gpt2.toml'} (its text is kept in the output)"
    assert lines[3] == "written on mesh: data=2,model=2"
    assert lines[4] == f"written by: port {version('port')}"
    assert "wte                 float32[1021,64]    vocab, embed" in result.stdout
    assert sum(1 for line in lines if line.startswith(("wte", "wpe", "blocks.", "ln_f."))) == 20
    import json

    metadata = tmp_path / "out" / "port" / "metadata"
    older = json.loads(metadata.read_text())
    del older["port_version"]  # an output written before port recorded its version
    metadata.write_text(json.dumps(older))
    unversioned = run_port("info", tmp_path / "out")
    assert unversioned.returncode == 0, unversioned.stderr
    assert unversioned.stdout.splitlines()[4] == "written by: port, its version not recorded"
    one_line(run_port("info", EXAMPLE), f"{EXAMPLE}: not a port output (no port/metadata)")
    for sharding in (
        '{"d3Rl": "[2, 2]"}',
        '{"d3Rl": 7}',
        "[]",
        '{"d3Rl": "{\\"shape\\": [2], \\"axis_names\\": [1]}"}',
    ):
        (tmp_path / "out" / "params" / "_sharding").write_text(sharding)  # untrusted: the mesh is then not shown
        odd = run_port("info", tmp_path / "out")
        assert odd.returncode == 0 and "written on mesh: not recorded" in odd.stdout, odd.stdout + odd.stderr


def documented_fields(schema: str) -> list[str]:
    """The fields docs/cli.md lists for `schema`, in order (backticked names in its table's first column)."""
    import re

    text = (REPO / "docs" / "cli.md").read_text()
    section = text.split(f"`{schema}`", 1)[1].split("\n## ", 1)[0]
    return [
        name
        for row in section.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`(\w+)`", row.split("|")[1])
    ]


@pytest.mark.slow
def test_json_output_is_what_docs_cli_md_says(tmp_path, beside):
    """Issue 24 row 9: `--json` prints one object whose fields are docs/cli.md's, in its order;
    errors stay one line on stderr with the same exit status."""
    import json

    plan = run_port("plan", EXAMPLE, "--mesh", "2x2", "--json")
    assert plan.returncode == 0, plan.stderr
    document = json.loads(plan.stdout)
    assert list(document) == documented_fields("port.plan/1")
    assert document["mesh"] == {"data": 2, "model": 2} and len(document["leaves"]) == 20
    assert document["leaves"][0] == {
        "path": "wte",
        "shape": [1021, 64],
        "dtype": "float32",
        "spec": [None, "data"],
        "bytes_per_device": 1021 * 64 * 4 // 2,
        "source": "wte.weight",
        "stack": [],
        "transforms": "-",
        "notes": ["vocab 1021 not divisible by model=2: replicated on model"],
    }
    assert document["leaves"][4] == {
        "path": "blocks.attn.wq",
        "shape": [2, 64, 4, 16],
        "dtype": "float32",
        "spec": [None, "data", "model", None],
        "bytes_per_device": 8192,
        "source": "h.{layer}.attn.c_attn.weight",
        "stack": [2],
        "transforms": "split(axis=1, parts=3, index=0) > reshape[64, 4, -1]",
        "notes": [],
    }
    assert document["params"] == 169536 and document["read_bytes"] == 678144

    check = run_port("check", REPO / "mappings" / "gpt2.toml", EXAMPLE, "--json")
    assert check.returncode == 0, check.stderr
    document = json.loads(check.stdout)
    assert list(document) == documented_fields("port.check/1") and document["ok"] is True

    (beside / "nonorm.py").write_text(NO_FINAL_NORM)
    (beside / "strict.toml").write_text(
        (REPO / "mappings" / "gpt2.toml")
        .read_text()
        .replace('model = "port.models.gpt2:GPT2"', 'model = "nonorm:NoNorm"')
    )
    failed = run_port("check", "strict.toml", EXAMPLE, "--module", "nonorm:NoNorm", "--json", cwd=beside)
    one_line(failed, "strict.toml: 4 problems with")
    document = json.loads(failed.stdout)
    assert list(document) == documented_fields("port.check/1")[:5] and document["ok"] is False
    assert len(document["problems"]) == 4 and "lies under 'ln_f', which is None" in document["problems"][0]

    made = run_port("convert", EXAMPLE, "--mesh", "2x2", "--out", tmp_path / "out")
    assert made.returncode == 0, made.stderr
    info = run_port("info", tmp_path / "out", "--json")
    document = json.loads(info.stdout)
    assert list(document) == documented_fields("port.info/1")
    assert document["mesh"] == {"data": 2, "model": 2} and document["params"] == 169536
    assert document["leaves"][0] == {
        "path": "wte",
        "shape": [1021, 64],
        "dtype": "float32",
        "axes": ["vocab", "embed"],
        "bytes": 1021 * 64 * 4,
        "quantized": None,
    }


def test_a_bare_completion_flag_means_the_shell_running_port(monkeypatch, capsys):
    """`--show-completion` without SHELL: the shell typer finds running `port`, else $SHELL; neither
    found, a usage error asking for one."""
    import typer._completion_shared

    from port import _cli

    monkeypatch.setattr(typer._completion_shared, "_get_shell_name", lambda: None)
    monkeypatch.setenv("SHELL", "/usr/bin/zsh")
    assert _cli.parse(["--show-completion"]) == 0
    assert "compdef _port_completion port" in capsys.readouterr().out
    monkeypatch.setattr(typer._completion_shared, "_get_shell_name", lambda: "fish")
    assert _cli.parse(["--show-completion"]) == 0
    assert capsys.readouterr().out.startswith("complete --command port ")
    monkeypatch.setattr(typer._completion_shared, "_get_shell_name", lambda: None)
    monkeypatch.setenv("SHELL", "/bin/tcsh")
    assert _cli.parse(["--show-completion"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Usage: port [OPTIONS] COMMAND [ARGS]...")
    assert "Error: cannot tell which shell runs port ('tcsh'): name one of bash, zsh, fish, powershell, pwsh" in err
