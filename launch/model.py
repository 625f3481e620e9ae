"""A decoder-only MoE transformer in Haiku (Llama4-style): RMSNorm, rotary attention, SwiGLU.

Shapes: B batch, S sequence, D model width, H query heads, G key/value heads, Dh head dim,
V vocabulary. Every `moe_every`-th block (the last of each group) uses `moe_hk.MoELayer`, the
others a dense SwiGLU MLP; MoE blocks may add a shared expert (a dense SwiGLU on every token).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

import moe_hk


class ModelOutput(NamedTuple):
  logits: jax.Array     # [B, S, V] float32
  moe_stats: tuple      # one moe_hk.MoEStats per MoE block, in order


def moe_config(config: ml_collections.ConfigDict) -> moe_hk.MoEConfig:
  """The MoE layer settings of a model config."""
  m = config.moe
  return moe_hk.MoEConfig(
      num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
      emb_dim=config.emb_dim, mlp_dim=m.mlp_dim, ragged_buffer_factor=m.ragged_buffer_factor,
      moe_dropless_fallback=m.dropless_fallback, use_ring_of_experts=m.use_ring_of_experts,
      router_score=m.router_score, dtype=config.dtype,
      load_balance_loss_weight=m.load_balance_loss_weight)


def rotary(x: jax.Array, base: float = 10_000.0) -> jax.Array:
  """Rotary position embedding of `x [B, S, heads, Dh]` (positions 0..S-1)."""
  seq, dim = x.shape[1], x.shape[-1]
  freqs = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)       # [Dh / 2]
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None]      # [S, Dh / 2]
  sin, cos = jnp.sin(angles)[None, :, None], jnp.cos(angles)[None, :, None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class Attention(hk.Module):
  """Causal grouped-query attention with rotary embeddings: `[B, S, D] -> [B, S, D]`."""

  def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype, name=None):
    super().__init__(name=name)
    self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = (
        num_heads, num_kv_heads, head_dim, dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, s, d = x.shape
    dense = lambda n, name: hk.Linear(n, with_bias=False, name=name)
    q = dense(self.num_heads * self.head_dim, "q")(x).reshape(b, s, self.num_heads, -1)
    k = dense(self.num_kv_heads * self.head_dim, "k")(x).reshape(b, s, self.num_kv_heads, -1)
    v = dense(self.num_kv_heads * self.head_dim, "v")(x).reshape(b, s, self.num_kv_heads, -1)
    q, k = rotary(q), rotary(k)
    repeat = self.num_heads // self.num_kv_heads
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    scores = jnp.einsum("bshd,bthd->bhst", q, k).astype(jnp.float32) / math.sqrt(self.head_dim)
    causal = jnp.tril(jnp.ones((s, s), jnp.bool_))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(self.dtype)
    out = jnp.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, -1)
    return dense(d, "o")(out)


class SwiGLU(hk.Module):
  """Dense SwiGLU MLP: `[B, S, D] -> [B, S, D]`."""

  def __init__(self, hidden: int, name=None):
    super().__init__(name=name)
    self.hidden = hidden

  def __call__(self, x: jax.Array) -> jax.Array:
    dense = lambda n, name: hk.Linear(n, with_bias=False, name=name)
    return dense(x.shape[-1], "wo")(
        jax.nn.silu(dense(self.hidden, "wi_0")(x)) * dense(self.hidden, "wi_1")(x))


class Transformer(hk.Module):
  """Tokens `[B, S]` int -> `ModelOutput`. MoE blocks label their metric events with `step`
  and their ordinal among MoE blocks."""

  def __init__(self, config: ml_collections.ConfigDict, mesh: Mesh, name=None):
    super().__init__(name=name)
    self.config = config
    self.mesh = mesh

  def __call__(self, tokens: jax.Array, step: jax.Array | None = None) -> ModelOutput:
    c = self.config
    dtype = jnp.dtype(c.dtype)
    embed = hk.Embed(c.vocab_size, c.emb_dim, name="embed")
    x = embed(tokens).astype(dtype)
    norm = lambda name: hk.RMSNorm(axis=-1, name=name)
    moe_layer_config = moe_config(c)
    stats = []
    for i in range(c.num_layers):
      with hk.name_scope(f"block_{i}"):
        x = x + Attention(c.num_heads, c.num_kv_heads, c.head_dim, dtype,
                          name="attention")(norm("attention_norm")(x))
        h = norm("mlp_norm")(x)
        if (i + 1) % c.moe_every == 0:
          y, layer_stats = moe_hk.MoELayer(moe_layer_config, self.mesh, name="moe")(
              h, step=step, layer_index=len(stats), return_stats=True)
          if c.moe.shared_expert:
            y = y + SwiGLU(c.moe.mlp_dim, name="shared_expert")(h)
          stats.append(layer_stats)
        else:
          y = SwiGLU(c.mlp_dim, name="mlp")(h)
        x = x + y.astype(dtype)
    x = norm("final_norm")(x)
    # Tied output embedding, scaled so that initial logits have unit variance.
    logits = jnp.einsum("bsd,vd->bsv", x.astype(jnp.float32),
                        embed.embeddings.astype(jnp.float32)) / math.sqrt(c.emb_dim)
    return ModelOutput(logits, tuple(stats))
