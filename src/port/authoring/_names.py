"""Names: the canonical tokens of a checkpoint key or a module path, and how alike two are.

Keys and paths name the same things in different words (`wte`, `embed_tokens`,
`embed`; `c_fc`, `fc1`, `up_proj`); both are reduced to canonical tokens, and
their likeness is a weighted overlap of the tokens plus a little of the plain text.

```python
tokens("h.{layer}.attn.c_proj.weight")     # ('layers', 'attn', 'o', 'down', 'weight')
tokens("layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight")   # (..., 'experts', 'gate', 'weight', '1')
similarity("model.embed_tokens.weight", "embed")   # high: both are ('embed', ...)
```
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Sequence

from .._mapping import STACKS

# Whole segments with a meaning of their own, looked up before splitting on `_`.
_SEGMENTS: dict[str, tuple[str, ...]] = {
    "wte": ("embed",),
    "word_embeddings": ("embed",),
    "embed_tokens": ("embed",),
    "tok_embeddings": ("embed",),
    "token_embedding": ("embed",),
    "wpe": ("position", "embed"),
    "token_type_embeddings": ("token_type", "embed"),
    "self_attn": ("attn",),
    "c_attn": ("attn", "qkv"),
    "qkv_proj": ("qkv",),
    "in_proj": ("qkv",),
    "query_key_value": ("qkv",),
    "wqkv": ("qkv", "weight"),
    "c_proj": ("o", "down"),
    "c_fc": ("up",),
    "fc1": ("up",),
    "fc2": ("down",),
    "ln_f": ("norm", "final"),
    "lm_head": ("lm_head",),
    "input_layernorm": ("norm", "attn", "1"),
    "post_attention_layernorm": ("norm", "mlp", "2"),
    "layer_norm": ("norm",),
    "feed_forward": ("mlp",),
    "block_sparse_moe": ("mlp",),
    "token_type": ("token_type",),
    **{f"w{x}": (x, "weight") for x in ("q", "k", "v", "o")},
    **{f"b{x}": (x, "bias") for x in ("q", "k", "v", "o")},
    # Meta's Llama and Mixtral: w1 gate, w2 down, w3 up (the digit kept: w1 ~ w1 best)
    "w1": ("gate", "weight", "1"),
    "w2": ("down", "weight", "2"),
    "w3": ("up", "weight", "3"),
}

# Single tokens (after splitting a segment on `_` and between letters and digits).
_SYNONYMS: dict[str, tuple[str, ...]] = {
    "embed": ("embed", "embedding", "embeddings", "emb", "embeds"),
    "position": ("position", "positions", "pos", "positional"),
    "norm": ("norm", "ln", "layernorm", "rmsnorm"),
    "attn": ("attn", "attention", "self"),
    "q": ("q", "query"),
    "k": ("k", "key"),
    "v": ("v", "value"),
    "o": ("o", "out", "dense"),
    "up": ("up", "fc", "intermediate", "wi"),
    "down": ("down", "proj", "output"),
    "gate": ("gate", "router"),
    "mlp": ("mlp", "ffn", "ff", "feedforward", "moe"),
    "experts": ("experts", "expert"),
    "bias": ("bias", "b", "beta"),
    "weight": ("weight", "w", "gamma", "kernel", "scale"),
    "layers": ("layers", "layer", "h", "blocks", "block", "encoder"),
    "final": ("final", "f"),
    "lm_head": ("head", "unembed", "unembedding"),
    "qkv": ("qkv",),
}
_TOKEN = {word: canon for canon, words in _SYNONYMS.items() for word in words}
_DROP = {"c"}
_KINDS = {"weight", "bias"}
_TOKEN_WEIGHT = {"layers": 0.5, "weight": 0.5}


@functools.cache
def tokens(name: str) -> tuple[str, ...]:
    """Canonical tokens of a key or path: `h.{layer}.attn.c_proj.weight` -> layers attn o down weight.

    A `{layer}` or `{expert}` segment is dropped; another integer segment (a layer of an
    unstacked model) is kept as `#n`, so that layer 3 pairs with layer 3.
    """
    out: list[str] = []
    for segment in name.lower().split("."):
        if segment in STACKS:
            continue
        if segment.isdigit():
            out.append(f"#{int(segment)}")
        elif segment in _SEGMENTS:
            out.extend(_SEGMENTS[segment])
        else:
            pieces = [p for p in re.split(r"_|(?<=[a-z])(?=\d)", segment) if p]
            if len(pieces) > 1 and pieces[-1] == "proj":  # q_proj, up_proj, out_proj
                pieces = pieces[:-1]
            out.extend(_TOKEN.get(p, p) for p in pieces if p not in _DROP)
    return tuple(dict.fromkeys(out))


def weight_or_bias(toks: Sequence[str]) -> str | None:
    """`"weight"` or `"bias"` when exactly one of them is among `toks`, else None."""
    found = _KINDS.intersection(toks)
    return found.pop() if len(found) == 1 else None


def similarity(key: str, path: str) -> float:
    """How alike a source key (pattern) and a module path are, from 0 to 1."""
    a, b = set(tokens(key)), set(tokens(path))
    if not (a & _KINDS) or not (b & _KINDS):  # `wte.weight` ~ `wte`: an implicit weight
        a.discard("weight")
        b.discard("weight")
    union = sum(_TOKEN_WEIGHT.get(t, 1.0) for t in a | b)
    jaccard = sum(_TOKEN_WEIGHT.get(t, 1.0) for t in a & b) / union if union else 0.0
    ratio = difflib.SequenceMatcher(None, _plain(key), _plain(path)).ratio()
    return 0.8 * jaccard + 0.2 * ratio


def _plain(name: str) -> str:
    return ".".join(s for s in name.lower().split(".") if s not in STACKS and not s.isdigit())
