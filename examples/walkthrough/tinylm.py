"""TinyLM in Equinox: the module a user brings to port (see docs/adding-an-architecture.md).

Built from port's library of layers (`port.nn`): its LayerNorm, the attention core
(`attend`), the inputs and masks (`prepare`) and the layer scan (`scan`), so the file
holds only what is TinyLM's own: a fused-free per-head attention layout, learned
positions, a GELU MLP of two `Linear`s and a tied head. Layers are stacked on a leading
axis; attention weights are kept per head, `[heads, head_dim, embed]`, so they can be
sharded by heads.

```python
model = TinyLM.from_config(json.load(open("config.json")), key=jax.random.key(0))
logits = model(input_ids)                                 # [batch, seq, vocab]
logits = model(input_ids, attention_mask=mask, remat=True)
```
"""

import equinox as eqx
import jax
import jax.numpy as jnp

from port.nn import LayerNorm, attend, prepare, scan


class Block(eqx.Module):
    norm1: LayerNorm
    wq: jax.Array  # [heads, head_dim, embed]
    wk: jax.Array
    wv: jax.Array
    bq: jax.Array  # [heads, head_dim]
    bk: jax.Array
    bv: jax.Array
    wo: jax.Array  # [embed, heads, head_dim]
    bo: jax.Array
    norm2: LayerNorm
    ff1: eqx.nn.Linear
    ff2: eqx.nn.Linear

    def __init__(self, config: dict, *, key):
        e, h, eps = config["hidden_size"], config["num_heads"], config["layer_norm_eps"]
        d = e // h
        keys = jax.random.split(key, 6)
        init = lambda k, *shape: 0.02 * jax.random.normal(k, shape)  # noqa: E731
        self.norm1 = LayerNorm(e, eps=eps, dtype=jnp.float32)
        self.wq, self.wk, self.wv = (init(k, h, d, e) for k in keys[:3])
        self.bq, self.bk, self.bv = jnp.zeros((h, d)), jnp.zeros((h, d)), jnp.zeros((h, d))
        self.wo, self.bo = init(keys[3], e, h, d), jnp.zeros(e)
        self.norm2 = LayerNorm(e, eps=eps, dtype=jnp.float32)
        self.ff1 = eqx.nn.Linear(e, 4 * e, key=keys[4])
        self.ff2 = eqx.nn.Linear(4 * e, e, key=keys[5])

    def __call__(self, x, mask):  # x: [batch, seq, embed], mask: [batch, seq, seq]
        y = self.norm1(x)
        q = jnp.einsum("bse,hde->bshd", y, self.wq) + self.bq
        k = jnp.einsum("bse,hde->bshd", y, self.wk) + self.bk
        v = jnp.einsum("bse,hde->bshd", y, self.wv) + self.bv
        attn = attend(q, k, v, mask, scale=q.shape[-1] ** -0.5)
        x = x + jnp.einsum("bshd,ehd->bse", attn, self.wo) + self.bo
        ff = jax.vmap(jax.vmap(self.ff1))(self.norm2(x))
        return x + jax.vmap(jax.vmap(self.ff2))(jax.nn.gelu(ff, approximate=False))


class TinyLM(eqx.Module):
    embed: jax.Array  # [vocab, embed]
    pos: jax.Array  # [positions, embed]
    blocks: Block  # every leaf stacked on a leading layer axis
    norm: LayerNorm

    def __init__(self, config: dict, *, key):
        e = config["hidden_size"]
        k_embed, k_pos, k_blocks = jax.random.split(key, 3)
        self.embed = 0.02 * jax.random.normal(k_embed, (config["vocab_size"], e))
        self.pos = 0.02 * jax.random.normal(k_pos, (config["max_positions"], e))
        keys = jax.random.split(k_blocks, config["num_layers"])
        self.blocks = eqx.filter_vmap(lambda k: Block(config, key=k))(keys)
        self.norm = LayerNorm(e, eps=config["layer_norm_eps"], dtype=jnp.float32)

    @classmethod
    def from_config(cls, config: dict, *, key) -> "TinyLM":
        return cls(config, key=key)

    def __call__(self, input_ids, *, attention_mask=None, remat=None):
        """[batch, seq] (or [seq]) ids -> [batch, seq, vocab] logits; 0 in `attention_mask` is padding."""
        tokens = prepare(input_ids, attention_mask=attention_mask, limit=("max_positions", self.pos.shape[0]))
        x = self.embed[tokens.ids] + self.pos[tokens.positions]
        x, _ = scan(lambda block, h: (block(h, tokens.mask), None), x, self.blocks, remat=remat)
        return tokens.output(self.norm(x) @ self.embed.T)
