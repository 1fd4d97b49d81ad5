"""`python -m port` and the `port` script run nothing from the working directory.

`python -m` puts the working directory first on `sys.path`; `port.__main__` takes it
off before its first import, and the worker runs with `-P`. Modules named like the ones
port imports (`signal`, `json`, `typer`, ...) lying in the working directory say when
they are run; neither command may run one, and both work as usual.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import port_command, port_env

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"
SHADOWS = ("signal", "json", "typer", "click", "subprocess", "select", "shutil")


@pytest.mark.slow
@pytest.mark.parametrize("command", [[sys.executable, "-m", "port"], port_command()], ids=["python-m", "script"])
def test_nothing_in_the_working_directory_is_imported(tmp_path, command):
    """Issue 32 row 10: a `typer.py` (or `signal.py`, `json.py`, ...) in the working directory is never run."""
    here = tmp_path / "here"
    here.mkdir()
    for name in SHADOWS:
        (here / f"{name}.py").write_text("from pathlib import Path\nPath(__file__).with_suffix('.ran').touch()\n")

    def run(*args):
        return subprocess.run(
            [*command, *map(str, args)], capture_output=True, text=True, env=port_env(), cwd=here, timeout=300
        )

    shown = run("--help")
    assert shown.returncode == 0 and "Usage: port" in shown.stdout, shown.stderr
    done = run("convert", EXAMPLE, "--out", tmp_path / "out")
    assert done.returncode == 0 and "port: converted" in done.stderr, done.stderr
    assert (tmp_path / "out" / "port" / "metadata").is_file()
    assert sorted(p.name for p in here.glob("*.ran")) == []
