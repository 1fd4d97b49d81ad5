"""GPTQ and AWQ int4 (`quant_method: "gptq"`, `"awq"`): the `-GPTQ-Int4` / `-AWQ` releases
(TheBloke's, Qwen's), each packed linear read as the `[out, in]` weight it stands for.

GPTQ: a linear `W` is `W.qweight` (int32 `[ceil(in / 8), out]`: eight 4-bit values per
word along `in`, value `k` of a word in bits `4k..4k+3`), `W.qzeros` (int32 `[groups,
ceil(out / 8)]`, packed the same way along `out`), `W.scales` (float16 `[groups, out]`)
and `W.g_idx` (int32 `[in]`: the group of each input row); `groups` is
`ceil(in / group_size)`, one for `group_size: -1`. The weight is

    W[o, i] = scales[g, o] * (q[i, o] - z[g, o]),   g = g_idx[i]

where `z` is the stored zero plus one for `checkpoint_format` (or `format`) `"gptq"` (v1,
the default: AutoGPTQ wrote each zero minus one) and as stored for `"gptq_v2"`. Bits 2 and
8 pack 16 and 4 values a word the same way. AWQ (`version: "gemm"`): `W.qweight` is int32
`[in, out / 8]`, packed along `out` in AWQ's interleaved order (value `k` of a word is
column `8c + [0, 2, 4, 6, 1, 3, 5, 7][k]`), `W.qzeros` `[groups, out / 8]` packed alike,
`W.scales` float16 `[groups, out]`; row `i` is in group `i // group_size`, no g_idx, no +1.
`W.bias`, where a linear has one, is stored as it is and read as it is.

The definitions, as the published code computes them (read, not copied): GPTQModel's
`PackableQuantLinear.dequantize_weight` (gptqmodel/nn_modules/qlinear/__init__.py:
`scales[g_idx] * (weight - zeros[g_idx])`, the unpacked `qweight` cut to `in` rows), which
transformers 5's `GptqHfQuantizer` loads through optimum; the v1 zero offset as vLLM's
GPTQ kernel applies it (csrc/quantization/gptq/q_gemm.cu: `zeros[j] + zero_offset`, 1 for
v1, 0 for v2) and AutoGPTQ's `qlinear_cuda_old` before it; AutoAWQ's `dequantize_gemm`
(awq/utils/packing_utils.py: `unpack_awq`, `reverse_awq_order` with AWQ_REVERSE_ORDER
`[0, 4, 1, 5, 2, 6, 3, 7]`, `(iweight - izeros) * scales` with scales repeated over each
group) and its `WQLinear_GEMM.from_linear` packing order. One difference, chosen: a v1
zero stored as 15 (a zero point of 0, which v1's minus one cannot hold) is 16 here, as in
vLLM and the brief's definition, where GPTQModel's v1-to-v2 conversion adds 0x11111111 to
the packed word (carrying into the next value).

Exactness: `q - z` is a small integer and a float16 scale has 11 significant bits, so the
float32 product is the exact value; the packages multiply in float16, one rounding of
that same exact product, so a float16 checkpoint (their usual `torch_dtype`) loads to
their values bit for bit, and any other dtype is rounded once from the exact value.

Regions: a region `(outs, ins)` of the `[out, in]` weight reads the `qweight` words
that cover it (GPTQ: packed rows `ins[0] // 8 .. ceil(ins[1] / 8)`, columns `outs`; AWQ:
rows `ins`, packed columns `outs[0] // 8 .. ceil(outs[1] / 8)`), `qzeros`' packed columns
covering `outs`, the `scales` columns `outs`, and the group rows: those covering `ins`
where row `i` is in group `i // group_size` (AWQ; GPTQ with `desc_act: false`), and
every group row for GPTQ act-order (`desc_act: true`): which groups a row needs is known
only from `g_idx`'s values, read with the region (its `g_idx[ins]`, checked then: a
monotone checkpoint whose `g_idx` leaves the groups read is refused, naming the row).

```python
info = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]   # from ...down_proj.qweight
info.shape, info.describe()     # (64, 128), 'gptq int4, groups of 32, zeros v1 (+1), scales float16'
```
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, final

import ml_dtypes
import numpy as np

from ..._errors import CheckpointError
from ..._text import quoted
from .._checkpoint import Region, TensorInfo
from ._format import Format
from ._source import FLOAT32, Blocks, QuantizedInfo, blocks_of, finite, shape_text, spread

WORD = np.dtype(np.int32)
"""What the packed tensors are stored as: `bits`-bit values, 32 // bits of them a word."""
SCALES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), FLOAT32)
GROUP_INDEX = (np.dtype(np.int32), np.dtype(np.int64))
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's packing order: value `k` of a word is column `8c + AWQ_ORDER[k]` of its eight."""
AWQ_COLUMNS = np.argsort(AWQ_ORDER)
"""Column `j` of a word's eight is its value `AWQ_COLUMNS[j]` (AutoAWQ's AWQ_REVERSE_ORDER)."""
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}
"""`checkpoint_format` -> what is added to each stored zero."""


def unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 `words` as their `32 // bits` unsigned values each (the first in the lowest bits),
    spread along `axis`, which grows by that factor; int16 (a value and its zero's difference fits)."""
    per, mask = 32 // bits, np.uint32(2**bits - 1)
    unsigned = words.view(np.uint32)
    values = np.empty((*words.shape, per), np.int16)
    for k in range(per):
        values[..., k] = (unsigned >> np.uint32(bits * k)) & mask
    if axis == 0:
        return values.transpose(0, 2, 1).reshape(words.shape[0] * per, words.shape[1])
    return values.reshape(words.shape[0], words.shape[1] * per)


def unpack_awq(words: np.ndarray) -> np.ndarray:
    """int32 `words` of AWQ's GEMM layout as their eight 4-bit values each, in column order."""
    values = unpack(words, 4, axis=1).reshape(words.shape[0], words.shape[1], 8)
    return values[:, :, AWQ_COLUMNS].reshape(words.shape[0], words.shape[1] * 8)


@final
@dataclass(frozen=True)
class GptqWeight(QuantizedInfo):
    """A GPTQ linear's `[out, in]` weight; `parts` are `(qweight, qzeros, scales, g_idx)`.
    `group_size` is `in` for one group; `act_order`: any group row may serve any input row;
    `zero_offset`: added to each stored zero (1 for the v1 format)."""

    bits: int = 4
    group_size: int = 128
    act_order: bool = False
    zero_offset: int = 1

    def regions(self, region: Region) -> tuple[tuple[Region, ...], ...]:
        outs, ins = region
        per = 32 // self.bits
        groups = ((0, self.parts[2].shape[0]),) if self.act_order else blocks_of((ins,), (self.group_size,))
        return (
            (blocks_of((ins, outs), (per, 1)),),
            ((*groups, *blocks_of((outs,), (per,))),),
            ((*groups, outs),),
            ((ins,),),
        )

    def dequantize(self, region: Region, blocks: Blocks) -> np.ndarray:
        (o0, o1), (i0, i1) = region
        (qweight,), (qzeros,), (scales,), (g_idx,) = blocks
        per = 32 // self.bits
        q = unpack(qweight, self.bits, axis=0)[i0 % per : i0 % per + i1 - i0]
        z = unpack(qzeros, self.bits, axis=1)[:, o0 % per : o0 % per + o1 - o0] + self.zero_offset
        s = finite(scales.astype(np.float32), self.parts[2])
        first = 0 if self.act_order else i0 // self.group_size
        g = self._groups(g_idx, first, len(s), i0)
        return ((q - z[g]).astype(np.float32) * s[g]).T

    def _groups(self, g_idx: np.ndarray, first: int, count: int, i0: int) -> np.ndarray:
        """Each row's group as an index into the group rows read (which start at group
        `first`), or a `CheckpointError` naming the first row whose group is not among them."""
        local = g_idx.astype(np.int64) - first
        bad = np.flatnonzero((local < 0) | (local >= count))
        if not bad.size:
            return local
        row = i0 + int(bad[0])
        group = int(g_idx[bad[0]])
        where = f"{self.parts[3].file.name}: tensor {quoted(self.parts[3].key, 200)}"
        if self.act_order:
            raise CheckpointError(f"{where}: row {row} is in group {group}, but the scales hold {count} groups")
        raise CheckpointError(
            f"{where}: row {row} is in group {group}, not {row // self.group_size} as groups of "
            f"{self.group_size} in order have it (quantization_config.desc_act is false)"
        )

    def describe(self) -> str:
        scales = self.parts[2]
        groups = "one group" if self.group_size >= self.shape[1] else f"groups of {self.group_size}"
        order = ", act-order g_idx" if self.act_order else ""
        zeros = "zeros v1 (+1)" if self.zero_offset else "zeros v2"
        return f"gptq int{self.bits}, {groups}{order}, {zeros}, scales {scales.dtype.name}"


@final
@dataclass(frozen=True)
class AwqWeight(QuantizedInfo):
    """An AWQ (GEMM) linear's `[out, in]` weight; `parts` are `(qweight, qzeros, scales)`;
    row `i` of the input is in group `i // group_size`."""

    group_size: int = 128

    def regions(self, region: Region) -> tuple[tuple[Region, ...], ...]:
        outs, ins = region
        words = blocks_of((outs,), (8,))
        groups = blocks_of((ins,), (self.group_size,))
        return ((ins, *words),), ((*groups, *words),), ((*groups, outs),)

    def dequantize(self, region: Region, blocks: Blocks) -> np.ndarray:
        (o0, o1), ins = region
        (qweight,), (qzeros,), (scales,) = blocks
        q = unpack_awq(qweight)[:, o0 % 8 : o0 % 8 + o1 - o0]
        z = unpack_awq(qzeros)[:, o0 % 8 : o0 % 8 + o1 - o0]
        s = finite(scales.astype(np.float32), self.parts[2])
        rows = (ins, (0, o1 - o0))
        return (
            (q - spread(z, rows, (self.group_size, 1))).astype(np.float32) * spread(s, rows, (self.group_size, 1))
        ).T

    def describe(self) -> str:
        groups = "one group" if self.group_size >= self.shape[1] else f"groups of {self.group_size}"
        return f"awq int4 gemm, {groups}, scales {self.parts[2].dtype.name}"


@final
class Gptq(Format, methods=("gptq",)):
    """`quant_method: "gptq"` (transformers' GPTQConfig; AutoGPTQ, GPTQModel, optimum)."""

    @classmethod
    def find(
        cls,
        config: Mapping[str, Any],
        settings: Mapping[str, Any],
        tensors: Mapping[str, TensorInfo],
        out_dtype: np.dtype,
        read: Callable[[str], np.ndarray],
    ) -> tuple[list[QuantizedInfo], set[str]]:
        bits = _bits(settings, (2, 4, 8))
        group_size = _group_size(settings)
        act_order = _flag(settings, "desc_act", False)
        fmt = _layout(settings, ("checkpoint_format", "format"), tuple(GPTQ_FORMATS))
        _layout(settings, ("pack_dtype",), ("int32",))
        if settings.get("dynamic"):
            raise CheckpointError("config.json: quantization_config.dynamic (per-module bits or groups) is not read")
        sources: list[QuantizedInfo] = []
        for prefix, (qweight, qzeros, scales, g_idx) in _linears(tensors, ("qzeros", "scales", "g_idx")):
            sources.append(
                _gptq(prefix, qweight, qzeros, scales, g_idx, bits, group_size, act_order, GPTQ_FORMATS[fmt], out_dtype)
            )
        return sources, set()


@final
class Awq(Format, methods=("awq",)):
    """`quant_method: "awq"` with `version: "gemm"` (transformers' AwqConfig; AutoAWQ)."""

    @classmethod
    def find(
        cls,
        config: Mapping[str, Any],
        settings: Mapping[str, Any],
        tensors: Mapping[str, TensorInfo],
        out_dtype: np.dtype,
        read: Callable[[str], np.ndarray],
    ) -> tuple[list[QuantizedInfo], set[str]]:
        _bits(settings, (4,))
        group_size = _group_size(settings)
        _layout(settings, ("version", "format"), ("gemm",))
        if not _flag(settings, "zero_point", True):
            raise CheckpointError(
                "config.json: quantization_config.zero_point false is not read (AWQ GEMM checkpoints hold qzeros)"
            )
        sources: list[QuantizedInfo] = []
        for prefix, (qweight, qzeros, scales) in _linears(tensors, ("qzeros", "scales")):
            sources.append(_awq(prefix, qweight, qzeros, scales, group_size, out_dtype))
        return sources, set()


def _bits(settings: Mapping[str, Any], allowed: tuple[int, ...]) -> int:
    """`quantization_config.bits` (4 when absent), one of `allowed`, else a `CheckpointError`."""
    value = settings.get("bits", 4)
    if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
        raise CheckpointError(
            f"config.json: quantization_config.bits {quoted(value)} is not read (read: {', '.join(map(str, allowed))})"
        )
    return value


def _layout(settings: Mapping[str, Any], names: tuple[str, ...], allowed: tuple[str, ...]) -> str:
    """The first of the settings `names` that is set (transformers' precedence), lowercased,
    one of `allowed`; `allowed[0]` when none is set; else a `CheckpointError`."""
    for name in names:
        value = settings.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or value.lower() not in allowed:
            raise CheckpointError(
                f"config.json: quantization_config.{name} {quoted(value)} is not read (read: {', '.join(allowed)})"
            )
        return value.lower()
    return allowed[0]


def _group_size(settings: Mapping[str, Any]) -> int:
    """`group_size`: a positive integer, or -1 for one group (returned as 0)."""
    value = settings.get("group_size", 128)
    if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
        raise CheckpointError(
            f"config.json: quantization_config.group_size {quoted(value)} must be a positive integer or -1"
        )
    return max(value, 0)


def _flag(settings: Mapping[str, Any], name: str, default: bool) -> bool:
    value = settings.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"config.json: quantization_config.{name} {quoted(value)} must be true or false")
    return value


def _linears(tensors: Mapping[str, TensorInfo], companions: tuple[str, ...]):
    """Each packed linear: its prefix (`...q_proj.`) and its `qweight` and `companions`
    tensors, a `CheckpointError` for one missing, or for a companion with no `qweight`."""
    for key, info in tensors.items():
        if key.endswith(".qzeros") and key.removesuffix("qzeros") + "qweight" not in tensors:
            raise CheckpointError(
                f"{info.file.name}: tensor {quoted(key, 200)} has no {quoted(key.removesuffix('qzeros') + 'qweight', 200)} "
                "beside it"
            )
    for key, qweight in tensors.items():
        if not key.endswith(".qweight"):
            continue
        prefix = key.removesuffix("qweight")
        parts = [qweight]
        for name in companions:
            part = tensors.get(prefix + name)
            if part is None:
                raise CheckpointError(
                    f"{qweight.file.name}: tensor {quoted(key, 200)} has no {quoted(prefix + name, 200)} beside it"
                )
            parts.append(part)
        yield prefix, tuple(parts)


def _check(part: TensorInfo, dtypes: tuple[np.dtype, ...], rank: int) -> None:
    """`part` is of one of `dtypes` and of `rank` dimensions, else a `CheckpointError`."""
    where = f"{part.file.name}: tensor {quoted(part.key, 200)}"
    if part.dtype not in dtypes:
        raise CheckpointError(f"{where} is {part.dtype.name}, not {' or '.join(d.name for d in dtypes)}")
    if len(part.shape) != rank:
        raise CheckpointError(f"{where} is {shape_text(part.shape)}, not {rank}-dimensional")


def _need(part: TensorInfo, shape: tuple[int, ...], why: str) -> None:
    """`part` is of `shape`, else a `CheckpointError` saying `why` it should be."""
    if part.shape != shape:
        raise CheckpointError(
            f"{part.file.name}: tensor {quoted(part.key, 200)} is {shape_text(part.shape)}, but {why} "
            f"need {shape_text(shape)}"
        )


def _gptq(
    prefix: str,
    qweight: TensorInfo,
    qzeros: TensorInfo,
    scales: TensorInfo,
    g_idx: TensorInfo,
    bits: int,
    group_size: int,
    act_order: bool,
    zero_offset: int,
    out_dtype: np.dtype,
) -> GptqWeight:
    """The `[out, in]` weight a GPTQ linear's tensors stand for, checked against each other:
    `in` is `g_idx`'s length, `out` the width of `scales`."""
    for part, dtypes, rank in (
        (qweight, (WORD,), 2),
        (qzeros, (WORD,), 2),
        (scales, SCALES, 2),
        (g_idx, GROUP_INDEX, 1),
    ):
        _check(part, dtypes, rank)
    per = 32 // bits
    (n_in,), n_out = g_idx.shape, scales.shape[1]
    size = group_size or max(n_in, 1)
    groups = -(-n_in // size)
    _need(
        qweight,
        (-(-n_in // per), n_out),
        f"the {n_in} input rows of {quoted(g_idx.key, 200)} ({per} a word) and the {n_out} columns of "
        f"{quoted(scales.key, 200)}",
    )
    _need(scales, (groups, n_out), f"{n_in} rows in {'one group' if not group_size else f'groups of {group_size}'}")
    _need(qzeros, (groups, -(-n_out // per)), f"{groups} groups of {n_out} columns ({per} a word)")
    return GptqWeight(
        prefix + "weight",
        qweight.file,
        FLOAT32,
        (n_out, n_in),
        qweight.offset,
        qweight.file_id,
        parts=(qweight, qzeros, scales, g_idx),
        out_dtype=out_dtype,
        bits=bits,
        group_size=size,
        act_order=act_order,
        zero_offset=zero_offset,
    )


def _awq(
    prefix: str,
    qweight: TensorInfo,
    qzeros: TensorInfo,
    scales: TensorInfo,
    group_size: int,
    out_dtype: np.dtype,
) -> AwqWeight:
    """The `[out, in]` weight an AWQ linear's tensors stand for, checked against each other:
    `in` is `qweight`'s height, `out` the width of `scales`."""
    for part, dtypes in ((qweight, (WORD,)), (qzeros, (WORD,)), (scales, SCALES)):
        _check(part, dtypes, 2)
    n_in, n_out = qweight.shape[0], scales.shape[1]
    size = group_size or max(n_in, 1)
    groups = -(-n_in // size)
    if n_out % 8:
        raise CheckpointError(
            f"{scales.file.name}: tensor {quoted(scales.key, 200)} has {n_out} columns, not a multiple of AWQ's 8 a word"
        )
    _need(qweight, (n_in, n_out // 8), f"the {n_out} columns of {quoted(scales.key, 200)} (8 a word)")
    _need(scales, (groups, n_out), f"{n_in} rows in {'one group' if not group_size else f'groups of {group_size}'}")
    _need(qzeros, (groups, n_out // 8), f"{groups} groups of {n_out} columns (8 a word)")
    return AwqWeight(
        prefix + "weight",
        qweight.file,
        FLOAT32,
        (n_out, n_in),
        qweight.offset,
        qweight.file_id,
        parts=(qweight, qzeros, scales),
        out_dtype=out_dtype,
        group_size=size,
    )
