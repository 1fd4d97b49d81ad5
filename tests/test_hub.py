"""A Hugging Face repo id resolves through the hub cache, offline."""

import shutil
from pathlib import Path

import pytest

import port

from helpers import run_port

EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny-gpt2"


pytestmark = pytest.mark.slow  # every test runs `port convert` in a subprocess


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
    out = tmp_path / "out"
    result = run_port("convert", "someone/tiny-gpt2", "--mesh", "2x2", "--out", out, env={"HF_HUB_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    assert "converted someone/tiny-gpt2" in result.stderr
    model = port.restore(out, port.make_mesh("1x1"))
    assert model.wte.shape == (1021, 64)


def test_a_cached_repo_with_only_pytorch_weights_converts_offline(tmp_path):
    """A Hub repo that ships only `pytorch_model.bin` (read in place, as a local `.bin` is)."""
    import torch
    from safetensors.numpy import load_file

    cache = cache_with(tmp_path, "someone/tiny-gpt2-bin")
    snapshot = next((cache / "models--someone--tiny-gpt2-bin" / "snapshots").iterdir())
    tensors = load_file(snapshot / "model.safetensors")
    (snapshot / "model.safetensors").unlink()
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, snapshot / "pytorch_model.bin")
    out = tmp_path / "out"
    result = run_port(
        "convert",
        "someone/tiny-gpt2-bin",
        "--mesh",
        "2x2",
        "--out",
        out,
        env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    model = port.restore(out, port.make_mesh("1x1"))
    assert (model.wte == tensors["transformer.wte.weight"]).all()
