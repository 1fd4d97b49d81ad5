"""Benchmark: loading quantized checkpoints against the same model stored in bfloat16 (issue 33).

    python bench/quantized.py [--formats fp8] [--size 1gb] [--mesh 4x2] [--repeats 3]
                              [--workdir DIR] [--profile] [--out FILE]

For each format, two checkpoints of one model with random weights are written once: the
quantized one, laid out as the Hub's checkpoints of that format are, and its twin in
bfloat16 holding the dequantized values (the format's definition in float32, rounded to
bfloat16 to nearest even, as torch's `.to()` does). Both are loaded the same way,
`port.load(dir, mesh=...)` (`port.convert(...).model`, whose report gives the bytes read),
onto 8 simulated CPU devices, `--repeats` times each, each run in a fresh process after the
page cache was warmed (as bench/bench.py runs its methods: bench/_measure.py), and the
median is reported. After each run's clock stops, a digest of every array's shards is
taken: the two loads must give the same bytes.

  fp8   a Llama of TinyLlama-1.1B's shape (hidden 2048, SwiGLU 5632, 32 heads / 4 KV heads,
        vocab 32000) with 16 of its 22 layers: 0.98 GB in FP8, as DeepSeek-V3 and Qwen3
        `-FP8` ship it (`quant_method: "fp8"`, `weight_block_size: [128, 128]`): each linear
        weight of the layers float8 e4m3 with a float32 `weight_scale_inv` per 128x128 block
        (scale = the block's largest magnitude / 448); embeddings, norms and the head bfloat16.

Columns: seconds; peak anonymous memory (`RssAnon`, sampled every 2 ms) above its value
when the load started; that peak minus the arrays the load produced (on CPU the arrays
live in host memory: what is left is the load's own working memory); bytes read (the
checkpoint's count) and the plan's bytes to read (they must agree); and the bytes the most
loaded device holds. Under each table, the issue's bounds: the quantized load within 1.3x
the bfloat16 load's time, and its memory above the arrays within 1x the largest tensor.

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
import bench  # bench/bench.py: its measuring helpers

import _measure

TIME_BOUND = 1.3  # the quantized load's time, at most this times the bfloat16 load's
MEMORY_BOUND = 1.0  # memory above the arrays, at most this times the largest tensor

# TinyLlama-1.1B's shape; "1gb" keeps 16 of its 22 layers, "tiny" is the smoke test's.
SIZES = {
    "1gb": dict(hidden_size=2048, intermediate_size=5632, heads=32, kv_heads=4, vocab_size=32000, layers=16),
    "tiny": dict(hidden_size=256, intermediate_size=512, heads=4, kv_heads=2, vocab_size=1024, layers=2),
}


# ---------------------------------------------------------------- the checkpoints


def llama_config(size: dict) -> dict:
    """A Llama config.json of `size` (SIZES), in bfloat16."""
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


def llama_shapes(config: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every tensor of a Llama checkpoint: (shape, whether a quantized checkpoint quantizes it:
    the layers' linear weights, not the embeddings, norms or head)."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": ((v, h), False)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": ((h,), False),
            p + "self_attn.q_proj.weight": ((h, h), True),
            p + "self_attn.k_proj.weight": ((kv, h), True),
            p + "self_attn.v_proj.weight": ((kv, h), True),
            p + "self_attn.o_proj.weight": ((h, h), True),
            p + "post_attention_layernorm.weight": ((h,), False),
            p + "mlp.gate_proj.weight": ((inter, h), True),
            p + "mlp.up_proj.weight": ((inter, h), True),
            p + "mlp.down_proj.weight": ((h, inter), True),
        }
    shapes |= {"model.norm.weight": ((h,), False), "lm_head.weight": ((v, h), False)}
    return shapes


def fp8_blocks(weight, block: int = 128):
    """`weight` (float32 [M, N]) in FP8 e4m3 with one float32 scale per `block` x `block` block
    (the largest magnitude / 448; edge blocks partial), and the bfloat16 of what they dequantize to:
    (fp8 [M, N], weight_scale_inv [ceil(M/block), ceil(N/block)], bfloat16 [M, N])."""
    import torch

    m, n = weight.shape
    rows, cols = -(-m // block), -(-n // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:m, :n] = weight
    blocks = padded.view(rows, block, cols, block)
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    each = scale[:, None, :, None]
    fp8 = (blocks / each).to(torch.float8_e4m3fn)
    values = (fp8.float() * each).view(rows * block, cols * block)[:m, :n]
    return fp8.view(rows * block, cols * block)[:m, :n].contiguous(), scale, values.to(torch.bfloat16)


def write_fp8(quantized: Path, twin: Path, size: dict) -> None:
    """The FP8 Llama (`weight_scale_inv` per 128x128 block) at `quantized`, its bfloat16 twin at `twin`."""
    import torch
    from safetensors.torch import save_file

    config = llama_config(size)
    generator = torch.Generator().manual_seed(0)
    fp8, bf16 = {}, {}
    for key, (shape, quantize) in llama_shapes(config).items():
        if len(shape) == 1:
            fp8[key] = bf16[key] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        weight = torch.randn(shape, generator=generator) * 0.02
        if not quantize:
            fp8[key] = bf16[key] = weight.to(torch.bfloat16)
            continue
        fp8[key], fp8[key + "_scale_inv"], bf16[key] = fp8_blocks(weight)
    quantization = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    for directory, tensors, extra in ((quantized, fp8, {"quantization_config": quantization}), (twin, bf16, {})):
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config | extra, indent=2))


# name: (what, the model in words, writer(quantized dir, bfloat16 twin dir, size))
FORMATS: dict[str, tuple[str, str, Callable[[Path, Path, dict], None]]] = {
    "fp8": ("FP8 e4m3, 128x128 block scales", "Llama (TinyLlama-1.1B's shape)", write_fp8),
}


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
    """Load `spec["dir"]` once with `port.load` (as `port.convert(...)`) in this fresh process: its figures."""
    mesh = _measure.started(spec["mesh"])
    import jax

    import port

    _measure.back_memory(2 * sum(path.stat().st_size for path in files_of(Path(spec["dir"]))))
    os.sync()
    stop = _measure.peak_memory(0.002)
    start = time.perf_counter()
    run = port.convert(spec["dir"], mesh=mesh)
    jax.block_until_ready(run.model)
    seconds = time.perf_counter() - start
    peak = stop()
    return {
        "seconds": seconds,
        "peak_above_start": peak,
        "bytes_read": run.report.bytes_read,
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


def table(name: str, results: dict, largest: int, mesh: str) -> str:
    """The Markdown section of one format: a row per checkpoint, then the bounds."""
    what, model, _ = FORMATS[name]
    header = [
        "checkpoint",
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
            rows.append([label, f"failed: {r}"])
            continue
        ratio = f"{r['seconds'] / base['seconds']:.2f}" if isinstance(base, dict) else ""
        rows.append(
            [
                label,
                f"{r['seconds']:.3f}",
                _mb(r["peak_above_start"]),
                _mb(r["peak_above_start"] - r["total_device_bytes"]),
                _mb(r["bytes_read"]),
                _mb(r["plan_read_bytes"]),
                _mb(r["device_bytes"]),
                ratio,
            ]
        )
    lines = [f"### {what}: {model}, mesh {mesh}", "", _measure.markdown(header, rows)]
    quantized = results[name]
    if isinstance(quantized, dict) and isinstance(base, dict):
        ratio = quantized["seconds"] / base["seconds"]
        above = quantized["peak_above_start"] - quantized["total_device_bytes"]
        same = "the same" if quantized["digest"] == base["digest"] else "DIFFERENT"
        read = "=" if quantized["bytes_read"] == quantized["plan_read_bytes"] else "!="
        lines += [
            "",
            f"{name}: {ratio:.2f} x the bfloat16 load's time (bound {TIME_BOUND}: {_holds(ratio, TIME_BOUND)}); "
            f"memory above the arrays {_mb(above)} against the largest tensor {_mb(largest)} "
            f"(bound {MEMORY_BOUND:g}x: {_holds(above, MEMORY_BOUND * largest)}); bytes read {read} the plan's; "
            f"arrays {same} as the bfloat16 twin's (digest of every shard).",
        ]
    return "\n".join(lines)


def measured(name: str, size: str, mesh: str, repeats: int, work: Path) -> str:
    """Both checkpoints of format `name` (written once under `work`), loaded `repeats` times each: its section."""
    quantized, twin = work / f"{name}-{size}", work / f"{name}-{size}-bf16"
    if not files_of(quantized) or not files_of(twin):
        clock = time.perf_counter()
        FORMATS[name][2](quantized, twin, SIZES[size])
        print(f"{name}: wrote both checkpoints in {time.perf_counter() - clock:.1f} s", file=sys.stderr, flush=True)
    bench.warm(*files_of(quantized), *files_of(twin))
    runs: dict[str, list] = {name: [], "bfloat16": []}
    for _ in range(repeats):
        for label, directory in ((name, quantized), ("bfloat16", twin)):
            r = _measure.isolated(__file__, {"dir": str(directory), "mesh": mesh}, timeout=900)
            runs[label].append(r)
            shown = r if isinstance(r, str) else f"{r['seconds']:.3f} s, {_mb(r['peak_above_start'])} above start"
            print(f"  {label}: {shown}", file=sys.stderr, flush=True)
    results = {label: bench.median_run(rs, ("peak_above_start",)) for label, rs in runs.items()}
    return table(name, results, largest_tensor(twin), mesh)


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
            f"Load average before the runs: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.",
            (
                "Each figure is the median of the repeats (peak memory: the largest), each run a fresh process "
                "after the page cache was warmed; seconds cover `port.load` alone (not JAX start-up)."
            ),
        ]
        _measure.write(args.out, "Quantized checkpoints", "quantized.py", sections, notes)


if __name__ == "__main__":
    main()
