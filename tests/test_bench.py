"""Every script in `bench/` runs, in its smallest form, so that none rots unseen (issue 22).

A smoke run proves a benchmark still measures something (a table row, no failed cell),
never how fast: timings belong to the benchmarks themselves and `docs/`.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import port_env

BENCH = Path(__file__).resolve().parents[1] / "bench"

SMOKE = {
    "bench.py": [
        "--sizes",
        "tiny",
        "--dtypes",
        "float32",
        "--repeats",
        "1",
        "--mesh",
        "2x2",
        "--methods",
        "port,port-convert,port-restore,recipe,floor-per-tensor,floor-restore,read+put,put",
        "--workdir",
        "{tmp}",
    ],
    "host.py": [
        "--checkpoints",
        "llama-tiny",
        "--rounds",
        "1",
        "--mesh",
        "2x2",
        "--methods",
        "port,orbax,recipe,read+put,floor,floor-threads,h2d",
        "--workdir",
        "{tmp}",
    ],
    "export.py": ["--sizes", "tiny", "--dtypes", "float32", "--repeats", "1", "--mesh", "2x2", "--workdir", "{tmp}"],
    "train.py": ["--models", "gpt2", "--remat", "off", "--layers", "1", "--batch", "1", "--seq", "16", "--steps", "1"],
    "decode.py": [
        "--models",
        "gpt2",
        "--batches",
        "1",
        "--prompt",
        "4",
        "--new",
        "2",
        "--repeats",
        "1",
        "--layers",
        "1",
    ],
    "moe.py": ["--tokens", "64", "--hidden", "32", "--inner", "16", "--experts", "4", "--repeats", "1"],
    "parity.py": ["--cases", "gpt2", "--meshes", "1x1,2x2"],
    "plan.py": ["--quick"],
    "sampling.py": ["--batch", "4", "--vocab", "64"],
    "scratch.py": ["--models", "llama", "--steps", "2"],
    "quantized.py": ["--formats", "fp8", "--size", "tiny", "--repeats", "1", "--workdir", "{tmp}"],
    "cold.py": ["--sizes", "tiny", "--repeats", "1", "--warm", "--workdir", "{tmp}"],
    "targets.py": ["--size", "tiny", "--repeats", "1", "--workdir", "{tmp}"],
    "lora.py": [
        "--size",
        "tiny",
        "--repeats",
        "1",
        "--mesh",
        "2x2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "1",
        "--workdir",
        "{tmp}",
    ],
}


def test_every_script_has_a_smoke_run():
    makers = {"make_gpt2.py", "make_bert.py", "make_llama.py"}  # run inside the others' smoke runs (remote.py's below)
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")} - makers - {"remote.py"}
    assert scripts == set(SMOKE)


def run(script: str, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=port_env(env),
        cwd=BENCH,
    )


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_a_benchmark_runs_in_its_smoke_form(script, tmp_path):
    result = run(script, *(a.replace("{tmp}", str(tmp_path)) for a in SMOKE[script]))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 2, output[-3000:]  # a header and at least one measured row
    assert "Traceback" not in output and "failed" not in result.stdout.lower(), output[-3000:]


@pytest.mark.slow
def test_the_remote_benchmark_needs_nginx_and_says_so(tmp_path):
    """With nginx (and curl) it measures every layout (one file, 4 files, BERT's many small tensors,
    the Hub's URLs); without, one line and exit 2: no stand-in server."""
    result = run(
        "remote.py",
        "--checkpoints",
        "gpt2-tiny,gpt2-tiny-x4,bert-tiny",
        "--hub",
        "--repeats",
        "1",
        "--workdir",
        tmp_path,
    )
    if shutil.which("nginx") and shutil.which("curl"):
        assert result.returncode == 0, result.stderr[-3000:]
        for row in ["| GPT-2 tiny |", "| GPT-2 tiny, 4 files |", "| BERT tiny |", "| GPT-2 tiny, hf:// |"]:
            assert row in result.stdout, result.stdout
        assert "failed" not in result.stdout
    else:
        assert result.returncode == 2 and "needs nginx and curl" in result.stderr
