"""Paths port cannot use, refused while the command line is parsed: one `port: error:` line
naming the flag or argument and what is wrong, exit 1, before any work (no worker started,
so neither JAX nor NumPy imported) and nothing written.

A path is given as bytes, as a shell passes it: one that is not UTF-8 reaches Python as lone
surrogates (`os.fsdecode`), which port's JSON records (metadata, reports) cannot hold.
"""

import os
import subprocess
from pathlib import Path

import pytest

from helpers import one_line, port_command, port_env

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = os.fsencode(REPO / "examples" / "tiny-gpt2")
LONG = b"a" * 256  # one name over NAME_MAX (255 bytes)


def run_bytes(*args: bytes, cwd: Path, env=None) -> subprocess.CompletedProcess:
    """`port ARGS` with each argument given as bytes (not necessarily UTF-8), from `cwd`."""
    return subprocess.run(
        [*map(os.fsencode, port_command()), *args],
        capture_output=True,
        text=True,
        errors="backslashreplace",
        env=port_env(env),
        cwd=cwd,
        timeout=120,
    )


CASES = [
    ([b"convert", EXAMPLE, b"--out", b"o\xff"], "--out o\\udcff: not UTF-8 (byte 0xff); port records paths as JSON"),
    ([b"convert", EXAMPLE, b"--out", LONG], f"--out {'a' * 40}"),
    ([b"convert", EXAMPLE, b"--out", b"b" * 230], "is 230 bytes, port writes it under a hidden name 37 bytes longer"),
    ([b"convert", b"m\xff", b"--out", b"o"], "MODEL m\\udcff: not UTF-8 (byte 0xff)"),
    ([b"convert", b"ckpt/" + LONG, b"--out", b"o"], "is 256 bytes, more than the 255 a name may have"),
    ([b"convert", b"https://me:secret@host/m\xff", b"--out", b"o"], "MODEL: not UTF-8 (byte 0xff)"),
    ([b"convert", EXAMPLE, b"--out", b"o", b"--report", b"r\xff.json"], "--report r\\udcff.json: not UTF-8"),
    ([b"convert", EXAMPLE, b"--out", b"o", b"--mapping", LONG], f"--mapping {'a' * 40}"),
    ([b"export", b"d\xff", b"--out", b"o"], "DIR d\\udcff: not UTF-8"),
    ([b"export", b"d", b"--out", LONG], "is 256 bytes"),
    ([b"info", LONG], f"DIR {'a' * 40}"),
    ([b"plan", b"x/" * 2100], "bytes as an absolute path, more than the 4095 a path may have"),
    ([b"check", b"m\xff.toml", b"gpt2"], "MAPPING m\\udcff.toml: not UTF-8"),
    ([b"check", b"m.toml", LONG], f"MODEL {'a' * 40}"),
    ([b"scaffold", b"gpt2", b"--module", b"a:B", b"--out", b"d\xff.toml"], "--out d\\udcff.toml: not UTF-8"),
    ([b"verify", b"\xfe"], "MODEL \\udcfe: not UTF-8 (byte 0xfe)"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "expected"), CASES, ids=[" ".join(map(ascii, c[0][:1])) for c in CASES])
def test_an_unusable_path_is_refused_while_parsing(tmp_path, args, expected):
    result = run_bytes(*args, cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    imported = [line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    said = "".join(line + "\n" for line in result.stderr.splitlines() if not line.startswith("import time:"))
    line = one_line(subprocess.CompletedProcess(result.args, result.returncode, result.stdout, said), expected)
    assert "secret" not in line
    assert imported.count("port._cli") == 1 and "numpy" not in imported and "jax" not in imported, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_usable_path_near_the_limits_is_taken(tmp_path):
    """A written name of exactly the most port can write beside (218 bytes), and a UTF-8 name
    of non-ASCII characters, convert as any other."""
    out = tmp_path / ("é" * 109)  # 218 bytes
    result = run_bytes(b"convert", EXAMPLE, b"--out", os.fsencode(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (out / "port" / "metadata").is_file()


def test_path_problem_and_the_library_refusal(tmp_path):
    """`path_problem`'s rules (a lone surrogate given as such, too), and `check_out` (what
    `port.convert(out=...)` calls) refusing in the library's words."""
    from port import PortError
    from port._output import check_out
    from port._paths import path_problem

    assert path_problem("ckpt/gpt2") is None and path_problem("a" * 255) is None
    assert path_problem("\ud800x") == (
        "not UTF-8 (lone surrogate \\ud800); port records paths as JSON text: give a name that is UTF-8"
    )
    assert path_problem("s3://bucket/" + "a" * 300, local=False) is None
    assert path_problem("a" * 219, written=True).startswith("its name 'aaaa")
    assert path_problem("a" * 218, written=True) is None and path_problem("a" * 219) is None
    with pytest.raises(PortError, match=r"^out=.*: not UTF-8 \(byte 0xff\)"):
        check_out(tmp_path / "o\udcff")
    assert list(tmp_path.iterdir()) == []
