"""bitsandbytes 4-bit (`quant_method: "bitsandbytes"`, `load_in_4bit`): unsloth's `-bnb-4bit`
checkpoints and whatever transformers' `save_pretrained` writes of a 4-bit model.

A weight `W.weight` of logical shape `[out, in]` is stored flattened: `W.weight`, uint8
`[ceil(out * in / 2), 1]`, two 4-bit codes per byte, the high nibble first (element
`2i` in byte `i`'s high four bits); `W.weight.absmax`, one scale per `blocksize`
elements of the flat index (float32; uint8 when double-quantized, `nested`);
`W.weight.quant_map`, the 16 values of the codes; and
`W.weight.quant_state.bitsandbytes__nf4` (or `__fp4`), a uint8 tensor holding the JSON of
the rest: `shape`, `dtype`, `blocksize`, `quant_type`, and for a nested state
`nested_blocksize`, `nested_dtype`, `nested_offset`. A nested state also has
`W.weight.nested_absmax` (float32, one per `nested_blocksize` absmax values) and
`W.weight.nested_quant_map` (the 256 values of the absmax codes). Element `e` is
`table[code(e)] * absmax[e // blocksize]` in float32, the absmax of a nested state being
`nested_quant_map[absmax_code] * nested_absmax[block // nested_blocksize] + nested_offset`,
as bitsandbytes' `dequantize_4bit` computes it. Like bitsandbytes, port takes the code
values from `quant_type` (its NF4 and FP4 tables), not from `quant_map`.

A region of `[out, in]` is, row by row, a run of the flat index: each row reads the
packed bytes that hold it and the absmax blocks (and nested blocks) that cover it, runs
that touch merged, so no byte is read twice. GPT-2's `Conv1D` weights are quantized as
`[out, in]` and shown in the checkpoint's own `[in, out]`.

```python
info = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]   # float32[64, 128]
info.describe()       # 'bitsandbytes nf4, blocks of 64, absmax uint8 nested by 256'
info.regions(((0, 2), (0, 128)))   # packed bytes 0-127, absmax 0-3, nested absmax 0
```
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, final

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..._errors import CheckpointError
from ..._text import quoted
from .._checkpoint import Region, TensorInfo
from .._safetensors import load_json
from ._format import Format
from ._source import FLOAT32, Blocks, QuantizedInfo, finite, shape_text

UINT8 = np.dtype(np.uint8)
STATE = ".quant_state.bitsandbytes__"
"""What a quantized weight's key and its quant type (`nf4`, `fp4`) are joined by."""
COMPANIONS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")
TABLES = {
    "nf4": np.array(
        [
            -1.0,
            -0.6961928009986877,
            -0.5250730514526367,
            -0.39491748809814453,
            -0.28444138169288635,
            -0.18477343022823334,
            -0.09105003625154495,
            0.0,
            0.07958029955625534,
            0.16093020141124725,
            0.24611230194568634,
            0.33791524171829224,
            0.44070982933044434,
            0.5626170039176941,
            0.7229568362236023,
            1.0,
        ],
        np.float32,
    ),
    "fp4": np.array([0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3], np.float32)
    / np.float32(12),
}
"""The values of the 16 codes, by quant type, as bitsandbytes' `get_4bit_type` makes them."""
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""The block sizes bitsandbytes' `dequantize_4bit` accepts."""
DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a quantized weight may have been (bitsandbytes quantizes no others)."""
KEYS = {"quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"}
"""The keys a packed quant_state may hold (bitsandbytes' `QuantState.from_dict` refuses others)."""
NESTED_KEYS = ("nested_blocksize", "nested_dtype", "nested_offset")
CONV1D = {"gpt2": ("c_attn", "c_proj", "c_fc", "q_attn")}
"""Per model type, the modules in `Conv1D` orientation (`[in, out]`), quantized transposed."""


@final
@dataclass(frozen=True)
class Bnb4bit(QuantizedInfo):
    """A bitsandbytes 4-bit weight, `parts` the packed codes, the absmax and (`nested`) the
    nested absmax. `stored` is the quantized `[out, in]`; `transposed`: shown as `[in, out]`.
    `nested_code` is the nested state's 256 absmax values (float32 bytes) and
    `nested_offset` its offset, both read when the checkpoint was opened."""

    quant_type: str = "nf4"
    blocksize: int = 64
    stored: tuple[int, int] = (0, 0)
    transposed: bool = False
    nested_blocksize: int = 0
    nested_code: bytes = b""
    nested_offset: float = 0.0

    @property
    def nested(self) -> bool:
        return bool(self.nested_blocksize)

    def regions(self, region: Region) -> tuple[tuple[Region, ...], ...]:
        runs = _runs(self._stored_region(region), self.stored[1])
        if runs is None:
            return ((),) * len(self.parts)
        packed = _covering(*runs, 2)
        absmax = _covering(*runs, self.blocksize)
        found = [tuple((run, (0, 1)) for (run,) in _as_regions(packed)), _as_regions(absmax)]
        if self.nested:
            found.append(_as_regions(_covering(*absmax, self.nested_blocksize)))
        return tuple(tuple(r) for r in found)

    def dequantize(self, region: Region, blocks: Blocks) -> np.ndarray:
        stored = self._stored_region(region)
        runs = _runs(stored, self.stored[1])
        if runs is None:
            out = np.zeros(tuple(b - a for a, b in stored), np.float32)
            return out.T if self.transposed else out
        first, last = runs
        width = int(last[0] - first[0])
        codes = _codes(_joined(blocks[0]), first, width, _covering(*runs, 2))
        block_runs = _covering(*runs, self.blocksize)
        absmax = np.repeat(self._absmax(blocks, block_runs), self.blocksize)  # one per element
        out = TABLES[self.quant_type][codes] * _rows(absmax, first, width, block_runs, self.blocksize)
        return out.T if self.transposed else out

    def describe(self) -> str:
        absmax = self.parts[1]
        text = f"bitsandbytes {self.quant_type}, blocks of {self.blocksize}, absmax {absmax.dtype.name}"
        if self.nested:
            text += f" nested by {self.nested_blocksize}"
        return text + (", transposed" if self.transposed else "")

    def _stored_region(self, region: Region) -> Region:
        return region[::-1] if self.transposed else region

    def _absmax(self, blocks: Blocks, absmax_runs: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """The float32 absmax of the blocks `absmax_runs` covers, in order; a nested state's
        decoded as bitsandbytes' `dequantize_blockwise` does."""
        absmax = _joined(blocks[1])
        if not self.nested:
            return finite(absmax, self.parts[1])
        nested = finite(_joined(blocks[2]), self.parts[2])
        starts, stops = absmax_runs
        lengths = stops - starts
        index = np.arange(lengths.sum()) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
        nested_runs = _covering(*absmax_runs, self.nested_blocksize)
        scale = nested[_compact(index // self.nested_blocksize, nested_runs)]
        return np.frombuffer(self.nested_code, np.float32)[absmax] * scale + np.float32(self.nested_offset)


def _runs(region: Region, width: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The flat index runs `[first, last)` of the rows of `region` of a `[*, width]` matrix;
    None for an empty region."""
    (r0, r1), (c0, c1) = region
    if r1 <= r0 or c1 <= c0:
        return None
    start = np.arange(r0, r1, dtype=np.int64) * width
    return start + c0, start + c1


def _covering(first: np.ndarray, last: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """The runs of units of `unit` elements (bytes of 2 codes, absmax blocks) that cover
    the sorted runs `[first, last)`, those that touch or overlap merged."""
    starts, stops = first // unit, -(-last // unit)
    cut = np.flatnonzero(starts[1:] > stops[:-1]) + 1
    return starts[np.r_[0, cut]], stops[np.r_[cut - 1, len(stops) - 1]]


def _as_regions(runs: tuple[np.ndarray, np.ndarray]) -> tuple[Region, ...]:
    return tuple(((a, b),) for a, b in zip(runs[0].tolist(), runs[1].tolist()))


def _joined(arrays: tuple[np.ndarray, ...]) -> np.ndarray:
    """The arrays read for one part's runs, end to end (one flat array)."""
    return np.concatenate([a.reshape(-1) for a in arrays])


def _compact(index: np.ndarray, runs: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Where each of `index` (all within `runs`) lies in the runs' values read end to end."""
    starts, stops = runs
    before = np.concatenate([[0], np.cumsum(stops - starts)[:-1]])
    k = np.searchsorted(starts, index, side="right") - 1
    return before[k] + index - starts[k]


def _rows(
    values: np.ndarray, first: np.ndarray, width: int, runs: tuple[np.ndarray, np.ndarray], unit: int
) -> np.ndarray:
    """`width` values per row from `values` (the runs' units read end to end, `unit` values
    each), row `i` from flat element `first[i]` on: one row is within one run."""
    start = _compact(first // unit, runs) * unit + first % unit
    return sliding_window_view(values, width)[start]


def _codes(packed: np.ndarray, first: np.ndarray, width: int, runs: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The 4-bit codes of each row (`width` from flat element `first[i]`) from the packed
    bytes of `runs`, read end to end; the high nibble is the even element."""
    nibbles = np.empty(2 * packed.size, np.uint8)
    nibbles[0::2] = packed >> 4
    nibbles[1::2] = packed & 0xF
    return _rows(nibbles, first, width, runs, 2)


@final
class Bitsandbytes(Format, methods=("bitsandbytes",)):
    """`quant_method: "bitsandbytes"` with `load_in_4bit` (transformers' BitsAndBytesConfig)."""

    @classmethod
    def find(
        cls,
        config: Mapping[str, Any],
        settings: Mapping[str, Any],
        tensors: Mapping[str, TensorInfo],
        out_dtype: np.dtype,
        read: Callable[[str], np.ndarray],
    ) -> tuple[list[QuantizedInfo], set[str]]:
        if settings.get("load_in_4bit") is not True:
            raise CheckpointError(
                "config.json: quantization_config (quant_method 'bitsandbytes') has no load_in_4bit true: "
                "port reads bitsandbytes' 4-bit checkpoints, not its 8-bit ones"
            )
        conv1d = CONV1D.get(str(config.get("model_type")), ())
        sources: list[QuantizedInfo] = []
        hidden: set[str] = set()
        for key, state in tensors.items():
            if STATE not in key:
                continue
            name, quant_type = key.rsplit(STATE, 1)
            weight = tensors.get(name)
            if weight is None:
                raise CheckpointError(
                    f"{state.file.name}: tensor {quoted(key, 200)} is the state of {quoted(name, 200)}, "
                    "which the checkpoint lacks"
                )
            module = name.split(".")[-2] if "." in name else ""
            info = _source(weight, state, quant_type, tensors, read, out_dtype, module in conv1d)
            sources.append(info)
            hidden.update({key, name + ".quant_map", name + ".nested_quant_map"} & tensors.keys())
        _check_orphans(tensors, {info.packed.key for info in sources})
        return sources, hidden


def _check_orphans(tensors: Mapping[str, TensorInfo], weights: set[str]) -> None:
    """A companion (absmax, quant map) of a weight without a quant_state is a CheckpointError;
    so is a weight with two."""
    seen: set[str] = set()
    for key, info in tensors.items():
        if STATE in key:
            name = key.rsplit(STATE, 1)[0]
            if name in seen:
                raise CheckpointError(
                    f"{info.file.name}: tensor {quoted(name, 200)} has two quant_state tensors "
                    f"(bitsandbytes reads exactly one)"
                )
            seen.add(name)
        for suffix in COMPANIONS:
            if key.endswith(suffix) and key.removesuffix(suffix) not in weights:
                base = key.removesuffix(suffix)
                raise CheckpointError(
                    f"{info.file.name}: tensor {quoted(key, 200)} has no {quoted(base + STATE + 'nf4', 200)} "
                    "(or __fp4) beside it: the quantization state of its weight is missing"
                )


def _source(
    weight: TensorInfo,
    state: TensorInfo,
    quant_type: str,
    tensors: Mapping[str, TensorInfo],
    read: Callable[[str], np.ndarray],
    out_dtype: np.dtype,
    transposed: bool,
) -> Bnb4bit:
    """The dequantized tensor `weight` and its companions stand for, each checked."""
    where = f"{state.file.name}: tensor {quoted(state.key, 200)}"
    if quant_type not in TABLES:
        raise CheckpointError(f"{where}: quant type {quoted(quant_type)} is not nf4 or fp4")
    if state.dtype != UINT8 or len(state.shape) != 1:
        raise CheckpointError(f"{where} is {state.dtype.name}{shape_text(state.shape)}, not JSON bytes (uint8[n])")
    fields = _state(read(state.key), where, quant_type)
    out, inner = fields["shape"]
    n = out * inner
    name = weight.key
    if weight.dtype != UINT8 or weight.shape != ((n + 1) // 2, 1):
        raise CheckpointError(
            f"{weight.file.name}: tensor {quoted(name, 200)} is {weight.dtype.name}{shape_text(weight.shape)}, "
            f"but {shape_text((out, inner))} packed two per byte is uint8{shape_text(((n + 1) // 2, 1))}"
        )
    blocks = -(-n // fields["blocksize"])
    nested = "nested_blocksize" in fields
    absmax = _companion(tensors, weight, ".absmax", UINT8 if nested else FLOAT32, (blocks,))
    _companion(tensors, weight, ".quant_map", FLOAT32, (16,))
    parts = [weight, absmax]
    code = b""
    if nested:
        nested_blocks = -(-blocks // fields["nested_blocksize"])
        parts.append(_companion(tensors, weight, ".nested_absmax", FLOAT32, (nested_blocks,)))
        code_info = _companion(tensors, weight, ".nested_quant_map", FLOAT32, (256,))
        values = read(code_info.key)
        if not np.isfinite(values).all():
            raise CheckpointError(f"{code_info.file.name}: tensor {quoted(code_info.key, 200)} holds a NaN or infinity")
        code = values.astype(np.float32).tobytes()
    elif name + ".nested_absmax" in tensors or name + ".nested_quant_map" in tensors:
        raise CheckpointError(f"{where} has no nested_blocksize, but {quoted(name, 200)} has a nested absmax beside it")
    return Bnb4bit(
        name,
        weight.file,
        FLOAT32,
        (inner, out) if transposed else (out, inner),
        weight.offset,
        weight.file_id,
        parts=tuple(parts),
        out_dtype=out_dtype,
        quant_type=quant_type,
        blocksize=fields["blocksize"],
        stored=(out, inner),
        transposed=transposed,
        nested_blocksize=fields.get("nested_blocksize", 0),
        nested_code=code,
        nested_offset=fields.get("nested_offset", 0.0),
    )


def _companion(
    tensors: Mapping[str, TensorInfo], weight: TensorInfo, suffix: str, dtype: np.dtype, shape: tuple[int, ...]
) -> TensorInfo:
    """The tensor `weight.key + suffix`, checked to be `dtype[shape]`."""
    name = weight.key
    info = tensors.get(name + suffix)
    if info is None:
        raise CheckpointError(
            f"{weight.file.name}: tensor {quoted(name, 200)} is bitsandbytes 4-bit but has no "
            f"{quoted(name + suffix, 200)} beside it"
        )
    if info.dtype != dtype or info.shape != shape:
        raise CheckpointError(
            f"{info.file.name}: tensor {quoted(info.key, 200)} is {info.dtype.name}{shape_text(info.shape)}, "
            f"but {quoted(name, 200)} needs {dtype.name}{shape_text(shape)}"
        )
    return info


def _state(raw: np.ndarray, where: str, quant_type: str) -> dict[str, Any]:
    """The JSON of a packed quant_state, each field checked as bitsandbytes reads it."""
    fields = load_json(raw.tobytes(), where)
    if not isinstance(fields, dict):
        raise CheckpointError(f"{where}: the quant_state is not a JSON object")
    unknown = sorted(set(fields) - KEYS)
    if unknown:
        raise CheckpointError(f"{where}: unknown quant_state key {quoted(unknown[0])}")
    if fields.get("quant_type") != quant_type:
        raise CheckpointError(
            f"{where}: quant_type {quoted(fields.get('quant_type'))} is not the {quoted(quant_type)} its name says"
        )
    shape = fields.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(_positive(n) for n in shape)):
        raise CheckpointError(f"{where}: shape {quoted(shape)} is not two positive integers [out, in]")
    if fields.get("blocksize") not in BLOCKSIZES or not _positive(fields["blocksize"]):
        raise CheckpointError(
            f"{where}: blocksize {quoted(fields.get('blocksize'))} is not one of {', '.join(map(str, BLOCKSIZES))}"
        )
    if fields.get("dtype") not in DTYPES:
        raise CheckpointError(f"{where}: dtype {quoted(fields.get('dtype'))} is not one of {', '.join(DTYPES)}")
    present = [k for k in NESTED_KEYS if k in fields]
    if present and len(present) < len(NESTED_KEYS):
        missing = next(k for k in NESTED_KEYS if k not in fields)
        raise CheckpointError(f"{where}: a nested quant_state without {missing}")
    if present:
        offset = fields["nested_offset"]
        if fields["nested_blocksize"] not in BLOCKSIZES or not _positive(fields["nested_blocksize"]):
            raise CheckpointError(
                f"{where}: nested_blocksize {quoted(fields['nested_blocksize'])} is not one of "
                f"{', '.join(map(str, BLOCKSIZES))}"
            )
        if fields["nested_dtype"] != "float32":
            raise CheckpointError(f"{where}: nested_dtype {quoted(fields['nested_dtype'])} is not float32")
        fields["nested_offset"] = _float32(offset, where)
    return fields


def _float32(value: Any, where: str) -> float:
    """`value` rounded to float32, as bitsandbytes' `torch.tensor(float(value))` rounds it:
    a CheckpointError unless it is a number finite in float32."""
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        with np.errstate(over="ignore"):
            rounded = np.float32(float(value)) if abs(value) < 2**128 else np.float32(np.inf)
        if np.isfinite(rounded):
            return float(rounded)
    raise CheckpointError(f"{where}: nested_offset {quoted(value)} is not a number float32 holds")


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
