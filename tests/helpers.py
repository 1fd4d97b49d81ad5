"""What the tests share that is not a fixture: checkpoint makers, the `port` subprocess, read recording.

Imported as `from helpers import ...`: `tests/` is on `sys.path` because
`conftest.py` lives there (pytest's default rootdir-based import mode).
"""

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

VOCAB = 101  # not divisible by the model axis: exercises replication

INPUT_IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 16))

# Each family's small config, as `config.json` holds it; the `transformers` builders
# below start from the same numbers. Large init (std 0.2, not 0.02) and perturbed norms
# and biases so that a wrong epsilon, activation or layout shows far above the tolerance.
GPT2_CONFIG = dict(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4)
LLAMA_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=None,
)
BERT_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=32,
)


def transformers_or_skip():
    """`transformers` with PyTorch, or skip the calling test (a test, fixture or module)."""
    pytest.importorskip("torch", exc_type=ImportError)  # absent, or present but broken
    return pytest.importorskip("transformers", exc_type=ImportError)


def expert_mapping(path):
    """The shipped mapping at `path` with the experts on an `expert` mesh axis."""
    import dataclasses

    import port

    shipped = port.load_mapping(path)
    return dataclasses.replace(shipped, rules={**shipped.rules, "experts": ("expert",)})


def error_of(ours, expected) -> float:
    """The largest |ours - expected|, in float32."""
    return float(np.abs(np.asarray(ours).astype(np.float32) - expected).max())


def perturbed(model, names, scale):
    """`model` in eval mode, with `scale`-sized noise added to the parameters `names` picks."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if names(name):
                param.add_(scale * torch.randn_like(param))
    return model.eval()


def gpt2_config(**overrides):
    """The small `transformers.GPT2Config`, eager attention; skips without PyTorch."""
    transformers = transformers_or_skip()
    config = transformers.GPT2Config(
        **GPT2_CONFIG,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=0.2,
        **overrides,
    )
    config._attn_implementation = "eager"
    return config


def torch_gpt2(seed=0, **overrides):
    """A seeded `GPT2LMHeadModel` with non-trivial norms and biases; skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(gpt2_config(**overrides))
    return perturbed(model, lambda name: name.endswith("bias") or ".ln_" in name, 0.1)


def torch_llama(arch="Llama", dtype=None, **overrides):
    """A seeded `{arch}ForCausalLM` (Llama, Mistral, Qwen2) of the small config; skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(**{**LLAMA_CONFIG, **overrides})
    config._attn_implementation = "eager"
    model = getattr(transformers, f"{arch}ForCausalLM")(config)
    model = perturbed(model, lambda name: name.endswith("bias") or "norm" in name, 0.2)
    return model if dtype is None else model.to(getattr(torch, dtype))


def torch_bert(pooler=True, **overrides):
    """A seeded `BertModel` of the small config (with or without its pooler); skips without PyTorch."""
    transformers = transformers_or_skip()
    import torch

    config = transformers.BertConfig(**BERT_CONFIG, initializer_range=0.2, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=pooler)
    return perturbed(model, lambda name: "LayerNorm" in name or name.endswith("bias"), 0.3)


def torch_logits(model, ids=INPUT_IDS):
    """The PyTorch model's logits for `ids`, as float32 NumPy."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@eqx.filter_jit
def logits(model, ids):
    """`model(ids)` compiled by `eqx.filter_jit`: a port model's logits for the token ids `ids`.

    `np.asarray(logits(port.load(directory), INPUT_IDS))` is what `torch_logits` gives for the
    PyTorch model saved at `directory`.
    """
    return model(ids)


class Saved(NamedTuple):
    """A PyTorch model written by `save_pretrained`, and its logits (float32 NumPy)."""

    directory: Path
    model: Any
    logits: np.ndarray


def equations(jaxpr):
    """Every equation of `jaxpr`, those of the jaxprs nested in it (scans, custom rules) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def loaded_once(checkpoints):
    """get(name, mesh): `port.load` of `checkpoints(name)` (a `saved_once` getter) on the mesh, one load each."""
    import port

    made = {}

    def get(name, mesh):
        if (name, mesh) not in made:
            made[name, mesh] = port.load(checkpoints(name).directory, mesh=mesh)
        return made[name, mesh]

    return get


def saved_once(tmp_path_factory, build, ids=INPUT_IDS, written=None):
    """get(name): a `Saved` of the PyTorch model `build(name)`, made on the first call for each name.

    The model is written by `save_pretrained` into a fresh directory; its logits are for `ids`
    (an array, or a function of the name giving one). `written(name, directory)`, if given, runs
    once the directory is written (to change what `save_pretrained` wrote). For a module's lazy
    fixture, each case built only if a test asks for it:

        @pytest.fixture(scope="module")
        def checkpoints(tmp_path_factory):
            return saved_once(tmp_path_factory, torch_moe)

        directory, model, expected = checkpoints("mixtral")
    """
    made = {}

    def get(name):
        if name not in made:
            model = build(name)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            if written is not None:
                written(name, directory)
            made[name] = Saved(directory, model, torch_logits(model, ids(name) if callable(ids) else ids))
        return made[name]

    return get


def converted(model, directory: Path, mesh="1x1", **load):
    """`model` saved by `save_pretrained` to `directory` and loaded back by `port.load`.

    The shipped mapping does the conversion: the tests hold no second mapping of their own.
    """
    import port

    model.save_pretrained(directory)
    return port.load(directory, mesh=mesh, **load)


def assert_same(model, expected) -> None:
    """Every array leaf of `model` equal to `expected`'s bit for bit, in the same dtype and sharding."""
    import jax

    ours, theirs = (jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (model, expected))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.sharding == b.sharding and a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def write_checkpoint(directory: Path, tensors: dict, config: dict) -> Path:
    """A safetensors checkpoint of NumPy arrays, for hand-made (and broken) inputs."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "model.safetensors")
    return directory


def read_header(path: Path) -> dict:
    """The tensors of one safetensors file, its header read and checked as port reads it
    (`read_safetensors`, with the whole header budget); no tensor data read."""
    from port._sources import _directory, _safetensors

    return _directory.read_safetensors(Path(path), _safetensors.MAX_HEADER)[0]


def script_module(path: Path):
    """The Python file at `path`, a script of the repository's (not on `sys.path`), imported as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_gpt2(directory: Path, drop=(), add=None, config=None) -> Path:
    """The tiny GPT-2 of `examples/tiny-gpt2`, made afresh by `examples/make_tiny_gpt2.py` at
    `directory`: without the tensors `drop` names, with those of `add` (added or replacing), and
    `config` merged into its config. `tiny_gpt2(tmp_path / "m", config={"model_type": "x"})`."""
    make = script_module(REPO / "examples" / "make_tiny_gpt2.py")
    tensors = {k: v for k, v in make.tensors(make.CONFIG).items() if k not in drop} | (add or {})
    return write_checkpoint(directory, tensors, make.CONFIG | (config or {}))


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root`: a file's digest, a link's target, or 'dir'."""
    found = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            found[name] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[name] = "dir"
        else:
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


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
        capture_output=True,
        text=True,
        env=port_env(env),
        cwd=cwd,
        timeout=timeout,
    )


_PROCESS_STATS = """
import atexit, os

def _report():  # this process's bytes read (read/pread/preadv) and peak resident set, at exit
    path = os.environ["PORT_TEST_IO"] + "." + str(os.getpid())
    with open("/proc/self/io") as f, open("/proc/self/status") as s, open(path, "w") as out:
        out.write(f.read() + s.read())

if os.environ.get("PORT_TEST_IO"):
    atexit.register(_report)
"""


def hooked(directory: Path, source: str) -> dict:
    """Environment that runs `source` first thing in every Python process of a `port` run (the
    supervisor and its worker): a `sitecustomize` module in `directory`, put first on PYTHONPATH."""
    directory.mkdir(exist_ok=True)
    (directory / "sitecustomize.py").write_text(source)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))}


def run_port_measured(tmp_path: Path, *args) -> tuple[subprocess.CompletedProcess, int, int]:
    """`port ARGS` as `run_port`, every process of it (the supervisor and its worker) reporting at
    exit what it read and its peak; returns (result, bytes read by all, the largest peak RSS)."""
    io = tmp_path / "stats"
    result = run_port(*args, env=hooked(tmp_path / "stats-hook", _PROCESS_STATS) | {"PORT_TEST_IO": str(io)})
    reports = [
        dict(line.split(":", 1) for line in f.read_text().splitlines() if ":" in line) for f in tmp_path.glob("stats.*")
    ]
    assert len(reports) == 2 or result.returncode != 0, reports  # the supervisor and the worker
    read = sum(int(r["rchar"]) for r in reports)
    peak = max((int(r["VmHWM"].split()[0]) * 1024 for r in reports), default=0)
    return result, read, peak


def one_line(result, *substrings: str, out: Path | None = None) -> str:
    """The run failed on bad input or a failed check: exit 1, exactly one `port: error:` line holding
    `substrings`, no traceback; given `out`, nothing left there nor beside it (the hidden sibling,
    `.{name}...`, a run writes first). Returns the line. A usage error (exit 2) is `usage_error`'s."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output and "internal error" not in output, output
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("port: no accelerator")]
    assert len(lines) == 1 and lines[0].startswith("port: error: "), output
    for s in substrings:
        assert s in lines[0], f"{s!r} not in {lines[0]!r}"
    if out is not None:
        assert not out.exists(), out
        assert not [p.name for p in out.parent.iterdir() if p.name.startswith("." + out.name)], out
    return lines[0]


def usage_error(result, *substrings: str) -> None:
    """The command line was used wrongly: exit 2, the usage on stderr holding `substrings` (`Usage: port
    COMMAND ...`, then `Error: ...`), no traceback, nothing on stdout."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output and "internal error" not in output, output
    assert result.stderr.startswith("Usage: port") and "\nError: " in result.stderr, output
    assert result.stdout == "", output
    for s in substrings:
        assert s in result.stderr, f"{s!r} not in {result.stderr!r}"


def place_on(directory, mesh, mapping=None):
    """Plan and place the checkpoint at `directory` on `mesh` (the shipped mapping unless given), as
    `port.load` does, for tests that record the reads: returns (plan, bytes read, tensor headers)."""
    import port

    with port.open_checkpoint(directory) as ckpt:
        mapping = port.mapping_for(ckpt.config) if mapping is None else mapping
        recipe = port.plan(port.skeleton(mapping, ckpt.config), mapping, ckpt.tensors, ckpt.config, mesh.shape)
        port.place(recipe, ckpt, mesh)
        return recipe, ckpt.bytes_read, ckpt.tensors


def cli(*args):
    """`port ARGS` in a subprocess; returns (exit status, stdout + stderr)."""
    result = run_port(*args)
    return result.returncode, result.stdout + result.stderr


@contextlib.contextmanager
def recorded_reads():
    """Every positioned read of tensor bytes made within the block, as (file offset, iovec, bytes read).

    `port._sources._local._preadv` is the one place tensor bytes come from a file: each call
    reads the file from its offset on, end to end, into the buffers its iovec rows
    (address, length) name. `read_offsets` turns the records into bytes.
    """
    import port._sources._local

    calls, real = [], port._sources._local._preadv

    def preadv(fd, iov, offset):
        rows = np.array(iov, copy=True)
        got = real(fd, iov, offset)
        calls.append((offset, rows, got))
        return got

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(port._sources._local, "_preadv", preadv)
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


def element_bytes(info, region):
    """The file offsets of every byte of `region` of tensor `info`."""
    index = np.arange(math.prod(info.shape)).reshape(info.shape)[tuple(slice(a, b) for a, b in region)]
    starts = info.offset + index.reshape(-1) * info.dtype.itemsize
    return set((starts[:, None] + np.arange(info.dtype.itemsize)[None, :]).reshape(-1).tolist())


def assert_blocks_read_exactly(per_block, recipe, tensors, mesh_shape) -> None:
    """Each block (from the `reads` fixture) read exactly the bytes of its source region, each once,
    and each distinct block of every leaf was read once, however many devices hold it."""
    by_leaf = {}
    for leaf, box, files in per_block:
        by_leaf.setdefault(leaf.path, []).append(box)
        region, keys = leaf.source_region(box)
        wanted = set().union(*(element_bytes(tensors[k], region) for k in keys))
        got = files.tolist()
        assert len(got) == len(set(got)), f"{leaf.path}: a byte read twice"
        assert set(got) == wanted, f"{leaf.path} {box}: read bytes outside its region"
    for leaf in recipe.leaves:  # one read per distinct block, though several devices ask
        boxes = by_leaf[leaf.path]
        assert len(boxes) == len(set(boxes)) == len(leaf.shards(mesh_shape)), leaf.path


ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "BOOL": 1}  # bytes per element of a safetensors dtype


def write_sparse_checkpoint(directory: Path, config: dict, shapes: dict, dtype: str = "BF16") -> int:
    """config.json and a model.safetensors in the new `directory`: a real header, each key's tensor
    of its shape in `shapes` (of `dtype`), or of (dtype, shape); the data a hole (os.truncate: no
    byte allocated), so a full-size model's plan costs no disk. Returns the file's size.

    `write_sparse_checkpoint(tmp_path / "m", config, {"w": [4096, 4096], "mask": ("BOOL", [8])})`
    """
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, entry in shapes.items():
        kind, shape = entry if entry and isinstance(entry[0], str) else (dtype, entry)
        n = ITEMSIZE[kind] * int(math.prod(shape))
        header[key] = {"dtype": kind, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = directory / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    size = 8 + len(text) + offset
    os.truncate(path, size)
    return size


def confirm_checks(path: Path, checkpoint, **kwargs) -> list[str]:
    """What an author does once each of `port scaffold`'s guesses in the draft at `path` is
    confirmed: `port.check` first names each `# CHECK` comment left (one problem each, and,
    as the draft is otherwise right, nothing else); then the comments are deleted. Returns
    those problems."""
    import pytest

    import port

    text = path.read_text()
    marked = [line for line in text.splitlines() if "# CHECK" in line]
    with pytest.raises(port.PlanError) as caught:
        port.check(path, checkpoint, **kwargs)
    problems = list(caught.value.problems)
    assert len(problems) == len(marked) and all("a CHECK of port scaffold's is still there" in p for p in problems)
    lines = []
    for line in text.splitlines():
        at = line.find("# CHECK")
        if at < 0:
            lines.append(line)
        elif line[:at].strip():
            lines.append(line[:at].rstrip())
    path.write_text("\n".join(lines) + "\n")
    return problems
