"""port's library of layers: what every model family is built from.

A family file holds only what is new in it; norms (`rms_norm`: Llama's, OLMo 2's
`float32_scale`, Gemma's `plus_one`), rotary embeddings (`run_layers(rope_layers=...)` for
layers without them), attention (`Attention`'s q/k norm per head or over the whole
projection, a per-query `q_scale`), MLPs, the decoder layer (`Block`: norms before, after or around each
branch), the routed mixture of experts, multi-head latent attention (DeepSeek-V3), Gated
DeltaNet linear attention (Qwen3-Next), low-rank adapters (`LoRA`, merged layer by
layer in the scan), the layer scan and layers of several kinds,
inputs and masks, the key/value cache, greedy and sampled generation (decoders and encoder-decoders;
transformers' logits processors: `process_logits`) and the losses live here. Every layer works on batch-first arrays
(`[batch, seq, embed]`); models accept `(batch, seq)` ids or one `(seq,)` sequence.

Reading config.json is `port.nn.config` (public): `get`, `check`, `activation`,
`check_model_type`, `read_kv_heads`, and `ConfigFields`, each module's declaration of the
fields it runs (`IGNORED`: those that change nothing numerically).

Axis names are one vocabulary (`AXES`, `REFINED`, `SHAPES`, written down in
`port/nn/_axes.py`): a field annotated `Float[Array, "heads head_dim embed"]` is filled by
a mapping entry whose `axes` are `["layers", "heads", "head_dim", "embed"]`. The test
suite runs every layer and model with jaxtyping's run-time checks (beartype), so the
annotations are checked contracts.

```python
import port.nn as pnn
attn = pnn.Attention(heads=8, kv_heads=2, head_dim=64, embd=512, dtype=jnp.float32, key=key)
tokens = pnn.prepare(input_ids, attention_mask=mask)
y, _ = attn(x, tokens.mask, cos=cos, sin=sin)
```
"""

from port.nn import config as config
from port.nn._attention import Attention as Attention
from port.nn._attention import attend as attend
from port.nn._attention import with_cache as with_cache
from port.nn._axes import AXES as AXES
from port.nn._axes import REFINED as REFINED
from port.nn._axes import SHAPES as SHAPES
from port.nn._block import Block as Block
from port.nn._cache import Cache as Cache
from port.nn._compressed import CompressedAttention as CompressedAttention
from port.nn._decoder import Decoder as Decoder
from port.nn._deltanet import GatedDeltaNet as GatedDeltaNet
from port.nn._deltanet import causal_conv as causal_conv
from port.nn._deltanet import chunk_gated_delta_rule as chunk_gated_delta_rule
from port.nn._deltanet import gated_rms_norm as gated_rms_norm
from port.nn._deltanet import l2norm as l2norm
from port.nn._deltanet import recurrent_gated_delta_rule as recurrent_gated_delta_rule
from port.nn._embedding import embeddings as embeddings
from port.nn._embedding import head as head
from port.nn._generate import decode_step as decode_step
from port.nn._generate import generate as generate
from port.nn._generate import prefill as prefill
from port.nn._hyper import HyperConnection as HyperConnection
from port.nn._hyper import HyperHead as HyperHead
from port.nn._init import normal as normal
from port.nn._init import shapes_only as shapes_only
from port.nn._init import stacked as stacked
from port.nn._init import zeros_if as zeros_if
from port.nn._layers import run_groups as run_groups
from port.nn._layers import run_layers as run_layers
from port.nn._lora import LoRA as LoRA
from port.nn._lora import merged as merged
from port.nn._lora import trainable as trainable
from port.nn._loss import next_token_loss as next_token_loss
from port.nn._loss import seq2seq_loss as seq2seq_loss
from port.nn._mla import LatentAttention as LatentAttention
from port.nn._mlp import MLP as MLP
from port.nn._mlp import GatedMLP as GatedMLP
from port.nn._mlp import clamped_swiglu as clamped_swiglu
from port.nn._mlp import linear as linear
from port.nn._moe import MoE as MoE
from port.nn._moe import route as route
from port.nn._norm import LayerNorm as LayerNorm
from port.nn._norm import rms_norm as rms_norm
from port.nn._pooler import Pooler as Pooler
from port.nn._precision import cast as cast
from port.nn._resize import bicubic_resize as bicubic_resize
from port.nn._resize import bicubic_weights as bicubic_weights
from port.nn._rope import Rope as Rope
from port.nn._rope import apply_rope as apply_rope
from port.nn._rope import read_rope as read_rope
from port.nn._sampling import apply_temperature as apply_temperature
from port.nn._sampling import keep_min_p as keep_min_p
from port.nn._sampling import keep_top_k as keep_top_k
from port.nn._sampling import keep_top_p as keep_top_p
from port.nn._sampling import penalize_repetition as penalize_repetition
from port.nn._sampling import process_logits as process_logits
from port.nn._scan import scan as scan
from port.nn._sparse import Indexer as Indexer
from port.nn._sparse import SparseLatentAttention as SparseLatentAttention
from port.nn._sparse import sparse_attend as sparse_attend
from port.nn._tokens import Tokens as Tokens
from port.nn._tokens import prepare as prepare
from port.nn._window import local_window as local_window
