"""`port export` / `port.export`: a port model back to a Hugging Face checkpoint, bit for bit.

Every shipped family goes checkpoint -> `port convert` -> `port export` (the real
command line) -> `transformers` `from_pretrained`, which must find no missing or
unexpected key and every parameter equal to loading the original checkpoint. The
exported files themselves hold exactly the source's keys (its prefix kept) minus
ignored buffers and tied duplicates, in the source's dtypes, with metadata
`{"format": "pt"}` (plus `"producer": "port"`, by which `--force` knows an export
is port's, and the `"port_version"` that wrote it). A model changed in JAX exports its change; a small
`--max-shard-size` gives the numbered shards and index `save_pretrained` writes;
bad input is one line, exit 1, and leaves everything as it was. The tests that
build a `transformers` model skip without PyTorch.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import equinox as eqx
import jax
import numpy as np
import pytest

import port

from helpers import (
    one_line,
    port_command,
    port_env,
    run_port,
    snapshot,
    torch_bert,
    torch_gpt2,
    torch_llama,
    transformers_or_skip,
    usage_error,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-gpt2"
# Each file's safetensors metadata: transformers' "format", and port's name and version.
METADATA = {"format": "pt", "producer": "port", "port_version": port.__version__}

# name: (the `transformers` class that loads it, extra `from_pretrained` arguments)
CASES = {
    "gpt2": ("GPT2LMHeadModel", {}),  # save_pretrained: `transformer.` keys, tied head absent
    "gpt2-unprefixed": ("GPT2LMHeadModel", {}),  # as the Hub's gpt2: bare keys, attn.bias buffers
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-tied": ("LlamaForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),  # q/k/v biases
    "mistral": ("MistralForCausalLM", {}),
    "bert": ("BertModel", {}),
    "bert-no-pooler": ("BertModel", {"add_pooling_layer": False}),
}
# Every case on 4x2 through the command line, and on one device through the Python API
# (`port.convert`, `port.restore`, `port.export`); GPT-2 on one device through the command
# line too, with the default --mesh.
ROUND_TRIPS = (
    [(name, "4x2", "cli") for name in CASES] + [(name, "1x1", "api") for name in CASES] + [("gpt2", "1x1", "cli")]
)

# Buffers the shipped mappings ignore (never written back), wherever the source's prefix puts them.
IGNORED = re.compile(
    r"(^|\.)(h\.\d+\.attn\.(masked_)?bias|embeddings\.(position_ids|token_type_ids)"
    r"|layers\.\d+\.self_attn\.rotary_emb\.inv_freq)$"
)
SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def torch_model(name):
    """The case's seeded `transformers` model (skips without PyTorch)."""
    if name.startswith("gpt2"):
        return torch_gpt2()
    if name.startswith("bert"):
        return torch_bert(pooler=name == "bert")
    arch = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[name.split("-")[0]]
    return torch_llama(arch, **({"tie_word_embeddings": True} if name == "llama-tied" else {}))


def hub_gpt2(model, directory: Path) -> Path:
    """`model` as the Hub's gpt2 `model.safetensors` holds it: no `transformer.` prefix, no lm_head,
    and the causal-mask buffers `h.N.attn.bias` (float32 [1, 1, n_positions, n_positions])."""
    import torch
    from safetensors.torch import save_file

    tensors = {
        k.removeprefix("transformer."): v.contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith("lm_head.")
    }
    n = model.config.n_positions
    for i in range(model.config.n_layer):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    return directory


def write_source(name, directory: Path) -> Path:
    model = torch_model(name)
    if name == "gpt2-unprefixed":
        return hub_gpt2(model, directory)
    model.save_pretrained(directory)
    return directory


def config_of(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def read_model_dir(directory: Path):
    """Every tensor of a Hugging Face model directory (one file or shards) and each file's metadata."""
    from safetensors import safe_open

    tensors, metadata = {}, {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            metadata[path.name] = f.metadata()
            for key in f.keys():
                assert key not in tensors, f"{key} in two files"
                tensors[key] = f.get_tensor(key)
    return tensors, metadata


def expected_keys(source_keys, config: dict) -> set:
    """The source's keys minus ignored buffers and, when the config ties them, the tied head."""
    tied = config.get("tie_word_embeddings", True)  # transformers' default
    return {k for k in source_keys if not IGNORED.search(k) and not (tied and k == "lm_head.weight")}


def from_pretrained(class_name, directory, **kwargs):
    """(model, loading info) from `transformers`."""
    transformers = transformers_or_skip()
    return getattr(transformers, class_name).from_pretrained(directory, output_loading_info=True, **kwargs)


def assert_loads_clean(info):
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[what], f"{what}: {info[what]}"


def assert_state_equal(ours, theirs, scale=1):
    """Every state_dict entry of `ours` is `scale` x `theirs`'s, bit for bit, in the same dtype."""
    import torch

    ours, theirs = ours.state_dict(), theirs.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        expected = scale * value if value.is_floating_point() else value
        assert ours[key].dtype == expected.dtype, key
        assert torch.equal(ours[key], expected), key


def succeeded(result):
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output, output
    return result


def refused(result, *patterns):
    """`one_line`'s failure (exit 1, one `port: error:` line), the line matching each regular expression of `patterns`."""
    line = one_line(result)
    for pattern in patterns:
        assert re.search(pattern, line), f"{pattern!r} not in {line!r}"


def export_cli(directory, out, *args):
    return run_port("export", directory, "--out", out, *args)


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    """get(name, mesh, via): the case's checkpoint, its conversion on MESH and that output's export.

    Made once per case, mesh and way: `via="cli"` runs `port convert --mesh MESH` and
    `port export` (1x1: the export's default, no --mesh); `via="api"` calls
    `port.convert(..., out=)`, `port.restore` and `port.export` in this process.
    """
    sources, done = {}, {}

    def get(name, mesh="4x2", via="cli"):
        if name not in sources:
            sources[name] = write_source(name, tmp_path_factory.mktemp(name) / "source")
        if (name, mesh, via) not in done:
            root = tmp_path_factory.mktemp(f"{name}-{mesh}-{via}")
            converted, exported = root / "jax", root / "hf"
            if via == "cli":
                succeeded(run_port("convert", sources[name], "--mesh", mesh, "--out", converted))
                succeeded(export_cli(converted, exported, *(() if mesh == "1x1" else ("--mesh", mesh))))
            else:
                port.convert(sources[name], mesh=mesh, out=converted)
                port.export(port.restore(converted, mesh=mesh), exported, converted)
            done[name, mesh, via] = SimpleNamespace(source=sources[name], converted=converted, exported=exported)
        return done[name, mesh, via]

    return get


# ---------------------------------------------------------------- round trips through the command line


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh, via", ROUND_TRIPS)
def test_transformers_loads_the_export_bit_for_bit(ported, name, mesh, via):
    """checkpoint -> port convert -> port export -> from_pretrained: no missing or unexpected key,
    every state_dict entry equal to loading the original checkpoint."""
    run = ported(name, mesh, via)
    class_name, kwargs = CASES[name]
    original, _ = from_pretrained(class_name, run.source, **kwargs)
    exported, info = from_pretrained(class_name, run.exported, **kwargs)
    assert_loads_clean(info)
    assert_state_equal(exported, original)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_exported_files_hold_the_source_keys_dtypes_and_bytes(ported, name):
    """Keys exactly the source's (prefix kept) minus ignored buffers and tied duplicates; the source's
    shapes, dtypes and bytes; `{"format": "pt"}`; config.json the source's; nothing else written."""
    import torch

    run = ported(name)
    source, _ = read_model_dir(run.source)
    tensors, metadata = read_model_dir(run.exported)
    assert sorted(p.name for p in run.exported.iterdir()) == ["config.json", "model.safetensors"]
    assert metadata == {"model.safetensors": METADATA}
    assert set(tensors) == expected_keys(source, config_of(run.source))
    for key, value in tensors.items():
        assert value.dtype == source[key].dtype and value.shape == source[key].shape, key
        assert torch.equal(value, source[key]), key
    assert config_of(run.exported) == config_of(run.source)


def _split(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (JSON) and its data bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_exported_file_is_what_save_file_writes(ported, name, tmp_path):
    """The layout and bytes `safetensors` writes for the same tensors (as save_pretrained does): the same
    entries and offsets, byte-identical data; only the metadata adds port's `producer` and `port_version`."""
    from safetensors.torch import save_file

    run = ported(name)
    source, _ = read_model_dir(run.source)
    keep = expected_keys(source, config_of(run.source))
    save_file(
        {k: v for k, v in source.items() if k in keep}, tmp_path / "expected.safetensors", metadata={"format": "pt"}
    )
    header, data = _split(run.exported / "model.safetensors")
    expected_header, expected_data = _split(tmp_path / "expected.safetensors")
    assert header.pop("__metadata__") == METADATA
    expected_header.pop("__metadata__")
    assert header == expected_header
    assert data == expected_data


@pytest.mark.slow
def test_sharded_output(ported, tmp_path):
    """--max-shard-size below the model: numbered shards and an index, as save_pretrained writes them."""
    import torch
    from safetensors import safe_open

    run = ported("gpt2")
    out = tmp_path / "hf"
    succeeded(export_cli(run.converted, out, "--max-shard-size", "100KB"))
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert names == sorted(["config.json", "model.safetensors.index.json", *shards])
    assert len(shards) > 1
    assert [SHARD.fullmatch(n).groups() for n in shards] == [
        (f"{i:05d}", f"{len(shards):05d}") for i in range(1, len(shards) + 1)
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors, metadata = read_model_dir(out)
    assert metadata == {n: METADATA for n in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert (
        set(index["weight_map"]) == set(tensors) == expected_keys(read_model_dir(run.source)[0], config_of(run.source))
    )
    for shard in shards:
        with safe_open(out / shard, "pt") as f:
            keys = list(f.keys())
        assert all(index["weight_map"][k] == shard for k in keys), shard
        size = sum(tensors[k].numel() * tensors[k].element_size() for k in keys)
        assert size <= 100_000 or len(keys) == 1, (shard, size)  # 100KB is 10**5 bytes, as transformers reads it
    source, _ = read_model_dir(run.source)
    assert all(torch.equal(tensors[k], source[k]) for k in tensors)
    original, _ = from_pretrained("GPT2LMHeadModel", run.source)
    exported, info = from_pretrained("GPT2LMHeadModel", out)
    assert_loads_clean(info)
    assert_state_equal(exported, original)


@pytest.fixture(scope="module")
def bfloat16_llama(tmp_path_factory):
    """A bfloat16 Llama checkpoint and its `port convert --mesh 4x2` output."""
    root = tmp_path_factory.mktemp("bf16")
    torch_llama(dtype="bfloat16").save_pretrained(root / "source")
    succeeded(run_port("convert", root / "source", "--mesh", "4x2", "--out", root / "jax"))
    return root / "source", root / "jax"


@pytest.mark.slow
@pytest.mark.parametrize("flag, expected", [(None, "bfloat16"), ("float16", "float16"), ("float32", "float32")])
def test_dtype(bfloat16_llama, tmp_path, flag, expected):
    """A bfloat16 checkpoint exports bfloat16 (no round trip through float32); --dtype casts every tensor."""
    import torch

    source_dir, converted = bfloat16_llama
    out = tmp_path / "hf"
    succeeded(export_cli(converted, out, "--mesh", "4x2", *(("--dtype", flag) if flag else ())))
    source, _ = read_model_dir(source_dir)
    tensors, _ = read_model_dir(out)
    assert set(tensors) == expected_keys(source, config_of(source_dir))
    for key, value in tensors.items():
        assert value.dtype == getattr(torch, expected), key
        assert torch.equal(value, source[key].to(value.dtype)), key
    exported, info = from_pretrained("LlamaForCausalLM", out, dtype=getattr(torch, expected))
    assert_loads_clean(info)


@pytest.mark.slow
def test_force_replaces_an_earlier_export(ported, tmp_path):
    """An earlier export (float16 here) is replaced whole, nothing of it kept beside the new one."""
    run = ported("gpt2", "1x1")
    out = tmp_path / "hf"
    succeeded(export_cli(run.converted, out, "--dtype", "float16", "--max-shard-size", "100KB"))
    succeeded(export_cli(run.converted, out, "--force"))
    assert snapshot(out) == snapshot(run.exported)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing beside it (no moved-aside copy)


# ---------------------------------------------------------------- from Python


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "qwen2", "bert"])
def test_a_model_changed_in_jax_exports_the_change(ported, name, tmp_path):
    """Every floating leaf doubled in JAX: transformers sees exactly 2x the original weights."""
    source = ported(name).source
    model = port.load(source, mesh="4x2")
    doubled = eqx.apply_updates(model, eqx.filter(model, eqx.is_inexact_array))  # x + x == 2x exactly
    out = tmp_path / "hf"
    written = port.export(doubled, out, source).out
    assert isinstance(written, Path) and written.resolve() == out.resolve()
    class_name, kwargs = CASES[name]
    original, _ = from_pretrained(class_name, source, **kwargs)
    exported, info = from_pretrained(class_name, out, **kwargs)
    assert_loads_clean(info)
    assert_state_equal(exported, original, scale=2)
    # The export is itself a checkpoint port reads: the same leaves come back.
    again = port._skeleton.leaves(eqx.filter(port.load(out, mesh="2x2"), eqx.is_array))
    for path, leaf in port._skeleton.leaves(eqx.filter(doubled, eqx.is_array)).items():
        np.testing.assert_array_equal(np.asarray(again[path]), np.asarray(leaf), err_msg=path)


@pytest.mark.slow
def test_source_may_be_a_checkpoint_an_open_checkpoint_or_a_convert_output(ported, tmp_path):
    """Names, shapes and dtypes from any of the three: the same files; `config` replaces config.json."""
    run = ported("gpt2")
    model = port.restore(run.converted, mesh="4x2")
    written = {}
    written["directory"] = port.export(model, tmp_path / "a", run.source).out
    with port.open_checkpoint(run.source) as ckpt:
        written["open"] = port.export(model, tmp_path / "b", ckpt).out
    written["convert output"] = port.export(model, tmp_path / "c", run.converted).out
    config = {**config_of(run.source), "note": "mine"}
    written["config"] = port.export(model, tmp_path / "d", run.source, config=config).out
    expected = (run.exported / "model.safetensors").read_bytes()
    for how, out in written.items():
        assert (out / "model.safetensors").read_bytes() == expected, how
        assert config_of(out) == (config if how == "config" else config_of(run.source)), how


BUFFERS_AND_TIES = ["gpt2-head-and-buffers", "bert-legacy-prefixed-buffers", "llama-tied-with-head"]


def with_extras(name, directory: Path):
    """A checkpoint holding what a shipped mapping ignores or ties, and the torch model it holds.

    - GPT-2 (`transformer.` keys) with its tied `lm_head.weight` and the `attn.bias` /
      `attn.masked_bias` buffers older checkpoints carry;
    - BERT with a `bert.` prefix, legacy `LayerNorm.gamma`/`beta` names and its
      `position_ids` / `token_type_ids` buffers;
    - a tied Llama whose file holds `lm_head.weight` anyway, and `rotary_emb.inv_freq` buffers.
    """
    import torch
    from safetensors.torch import save_file

    family = name.split("-")[0]
    model = {"gpt2": torch_gpt2, "bert": torch_bert, "llama": lambda: torch_llama(tie_word_embeddings=True)}[family]()
    tensors = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    config = model.config
    if family == "gpt2":
        n = config.n_positions
        for i in range(config.n_layer):
            tensors[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
            tensors[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    elif family == "bert":
        legacy = lambda k: k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")  # noqa: E731
        tensors = {"bert." + legacy(k): v for k, v in tensors.items()}
        n = config.max_position_embeddings
        tensors["bert.embeddings.position_ids"] = torch.arange(n)[None]
        tensors["bert.embeddings.token_type_ids"] = torch.zeros(1, n, dtype=torch.long)
    else:
        head_dim = config.hidden_size // config.num_attention_heads
        for i in range(config.num_hidden_layers):
            tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = 1.0 / (
                10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
            )
    assert "lm_head.weight" in tensors or family == "bert"
    directory.mkdir(parents=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(directory)
    return model


@pytest.mark.parametrize("name", BUFFERS_AND_TIES)
def test_ignored_buffers_and_tied_duplicates_are_not_written(name, tmp_path):
    """Not read, not invented: the export holds the source's other keys, under the source's names."""
    import torch

    model = with_extras(name, tmp_path / "source")
    out = port.export(port.load(tmp_path / "source", mesh="4x2"), tmp_path / "hf", tmp_path / "source").out
    source, _ = read_model_dir(tmp_path / "source")
    tensors, _ = read_model_dir(out)
    dropped = set(source) - set(tensors)
    assert set(tensors) == expected_keys(source, config_of(tmp_path / "source"))
    assert dropped and all(IGNORED.search(k) or k == "lm_head.weight" for k in dropped)
    assert all(torch.equal(tensors[k], source[k]) for k in tensors)
    class_name = {"gpt2": "GPT2LMHeadModel", "bert": "BertModel", "llama": "LlamaForCausalLM"}[name.split("-")[0]]
    exported, info = from_pretrained(class_name, out)
    assert_loads_clean(info)
    assert_state_equal(exported, model)


@pytest.mark.slow
@pytest.mark.parametrize("other", ["gpt2-3-layers", "llama"])
def test_a_model_that_does_not_fit_the_mapping_is_refused(ported, other, tmp_path):
    """A model of another shape (or another family) than the source: one PortError naming a leaf, nothing written."""
    from port.models.gpt2 import GPT2
    from port.models.llama import Llama

    source = ported("gpt2").source
    if other == "llama":
        model = Llama.from_config({**config_of(ported("llama-gqa").source)}, key=jax.random.key(0))
    else:
        model = GPT2.from_config({**config_of(source), "n_layer": 3}, key=jax.random.key(0))
    before = snapshot(tmp_path)
    with pytest.raises(port.PortError) as raised:
        port.export(model, tmp_path / "hf", source)
    message = str(raised.value)
    assert "\n" not in message
    paths = set(port._skeleton.leaves(eqx.filter(model, eqx.is_array))) | set(
        port._skeleton.leaves(eqx.filter(port.load(source), eqx.is_array))
    )
    assert any(path in message for path in paths), message
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- bad input through the command line


@pytest.fixture(scope="module")
def tiny_converted(tmp_path_factory):
    """examples/tiny-gpt2 through `port convert` (no PyTorch needed)."""
    out = tmp_path_factory.mktemp("tiny") / "jax"
    succeeded(run_port("convert", EXAMPLE, "--out", out))
    return out


@pytest.fixture(scope="module")
def tiny_exported(tiny_converted, tmp_path_factory):
    """tiny_converted through `port export` (what `is_export` recognises is in the files alone)."""
    out = tmp_path_factory.mktemp("tiny-export") / "hf"
    succeeded(export_cli(tiny_converted, out))
    return out


@pytest.fixture
def workspace(tiny_converted, tiny_exported, tmp_path):
    """tmp_path holding: jax/ (a port convert output), plain/ (a user's directory), ckpt/ (a checkpoint),
    earlier/ (a port export of jax/), afile."""
    shutil.copytree(tiny_converted, tmp_path / "jax")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    shutil.copytree(EXAMPLE, tmp_path / "ckpt")
    (tmp_path / "afile").write_text("not a directory")
    shutil.copytree(tiny_exported, tmp_path / "earlier")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("directory", ["plain", "ckpt", "missing", "afile"])
def test_refuses_a_directory_that_is_not_a_port_output(workspace, directory):
    before = snapshot(workspace)
    refused(export_cli(workspace / directory, workspace / "hf"), re.escape(str(workspace / directory)))
    assert snapshot(workspace) == before


@pytest.mark.slow
@pytest.mark.parametrize(
    "out, force",
    [
        ("earlier", False),
        ("plain", False),
        ("plain", True),
        ("jax2", True),
        ("ckpt", True),
        ("afile", True),
        ("afile", False),
    ],
)
def test_refuses_an_out_it_may_not_write(workspace, out, force):
    """An existing --out without --force (even an earlier export), and with --force anything but an
    earlier export: one line naming --out, every file untouched, nothing left beside it."""
    shutil.copytree(workspace / "jax", workspace / "jax2")  # another port convert output: not an export
    before = snapshot(workspace)
    refused(export_cli(workspace / "jax", workspace / out, *(["--force"] if force else [])), "--out")
    assert snapshot(workspace) == before


@pytest.mark.slow
@pytest.mark.parametrize("size", ["5XB", "0", "-1", "GB", "1.5.5MB"])
def test_refuses_a_bad_max_shard_size(workspace, size):
    before = snapshot(workspace)
    refused(export_cli(workspace / "jax", workspace / "hf", "--max-shard-size", size), "--max-shard-size")
    assert snapshot(workspace) == before


@pytest.mark.slow
def test_refuses_a_mapping_it_cannot_invert(workspace):
    """A mapping that takes q twice from c_attn and never its k part converts, but cannot go back:
    one line naming the entry."""
    text = (REPO / "mappings" / "gpt2.toml").read_text()
    wrong = text.replace(
        'parts = 3, index = 1 } }, { reshape = ["n_embd"', 'parts = 3, index = 0 } }, { reshape = ["n_embd"'
    )
    assert wrong != text
    (workspace / "qq.toml").write_text(wrong)
    succeeded(run_port("convert", workspace / "ckpt", "--mapping", workspace / "qq.toml", "--out", workspace / "qq"))
    before = snapshot(workspace)
    refused(export_cli(workspace / "qq", workspace / "hf"), r"c_attn|blocks\.attn\.w[qk]")
    assert snapshot(workspace) == before


@pytest.mark.slow
def test_unknown_dtype_is_a_usage_error(workspace):
    usage_error(export_cli(workspace / "jax", workspace / "hf", "--dtype", "int8"), "--dtype")
    assert not (workspace / "hf").exists()


@pytest.mark.slow
def test_a_failing_write_is_one_line_and_leaves_nothing(workspace):
    """Files past 100 KB cannot be written (`ulimit -f`, RLIMIT_FSIZE, as a full disk): one line, nothing left."""
    before = snapshot(workspace)
    result = subprocess.run(  # the limit set by a shell (512-byte blocks), not preexec_fn: no fork of this process
        [
            "sh",
            "-c",
            'ulimit -f 200 && exec "$@"',
            "sh",
            *port_command(),
            "export",
            str(workspace / "jax"),
            "--out",
            str(workspace / "hf"),
        ],
        capture_output=True,
        text=True,
        env=port_env(),
        timeout=120,
    )
    refused(result, "File too large")
    assert snapshot(workspace) == before
