"""Fixtures: eight simulated CPU devices, and GPT-2 checkpoints written by `transformers`.

Every layer and model runs with its jaxtyping annotations checked (beartype), as
Equinox's own tests do: the import hook is installed before anything imports `port.nn`
or `port.models`, so a shape or dtype that disagrees with an annotation fails the test
(checked while tracing, so a jitted function pays once per compile).

Helpers that are not fixtures live in `helpers.py` (`from helpers import ...`).
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import beartype  # noqa: E402, F401  (the checker the hook names)
import jaxtyping  # noqa: E402

jaxtyping.install_import_hook(["port.nn", "port.models"], "beartype.beartype")

import threading  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import port._place  # noqa: E402
import port._sources._local  # noqa: E402

from helpers import read_offsets, tiny_gpt2, torch_gpt2, torch_logits  # noqa: E402

# The family matrices: a model family's parity with transformers (each file one family, or every
# family's contract). `-m "not families"` leaves them out: `.ci/run` does on the oldest stack,
# where the converter, the layers and their errors are what a JAX release can break.
FAMILY_FILES = {
    "test_decoders.py",
    "test_encoders.py",
    "test_lora_training.py",
    *(
        f"test_{name}.py"
        for name in (
            "bert clip deepseek_v3 deepseek_v32 deepseek_v4 dinov2 distilbert gemma gemma3 gemma4 glm4_moe gpt2 gpt_neox "
            "gpt_oss llama llama4 minimax_m2 ministral3 mistral_large4 modernbert moe olmo_smollm3 phi3 qwen3 "
            "qwen3_next roberta siglip t5 vit whisper"
        ).split()
    ),
}


def pytest_collection_modifyitems(config, items):
    """Mark every test of `FAMILY_FILES` `families`."""
    for item in items:
        if item.path.name in FAMILY_FILES:
            item.add_marker(pytest.mark.families)


@pytest.fixture(scope="session")
def gpt2_checkpoints(tmp_path_factory):
    """Three layouts of one GPT-2, and its PyTorch logits; skips without PyTorch.

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


@pytest.fixture
def tiny(tmp_path):
    """make(drop=(), add=None, config=None): the tiny GPT-2 of `examples/tiny-gpt2` written afresh
    at tmp_path/model, changed as asked (`helpers.tiny_gpt2`); returns its directory."""
    return lambda **changes: tiny_gpt2(tmp_path / "model", **changes)


# Each executable XLA compiles for the CPU keeps a few memory maps while JAX's caches hold it
# (~6 a small function, ~370 a decoder's train step), and Linux allows 65,530 maps a process
# (`vm.max_map_count`): past that, the next compile fails to map its code and the worker dies
# with SIGSEGV inside `backend_compile`. A worker that runs test_decoders.py passes 50,000.
# When a test leaves more than MAX_MAPS maps, JAX's caches are dropped (the next test that
# needs a function compiles it again).
MAX_MAPS = 20_000


def _maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _bounded_compiled_code():
    yield
    if _maps() > MAX_MAPS:
        import gc

        jax.clear_caches()
        gc.collect()


def record_key_reads(monkeypatch, each):
    """Call `each(parts, file offsets, destination addresses)` (under a lock) for every `read_key`
    of a placement: one source key's parts, and where each byte it read came from and went."""
    lock, local = threading.Lock(), threading.local()
    real_read_key, real_preadv = port._place.read_key, port._sources._local._preadv

    def preadv(fd, iov, offset):
        rows = np.array(iov, copy=True)
        got = real_preadv(fd, iov, offset)
        local.calls.append((offset, rows, got))
        return got

    def read_key(checkpoint, parts):
        local.calls = []
        real_read_key(checkpoint, parts)
        files, addresses = read_offsets(local.calls)
        with lock:
            each(parts, files, addresses)

    monkeypatch.setattr(port._place, "read_key", read_key)
    monkeypatch.setattr(port._sources._local, "_preadv", preadv)


@pytest.fixture
def key_reads(monkeypatch):
    """Every read of one source key while placing: (its parts, the file offsets of each byte it read).

    The `reads` fixture attributes bytes to the blocks they land in; a transposed kernel is
    read into a staging buffer first, so here the bytes are taken per read of a key, whose
    parts (one a distinct block) say which regions it had to read."""
    found = []
    record_key_reads(monkeypatch, lambda parts, files, _: found.append((parts, files)))
    return found


@pytest.fixture
def reads(monkeypatch):
    """Every byte read while placing, attributed to the block it landed in.

    Returns a function of the finished run giving (leaf, box, file offsets of its bytes)
    per block, and the file offsets of the bytes that landed in no block (read into a
    staging buffer). Reads are attributed by destination address within each
    `read_key` call, while its buffers are alive (later ones may reuse the memory).
    """
    blocks, landed, lock = [], [], threading.Lock()
    real_plan_reads = port._place.plan_reads

    def plan_reads(wanted):
        planned, parts = real_plan_reads(wanted)
        with lock:
            for (leaf, _), leaf_blocks in zip(wanted, planned):
                blocks.extend((leaf, box, out) for box, out in leaf_blocks.items())
        return planned, parts

    def each(parts, files, addresses):
        staged = np.ones(len(files), bool)
        for part in parts:
            start = part.target.ctypes.data
            inside = (addresses >= start) & (addresses < start + part.target.nbytes)
            landed.append((start, files[inside]))
            staged &= ~inside
        landed.append((None, files[staged]))

    monkeypatch.setattr(port._place, "plan_reads", plan_reads)
    record_key_reads(monkeypatch, each)

    def attribute():
        per_block = {id(out): (leaf, box, []) for leaf, box, out in blocks}
        elsewhere = []
        for start, files in landed:
            inside = [
                out for _, _, out in blocks if start is not None and 0 <= start - out.ctypes.data < max(out.nbytes, 1)
            ]
            (per_block[id(inside[0])][2] if inside else elsewhere).append(files)
        result = [(leaf, box, np.concatenate(f) if f else np.zeros(0, np.int64)) for leaf, box, f in per_block.values()]
        return result, np.concatenate(elsewhere) if elsewhere else np.zeros(0, np.int64)

    return attribute
