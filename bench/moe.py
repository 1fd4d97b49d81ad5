"""Benchmark: the cost of a mixture-of-experts layer, routed (grouped by expert) against dense.

    python bench/moe.py [--tokens 4096] [--hidden 1024] [--inner 896] [--experts 8]
                        [--top-k 2] [--repeats 5] [--dtype float32] [--out docs/moe.md]

A Mixtral-shaped MoE layer (Mixtral 8x7B: hidden 4096, expert SwiGLU 14336, 8 experts,
top-2; the defaults shrink hidden and inner 4x and 16x to stay small on CPU, so pass
`--hidden 4096 --inner 14336` on an accelerator for the real shape), random weights, run on
`--tokens` random tokens three ways:

  grouped top-k   `port.nn.MoE(..., top_k=k)`: each token's k (token, expert) pairs sorted
                  by expert, each expert's gated MLP on its own rows only
                  (`jax.lax.ragged_dot_general`, grouped matmuls), weighted and added back.
  grouped top-E   the same layer (same weights) with every expert chosen (top_k = experts):
                  as many rows as dense, through the grouped path.
  dense (before)  the dispatch port's models/moe.py `SparseMoe` used before port.nn.MoE,
                  written out here: `eqx.filter_vmap` of the expert `GatedMLP` over the
                  stacked experts, every expert on every token, then the outputs summed
                  weighted by the routing weights (zero for the experts not chosen). Same
                  weights and routing as grouped top-k, so the same result (checked).

Columns: XLA's `cost_analysis()["flops"]` of `jax.jit(f).lower(layer, x).compile()`; the
rows entering the expert matmuls (tokens x k grouped, tokens x experts dense); the flops
those rows need (rows x 3 matmuls x 2 x hidden x inner), what a grouped GEMM does; and the
measured seconds per call (median of `--repeats` after one untimed call).

On CPU, XLA runs `ragged_dot` (and costs it) densely: every group's matmul over all the
rows, masked, so the grouped layer costs experts x tokens x k rows there, top-k times the
dense dispatch. So on CPU the flops column and the seconds do not show the saving of top-k
routing (they show the opposite); the rows column, and a GPU or TPU run (grouped GEMMs), do.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _measure


def dense(moe, x):
    """The dispatch before port.nn.MoE: every expert on every token, then weighted by the routing.

    As the removed `port.models.moe.SparseMoe.__call__` did it, on `moe`'s own weights.
    """
    import equinox as eqx
    import jax

    import port.nn as pnn

    shape = x.shape
    x = x.reshape(-1, shape[-1])
    top, index = pnn.route(pnn.linear(x, moe.router, None), moe.top_k, renormalise=moe.renormalise)
    experts = moe.router.shape[0]
    weights = (jax.nn.one_hot(index, experts, dtype=top.dtype) * top[..., None]).sum(axis=-2)  # [tokens, experts]
    each = eqx.filter_vmap(lambda mlp: mlp(x))(moe.experts)  # [experts, tokens, embd]
    # Weighted in the weights' dtype, then cast, as transformers does per expert.
    y = (each * weights.T[:, :, None]).astype(x.dtype).sum(axis=0)
    return y.reshape(shape)


def flops_of(compiled) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
        cost = cost[0] if cost else None
    return None if not cost else cost.get("flops")


def run(args) -> tuple[list[list[str]], str]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import port.nn as pnn

    dtype = jnp.dtype(args.dtype)
    key = jax.random.key(0)

    def layer(top_k):  # same key: the same weights whatever top_k
        return pnn.MoE(
            embd=args.hidden,
            inner=args.inner,
            experts=args.experts,
            top_k=top_k,
            activation="silu",
            dtype=dtype,
            key=key,
        )

    x = jax.random.normal(jax.random.key(1), (args.tokens, args.hidden), dtype)
    routed, every = layer(args.top_k), layer(args.experts)
    methods = [
        (f"grouped top-{args.top_k} (port.nn.MoE)", lambda m, x: m(x), routed, args.tokens * args.top_k),
        (
            f"grouped top-{args.experts} (port.nn.MoE, every expert)",
            lambda m, x: m(x),
            every,
            args.tokens * args.experts,
        ),
        (f"dense top-{args.top_k} (before: every expert on every token)", dense, routed, args.tokens * args.experts),
    ]
    rows, outputs = [], []
    for name, f, module, count in methods:
        print(f"{name}: compiling", file=sys.stderr, flush=True)
        compiled = jax.jit(f).lower(module, x).compile()
        flops = flops_of(compiled)
        out = jax.block_until_ready(compiled(module, x))  # untimed
        seconds = []
        for _ in range(args.repeats):
            clock = time.perf_counter()
            out = jax.block_until_ready(compiled(module, x))
            seconds.append(time.perf_counter() - clock)
        outputs.append(np.asarray(out, np.float32))
        needed = count * 3 * 2 * args.hidden * args.inner
        rows.append(
            [
                name,
                f"{flops / 1e9:,.1f} G" if flops is not None else "-",
                f"{count:,}",
                f"{needed / 1e9:,.1f} G",
                f"{_measure.median(seconds):.4f}",
            ]
        )
        print(f"{name}: {_measure.median(seconds):.4f} s", file=sys.stderr, flush=True)
    difference = float(np.abs(outputs[0] - outputs[2]).max())
    scale = float(np.abs(outputs[2]).max())
    check = (
        f"grouped top-{args.top_k} against dense top-{args.top_k}: largest absolute difference "
        f"{difference:.3g} (outputs up to {scale:.3g})"
    )
    return rows, check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024, help="Mixtral: 4096")
    parser.add_argument("--inner", type=int, default=896, help="each expert's hidden size; Mixtral: 14336")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not 1 <= args.top_k <= args.experts:
        parser.error("--top-k must be between 1 and --experts")
    import jax

    rows, check = run(args)
    backend = jax.default_backend()
    header = [
        "method",
        "XLA cost_analysis flops",
        "rows into the expert matmuls",
        "flops those rows need",
        f"seconds per call ({backend})",
    ]
    title = (
        f"MoE layer: {args.tokens} tokens, hidden {args.hidden}, expert inner {args.inner}, "
        f"{args.experts} experts, {args.dtype}, median of {args.repeats}"
    )
    footnote = (
        f'{check}. "Flops those rows need" is rows x 3 matmuls x 2 x hidden x inner (router '
        "excluded), what grouped matmuls on a GPU or TPU do. XLA's CPU backend runs and costs "
        "`ragged_dot` densely, every expert's matmul over all the rows (experts x rows x 6 x hidden x "
        "inner: top-k times the dense dispatch), so on CPU the flops column and the seconds do not show "
        "the saving; the rows column and an accelerator run do."
    )
    section = f"### {title}\n\n" + _measure.markdown(header, rows) + "\n\n" + footnote
    print(section)
    if args.out:
        notes = [
            (
                "One process: each method jitted (`jax.jit(f).lower(layer, x).compile()`), its XLA cost analysis "
                "read, one untimed call, then the median of the timed calls."
            )
        ]
        _measure.write(args.out, "Mixture of experts", "moe.py", [section], notes)


if __name__ == "__main__":
    main()
