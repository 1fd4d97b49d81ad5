"""Eight simulated CPU devices, and GPT-2 checkpoints written by `transformers`."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

VOCAB = 101  # not divisible by the model axis: exercises replication


def gpt2_config(**overrides):
    from transformers import GPT2Config

    # Large init so a wrong epsilon, GELU or layout shows far above the tolerance.
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0, initializer_range=0.2, **overrides,
    )
    config._attn_implementation = "eager"
    return config


def torch_gpt2(seed=0, **overrides):
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(gpt2_config(**overrides)).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


INPUT_IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 16))


def torch_logits(model, ids=INPUT_IDS):
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.fixture(scope="session")
def gpt2_checkpoints(tmp_path_factory):
    """Three layouts of one GPT-2, and its PyTorch logits.

    - `lm`: GPT2LMHeadModel.save_pretrained (keys with `transformer.`, no lm_head: tied)
    - `base`: GPT2Model.save_pretrained (no prefix)
    - `sharded`: GPT2LMHeadModel saved in many files with an index
    """
    model = torch_gpt2()
    root = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(root / "lm")
    model.transformer.save_pretrained(root / "base")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert (root / "sharded" / "model.safetensors.index.json").exists()
    return {name: root / name for name in ("lm", "base", "sharded")}, torch_logits(model)


def write_checkpoint(directory: Path, tensors: dict, config: dict) -> Path:
    """A safetensors checkpoint of NumPy arrays, for hand-made (and broken) inputs."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "model.safetensors")
    return directory


def port_command() -> list[str]:
    """The installed `port` console script (the real entry point, `main()`), or `python -m port`."""
    script = Path(sys.executable).parent / "port"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "port"]


def port_env(env=None) -> dict:
    """The environment of a `port` subprocess: no device settings inherited from this one, offline, CPU."""
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "PORT_DEBUG")}
    return base | {"HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"} | (env or {})


def run_port(*args, env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """`port ARGS` in a subprocess, as a user runs it; the result has returncode, stdout, stderr."""
    return subprocess.run(
        [*port_command(), *map(str, args)],
        capture_output=True, text=True, env=port_env(env), cwd=cwd, timeout=timeout,
    )


def cli(*args):
    """`port ARGS` in a subprocess; returns (exit status, stdout + stderr)."""
    result = run_port(*args)
    return result.returncode, result.stdout + result.stderr


@contextlib.contextmanager
def recorded_reads():
    """Every positioned read of tensor bytes made within the block, as (file offset, iovec, bytes read).

    `port._source._preadv` is the one place tensor bytes come from a file: each call
    reads the file from its offset on, end to end, into the buffers its iovec rows
    (address, length) name. `read_offsets` turns the records into bytes.
    """
    import port._source

    calls, real = [], port._source._preadv

    def preadv(fd, iov, offset):
        rows = np.array(iov, copy=True)
        got = real(fd, iov, offset)
        calls.append((offset, rows, got))
        return got

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(port._source, "_preadv", preadv)
        yield calls


def read_offsets(calls) -> tuple[np.ndarray, np.ndarray]:
    """The file offset and the destination address of every byte the recorded reads read.

    The proof that a read touches only its region, and where each byte went.
    """
    files, addresses = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for offset, rows, got in calls:
        position = offset
        for address, length in rows.astype(np.int64).tolist():
            length = min(length, offset + got - position)
            if length <= 0:
                break
            files.append(np.arange(position, position + length, dtype=np.int64))
            addresses.append(np.arange(address, address + length, dtype=np.int64))
            position += length
    return np.concatenate(files), np.concatenate(addresses)
