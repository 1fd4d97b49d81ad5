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
        generated = {"torch_tinylm"}  # a module test_walkthrough.py writes, as a user would
        local = {path.stem for path in (ROOT / "tests").glob("*.py")} | {"make_gpt2"} | generated
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
