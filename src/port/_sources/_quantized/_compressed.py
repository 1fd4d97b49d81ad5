"""compressed-tensors (`quant_method: "compressed-tensors"`): llm-compressor's releases (Neural
Magic / Red Hat `-W4A16`, `-FP8-dynamic`, `-NVFP4`), Kimi K2 Thinking's int4 experts, NVIDIA's NVFP4.

`quantization_config.config_groups` give each group of modules a scheme (`targets`: names,
`re:` regexes or class names such as `Linear`; `weights`: `num_bits`, `type`, `strategy`,
`group_size`, `symmetric`); `ignore` lists the modules left unquantized; `format` (per group,
else the config's) says how a module `M`'s weight is stored:

- `pack-quantized`: `M.weight_packed` int32, `num_bits` (1 to 8) values of each row packed
  densely (value `i` at bit `i * num_bits` of the row, little-endian words), stored unsigned
  (`q + 2**(num_bits - 1)`); `M.weight_scale` per tensor, channel or group of `group_size`
  columns; asymmetric groups and channels have `M.weight_zero_point` packed the same way along
  the rows (the output dimension), a tensor's as it is; `M.weight_shape` holds `[out, in]`.
- `nvfp4-pack-quantized`: `M.weight_packed` uint8, two e2m1 values a byte (low nibble first);
  `M.weight_scale` float8 e4m3 per 16 columns; `M.weight_global_scale` float32 `[1]`.
- `float-quantized` / `int-quantized` / `naive-quantized`: `M.weight` itself in float8 or int8,
  with `M.weight_scale` (tensor, channel, group or block) and, asymmetric, `M.weight_zero_point`.

Each is read as `M.weight` `[out, in]` equal to what the package's own decompression gives
(its compressors' `decompress`): `(q - zero) * scale` (an NVFP4 scale divided by the global
one first), rounded as it rounds, to the scale's dtype (bfloat16 for NVFP4). `[out, in]`
comes from the headers: the packed width with the scales' groups (or the NVFP4 bytes); only
a packed tensor with per-channel or per-tensor scales, whose width leaves `in` to within
`32 / num_bits`, has its 16-byte `weight_shape` read. A region reads its packed rows and
words, the scales (and packed zero-point rows) that cover it, nothing else. Activation and
KV-cache scales (`input_scale`, `input_global_scale`, `k_scale`, ...) are consumed, unused.

```python
info = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]      # Compressed: float32[64, 128]
info.describe()   # 'int4 pack-quantized (8 per int32), groups of 16, scales weight_scale bfloat16'
info.regions(((8, 24), (20, 50)))   # weight_packed rows 8-24 words 2-7, weight_scale groups 1-4
```
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, final

import ml_dtypes
import numpy as np

from ..._errors import CheckpointError
from ..._text import quoted
from .._checkpoint import Region, TensorInfo
from ._format import Format
from ._fp8 import FP4_VALUES, fp8_values, scale_blocks
from ._source import BFLOAT16, FLOAT32, Blocks, QuantizedInfo, blocks_of, finite, shape_text, spread

PACKED, NVFP4 = "pack-quantized", "nvfp4-pack-quantized"
NAIVE = ("float-quantized", "int-quantized", "naive-quantized")
FORMATS_READ = (PACKED, NVFP4, *NAIVE)
STRATEGIES = {  # the strategies each kind of format stores
    PACKED: ("tensor", "channel", "group"),
    NVFP4: ("group", "tensor_group"),
    "naive": ("tensor", "channel", "group", "block"),
}
SCALES = (FLOAT32, BFLOAT16, np.dtype(np.float16))
NVFP4_SCALES = (np.dtype(ml_dtypes.float8_e4m3fn), *SCALES)
FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
INT32, INT8, UINT8 = np.dtype(np.int32), np.dtype(np.int8), np.dtype(np.uint8)
SHAPE_DTYPES = (np.dtype(np.int64), INT32)
COMPANIONS = (".weight_scale", ".weight_zero_point", ".weight_global_scale", ".weight_shape", ".weight_g_idx")
ACTIVATIONS = (
    ".input_scale",
    ".input_zero_point",
    ".input_global_scale",
    ".output_scale",
    ".output_zero_point",
    ".k_scale",
    ".v_scale",
    ".q_scale",
)
MAX_PATTERNS, MAX_PATTERN_CHARS = 10_000, 1_000
"""The most targets and ignore entries a config may list, and characters a `re:` pattern may have."""


@dataclass(frozen=True)
class Scheme:
    """One config group's weight quantization, as stored: its format and what a scale covers."""

    group: str
    format: str
    num_bits: int
    type: str
    strategy: str
    group_size: int
    block: tuple[int, int]
    symmetric: bool


@final
@dataclass(frozen=True)
class Compressed(QuantizedInfo):
    """A compressed-tensors weight `[out, in]`: `parts` are the packed (or float8 / int8) weight,
    its scales, then its zero points (`zero`: "packed" along the rows, "plain" as the scales),
    then its global scale (`global_scale`). One scale covers `block` (rows, columns) of the
    weight; `bits` per packed value (`kind` "pack"), 4 for "nvfp4", 0 for an unpacked weight."""

    kind: str = "naive"
    bits: int = 0
    block: tuple[int, int] = (1, 1)
    zero: str = ""
    global_scale: bool = False
    result: np.dtype = FLOAT32
    scheme: str = ""

    def regions(self, region: Region) -> tuple[tuple[Region, ...], ...]:
        grid = blocks_of(region, self.block)
        wanted: list[tuple[Region, ...]] = [(self._packed_region(region),), (_stored(grid, self.parts[1]),)]
        if self.zero == "packed":
            (a, b), columns = grid
            wanted.append((((a * self.bits // 32, -(-b * self.bits // 32)), columns),))
        elif self.zero:
            wanted.append((_stored(grid, self.parts[2]),))
        if self.global_scale:
            wanted.append((tuple((0, n) for n in self.parts[-1].shape),))
        return tuple(wanted)

    def _packed_region(self, region: Region) -> Region:
        rows, (c, d) = region
        if self.kind == "pack":
            return rows, (c * self.bits // 32, -(-d * self.bits // 32))
        if self.kind == "nvfp4":
            return rows, (c // 2, -(-d // 2))
        return region

    def dequantize(self, region: Region, blocks: Blocks) -> np.ndarray:
        grid = blocks_of(region, self.block)
        grid_shape = tuple(b - a for a, b in grid)
        values = self._values(region, blocks[0][0])
        scale = finite(blocks[1][0].astype(np.float32), self.parts[1]).reshape(grid_shape)
        if self.zero:
            zero = blocks[2][0]
            if self.zero == "packed":  # along the rows: unpacked as the rows of its transpose
                first = grid[0][0] * self.bits
                zero = unpack_ints(zero.T, first - 32 * (first // 32), grid_shape[0], self.bits).T
            zero = rounded(zero.astype(np.float32).reshape(grid_shape), self.result)
            values = rounded(values - spread(zero, region, self.block), self.result)
        if self.kind == "nvfp4":  # its scales are cast to bfloat16 first
            scale = rounded(scale, BFLOAT16)
        if self.global_scale:
            scale = finite(scale / blocks[-1][0].astype(np.float32).reshape(()), self.parts[-1])
        return rounded(scale_blocks(values, scale, region, self.block), self.result)

    def _values(self, region: Region, stored: np.ndarray) -> np.ndarray:
        """The quantized values of `region` (float32) from its packed (or plain) block."""
        (c, d) = region[1]
        if self.kind == "pack":
            return unpack_ints(stored, c * self.bits - 32 * (c * self.bits // 32), d - c, self.bits)
        if self.kind == "nvfp4":
            return looked_up(stored.view(np.uint8), _byte_values(0))[:, c % 2 : c % 2 + d - c]
        return fp8_values(stored) if stored.dtype in FP8 else stored.astype(np.float32)

    def describe(self) -> str:
        scale = self.parts[1]
        if self.kind == "pack":
            kind = f"int{self.bits} {PACKED} ({32 // self.bits} per int32)" if 32 % self.bits == 0 else ""
            kind = kind or f"int{self.bits} {PACKED} (32 in {self.bits} int32)"
        elif self.kind == "nvfp4":
            kind = "nvfp4 e2m1 (2 per byte)"
        else:
            name = self.packed.dtype.name
            kind = f"{'fp8 ' + name.removeprefix('float8_') if name.startswith('float8') else name} {self.scheme}"
        text = f"{kind}, {_covers(self.block, self.shape)}, scales {_suffix(scale)} {scale.dtype.name}"
        if self.zero:
            text += f", zero points {_suffix(self.parts[2])}"
        if self.global_scale:
            text += f", global scale {_suffix(self.parts[-1])}"
        return text


def unpack_ints(words: np.ndarray, start: int, count: int, bits: int) -> np.ndarray:
    """`count` signed values of `bits` bits from each row of int32 `words`, the first `start`
    bits into the row (dense packing: value `i` at bit `i * bits` of the row's little-endian
    words, stored as `q + 2**(bits - 1)`), as float32 (a view of a new array)."""
    u8 = np.ascontiguousarray(words).view(np.uint8)
    if 8 % bits == 0:  # whole values in each byte
        return looked_up(u8, _byte_values(bits))[..., start // bits : start // bits + count]
    stream = np.unpackbits(u8, axis=-1, bitorder="little")[..., start : start + count * bits]
    weights = (1 << np.arange(bits)).astype(np.uint16)
    values = (stream.reshape(*stream.shape[:-1], count, bits) * weights).sum(-1, dtype=np.uint16)
    return values.astype(np.float32) - float(1 << (bits - 1))


def looked_up(u8: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Bytes `u8` ([..., n]) as the values `table` ([256, k] float32) gives each: [..., n * k]."""
    if table.shape[1] <= 2:  # a byte's values read as one uint32 or uint64: one take
        values = np.take(table.view(f"u{4 * table.shape[1]}").reshape(-1), u8).view(np.float32)
    else:
        values = table[u8]
    return values.reshape(*u8.shape[:-1], -1)


@functools.cache
def _byte_values(bits: int) -> np.ndarray:
    """The values of each byte, low bits first, as float32 `[256, 8 // bits]`: signed `bits`-bit
    integers; with `bits` 0, its two e2m1 nibbles."""
    if bits == 0:
        return FP4_VALUES[np.stack([np.arange(256) & 0xF, np.arange(256) >> 4], axis=1)]
    fields = np.arange(256, dtype=np.uint16)[:, None] >> (bits * np.arange(8 // bits, dtype=np.uint16))
    return (fields & ((1 << bits) - 1)).astype(np.float32) - float(1 << (bits - 1))


def rounded(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float32 `values` rounded to `dtype` (to nearest, ties to even, as torch's `.to`), as float32."""
    return values if dtype == FLOAT32 else values.astype(dtype).astype(np.float32)


def _stored(grid: Region, part: TensorInfo) -> Region:
    """The region of a scale (or zero-point) tensor stored with its trailing grid dimensions of
    1 dropped (`[1]` for one scale, `[out]` per channel) that `grid` covers."""
    return grid[: len(part.shape)]


def _suffix(part: TensorInfo) -> str:
    return part.key.rsplit(".", 1)[-1]


def _covers(block: tuple[int, int], shape: tuple[int, ...]) -> str:
    if block == tuple(shape):
        return "one scale"
    if block == (1, shape[1]):
        return "per-channel"
    if block[0] == 1:
        return f"groups of {block[1]}"
    return f"{block[0]}x{block[1]} blocks"


@final
class CompressedTensors(Format, methods=("compressed-tensors",)):
    """`quant_method: "compressed-tensors"` (transformers' CompressedTensorsConfig)."""

    @classmethod
    def find(
        cls,
        config: Mapping[str, Any],
        settings: Mapping[str, Any],
        tensors: Mapping[str, TensorInfo],
        out_dtype: np.dtype,
        read: Callable[[str], np.ndarray],
    ) -> tuple[list[QuantizedInfo], set[str]]:
        groups, ignore = _groups(settings)
        hidden = {key for key in tensors if key.endswith(ACTIVATIONS)}
        sources: list[QuantizedInfo] = []
        for module, root in _modules(tensors).items():
            scheme = _scheme_for(module, tensors[root], groups, ignore)
            info, consumed = _source(module, root, scheme, tensors, out_dtype, read)
            sources.append(info)
            hidden |= consumed
        used = hidden | {part.key for info in sources for part in info.parts}
        for key, info in tensors.items():
            if key.endswith(COMPANIONS) and key not in used:
                raise CheckpointError(
                    f"{info.file.name}: tensor {quoted(key, 200)} belongs to no quantized weight "
                    f"(no {quoted(key.rsplit('.', 1)[0] + '.weight_packed', 200)} or quantized "
                    f"{quoted(key.rsplit('.', 1)[0] + '.weight', 200)})"
                )
        return sources, hidden


def _modules(tensors: Mapping[str, TensorInfo]) -> dict[str, str]:
    """Each quantized module's name and its root tensor: `M.weight_packed`, or `M.weight` with `M.weight_scale`."""
    modules = {}
    for key in tensors:
        if key.endswith(".weight_packed"):
            modules[key.removesuffix(".weight_packed")] = key
    for key in tensors:
        module = key.removesuffix(".weight_scale")
        if key.endswith(".weight_scale") and module not in modules and module + ".weight" in tensors:
            modules[module] = module + ".weight"
    return modules


# ------------------------------------------------------------------ the config


def _groups(settings: Mapping[str, Any]) -> tuple[list[tuple[str, list[str], Scheme | None]], list[str]]:
    """The config groups as (name, targets, scheme or None without `weights`), and `ignore`."""
    groups = settings.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(
            f"config.json: quantization_config.config_groups must be an object of groups, got {quoted(groups)}"
        )
    ignore = _patterns(settings.get("ignore") or [], "quantization_config.ignore")
    top = settings.get("format")
    found = []
    for name, group in groups.items():
        where = f"config.json: quantization_config.config_groups[{quoted(name)}]"
        if not isinstance(group, dict):
            raise CheckpointError(f"{where} must be an object with 'targets' and 'weights', got {quoted(group)}")
        targets = _patterns(group.get("targets"), f"quantization_config.config_groups[{quoted(name)}].targets")
        weights = group.get("weights")
        scheme = None if weights is None else _scheme(name, where, weights, group.get("format") or top)
        found.append((name, targets, scheme))
    if all(scheme is None for _, _, scheme in found):
        raise CheckpointError("config.json: no quantization_config.config_groups entry has 'weights'")
    return found, ignore


def _patterns(value: Any, where: str) -> list[str]:
    """A list of module names and `re:` patterns, each pattern compiled once to check it."""
    if not isinstance(value, list) or len(value) > MAX_PATTERNS or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"config.json: {where} must be a list of names, got {quoted(value)}")
    for pattern in value:
        if pattern.startswith("re:"):
            if len(pattern) > MAX_PATTERN_CHARS:
                raise CheckpointError(f"config.json: {where} has a pattern of more than {MAX_PATTERN_CHARS} characters")
            try:
                _compiled(pattern)
            except re.error as error:
                raise CheckpointError(
                    f"config.json: {where} {quoted(pattern)} is not a regular expression: {error}"
                ) from None
    return value


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern[str]:
    """A `re:` target or ignore entry as the regular expression it holds."""
    return re.compile(pattern.removeprefix("re:"))


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' `match_name`: a `re:` pattern matching from the name's start, else the name itself."""
    return _compiled(target).match(name) is not None if target.startswith("re:") else target == name


def _is_class(target: str) -> bool:
    """Whether a target names a module class (`Linear`), which only the model could tell apart."""
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def _scheme(name: str, where: str, weights: Any, form: Any) -> Scheme:
    """A group's `weights` arguments, checked as compressed-tensors' QuantizationArgs checks them."""
    if not isinstance(weights, dict):
        raise CheckpointError(f"{where}.weights must be an object, got {quoted(weights)}")
    if not isinstance(form, str) or form not in FORMATS_READ:
        raise CheckpointError(f"{where}: format {quoted(form)} is not supported (supported: {', '.join(FORMATS_READ)})")
    bits, kind, size = weights.get("num_bits", 8), weights.get("type", "int"), weights.get("group_size")
    if not _integer(bits) or not 1 <= bits <= 8:
        raise CheckpointError(f"{where}.weights.num_bits {quoted(bits)} must be an integer from 1 to 8")
    if kind not in ("int", "float"):
        raise CheckpointError(f"{where}.weights.type {quoted(kind)} must be 'int' or 'float'")
    if size is not None and (not _integer(size) or size == 0 or size < -1):
        raise CheckpointError(f"{where}.weights.group_size {quoted(size)} must be a positive integer or -1")
    strategy = weights.get("strategy")
    if strategy is None:
        strategy = "tensor" if size is None else "channel" if size == -1 else "group"
    family = form if form in (PACKED, NVFP4) else "naive"
    if strategy not in STRATEGIES[family]:
        raise CheckpointError(
            f"{where}.weights.strategy {quoted(strategy)} is not one format {form} stores "
            f"({', '.join(STRATEGIES[family])})"
        )
    if strategy in ("group", "tensor_group") and (size is None or size < 1):
        raise CheckpointError(f"{where}.weights.group_size {quoted(size)} must be positive for strategy {strategy}")
    block = _block(where, weights.get("block_structure"), strategy)
    symmetric = weights.get("symmetric", True)
    actorder = weights.get("actorder")
    if actorder is True or (isinstance(actorder, str) and actorder.lower() in ("group", "dynamic")):
        raise CheckpointError(
            f"{where}.weights.actorder {quoted(actorder)}: activation-order groups (weight_g_idx) are not read, "
            "as compressed-tensors 0.20 no longer reads them"
        )
    if weights.get("dynamic") not in (None, False):
        raise CheckpointError(f"{where}.weights.dynamic {quoted(weights.get('dynamic'))}: weights have stored scales")
    _check_kind(where, form, kind, bits, symmetric)
    return Scheme(name, form, bits, kind, strategy, size or 0, block, bool(symmetric))


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _block(where: str, value: Any, strategy: str) -> tuple[int, int]:
    if strategy != "block":
        return (0, 0)
    if isinstance(value, str):
        parts = value.split("x")
        value = [int(p) for p in parts] if len(parts) == 2 and all(p.isdigit() for p in parts) else value
    if not isinstance(value, list) or len(value) != 2 or not all(_integer(v) and v > 0 for v in value):
        raise CheckpointError(f"{where}.weights.block_structure {quoted(value)} must be two positive integers")
    return value[0], value[1]


def _check_kind(where: str, form: str, kind: str, bits: int, symmetric: Any) -> None:
    """The value types each format stores."""
    if not isinstance(symmetric, bool):
        raise CheckpointError(f"{where}.weights.symmetric {quoted(symmetric)} must be true or false")
    wanted = {
        PACKED: ("int", None),
        NVFP4: ("float", 4),
        "float-quantized": ("float", 8),
        "int-quantized": ("int", None),
    }
    kind_wanted, bits_wanted = wanted.get(form, (kind, 8 if kind == "float" else None))
    if kind != kind_wanted or bits_wanted not in (None, bits):
        bits_text = f"{bits_wanted}-bit " if bits_wanted else ""
        raise CheckpointError(
            f"{where}: format {form} stores {bits_text}{kind_wanted} weights, not {bits}-bit {kind} ones"
        )
    if form == NVFP4 and not symmetric:
        raise CheckpointError(f"{where}: format {form} is symmetric (its decompression has no zero points)")


def _scheme_for(
    module: str, root: TensorInfo, groups: Sequence[tuple[str, list[str], Scheme | None]], ignore: Sequence[str]
) -> Scheme:
    """The scheme compressed-tensors gives `module`: the group of its first target by name
    (names before `re:` patterns, each sorted), else by class; a later group's same target wins."""
    where = f"{root.file.name}: tensor {quoted(root.key, 200)}"
    ignored = next((p for p in ignore if not _is_class(p) and _matches(module, p)), None)
    if ignored is not None:
        raise CheckpointError(f"{where} is quantized, but quantization_config.ignore lists it ({quoted(ignored)})")
    by_target: dict[str, tuple[str, Scheme | None]] = {}
    for name, targets, scheme in groups:
        by_target.update((target, (name, scheme)) for target in targets)
    ordered = sorted(by_target, key=lambda t: ("re:" in t, t))
    named = [t for t in ordered if not _is_class(t) and _matches(module, t)]
    chosen = [by_target[named[0]]] if named else [by_target[t] for t in ordered if _is_class(t)]
    if not chosen:
        raise CheckpointError(f"{where} is quantized, but no quantization_config.config_groups entry targets it")
    if len({scheme for _, scheme in chosen}) > 1:
        raise CheckpointError(
            f"{where}: config groups {', '.join(quoted(n) for n, _ in chosen)} target it by class only "
            "and differ; port cannot tell which class it is"
        )
    name, scheme = chosen[0]
    if scheme is None:
        raise CheckpointError(f"{where} is quantized, but config group {quoted(name)} that targets it has no 'weights'")
    return scheme


# ------------------------------------------------------------------ the tensors


def _source(
    module: str,
    root: str,
    scheme: Scheme,
    tensors: Mapping[str, TensorInfo],
    out_dtype: np.dtype,
    read: Callable[[str], np.ndarray],
) -> tuple[Compressed, set[str]]:
    """`module`'s weight as a `Compressed`, every part checked against the others; and the
    keys it consumes without reading (`weight_shape`, a zero point its scheme does not use)."""
    weight = tensors[root]
    where = f"{weight.file.name}: tensor {quoted(root, 200)}"
    if len(weight.shape) != 2:
        raise CheckpointError(f"{where} is {shape_text(weight.shape)}: compressed-tensors weights are [out, in]")
    packed = root.endswith(".weight_packed")
    if packed != (scheme.format in (PACKED, NVFP4)):
        stored = "a packed weight_packed" if packed else "an unpacked weight"
        raise CheckpointError(f"{where}: config group {quoted(scheme.group)} is {scheme.format}, not {stored}")
    scale = _companion(tensors, module, "weight_scale", where)
    consumed: set[str] = set()
    if scheme.format == PACKED:
        shape = _packed_shape(module, weight, scale, scheme, tensors, read, where)
        consumed.add(module + ".weight_shape")
        kind, result = "pack", _scale_result(scale, SCALES)
    elif scheme.format == NVFP4:
        _dtype(weight, (UINT8,), where, "uint8, two e2m1 values a byte")
        shape, kind, result = (weight.shape[0], 2 * weight.shape[1]), "nvfp4", BFLOAT16
        _scale_result(scale, NVFP4_SCALES)
    else:
        _dtype(weight, FP8 if scheme.type == "float" else (INT8,), where, f"{scheme.type} {scheme.num_bits}-bit")
        shape, kind, result = weight.shape, "naive", _scale_result(scale, SCALES)
    block = _grid_block(scheme, shape)
    _check_grid(scale, block, shape, root, scheme)
    parts = [weight, scale]
    zero, zero_kind = _zero(module, scheme, tensors, where), ""
    if zero is not None and scheme.format == NVFP4:
        consumed.add(zero.key)  # its decompression has no zero points
    elif zero is not None:
        packs = scheme.format == PACKED and not scheme.symmetric and scheme.strategy in ("group", "channel")
        zero_kind = "packed" if packs else "plain"
        _check_zero(zero, zero_kind, block, shape, scheme, root)
        parts.append(zero)
    global_scale = tensors.get(module + ".weight_global_scale")
    if (global_scale is not None) != (scheme.strategy == "tensor_group"):
        raise CheckpointError(
            f"{where}: {'a' if global_scale is None else 'no'} {quoted(module + '.weight_global_scale', 200)} "
            f"is expected for strategy {scheme.strategy}"
        )
    if global_scale is not None:
        if global_scale.shape != (1,) or global_scale.dtype not in SCALES:
            raise CheckpointError(
                f"{global_scale.file.name}: tensor {quoted(global_scale.key, 200)} is {global_scale.dtype.name} "
                f"{shape_text(global_scale.shape)}, not one float [1]"
            )
        parts.append(global_scale)
    info = Compressed(
        module + ".weight",
        weight.file,
        FLOAT32,
        tuple(shape),
        weight.offset,
        weight.file_id,
        parts=tuple(parts),
        out_dtype=out_dtype,
        kind=kind,
        bits=scheme.num_bits if kind == "pack" else 4 if kind == "nvfp4" else 0,
        block=block,
        zero=zero_kind,
        global_scale=global_scale is not None,
        result=result,
        scheme=scheme.format,
    )
    return info, consumed


def _companion(tensors: Mapping[str, TensorInfo], module: str, name: str, where: str) -> TensorInfo:
    part = tensors.get(f"{module}.{name}")
    if part is None:
        raise CheckpointError(f"{where} has no {quoted(f'{module}.{name}', 200)} beside it")
    return part


def _dtype(part: TensorInfo, allowed: Sequence[np.dtype], where: str, what: str) -> None:
    if part.dtype not in allowed:
        raise CheckpointError(f"{where} is {part.dtype.name}, not {what}")


def _scale_result(scale: TensorInfo, allowed: Sequence[np.dtype]) -> np.dtype:
    """The dtype the package's decompression gives (the scales'), once they are one of `allowed`."""
    if scale.dtype not in allowed:
        raise CheckpointError(
            f"{scale.file.name}: tensor {quoted(scale.key, 200)} is {scale.dtype.name}, not a scale "
            f"({', '.join(d.name for d in allowed)})"
        )
    return scale.dtype


def _packed_shape(
    module: str,
    packed: TensorInfo,
    scale: TensorInfo,
    scheme: Scheme,
    tensors: Mapping[str, TensorInfo],
    read: Callable[[str], np.ndarray],
    where: str,
) -> tuple[int, int]:
    """`[out, in]` of an int32-packed weight: `in` from its groups' scales where it has them,
    else from its `weight_shape` (read: the packed width leaves it to within 32 / num_bits)."""
    _dtype(packed, (INT32,), where, "int32 (pack-quantized)")
    shape_part = _companion(tensors, module, "weight_shape", where)
    if shape_part.shape != (2,) or shape_part.dtype not in SHAPE_DTYPES:
        raise CheckpointError(
            f"{shape_part.file.name}: tensor {quoted(shape_part.key, 200)} is {shape_part.dtype.name} "
            f"{shape_text(shape_part.shape)}, not the two integers of a weight's [out, in]"
        )
    out, words = packed.shape
    bits = scheme.num_bits
    if scheme.strategy == "group":
        if len(scale.shape) != 2:
            raise CheckpointError(
                f"{scale.file.name}: tensor {quoted(scale.key, 200)} is {shape_text(scale.shape)}, not [out, groups]"
            )
        columns = scale.shape[1] * scheme.group_size
        if -(-columns * bits // 32) != words:
            raise CheckpointError(
                f"{where} is {shape_text(packed.shape)}, but {quoted(scale.key, 200)} "
                f"{shape_text(scale.shape)} in groups of {scheme.group_size} makes {columns} columns of "
                f"{bits} bits, {-(-columns * bits // 32)} int32 a row"
            )
        return out, columns
    stored = read(shape_part.key).astype(np.int64).tolist()
    if stored[0] != out or not 0 < stored[1] or -(-stored[1] * bits // 32) != words:
        raise CheckpointError(
            f"{shape_part.file.name}: tensor {quoted(shape_part.key, 200)} holds {stored}, but "
            f"{quoted(packed.key, 200)} is {shape_text(packed.shape)} of {bits}-bit values"
        )
    return out, stored[1]


def _grid_block(scheme: Scheme, shape: Sequence[int]) -> tuple[int, int]:
    """The rows and columns of the weight one scale covers."""
    out, columns = shape
    if scheme.strategy == "tensor":
        return out, columns
    if scheme.strategy == "channel":
        return 1, columns
    if scheme.strategy == "block":
        return scheme.block
    return 1, scheme.group_size


def _grid(block: tuple[int, int], shape: Sequence[int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _fits(part: TensorInfo, grid: tuple[int, int]) -> bool:
    """Whether `part` holds one value per block of `grid` (trailing dimensions of 1 may be left out)."""
    rank = len(part.shape)
    return tuple(part.shape) == grid[:rank] and all(n == 1 for n in grid[rank:])


def _check_grid(scale: TensorInfo, block: tuple[int, int], shape: Sequence[int], root: str, scheme: Scheme) -> None:
    grid = _grid(block, shape)
    if not _fits(scale, grid):
        raise CheckpointError(
            f"{scale.file.name}: tensor {quoted(scale.key, 200)} is {shape_text(scale.shape)}, but "
            f"{quoted(root, 200)} {shape_text(shape)} ({scheme.format}, {_covers(block, tuple(shape))}) "
            f"needs {shape_text(grid)}"
        )


def _zero(module: str, scheme: Scheme, tensors: Mapping[str, TensorInfo], where: str) -> TensorInfo | None:
    """The zero points, which an asymmetric scheme requires (the package uses any stored, but NVFP4's)."""
    zero = tensors.get(module + ".weight_zero_point")
    if zero is None and not scheme.symmetric:
        raise CheckpointError(
            f"{where} has no {quoted(module + '.weight_zero_point', 200)} beside it "
            f"(config group {quoted(scheme.group)} is asymmetric)"
        )
    return zero


def _check_zero(
    zero: TensorInfo, kind: str, block: tuple[int, int], shape: Sequence[int], scheme: Scheme, root: str
) -> None:
    grid = _grid(block, shape)
    where = f"{zero.file.name}: tensor {quoted(zero.key, 200)}"
    if kind == "packed":
        need = (-(-grid[0] * scheme.num_bits // 32), grid[1])
        if zero.dtype != INT32 or tuple(zero.shape) != need:
            raise CheckpointError(
                f"{where} is {zero.dtype.name} {shape_text(zero.shape)}, but {quoted(root, 200)}'s "
                f"{scheme.num_bits}-bit zero points packed along its {grid[0]} rows are int32 {shape_text(need)}"
            )
    elif not _fits(zero, grid) or (zero.dtype.kind not in "iuf" and zero.dtype not in (*FP8, BFLOAT16)):
        raise CheckpointError(
            f"{where} is {zero.dtype.name} {shape_text(zero.shape)}, but {quoted(root, 200)}'s zero points "
            f"are numbers of the scales' shape {shape_text(grid)}"
        )
