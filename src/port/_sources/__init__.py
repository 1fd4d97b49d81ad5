"""Sources: where a checkpoint's config, tensor headers and tensor bytes come from.

A checkpoint is untrusted input. Opening one reads only `config.json`, the shard
index and the tensor headers, each bounded in size before a byte of it is read, from
regular files only (a FIFO, a device or a directory is refused, never waited on),
named by the index as plain file names inside the checkpoint directory. Each header
is validated as its format specifies, refusing whatever the reference loader refuses.
Tensor bytes are read later, region by region, straight into the caller's buffers.

Every source answers one interface, the abstract `Checkpoint` (`_checkpoint`); the
rest of port sees no other. The modules:

- `_checkpoint`: `Checkpoint`, `TensorInfo`, `Region`, the rules every tensor obeys.
- `_runs`: where a region's bytes lie in its file (runs), in bounded batches.
- `_safetensors`: the safetensors format and the index, parsed from bytes.
- `_pytorch`: `torch.save` zips (`pytorch_model.bin`), through a restricted unpickler.
- `_directory`: a local checkpoint directory (or a repo id, through the Hugging Face cache).
- `_local`: `LocalCheckpoint`, its reads by `preadv`.
- `_urls`: which names are URLs, and URLs without credentials.
- `_transport`, `_ranges`, `_http`, `_hub`, `_fsspec`: reading a URL by byte range.
- `_remote`: `RemoteCheckpoint`, composed around a transport.
- `_quantized`: a quantized checkpoint (FP8, MXFP4, int4, nf4, ...) read as the unquantized
  one it stands for, composed around any of them.
- `_open`: `open_checkpoint`, which of them a name means (a quantized one dequantized).

The safe opening and bounded reading of files, shared with `restore` and `export`,
is `port._files`.

```python
ckpt = open_checkpoint("path/to/gpt2")          # or a Hugging Face repo id, or a URL
ckpt.tensors["h.0.attn.c_attn.weight"].shape    # (768, 2304), no data read
block = ckpt.read("wte.weight", ((0, 50257), (0, 192)))   # exactly that region
ckpt.bytes_read                                  # 50257 * 192 * 4
```
"""

from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import Region as Region
from ._checkpoint import TensorInfo as TensorInfo
from ._directory import raw_header as raw_header
from ._directory import resolve as resolve
from ._local import LocalCheckpoint as LocalCheckpoint
from ._open import open_checkpoint as open_checkpoint
from ._remote import RemoteCheckpoint as RemoteCheckpoint
from ._safetensors import MAX_HEADER as MAX_HEADER
from ._urls import is_url as is_url
from ._urls import shown as shown
