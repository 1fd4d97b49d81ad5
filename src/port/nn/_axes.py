"""The axis vocabulary: one name per axis, in jaxtyping annotations and in mappings alike.

A parameter's axis has one name wherever it is written: the annotation of the layer's
field (`wq: Float[Array, "heads head_dim embed"]`), checked at run time in the test
suite, and the logical axes of the mapping entry that fills it (`axes = ["layers",
"heads", "head_dim", "embed"]`), which the mapping's `[rules]` place on mesh axes.

- `AXES`: the logical axes of parameters, the names mappings use (`axes`, `[rules]`);
  annotations use them too. `layers` (and `experts`, for stacked experts) is the
  leading axis `port.nn.stacked` adds: an annotation describes one layer, so only
  mappings write `layers`.
- `REFINED`: where one layer holds two sizes that a mapping gives one logical axis
  (DeepSeek-V3's query and key/value ranks are both `lora`), the annotation tells them
  apart by a name of its own; each maps to its logical axis.
- `SHAPES`: axes of activations and of generic helpers, never of a parameter
  (`batch`, `seq`, ...); only annotations use them.

| name | what it is | in |
|---|---|---|
| `layers` | stacked layers of one kind | mappings |
| `vocab`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `experts`, ... | see `AXES` | both |
| `q_rank`, `kv_rank`, `qk_dim`, `nope_dim`, `rope_dim`, `v_dim`, `key_dim`, `value_dim` | see `REFINED` | annotations |
| `batch`, `seq`, `keys`, `length`, ... | see `SHAPES` | annotations |

```python
AXES["embed"]          # "the hidden size (hidden_size, n_embd)"
REFINED["kv_rank"]     # "lora": mappings call DeepSeek-V3's latent rank `lora`
"batch" in SHAPES      # True: an activation's axis, never a parameter's
```
"""

from __future__ import annotations

AXES: dict[str, str] = {
    "layers": "stacked layers of one kind (the leading axis `stacked` adds; mappings only)",
    "vocab": "the token vocabulary (vocab_size)",
    "embed": "the hidden size (hidden_size, n_embd)",
    "embed_out": "a projection of the hidden size back to it: its output axis (BERT's and ViT's pooler)",
    "projection": "a dual model's shared embedding space, both towers projected into it (CLIP's projection_dim)",
    "heads": "attention (query) heads (num_attention_heads, n_head)",
    "kv_heads": "key/value heads (num_key_value_heads); `heads` in a mapping of a model without grouped-query attention",
    "head_dim": "the features of one head (head_dim)",
    "qkv": "queries, keys and values fused on one axis of size 3 (GPT-NeoX)",
    "mlp": "an MLP's or an expert's hidden size (intermediate_size, moe_intermediate_size, n_inner)",
    "experts": "routed experts (num_experts, num_local_experts, n_routed_experts)",
    "lora": "a low-rank bottleneck (DeepSeek-V3's q_lora_rank, kv_lora_rank)",
    "rank": "a LoRA adapter's rank (PEFT's r): the axis between `a` and `b`",
    "linear_heads": "Gated DeltaNet's key heads (linear_num_key_heads)",
    "linear_v_heads": "Gated DeltaNet's value heads (linear_num_value_heads)",
    "kernel": "a causal convolution's taps (linear_conv_kernel_dim)",
    "positions": "a learned position table (max_position_embeddings, n_positions)",
    "token_types": "BERT's token types (type_vocab_size)",
    "buckets": "T5's relative position buckets (relative_attention_num_buckets)",
    "channels": "an image's channels (num_channels)",
    "patch_height": "a ViT patch's rows (patch_size)",
    "patch_width": "a ViT patch's columns (patch_size)",
    "patch_pixels": "a patch's pixels flattened, (patch, patch, channels): SigLIP 2's patch_size**2 * num_channels",
    "registers": "DINOv2's register tokens (num_register_tokens)",
    "mels": "audio features' mel bins (Whisper's num_mel_bins)",
    "per_layer": "Gemma 4's per-layer input (hidden_size_per_layer_input), or every layer's side by side",
    "scalar": "an axis of size 1 holding one number per layer (Gemma 4's layer_scalar)",
    "hc": "DeepSeek-V4's hyper-connection streams (hc_mult)",
    "hc_mix": "DeepSeek-V4's hyper-connection weights per token: pre, post and comb ((2 + hc_mult) * hc_mult)",
    "hc_embed": "DeepSeek-V4's streams flattened (hc_mult * hidden_size)",
    "hc_scale": "DeepSeek-V4's hyper-connection scales: pre, post and comb (3)",
    "o_groups": "DeepSeek-V4's groups of heads in the grouped output projection (o_groups)",
    "group_in": "DeepSeek-V4's features of one group of heads (num_attention_heads / o_groups * head_dim)",
    "comp_dim": "DeepSeek-V4's compressor projections (head_dim, or two series of it)",
    "rate": "DeepSeek-V4's tokens pooled into one compressed entry (compress_rates)",
    "index_heads": "an indexer's query heads (index_n_heads): DeepSeek-V4's; Mistral Large 4's, kept whole",
    "index_q": "DeepSeek-V4's indexer queries, heads by features (index_n_heads * index_head_dim)",
    "hash_experts": "DeepSeek-V4's experts a hash-routed token takes (num_experts_per_tok)",
}
"""The logical axes of parameters, by name: what mappings write, and annotations too."""

REFINED: dict[str, str] = {
    "q_rank": "lora",  # DeepSeek-V3: the queries' bottleneck (q_lora_rank)
    "kv_rank": "lora",  # DeepSeek-V3: the latent (kv_lora_rank)
    "qk_dim": "head_dim",  # DeepSeek-V3: a query/key head, nope_dim + rope_dim (qk_head_dim)
    "nope_dim": "head_dim",  # DeepSeek-V3: its part without rotation (qk_nope_head_dim)
    "rope_dim": "head_dim",  # DeepSeek-V3: its rotated part (qk_rope_head_dim)
    "v_dim": "head_dim",  # a value head where its size is not the key's (DeepSeek-V3's v_head_dim; with_cache)
    "key_dim": "head_dim",  # Gated DeltaNet: a key head (linear_key_head_dim)
    "value_dim": "head_dim",  # Gated DeltaNet: a value head (linear_value_head_dim)
    "per_layer_vocab": "vocab",  # Gemma 4: the per-layer embeddings' table (vocab_size_per_layer_input)
    "per_layer_all": "per_layer",  # Gemma 4: every layer's per-layer input, packed (layers x per_layer)
    "o_rank": "lora",  # DeepSeek-V4: a group's output bottleneck (o_lora_rank)
    "index_dim": "head_dim",  # DeepSeek sparse attention: an indexer head's features (index_head_dim)
    "half_rotary": "head_dim",  # Mistral Large 4: LeRoPE's learned alpha, one per rotary frequency
    "o_in": "lora",  # DeepSeek-V4: every group's bottleneck side by side (o_groups * o_lora_rank)
}
"""Annotation names for one of two sizes a mapping gives one logical axis: name -> that axis."""

SHAPES: dict[str, str] = {
    "batch": "sequences in a batch",
    "seq": "positions of this call's tokens",
    "keys": "positions attended to: the sequence's, or the cache's slots",
    "source": "an encoder's positions, which a decoder's cross-attention attends to (T5)",
    "length": "a key/value cache's slots",
    "total": "a generated sequence: the prompt and the new tokens",
    "tokens": "batch x seq tokens, flattened (routing)",
    "top_k": "the experts each token is routed to",
    "top": "the keys each query attends to in sparse attention (index_topk)",
    "rows": "(token, expert) pairs sorted by expert (grouped matmuls)",
    "rotary": "the rotated features of a head (RoPE's cos and sin)",
    "entries": "DeepSeek-V4's compressed entries: one per window of `rate` tokens",
    "height": "an image's rows of pixels",
    "width": "an image's columns of pixels",
    "frames": "audio features' time steps (Whisper's 2 * max_source_positions)",
    "patches": "an image's patches, flattened",
    "images": "the images of a dual text-image model's batch (SigLIP's, CLIP's logits per image)",
    "texts": "the texts of a dual text-image model's batch (its logits per text)",
    "groups": "one axis per head of a per-head helper, whichever heads it is given (causal_conv)",
    "in": "a generic helper's input features (linear, grouped)",
    "out": "a generic helper's output features (linear, grouped)",
    "dim": "a generic helper's last axis (l2norm, gated_rms_norm, causal_conv)",
    "rest": "a generic helper's leading axes (`*rest`)",
    "n": "a generic helper's square matrices (`... n n`)",
    "carry": "a layer scan's carry: the hidden state and what rides along it (Gemma 4's per-layer inputs)",
}
"""Axes of activations and generic helpers, never of a parameter: annotations only."""
