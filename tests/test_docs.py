"""Every block of code in README.md and docs/ runs as written, in the conditions it states.

A page is run as a reader follows it: its blocks in order, in one working directory
holding what a clone of port holds that the blocks use (`examples/tiny-gpt2`, its adapter
`examples/tiny-gpt2-lora`, `examples/nnx_llama`, `mappings/`), so a block may use what an earlier one wrote. A block's language says
what it is and how it is run:

- `sh`: `port` commands, one a line (a trailing `\\` continues one), each through the real
  `port` entry point, expected to exit 0. Commands with `--process-id` are the processes
  of one multi-process run, started together on loopback (`--coordinator` moved to a free
  local port).
- `console`: `$ port ...` and the lines it prints: run, and what it prints compared line
  by line with numbers, sizes and paths generalised (the format, not the figures).
- `python`: run by a fresh interpreter in an ordinary process: no device settings (one
  CPU device until port simulates those a mesh needs), offline.
- `toml`: a mapping excerpt: parsed by `port.load_mapping`, and each of its entries is
  a shipped mapping's (or the NNX example's, `examples/nnx_llama/llama.toml`).
- `text`: a synopsis: each `port COMMAND` names exactly the options its parser has.
- `bash`: the fresh-machine blocks `.ci/run` runs (tests/test_readme.py checks them).

What a reader has and this machine has not stands in: a Hugging Face repo id resolves,
offline, through a Hub cache holding a small checkpoint of the same family (`HUB`);
absolute paths under /tmp/ and /shared/ lie under the working directory, where
`/tmp/gpt2-small` is the tiny GPT-2 of examples/.
"""

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helpers import port_command, port_env, torch_bert, torch_llama
from test_multiprocess import free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"

# docs/ pages whose blocks are not run here, and why.
NOT_HERE = {
    "architecture.md": "the code's layout drawn as a diagram; no command",
    "adding-an-architecture.md": "its marked blocks run in tests/test_walkthrough.py",
    "benchmarks.md": "figures and the commands that measured them on the machines named; "
    "tests/test_bench.py runs each script in its smallest form",
    "measurements.md": "figures measured on the machines named, with their commands",
}
PAGES = [REPO / "README.md"] + sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in NOT_HERE)

# Hugging Face repo ids the pages name: a small checkpoint of the same family for each.
HUB = {
    "gpt2": lambda d: shutil.copytree(EXAMPLE, d),
    "meta-llama/Llama-3.2-1B": lambda d: torch_llama().save_pretrained(d),
    "Qwen/Qwen2.5-0.5B": lambda d: torch_llama("Qwen2").save_pretrained(d),
    "sentence-transformers/all-MiniLM-L6-v2": lambda d: torch_bert().save_pretrained(d),
}
LOCAL = {"/tmp/gpt2-small": EXAMPLE}  # absolute paths the pages read, and what stands in for them
# what of examples/ the working directory holds
EXAMPLES = [EXAMPLE, REPO / "examples" / "tiny-gpt2-lora", REPO / "examples" / "nnx_llama"]
EXAMPLE_MAPPINGS = [REPO / "examples" / "nnx_llama" / "llama.toml"]  # mappings the pages quote beside mappings/

# Checks appended to a Python block (found by a line of it): what its prose says of the process it runs in.
CONDITIONS = {
    "checkpointer = ocp.StandardCheckpointer()": (
        "\nimport sys\n"
        "assert jax.device_count() == 1, jax.devices()  # an ordinary one-device process\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'port'], 'stock Orbax, without port'\n"
    ),
}

FENCE = re.compile(r"^```(\S*)\n(.*?)^```\s*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    text: str
    marker: str  # the line before the fence when it is an HTML comment, else ""

    def __str__(self) -> str:
        name = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{name}:{self.line} ({self.language or 'no language'})"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append(
            Block(
                page,
                text.count("\n", 0, match.start()) + 1,
                match.group(1),
                match.group(2),
                before if before.startswith("<!--") else "",
            )
        )
    return found


def command_lines(text: str) -> list[list[str]]:
    """The commands of an `sh` block as argv lists: `\\` joins lines, `#` starts a comment."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [argv for argv in (shlex.split(line, comments=True) for line in joined.splitlines()) if argv]


def shape_of(line: str) -> str:
    """A line with its numbers, sizes and paths generalised: the format, not the figures."""
    line = re.sub(r"\S*/\S+", "PATH", line)
    line = re.sub(r"\d+(\.\d+)?[KMB]?\b", "N", line)  # 4.1, 124.4M, 169.5K
    return re.sub(r"\b[KMGT]?B\b", "UNIT", line)


@pytest.fixture(scope="session")
def hub(tmp_path_factory) -> Path:
    """A Hugging Face cache holding a stand-in for every repo id in `HUB`, as huggingface_hub lays it out."""
    cache = tmp_path_factory.mktemp("hub")
    for repo, make in HUB.items():
        entry = cache / f"models--{repo.replace('/', '--')}"
        make(entry / "snapshots" / ("0" * 40))
        (entry / "refs").mkdir(parents=True)
        (entry / "refs" / "main").write_text("0" * 40)
    return cache


class Reader:
    """One page's working directory and environment; runs its blocks in order."""

    def __init__(self, root: Path, hub: Path):
        self.work = root / "work"
        (self.work / "examples").mkdir(parents=True)
        for example in EXAMPLES:
            shutil.copytree(example, self.work / "examples" / example.name)
        shutil.copytree(REPO / "mappings", self.work / "mappings")
        for path, stand_in in LOCAL.items():
            shutil.copytree(stand_in, self.local(path))
        (root / "tmp").mkdir()
        self.env = port_env({"HF_HUB_CACHE": str(hub), "TMPDIR": str(root / "tmp")})

    def local(self, token: str) -> str:
        """An absolute path under /tmp/ or /shared/ moved under the working directory; any other token as is."""
        if not token.startswith(("/tmp/", "/shared/")):
            return token
        path = self.work / token.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        return str(path)

    def argv(self, tokens: list[str], block: Block) -> list[str]:
        assert tokens[0] == "port", f"{block}: a block of commands holds `port` commands only: {shlex.join(tokens)}"
        return [*port_command(), *(self.local(t) for t in tokens[1:])]

    def run(self, argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=600)

    def sh(self, block: Block) -> None:
        commands = command_lines(block.text)
        assert commands, f"{block}: no command"
        if any("--process-id" in c for c in commands):
            return self.processes(block, commands)
        for tokens in commands:
            result = self.run(self.argv(tokens, block))
            assert result.returncode == 0, f"{block}: {shlex.join(tokens)}\n{result.stdout}{result.stderr}"

    def processes(self, block: Block, commands: list[list[str]]) -> None:
        """The commands of one multi-process run, each as its own process, the coordinator on loopback."""
        assert all("--process-id" in c for c in commands), f"{block}: one run's processes, and nothing else"
        address = f"127.0.0.1:{free_port()}"
        argvs = [[address if before == "--coordinator" else t for before, t in zip(["", *c], c)] for c in commands]
        started = [
            subprocess.Popen(
                self.argv(a, block),
                cwd=self.work,
                env=self.env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for a in argvs
        ]
        try:
            for tokens, process in zip(commands, started):
                out, err = process.communicate(timeout=600)
                assert process.returncode == 0, f"{block}: {shlex.join(tokens)}\n{out}{err}"
        finally:
            for process in started:
                if process.poll() is None:
                    process.kill()
                    process.wait()

    def console(self, block: Block) -> None:
        """`$ command` lines, each followed by what it prints (shaped alike: numbers and paths may differ)."""
        runs: list[tuple[str, list[str]]] = []
        for line in block.text.splitlines():
            if line.startswith("$ "):
                runs.append((line[2:], []))
            else:
                assert runs, f"{block}: output before any `$ ` command"
                runs[-1][1].append(line)
        for command, shown in runs:
            result = self.run(self.argv(shlex.split(command), block))
            assert result.returncode == 0, f"{block}: {command}\n{result.stdout}{result.stderr}"
            printed = (result.stdout + result.stderr).strip().splitlines()
            assert [shape_of(line) for line in printed] == [shape_of(line) for line in shown], (
                f"{block}: {command} printed\n" + "\n".join(printed)
            )

    def python(self, block: Block) -> None:
        code = block.text + "".join(check for line, check in CONDITIONS.items() if line in block.text)
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=self.work, env=self.env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, f"{block}\n{result.stdout}{result.stderr}"

    def toml(self, block: Block) -> None:
        check_mapping_excerpt(block, self.work / "excerpt.toml")

    def text(self, block: Block) -> None:
        check_synopsis(block)

    def bash(self, block: Block) -> None:
        assert block.page.name == "README.md" and block.marker in ("<!-- ci: run -->", "<!-- ci: test -->"), (
            f"{block}: a bash block is one `.ci/run` runs, after its `<!-- ci: ... -->` marker in the README"
        )


@pytest.mark.slow  # each page's blocks run as subprocesses (port, Python)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_block_runs_as_written(page, hub, tmp_path):
    reader = Reader(tmp_path, hub)
    for block in blocks(page):
        run = (
            getattr(reader, block.language, None)
            if block.language in ("sh", "console", "python", "toml", "text", "bash")
            else None
        )
        assert run is not None, f"{block}: say what the block is (sh, console, python, toml, text or bash)"
        run(block)


def check_mapping_excerpt(block: Block, path: Path) -> None:
    """A mapping excerpt parses, and each entry and setting it shows is a shipped mapping's."""
    import port

    path.write_text(block.text)
    excerpt = port.load_mapping(path)
    shipped = [port.load_mapping(p) for p in [*sorted((REPO / "mappings").glob("*.toml")), *EXAMPLE_MAPPINGS]]
    (main,) = [m for m in shipped if m.model == excerpt.model]
    for param in excerpt.params:
        assert param in main.params, f"{block}: {param.key} is not {main.source}'s entry"
    for rule, axes in excerpt.rules.items():
        assert main.rules.get(rule) == axes, f"{block}: rule {rule}"
    for name in ("model_types", "prefixes", "ignore", "tied", "reference", "config", "architectures"):
        assert getattr(excerpt, name) == getattr(main, name), f"{block}: {name}"
    for alias in excerpt.aliases.items():
        assert any(alias in m.aliases.items() for m in shipped), f"{block}: alias {alias}"


def parsers() -> dict[str, Any]:
    """`port`'s own command (under "") and each sub-command's: the click commands typer builds."""
    from port._cli import command

    root = command()
    return {"": root, **root.commands}


def options(command) -> set[str]:
    """A click command's long options (`--progress` and `--no-progress` both), `--help` aside."""
    return {
        name
        for param in command.params
        if param.param_type_name == "option"
        for name in (*param.opts, *param.secondary_opts)
        if name.startswith("--")
    } - {"--help"}


def synopses(text: str) -> list[str]:
    """Each `port ...` line of a synopsis, with its indented continuation lines."""
    found = []
    for line in text.splitlines():
        if line.startswith("port "):
            found.append(line)
        else:
            assert found and line.startswith(" "), f"not a synopsis line: {line!r}"
            found[-1] += " " + line.strip()
    return found


def check_synopsis(block: Block) -> list[str]:
    """Each command of a synopsis names exactly the options its parser has, and its arguments."""
    every = parsers()
    named = []
    for line in synopses(block.text):
        words = line.split()
        command = "" if words[1].startswith("-") else words[1]
        assert command in every, f"{block}: no command {command!r}"
        found = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line))
        assert found == options(every[command]), f"{block}: port {command}"
        for param in every[command].params:
            if param.param_type_name == "argument":
                assert param.metavar in words, f"{block}: port {command} takes {param.metavar}"
        named.append(command)
    return named


def test_the_synopsis_names_every_command():
    """docs/cli.md's synopsis: every command of `port`, `port --version` included."""
    (synopsis,) = [b for b in blocks(REPO / "docs" / "cli.md") if b.language == "text"]
    assert sorted(check_synopsis(synopsis)) == sorted(parsers())


def test_every_option_is_described():
    """Each option of each command appears in docs/cli.md's text, beyond its synopsis."""
    text = FENCE.sub("", (REPO / "docs" / "cli.md").read_text())
    for name, command in parsers().items():
        for option in options(command):
            assert re.search(rf"(?<![\w-]){option}(?![\w-])", text), f"port {name} {option}"


def test_the_runner_compares_what_it_should(tmp_path):
    """The checks themselves: a synopsis missing a flag, a console block showing another format,
    and an unnamed block are caught."""
    page = tmp_path / "page.md"
    page.write_text("```text\nport info DIR\n```\n\n```\nport info DIR\n```\n")
    synopsis, unnamed = blocks(page)
    with pytest.raises(AssertionError, match="port info"):
        check_synopsis(synopsis)
    assert unnamed.language == "" and "no language" in str(unnamed)
    assert shape_of("port: converted /a/b: 124.4M params in 3.6 s") == shape_of(
        "port: converted c/d: 1.5K params in 0.2 s"
    )
    assert shape_of("port: converted x: N params") != shape_of("port: wrote x: N params")
    assert command_lines("port a \\\n    --b 1     # on host 0\n\nport c\n") == [
        ["port", "a", "--b", "1"],
        ["port", "c"],
    ]


def test_the_pages_not_run_here_exist():
    for name in NOT_HERE:
        assert (REPO / "docs" / name).is_file(), name
