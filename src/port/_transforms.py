"""Transforms from a source tensor to a target leaf, each answering the slice contract.

Every transform knows, for an input of a given shape:

- `shape(in_shape)`: the shape of its output;
- `region(in_shape, out_region)`: which box of the input a box of the output needs;
- `apply(block, in_shape, out_region)`: turn that input box into the output box.

The contract, tested with hypothesis:
`apply(x[region(s, r)], s, r) == full(x)[r]` for every box `r` of the output.

```python
t = Transpose((1, 0))
t.shape((768, 2304))                             # (2304, 768)
t.region((768, 2304), ((0, 1152), (0, 768)))     # ((0, 768), (0, 1152))
```
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._source import Region

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Transpose:
    """Permute axes: output axis `j` is input axis `perm[j]` (GPT-2 `Conv1D` -> `Linear`)."""

    perm: tuple[int, ...]

    def shape(self, in_shape: Shape) -> Shape:
        if sorted(self.perm) != list(range(len(in_shape))):
            raise ValueError(f"transpose {list(self.perm)} does not fit a {len(in_shape)}-d tensor")
        return tuple(in_shape[p] for p in self.perm)

    def region(self, in_shape: Shape, out: Region) -> Region:
        source = [None] * len(out)
        for j, p in enumerate(self.perm):
            source[p] = out[j]
        return tuple(source)

    def apply(self, block: np.ndarray, in_shape: Shape, out: Region) -> np.ndarray:
        return block.transpose(self.perm)

    def __str__(self) -> str:
        return f"transpose{list(self.perm)}"


@dataclass(frozen=True)
class Split:
    """Take part `index` of `axis` cut into `parts` equal pieces or into `sizes` (fused q/k/v)."""

    axis: int
    index: int
    parts: int | None = None
    sizes: tuple[int, ...] | None = None

    def _bounds(self, in_shape: Shape) -> tuple[int, int, int]:
        axis = self.axis % len(in_shape) if in_shape and -len(in_shape) <= self.axis < len(in_shape) else None
        if axis is None:
            raise ValueError(f"split axis {self.axis} does not fit a {len(in_shape)}-d tensor")
        n = in_shape[axis]
        if self.sizes is not None:
            sizes = list(self.sizes)
            if sum(sizes) != n or min(sizes) < 0:
                raise ValueError(f"split sizes {sizes} are not a partition of axis {self.axis} of size {n}")
        else:
            if not self.parts or n % self.parts:
                raise ValueError(f"split of axis {self.axis} (size {n}) into {self.parts} equal parts")
            sizes = [n // self.parts] * self.parts
        if not 0 <= self.index < len(sizes):
            raise ValueError(f"split index {self.index} out of range for {len(sizes)} parts")
        start = sum(sizes[: self.index])
        return axis, start, start + sizes[self.index]

    def shape(self, in_shape: Shape) -> Shape:
        axis, start, stop = self._bounds(in_shape)
        return in_shape[:axis] + (stop - start,) + in_shape[axis + 1 :]

    def region(self, in_shape: Shape, out: Region) -> Region:
        axis, start, _ = self._bounds(in_shape)
        a, b = out[axis]
        return out[:axis] + ((a + start, b + start),) + out[axis + 1 :]

    def apply(self, block: np.ndarray, in_shape: Shape, out: Region) -> np.ndarray:
        return block

    def __str__(self) -> str:
        parts = f"sizes={list(self.sizes)}" if self.sizes is not None else f"parts={self.parts}"
        return f"split(axis={self.axis}, {parts}, index={self.index})"


@dataclass(frozen=True)
class Cast:
    """Change the dtype (a bfloat16 source never passes through float32 unless asked)."""

    dtype: np.dtype

    def shape(self, in_shape: Shape) -> Shape:
        return in_shape

    def region(self, in_shape: Shape, out: Region) -> Region:
        return out

    def apply(self, block: np.ndarray, in_shape: Shape, out: Region) -> np.ndarray:
        return block.astype(self.dtype, copy=False)

    def __str__(self) -> str:
        return f"cast({np.dtype(self.dtype).name})"


@dataclass(frozen=True)
class Reshape:
    """Reshape by splitting axes (E -> H x D), merging them (H x D -> E), or adding/removing 1s.

    A box of a split axis needs the bounding range of the input axis, which is
    contiguous whenever the inner output axes are whole; otherwise the bounding
    range is read and the box is picked out of it with strides.
    """

    target: tuple[int, ...]

    def shape(self, in_shape: Shape) -> Shape:
        target = list(self.target)
        if target.count(-1) > 1:
            raise ValueError(f"reshape {target} has more than one -1")
        if -1 in target:
            known = math.prod(d for d in target if d != -1)
            if known == 0 or math.prod(in_shape) % known:
                raise ValueError(f"cannot reshape {list(in_shape)} to {target}")
            target[target.index(-1)] = math.prod(in_shape) // known
        if math.prod(target) != math.prod(in_shape):
            raise ValueError(f"cannot reshape {list(in_shape)} to {target}")
        _groups(tuple(in_shape), tuple(target))  # raises for a regrouping
        return tuple(target)

    def region(self, in_shape: Shape, out: Region) -> Region:
        target = self.shape(in_shape)
        source: list[tuple[int, int]] = []
        for src, dst in _groups(tuple(in_shape), target):
            sizes = [target[j] for j in dst]
            boxes = [out[j] for j in dst]
            if len(src) == 1 and len(dst) == 1:
                source.append(boxes[0])
            elif len(src) == 1:  # split (or a dropped 1 when dst is empty)
                lo, hi = _span(boxes, sizes)
                source.append((lo, hi))
            elif src:  # merge
                (a, b), = boxes
                source.extend(_merge_box(a, b, [in_shape[i] for i in src]))
        return tuple(source)

    def apply(self, block: np.ndarray, in_shape: Shape, out: Region) -> np.ndarray:
        target = self.shape(in_shape)
        pos = 0
        for src, dst in _groups(tuple(in_shape), target):
            sizes = [target[j] for j in dst]
            boxes = [out[j] for j in dst]
            if len(src) == 1 and len(dst) == 1:
                pos += 1
            elif not src:
                (a, b), = boxes
                block = np.expand_dims(block, pos)[(slice(None),) * pos + (slice(0, b - a),)]
                pos += 1
            elif not dst:
                block = block.squeeze(axis=pos)
            elif len(src) == 1:  # split: stride into the bounding range
                strides = _strides(sizes)
                lengths = tuple(b - a for a, b in boxes)
                step = block.strides[pos]
                block = np.lib.stride_tricks.as_strided(
                    block,
                    block.shape[:pos] + lengths + block.shape[pos + 1 :],
                    block.strides[:pos] + tuple(s * step for s in strides) + block.strides[pos + 1 :],
                    writeable=False,
                )
                pos += len(dst)
            else:  # merge: flatten the box, then take the asked range
                (a, b), = boxes
                src_sizes = [in_shape[i] for i in src]
                box = _merge_box(a, b, src_sizes)
                first = sum(lo * s for (lo, _), s in zip(box, _strides(src_sizes)))
                flat = block.reshape(block.shape[:pos] + (math.prod(block.shape[pos : pos + len(src)]),) + block.shape[pos + len(src) :])
                block = flat[(slice(None),) * pos + (slice(a - first, b - first),)]
                pos += 1
        return block

    def __str__(self) -> str:
        return f"reshape{list(self.target)}"


Transform = Transpose | Split | Cast | Reshape


def _strides(sizes: Sequence[int]) -> list[int]:
    return [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]


def _span(boxes: Sequence[tuple[int, int]], sizes: Sequence[int]) -> tuple[int, int]:
    """The range of a flat axis that holds a box of its split into `sizes`."""
    if any(b <= a for a, b in boxes):
        return 0, 0
    strides = _strides(sizes)
    lo = sum(a * s for (a, _), s in zip(boxes, strides))
    hi = sum((b - 1) * s for (_, b), s in zip(boxes, strides)) + 1
    return lo, hi


def _merge_box(a: int, b: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """The smallest box of axes `sizes` whose flattening holds the flat range [a, b)."""
    if b <= a:
        return [(0, 0)] * len(sizes)
    strides = _strides(sizes)
    box = []
    for i, (size, stride) in enumerate(zip(sizes, strides)):
        ia, ib = (a // stride) % size, ((b - 1) // stride) % size
        if ia != ib:
            return box + [(ia, ib + 1)] + [(0, s) for s in sizes[i + 1 :]]
        box.append((ia, ia + 1))
    return box


@functools.lru_cache(maxsize=1024)
def _groups(src: Shape, dst: Shape) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Pair runs of input axes with runs of output axes of equal size."""
    if 0 in src or 0 in dst:
        raise ValueError(f"reshape of an empty tensor {list(src)} -> {list(dst)}")
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(((), (j,)))
            j += 1
            continue
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(((i,), ()))
            i += 1
            continue
        si, dj, ps, pd = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                si.append(i)
                ps *= src[i]
                i += 1
            else:
                dj.append(j)
                pd *= dst[j]
                j += 1
        if len(si) > 1 and len(dj) > 1:
            raise ValueError(
                f"reshape {list(src)} -> {list(dst)} regroups axes; only splitting or merging axes is supported"
            )
        groups.append((tuple(si), tuple(dj)))
    return tuple(groups)


@dataclass(frozen=True)
class Chain:
    """Transforms applied in order to a source of a given shape."""

    transforms: tuple[Transform, ...]
    shapes: tuple[Shape, ...]  # the input shape of each transform, then the output shape

    @classmethod
    def build(cls, transforms: Sequence[Transform], source_shape: Shape) -> Chain:
        shapes = [tuple(source_shape)]
        for t in transforms:
            shapes.append(t.shape(shapes[-1]))
        return cls(tuple(transforms), tuple(shapes))

    @property
    def shape(self) -> Shape:
        return self.shapes[-1]

    def regions(self, out: Region) -> list[Region]:
        """The region needed at each stage, source first, `out` last."""
        regions = [out]
        for t, shape in zip(reversed(self.transforms), reversed(self.shapes[:-1])):
            regions.append(t.region(shape, regions[-1]))
        return regions[::-1]

    def apply(self, block: np.ndarray, regions: Sequence[Region]) -> np.ndarray:
        """Turn the source block read for `regions[0]` into the target block for `regions[-1]`."""
        for t, shape, region in zip(self.transforms, self.shapes, regions[1:]):
            block = t.apply(block, shape, region)
        return block

    def __str__(self) -> str:
        return " > ".join(str(t) for t in self.transforms) or "-"
