"""Benchmark: greedy and sampled decoding with port's key/value cache against re-running the whole prefix.

    python bench/decode.py [--models llama,gpt2] [--batches 1,8] [--prompt 64] [--new 64]
                           [--repeats 3] [--layers N] [--out docs/decode.md]

Three ways to add `--new` tokens to a `--prompt`-token random prompt (random weights,
float32; the models of bench/train.py, see `bench/_measure.py`):

  cache      `port.nn.generate(model, ids, max_new_tokens=new)`, greedy: one jitted prefill
             of the prompt into the cache, then one jitted decode step (the model and the
             argmax; compiled once: its shapes do not change) for each further token.
  sample     the same with `key=jax.random.key(0), temperature=0.7, top_k=50, top_p=0.9`:
             each step also runs transformers' processors (a sort of the vocabulary for
             top-k and one for top-p), the draw and the key's split, in the same jitted step.
  recompute  the baseline a user writes without a cache: one buffer of the final length
             (prompt + new, zero-padded on the right), one jitted function that runs the
             model on the whole buffer, takes the argmax of the logits at the current
             length and writes it into the buffer; called once per new token with the
             position as a traced scalar, so it compiles once. (Causal attention: the
             padding after the current position changes nothing before it. Re-jitting
             for every prefix length instead would compile `--new` programs, slower still.)

Each (model, method, batch) runs in a fresh process: one untimed call (it compiles; its
seconds are the "first call" column), then `--repeats` timed calls, the median reported.
tokens/s counts the new tokens of every sequence (batch x new / seconds); speedup is the
recompute row's seconds over the row's. The greedy methods' tokens are compared, and a
mismatch is printed loudly (float rounding differs between the two programs, so a near-tie
in the logits could flip an argmax; with these random weights none is expected).
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

METHODS = ("cache", "sample", "recompute")
SAMPLING = dict(temperature=0.7, top_k=50, top_p=0.9)  # the `sample` method's processors


def measure(spec: dict) -> dict:
    """One (model, method, batch) in this fresh process: a first (compiling) call, then `repeats` timed."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import port.nn as pnn

    model, vocab = _measure.build(spec["model"], spec["layers"])
    batch, prompt, new = spec["batch"], spec["prompt"], spec["new"]
    # The same prompts in every process (and for both methods).
    ids = jax.random.randint(jax.random.key(1), (batch, prompt), 0, vocab, dtype=jnp.int32)

    if spec["method"] == "cache":

        def run():
            return pnn.generate(model, ids, max_new_tokens=new)
    elif spec["method"] == "sample":

        def run():
            return pnn.generate(model, ids, max_new_tokens=new, key=jax.random.key(0), **SAMPLING)
    else:

        @eqx.filter_jit
        def step(model, buffer, length):
            logits = model(buffer)  # [batch, prompt + new, vocab]
            last = jax.lax.dynamic_index_in_dim(logits, length - 1, axis=1, keepdims=False)
            token = jnp.argmax(last, axis=-1).astype(buffer.dtype)
            return jax.lax.dynamic_update_index_in_dim(buffer, token[:, None], length, axis=1)

        def run():
            buffer = jnp.zeros((batch, prompt + new), ids.dtype).at[:, :prompt].set(ids)
            for length in range(prompt, prompt + new):
                buffer = step(model, buffer, jnp.asarray(length, jnp.int32))
            return buffer

    clock = time.perf_counter()
    out = jax.block_until_ready(run())
    first = time.perf_counter() - clock
    seconds = []
    for _ in range(spec["repeats"]):
        clock = time.perf_counter()
        out = jax.block_until_ready(run())
        seconds.append(time.perf_counter() - clock)
    median = _measure.median(seconds)
    return {
        "first_call": first,
        "seconds": median,
        "tokens_per_second": batch * new / median,
        "tokens": np.asarray(out)[:, prompt:].tolist(),
    }


def compare(a: dict | str, b: dict | str) -> str | None:
    """Where two runs' tokens differ (None: the same, or nothing to compare)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None
    rows = [
        (i, j) for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) for j, (p, q) in enumerate(zip(x, y)) if p != q
    ]
    if not rows:
        return None
    sequence, position = rows[0]
    return (
        f"{len(rows)} of {sum(len(x) for x in a['tokens'])} new tokens differ; first in sequence {sequence} "
        f"at new token {position}: cache {a['tokens'][sequence][position]}, "
        f"recompute {b['tokens'][sequence][position]}"
    )


def table(title: str, results: dict, models: list[str], batches: list[int]) -> tuple[str, list[str]]:
    header = ["model", "method", "batch", "first call s (compiles)", "seconds", "tokens / s", "speedup", "same tokens"]
    rows, mismatches = [], []
    for model in models:
        for batch in batches:
            base = results[model, "recompute", batch]
            problem = compare(results[model, "cache", batch], base)
            if problem:
                mismatches.append(f"MISMATCH {model} batch {batch}: {problem}")
            for method in METHODS:
                r = results[model, method, batch]
                if not isinstance(r, dict):
                    rows.append([model, method, str(batch), f"failed: {r}"])
                    continue
                speedup = f"{base['seconds'] / r['seconds']:.1f}x" if isinstance(base, dict) else "-"
                same = "-" if method != "cache" or not isinstance(base, dict) else ("NO" if problem else "yes")
                rows.append(
                    [
                        model,
                        method,
                        str(batch),
                        f"{r['first_call']:.2f}",
                        f"{r['seconds']:.3f}",
                        f"{r['tokens_per_second']:,.1f}",
                        speedup,
                        same,
                    ]
                )
    text = f"### {title}\n\n" + _measure.markdown(header, rows)
    if mismatches:
        text += "\n\n" + "\n\n".join(f"**{m}**" for m in mismatches)
    return text, mismatches


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,gpt2", help=f"from {', '.join(_measure.CONFIGS)}")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, help="override the depth (smoke runs)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    models, batches = args.models.split(","), [int(b) for b in args.batches.split(",")]
    for name in models:
        if name not in _measure.CONFIGS:
            parser.error(f"--models: {name!r} is not one of {', '.join(_measure.CONFIGS)}")
    results = {}
    for model in models:
        for batch in batches:
            for method in METHODS:
                spec = {
                    "model": model,
                    "method": method,
                    "batch": batch,
                    "prompt": args.prompt,
                    "new": args.new,
                    "repeats": args.repeats,
                    "layers": args.layers,
                }
                r = _measure.isolated(__file__, spec)
                print(
                    f"{model} {method} batch {batch}: " + (f"{r['seconds']:.3f} s" if isinstance(r, dict) else r),
                    file=sys.stderr,
                    flush=True,
                )
                results[model, method, batch] = r
    depth = f", {args.layers} layers" if args.layers else ""
    title = f"Decoding: prompt {args.prompt}, {args.new} new tokens{depth}, float32, median of {args.repeats}"
    section, mismatches = table(title, results, models, batches)
    print(section)
    for m in mismatches:
        print(f"\n*** {m} ***", file=sys.stderr)
    if args.out:
        notes = [
            (
                "`cache` is `port.nn.generate`, greedy (jitted prefill, then one decode step compiled once); "
                "`sample` the same with `key`, temperature 0.7, top-k 50, top-p 0.9 (transformers' processors, "
                "the draw and the key's split inside the same compiled step); "
                "`recompute` runs the whole zero-padded buffer of the final length through one jitted forward "
                "per new token and takes the argmax at the current length (compiled once). Each row is a fresh "
                "process; the first call compiles and is not in the median. tokens/s = batch x new tokens / "
                "seconds; speedup is recompute's seconds over the row's; \"same tokens\" compares the cache "
                "row's new tokens with recompute's."
            )
        ]
        _measure.write(args.out, "Decoding", "decode.py", [section], notes)
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
