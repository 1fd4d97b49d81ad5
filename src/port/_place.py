"""Place: each leaf becomes a `jax.Array` under its final `NamedSharding`.

Every distinct block a process's devices hold is built once, from only the source
bytes it needs, read with positioned reads (no memory map: a checkpoint cut short
meanwhile is a clean error, never a SIGBUS). Where the transform chain only
reshapes or offsets the source region (the common case: no transpose, no cast),
the region's bytes are read straight into the block's 64-byte-aligned buffer, so
each byte is copied once; otherwise the region is read into a staging buffer and
the chain's views over it are copied (casting on the way) into the block. On CPU,
JAX adopts such a buffer as the device buffer without copying it, and devices that
share a block (a replicated axis) share that one buffer: no second read, no copy. The blocks of one source tensor are read together, so runs
that lie end to end in the file (the column blocks of a matrix) share one
`preadv`. `jax.make_array_from_callback` asks each process only for its own
devices' blocks, so a process reads only what its devices hold.

```python
arrays = place(p, ckpt, mesh)          # {"wte": jax.Array, ...}
arrays["wte"].sharding                  # NamedSharding(mesh, P(None, 'data'))
```
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ._copy import copy
from ._pipeline import ReadAhead
from ._plan import LeafPlan, Plan
from ._sources import Checkpoint, Region

ALIGN = 64  # XLA's CPU client adopts host buffers aligned like this without a copy
BAND_BYTES = 16 * 2**20  # a source tensor larger than this is read by several jobs
STAGED_BYTES = 4 * 2**20  # a staged block larger than this is read and finished in bands of about this size
AHEAD = 2  # units (leaves, or leaves cut from the same tensors) read ahead of the one being assembled


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _same_layout(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `a` and `b` are the same elements of the same memory."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and all(x == y for x, y, n in zip(a.strides, b.strides, a.shape) if n > 1)
    )


def direct(leaf: LeafPlan, region: Region, regions: list[Region], target: np.ndarray) -> bool:
    """Whether the chain turns a C-contiguous array of the source region laid in
    `target`'s memory into `target` itself (it only reshapes or offsets: no transpose,
    cast or strided pick). Then reading the region into that memory fills `target`."""
    shape = tuple(b - a for a, b in region)
    if target.dtype != leaf.source_dtype or math.prod(shape) != target.size or not target.flags.c_contiguous:
        return False
    return _same_layout(leaf.chain.apply(target.reshape(shape), regions), target)


@dataclass
class Part:
    """One source key's share of one block of `leaf`: read `region` of `key` into
    `source` (a view of the block, or a staging buffer allocated when read), then,
    unless direct, copy the chain's result into `target`."""

    leaf: LeafPlan
    key: str
    region: Region
    regions: list[Region]
    target: np.ndarray
    source: np.ndarray | None


def read_key(checkpoint: Checkpoint, parts: list[Part]) -> None:
    """Read one source key's regions for all the blocks that need it at once, and finish the staged ones.

    Staged blocks that need the same region (the parts of an interleaved tensor, as
    `stride` cuts it) share one buffer, read once."""
    staged: dict[Region, np.ndarray] = {}
    requests, buffers = [], []
    for part in parts:
        if part.source is not None:
            buffer = part.source
        elif part.region in staged:
            buffers.append(staged[part.region])
            continue
        else:
            buffer = staged[part.region] = np.empty(tuple(b - a for a, b in part.region), part.leaf.source_dtype)
        requests.append((part.region, buffer))
        buffers.append(buffer)
    checkpoint.read_into(parts[0].key, requests)
    for part, buffer in zip(parts, buffers):
        if part.source is None:
            copy(part.target, part.leaf.chain.apply(buffer, part.regions))


def plan_reads(
    wanted: list[tuple[LeafPlan, list[Region]]],
) -> tuple[list[dict[Region, np.ndarray]], list[list[Part]]]:
    """For each (leaf, boxes): its (uninitialised) blocks; and the reads that fill them all,
    one list per source key, so that blocks of several leaves cut from one tensor
    (q, k and v of a fused c_attn) are read together."""
    blocks, by_key = [], {}
    for leaf, boxes in wanted:
        blocks.append({})
        for box in boxes:
            region, keys = leaf.source_region(box)
            _, inner = leaf.split_box(box)
            regions = leaf.chain.regions(inner)
            out = blocks[-1][box] = aligned_empty(tuple(b - a for a, b in box), leaf.dtype)
            k = len(leaf.stack)
            targets = out.reshape(math.prod(out.shape[:k]), *out.shape[k:])  # one per key, in `keys` order (a view)
            shape = tuple(b - a for a, b in region)
            in_place = len(targets) > 0 and direct(leaf, region, regions, targets[0])  # alike for every layer
            for key, i in zip(keys, range(len(targets))):
                target = targets[i, ...]  # a view, 0-d for a scalar leaf (`targets[i]` would be a copy: a numpy scalar)
                part = Part(leaf, key, region, regions, target, target.reshape(shape) if in_place else None)
                by_key.setdefault(key, []).append(part)
    return blocks, list(by_key.values())


def _bands(parts: list[Part]) -> list[list[Part]]:
    """One source key's parts as jobs of about `BAND_BYTES` each, so that one large tensor
    (an embedding) is read by several threads: bands of the tensor's first axis, every
    part cut at the same rows, so the runs a band holds still lie end to end. Only
    direct parts are cut (a staged part is finished whole once read)."""
    band_bytes = BAND_BYTES
    total = sum(math.prod(b - a for a, b in part.region) for part in parts) * parts[0].leaf.source_dtype.itemsize
    rows = band_rows(parts[0].leaf)
    staged = [part for part in parts if part.source is None]
    if staged and total > band_bytes and len(staged) == len(parts) and len({p.region for p in parts}) == len(parts):
        return _staged_bands(parts)
    if total <= band_bytes or not parts[0].region or staged or rows is None:
        return [parts]
    lo, hi = min(part.region[0][0] for part in parts), max(part.region[0][1] for part in parts)
    step = -(-max(1, (hi - lo) * band_bytes // total) // rows) * rows
    edges = sorted({lo, hi, *range(-(-lo // step) * step, hi, step)})  # inner edges: multiples of `rows`
    jobs = []
    for start, stop in zip(edges, edges[1:]):
        band = []
        for part in parts:
            (a, b), rest = part.region[0], part.region[1:]
            x, y = max(a, start), min(b, stop)
            if x < y:
                assert part.source is not None  # direct: staged parts were returned whole above
                source = part.source[x - a : y - a]
                band.append(Part(part.leaf, part.key, ((x, y), *rest), part.regions, part.target, source))
        jobs.append(band)
    return jobs


def _staged_bands(parts: list[Part]) -> list[list[Part]]:
    """One large source key's staged parts (a transposed embedding's blocks) as jobs of about
    `STAGED_BYTES` of staging each: every part cut into bands of its source rows
    (`cut_staged`), and the bands of the parts beside one another (the same rows) read
    together, so that their runs still merge into whole rows."""
    beside: dict[tuple[int, int], int] = {}
    for part in parts:
        beside[part.region[0]] = beside.get(part.region[0], 0) + 1
    jobs: dict[tuple[int, int], list[Part]] = {}
    for part in parts:
        for cut in cut_staged(part, max(1, STAGED_BYTES // beside[part.region[0]])):
            jobs.setdefault(cut.region[0], []).append(cut)
    return list(jobs.values())


def cut_staged(part: Part, nbytes: int) -> list[Part]:
    """A staged part of more than `nbytes` as parts of sub-boxes of its block, each reading one band
    of the source's rows (so no byte is read twice) and finishing its share of the block: its
    staging buffer then holds about `nbytes`, not the whole block. A part whose block no axis
    cuts into such bands (a reshape across rows) stays whole.

    ```python
    cut_staged(part, 4 << 20)   # lm_head.weight rows [0, 16000) x [0, 256) transposed -> 2 parts of 8000 rows
    ```
    """
    size = math.prod(b - a for a, b in part.region) * part.leaf.source_dtype.itemsize
    rows = band_rows(part.leaf)
    out = part.regions[-1]
    if size <= nbytes or not part.region or rows is None:
        return [part]
    n = -(-size // nbytes)
    (first, last), rest = part.region[0], part.region[1:]
    for axis, (a, b) in enumerate(out):
        edges = sorted({a + (b - a) * i // n for i in range(n + 1)})
        if len(edges) < 3:
            continue
        subs = [(*out[:axis], (x, y), *out[axis + 1 :]) for x, y in zip(edges, edges[1:])]
        regions = [part.leaf.chain.regions(sub) for sub in subs]
        bands = [r[0] for r in regions]
        ordered = sorted(bands)
        if (
            all(band[1:] == rest for band in bands)
            and ordered[0][0][0] == first
            and ordered[-1][0][1] == last
            and all(p[0][1] == q[0][0] and q[0][0] % rows == 0 for p, q in zip(ordered, ordered[1:]))
        ):
            return [
                Part(
                    part.leaf,
                    part.key,
                    band,
                    r,
                    part.target[tuple(slice(x - a0, y - a0) for (x, y), (a0, _) in zip(sub, out))],
                    None,
                )
                for sub, r, band in zip(subs, regions, bands)
            ]
    return [part]


def band_rows(leaf: LeafPlan) -> int | None:
    """What the first row of a band of `leaf`'s source tensor must be a multiple of so that
    bands read no byte twice: 1 for a plain tensor, a quantized source's `band_rows` (its scale
    blocks' height), None for one that says none does (it is not cut)."""
    return 1 if leaf.source is None else leaf.source.band_rows


def _units(leaves: tuple[LeafPlan, ...]) -> list[list[int]]:
    """Leaves in order, consecutive ones that read the same source tensors grouped."""
    units: list[list[int]] = []
    keys: set[str] = set()
    for i, leaf in enumerate(leaves):
        if units and keys & set(leaf.keys):
            units[-1].append(i)
            keys |= set(leaf.keys)
        else:
            units.append([i])
            keys = set(leaf.keys)
    return units


def planned_reads(plan: Plan, leaf_boxes: list[list[Region]]) -> dict[str, set[Region]]:
    """The regions of each source tensor this process's blocks (`leaf_boxes`, per leaf) read:
    several for one tensor when its blocks, or the leaves cut from it, each need a part."""
    reads: dict[str, set[Region]] = {}
    for leaf, found in zip(plan.leaves, leaf_boxes):
        for box in found:
            region, keys = leaf.source_region(box)
            for key in keys:
                reads.setdefault(key, set()).add(region)
    return reads


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    """JAX's device index (slices, possibly open-ended) as a box."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def boxes(shape: tuple[int, ...], sharding: NamedSharding) -> list[Region]:
    """The distinct blocks of an array of `shape` this process's devices hold, in device order."""
    found = []
    for index in sharding.addressable_devices_indices_map(shape).values():
        assert index is not None  # each addressable device holds a block (JAX's type allows None)
        box = _box(index, shape)
        if box not in found:
            found.append(box)
    return found


def assemble(shape: tuple[int, ...], sharding: NamedSharding, blocks: dict[Region, np.ndarray]) -> jax.Array:
    """The array of `shape` under `sharding` from its distinct blocks (64-byte aligned): every
    device holding a block is handed that same block. On CPU, JAX adopts it without a copy, the
    devices that share it (a replicated axis) share its memory, and XLA never writes into such
    an adopted buffer, donated or not (it writes a donated step's result to new memory); an
    accelerator copies it to each of them from the one host buffer."""

    def callback(index: tuple[slice, ...] | None) -> np.ndarray:
        assert index is not None  # JAX passes each device's index (and asserts so itself)
        return blocks[_box(index, shape)]

    return jax.make_array_from_callback(shape, sharding, callback)


def place(
    plan: Plan,
    checkpoint: Checkpoint,
    mesh: Mesh,
    placed: Callable[[LeafPlan, jax.Array], None] | None = None,
    workers: int | None = None,
) -> dict[str, jax.Array | None]:
    """Every leaf of `plan` as an array under its final sharding, each device reading only its region.

    Blocks are read by `workers` threads, one source tensor at a time, at most two
    leaves (or groups of leaves cut from the same tensors) ahead of the one being
    assembled. Optional leaves the checkpoint lacks (`plan.empty`) are None.

    **Arguments:**

    - `plan`: the `Plan` made by `port.plan` for this checkpoint and a mesh of this shape.
    - `checkpoint`: the open `Checkpoint` to read.
    - `mesh`: the `Mesh` the arrays are sharded over.
    - `placed`: called with each `LeafPlan` and its array once made (to show progress,
      or to start writing it while the next leaves are placed).
    - `workers`: reading threads (default: twice the CPU count, at most 8).

    Returns dotted module paths to arrays, for `port.fill`.

    ```python
    arrays = port.place(recipe, ckpt, mesh)
    model = port.fill(skel, arrays)
    ```
    """
    arrays: dict[str, jax.Array | None] = dict.fromkeys(plan.empty)
    shardings = [NamedSharding(mesh, leaf.spec) for leaf in plan.leaves]
    leaf_boxes = [boxes(leaf.shape, sharding) for leaf, sharding in zip(plan.leaves, shardings)]
    checkpoint.expect(planned_reads(plan, leaf_boxes))

    def unit(members: list[int]) -> tuple[tuple[list[int], list[dict[Region, np.ndarray]]], list, int]:
        """One unit's blocks (allocated now) and its reads, one job per band of a source tensor."""
        blocks, reads = plan_reads([(plan.leaves[i], leaf_boxes[i]) for i in members])
        jobs = [functools.partial(read_key, checkpoint, band) for parts in reads for band in _bands(parts)]
        return (members, blocks), jobs, 0

    with ReadAhead(ahead=AHEAD, workers=workers) as ahead:
        for members, blocks in ahead.run(unit(members) for members in _units(plan.leaves)):
            for i, leaf_blocks in zip(members, blocks):
                array = arrays[plan.leaves[i].path] = assemble(plan.leaves[i].shape, shardings[i], leaf_blocks)
                if placed is not None:
                    placed(plan.leaves[i], array)
            del blocks
    return arrays
