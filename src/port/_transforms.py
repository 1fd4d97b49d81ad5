"""Transforms from a source tensor to a target leaf: one class each, in one registry.

A mapping entry's `transforms = [{ split = {...} }, { transpose = [1, 0] }, ...]` is a
list of one-key tables; the key names a class in `REGISTRY`. Each class

- parses and checks its TOML argument (`parse`), keeping `config.json` names as they
  are, and renders itself back (`render`): `parse_transform(t.toml()) == t`;
- swaps those names for their values (`resolve(config)`) before it is used;
- answers the slice contract, for an input of a given shape:
  `shape(in_shape)`, the shape of its output; `region(in_shape, out_region)`, which box
  of the input a box of the output needs; `apply(block, in_shape, out_region)`, turn
  that input box into the output box. Tested with hypothesis:
  `apply(x[region(s, r)], s, r) == full(x)[r]` for every box `r` of the output;
- answers the inverse contract (`port export` walks the plan backwards):
  `inverse(forward(x), in_shape, in_dtype) == x` bit for bit. `transpose` inverts by
  the inverse permutation, `reshape` by reshaping back to `in_shape`, `cast` by casting
  back to `in_dtype` (exact when the forward cast lost nothing: a widening cast, or
  values the narrower dtype holds). `split` keeps one part of a fused tensor, so its
  inverse takes every part, in index order, and concatenates them (`Split.fused`):
  `Split.inverse([forward of part i for every i], in_shape, in_dtype) == x`. `stride`
  (every `step`-th element from an offset: a de-interleave) is fused the same way, its
  inverse interleaving the parts.

`Chain` strings transforms together for a source shape, and inverts them in reverse
order; a chain holding a split inverts with its siblings, the chains that keep the
other parts of the same source tensor (`Chain.inverse(out, dtype, siblings=...)`).

Adding a transform is one class here and its tests: subclass the abstract `Transform`
with `name="..."`, write its abstract methods `parse`, `arg`, `shape`, `region`, `apply`
and `inverse` (and `resolve` if its argument may name config values). Concrete
transforms are final (`@final`; subclassing one raises `TypeError`).

```python
t = parse_transform({"transpose": [1, 0]})       # Transpose(perm=(1, 0))
t.render()                                       # '{ transpose = [1, 0] }'
t.shape((768, 2304))                             # (2304, 768)
t.region((768, 2304), ((0, 1152), (0, 768)))     # ((0, 768), (0, 1152))
x = np.zeros((768, 2304), np.float32)
t.inverse(t.apply(x, x.shape, ((0, 2304), (0, 768))), x.shape, x.dtype)  # x again
```
"""

from __future__ import annotations

import abc
import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeGuard, final

import numpy as np

from ._dtypes import NAMES, dtype
from ._errors import ConfigError
from ._sources import Region

Shape = tuple[int, ...]
Size = int | str  # a size, or the name of an integer in config.json

#: The transforms by their name in a mapping file, filled by subclassing `Transform`.
REGISTRY: dict[str, type[Transform]] = {}


class Transform(abc.ABC):
    """One step from a source tensor towards a target leaf: the interface every transform answers.

    Abstract (Equinox's abstract/final pattern): a concrete transform subclasses it with
    `name=` (the key a mapping file gives it), which registers it in `REGISTRY`, and is
    final: subclassing a registered transform raises `TypeError` (compose, do not extend).
    It must answer the abstract methods: `parse` and `arg` (its TOML argument, both
    ways), `shape`, `region` and `apply` (the slice contract) and `inverse`; `resolve`,
    `out_dtype` and `siblings` have defaults for a transform that names no config
    value, keeps the dtype and is not `fused`.

    ```python
    @final
    @dataclass(frozen=True)
    class Flip(Transform, name="flip"):          # transforms = [{ flip = 1 }]: reverse axis 1
        axis: int

        @classmethod
        def parse(cls, arg): ...                 # Flip(arg), or ValueError("flip takes an axis")
        def arg(self): return self.axis          # what `render` writes back
        # shape, region, apply (the slice contract) and inverse: see tests/test_transforms.py
    ```
    """

    name: ClassVar[str]
    #: True when one output does not determine the input: `inverse` takes every part.
    fused: ClassVar[bool] = False
    #: True when the parts' blocks on a device need one region (read once for all of them).
    shares_regions: ClassVar[bool] = False

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        final_bases = [base.name for base in cls.__mro__[1:] if base in REGISTRY.values()]
        if final_bases:
            raise TypeError(
                f"{cls.__qualname__}: transform '{final_bases[0]}' is final; write a new Transform "
                "(with its own name=) that uses it rather than subclassing it"
            )
        if name is not None:
            if name in REGISTRY:
                raise TypeError(f"transform '{name}' is registered twice")
            cls.name = name
            REGISTRY[name] = cls

    @classmethod
    @abc.abstractmethod
    def parse(cls, arg: Any) -> Transform:
        """The transform from its TOML argument; `ValueError` starting with its name if bad."""

    @abc.abstractmethod
    def arg(self) -> Any:
        """The TOML argument that `parse` reads back into this transform."""

    def toml(self) -> dict[str, Any]:
        """The one-key table of a mapping file: `{"transpose": [1, 0]}`."""
        return {self.name: self.arg()}

    def render(self) -> str:
        """The TOML inline table: `{ transpose = [1, 0] }`."""
        return toml_inline(self.toml())

    def resolve(self, config: Mapping[str, Any]) -> Transform:
        """This transform with config.json names replaced by their values (`ConfigError` if missing)."""
        return self

    @abc.abstractmethod
    def shape(self, in_shape: Shape) -> Shape:
        """The shape of the output for an input of `in_shape`; `ValueError` if it does not fit."""

    @abc.abstractmethod
    def region(self, in_shape: Shape, out: Region) -> Region:
        """The box of the input (of `in_shape`) that the box `out` of the output needs."""

    @abc.abstractmethod
    def apply(self, block: np.ndarray, in_shape: Shape, out: Region) -> np.ndarray:
        """The box `out` of the output, from `block`, the input's box `region(in_shape, out)`."""

    def out_dtype(self, in_dtype: np.dtype) -> np.dtype:
        """The dtype of its output for an input of `in_dtype`."""
        return np.dtype(in_dtype)

    @abc.abstractmethod
    def inverse(self, out: Any, in_shape: Shape, in_dtype: np.dtype) -> np.ndarray:
        """The input (of `in_shape`, `in_dtype`) rebuilt from the whole output.

        When `fused`, `out` is the list of every part's output, in `siblings` order.
        """

    def siblings(self, in_shape: Shape) -> tuple[Transform, ...]:
        """The transforms whose outputs together rebuild the input (`fused`), in order."""
        return (self,)


def parse_transform(table: Any) -> Transform:
    """A transform from its one-key table, such as `{"transpose": [1, 0]}`.

    Raises `ValueError` with a message for the mapping file (the caller names the entry).
    """
    if not isinstance(table, dict) or len(table) != 1:
        raise ValueError("each transform is a one-key table such as { transpose = [1, 0] }")
    ((op, arg),) = table.items()
    cls = REGISTRY.get(op)
    if cls is None:
        names = list(REGISTRY)
        expected = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
        raise ValueError(f"{op}: unknown transform (expected {expected})")
    return cls.parse(arg)


def toml_inline(value: Any) -> str:
    """A TOML inline value (strings, ints, lists, tables): `toml_inline({"a": [1]}) == '{ a = [1] }'`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, str)):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_inline(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def _int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _sizes(x: Any) -> bool:
    return isinstance(x, list) and all(_int(v) or isinstance(v, str) for v in x)


def _value(x: Size, config: Mapping[str, Any]) -> int:
    """A size: an integer, or a config.json key, dotted for a sub-config's (`"vision_config.hidden_size"`:
    a dual model's mapping names its towers' sizes so), with `=default` for a key config.json may
    leave out (`"text_config.hidden_size=768"`: the config class's default, which sparse Hub configs rely on)."""
    name, _, default = x.partition("=") if isinstance(x, str) else ("", "", "")
    value: Any = config if isinstance(x, str) else x
    for part in name.split(".") if name else ():
        value = value.get(part) if isinstance(value, Mapping) else None
    if value is None and default.isdigit():
        value = int(default)
    if not _int(value):
        raise ConfigError(f"config.json has no integer '{name or x}'")
    return value


def _resolved(sizes: Sequence[Size], what: str) -> list[int]:
    """`sizes` as integers; `ValueError` if any is still a config name."""
    ints = [s for s in sizes if not isinstance(s, str)]
    if len(ints) != len(sizes):
        raise ValueError(f"{what} {list(sizes)} names config values: resolve(config) it first")
    return ints


@final
@dataclass(frozen=True)
class Transpose(Transform, name="transpose"):
    """Permute axes: output axis `j` is input axis `perm[j]` (GPT-2 `Conv1D` -> `Linear`).

    ```python
    Transpose((1, 0)).render()                   # '{ transpose = [1, 0] }'
    Transpose((2, 0, 1)).inverse(y, ...)         # y.transpose(1, 2, 0)
    ```
    """

    perm: tuple[int, ...]

    @classmethod
    def parse(cls, arg: Any) -> Transpose:
        if not isinstance(arg, list) or not all(_int(x) for x in arg):
            raise ValueError("transpose takes a permutation such as [1, 0]")
        return cls(tuple(arg))

    def arg(self) -> list[int]:
        return list(self.perm)

    def shape(self, in_shape: Shape) -> Shape:
        if sorted(self.perm) != list(range(len(in_shape))):
            raise ValueError(f"transpose {list(self.perm)} does not fit a {len(in_shape)}-d tensor")
        return tuple(in_shape[p] for p in self.perm)

    def region(self, in_shape: Shape, out: Region) -> Region:
        # Input axis perm[j] is output axis j (`shape` checked that perm is a permutation).
        by_input = dict(zip(self.perm, out))
        return tuple(by_input[p] for p in range(len(out)))

    def apply(self, block: np.ndarray, in_shape: Shape, out: Region) -> np.ndarray:
        return block.transpose(self.perm)

    def inverse(self, out: np.ndarray, in_shape: Shape, in_dtype: np.dtype) -> np.ndarray:
        """The inverse permutation: input axis `perm[j]` is output axis `j`."""
        return out.transpose(np.argsort(self.perm))

    def __str__(self) -> str:
        return f"transpose{list(self.perm)}"


@final
@dataclass(frozen=True)
class Reshape(Transform, name="reshape"):
    """Reshape by splitting axes (E -> H x D), merging them (H x D -> E), or adding/removing 1s.

    Sizes may be `-1` (once) or config.json names, kept by `parse` and `render` and
    replaced by `resolve`. A box of a split axis needs the bounding range of the
    input axis, which is contiguous whenever the inner output axes are whole;
    otherwise the bounding range is read and the box is picked out of it with strides.

    ```python
    t = Reshape(("n_head", -1, "n_embd"))        # { reshape = ["n_head", -1, "n_embd"] }
    t.resolve({"n_head": 12, "n_embd": 768}).shape((768, 768))   # (12, 64, 768)
    ```
    """

    target: tuple[Size, ...]

    @classmethod
    def parse(cls, arg: Any) -> Reshape:
        if not _sizes(arg):
            raise ValueError("reshape takes a list of sizes, -1 or config names")
        return cls(tuple(arg))

    def arg(self) -> list[Size]:
        return list(self.target)

    def resolve(self, config: Mapping[str, Any]) -> Reshape:
        return Reshape(tuple(_value(x, config) for x in self.target))

    def inverse(self, out: np.ndarray, in_shape: Shape, in_dtype: np.dtype) -> np.ndarray:
        """Reshape back to the input shape."""
        return out.reshape(in_shape)

    def shape(self, in_shape: Shape) -> Shape:
        target = _resolved(self.target, "reshape")
        if target.count(-1) > 1:
            raise ValueError(f"reshape {target} has more than one -1")
        if -1 in target:
            known = math.prod(d for d in target if d != -1)
            if known == 0 or math.prod(in_shape) % known:
                raise ValueError(f"cannot reshape {list(in_shape)} to {target}")
            target[target.index(-1)] = math.prod(in_shape) // known
        if math.prod(target) != math.prod(in_shape):
            raise ValueError(f"cannot reshape {list(in_shape)} to {target}")
        reshape_groups(tuple(in_shape), tuple(target))  # raises for a regrouping
        return tuple(target)

    def region(self, in_shape: Shape, out: Region) -> Region:
        target = self.shape(in_shape)
        source: list[tuple[int, int]] = []
        for src, dst in reshape_groups(tuple(in_shape), target):
            sizes = [target[j] for j in dst]
            boxes = [out[j] for j in dst]
            if len(src) == 1 and len(dst) == 1:
                source.append(boxes[0])
            elif len(src) == 1:  # split (or a dropped 1 when dst is empty)
                lo, hi = _span(boxes, sizes)
                source.append((lo, hi))
            elif src:  # merge
                ((a, b),) = boxes
                source.extend(_merge_box(a, b, [in_shape[i] for i in src]))
        return tuple(source)

    def apply(self, block: np.ndarray, in_shape: Shape, out: Region) -> np.ndarray:
        target = self.shape(in_shape)
        pos = 0
        for src, dst in reshape_groups(tuple(in_shape), target):
            sizes = [target[j] for j in dst]
            boxes = [out[j] for j in dst]
            if len(src) == 1 and len(dst) == 1:
                pos += 1
            elif not src:
                ((a, b),) = boxes
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
                ((a, b),) = boxes
                src_sizes = [in_shape[i] for i in src]
                box = _merge_box(a, b, src_sizes)
                first = sum(lo * s for (lo, _), s in zip(box, _strides(src_sizes)))
                flat = block.reshape(
                    block.shape[:pos] + (math.prod(block.shape[pos : pos + len(src)]),) + block.shape[pos + len(src) :]
                )
                block = flat[(slice(None),) * pos + (slice(a - first, b - first),)]
                pos += 1
        return block

    def __str__(self) -> str:
        return f"reshape{list(self.target)}"


@final
@dataclass(frozen=True)
class Split(Transform, name="split"):
    """Take part `index` of `axis` cut into `parts` equal pieces or into `sizes` (fused q/k/v).

    Its inverse concatenates every part (`fused`): one part does not give the input back.

    ```python
    t = Split(axis=1, index=0, parts=3)          # { split = { axis = 1, parts = 3, index = 0 } }
    t.shape((768, 2304))                         # (768, 768)
    t.inverse([q, k, v], (768, 2304), dtype)     # np.concatenate([q, k, v], axis=1)
    ```
    """

    fused: ClassVar[bool] = True

    axis: int
    index: int
    parts: int | None = None
    sizes: tuple[Size, ...] | None = None

    @classmethod
    def parse(cls, arg: Any) -> Split:
        if not isinstance(arg, dict) or set(arg) - {"axis", "index", "parts", "sizes"}:
            raise ValueError("split takes { axis, index, parts | sizes }")
        if not _int(arg.get("axis")) or not _int(arg.get("index")):
            raise ValueError("split needs integer 'axis' and 'index'")
        if ("parts" in arg) == ("sizes" in arg):
            raise ValueError("split needs exactly one of 'parts' or 'sizes'")
        if "parts" in arg and not _int(arg["parts"]):
            raise ValueError("split: 'parts' must be an integer")
        if "sizes" in arg and not _sizes(arg["sizes"]):
            raise ValueError("split: 'sizes' must be a list of sizes or config names")
        sizes = arg.get("sizes")
        return cls(arg["axis"], arg["index"], arg.get("parts"), None if sizes is None else tuple(sizes))

    def arg(self) -> dict[str, Any]:
        parts = {"parts": self.parts} if self.sizes is None else {"sizes": list(self.sizes)}
        return {"axis": self.axis, **parts, "index": self.index}

    def resolve(self, config: Mapping[str, Any]) -> Split:
        if self.sizes is None:
            return self
        return replace(self, sizes=tuple(_value(x, config) for x in self.sizes))

    def _cuts(self, in_shape: Shape) -> tuple[int, list[int]]:
        """The axis (non-negative) and the size of every part."""
        axis = self.axis % len(in_shape) if in_shape and -len(in_shape) <= self.axis < len(in_shape) else None
        if axis is None:
            raise ValueError(f"split axis {self.axis} does not fit a {len(in_shape)}-d tensor")
        n = in_shape[axis]
        if self.sizes is not None:
            sizes = _resolved(self.sizes, "split sizes")
            if sum(sizes) != n or min(sizes) < 0:
                raise ValueError(f"split sizes {sizes} are not a partition of axis {self.axis} of size {n}")
        else:
            if not self.parts or n % self.parts:
                raise ValueError(f"split of axis {self.axis} (size {n}) into {self.parts} equal parts")
            sizes = [n // self.parts] * self.parts
        return axis, sizes

    def _bounds(self, in_shape: Shape) -> tuple[int, int, int]:
        axis, sizes = self._cuts(in_shape)
        if not 0 <= self.index < len(sizes):
            raise ValueError(f"split index {self.index} out of range for {len(sizes)} parts")
        start = sum(sizes[: self.index])
        return axis, start, start + sizes[self.index]

    def siblings(self, in_shape: Shape) -> tuple[Split, ...]:
        """The splits keeping every part of `in_shape`, in index order (this one among them)."""
        return tuple(replace(self, index=i) for i in range(len(self._cuts(in_shape)[1])))

    def shape(self, in_shape: Shape) -> Shape:
        axis, start, stop = self._bounds(in_shape)
        return in_shape[:axis] + (stop - start,) + in_shape[axis + 1 :]

    def region(self, in_shape: Shape, out: Region) -> Region:
        axis, start, _ = self._bounds(in_shape)
        a, b = out[axis]
        return out[:axis] + ((a + start, b + start),) + out[axis + 1 :]

    def apply(self, block: np.ndarray, in_shape: Shape, out: Region) -> np.ndarray:
        return block

    def inverse(self, out: Sequence[np.ndarray], in_shape: Shape, in_dtype: np.dtype) -> np.ndarray:
        """Concatenate every part, in index order, along the axis (`out[i]` is part `i`)."""
        siblings = self.siblings(in_shape)
        if len(out) != len(siblings):
            raise ValueError(f"split inverse needs all {len(siblings)} parts, got {len(out)}")
        for i, (part, s) in enumerate(zip(out, siblings)):
            if tuple(part.shape) != s.shape(in_shape):
                raise ValueError(f"split part {i} is {list(part.shape)}, expected {list(s.shape(in_shape))}")
        return np.concatenate(out, axis=self._cuts(in_shape)[0])

    def __str__(self) -> str:
        parts = f"sizes={list(self.sizes)}" if self.sizes is not None else f"parts={self.parts}"
        return f"split(axis={self.axis}, {parts}, index={self.index})"


@final
@dataclass(frozen=True)
class Cast(Transform, name="cast"):
    """Change the dtype (a bfloat16 source never passes through float32 unless asked).

    ```python
    t = Cast(dtype("bfloat16"))                  # { cast = "bfloat16" }
    t.inverse(y, shape, np.dtype("float32"))     # y.astype(float32): exact, bf16 is in f32
    ```
    """

    dtype: np.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @classmethod
    def parse(cls, arg: Any) -> Cast:
        if not isinstance(arg, str) or arg not in NAMES:
            raise ValueError(f"cast: unknown dtype '{arg}' (expected one of {', '.join(sorted(NAMES))})")
        return cls(dtype(arg))

    def arg(self) -> str:
        return self.dtype.name

    def shape(self, in_shape: Shape) -> Shape:
        return in_shape

    def region(self, in_shape: Shape, out: Region) -> Region:
        return out

    def apply(self, block: np.ndarray, in_shape: Shape, out: Region) -> np.ndarray:
        return block.astype(self.dtype, copy=False)

    def out_dtype(self, in_dtype: np.dtype) -> np.dtype:
        return self.dtype

    def inverse(self, out: np.ndarray, in_shape: Shape, in_dtype: np.dtype) -> np.ndarray:
        """Cast back to the source dtype (bit for bit when the forward cast was exact)."""
        return out.astype(in_dtype, copy=False)

    def __str__(self) -> str:
        return f"cast({self.dtype.name})"


@final
@dataclass(frozen=True)
class Stride(Transform, name="stride"):
    """Take every `step`-th element of `axis` from `offset` on: `x[..., offset::step]` (de-interleave).

    gpt-oss fuses its experts' gate and up projections column by column
    (`gate_up_proj[..., ::2]` is the gate, `[..., 1::2]` up): `step` 2, offset 0 and 1.
    Like `split` it keeps one part of a fused tensor, so its inverse takes every part,
    offsets `0..step-1` in order, and interleaves them back (`fused`).

    Reading: a box `[a, b)` of the output needs elements `offset + step*a` through
    `offset + step*(b-1)` of the input. A source region is a box and a read is a run
    of contiguous bytes (positioned reads; skipping every other element of the
    innermost axis would save no I/O, pages are read whole), so the region is the box
    of whole groups of `step` elements, `[step*a, step*b)`, the same for every offset,
    and `apply` picks the elements out with a step. The parts' blocks on one device
    then need one region, which placing reads once for all of them (`_place.read_key`):
    a device holding columns `[a, b)` of gate and up reads exactly `[2a, 2b)` of the
    fused tensor, its own bytes, once.

    ```python
    t = Stride(axis=1, step=2, offset=0)         # { stride = { axis = 1, step = 2, offset = 0 } }
    t.shape((4, 10))                             # (4, 5)
    t.region((4, 10), ((0, 4), (1, 3)))          # ((0, 4), (2, 6)): elements 2 and 4 (and 3, 5 for offset 1)
    t.inverse([gate, up], (4, 10), dtype)        # interleaved: gate in columns 0, 2, ...
    ```
    """

    fused: ClassVar[bool] = True
    shares_regions: ClassVar[bool] = True

    axis: int
    step: int
    offset: int = 0

    @classmethod
    def parse(cls, arg: Any) -> Stride:
        if not isinstance(arg, dict) or set(arg) - {"axis", "step", "offset"} or not {"axis", "step"} <= set(arg):
            raise ValueError("stride takes { axis, step, offset }")
        if not all(_int(v) for v in arg.values()):
            raise ValueError("stride needs integer 'axis', 'step' and 'offset'")
        if arg["step"] < 1 or not 0 <= arg.get("offset", 0) < arg["step"]:
            raise ValueError(f"stride: 'step' must be positive and 'offset' in [0, step), got {arg}")
        return cls(arg["axis"], arg["step"], arg.get("offset", 0))

    def arg(self) -> dict[str, int]:
        return {"axis": self.axis, "step": self.step, "offset": self.offset}

    def _axis(self, in_shape: Shape) -> int:
        if not (in_shape and -len(in_shape) <= self.axis < len(in_shape)):
            raise ValueError(f"stride axis {self.axis} does not fit a {len(in_shape)}-d tensor")
        axis = self.axis % len(in_shape)
        if self.step < 1 or not 0 <= self.offset < self.step or in_shape[axis] % self.step:
            raise ValueError(
                f"stride of axis {self.axis} (size {in_shape[axis]}) by step {self.step} from offset {self.offset}: "
                "the step must divide the axis, the offset be below the step"
            )
        return axis

    def siblings(self, in_shape: Shape) -> tuple[Stride, ...]:
        """The strides keeping every offset of `in_shape`, in offset order (this one among them)."""
        self._axis(in_shape)
        return tuple(replace(self, offset=i) for i in range(self.step))

    def shape(self, in_shape: Shape) -> Shape:
        axis = self._axis(in_shape)
        return in_shape[:axis] + (in_shape[axis] // self.step,) + in_shape[axis + 1 :]

    def region(self, in_shape: Shape, out: Region) -> Region:
        axis = self._axis(in_shape)
        a, b = out[axis]
        span = (0, 0) if b <= a else (self.step * a, self.step * b)
        return out[:axis] + (span,) + out[axis + 1 :]

    def apply(self, block: np.ndarray, in_shape: Shape, out: Region) -> np.ndarray:
        axis = self._axis(in_shape)
        return block[(slice(None),) * axis + (slice(self.offset, None, self.step),)]

    def inverse(self, out: Sequence[np.ndarray], in_shape: Shape, in_dtype: np.dtype) -> np.ndarray:
        """Interleave every part back along the axis (`out[i]` the elements at `i`, `i + step`, ...)."""
        axis, siblings = self._axis(in_shape), self.siblings(in_shape)
        if len(out) != len(siblings):
            raise ValueError(f"stride inverse needs all {len(siblings)} parts, got {len(out)}")
        for i, (part, s) in enumerate(zip(out, siblings)):
            if tuple(part.shape) != s.shape(in_shape):
                raise ValueError(f"stride part {i} is {list(part.shape)}, expected {list(s.shape(in_shape))}")
        whole = np.empty(in_shape, np.result_type(*out))
        for i, part in enumerate(out):
            whole[(slice(None),) * axis + (slice(i, None, self.step),)] = part
        return whole

    def __str__(self) -> str:
        return f"stride(axis={self.axis}, step={self.step}, offset={self.offset})"


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
def reshape_groups(src: Shape, dst: Shape) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
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


@final
@dataclass(frozen=True)
class Chain:
    """Transforms (resolved) applied in order to a source of a given shape.

    ```python
    chain = Chain.build([Split(1, 0, parts=3), Transpose((1, 0))], (768, 2304))
    chain.shape                                  # (768, 768)
    chain.regions(box)                           # the region needed at each stage
    q = ...                                      # the full output of `chain` (and k, v of its siblings)
    chain.inverse(q, np.dtype("float32"), siblings=[(chain_k, k), (chain_v, v)])  # the source
    ```
    """

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

    def dtypes(self, dtype: np.dtype) -> list[np.dtype]:
        """The dtype at each stage for a source of `dtype`, source first."""
        out = [np.dtype(dtype)]
        for t in self.transforms:
            out.append(t.out_dtype(out[-1]))
        return out

    def inverse(
        self, out: np.ndarray, dtype: np.dtype, siblings: Sequence[tuple[Chain, np.ndarray]] = ()
    ) -> np.ndarray:
        """The source (of dtype `dtype`) rebuilt from the full output `out`: inverses in reverse order.

        A chain holding a fused transform (a split) keeps one part of its source, so it
        needs `siblings`: the `(chain, full output)` of every other part, chains equal to
        this one up to the split, which keeps another index; after the split, each chain
        has its own steps (none of them fused). Without a split, `siblings` is empty.
        """
        dtypes = self.dtypes(dtype)
        fused = [i for i, t in enumerate(self.transforms) if t.fused]
        if not fused:
            if siblings:
                raise ValueError(f"chain {self} splits nothing: it takes no siblings")
            return self._undo(out, len(self.transforms), dtypes)
        k = fused[0]
        split = self.transforms[k]
        family = split.siblings(self.shapes[k])
        parts: dict[int, np.ndarray] = {}
        for chain, y in [(self, out), *siblings]:
            if chain.transforms[:k] != self.transforms[:k] or chain.shapes[: k + 1] != self.shapes[: k + 1]:
                raise ValueError(f"chain {chain} is no sibling of {self}: they differ before the split")
            if chain.transforms[k] not in family:
                raise ValueError(f"chain {chain} is no sibling of {self}: {chain.transforms[k]} is another split")
            if any(t.fused for t in chain.transforms[k + 1 :]):
                raise ValueError(f"chain {chain} splits twice: its inverse is not supported")
            index = family.index(chain.transforms[k])
            if index in parts:
                raise ValueError(f"part {index} of {split} is given twice")
            parts[index] = chain._undo(y, len(chain.transforms), chain.dtypes(dtype), start=k + 1)
        missing = [i for i in range(len(family)) if i not in parts]
        if missing:
            raise ValueError(f"the inverse of {split} needs every part; missing {missing}")
        whole = split.inverse([parts[i] for i in range(len(family))], self.shapes[k], dtypes[k])
        return self._undo(whole, k, dtypes)

    def _undo(self, out: np.ndarray, stop: int, dtypes: Sequence[np.dtype], start: int = 0) -> np.ndarray:
        """Invert steps `stop - 1` down to `start` of `out`, the full array after step `stop - 1`."""
        if tuple(out.shape) != self.shapes[stop]:
            raise ValueError(f"inverse of {self}: got {list(out.shape)}, expected {list(self.shapes[stop])}")
        for i in reversed(range(start, stop)):
            out = self.transforms[i].inverse(out, self.shapes[i], dtypes[i])
        return out

    def __str__(self) -> str:
        return " > ".join(str(t) for t in self.transforms) or "-"
