"""Quantized checkpoints: each packed weight and its companions read as the tensor they stand for.

A checkpoint whose `config.json` has a `quantization_config` is opened as a
`DequantizedCheckpoint` (`dequantized`): its tensors are the unquantized checkpoint's,
of their real shapes, each a `QuantizedInfo` that reads only the packed bytes and the
scale blocks covering a region and dequantizes them. Plan, place, restore and the
multi-process split see ordinary tensors; `bytes_read` counts what was read.

The modules, one idea each:

- `_source`: `QuantizedInfo`, the region question one step further, and block helpers.
- `_format`: `Format`, the registry of `quant_method`s, the dtype dequantized weights take.
- `_checkpoint`: `DequantizedCheckpoint` and `dequantized`.
- `_bitsandbytes`: bitsandbytes 4-bit (nf4, fp4, nested absmax), as unsloth's `-bnb-4bit` stores it.
- `_compressed`: compressed-tensors: pack-quantized int groups, NVFP4, float8 / int8 with scales.
- `_fp8`: FP8 with block (or per-tensor) scales, and FP4-packed experts beside it.
- `_int4`: GPTQ (act-order `g_idx`, v1 and v2 zeros) and AWQ (GEMM) int4 groups.
- `_mxfp4`: gpt-oss's MXFP4 experts (`*_blocks`, `*_scales`), read as the fused experts.

```python
with port.open_checkpoint("tiny-deepseek-fp8") as ckpt:
    ckpt.tensors["model.layers.0.mlp.down_proj.weight"].describe()
    # 'fp8 e4m3fn, 128x128 blocks, scales weight_scale_inv float32'
```
"""

from . import _bitsandbytes as _bitsandbytes  # registers its format
from . import _compressed as _compressed  # registers its format
from . import _fp8 as _fp8  # registers its format
from . import _int4 as _int4  # registers its formats
from . import _mxfp4 as _mxfp4  # registers its format
from ._checkpoint import DequantizedCheckpoint as DequantizedCheckpoint
from ._checkpoint import dequantized as dequantized
from ._checkpoint import describe as describe
from ._format import FORMATS as FORMATS
from ._format import Format as Format
from ._source import QuantizedInfo as QuantizedInfo
