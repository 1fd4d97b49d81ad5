"""Quantize: export's way back to FP8 with block scales, the layout DeepSeek-V3 and Qwen3 `-FP8` publish.

`port.export(..., quantize="fp8")` (`port export --quantize fp8`) writes each Linear
weight `W.weight` (`[..., M, N]`) as float8_e4m3fn and `W.weight_scale_inv` beside it:
one float32 scale per block of `quantize_block` (default 128x128), `[..., ceil(M / bm),
ceil(N / bn)]` (blocks at the edges partial). config.json's `quantization_config` says so:
`quant_method: "fp8"`, `fmt: "e4m3"`, `activation_scheme: "dynamic"`, `weight_block_size`,
`modules_to_not_convert`. It is what `_quantized._fp8` reads: port loads the export back
to exactly `float32(q) * scale`, each value by its block's scale.

**A block's scale** is transformers' `Fp8Quantize`'s, bit for bit (float32 arithmetic):
`forward = (1 / amax(|block|)) * 448`, `scale = 1 / forward`, `q = e4m3(clip(x * forward,
-448, 448))`, rounded to nearest even; an all-zero block has scale 1.

**Which tensors** (`plan_fp8`, the format's convention): a floating 2-D `*.weight` (a
Linear layer's) or a stacked per-expert weight (3-D or more, of a module `*.experts`),
but not an embedding table or the LM head (a leaf with a `vocab`, `positions` or
`token_types` axis; a module `lm_head`, one whose name holds `embed`; a tied key), not a
router or gate (a module `gate`, `router` or `*_gate`), and not a module that the config's
`quantization_config.modules_to_not_convert` names (matched as transformers matches: from
the start up to a module boundary, `.` any character and `c*` repeats, or as a suffix).
Norms, biases and everything else keep their dtype. Where the source is itself a
quantized checkpoint, only its quantized weights are candidates: what it left
unquantized stays so. The written `modules_to_not_convert` is the config's own, then the
module of every other tensor of 2 or more dimensions (and the tied ones), so that
transformers' FP8 loader keeps those as they are.

**The source's scales** (a round trip): where the source is an FP8 checkpoint whose
weight has the same block, each block keeps the source's scale `s` when quantizing with
it gives the block's values back exactly, bit for bit in the tensor's dtype
(`dtype(float32(e4m3(x * (1 / s))) * s) == x`), and gets a fresh scale otherwise. So a
model loaded from an FP8 checkpoint and exported unchanged writes the source's FP8 bytes
and scales (distinct e4m3 values times one scale stay distinct in bfloat16), where
fresh scales, from the bfloat16 values, would differ wherever the source's were computed
from float32 weights. Its scales are then written in the source's scale dtype (float32;
bfloat16 or float16, as Qwen3 `-FP8` stores them; E8M0) with its `scale_fmt`: a fresh
scale is first rounded to that dtype (E8M0 or `scale_fmt: "ue8m0"`: up to a power of two,
as transformers does) and its block quantized with the rounded scale.

Each tensor is quantized where export assembles it, one row of blocks at a time (float32
temporaries of one row of blocks), each row written at its offset (`write_quantized`).

```python
quantization = plan_fp8(inverse, (128, 128), config, tied, source.tensors)
quantization.layout(inverse.tensors)        # each quantized tensor in FP8, then its scales
```
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from .._dtypes import floating
from .._errors import CheckpointError, PlanError
from .._sources import Region, TensorInfo
from .._sources._quantized import QuantizedInfo
from .._sources._quantized._fp8 import Fp8Block, scale_values
from .._sources._quantized._source import blocks_of
from .._text import quoted
from ._invert import Inverse, Part
from ._safetensors import OutTensor

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = np.float32(448.0)
FLOAT32 = np.dtype(np.float32)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
POWERS_OF_TWO = (E8M0, np.dtype(np.uint8))  # scale dtypes that hold only powers of two (uint8: E8M0's bytes)
SCALE_SUFFIX = "_scale_inv"
EMBEDDING_AXES = frozenset({"vocab", "positions", "token_types"})
"""The mappings' logical axes along which a table is looked up (token, position, token type)."""
MAX_PATTERNS = 100_000
MAX_PATTERN_CHARS = 1000
MAX_STARRED = 64
_NOT_MATCHED = re.compile(r"[\\^$+?()\[\]{}|]")  # regular-expression syntax beyond `.` and `*`: refused
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class Target:
    """One tensor written in FP8: its key, shape and own dtype, its block, and how its scales are stored.

    `source_scales`: the source checkpoint's scale tensor of the same block, whose scales
    are kept where they reproduce the block (see the module)."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype  # the tensor unquantized (the values' dtype, the exactness check's)
    block: tuple[int, int]
    scale_dtype: np.dtype = FLOAT32
    pow2: bool = False
    source_scales: TensorInfo | None = None

    @property
    def scale_key(self) -> str:
        return self.key + SCALE_SUFFIX

    @property
    def grid(self) -> tuple[int, ...]:
        """The scale tensor's shape: one per block, ceil-divided."""
        return tuple(b for _, b in self.scales_of(tuple((0, n) for n in self.shape)))

    def scales_of(self, region: Region) -> Region:
        """The region of the scale tensor that `region` of the weight covers."""
        return (*region[:-2], *blocks_of(region[-2:], self.block))

    def aligned(self, region: Region) -> bool:
        """Whether `region` holds whole blocks (those at the edges as far as the tensor goes)."""
        return all(
            a % b == 0 and (c % b == 0 or c == n) for (a, c), b, n in zip(region[-2:], self.block, self.shape[-2:])
        )

    def nbytes(self, region: Region) -> int:
        """Bytes written for `region` (aligned): its FP8 values and the scales of its blocks."""
        scales = self.scales_of(region)
        return (
            math.prod(b - a for a, b in region) * FP8.itemsize
            + math.prod(b - a for a, b in scales) * self.scale_dtype.itemsize
        )


@dataclass(frozen=True)
class Quantization:
    """What `quantize="fp8"` writes: the tensors in FP8 (`targets`, by key) and config.json's `settings`."""

    block: tuple[int, int]
    targets: dict[str, Target]
    settings: dict[str, Any] = field(default_factory=dict)

    def layout(self, tensors: Iterable[OutTensor]) -> tuple[OutTensor, ...]:
        """`tensors` as written: each target in FP8 followed by its scales, the others as they are."""
        out = []
        for tensor in tensors:
            target = self.targets.get(tensor.key)
            if target is None:
                out.append(tensor)
            else:
                out.append(OutTensor(tensor.key, tensor.shape, FP8))
                out.append(OutTensor(target.scale_key, target.grid, target.scale_dtype))
        return tuple(out)

    def nbytes(self, key: str, region: Region, dtype: np.dtype) -> int:
        """Bytes written for `region` of tensor `key` (of `dtype` unquantized)."""
        target = self.targets.get(key)
        if target is None:
            return math.prod(b - a for a, b in region) * dtype.itemsize
        return target.nbytes(region)


# ------------------------------------------------------------------------ which tensors


def plan_fp8(
    inverse: Inverse,
    block: tuple[int, int],
    config: Mapping[str, Any],
    tied: Iterable[str] = (),
    source: Mapping[str, TensorInfo] | None = None,
) -> Quantization:
    """The tensors of `inverse` to write in FP8 blocks of `block`, by the format's convention
    (see the module); `config` is the config written (its `quantization_config`, if any, the
    source's), `tied` the mapping's tied keys, `source` the source checkpoint's tensors where
    it is one (its quantized weights, its FP8 scales kept where they reproduce a block).
    A `CheckpointError` for a `modules_to_not_convert` that is not a list of names, a
    `PlanError` where a scale's name is already a tensor's."""
    settings = config.get("quantization_config")
    settings = settings if isinstance(settings, dict) else {}
    skip = _Patterns(settings.get("modules_to_not_convert"))
    stored = {k: t for k, t in (source or {}).items() if isinstance(t, QuantizedInfo)}
    same_block = [t for t in stored.values() if _keeps(t, block)]
    ue8m0 = bool(same_block) and settings.get("scale_fmt") == "ue8m0"
    tied = tuple(tied)
    targets: dict[str, Target] = {}
    left: list[str] = []
    for tensor in inverse.tensors:
        module = _module(tensor.key)
        chosen = (
            _linear(tensor, module)
            and not _table(tensor.key, module, inverse.parts[tensor.key], tied)
            and not _router(module)
            and (not stored or tensor.key in stored)
            and not skip.match(module)
        )
        if chosen:
            info = stored.get(tensor.key)
            scales = info.parts[1] if info is not None and _keeps(info, block) else None
            scale_dtype = FLOAT32 if scales is None else scales.dtype
            pow2 = ue8m0 or scale_dtype in POWERS_OF_TWO
            targets[tensor.key] = Target(tensor.key, tensor.shape, tensor.dtype, block, scale_dtype, pow2, scales)
        elif len(tensor.shape) >= 2:
            left.append(module)
    written = {t.key for t in inverse.tensors}
    taken = sorted(t.scale_key for t in targets.values() if t.scale_key in written)
    if taken:
        raise PlanError(
            [f"tensor {quoted(key, 200)} is also the name of a scale quantize='fp8' writes" for key in taken]
        )
    return Quantization(block, targets, _settings(block, skip.names, left, tied, ue8m0))


def _settings(block: tuple[int, int], own: list[str], left: list[str], tied: Sequence[str], ue8m0: bool) -> dict:
    """config.json's `quantization_config`: `modules_to_not_convert` the config's own names, then
    the modules `left` unquantized and the tied ones (a tied head is not written, but
    transformers' model has the module)."""
    left = list(left)
    for module in map(_module, tied):
        if not any(m == module or m.endswith("." + module) for m in left):
            left.append(module)
    settings: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": own + sorted(set(left) - set(own)),
    }
    if ue8m0:
        settings["scale_fmt"] = "ue8m0"
    return settings


def _module(key: str) -> str:
    """The module a tensor belongs to: its key without the last name (`mlp.down_proj.weight` -> `mlp.down_proj`)."""
    return key.rsplit(".", 1)[0] if "." in key else key


def _linear(tensor: OutTensor, module: str) -> bool:
    """A Linear layer's weight: floating, 2-D `*.weight`, or stacked experts' (`*.experts.*`, 3-D or more)."""
    if not floating(tensor.dtype):
        return False
    if len(tensor.shape) == 2:
        return tensor.key.endswith(".weight")
    return len(tensor.shape) >= 3 and module.endswith(".experts")


def _table(key: str, module: str, parts: Sequence[Part], tied: Sequence[str]) -> bool:
    """An embedding table or the LM head (see the module)."""
    last = module.rsplit(".", 1)[-1]
    if last == "lm_head" or "embed" in last or any(key == t or key.endswith("." + t) for t in tied):
        return True
    return any(axis in EMBEDDING_AXES for part in parts for axis in part.leaf.axes)


def _router(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return last in ("gate", "router") or last.endswith("_gate")


def _keeps(info: TensorInfo, block: tuple[int, int]) -> bool:
    """Whether `info` is an FP8 e4m3 weight of the source in blocks of `block`: its scales may be kept."""
    return (
        isinstance(info, Fp8Block)
        and not info.fp4
        and info.packed.dtype == FP8
        and len(info.block) >= 2
        and tuple(info.block[-2:]) == tuple(block)
        and all(b == 1 for b in info.block[:-2])
    )


class _Patterns:
    """`modules_to_not_convert`, matched as transformers' `should_convert_module` matches it, in
    bounded time: each name as a regular expression of literal characters, `.` (any character)
    and `c*` (a repeat), from the start up to a module boundary; or literally, as a suffix."""

    def __init__(self, names: Any):
        where = "config.json: quantization_config.modules_to_not_convert"
        if names is None:
            names = []
        if not isinstance(names, list) or len(names) > MAX_PATTERNS:
            raise CheckpointError(f"{where} must be a list of at most {MAX_PATTERNS} module names")
        fixed, self.starred = [], []
        for name in names:
            if not isinstance(name, str) or not 0 < len(name) <= MAX_PATTERN_CHARS or _NOT_MATCHED.search(name):
                raise CheckpointError(
                    f"{where}: {quoted(name, 80)} is not a module name (at most {MAX_PATTERN_CHARS} characters; "
                    "'.' and '*' the only patterns)"
                )
            if name.startswith("*") or "**" in name:
                raise CheckpointError(f"{where}: {quoted(name, 80)}: '*' repeats the character before it")
            if "*" in name:
                self.starred.append(_tokens(name))
            else:
                fixed.append("".join("." if c == "." else re.escape(c) for c in name))
        if len(self.starred) > MAX_STARRED:
            raise CheckpointError(f"{where}: more than {MAX_STARRED} names with '*'")
        self.names = list(names)
        self._suffixes = tuple(names)
        # fixed-length alternatives, anchored at the start: no backtracking beyond their lengths
        self._fixed = re.compile("(?:" + "|".join(fixed) + r")(?:(?<=\.)|(?=\.|$))") if fixed else None

    def match(self, module: str) -> bool:
        if module.endswith(self._suffixes):
            return True
        if self._fixed is not None and self._fixed.match(module):
            return True
        return any(_boundary(module, end) for tokens in self.starred for end in _ends(tokens, module))


def _tokens(pattern: str) -> list[tuple[str | None, bool]]:
    """A pattern as (character or None for any, repeated) per item."""
    out: list[tuple[str | None, bool]] = []
    for c in pattern:
        if c == "*":
            out[-1] = (out[-1][0], True)
        else:
            out.append((None if c == "." else c, False))
    return out


def _ends(tokens: list[tuple[str | None, bool]], name: str) -> list[int]:
    """Every `end` such that the pattern matches `name[:end]` whole (a set of states per character: linear)."""

    def closure(states: set[int]) -> set[int]:
        todo, seen = list(states), set(states)
        while todo:
            s = todo.pop()
            if s < len(tokens) and tokens[s][1] and s + 1 not in seen:
                seen.add(s + 1)
                todo.append(s + 1)
        return seen

    states = closure({0})
    ends = [0] if len(tokens) in states else []
    for i, c in enumerate(name):
        step = set()
        for s in states:
            if s < len(tokens) and tokens[s][0] in (None, c):
                step.add(s if tokens[s][1] else s + 1)
        states = closure(step)
        if not states:
            break
        if len(tokens) in states:
            ends.append(i + 1)
    return ends


def _boundary(name: str, end: int) -> bool:
    return end == len(name) or name[end] == "." or (end > 0 and name[end - 1] == ".")


# ------------------------------------------------------------------------ the quantizing


def _e4m3(values: np.ndarray) -> np.ndarray:
    return np.clip(values, -FP8_MAX, FP8_MAX).astype(FP8)


def _stored(scale: np.ndarray, target: Target) -> np.ndarray:
    """Fresh float32 scales in the target's scale dtype: powers of two rounded up where it
    holds only those (or `scale_fmt` says ue8m0), else rounded to nearest."""
    if target.pow2:
        mantissa, exponent = np.frexp(np.maximum(scale, np.finfo(np.float32).tiny))
        power = np.ldexp(np.float32(1), np.where(mantissa == 0.5, exponent - 1, exponent)).astype(np.float32)
        scale = np.where(np.isfinite(scale), power, scale)
    if target.scale_dtype == np.uint8:
        return scale.astype(E8M0).view(np.uint8)
    return scale.astype(target.scale_dtype)


def _fresh(blocks: np.ndarray, target: Target) -> tuple[np.ndarray, np.ndarray]:
    """`blocks` (float32, `[..., gm, bm, gn, bn]`) quantized with scales of their own: (q, scales)."""
    amax = np.abs(blocks).max(axis=(-3, -1))
    nonzero = amax > 0
    forward = np.where(nonzero, np.reciprocal(np.where(nonzero, amax, np.float32(1))) * FP8_MAX, np.float32(1))
    forward = forward.astype(np.float32)
    scales = np.reciprocal(forward)
    stored = _stored(scales, target)
    if target.pow2 or target.scale_dtype != FLOAT32:  # quantized with the scale as stored
        forward = np.reciprocal(scale_values(stored))
    return _e4m3(blocks * forward[..., :, None, :, None]), stored


def _bits(values: np.ndarray) -> np.ndarray:
    return values.view(_UINT[values.dtype.itemsize])


def quantize_box(x: np.ndarray, target: Target, kept: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A box of the target's tensor (`[..., m, n]`, starting on a block's corner) in FP8, and its
    blocks' scales in the target's scale dtype. `kept`: the source's scales of those blocks,
    each kept where it gives the block back exactly (see the module).

    ```python
    q, scales = quantize_box(weight, Target("w.weight", weight.shape, weight.dtype, (128, 128)))
    ```
    """
    *lead, m, n = x.shape
    bm, bn = target.block
    gm, gn = -(-m // bm), -(-n // bn)
    padded = np.zeros((*lead, gm * bm, gn * bn), np.float32)
    padded[..., :m, :n] = x
    blocks = padded.reshape(*lead, gm, bm, gn, bn)
    q, scales = _fresh(blocks, target)
    if kept is not None:
        forward = np.reciprocal(scale_values(kept))
        again = _e4m3(blocks * forward[..., :, None, :, None])
        back = (again.astype(np.float32) * scale_values(kept)[..., :, None, :, None]).astype(x.dtype)
        same = _bits(back) == _bits(padded.astype(x.dtype).reshape(blocks.shape))
        keep = same.all(axis=(-3, -1))
        q = np.where(keep[..., :, None, :, None], _bits(again), _bits(q)).view(FP8)
        scales = np.where(keep, _bits(kept), _bits(scales)).view(target.scale_dtype)
    return q.reshape(padded.shape)[..., :m, :n], scales


def write_quantized(
    writer: Any, target: Target, data: np.ndarray, region: Region, kept: np.ndarray | None
) -> tuple[int, int]:
    """Quantize `data`, the box `region` of the target's tensor (whole blocks), one row of blocks
    at a time, each row written at its offset by `writer` (`write_region`), then the box's
    scales; returns (bytes written, 1)."""
    bm = target.block[0]
    lead = len(region) - 2
    (r0, _), columns = region[-2], region[-1]
    scales = np.empty(tuple(b - a for a, b in target.scales_of(region)), target.scale_dtype)
    written = 0
    for index in np.ndindex(*data.shape[:lead]):
        for start in range(0, data.shape[-2], bm):
            rows = data[(*index, slice(start, start + bm))]
            at = (*index, slice(start // bm, start // bm + 1))
            q, scales[at] = quantize_box(rows, target, None if kept is None else kept[at])
            box = (
                *((a + i, a + i + 1) for (a, _), i in zip(region[:lead], index)),
                (r0 + start, r0 + start + rows.shape[0]),
                columns,
            )
            written += writer.write_region(target.key, box, q.reshape(tuple(b - a for a, b in box)))
    if not data.size:  # nothing to quantize: the empty box still counts as written
        written += writer.write_region(target.key, region, np.empty(data.shape, FP8))
    written += writer.write_region(target.scale_key, target.scales_of(region), scales)
    return written, 1


def scales_reader(checkpoint: Any) -> Callable[[Target, Region], np.ndarray | None]:
    """`read(target, region)`: the source's scales of `region` of the scale tensor, None where the
    target keeps none. `checkpoint` is the source opened (a `DequantizedCheckpoint`), or None."""
    inner = getattr(checkpoint, "inner", None)

    def read(target: Target, region: Region) -> np.ndarray | None:
        if target.source_scales is None or inner is None:
            return None
        return inner.read(target.source_scales.key, region)

    return read
