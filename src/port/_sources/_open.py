"""`open_checkpoint`: which source a name means (a URL, or a local directory or repo id), opened.

```python
ckpt = open_checkpoint("path/to/gpt2")          # or a Hugging Face repo id
ckpt.tensors["h.0.attn.c_attn.weight"].shape    # (768, 2304), no data read
block = ckpt.read("wte.weight", ((0, 50257), (0, 192)))   # exactly that region
ckpt.bytes_read                                  # 50257 * 192 * 4
```
"""

from __future__ import annotations

import os

from ._checkpoint import Checkpoint
from ._directory import open_local
from ._quantized import dequantized
from ._remote import MAX_OVER_READ, open_remote, over_read_ratio
from ._urls import is_url


def open_checkpoint(model: str | os.PathLike, max_over_read: float | None = None) -> Checkpoint:
    """Open a checkpoint, reading only its `config.json` and tensor headers.

    Every file is untrusted: headers are checked in full (offsets, sizes, dtypes) before
    anything is read; a `CheckpointError` names the file and what is wrong.

    **Arguments:**

    - `model`: a directory with `config.json` and `*.safetensors` (sharded ones with
      their `model.safetensors.index.json`), or a Hugging Face repo id; or a URL of such
      a directory, read in place by byte range (`http(s)://`, `hf://org/name[@revision]`,
      `s3://`, `gs://`: see `port._sources._remote`).
    - `max_over_read`: a URL's reads may fetch up to this many times the bytes they need,
      one request spanning the gaps between the stretches wanted, the gaps discarded and
      counted in `bytes_over_read` (a number >= 1; default 2; 1: exact ranges). Local
      files are read exactly unless it is given: a positioned read costs no round trip, but
      several processes' interleaved rows cost a `preadv` each, which reading through the
      other processes' bytes saves.

    A checkpoint whose config.json has a `quantization_config` (FP8, MXFP4, int4, ...) is
    read as the unquantized checkpoint it stands for: see `port._sources._quantized`.

    Returns a `Checkpoint`, a context manager: leaving it closes what the checkpoint holds
    open (a remote one's connections and request threads; a local one holds no file open
    between reads).

    ```python
    with port.open_checkpoint("path/to/gpt2") as ckpt:
        ckpt.config["n_layer"], ckpt.tensors["wte.weight"].shape
    ```
    """
    if is_url(model) and not str(model).lower().startswith("file://"):
        ratio = MAX_OVER_READ if max_over_read is None else over_read_ratio(max_over_read)
        return dequantized(open_remote(str(model), max_over_read=ratio))
    return dequantized(open_local(model, 1.0 if max_over_read is None else over_read_ratio(max_over_read)))
