"""Benchmark: loading quantized checkpoints against the same model stored in bfloat16 (issue 33).

    python bench/quantized.py [--formats fp8,mxfp4,int4,ct-int4,nf4] [--size 1gb] [--mesh 4x2]
                              [--repeats 3] [--workdir DIR] [--profile] [--out FILE]

For each format, two checkpoints of one model with random weights are written once: the
quantized one, laid out as the Hub's checkpoints of that format are (tensors and
`quantization_config`), and its twin in bfloat16 holding what the quantized one
dequantizes to (by the reference the tests compare port with, in float32, rounded to
bfloat16 to nearest even as torch's `.to()` does). Both are loaded the same way,
`port.load(dir, mesh=...)` (as `port.convert(...)`, whose report gives the bytes read),
onto 8 simulated CPU devices, `--repeats` times each, each run in a fresh process after the
page cache was warmed (bench/bench.py's way, with bench/_measure.py's helpers), and the
median is reported. After each run's clock stops, a digest of every array's shards is
taken: the two loads must give the same bytes.

  fp8      a Llama of TinyLlama-1.1B's shape with 16 of its 22 layers (0.97 GB in FP8), as
           DeepSeek-V3 and Qwen3 `-FP8` ship: each linear weight of the layers float8 e4m3 with
           a float32 `weight_scale_inv` per 128x128 block (scale = the block's largest
           magnitude / 448); embeddings, norms and head bfloat16
  mxfp4    gpt-oss with gpt-oss-20b's widths, 16 experts and 2 layers: the fused experts in
           MXFP4 (`*_blocks`, random e2m1 codes; `*_scales`, E8M0), the rest bfloat16; the
           twin by transformers' `convert_moe_packed_tensors`
  int4     the Llama in GPTQ int4 (Qwen's `-GPTQ-Int4` config: groups of 128, v1 zeros),
           random packed words and float16 scales; the twin by the format's definition
  ct-int4  the Llama in compressed-tensors `pack-quantized` int4 (Kimi K2 Thinking's scheme:
           symmetric groups of 32, bfloat16 scales); the twin by the package's `decompress`
  nf4      the Llama in bitsandbytes nf4 as unsloth's `-bnb-4bit` (blocks of 64, nested
           absmax), quantized by bitsandbytes; the twin by its `dequantize_4bit`

Columns: the checkpoint's size; seconds; peak anonymous memory (`RssAnon`, sampled every
2 ms) above its value when the load started; that peak minus the arrays the load produced
(on CPU the arrays live in host memory: what is left is the load's own working memory);
bytes read (the checkpoint's count) and the plan's bytes to read; and the bytes the most
loaded device holds. Under each table, the issue's bounds: the quantized load within 1.3x
the bfloat16 load's time, and its memory above the arrays within 1x the largest tensor;
and the load average before and after the runs.

`--profile` also runs the quantized load once under cProfile (every reading thread
profiled, the stats merged) and prints the functions that took the most time.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import math
import os
import pstats
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# bench/bench.py's measuring helpers, bench/plan.py's gpt-oss config and tensors
import plan

import bench

import _measure

TIME_BOUND = 1.3  # the quantized load's time, at most this times the bfloat16 load's
MEMORY_BOUND = 1.0  # memory above the arrays, at most this times the largest tensor

# The models, by --size: "1gb" (each quantized checkpoint about 1 GB), "tiny" (the smoke test's).
# Llama: TinyLlama-1.1B's shape, 16 of its 22 layers.
LLAMA = {
    "1gb": dict(hidden_size=2048, intermediate_size=5632, heads=32, kv_heads=4, vocab_size=32000, layers=16),
    "tiny": dict(hidden_size=256, intermediate_size=512, heads=4, kv_heads=2, vocab_size=1024, layers=2),
}
# gpt-oss: gpt-oss-20b's widths (hidden and expert inner 2880, 64 heads / 8 KV heads of 64),
# 16 of its 32 experts, 2 of its 24 layers, the vocabulary cut to 32000.
GPT_OSS = {
    "1gb": dict(
        hidden_size=2880,
        intermediate_size=2880,
        experts=16,
        heads=64,
        kv_heads=8,
        head_dim=64,
        vocab_size=32000,
        layers=2,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=64, experts=4, heads=4, kv_heads=2, head_dim=16, vocab_size=1024, layers=2
    ),
}
SIZES = tuple(LLAMA)


# ---------------------------------------------------------------- the checkpoints


def llama_config(size: dict) -> dict:
    """A Llama config.json of `size` (LLAMA), in bfloat16."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": size["hidden_size"],
        "intermediate_size": size["intermediate_size"],
        "num_attention_heads": size["heads"],
        "num_key_value_heads": size["kv_heads"],
        "num_hidden_layers": size["layers"],
        "vocab_size": size["vocab_size"],
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def llama_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint and its shape."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (v, h)}


def llama_linear(key: str, shape: tuple[int, ...]) -> bool:
    """Whether a quantized Llama checkpoint quantizes `key`: the layers' linear weights (not the
    embeddings, norms or head)."""
    return len(shape) == 2 and key.startswith("model.layers.")


def gpt_oss_config(size: dict) -> dict:
    """A gpt-oss config.json of `size` (GPT_OSS): gpt-oss-120b's (bench/plan.py), resized."""
    return plan.GPT_OSS_120B | {
        "hidden_size": size["hidden_size"],
        "intermediate_size": size["intermediate_size"],
        "num_local_experts": size["experts"],
        "num_attention_heads": size["heads"],
        "num_key_value_heads": size["kv_heads"],
        "head_dim": size["head_dim"],
        "vocab_size": size["vocab_size"],
        "num_hidden_layers": size["layers"],
        "layer_types": ["sliding_attention", "full_attention"] * (size["layers"] // 2),
        "torch_dtype": "bfloat16",
    }


def gpt_oss_experts(key: str, shape: tuple[int, ...]) -> bool:
    """Whether gpt-oss's MXFP4 checkpoint quantizes `key`: the fused experts, not their biases."""
    return key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


def fp8_blocks(key: str, shape: tuple[int, ...], generator, block: int = 128):
    """A random weight [M, N] in FP8 e4m3 with one float32 scale per `block` x `block` block (the
    block's largest magnitude / 448; edge blocks partial), as {key, key_scale_inv}, and the
    bfloat16 of what they dequantize to (float32 value times scale, rounded to nearest even)."""
    import torch

    m, n = shape
    rows, cols = -(-m // block), -(-n // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:m, :n] = torch.randn(shape, generator=generator) * 0.02
    blocks = padded.view(rows, block, cols, block)
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    each = scale[:, None, :, None]
    fp8 = (blocks / each).to(torch.float8_e4m3fn)
    values = (fp8.float() * each).view(rows * block, cols * block)[:m, :n]
    parts = {key: fp8.view(rows * block, cols * block)[:m, :n].contiguous(), key + "_scale_inv": scale}
    return parts, values.to(torch.bfloat16)


def mxfp4_experts(key: str, shape: tuple[int, ...], generator):
    """Random fused experts [E, inputs, rows] in MXFP4 as gpt-oss stores them: `key_blocks` (uint8
    [E, rows, inputs / 32, 16], random e2m1 codes) and `key_scales` (uint8 [E, rows, inputs / 32],
    E8M0 exponents 2**-8 .. 2**-5); and the bfloat16 of transformers' dequantization of them
    (`convert_moe_packed_tensors`, the reference the tests compare port with)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    experts, inputs, rows = shape
    blocks = torch.randint(0, 256, (experts, rows, inputs // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(119, 123, (experts, rows, inputs // 32), generator=generator, dtype=torch.uint8)
    values = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    return {key + "_blocks": blocks, key + "_scales": scales}, values.to(torch.bfloat16)


def gptq_int4(key: str, shape: tuple[int, ...], generator, group: int = 128):
    """A random linear [out, in] as GPTQ int4 stores it (v1 zeros, groups of `group` in order):
    `qweight` (int32 [in / 8, out], random), `qzeros` (int32 [groups, out / 8], random), `scales`
    (float16 [groups, out]), `g_idx`; and the bfloat16 of the definition,
    W[o, i] = scales[g, o] * (q[i, o] - (z[g, o] + 1)), g = g_idx[i], computed in float32."""
    import torch

    out, inputs = shape
    groups = -(-inputs // group)
    qweight, qzeros = (
        torch.randint(-(2**31), 2**31, s, generator=generator, dtype=torch.int64).to(torch.int32)
        for s in ((inputs // 8, out), (groups, out // 8))
    )
    scales = (torch.rand(groups, out, generator=generator) * 0.004 + 0.001).to(torch.float16)
    g_idx = torch.arange(inputs, dtype=torch.int32) // group
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(inputs, out)
    z = ((qzeros[:, :, None] >> shifts[None, None, :]) & 15).reshape(groups, out) + 1
    values = scales.float()[g_idx] * (q - z[g_idx]).float()
    prefix = key.removesuffix(".weight")
    parts = {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales}
    return parts | {f"{prefix}.g_idx": g_idx}, values.T.contiguous().to(torch.bfloat16)


def ct_int4(key: str, shape: tuple[int, ...], generator):
    """A random linear [out, in] as compressed-tensors' `pack-quantized` int4 stores it (Kimi K2
    Thinking's scheme: symmetric, groups of 32): `weight_packed` (int32 [out, in / 8], random),
    `weight_scale` (bfloat16 [out, in / 32]), `weight_shape`; and the package's own decompression
    of them (its compressor's `decompress`, the reference the tests compare port with)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    out, inputs = shape
    packed = torch.randint(-(2**31), 2**31, (out, inputs // 8), generator=generator, dtype=torch.int64)
    scale = torch.rand(out, inputs // 32, generator=generator) * 0.004 + 0.001
    prefix = key.removesuffix(".weight")
    state = {"weight_packed": packed.to(torch.int32), "weight_scale": scale.to(torch.bfloat16)}
    state["weight_shape"] = torch.tensor([out, inputs])
    scheme = QuantizationConfig.model_validate(COMPRESSED).config_groups["group_0"]
    values = BaseCompressor.get_value_from_registry(COMPRESSED["format"]).decompress(state, scheme)["weight"]
    return {f"{prefix}.{name}": v for name, v in state.items()}, values.to(torch.bfloat16)


def nf4_nested(key: str, shape: tuple[int, ...], generator):
    """A random bfloat16 weight quantized by bitsandbytes as unsloth's `-bnb-4bit` checkpoints are
    (nf4, blocks of 64, absmax double-quantized): {key, key.absmax, ..., key.quant_state...}; and
    the bfloat16 of bitsandbytes' `dequantize_4bit` of it in float32."""
    import bitsandbytes.functional as F
    import torch

    weight = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    packed, state = F.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    parts = {key: packed} | {f"{key}.{name}": v for name, v in state.as_dict(packed=True).items()}
    state.dtype = torch.float32
    with torch._dynamo.config.patch(disable=True):  # bitsandbytes' CPU path, uncompiled
        values = F.dequantize_4bit(packed, state)
    return parts, values.to(torch.bfloat16)


def write_pair(quantized: Path, twin: Path, config: dict, shapes: dict, chosen, quantize, quantization: dict) -> None:
    """A model of random weights twice: at `quantized` with the tensors `chosen(key, shape)` picks
    quantized by `quantize(key, shape, generator)` (-> the quantized tensors, the bfloat16 of what
    they dequantize to) and `quantization` as config.json's quantization_config; at `twin` in
    bfloat16, those tensors as they dequantize. Norms and biases ones, the rest as in both."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    packed, plain = {}, {}
    for key, shape in shapes.items():
        if chosen(key, tuple(shape)):
            parts, plain[key] = quantize(key, tuple(shape), generator)
            packed |= parts
        elif len(shape) == 1:
            packed[key] = plain[key] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            packed[key] = plain[key] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    for directory, tensors, extra in ((quantized, packed, {"quantization_config": quantization}), (twin, plain, {})):
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config | extra, indent=2))


def write_llama(quantize, quantization: dict) -> Callable[[Path, Path, str], None]:
    def write(quantized: Path, twin: Path, size: str) -> None:
        config = llama_config(LLAMA[size])
        write_pair(quantized, twin, config, llama_shapes(config), llama_linear, quantize, quantization)

    return write


def write_gpt_oss(quantized: Path, twin: Path, size: str) -> None:
    config = gpt_oss_config(GPT_OSS[size])
    write_pair(quantized, twin, config, plan.gpt_oss_shapes(config), gpt_oss_experts, mxfp4_experts, MXFP4)


# The quantization_config of each, as the Hub's checkpoints have it.
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
MXFP4 = {  # openai/gpt-oss-20b's
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
GPTQ = {  # Qwen/Qwen2.5-*-GPTQ-Int4's
    "batch_size": 1,
    "bits": 4,
    "damp_percent": 0.01,
    "desc_act": False,
    "exllama_config": {"version": 1},
    "group_size": 128,
    "quant_method": "gptq",
    "sym": True,
    "true_sequential": True,
    "use_exllama": True,
}
COMPRESSED = {  # moonshotai/Kimi-K2-Thinking's (its ignore list: the modules it leaves unquantized)
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
BNB_NF4 = {  # unsloth's *-bnb-4bit
    "_load_in_4bit": True,
    "_load_in_8bit": False,
    "bnb_4bit_compute_dtype": "bfloat16",
    "bnb_4bit_quant_storage": "uint8",
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": True,
    "llm_int8_enable_fp32_cpu_offload": False,
    "llm_int8_has_fp16_weight": False,
    "llm_int8_skip_modules": None,
    "llm_int8_threshold": 6.0,
    "load_in_4bit": True,
    "load_in_8bit": False,
    "quant_method": "bitsandbytes",
}

# name: (the format in words, the family (LLAMA, GPT_OSS), writer(quantized dir, bfloat16 twin dir, size))
FORMATS: dict[str, tuple[str, str, Callable[[Path, Path, str], None]]] = {
    "fp8": (
        "FP8 e4m3, 128x128 block scales (DeepSeek-V3, Qwen3 -FP8)",
        "llama",
        write_llama(fp8_blocks, FP8),
    ),
    "mxfp4": (
        "MXFP4 experts, E8M0 scales per 32 (gpt-oss)",
        "gpt_oss",
        write_gpt_oss,
    ),
    "int4": (
        "GPTQ int4, groups of 128 (Qwen2.5 -GPTQ-Int4)",
        "llama",
        write_llama(gptq_int4, GPTQ),
    ),
    "ct-int4": (
        "compressed-tensors pack-quantized int4, groups of 32 (Kimi K2 Thinking)",
        "llama",
        write_llama(ct_int4, COMPRESSED),
    ),
    "nf4": (
        "bitsandbytes nf4, blocks of 64, nested absmax (unsloth -bnb-4bit)",
        "llama",
        write_llama(nf4_nested, BNB_NF4),
    ),
}


def model_words(family: str, size: str) -> str:
    """The model a format is measured on, in words: `Llama, hidden 2048, SwiGLU 5632, ...`."""
    if family == "llama":
        c = LLAMA[size]
        return (
            f"Llama, hidden {c['hidden_size']}, SwiGLU {c['intermediate_size']}, {c['heads']} / {c['kv_heads']} "
            f"heads, {c['layers']} layers, vocab {c['vocab_size']}"
        )
    c = GPT_OSS[size]
    return (
        f"gpt-oss, hidden {c['hidden_size']}, {c['experts']} experts of inner {c['intermediate_size']}, "
        f"{c['heads']} / {c['kv_heads']} heads, {c['layers']} layers, vocab {c['vocab_size']}"
    )


def files_of(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def largest_tensor(directory: Path) -> int:
    """Bytes of the largest tensor of the (bfloat16) checkpoint at `directory`."""
    from safetensors import safe_open

    largest = 0
    for path in files_of(directory):
        with safe_open(path, "np") as f:
            for key in f.keys():
                largest = max(largest, 2 * math.prod(f.get_slice(key).get_shape()))
    return largest


# ---------------------------------------------------------------- measured process


def digest(model) -> str:
    """A hash of every array's shards (in leaf and device order): equal models, equal digests."""
    import equinox as eqx
    import jax
    import numpy as np

    h = hashlib.blake2b(digest_size=16)
    for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)):
        for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
            h.update(np.ascontiguousarray(shard.data).view(np.uint8).data)
    return h.hexdigest()


def measure(spec: dict) -> dict:
    """Load `spec["dir"]` once with `port.load` (as `port.convert(...)`) in this fresh process: its
    figures. With `spec["adapter"]` (bench/lora.py), that PEFT adapter merged onto it."""
    mesh = _measure.started(spec["mesh"])
    import jax

    import port

    adapter = spec.get("adapter")
    files = [*files_of(Path(spec["dir"])), *(files_of(Path(adapter)) if adapter else [])]
    _measure.back_memory(2 * sum(path.stat().st_size for path in files))
    os.sync()
    kwargs = {"adapter": adapter} if adapter else {}  # without one: the call as any other benchmark makes it
    stop = _measure.peak_memory(0.002)
    start = time.perf_counter()
    run = port.convert(spec["dir"], mesh=mesh, **kwargs)
    jax.block_until_ready(run.model)
    seconds = time.perf_counter() - start
    peak = stop()
    return {
        "seconds": seconds,
        "peak_above_start": peak,
        "bytes_read": run.report.bytes_read,
        "adapter_bytes_read": run.report.adapter_bytes_read,
        "plan_read_bytes": run.plan.read_bytes,
        "device_bytes": max(run.report.device_bytes.values()),
        "total_device_bytes": sum(run.report.device_bytes.values()),
        "digest": digest(run.model),
    }


def profiled(spec: dict) -> dict:
    """The load once under cProfile, every thread profiled (the reading threads too), stats merged:
    the `spec["top"]` functions by own time."""
    _measure.started(spec["mesh"])
    import port

    profiles: list[cProfile.Profile] = []

    def start_profiling(*_) -> None:  # a new thread's first event: profile the rest of it
        profile = cProfile.Profile()
        profiles.append(profile)
        profile.enable()

    main = cProfile.Profile()
    threading.setprofile(start_profiling)
    main.enable()
    port.load(spec["dir"], mesh=spec["mesh"])
    main.disable()
    threading.setprofile(None)  # pyright: ignore[reportArgumentType]  # None removes the hook
    text = io.StringIO()
    pstats.Stats(main, *profiles, stream=text).sort_stats("tottime").print_stats(spec["top"])
    return {"profile": text.getvalue()}


# ---------------------------------------------------------------- driver


def _mb(n: float) -> str:
    return _measure.mb(n)


def _holds(value: float, bound: float) -> str:
    return "holds" if value <= bound else "EXCEEDED"


def table(name: str, size: str, results: dict, sizes: dict, largest: int, mesh: str) -> str:
    """The Markdown section of one format: a row per checkpoint (of `sizes` bytes), then the bounds."""
    what, family, _ = FORMATS[name]
    header = [
        "checkpoint",
        "size",
        "seconds",
        "peak anon memory above start",
        "memory above the arrays",
        "bytes read",
        "plan: bytes to read",
        "bytes per device",
        "x bfloat16 (time)",
    ]
    base = results["bfloat16"]
    rows = []
    for label, r in results.items():
        if not isinstance(r, dict):
            rows.append([label, _mb(sizes[label]), f"failed: {r}"])
            continue
        ratio = f"{r['seconds'] / base['seconds']:.2f}" if isinstance(base, dict) else ""
        rows.append(
            [
                label,
                _mb(sizes[label]),
                f"{r['seconds']:.3f}",
                _mb(r["peak_above_start"]),
                _mb(r["peak_above_start"] - r["total_device_bytes"]),
                _mb(r["bytes_read"]),
                _mb(r["plan_read_bytes"]),
                _mb(r["device_bytes"]),
                ratio,
            ]
        )
    lines = [f"### {what}: {model_words(family, size)}, mesh {mesh}", "", _measure.markdown(header, rows)]
    quantized = results[name]
    if isinstance(quantized, dict) and isinstance(base, dict):
        ratio = quantized["seconds"] / base["seconds"]
        above = quantized["peak_above_start"] - quantized["total_device_bytes"]
        same = "the same" if quantized["digest"] == base["digest"] else "DIFFERENT"
        extra = quantized["bytes_read"] - quantized["plan_read_bytes"]
        read = "bytes read = the plan's" if not extra else f"bytes read = the plan's + {extra:,} B"
        lines += [
            "",
            f"{name}: {ratio:.2f} x the bfloat16 load's time (bound {TIME_BOUND}: {_holds(ratio, TIME_BOUND)}); "
            f"memory above the arrays {_mb(above)} against the largest tensor {_mb(largest)} "
            f"(bound {MEMORY_BOUND:g}x: {_holds(above, MEMORY_BOUND * largest)}); {read}; "
            f"arrays {same} as the bfloat16 twin's (digest of every shard).",
        ]
    return "\n".join(lines)


def measured(name: str, size: str, mesh: str, repeats: int, work: Path) -> str:
    """Both checkpoints of format `name` (written once under `work`), loaded `repeats` times each: its section."""
    quantized, twin = work / f"{name}-{size}", work / f"{name}-{size}-bf16"
    if not files_of(quantized) or not files_of(twin):
        clock = time.perf_counter()
        FORMATS[name][2](quantized, twin, size)
        print(f"{name}: wrote both checkpoints in {time.perf_counter() - clock:.1f} s", file=sys.stderr, flush=True)
    bench.warm(*files_of(quantized), *files_of(twin))
    runs: dict[str, list] = {name: [], "bfloat16": []}
    before = os.getloadavg()[0]
    for _ in range(repeats):
        for label, directory in ((name, quantized), ("bfloat16", twin)):
            r = _measure.isolated(__file__, {"dir": str(directory), "mesh": mesh}, timeout=900)
            runs[label].append(r)
            shown = r if isinstance(r, str) else f"{r['seconds']:.3f} s, {_mb(r['peak_above_start'])} above start"
            print(f"  {label}: {shown}", file=sys.stderr, flush=True)
    results = {label: bench.median_run(rs, ("peak_above_start",)) for label, rs in runs.items()}
    sizes = {label: sum(p.stat().st_size for p in files_of(d)) for label, d in ((name, quantized), ("bfloat16", twin))}
    load = f"Load average (1 minute) before the runs {before:.2f}, after {os.getloadavg()[0]:.2f}."
    return table(name, size, results, sizes, largest_tensor(twin), mesh) + "\n\n" + load


def profile(name: str, size: str, mesh: str, work: Path, top: int = 25) -> str:
    spec = {"dir": str(work / f"{name}-{size}"), "mesh": mesh, "profile": True, "top": top}
    result = _measure.isolated(__file__, spec, timeout=900)
    text = result if isinstance(result, str) else result["profile"]
    return f"#### {name}: cProfile of one load, every thread, by own time\n\n```\n{text.strip()}\n```"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"from {', '.join(FORMATS)}")
    parser.add_argument("--size", default="1gb", choices=SIZES)
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help="where to write the checkpoints, kept (default: a temp dir)")
    parser.add_argument("--profile", action="store_true", help="also profile one quantized load per format")
    parser.add_argument("--out", type=Path, help="also write the tables as Markdown here")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one run, in a fresh process
    args = parser.parse_args()
    if args.measure:
        spec = json.loads(args.measure)
        print(json.dumps(profiled(spec) if spec.get("profile") else measure(spec)))
        return
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        parser.error(f"unknown format {unknown[0]!r}: one of {', '.join(FORMATS)}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="port-bench-quantized-"))
    sections = []
    try:
        for name in names:
            section = measured(name, args.size, args.mesh, args.repeats, work)
            if args.profile:
                section += "\n\n" + profile(name, args.size, args.mesh, work)
            print(section + "\n", flush=True)
            sections.append(section)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        notes = [
            (
                "Each figure is the median of the repeats (peak memory: the largest), each run a fresh process "
                "after the page cache was warmed; seconds cover `port.load` alone (not JAX start-up)."
            ),
        ]
        _measure.write(args.out, "Quantized checkpoints", "quantized.py", sections, notes)


if __name__ == "__main__":
    main()
