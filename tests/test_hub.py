"""A Hugging Face repo id resolves through the hub cache, offline."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import port

EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny-gpt2"


def cache_with(tmp_path: Path, repo: str) -> Path:
    """A Hugging Face hub cache holding `repo` at revision main, as huggingface_hub lays it out."""
    cache = tmp_path / "hub"
    entry = cache / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / ("0" * 40)
    shutil.copytree(EXAMPLE, snapshot)
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text("0" * 40)
    return cache


def test_cached_repo_id_converts_offline(tmp_path):
    cache = cache_with(tmp_path, "someone/tiny-gpt2")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env |= {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "port", "convert", "someone/tiny-gpt2", "--mesh", "2x2", "--out", str(out)],
        capture_output=True, text=True, env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "converted someone/tiny-gpt2" in result.stderr
    model = port.restore(out, port.make_mesh("1x1"))
    assert model.wte.shape == (1021, 64)
