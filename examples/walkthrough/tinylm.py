"""TinyLM in Equinox: the module a user brings to port (see docs/adding-an-architecture.md).

Layers are stacked on a leading axis and run with `lax.scan`; attention weights
are kept per head, `[heads, head_dim, embed]`, so they can be sharded by heads.

```python
model = TinyLM.from_config(json.load(open("config.json")), key=jax.random.key(0))
logits = model(input_ids)          # [batch, seq, vocab]
```
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp


class LayerNorm(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    eps: float = eqx.field(static=True)

    def __call__(self, x):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + self.eps) * self.weight + self.bias


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
        self.norm1 = LayerNorm(jnp.ones(e), jnp.zeros(e), eps)
        self.wq, self.wk, self.wv = (init(k, h, d, e) for k in keys[:3])
        self.bq, self.bk, self.bv = jnp.zeros((h, d)), jnp.zeros((h, d)), jnp.zeros((h, d))
        self.wo, self.bo = init(keys[3], e, h, d), jnp.zeros(e)
        self.norm2 = LayerNorm(jnp.ones(e), jnp.zeros(e), eps)
        self.ff1 = eqx.nn.Linear(e, 4 * e, key=keys[4])
        self.ff2 = eqx.nn.Linear(4 * e, e, key=keys[5])

    def __call__(self, x):  # x: [seq, embed]
        y = self.norm1(x)
        q = jnp.einsum("se,hde->hsd", y, self.wq) + self.bq[:, None]
        k = jnp.einsum("se,hde->hsd", y, self.wk) + self.bk[:, None]
        v = jnp.einsum("se,hde->hsd", y, self.wv) + self.bv[:, None]
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        attn = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1) @ v
        x = x + jnp.einsum("hsd,ehd->se", attn, self.wo) + self.bo
        hidden = jax.nn.gelu(jax.vmap(self.ff1)(self.norm2(x)), approximate=False)
        return x + jax.vmap(self.ff2)(hidden)


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
        self.norm = LayerNorm(jnp.ones(e), jnp.zeros(e), config["layer_norm_eps"])

    @classmethod
    def from_config(cls, config: dict, *, key) -> "TinyLM":
        return cls(config, key=key)

    def __call__(self, input_ids):  # [batch, seq] -> [batch, seq, vocab]
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def one(ids):
            x = self.embed[ids] + self.pos[: ids.shape[0]]
            step = lambda h, p: (eqx.combine(p, static)(h), None)  # noqa: E731
            x, _ = jax.lax.scan(step, x, params)
            return self.norm(x) @ self.embed.T

        return jax.vmap(one)(input_ids)
