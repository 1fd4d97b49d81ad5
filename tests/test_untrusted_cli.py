"""Untrusted input through the `port` command: names printed literally, sizes refused
before anything proportional to them is built, and every write failure one line that
leaves nothing behind. (Checkpoint files and restore have their own test files.)
"""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import hooked, one_line, port_command, port_env, run_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"


def variant(directory: Path, add=None, config=None) -> Path:
    """The tiny GPT-2 example with tensors added and config values changed."""
    from safetensors.numpy import load_file, save_file

    directory.mkdir(parents=True)
    save_file(load_file(EXAMPLE / "model.safetensors") | (add or {}), directory / "model.safetensors")
    (directory / "config.json").write_text(
        json.dumps(json.loads((EXAMPLE / "config.json").read_text()) | (config or {}))
    )
    return directory


def nothing_left(parent: Path, *allowed: str):
    assert sorted(p.name for p in parent.iterdir()) == sorted(allowed)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["plan", "convert"])
def test_names_are_printed_literally(tmp_path, command):
    hostile = "transformer.h.0.\x1b]0;pwned\x07[link=http://x]y[/]\u202e.weight"
    model = variant(tmp_path / "model", add={hostile: np.zeros((2,), np.float32)})
    extra = ("--out", tmp_path / "out") if command == "convert" else ()
    result = run_port(command, model, *extra)
    line = one_line(result, "model.safetensors")
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr and "\u202e" not in result.stderr
    assert "transformer.h.0.\\x1b]0;pwned\\x07[link=http://x]y[/]\\u202e.weight" in line
    nothing_left(tmp_path, "model")


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, expected",
    [
        ("1000x1000", "more than the 65536 port accepts"),
        ("99999999999999999999", "at most 65536 devices"),
        ("64x64", "port simulates at most 512 CPU devices"),
    ],
)
def test_huge_meshes_are_refused_at_once(tmp_path, mesh, expected):
    began = time.perf_counter()
    one_line(run_port("convert", EXAMPLE, "--mesh", mesh, "--out", tmp_path / "out"), expected)
    assert time.perf_counter() - began < 30
    nothing_left(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layers", [10**9, 10**7])
def test_a_config_claiming_huge_sizes_is_refused_before_building(tmp_path, layers):
    model = variant(tmp_path / "model", config={"n_layer": layers})
    began = time.perf_counter()
    one_line(run_port("plan", model), "'n_layer' must be a positive integer up to 10000", str(layers))
    assert time.perf_counter() - began < 30


@pytest.mark.slow
def test_a_full_file_system_is_refused_before_reading(tmp_path):
    out = tmp_path / "full" / "out"
    out.parent.mkdir()
    script = f"mount -t tmpfs -o size=100k none {out.parent} && exec {' '.join(port_command())} convert {EXAMPLE} --out {out}"
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=port_env())
    if "mount:" in result.stderr or "unshare:" in result.stderr:
        pytest.skip(f"no private mount namespace here: {result.stderr.strip()}")
    one_line(result, "--out", "needs 678.1 KB, only", "free on its file system")


@pytest.mark.slow
def test_a_read_only_parent_is_refused_before_reading(tmp_path):
    out = tmp_path / "ro" / "out"
    out.parent.mkdir()
    script = (
        f"mount -t tmpfs -o ro,size=1m none {out.parent} && exec {' '.join(port_command())} convert {EXAMPLE} "
        f"--out {out}"
    )
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=port_env())
    if "mount:" in result.stderr or "unshare:" in result.stderr:
        pytest.skip(f"no private mount namespace here: {result.stderr.strip()}")
    one_line(result, "--out", "cannot write in", "read-only or not permitted")


@pytest.mark.slow
def test_a_failing_write_is_one_line_and_leaves_nothing(tmp_path):
    """Files past 20 KB cannot be written (`ulimit -f`, RLIMIT_FSIZE): a chunk fails mid-write, in a writing thread."""

    def convert(env=None):  # the limit set by a shell, not preexec_fn: no fork of this multithreaded process
        return subprocess.run(
            [
                "sh",
                "-c",
                'ulimit -f 40 && exec "$@"',
                "sh",
                *port_command(),
                "convert",
                str(EXAMPLE),
                "--mesh",
                "2x2",
                "--out",
                str(tmp_path / "out"),
            ],
            capture_output=True,
            text=True,
            env=port_env(env),
            timeout=120,
        )

    one_line(convert(), "--out", "writing the checkpoint failed: File too large (params/wte/0.0)")
    nothing_left(tmp_path)


@pytest.mark.slow
def test_two_runs_to_one_output_one_wins(tmp_path):
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        runs = [
            subprocess.Popen(
                [*port_command(), "convert", EXAMPLE, "--mesh", "2x2", "--out", out],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=port_env(),
            )
            for _ in range(2)
        ]
        results = [(run.wait(timeout=120), run.stderr.read()) for run in runs]
        codes = sorted(code for code, _ in results)
        assert codes == [0, 1], results
        (loser,) = [err for code, err in results if code == 1]
        last = loser.strip().splitlines()[-1]
        assert last.startswith("port: error: --out") and (
            "already exists" in last or "another run wrote it meanwhile" in last
        ), loser
        assert sorted(p.name for p in out.iterdir()) == ["_CHECKPOINT_METADATA", "commit_success.txt", "params", "port"]
    nothing_left(tmp_path, "out0", "out1", "out2")


@pytest.mark.slow
def test_a_report_that_is_a_directory_is_refused_before_reading(tmp_path):
    (tmp_path / "run.json").mkdir()
    one_line(
        run_port("convert", EXAMPLE, "--out", tmp_path / "out", "--report", tmp_path / "run.json"),
        "--report",
        "not a regular file",
    )
    nothing_left(tmp_path, "run.json")
    assert list((tmp_path / "run.json").iterdir()) == []


@pytest.mark.slow
def test_a_report_at_the_outputs_path_is_refused_before_reading(tmp_path):
    out = tmp_path / "out"
    one_line(
        run_port("convert", EXAMPLE, "--out", out, "--report", out),
        "--report",
        "the same path as --out; give the run summary a file of its own",
    )
    nothing_left(tmp_path)


def test_a_report_that_cannot_be_written_says_the_output_is_complete(tmp_path, monkeypatch, capfd):
    """The disk fills while the summary is written: one line, status 1, and the output (written
    and made final before the summary) is said to be complete, as it is."""
    import errno

    import port._cli as cli
    import port._commands as commands

    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(commands, "_write_file", full)
    code = cli.run(["convert", str(EXAMPLE), "--out", str(tmp_path / "out"), "--report", str(tmp_path / "r.json")])
    err = capfd.readouterr().err
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        f"port: error: --report {tmp_path / 'r.json'}: could not write the run summary (No space left on device); "
        f"the output {tmp_path / 'out'} is complete"
    ), err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "params",
        "port",
    ]


def test_many_ignored_tensors_convert_to_an_output_that_reads_back(tmp_path, monkeypatch):
    """Issue 21, row 9: 1.35M ignored zero-size tensors made port/metadata 78.8 MB, over the 32 MB
    restore reads, so port refused the output it had just written. An output records only the
    tensors `port export` writes back: here the metadata stays far under a bound 7x smaller than
    the ignored names alone would take, and restore and export read it back."""
    from safetensors.numpy import load_file

    import port
    import port._output._read
    import port._output._save

    model = variant(
        tmp_path / "model",
        add={
            f"transformer.h.{i}.attn.bias": np.zeros((0,), np.float32)
            for i in range(2, 20_002)  # ignored by the mapping
        },
    )
    limit = 200_000  # the names of the ignored tensors alone take over 1.3 MB
    monkeypatch.setattr(port._output._save, "MAX_METADATA_BYTES", limit)  # one bound, the writer's and the reader's
    monkeypatch.setattr(port._output._read, "MAX_METADATA_BYTES", limit)
    out = tmp_path / "out"
    port.convert(model, mesh="1x1", out=out)
    assert (out / "port" / "metadata").stat().st_size < limit
    original = load_file(EXAMPLE / "model.safetensors")
    assert sorted(json.loads((out / "port" / "metadata").read_text())["sources"]) == sorted(original)
    port.export(port.restore(out, "2x2"), tmp_path / "hf", out)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for key, array in original.items():
        np.testing.assert_array_equal(exported[key], array, err_msg=key)


@pytest.mark.parametrize(
    "bound, value, expected",
    [
        (
            "MAX_METADATA_BYTES",
            4000,
            (
                r"port/metadata would be \d+ bytes \([\d.]+ KB\), more than restore reads back "
                r"\(4000 at most; its 'mapping' takes [\d.]+ KB\); the output is not written"
            ),
        ),
        (
            "MAX_SOURCES",
            10,
            (
                r"port/metadata would record 28 source tensors, more than restore reads back "
                r"\(10 at most\); the output is not written"
            ),
        ),
    ],
    ids=["bytes", "sources"],
)
def test_metadata_restore_would_refuse_is_never_written(tmp_path, monkeypatch, bound, value, expected):
    """The writer checks the metadata against the bounds restore reads it under before writing it:
    one line saying how large and what is large, and nothing left (no output, no hidden partial)."""
    import re

    import port
    import port._output._save

    monkeypatch.setattr(port._output._save, bound, value)
    out = tmp_path / "out"
    with pytest.raises(port.OutputError) as caught:
        port.convert(EXAMPLE, mesh="2x2", out=out)
    assert re.fullmatch(f"out={re.escape(str(out))}: {expected}", str(caught.value)), str(caught.value)
    nothing_left(tmp_path)


# ---------------------------------------------------------------- long input in error lines (issue 21, row 18)


@pytest.mark.slow
def test_a_100_kb_tensor_name_is_shortened_in_the_error_line(tmp_path):
    name = "transformer.h.0." + "x" * 100_000 + ".weight"
    model = variant(tmp_path / "model", add={name: np.zeros((2,), np.float32)})
    line = one_line(
        run_port("plan", model),
        "port: error: model.safetensors: tensor 'transformer.h.0.xxx",
        "'... is not used by the mapping",
        "(map it, or add it to ignore)",
    )
    assert len(line) < 1000, len(line)


@pytest.mark.slow
@pytest.mark.parametrize(
    "include, expected",
    [
        ("x" * 5000, "port: error: include 'xxx"),
        ("," * 5000, "port: error: --include ',,,"),
    ],
)
def test_a_5000_character_include_is_shortened_in_the_error_line(tmp_path, include, expected):
    line = one_line(run_port("convert", EXAMPLE, "--out", tmp_path / "out", "--include", include), expected)
    assert len(line) < 1000, len(line)
    nothing_left(tmp_path)


def test_no_line_port_says_is_longer_than_its_bound(monkeypatch, capfd):
    """Whatever a message quotes unshortened, the line keeps its beginning and end, and says how much was cut."""
    import port._console as console
    from port._text import MAX_LINE

    monkeypatch.setattr(console, "failed", False)
    console.say("error: x.bin: " + "\x1b" * 100_000 + " is wrong")
    line = capfd.readouterr().err
    assert line.endswith("\n") and "\n" not in line[:-1] and "\x1b" not in line
    assert len(line[:-1]) <= MAX_LINE
    assert line.startswith("port: error: x.bin: \\x1b\\x1b") and line.endswith("\\x1b\\x1b is wrong\n")
    whole = len("port: error: x.bin: ") + 4 * 100_000 + len(" is wrong")  # each \x1b written as its 4-character escape
    head, cut, tail = re.fullmatch(r"(.*) \.\.\. \((\d+) characters cut\) \.\.\. (.*)\n", line).groups()
    assert len(head) + int(cut) + len(tail) == whole
    assert console.shortened("short") == "short"
    assert console.shortened("a" * 50 + "b" * 50, 60) == "a" * 15 + " ... (70 characters cut) ... " + "b" * 15


FULL_DISK = """
import errno, os
_replace = os.replace
def replace(src, dst, *args, **kwargs):  # the disk is full when the run summary is put in place
    if str(dst).endswith("r.json"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _replace(src, dst, *args, **kwargs)
os.replace = replace
"""


@pytest.mark.slow
def test_a_report_the_disk_cannot_take_is_one_line_through_the_command(tmp_path):
    """The same, through the installed `port` (exit 1, one line, the output complete, no partial summary)."""
    work = tmp_path / "work"
    work.mkdir()
    out, report = work / "out", work / "r.json"
    result = run_port("convert", EXAMPLE, "--out", out, "--report", report, env=hooked(tmp_path / "hook", FULL_DISK))
    one_line(
        result,
        f"--report {report}: could not write the run summary (No space left on device); the output {out} is complete",
    )
    nothing_left(work, "out")
    assert sorted(p.name for p in out.iterdir()) == ["_CHECKPOINT_METADATA", "commit_success.txt", "params", "port"]


SMALL_HOST = """
import builtins, io
_open = builtins.open
def small(file, *args, **kwargs):  # a host with 1 KB of memory available
    return io.StringIO("MemAvailable:       1 kB\\n") if file == "/proc/meminfo" else _open(file, *args, **kwargs)
builtins.open = small
"""


@pytest.mark.slow
def test_a_mesh_that_outgrows_host_memory_is_one_line_through_the_command(tmp_path):
    result = run_port(
        "convert", EXAMPLE, "--mesh", "4x2", "--out", tmp_path / "out", env=hooked(tmp_path / "hook", SMALL_HOST)
    )
    line = one_line(
        result,
        "--mesh data=4,model=2: its blocks take ",
        "(8 CPU devices x ",
        "more than the 1.0 KB available; use fewer devices, or shard what is replicated",
    )
    assert "converted" not in result.stderr, line
    nothing_left(tmp_path, "hook")
