"""Benchmark: a PEFT LoRA adapter loaded merged onto a sharded base, and a LoRA train step (issue 37).

    python bench/lora.py [--parts load,train] [--size 1gb|tiny] [--mesh 4x2] [--repeats 5]
                         [--batch 4] [--seq 256] [--steps 2] [--workdir DIR] [--out FILE]

`load`: a Llama-shaped checkpoint of random bfloat16 weights (TinyLlama-1.1B's widths,
bench/quantized.py's, with 9 of its 22 layers: 1.05 GB in one file) and a rank-16 PEFT
adapter on every projection (q, k, v, o, gate, up, down; `lora_alpha` 32), written as PEFT
0.21 writes one (`adapter_config.json` by peft's own `LoraConfig.save_pretrained`;
`adapter_model.safetensors`, float32 factors, random and non-zero, under PEFT's key names).
Both loads run `port.convert(base, mesh=...)` (what `port.load` returns the model of), one
with `adapter=DIR` (merged: each device's block is its base block plus the scaled `B @ A`
of only the rows and columns it needs), onto 8 simulated CPU devices, `--repeats` times
each in alternating rounds, each run in a fresh process after the page cache was warmed
(bench/bench.py's and bench/quantized.py's way, with their helpers). Columns as
bench/quantized.py's: seconds, peak anonymous memory (`RssAnon`, sampled every 2 ms) above
its value when the load started, that peak minus the arrays produced (on CPU the arrays
live in host memory: what is left is the load's own working memory), bytes read (the
report's; of them, those read from the adapter) and the plan's bytes to read, the bytes on the most loaded device. Under the
table, the issue's bounds: the merged load within 1.15x the base load's time, its memory
above the arrays within 1x the largest tensor. Two more rows: the merged load with
`OPENBLAS_NUM_THREADS=1` (each of port's reading threads then multiplies `B @ A` on its
own thread: NumPy's OpenBLAS otherwise starts its own threads per product, many more than
2 cores), and the merge's arithmetic alone (`measure_product`: every adapted weight already
in memory, merged by NumPy on one thread in bands of rows; no read, no placement), the
floor the merged load's extra time is measured against.

`train`: one jitted step (forward with `remat="full"`, `port.nn.next_token_loss`,
`jax.value_and_grad`, an optax Adam update, parameters and optimizer state donated) of a
Llama loaded with `port.load(..., mesh=...)` from a float32 checkpoint (bench/_measure.py's
"llama", 125M parameters: the 1 GB model's full fine-tuning step takes minutes here), the
batch sharded on `data`: full fine-tuning (every parameter trained) against LoRA (rank 16,
alpha 32, `port.nn.LoRA.attach` on every projection, the factors sharded as their weight
is, `eqx.partition(model, port.nn.trainable(model))`: only the factors trained). Columns:
trainable parameters, the optimizer state's bytes, compile seconds, seconds per step (the
median after the first), tokens per second, XLA's temporary bytes
(`memory_analysis().temp_size_in_bytes`) of the compiled step, and its flops: XLA's
`cost_analysis()` of the step lowered with the layer loop unrolled (XLA counts a loop's
body once; the timed step keeps the loop).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# bench/bench.py's warm-up and medians, bench/quantized.py's Llama checkpoints, bench/moe.py's flops
import moe
import quantized

import bench

import _measure

TIME_BOUND = 1.15  # the merged load's time, at most this times the base load's
MEMORY_BOUND = 1.0  # memory above the arrays, at most this times the largest tensor
RANK, ALPHA = 16, 32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LEARNING_RATE = 1e-3
BAND = 256  # rows merged at a time by the product's floor (measure_product)

# The loaded model (bfloat16) and the trained one (float32), by --size.
LOAD = {"1gb": quantized.LLAMA["1gb"] | {"layers": 9}, "tiny": quantized.LLAMA["tiny"]}
TRAIN = {
    "1gb": dict(hidden_size=768, intermediate_size=2048, heads=12, kv_heads=4, vocab_size=32000, layers=12),
    "tiny": quantized.LLAMA["tiny"],
}
# port.models.llama's leaves of the projections (stacked over layers) and how many of their
# own axes are inputs: `wo` is [layers, embed, heads, head_dim], the rest [layers, *out, in].
LEAVES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "gate": 1, "up": 1, "down": 1}


# ---------------------------------------------------------------- the checkpoints


def write_base(directory: Path, size: dict, dtype: str) -> None:
    """A Llama of `size` (quantized.LLAMA's keys) with random weights in `dtype`, norms ones."""
    import torch
    from safetensors.torch import save_file

    config = quantized.llama_config(size) | {"torch_dtype": dtype}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for key, shape in quantized.llama_shapes(config).items():
        value = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * 0.02
        tensors[key] = value.to(getattr(torch, dtype))
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def write_adapter(directory: Path, base: Path) -> None:
    """A rank-`RANK` PEFT LoRA adapter on every projection of the Llama at `base`, as PEFT saves
    one: the config by peft itself, float32 factors `base_model.model.<module>.lora_A.weight`
    [r, in] and `...lora_B.weight` [out, r], random (B non-zero, as after training)."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for key, shape in quantized.llama_shapes(config).items():
        module = key.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in PROJECTIONS:
            out, inputs = shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, inputs, generator=generator) * 0.01
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out, RANK, generator=generator) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(PROJECTIONS), task_type="CAUSAL_LM")
    lora.base_model_name_or_path = str(base)
    lora.save_pretrained(str(directory))


def checkpoints(work: Path, size: str, parts: list[str]) -> dict[str, Path]:
    """The checkpoints of `size` the `parts` need under `work`, each written once: base (bfloat16) and
    its adapter for "load", train (float32) for "train"."""
    paths = {"base": work / f"base-{size}", "adapter": work / f"adapter-{size}", "train": work / f"train-{size}"}
    for name, write in (
        ("base", lambda p: write_base(p, LOAD[size], "bfloat16")),
        ("adapter", lambda p: write_adapter(p, paths["base"])),
        ("train", lambda p: write_base(p, TRAIN[size], "float32")),
    ):
        if ("train" if name == "train" else "load") in parts and not any(paths[name].glob("*.safetensors")):
            clock = time.perf_counter()
            write(paths[name])
            print(f"wrote {paths[name]} in {time.perf_counter() - clock:.1f} s", file=sys.stderr, flush=True)
    return paths


# ---------------------------------------------------------------- measured processes


def measure_product(spec: dict) -> dict:
    """The merge's own arithmetic, in this fresh process, as a floor for the merged load's extra
    time: every adapted weight, already in memory, merged by NumPy in bands of `BAND` rows into
    reused buffers (`base + (scale * B) @ A`, summed in float32, rounded once to bfloat16), on one
    thread, with no read, no placement and no sharding."""
    import numpy as np
    from safetensors import safe_open

    import port

    config = json.loads((Path(spec["adapter"]) / "adapter_config.json").read_text())
    scale = np.float32(config["lora_alpha"] / config["r"])
    factors: dict[str, dict[str, np.ndarray]] = {}
    with safe_open(str(Path(spec["adapter"]) / "adapter_model.safetensors"), "np") as f:
        for key in f.keys():
            module, factor = key.removeprefix("base_model.model.").rsplit(".", 2)[:2]
            factors.setdefault(module + ".weight", {})[factor] = f.get_tensor(key)
    with port.open_checkpoint(spec["dir"]) as base:
        weights = {key: base.read(key, tuple((0, n) for n in base.tensors[key].shape)) for key in factors}
    clock = time.perf_counter()
    for key, weight in weights.items():
        b, a = factors[key]["lora_B"] * scale, factors[key]["lora_A"]
        band = np.empty((min(BAND, weight.shape[0]), weight.shape[1]), np.float32)
        for start in range(0, weight.shape[0], BAND):
            rows = slice(start, start + BAND)
            part = band[: len(weight[rows])]
            np.matmul(b[rows], a, out=part)
            part += weight[rows].astype(np.float32)
            weight[rows] = part.astype(weight.dtype)
    return {"seconds": time.perf_counter() - clock}


def factor_specs(weight, inputs: int):
    """The `PartitionSpec`s of a LoRA's `a` [layers, rank, *in] and `b` [layers, *out, rank] on
    `weight` [layers, *out, *in]: each axis sharded as the weight's axis it spans, rank not."""
    from jax.sharding import PartitionSpec

    spec = tuple(weight.sharding.spec) + (None,) * (weight.ndim - len(weight.sharding.spec))
    stack, outs, ins = spec[:1], spec[1 : weight.ndim - inputs], spec[weight.ndim - inputs :]
    return PartitionSpec(*stack, None, *ins), PartitionSpec(*stack, *outs, None)


def with_adapters(model, key):
    """`model` (port.models.llama, loaded on a mesh) with a rank-`RANK` LoRA on every projection
    (`port.nn.LoRA.attach`, as PEFT initialises one), the factors sharded as their weight is."""
    import equinox as eqx
    import jax
    from jax.sharding import NamedSharding

    import port.nn as pnn

    def where(m):
        return [getattr(m.blocks.attn if name.startswith("w") else m.blocks.mlp, name) for name in LEAVES]

    nodes = []
    for inputs, weight, k in zip(LEAVES.values(), where(model), jax.random.split(key, len(LEAVES))):
        node = pnn.LoRA.attach(weight, inputs=inputs, rank=RANK, scale=ALPHA / RANK, key=k, stack=1)
        a_spec, b_spec = factor_specs(weight, inputs)
        mesh = weight.sharding.mesh
        a = jax.device_put(node.a, NamedSharding(mesh, a_spec))
        b = jax.device_put(node.b, NamedSharding(mesh, b_spec))
        nodes.append(eqx.tree_at(lambda n: (n.a, n.b), node, (a, b)))
    return eqx.tree_at(where, model, nodes)


def unrolled_flops(function, *args) -> float | None:
    """XLA's flops of `jax.jit(function)` lowered with every `jax.lax.scan` unrolled: XLA's cost
    analysis counts a loop's body once, so the step as run (the layers in a scan) shows one
    layer's cost. Lowered only, for the count: the timed step keeps its loop."""
    import jax

    scan = jax.lax.scan
    jax.lax.scan = functools.partial(scan, unroll=True)
    try:
        lowered = jax.jit(function).lower(*args)
    finally:
        jax.lax.scan = scan
    return moe.flops_of(lowered)


def measure_train(spec: dict) -> dict:
    """One (mode: full or lora) train step in this fresh process: compile, then `steps` + 1 steps."""
    mesh = _measure.started(spec["mesh"])
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    import port
    import port.nn as pnn

    model = port.load(spec["dir"], mesh=mesh)
    if spec["mode"] == "lora":
        model = with_adapters(model, jax.random.key(2))
        params, frozen = eqx.partition(model, pnn.trainable(model))
    else:
        params, frozen = eqx.partition(model, eqx.is_inexact_array)
    del model
    frozen, static = eqx.partition(frozen, eqx.is_array)  # the frozen arrays are arguments, not constants
    optimizer = optax.adam(LEARNING_RATE)
    state = optimizer.init(params)
    vocab = TRAIN[spec["size"]]["vocab_size"]
    ids = jax.random.randint(jax.random.key(1), (spec["batch"], spec["seq"]), 0, vocab, dtype=jnp.int32)
    ids = jax.device_put(ids, NamedSharding(mesh, PartitionSpec("data", None)))

    def loss_fn(params, frozen, ids):
        model = eqx.combine(params, frozen, static)
        return pnn.next_token_loss(model(ids, remat="full"), ids)

    def step(params, state, frozen, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, frozen, ids)
        updates, state = optimizer.update(grads, state, params)
        return eqx.apply_updates(params, updates), state, loss

    jax.block_until_ready((params, state, frozen, ids))
    flops = unrolled_flops(step, params, state, frozen, ids)
    clock = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, frozen, ids).compile()
    compile_seconds = time.perf_counter() - clock
    analysis = compiled.memory_analysis()
    temp = getattr(analysis, "temp_size_in_bytes", None) if analysis is not None else None
    seconds, losses = [], []
    for _ in range(spec["steps"] + 1):
        clock = time.perf_counter()
        params, state, loss = compiled(params, state, frozen, ids)
        jax.block_until_ready((params, state, loss))
        seconds.append(time.perf_counter() - clock)
        losses.append(float(loss))
    per_step = _measure.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    return {
        "trainable": _measure.parameters(params),
        "parameters": _measure.parameters(params) + _measure.parameters(frozen),
        "optimizer_bytes": sum(x.nbytes for x in jax.tree.leaves(state) if eqx.is_array(x)),
        "compile_seconds": compile_seconds,
        "seconds": per_step,
        "tokens_per_second": spec["batch"] * spec["seq"] / per_step,
        "xla_temp": temp,
        "flops": flops,
        "losses": losses,
    }


# ---------------------------------------------------------------- driver


def _holds(value: float, bound: float) -> str:
    return "holds" if value <= bound else "EXCEEDED"


def load_table(size: str, mesh: str, results: dict, adapter_bytes: int, largest: int) -> str:
    """The merged load against the base load: a row each, then the bounds."""
    c = LOAD[size]
    header = [
        "load",
        "seconds",
        "peak anon memory above start",
        "memory above the arrays",
        "bytes read",
        "of which from the adapter",
        "plan: bytes to read",
        "bytes per device",
        "x base (time)",
    ]
    base = results[BASE]
    rows = []
    for label, r in results.items():
        if not isinstance(r, dict):
            rows.append([label, f"failed: {r}"])
            continue
        ratio = f"{r['seconds'] / base['seconds']:.2f}" if isinstance(base, dict) else ""
        if "peak_above_start" not in r:  # the arithmetic alone: seconds only
            rows.append([label, f"{r['seconds']:.3f}", *["-"] * 6, ratio])
            continue
        rows.append(
            [
                label,
                f"{r['seconds']:.3f}",
                _measure.mb(r["peak_above_start"]),
                _measure.mb(r["peak_above_start"] - r["total_device_bytes"]),
                _measure.mb(r["bytes_read"]),
                _measure.mb(r["adapter_bytes_read"]),
                _measure.mb(r["plan_read_bytes"]),
                _measure.mb(r["device_bytes"]),
                ratio,
            ]
        )
    title = (
        f"### Merged LoRA load: Llama, hidden {c['hidden_size']}, SwiGLU {c['intermediate_size']}, "
        f"{c['heads']} / {c['kv_heads']} heads, {c['layers']} layers, vocab {c['vocab_size']}, bfloat16; "
        f"rank-{RANK} adapter on every projection ({_measure.mb(adapter_bytes)}); mesh {mesh}"
    )
    lines = [title, "", _measure.markdown(header, rows)]
    for label, merged in results.items():
        if not (label.startswith(MERGED) and isinstance(merged, dict) and isinstance(base, dict)):
            continue
        ratio = merged["seconds"] / base["seconds"]
        above = merged["peak_above_start"] - merged["total_device_bytes"]
        lines += [
            "",
            f"{label}: {ratio:.2f} x the base load's time (bound {TIME_BOUND}: {_holds(ratio, TIME_BOUND)}); "
            f"memory above the arrays {_measure.mb(above)} against the largest tensor {_measure.mb(largest)} "
            f"(bound {MEMORY_BOUND:g}x: {_holds(above, MEMORY_BOUND * largest)}); bytes read "
            f"{merged['bytes_read'] - base['bytes_read']:+,} B against the base load's, "
            f"{merged['adapter_bytes_read']:,} B of them from the adapter (its file {adapter_bytes:,} B: "
            "each device's block reads the rows of B and the columns of A it needs).",
        ]
    return "\n".join(lines)


# The load rows: (kind, with the adapter, environment of the measured process).
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1"}  # NumPy's BLAS on one thread in each reading thread
MERGED, BASE = "base + adapter (merged)", "base alone"
LOADS = {
    MERGED: ("load", True, {}),
    f"{MERGED}, OPENBLAS_NUM_THREADS=1": ("load", True, ONE_THREAD),
    BASE: ("load", False, {}),
    "the merge's arithmetic alone (NumPy, in memory, one thread)": ("product", True, ONE_THREAD),
}


def isolated(spec: dict, env: dict[str, str]) -> dict | str:
    """`_measure.isolated` of this script with `env` added to the measured process's environment."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return _measure.isolated(__file__, spec, timeout=900)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def measured_load(paths: dict, size: str, mesh: str, repeats: int) -> str:
    base, adapter = paths["base"], paths["adapter"]
    bench.warm(*quantized.files_of(base), *quantized.files_of(adapter))
    runs: dict[str, list] = {label: [] for label in LOADS}
    before = os.getloadavg()[0]
    for _ in range(repeats):
        for label, (kind, with_adapter, env) in LOADS.items():
            spec = {"kind": kind, "dir": str(base), "adapter": str(adapter) if with_adapter else None, "mesh": mesh}
            r = isolated(spec, env)
            runs[label].append(r)
            shown = r if isinstance(r, str) else f"{r['seconds']:.3f} s"
            print(f"  {label}: {shown}", file=sys.stderr, flush=True)
    results = {
        label: bench.median_run(rs, ("peak_above_start",) if LOADS[label][0] == "load" else ())
        for label, rs in runs.items()
    }
    adapter_bytes = sum(p.stat().st_size for p in quantized.files_of(adapter))
    load = f"Load average (1 minute) before the runs {before:.2f}, after {os.getloadavg()[0]:.2f}."
    return load_table(size, mesh, results, adapter_bytes, quantized.largest_tensor(base)) + "\n\n" + load


def train_table(title: str, results: list[tuple[str, dict | str]]) -> str:
    header = [
        "step",
        "parameters",
        "trained",
        "optimizer state",
        "compile s",
        "s / step",
        "tokens / s",
        "XLA temp",
        "XLA flops",
        "loss first → last",
    ]
    rows = []
    for mode, r in results:
        if not isinstance(r, dict):
            rows.append([mode, f"failed: {r}"])
            continue
        rows.append(
            [
                mode,
                f"{r['parameters'] / 1e6:.1f} M",
                f"{r['trainable'] / 1e6:.2f} M",
                _measure.mb(r["optimizer_bytes"]),
                f"{r['compile_seconds']:.1f}",
                f"{r['seconds']:.3f}",
                f"{r['tokens_per_second']:,.0f}",
                _measure.mb(r["xla_temp"]) if r["xla_temp"] is not None else "-",
                f"{r['flops'] / 1e9:,.1f} G" if r["flops"] else "-",
                f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f}",
            ]
        )
    return f"### {title}\n\n" + _measure.markdown(header, rows)


def measured_train(paths: dict, size: str, mesh: str, args) -> str:
    c = TRAIN[size]
    before = os.getloadavg()[0]
    results = []
    for mode in ("full fine-tuning", "LoRA"):
        spec = {
            "kind": "train",
            "mode": "lora" if mode == "LoRA" else "full",
            "dir": str(paths["train"]),
            "size": size,
            "mesh": mesh,
            "batch": args.batch,
            "seq": args.seq,
            "steps": args.steps,
        }
        r = _measure.isolated(__file__, spec, timeout=1800)
        print(f"  {mode}: " + (f"{r['seconds']:.3f} s/step" if isinstance(r, dict) else r), file=sys.stderr)
        results.append((mode, r))
    title = (
        f"Train step: Llama, hidden {c['hidden_size']}, SwiGLU {c['intermediate_size']}, {c['heads']} / "
        f"{c['kv_heads']} heads, {c['layers']} layers, vocab {c['vocab_size']}, float32; batch {args.batch} x "
        f'{args.seq} tokens, remat "full", Adam, mesh {mesh}, median of {args.steps} steps'
    )
    load = f"Load average (1 minute) before the runs {before:.2f}, after {os.getloadavg()[0]:.2f}."
    return train_table(title, results) + "\n\n" + load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="load,train", help="from load, train")
    parser.add_argument("--size", default="1gb", choices=tuple(LOAD))
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--repeats", type=int, default=5, help="loads of each kind")
    parser.add_argument("--batch", type=int, default=4, help="train step: sequences (a multiple of the data axis)")
    parser.add_argument("--seq", type=int, default=256, help="train step: tokens per sequence")
    parser.add_argument("--steps", type=int, default=2, help="train step: timed steps after the first")
    parser.add_argument("--workdir", type=Path, help="where to write the checkpoints, kept (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="also write the tables as Markdown here")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one run, in a fresh process
    args = parser.parse_args()
    if args.measure:
        spec = json.loads(args.measure)
        measures = {"load": quantized.measure, "product": measure_product, "train": measure_train}
        print(json.dumps(measures[spec["kind"]](spec)))
        return
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in ("load", "train")]
    if unknown:
        parser.error(f"--parts: {unknown[0]!r} is not one of load, train")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="port-bench-lora-"))
    sections = []
    try:
        paths = checkpoints(work, args.size, parts)
        if "load" in parts:
            sections.append(measured_load(paths, args.size, args.mesh, args.repeats))
            print(sections[-1] + "\n", flush=True)
        if "train" in parts:
            sections.append(measured_train(paths, args.size, args.mesh, args))
            print(sections[-1] + "\n", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.out:
        notes = [
            (
                "Each load figure is the median of the repeats (peak memory: the largest), each run a fresh "
                "process after the page cache was warmed; seconds cover `port.convert` alone (not JAX start-up). "
                "Each train row is one fresh process; seconds per step are the median after the first."
            ),
        ]
        _measure.write(args.out, "LoRA adapters", "lora.py", sections, notes)


if __name__ == "__main__":
    main()
