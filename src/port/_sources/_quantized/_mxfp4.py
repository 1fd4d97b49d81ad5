"""MXFP4 experts (`quant_method: "mxfp4"`): openai/gpt-oss-20b and gpt-oss-120b.

Each layer's fused experts are stored packed: `...experts.gate_up_proj_blocks` (uint8
`[experts, rows, groups, 16]`: per row, groups of 32 e2m1 values along the input dim,
two a byte, low nibble first) and `...experts.gate_up_proj_scales` (uint8 `[experts,
rows, groups]`: one E8M0 exponent per group, the scale `2 ** (byte - 127)`); likewise
`down_proj_blocks` / `_scales`. Everything else (`modules_to_not_convert`: attention,
routers, embeddings, head) is stored unquantized and read as it is.

Each pair is read as the tensor transformers' unquantized gpt-oss checkpoint stores
under the name without `_blocks`: `gate_up_proj` `[experts, hidden, 2 * inter]` and
`down_proj` `[experts, inter, hidden]`, the transpose of the stored rows (transformers'
`convert_moe_packed_tensors`: values times scale, `[experts, rows, groups * 32]`,
dims 1 and 2 swapped), so mappings/gpt_oss.toml applies unchanged. A region
`experts x inputs x rows` reads, for those experts and rows, only the bytes holding its
inputs (partial groups at its edges read in part) and the scales of the groups that
cover them.

```python
info = ckpt.tensors["model.layers.0.mlp.experts.gate_up_proj"]   # Mxfp4Experts: float32[4, 96, 128]
info.describe()      # 'mxfp4 e2m1 (2 per byte), groups of 32, scales gate_up_proj_scales e8m0 (uint8)'
info.region_nbytes(((0, 1), (24, 48), (0, 128)))   # 128 * 12 bytes of values + 128 * 2 scales
```
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, final

import numpy as np

from ..._errors import CheckpointError
from ..._text import quoted
from .._checkpoint import Region, TensorInfo
from ._format import Format
from ._fp8 import FP4_VALUES, scale_values
from ._source import FLOAT32, Blocks, QuantizedInfo, finite, shape_text

GROUP = 32
"""Values sharing one scale, along the input dim."""
GROUP_BYTES = GROUP // 2
BLOCKS, SCALES = "_blocks", "_scales"
UINT8 = np.dtype(np.uint8)


@final
@dataclass(frozen=True)
class Mxfp4Experts(QuantizedInfo):
    """Fused experts `[experts, inputs, rows]` from MXFP4 blocks `[experts, rows, inputs / 32, 16]`
    and their E8M0 scales `[experts, rows, inputs / 32]` (see the module)."""

    def regions(self, region: Region) -> tuple[tuple[Region, ...], ...]:
        experts, inputs, rows = region
        first, last = inputs[0] // GROUP, -(-inputs[1] // GROUP)
        pieces = tuple((experts, rows, groups, span) for groups, span in _pieces(*inputs))
        return pieces, ((experts, rows, (first, last)),)

    def dequantize(self, region: Region, blocks: Blocks) -> np.ndarray:
        _, inputs, _ = region
        pieces, (scales,) = blocks
        first = inputs[0] // GROUP
        count, height, groups = scales.shape
        # built in the dequantized tensor's order (inputs before rows) from the bytes transposed:
        # [experts, groups, bytes, nibbles, rows]; the inputs of the covering groups not read stay unset
        values = np.empty((count, groups, GROUP_BYTES, 2, height), np.float32)
        for piece, (_, _, (a, b), (c, d)) in zip(pieces, self.regions(region)[0]):
            nibbles = np.ascontiguousarray(piece.transpose(0, 2, 3, 1))
            values[:, a - first : b - first, c:d, 0] = FP4_VALUES[nibbles & 0xF]  # low nibble first
            values[:, a - first : b - first, c:d, 1] = FP4_VALUES[nibbles >> 4]
        scale = finite(scale_values(scales), self.parts[1]).transpose(0, 2, 1)[:, :, None, None, :]
        with np.errstate(all="ignore"):  # 6 * 2 ** 127 is inf in float32, as in transformers; unset inputs
            values *= scale
        start = inputs[0] - first * GROUP
        return values.reshape(count, groups * GROUP, height)[:, start : start + inputs[1] - inputs[0]]

    def describe(self) -> str:
        return f"mxfp4 e2m1 (2 per byte), groups of {GROUP}, scales {self.parts[1].key.rsplit('.', 1)[-1]} e8m0 (uint8)"


def _pieces(start: int, stop: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (groups, bytes within each group) rectangles of blocks that hold inputs `start:stop`
    and nothing else: a partial first group, the whole groups between, a partial last group.

    ```python
    _pieces(24, 72)   # [((0, 1), (12, 16)), ((1, 2), (0, 16)), ((2, 3), (0, 4))]
    ```
    """
    first, last = start // GROUP, -(-stop // GROUP)
    head, tail = (start - first * GROUP) // 2, -(-(stop - (last - 1) * GROUP) // 2)
    if stop <= start:
        return [((first, first), (0, 0))]
    if last - first == 1:
        return [((first, last), (head, tail))]
    pieces = []
    whole = (first + (head > 0), last - (tail < GROUP_BYTES))
    if head > 0:
        pieces.append(((first, first + 1), (head, GROUP_BYTES)))
    if whole[1] > whole[0]:
        pieces.append((whole, (0, GROUP_BYTES)))
    if tail < GROUP_BYTES:
        pieces.append(((last - 1, last), (0, tail)))
    return pieces


@final
class Mxfp4(Format, methods=("mxfp4",)):
    """`quant_method: "mxfp4"` (transformers' Mxfp4Config): each `X_blocks` with its `X_scales`
    is the tensor `X`; every other tensor is read as stored (the tensors say which are packed:
    `modules_to_not_convert` is not needed, as in transformers' dequantizing load)."""

    @classmethod
    def find(
        cls,
        config: Mapping[str, Any],
        settings: Mapping[str, Any],
        tensors: Mapping[str, TensorInfo],
        out_dtype: np.dtype,
        read: Callable[[str], np.ndarray],
    ) -> tuple[list[QuantizedInfo], set[str]]:
        sources: list[QuantizedInfo] = []
        for key, info in tensors.items():
            if key.endswith(SCALES) and key.removesuffix(SCALES) + BLOCKS not in tensors:
                raise CheckpointError(
                    f"{info.file.name}: tensor {quoted(key, 200)} scales "
                    f"{quoted(key.removesuffix(SCALES) + BLOCKS, 200)}, which the checkpoint lacks"
                )
            if key.endswith(BLOCKS):
                scales = tensors.get(key.removesuffix(BLOCKS) + SCALES)
                if scales is None:
                    raise CheckpointError(
                        f"{info.file.name}: tensor {quoted(key, 200)} has no "
                        f"{quoted(key.removesuffix(BLOCKS) + SCALES, 200)} beside it"
                    )
                sources.append(_source(info, scales, out_dtype))
        return sources, set()


def _source(blocks: TensorInfo, scales: TensorInfo, out_dtype: np.dtype) -> Mxfp4Experts:
    """The experts tensor `blocks` and `scales` stand for, checked against each other."""
    where = f"{blocks.file.name}: tensor {quoted(blocks.key, 200)}"
    if blocks.dtype != UINT8:
        raise CheckpointError(f"{where} is {blocks.dtype.name}: MXFP4 blocks are uint8 (two e2m1 values a byte)")
    if len(blocks.shape) != 4 or blocks.shape[-1] != GROUP_BYTES:
        raise CheckpointError(
            f"{where} is {shape_text(blocks.shape)}: MXFP4 blocks are [experts, rows, groups, {GROUP_BYTES}] "
            f"({GROUP} values in {GROUP_BYTES} bytes a group)"
        )
    if scales.dtype != UINT8:
        raise CheckpointError(
            f"{scales.file.name}: tensor {quoted(scales.key, 200)} is {scales.dtype.name}: "
            "MXFP4 scales are uint8 (E8M0 exponents)"
        )
    if scales.shape != blocks.shape[:-1]:
        raise CheckpointError(
            f"{scales.file.name}: tensor {quoted(scales.key, 200)} is {shape_text(scales.shape)}, but "
            f"{quoted(blocks.key, 200)} {shape_text(blocks.shape)} needs one scale a group: "
            f"{shape_text(blocks.shape[:-1])}"
        )
    experts, rows, groups, _ = blocks.shape
    return Mxfp4Experts(
        blocks.key.removesuffix(BLOCKS),
        blocks.file,
        FLOAT32,
        (experts, groups * GROUP, rows),
        blocks.offset,
        blocks.file_id,
        parts=(blocks, scales),
        out_dtype=out_dtype,
    )
