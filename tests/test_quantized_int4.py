"""GPTQ and AWQ int4 checkpoints (`quant_method: "gptq"` / `"awq"`), read as published: the
TheBloke / Qwen `-GPTQ-Int4` (act-order or not, v1 or v2 zeros) and `-AWQ` (GEMM) layouts.

Neither auto-gptq / gptqmodel nor autoawq runs on this CPU-only machine, so the reference
is a NumPy implementation of the formats' published definitions, written here element by
element (not port's code): GPTQ `W[o, i] = scales[g, o] * (q[i, o] - z[g, o])` with
`g = g_idx[i]`, `q` the `(i % 8)`-th 4-bit value of `qweight[i // 8, o]` and `z` the
`(o % 8)`-th of `qzeros[g, o // 8]`, plus one in the v1 format (GPTQModel's
`dequantize_weight`; vLLM's `zero_offset`); AWQ the same with `g = i // group_size`, no +1,
and the value of column `o` at position `AWQ_ORDER.index(o % 8)` of `qweight[i, o // 8]`
(AutoAWQ's `WQLinear_GEMM.from_linear` packing order). Checked:

- regions of random packed words (every bit pattern, sign bit included) equal the reference
  bit for bit, regions unaligned to the packing and to the groups, act-order `g_idx` (a
  random permutation of the groups), one group (`group_size: -1`), v1 and v2 zeros, 2, 4
  and 8 bits; each region reads exactly its covering words, `g_idx` rows and group rows;
- a tiny Llama (transformers' `LlamaForCausalLM`) quantized here by round-to-nearest in
  each format loads by `port.load` on 1x1 and 4x2 to the reference-dequantized weights
  bit for bit, with transformers' logits from those weights; 4x2 reads the plan's bytes;
- contradicting tensors and settings fail in one line before any byte is read.
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import port
from port._errors import CheckpointError

from helpers import VOCAB, logits, one_line, place_on, recorded_reads, run_port, torch_llama, torch_logits

IDS = np.random.default_rng(1).integers(0, VOCAB, (2, 12))
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: value k of a word is column 8c + AWQ_ORDER[k]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 16

# The Hub's quantization_config of each kind (group sizes made small for the tiny model).
QWEN_GPTQ = {  # Qwen/Qwen2.5-*-GPTQ-Int4 (v1 zeros, no checkpoint_format: the default)
    "batch_size": 1,
    "bits": 4,
    "damp_percent": 0.01,
    "desc_act": False,
    "exllama_config": {"version": 1},
    "group_size": GROUP,
    "quant_method": "gptq",
    "sym": True,
    "true_sequential": True,
    "use_exllama": True,
}
THEBLOKE_GPTQ = {  # TheBloke/*-GPTQ with act-order
    "bits": 4,
    "group_size": GROUP,
    "damp_percent": 0.1,
    "desc_act": True,
    "sym": False,
    "true_sequential": True,
    "model_name_or_path": None,
    "model_file_base_name": "model",
    "quant_method": "gptq",
}
AWQ = {"quant_method": "awq", "zero_point": True, "group_size": GROUP, "bits": 4, "version": "gemm"}


# ------------------------------------------------------------------ the definitions, in the test


def gptq_reference(qweight, qzeros, scales, g_idx, bits, v1) -> np.ndarray:
    """GPTQ's `[out, in]` weight, element by element from the published definition."""
    per, mask = 32 // bits, 2**bits - 1
    qweight, qzeros, g_idx = qweight.tolist(), qzeros.tolist(), g_idx.tolist()
    s = scales.astype(np.float32)
    n_out, n_in = scales.shape[1], len(g_idx)
    w = np.empty((n_out, n_in), np.float32)
    for i in range(n_in):
        g = g_idx[i]
        for o in range(n_out):
            q = (qweight[i // per][o] >> (bits * (i % per))) & mask
            z = (qzeros[g][o // per] >> (bits * (o % per))) & mask
            w[o, i] = s[g, o] * np.float32(q - (z + 1 if v1 else z))
    return w


def awq_reference(qweight, qzeros, scales, group_size) -> np.ndarray:
    """AWQ GEMM's `[out, in]` weight, element by element from the published definition."""
    qweight, qzeros = qweight.tolist(), qzeros.tolist()
    s = scales.astype(np.float32)
    n_in, n_out = len(qweight), scales.shape[1]
    size = n_in if group_size == -1 else group_size
    w = np.empty((n_out, n_in), np.float32)
    for i in range(n_in):
        g = i // size
        for o in range(n_out):
            at = 4 * AWQ_ORDER.index(o % 8)
            q = (qweight[i][o // 8] >> at) & 15
            z = (qzeros[g][o // 8] >> at) & 15
            w[o, i] = s[g, o] * np.float32(q - z)
    return w


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """`values` ([n, m], each < 2**bits) packed along rows: value k of word r is row r * per + k."""
    per = 32 // bits
    padded = np.zeros((-(-len(values) // per) * per, values.shape[1]), np.uint32)
    padded[: len(values)] = values
    words = np.zeros((len(padded) // per, values.shape[1]), np.uint32)
    for k in range(per):
        words |= padded[k::per] << np.uint32(bits * k)
    return words.view(np.int32)


def pack_columns(values: np.ndarray, bits: int, order=None) -> np.ndarray:
    """`values` ([n, m]) packed along columns: value k of word c is column c * per + order[k]."""
    per = 32 // bits
    order = range(per) if order is None else order
    padded = np.zeros((len(values), -(-values.shape[1] // per) * per), np.uint32)
    padded[:, : values.shape[1]] = values
    words = np.zeros((len(values), padded.shape[1] // per), np.uint32)
    for k in range(per):
        words |= padded[:, order[k] :: per] << np.uint32(bits * k)
    return words.view(np.int32)


def round_to_nearest(w: np.ndarray, g_idx: np.ndarray, groups: int, bits: int, sym: bool):
    """`w` ([out, in]) quantized per group of input rows: (q [in, out], zeros [groups, out], scales float16)."""
    maxq = 2**bits - 1
    lo = np.stack([np.minimum(w[:, g_idx == g].min(axis=1), 0) for g in range(groups)])
    hi = np.stack([np.maximum(w[:, g_idx == g].max(axis=1), 0) for g in range(groups)])
    if sym:
        hi = np.maximum(-lo, hi)
        lo = -hi
    scales = ((hi - lo) / maxq).astype(np.float16)
    scales[scales == 0] = 1
    zeros = np.full_like(lo, (maxq + 1) // 2, dtype=np.int64) if sym else np.round(-lo / scales).astype(np.int64)
    zeros = np.clip(zeros, 0, maxq)
    q = np.clip(np.round(w.T / scales[g_idx].astype(np.float32)) + zeros[g_idx], 0, maxq).astype(np.int64)
    return q, zeros, scales


def gptq_parts(w, bits, group_size, act_order, v1, sym, rng):
    """A GPTQ linear's tensors for `w` [out, in] (round to nearest), and their reference weight."""
    n_in = w.shape[1]
    size = n_in if group_size == -1 else group_size
    g_idx = (np.arange(n_in) // size).astype(np.int32)
    if act_order:
        g_idx = rng.permutation(g_idx)
    q, zeros, scales = round_to_nearest(w, g_idx, -(-n_in // size), bits, sym)
    stored = (zeros - (1 if v1 else 0)) & (2**bits - 1)
    parts = {"qweight": pack_rows(q, bits), "qzeros": pack_columns(stored, bits), "scales": scales, "g_idx": g_idx}
    return parts, gptq_reference(parts["qweight"], parts["qzeros"], scales, g_idx, bits, v1)


def awq_parts(w, group_size):
    n_in = w.shape[1]
    g_idx = np.arange(n_in) // (n_in if group_size == -1 else group_size)
    q, zeros, scales = round_to_nearest(w, g_idx, g_idx[-1] + 1, 4, sym=False)
    parts = {"qweight": pack_columns(q, 4, AWQ_ORDER), "qzeros": pack_columns(zeros, 4, AWQ_ORDER), "scales": scales}
    return parts, awq_reference(parts["qweight"], parts["qzeros"], scales, group_size)


def write_one(directory: Path, tensors: dict, settings: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    config = {"model_type": "llama", "dtype": "float16", "quantization_config": settings}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# ------------------------------------------------------------------ the formats, region by region

# name: (bits, group_size, act order, v1 zeros, [out, in])
GPTQ_CASES = {
    "int4-groups-v1": (4, 16, False, True, (40, 52)),
    "int4-act-order-v2": (4, 16, True, False, (40, 52)),
    "int4-one-group-v1": (4, -1, False, True, (44, 52)),
    "int8-act-order-v1": (8, 16, True, True, (40, 52)),
    "int2-groups-v2": (2, 16, False, False, (40, 52)),
}
REGIONS = [((0, 40), (0, 52)), ((0, 8), (16, 32)), ((3, 37), (5, 45)), ((13, 14), (51, 52)), ((39, 40), (0, 9))]


@pytest.fixture(scope="module")
def random_gptq(tmp_path_factory):
    """get(name): a GPTQ checkpoint of one linear `w` of random words, and its reference weight."""
    made = {}

    def get(name):
        if name not in made:
            bits, group_size, act_order, v1, (n_out, n_in) = GPTQ_CASES[name]
            rng = np.random.default_rng(len(made))
            per, groups = 32 // bits, 1 if group_size == -1 else -(-n_in // group_size)
            g_idx = np.arange(n_in) // (n_in if group_size == -1 else group_size)
            g_idx = (rng.permutation(g_idx) if act_order else g_idx).astype(np.int32)
            tensors = {
                "w.qweight": rng.integers(-(2**31), 2**31, (-(-n_in // per), n_out)).astype(np.int32),
                "w.qzeros": rng.integers(-(2**31), 2**31, (groups, -(-n_out // per))).astype(np.int32),
                "w.scales": rng.normal(0, 0.05, (groups, n_out)).astype(np.float16),
                "w.g_idx": g_idx,
                "w.bias": rng.normal(0, 1, n_out).astype(np.float16),
            }
            settings = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order}
            settings["checkpoint_format"] = "gptq" if v1 else "gptq_v2"
            directory = write_one(tmp_path_factory.mktemp(name), tensors, settings)
            made[name] = (
                directory,
                gptq_reference(*(tensors[f"w.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")), bits, v1),
            )
        return made[name]

    return get


def gptq_region_bytes(region, bits, group_size, act_order, groups, n_out_words=None) -> int:
    """What a region of a GPTQ weight reads, counted from the shapes: qweight words covering
    it (int32), its g_idx rows (int32), the group rows it needs (scales float16, qzeros int32)."""
    (o0, o1), (i0, i1) = region
    per = 32 // bits
    rows = groups if act_order else -(-i1 // group_size) - i0 // group_size
    words = (-(-i1 // per) - i0 // per) * (o1 - o0) * 4
    zeros = rows * (-(-o1 // per) - o0 // per) * 4
    return words + (i1 - i0) * 4 + rows * (o1 - o0) * 2 + zeros


@pytest.mark.parametrize("name", list(GPTQ_CASES))
def test_gptq_regions_equal_the_definition_and_read_only_their_words_and_groups(random_gptq, name):
    bits, group_size, act_order, v1, (n_out, n_in) = GPTQ_CASES[name]
    directory, expected = random_gptq(name)
    groups = 1 if group_size == -1 else -(-n_in // group_size)
    with port.open_checkpoint(directory) as ckpt:
        assert sorted(ckpt.tensors) == ["w.bias", "w.weight"]
        info = ckpt.tensors["w.weight"]
        assert info.shape == (n_out, n_in) and info.dtype == np.float32 and info.load_dtype == np.float16
        for region in REGIONS:
            before = ckpt.bytes_read
            got = ckpt.read("w.weight", region)
            (a, b), (c, d) = region
            assert np.array_equal(got.view(np.uint32), expected[a:b, c:d].view(np.uint32)), region
            size = n_in if group_size == -1 else group_size
            assert ckpt.bytes_read - before == gptq_region_bytes(region, bits, size, act_order, groups), region


def test_a_gptq_region_reads_its_covering_words_and_groups():
    """Rows 5..45 of the input, columns 3..37 in int4 groups of 16, counted by hand: qweight words
    0..5 (6 rows x 34 columns x 4 bytes), g_idx 5..45 (40 x 4), groups 0..2 (3 rows: scales 3 x 34
    x 2, qzeros 3 x words 0..4 x 4); act-order: all 4 groups (scales 4 x 34 x 2, qzeros 4 x 5 x 4)."""
    region = ((3, 37), (5, 45))
    assert gptq_region_bytes(region, 4, 16, False, 4) == 6 * 34 * 4 + 40 * 4 + 3 * 34 * 2 + 3 * 5 * 4
    assert gptq_region_bytes(region, 4, 16, True, 4) == 6 * 34 * 4 + 40 * 4 + 4 * 34 * 2 + 4 * 5 * 4


def test_describe_says_the_format_its_groups_and_zeros(random_gptq):
    with port.open_checkpoint(random_gptq("int4-act-order-v2")[0]) as ckpt:
        assert (
            ckpt.tensors["w.weight"].describe() == "gptq int4, groups of 16, act-order g_idx, zeros v2, scales float16"
        )
    with port.open_checkpoint(random_gptq("int4-one-group-v1")[0]) as ckpt:
        assert ckpt.tensors["w.weight"].describe() == "gptq int4, one group, zeros v1 (+1), scales float16"


@pytest.mark.parametrize("group_size", [16, -1])
def test_awq_regions_equal_the_definition_and_read_only_their_words_and_groups(tmp_path, group_size):
    rng = np.random.default_rng(3)
    n_in, n_out = 48, 40
    groups = 1 if group_size == -1 else n_in // group_size
    tensors = {
        "w.qweight": rng.integers(-(2**31), 2**31, (n_in, n_out // 8)).astype(np.int32),
        "w.qzeros": rng.integers(-(2**31), 2**31, (groups, n_out // 8)).astype(np.int32),
        "w.scales": rng.normal(0, 0.05, (groups, n_out)).astype(np.float16),
    }
    expected = awq_reference(tensors["w.qweight"], tensors["w.qzeros"], tensors["w.scales"], group_size)
    directory = write_one(tmp_path / "awq", tensors, AWQ | {"group_size": group_size})
    size = n_in if group_size == -1 else group_size
    with port.open_checkpoint(directory) as ckpt:
        info = ckpt.tensors["w.weight"]
        assert info.shape == (n_out, n_in) and list(ckpt.tensors) == ["w.weight"]
        assert (
            info.describe() == f"awq int4 gemm, {'one group' if group_size == -1 else 'groups of 16'}, scales float16"
        )
        for region in [
            ((0, 40), (0, 48)),
            ((0, 8), (16, 32)),
            ((3, 37), (5, 45)),
            ((13, 14), (47, 48)),
            ((9, 40), (0, 9)),
        ]:
            before = ckpt.bytes_read
            got = ckpt.read("w.weight", region)
            (o0, o1), (i0, i1) = region
            assert np.array_equal(got.view(np.uint32), expected[o0:o1, i0:i1].view(np.uint32)), region
            words, rows = -(-o1 // 8) - o0 // 8, -(-i1 // size) - i0 // size
            assert ckpt.bytes_read - before == (i1 - i0) * words * 4 + rows * words * 4 + rows * (o1 - o0) * 2


# ------------------------------------------------------------------ a Llama, against transformers


def quantized_llama(directory: Path, kind: str):
    """transformers' tiny Llama, its projections quantized in `kind` ("gptq", "gptq-act-order",
    "awq") into the Hub's layout at `directory`: (directory, reference weights, logits of
    transformers' Llama holding those reference-dequantized weights)."""
    import torch

    model = torch_llama()
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    rng = np.random.default_rng(0)
    weights = {}
    for layer in range(model.config.num_hidden_layers):
        for linear in LINEARS:
            prefix = f"model.layers.{layer}.{linear}."
            w = tensors.pop(prefix + "weight")
            if kind == "awq":
                parts, weights[prefix + "weight"] = awq_parts(w, GROUP)
            else:
                act = kind == "gptq-act-order"
                parts, weights[prefix + "weight"] = gptq_parts(w, 4, GROUP, act, v1=True, sym=not act, rng=rng)
            tensors.update({prefix + k: v for k, v in parts.items()})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    settings = {"gptq": QWEN_GPTQ, "gptq-act-order": THEBLOKE_GPTQ, "awq": AWQ}[kind]
    (directory / "config.json").write_text(json.dumps(config | {"quantization_config": settings}))
    state = model.state_dict()
    with torch.no_grad():
        for key, w in weights.items():
            state[key].copy_(torch.from_numpy(w))
    return directory, weights, torch_logits(model, IDS)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = quantized_llama(tmp_path_factory.mktemp(kind), kind)
        return made[kind]

    return get


@pytest.mark.parametrize(
    "kind, mesh", [("gptq", "1x1"), ("gptq", "4x2"), ("gptq-act-order", "4x2"), ("awq", "1x1"), ("awq", "4x2")]
)
def test_a_quantized_llama_loads_to_the_reference_weights_and_transformers_logits(llamas, kind, mesh):
    directory, weights, expected = llamas(kind)
    model = port.load(directory, mesh=mesh)
    for layer in range(2):
        down = weights[f"model.layers.{layer}.mlp.down_proj.weight"]
        q = weights[f"model.layers.{layer}.self_attn.q_proj.weight"]
        assert np.array_equal(np.asarray(model.blocks.mlp.down[layer]), down)
        assert np.array_equal(np.asarray(model.blocks.attn.wq[layer]).reshape(q.shape), q)
    np.testing.assert_allclose(np.asarray(logits(model, IDS)), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["gptq", "gptq-act-order", "awq"])
def test_each_device_reads_its_packed_words_and_the_group_rows_that_cover_them(llamas, kind):
    """Placing on 4x2 reads exactly the plan's bytes: per distinct block of each leaf, the words,
    g_idx rows and group rows covering its region, counted here from the shapes, not by port."""
    directory, _, _ = llamas(kind)
    mesh = port.make_mesh("4x2")
    recipe, read, tensors = place_on(directory, mesh)
    expected = 0
    for leaf in recipe.leaves:
        for box in leaf.shards(mesh.shape):
            region, keys = leaf.source_region(box)
            info = tensors[keys[0]]
            quantized = any(note.startswith("quantized: ") for note in leaf.notes)
            if quantized and kind == "awq":
                (o0, o1), (i0, i1) = region
                words, rows = -(-o1 // 8) - o0 // 8, -(-i1 // GROUP) - i0 // GROUP
                expected += ((i1 - i0) * words * 4 + rows * words * 4 + rows * (o1 - o0) * 2) * len(keys)
            elif quantized:
                groups = -(-info.shape[1] // GROUP)
                expected += gptq_region_bytes(region, 4, GROUP, kind == "gptq-act-order", groups) * len(keys)
            else:
                expected += math.prod(b - a for a, b in region) * info.dtype.itemsize * len(keys)
    assert recipe.read_bytes == expected == read


# ------------------------------------------------------------------ bad input


def corrupted(source: Path, tmp_path: Path, change) -> Path:
    directory = tmp_path / "bad"
    shutil.copytree(source, directory)
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    change(tensors, config["quantization_config"])
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def setting(**changes):
    return lambda t, s: s.update(changes)


GPTQ_BAD = {
    "missing qzeros": (lambda t, s: t.pop("w.qzeros"), "tensor 'w.qweight' has no 'w.qzeros' beside it"),
    "missing scales": (lambda t, s: t.pop("w.scales"), "tensor 'w.qweight' has no 'w.scales' beside it"),
    "missing g_idx": (lambda t, s: t.pop("w.g_idx"), "tensor 'w.qweight' has no 'w.g_idx' beside it"),
    "g_idx length": (
        lambda t, s: t.update({"w.g_idx": t["w.g_idx"][:40]}),
        "tensor 'w.qweight' is [7, 40], but the 40 input rows of 'w.g_idx' (8 a word) and the 40 columns of "
        "'w.scales' need [5, 40]",
    ),
    "group count": (setting(group_size=32), "tensor 'w.scales' is [4, 40], but 52 rows in groups of 32 need [2, 40]"),
    "one group": (setting(group_size=-1), "tensor 'w.scales' is [4, 40], but 52 rows in one group need [1, 40]"),
    "qweight width": (
        lambda t, s: t.update({"w.qweight": t["w.qweight"][:, :32]}),
        "tensor 'w.qweight' is [7, 32], but the 52 input rows of 'w.g_idx' (8 a word) and the 40 columns of "
        "'w.scales' need [7, 40]",
    ),
    "qzeros width": (
        lambda t, s: t.update({"w.qzeros": t["w.qzeros"][:, :4]}),
        "tensor 'w.qzeros' is [4, 4], but 4 groups of 40 columns (8 a word) need [4, 5]",
    ),
    "int8 words": (
        lambda t, s: t.update({"w.qweight": t["w.qweight"].view(np.int8)}),
        "tensor 'w.qweight' is int8, not int32",
    ),
    "float scales rank": (
        lambda t, s: t.update({"w.scales": t["w.scales"].reshape(-1)}),
        "tensor 'w.scales' is [160], not 2-dimensional",
    ),
    "orphan qzeros": (
        lambda t, s: t.update({"x.qzeros": t["w.qzeros"]}),
        "tensor 'x.qzeros' has no 'x.qweight' beside it",
    ),
    "bits 3": (setting(bits=3), "config.json: quantization_config.bits 3 is not read (read: 2, 4, 8)"),
    "group size 0": (setting(group_size=0), "quantization_config.group_size 0 must be a positive integer or -1"),
    "desc_act": (setting(desc_act="yes"), "quantization_config.desc_act 'yes' must be true or false"),
    "format": (
        setting(checkpoint_format="marlin"),
        "config.json: quantization_config.checkpoint_format 'marlin' is not read (read: gptq, gptq_v2)",
    ),
    "pack dtype": (setting(pack_dtype="int64"), "quantization_config.pack_dtype 'int64' is not read (read: int32)"),
    "dynamic": (
        setting(dynamic={"-:.*down": {}}),
        "quantization_config.dynamic (per-module bits or groups) is not read",
    ),
}


@pytest.mark.parametrize("case", list(GPTQ_BAD))
def test_gptq_contradictions_fail_in_one_line_before_any_byte_is_read(random_gptq, tmp_path, case):
    change, message = GPTQ_BAD[case]
    directory = corrupted(random_gptq("int4-groups-v1")[0], tmp_path, change)
    with recorded_reads() as calls, pytest.raises(CheckpointError) as raised:
        port.open_checkpoint(directory)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not calls


def awq_checkpoint(tmp_path: Path) -> Path:
    rng = np.random.default_rng(4)
    tensors = {
        "w.qweight": rng.integers(-(2**31), 2**31, (48, 5)).astype(np.int32),
        "w.qzeros": rng.integers(-(2**31), 2**31, (3, 5)).astype(np.int32),
        "w.scales": rng.normal(0, 0.05, (3, 40)).astype(np.float16),
    }
    return write_one(tmp_path / "awq", tensors, dict(AWQ))


AWQ_BAD = {
    "missing qzeros": (lambda t, s: t.pop("w.qzeros"), "tensor 'w.qweight' has no 'w.qzeros' beside it"),
    "missing scales": (lambda t, s: t.pop("w.scales"), "tensor 'w.qweight' has no 'w.scales' beside it"),
    "qweight width": (
        lambda t, s: t.update({"w.qweight": t["w.qweight"][:, :4]}),
        "tensor 'w.qweight' is [48, 4], but the 40 columns of 'w.scales' (8 a word) need [48, 5]",
    ),
    "group count": (setting(group_size=32), "tensor 'w.scales' is [3, 40], but 48 rows in groups of 32 need [2, 40]"),
    "scales width": (
        lambda t, s: t.update({"w.scales": t["w.scales"][:, :36]}),
        "tensor 'w.scales' has 36 columns, not a multiple of AWQ's 8 a word",
    ),
    "bits 8": (setting(bits=8), "config.json: quantization_config.bits 8 is not read (read: 4)"),
    "gemv": (setting(version="gemv"), "quantization_config.version 'gemv' is not read (read: gemm)"),
    "no zero point": (setting(zero_point=False), "quantization_config.zero_point false is not read"),
}


@pytest.mark.parametrize("case", list(AWQ_BAD))
def test_awq_contradictions_fail_in_one_line_before_any_byte_is_read(tmp_path, case):
    change, message = AWQ_BAD[case]
    directory = corrupted(awq_checkpoint(tmp_path), tmp_path, change)
    with recorded_reads() as calls, pytest.raises(CheckpointError) as raised:
        port.open_checkpoint(directory)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not calls


def test_g_idx_values_and_scales_are_checked_as_they_are_read(random_gptq, tmp_path):
    """A group index past the scales (act-order), a monotone checkpoint's index outside the groups
    its rows cover, and a NaN scale: one line naming the tensor and the row, when read."""

    def past(tensors, settings):
        tensors["w.g_idx"] = tensors["w.g_idx"].copy()
        tensors["w.g_idx"][3] = 9

    directory = corrupted(random_gptq("int4-act-order-v2")[0], tmp_path / "a", past)
    with port.open_checkpoint(directory) as ckpt, pytest.raises(CheckpointError) as raised:
        ckpt.read("w.weight", ((0, 8), (0, 16)))
    assert str(raised.value) == "model.safetensors: tensor 'w.g_idx': row 3 is in group 9, but the scales hold 4 groups"

    def shuffled(tensors, settings):
        tensors["w.g_idx"] = tensors["w.g_idx"][::-1].copy()

    directory = corrupted(random_gptq("int4-groups-v1")[0], tmp_path / "b", shuffled)
    with port.open_checkpoint(directory) as ckpt, pytest.raises(CheckpointError) as raised:
        ckpt.read("w.weight", ((0, 8), (0, 16)))
    assert str(raised.value) == (
        "model.safetensors: tensor 'w.g_idx': row 0 is in group 3, not 0 as groups of 16 in order have it "
        "(quantization_config.desc_act is false)"
    )

    def nan(tensors, settings):
        tensors["w.scales"] = tensors["w.scales"].copy()
        tensors["w.scales"][0, 2] = np.nan  # group 0, column 2: in the region read

    directory = corrupted(random_gptq("int4-groups-v1")[0], tmp_path / "c", nan)
    with port.open_checkpoint(directory) as ckpt, pytest.raises(CheckpointError) as raised:
        ckpt.read("w.weight", ((0, 8), (0, 16)))
    assert str(raised.value) == "model.safetensors: tensor 'w.scales' holds a NaN or infinite scale"


@pytest.mark.slow
def test_port_plan_shows_the_format_and_refuses_a_missing_g_idx_in_one_line(llamas, tmp_path):
    directory, _, _ = llamas("gptq-act-order")
    planned = run_port("plan", str(directory), "--mesh", "4x2")
    assert planned.returncode == 0, planned.stderr
    shown = " ".join(planned.stdout.split())  # the notes wrap
    assert "quantized: gptq int4, groups of 16, act-order g_idx, zeros v1 (+1), scales float16" in shown
    bad = corrupted(directory, tmp_path, lambda t, s: t.pop("model.layers.1.mlp.down_proj.g_idx"))
    result = run_port("plan", str(bad), "--mesh", "4x2")
    one_line(
        result,
        "model.safetensors: tensor 'model.layers.1.mlp.down_proj.qweight' has no "
        "'model.layers.1.mlp.down_proj.g_idx' beside it",
    )
