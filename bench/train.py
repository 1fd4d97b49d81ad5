"""Benchmark: one jitted training step of port's decoders, with and without rematerialisation.

    python bench/train.py [--models gpt2,llama] [--batch 8] [--seq 512] [--steps 5]
                          [--remat off,true,dots] [--dtype float32|bfloat16] [--layers N]
                          [--out docs/train.md]

The step is what a user writes with port.nn: forward, `port.nn.next_token_loss` on the
batch's own ids, `jax.value_and_grad`, and an SGD update by `eqx.apply_updates`, all in one
`jax.jit` that donates the parameters:

    loss = next_token_loss(model(ids, remat=..., dtype=...), ids)

Models (random weights, float32 parameters; `bench/_measure.py` holds the configs):
  gpt2   `port.models.gpt2.GPT2`, GPT-2 small: 768 wide, 12 layers, 12 heads, vocab 50257
  llama  `port.models.llama.Llama` of about the same size: 768 wide, 12 layers, 12 heads,
         4 kv heads, SwiGLU 2048, vocab 32000, untied head

`--remat`: "off" calls the model without `remat`; "true" passes `remat=True` (recompute each
layer in the backward pass); "dots" passes `remat="dots"` (keep the matmul outputs).
`--dtype bfloat16` passes `dtype=jnp.bfloat16` (bfloat16 compute on the float32 parameters,
float32 gradients); float32 passes no `dtype`. `--layers` overrides the depth (smoke runs).

Each (model, remat) runs in a fresh process. Compile seconds are `jit(step).lower(...).compile()`
(tracing included). The step then runs `--steps` + 1 times on the same batch; seconds per step
are the median of all but the first. Memory is anonymous resident memory (`RssAnon`) sampled
every 5 ms by another process, above its value once the model and the batch exist (so the
parameters themselves are not counted; on CPU everything lives in host memory, on an
accelerator this is host memory only): the peak while compiling, and the peak while stepping
(the compiled program kept). "XLA temp" is the compiled step's `memory_analysis()` temporary
bytes: the activations kept for the backward pass, which rematerialisation trades for compute.
The loss column (first and last step) shows the steps train and that remat changes no values.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _measure

LEARNING_RATE = 1e-2
REMAT = {"off": None, "true": True, "dots": "dots"}


def measure(spec: dict) -> dict:
    """One (model, remat, dtype) in this fresh process: compile, then `steps` + 1 steps."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import port.nn as pnn

    model, vocab = _measure.build(spec["model"], spec["layers"])
    count = _measure.parameters(model)
    ids = jax.random.randint(jax.random.key(1), (spec["batch"], spec["seq"]), 0, vocab, dtype=jnp.int32)
    kwargs = {}  # only the keywords asked for: the call with none is the default path
    if REMAT[spec["remat"]] is not None:
        kwargs["remat"] = REMAT[spec["remat"]]
    if spec["dtype"] != "float32":
        kwargs["dtype"] = jnp.dtype(spec["dtype"])
    params, static = eqx.partition(model, eqx.is_inexact_array)
    del model

    def loss_fn(params, ids):
        return pnn.next_token_loss(eqx.combine(params, static)(ids, **kwargs), ids)

    def step(params, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        updates = jax.tree.map(lambda g: -LEARNING_RATE * g, grads)
        return eqx.apply_updates(params, updates), loss

    jax.block_until_ready((params, ids))
    start = _measure.rss()
    stop = _measure.peak_memory()
    clock = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(params, ids).compile()
    compile_seconds = time.perf_counter() - clock
    compile_peak = stop()
    analysis = compiled.memory_analysis()
    temp = getattr(analysis, "temp_size_in_bytes", None) if analysis is not None else None

    before_steps = _measure.rss() - start
    stop = _measure.peak_memory()
    seconds, losses = [], []
    for _ in range(spec["steps"] + 1):
        clock = time.perf_counter()
        params, loss = compiled(params, ids)
        jax.block_until_ready((params, loss))
        seconds.append(time.perf_counter() - clock)
        losses.append(float(loss))
    steps_peak = before_steps + stop()
    per_step = _measure.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    return {
        "parameters": count,
        "compile_seconds": compile_seconds,
        "seconds": per_step,
        "first_step": seconds[0],
        "tokens_per_second": spec["batch"] * spec["seq"] / per_step,
        "compile_peak": compile_peak,
        "steps_peak": steps_peak,
        "xla_temp": temp,
        "losses": losses,
    }


def table(title: str, results: list[tuple[str, str, dict | str]]) -> str:
    header = [
        "model",
        "remat",
        "parameters",
        "compile s",
        "s / step",
        "tokens / s",
        "peak anon memory above start: compile",
        "peak anon memory above start: steps",
        "XLA temp",
        "loss first → last",
    ]
    rows = []
    for model, remat, r in results:
        shown = {"off": "off", "true": "True", "dots": '"dots"'}[remat]
        if not isinstance(r, dict):
            rows.append([model, shown, f"failed: {r}"])
            continue
        temp = _measure.mb(r["xla_temp"]) if r["xla_temp"] is not None else "-"
        rows.append(
            [
                model,
                shown,
                f"{r['parameters'] / 1e6:.1f} M",
                f"{r['compile_seconds']:.1f}",
                f"{r['seconds']:.3f}",
                f"{r['tokens_per_second']:,.0f}",
                _measure.mb(r["compile_peak"]),
                _measure.mb(r["steps_peak"]),
                temp,
                f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f}",
            ]
        )
    return f"### {title}\n\n" + _measure.markdown(header, rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama", help=f"from {', '.join(_measure.CONFIGS)}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the first")
    parser.add_argument("--remat", default="off,true,dots", help="from off, true, dots")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    parser.add_argument("--layers", type=int, help="override the depth (smoke runs)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    models, remats = args.models.split(","), args.remat.lower().split(",")
    for name in models:
        if name not in _measure.CONFIGS:
            parser.error(f"--models: {name!r} is not one of {', '.join(_measure.CONFIGS)}")
    for remat in remats:
        if remat not in REMAT:
            parser.error(f"--remat: {remat!r} is not one of {', '.join(REMAT)}")
    results = []
    for model in models:
        for remat in remats:
            spec = {
                "model": model,
                "remat": remat,
                "batch": args.batch,
                "seq": args.seq,
                "steps": args.steps,
                "dtype": args.dtype,
                "layers": args.layers,
            }
            r = _measure.isolated(__file__, spec)
            print(
                f"{model} remat={remat}: " + (f"{r['seconds']:.3f} s/step" if isinstance(r, dict) else r),
                file=sys.stderr,
                flush=True,
            )
            results.append((model, remat, r))
    depth = f", {args.layers} layers" if args.layers else ""
    title = (
        f"Train step: batch {args.batch} x {args.seq} tokens{depth}, float32 parameters, "
        f"{args.dtype} compute, median of {args.steps} steps"
    )
    section = table(title, results)
    print(section)
    if args.out:
        notes = [
            (
                "Each row is one fresh process: `jax.jit` of forward + `port.nn.next_token_loss` + "
                "`jax.value_and_grad` + an SGD update (`eqx.apply_updates`), parameters donated. Compile "
                "seconds include tracing; seconds per step are the median of the timed steps after the first. "
                "Peak memory is `RssAnon` sampled every 5 ms above its value once the model and batch "
                "existed (parameters not counted), while compiling and while stepping; on an accelerator it "
                "is host memory only. XLA temp is the compiled step's temporary buffers "
                "(`memory_analysis().temp_size_in_bytes`): what rematerialisation saves."
            )
        ]
        _measure.write(args.out, "Training step", "train.py", [section], notes)


if __name__ == "__main__":
    main()
