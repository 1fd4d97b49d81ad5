"""Everything port imports is declared in pyproject.toml, with a range the installed version is in.

An import that works only because another package happened to bring it (as `click`
once did through typer) breaks the day that package changes; a range without an upper
bound admits versions the suite never ran against.
"""

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REQUIREMENT = re.compile(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)\s*,\s*<\s*([0-9.]+)$")


def _name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _declared(requirements: list[str]) -> dict[str, tuple[str, str]]:
    ranges = {}
    for requirement in requirements:
        match = REQUIREMENT.match(requirement)
        assert match, f"{requirement!r}: expected NAME>=LOW,<HIGH (a tested range with an upper bound)"
        ranges[_name(match[1])] = (match[2], match[3])
    return ranges


def _imports(directory: Path) -> set[str]:
    """Top-level modules imported anywhere under `directory`, outside the standard library."""
    found = set()
    for path in directory.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != "port"}


def _distributions(modules: set[str]) -> dict[str, str]:
    owners = packages_distributions()
    unknown = sorted(m for m in modules if m not in owners)
    assert not unknown, f"imported but not installed by any distribution: {unknown}"
    return {module: _name(owners[module][0]) for module in modules}


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


@pytest.mark.parametrize("group", ["runtime", "test"])
def test_every_import_is_declared_with_a_range_that_holds_the_installed_version(group):
    if group == "runtime":
        ranges = _declared(PROJECT["dependencies"])
        modules = _imports(ROOT / "src" / "port") - {"torch", "transformers"}  # `port verify`: the torch extra
    else:
        ranges = _declared(PROJECT["dependencies"]) | _declared(PROJECT["optional-dependencies"]["test"])
        generated = {"torch_tinylm", "dict_llama"}  # modules test_walkthrough.py, test_scaffold_targets.py write
        examples = {path.stem for path in (ROOT / "examples").glob("*/*.py")}  # the worked examples' modules
        local = {path.stem for path in (ROOT / "tests").glob("*.py")} | {"make_gpt2"} | generated | examples
        modules = _imports(ROOT / "tests") - local
    for module, distribution in sorted(_distributions(modules).items()):
        assert distribution in ranges, f"{module} (from {distribution}) is imported but not declared for {group}"
        low, high = ranges[distribution]
        installed = _version_tuple(version(distribution))
        assert _version_tuple(low) <= installed < _version_tuple(high), (
            f"{distribution} {version(distribution)} is outside its declared range >={low},<{high}"
        )


def test_the_torch_extra_names_what_verify_imports():
    extra = _declared(PROJECT["optional-dependencies"]["torch"])
    assert {"torch", "transformers"} <= set(extra)


COMMAND_LINE = {"port._cli", "port._commands", "port._flags", "port._interrupt", "port._console", "port.__main__"}
"""The command line's modules: only they print, exit, or handle signals; the library raises."""


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module an `import from` names, its relative form resolved against `module`."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imported(path: Path, module: str) -> set[str]:
    """Every module `path` (the module named `module`) imports, at any level of its code,
    as absolute names; `from . import x` counts as importing `PACKAGE.x`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path.name == "__init__.py")
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return found


def test_no_library_module_imports_the_command_line():
    """Issue 23 row 3: the library never imports `_cli`, `_interrupt`, `_console` or `__main__`;
    it raises, and the command line prints and exits."""
    package = ROOT / "src" / "port"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module in COMMAND_LINE:
            continue
        offenders += [f"{module} imports {name}" for name in sorted(_imported(path, module) & COMMAND_LINE)]
    assert not offenders, offenders


def test_the_import_check_resolves_relative_imports(tmp_path):
    module = tmp_path / "_check.py"
    module.write_text("from .. import _console\nfrom .._cli import main\nfrom . import _cli\nimport port._interrupt\n")
    found = _imported(module, "port.authoring._check")
    assert {"port._console", "port._cli", "port._interrupt"} <= found and "port.authoring._cli" in found
    module.write_text("from ._console import say\n")
    assert "port._console" in _imported(module, "port._runtime")


def _modules() -> dict[str, Path]:
    """Every module of port by its dotted name (a package by its `__init__.py`)."""
    package = ROOT / "src" / "port"
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _edges(path: Path, module: str, modules: dict[str, Path]) -> dict[str, set[str]]:
    """The port modules `module` imports (at any level of its code), each with the names it takes
    from it: `from .pkg import sub` imports `pkg.sub` when that is a module, else `pkg`."""
    edges: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    edges.setdefault(alias.name, set())
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path.name == "__init__.py")
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    edges.setdefault(f"{source}.{alias.name}", set())
                elif source in modules:
                    edges.setdefault(source, set()).add(alias.name)
    return edges


def test_no_import_circle_and_no_private_name_crossing_modules():
    """Issue 23 rows 1 and 3: port's modules import one another without a circle (a function-level
    import counts: none dodges one), and no module takes a private `_name` from another."""
    modules = _modules()
    graph = {m: _edges(path, m, modules) for m, path in modules.items()}
    private = [
        f"{m} takes {name} from {source}"
        for m, edges in graph.items()
        for source, names in edges.items()
        for name in sorted(names)
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not private, private

    # Tarjan's strongly connected components: a component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n == m or n not in graph:
                continue
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    assert not circles, circles


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's tree has one line for each module of the library's top level and of
    `_sources/`, `_output/`, `_export/`, `_targets/` (and nothing that is not there)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = re.search(r"```\nsrc/port/\n(.*?)```", text, re.S).group(1)
    listed, package = set(), ""
    for line in tree.splitlines():
        name = line.strip().split(" ")[0] if line.strip() else ""
        indent = len(line) - len(line.lstrip())
        if indent == 2 and name.endswith("/"):
            package = name
        elif indent == 2 and name.endswith(".py"):
            package = ""
            listed.add(name)
        elif indent == 4 and name.endswith(".py"):
            listed.add(package + name)
    package = ROOT / "src" / "port"
    present = {p.relative_to(package).as_posix() for p in package.glob("*.py")}
    present |= {
        p.relative_to(package).as_posix()
        for d in ("_sources", "_output", "_export", "_targets")
        for p in (package / d).glob("*.py")
        if p.name != "__init__.py" or d in ("_sources", "_targets")
    }
    assert listed == present, (sorted(present - listed), sorted(listed - present))
