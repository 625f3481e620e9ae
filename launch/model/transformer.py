"""A decoder-only MoE transformer in Haiku (Llama4-style): RMSNorm, rotary attention, SwiGLU.

Shapes: B batch, S sequence, D model width, H query heads, G key/value heads, Dh head dim,
V vocabulary, n layer groups. Every `moe_every`-th block is an MoE block (`moe_hk.MoELayer`,
plus an optional shared expert), the others dense SwiGLU blocks of width `mlp_dim`; every
`nope_every`-th block (0: none) attends without rotary embeddings, over the whole prefix (Llama
4's NoPE layers), the others within chunks of `attention_chunk_size` (0: the whole prefix).
A layer group holds one period of that pattern (`layer_period`), and the groups run in an
`hk.layer_stack` (a scan: one compiled group however deep the model), each group, or with
`config.remat_unit='block'` each block of it, rematerialised in the backward under
`config.remat_policy` (`REMAT_POLICIES`). Parameters are
float32; matmuls run in `config.dtype`. The knobs public checkpoints need (`launch.convert`)
are config keys whose defaults are the model above: `tie_embeddings` (False: an untied
`[V, D]` output projection), `rope_theta`, `rope_layout`, `rope_scaling`, `norm_eps`, `qk_norm`
(an RMSNorm over each query and key head before the rotation), `qk_l2_norm` (a weightless one
after it), `attn_temperature_tuning` (`floor_scale`, `attn_scale`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

import moe_hk
from launch.model import attention as attention_lib, positions
from launch.setup import choices
from moe_hk import step_mode


class ModelOutput(NamedTuple):
  hidden: jax.Array           # [B, S, D] final-normed activations, compute dtype.
  # [V, D] float32, the output projection: the input embedding when tied, else `unembed`.
  embeddings: jax.Array
  moe_stats: moe_hk.MoEStats  # per MoE block, stacked: each field has a leading [n] axis.


# `config.remat_policy` -> what the backward keeps of a remat unit's forward (None: nothing is
# rematerialised, every residual is kept). The unit is `config.remat_unit`: a layer group
# (one period of the layer pattern) or each block of it; a unit's inputs are the only
# residuals 'full' keeps (one [B, S, D] per unit).
UNIT_INPUT = "unit_input"  # the name of a remat unit's input (`rematerialised`)
REMAT_POLICIES = {
    "none": None,
    # Everything recomputed: the least memory, one extra forward.
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keeps each block's attention output and the MoE output (the two costliest to recompute:
    # attention's S^2 work, and the MoE's all-to-alls and grouped matmuls), recomputes the
    # rest: per group 2 x moe_every - 1 more [B, S, D] arrays kept, less recompute.
    "save_attention_moe": jax.checkpoint_policies.save_only_these_names("attention_out",
                                                                       "moe_out"),
    # Keeps every matmul output whose operands share no batch axis (the projections: q, k, v,
    # o, the dense MLP's three, the router's) and recomputes the rest in the backward: norms,
    # rotary, the attention kernel's forward, the MoE's permutation and grouped matmuls. Per
    # dense block (3 + 2 x kv/q heads) x D + 2 x mlp_dim values a token in the compute dtype.
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # As 'save_dots', and the experts' three grouped matmul outputs (`moe_hk.EXPERT_MATMUL`,
    # `[rows, F]` twice and `[rows, D]` per MoE block) and splash's forward residuals (its
    # output and log-sum-exp, `attention.KERNEL_RESIDUALS`): the backward then recomputes no
    # matmul and no attention kernel, only norms, rotary, activations and the MoE's row
    # movement. On one v5e chip (`tpu_chip.py`): 0.427 s a step against 0.445, 1.8 GiB more
    # (docs/tpu-chip.md).
    "save_matmuls": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(moe_hk.EXPERT_MATMUL,
                                                      attention_lib.KERNEL_RESIDUALS)),
    # As 'full', but each unit's input (`UNIT_INPUT`), the one residual 'full' keeps, waits
    # for the backward in the host's memory (TPU and GPU: `pinned_host`), copied out in the
    # forward and back in the backward; the same FLOPs. What a 48-layer model keeps per chip
    # drops by its unit inputs: with group units Maverick's 12 x [4, 8192, 5120] bfloat16
    # (3.75 GiB); with block units every block's input, 48 of them (15 GiB), which 'full'
    # would keep on the device.
    "full_inputs_on_host": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[UNIT_INPUT],
        offload_src="device", offload_dst="pinned_host"),
}


def rematerialised(fn: Callable, policy: Callable | None) -> Callable:
  """`fn(x [B, S, D], *rest)` as one remat unit under `policy` (a `REMAT_POLICIES` value;
  None: `fn` as it is). `x` is named `UNIT_INPUT` inside the unit, so that a policy can keep
  it elsewhere ('full_inputs_on_host': the host's memory): the backward's recompute starts
  from that copy, not from the residual the enclosing scan would stack on the device."""
  if policy is None:
    return fn
  return hk.remat(lambda x, *rest: fn(checkpoint_name(x, UNIT_INPUT), *rest), policy=policy)


def dense(x: jax.Array, features: int, name: str) -> jax.Array:
  """`x [..., Din] @ w [Din, features]` in x's dtype; w is a float32 parameter."""
  w = hk.get_parameter(name, (x.shape[-1], features), jnp.float32,
                       init=hk.initializers.TruncatedNormal(1 / math.sqrt(x.shape[-1])))
  return jnp.dot(x, w.astype(x.dtype))


def rms_norm(x: jax.Array, name: str, eps: float = 1e-6) -> jax.Array:
  """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
  scale = hk.get_parameter(name, (x.shape[-1],), jnp.float32, init=jnp.ones)
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (normed * scale).astype(x.dtype)


def weightless_rms_norm(x: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis without a scale (Llama 4's query/key norm), in float32."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + eps)).astype(x.dtype)


def attention(x: jax.Array, c: ml_collections.ConfigDict, mesh: Mesh, rope: bool = True
              ) -> jax.Array:
  """Causal grouped-query attention: `[B, S, D] -> [B, S, D]`, in the form
  `config.attention_impl` names for the mesh's platform (`launch.model.attention`).

  With `rope` (every layer but the `nope_every`-th): rotary embeddings (`rope_layout`,
  `rope_scaling`), then `qk_l2_norm`'s weightless norm of each query and key head, and
  attention within chunks of `attention_chunk_size` positions (0: the whole prefix). Without
  (Llama 4's NoPE layers): no rotation, attention over the whole prefix, and with
  `attn_temperature_tuning` the queries scaled by `positions.temperature`. `qk_norm`
  (Qwen3's weighted norm before the rotation) applies to every layer.
  """
  b, s, _ = x.shape
  groups, per_group = c.num_kv_heads, c.num_heads // c.num_kv_heads
  q = dense(x, c.num_heads * c.head_dim, "q").reshape(b, s, groups, per_group, c.head_dim)
  k = dense(x, groups * c.head_dim, "k").reshape(b, s, groups, c.head_dim)
  v = dense(x, groups * c.head_dim, "v").reshape(b, s, groups, c.head_dim)
  if c.qk_norm:
    q, k = rms_norm(q, "q_norm", c.norm_eps), rms_norm(k, "k_norm", c.norm_eps)
  if rope:
    rates = positions.frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
    q, k = (positions.rotary(t, rates, c.rope_layout) for t in (q, k))
    if c.qk_l2_norm:
      q, k = weightless_rms_norm(q, c.norm_eps), weightless_rms_norm(k, c.norm_eps)
  elif c.attn_temperature_tuning:
    scale = positions.temperature(s, c.floor_scale, c.attn_scale)
    q = (q * scale[None, :, None, None, None]).astype(q.dtype)
  impl = choices.resolve_attention(c.attention_impl, mesh.devices.flat[0].platform)
  out = attention_lib.causal_attention(q, k, v, impl=impl, block=c.attention_block, mesh=mesh,
                                       chunk=c.attention_chunk_size if rope else 0)
  return checkpoint_name(dense(out.reshape(b, s, -1), x.shape[-1], "o"), "attention_out")


def layer_period(c: ml_collections.ConfigDict) -> int:
  """Blocks in one layer group: the pattern of MoE blocks (every `moe_every`-th) and blocks
  without rotary embeddings (every `nope_every`-th, 0: none) repeats every this many."""
  return math.lcm(c.moe_every, c.nope_every or 1)


def block_kinds(c: ml_collections.ConfigDict) -> list[tuple[bool, bool]]:
  """`(moe, rope)` of each block of a layer group, in order."""
  return [((i + 1) % c.moe_every == 0, not c.nope_every or (i + 1) % c.nope_every != 0)
          for i in range(layer_period(c))]


def swiglu(x: jax.Array, hidden: int) -> jax.Array:
  """Dense SwiGLU MLP: `[B, S, D] -> [B, S, D]`."""
  return dense(jax.nn.silu(dense(x, hidden, "wi_0")) * dense(x, hidden, "wi_1"), x.shape[-1], "wo")


class Transformer(hk.Module):
  """Tokens `[B, S]` int -> `ModelOutput`.

  Its MoE blocks run `layer` (`moe_hk.MoEConfig`) and label their metric events with `step`
  and their ordinal among MoE blocks. In 'step' fallback mode the layer stack carries
  `moe_hk.step_mode`'s flag beside the activations, so every MoE layer after an overflow runs
  dropless.
  """

  def __init__(self, config: ml_collections.ConfigDict, layer: moe_hk.MoEConfig, mesh: Mesh,
               name: str | None = None):
    super().__init__(name=name)
    self.config = config
    self.mesh = mesh
    # The fallback events leave once per step, all layers in one callback after the layer
    # stack (`__call__`), not from each layer: a rematerialised unit (a group or a block)
    # would call back again when the backward recomputes it, and each callback holds a device
    # up until the host takes it.
    self.emit_fallback_events = layer.emit_fallback_events
    self.moe_config = dataclasses.replace(layer, emit_fallback_events=False)

  # Transparent: the block's parameters belong to the group's `block_<i>` scope, where
  # `_group` calls it, not to a scope of this method's own.
  @hk.transparent
  def _block(self, x: jax.Array, after_overflow: jax.Array | None, layer_index: jax.Array,
             step: jax.Array | None, moe: bool, rope: bool
             ) -> tuple[jax.Array, jax.Array | None, moe_hk.MoEStats | None]:
    """One block (`block_kinds`: MoE or dense, with or without RoPE): `[B, S, D]` -> same, the
    'step'-mode flag after it (`after_overflow`; None in the other modes) and, for an MoE
    block, its stats (`layer_index`: its ordinal among the MoE blocks; None for a dense
    block)."""
    c = self.config
    x = x + attention(rms_norm(x, "attention_norm", c.norm_eps), c, self.mesh, rope)
    h = rms_norm(x, "mlp_norm", c.norm_eps)
    if not moe:
      with hk.name_scope("mlp"):
        return x + swiglu(h, c.mlp_dim).astype(x.dtype), after_overflow, None
    layer = moe_hk.MoELayer(self.moe_config, self.mesh, name="moe")
    y, stats = layer(h, step=step, layer_index=layer_index, return_stats=True,
                     after_overflow=after_overflow)
    if after_overflow is not None:
      after_overflow = step_mode.overflowed(after_overflow, stats)
    y = checkpoint_name(y, "moe_out")
    if c.shared_expert:
      with hk.name_scope("shared_expert"):
        y = y + swiglu(h, self.moe_config.mlp_dim)
    return x + y.astype(x.dtype), after_overflow, stats

  def _group(self, x: jax.Array, after_overflow: jax.Array | None, group: jax.Array,
             step: jax.Array | None, unit: Callable[[Callable], Callable]
             ) -> tuple[jax.Array, jax.Array | None, moe_hk.MoEStats]:
    """One layer group's blocks (`block_kinds`), each run as `unit(block)` (a remat unit per
    block, or the block as it is): `[B, S, D]` -> same, the 'step'-mode flag after them
    (`after_overflow`; None in the other modes) and its MoE blocks' stats, stacked
    `[m, ...]`."""
    kinds = block_kinds(self.config)
    per_group = sum(moe for moe, _ in kinds)
    stats = []
    for i, (moe, rope) in enumerate(kinds):
      block = unit(functools.partial(self._block, moe=moe, rope=rope))
      with hk.name_scope(f"block_{i}"):
        x, after_overflow, layer_stats = block(x, after_overflow,
                                               group * per_group + len(stats), step)
      if moe:
        stats.append(layer_stats)
    return x, after_overflow, jax.tree.map(lambda *s: jnp.stack(s), *stats)

  def __call__(self, tokens: jax.Array, step: jax.Array | None = None) -> ModelOutput:
    c = self.config
    embed = hk.Embed(c.vocab_size, c.emb_dim, name="embed", w_init=embedding_init(c.emb_dim))
    x = embed(tokens).astype(jnp.dtype(c.dtype))
    # The remat unit: the whole group, or each of its blocks (the backward then holds one
    # block's activations at a time, and an MoE block's output feeds no recompute but its own).
    unit = functools.partial(rematerialised, policy=REMAT_POLICIES[c.remat_policy])
    as_is = lambda fn: fn
    whole, each = (unit, as_is) if c.remat_unit == "group" else (as_is, unit)
    run_group = whole(lambda x_, after, index: self._group(x_, after, index, step, each))
    def group(carry, index):
      x_, after, stats = run_group(*carry, index)
      return (x_, after), stats
    num_groups = c.num_layers // layer_period(c)
    after = jnp.zeros((), bool) if self.moe_config.step_fallback else None
    (x, _), stats = hk.layer_stack(num_groups, with_per_layer_inputs=True,
                                   unroll=min(c.layer_scan_unroll, num_groups), name="groups")(
        group)((x, after), jnp.arange(num_groups, dtype=jnp.int32))
    # [groups, m, ...] -> [MoE blocks, ...], in the order of the layers. The leading size is
    # spelled out: a field the run does not record is empty (traffic without
    # `record_traffic`: `[groups, m, 0, E]`), and -1 cannot be inferred from zero elements.
    stats = jax.tree.map(lambda s: s.reshape(s.shape[0] * s.shape[1], *s.shape[2:]), stats)
    if step is not None and self.emit_fallback_events:
      moe_hk.events.emit_stacked_fallback_events(stats, step=jnp.asarray(step, jnp.int32),
                                                 process=jax.process_index())
    output = embed.embeddings if c.tie_embeddings else hk.get_parameter(
        "unembed", (c.vocab_size, c.emb_dim), jnp.float32,
        init=embedding_init(c.emb_dim))
    return ModelOutput(rms_norm(x, "final_norm", c.norm_eps), output, stats)


def embedding_init(width: int) -> hk.initializers.Initializer:
  """The token embedding's and the untied output projection's initialiser: a normal of
  scale 1/(2 sqrt(`width`)) cut at two scales (Haiku's TruncatedNormal does not rescale: its
  deviation is 0.88 x the scale), so that a fresh model's first loss is about ln(vocab_size) +
  0.1 at any width. The logits `hidden . e_v` are not scaled; with unit-RMS hidden states an
  output embedding of deviation s gives logits of deviation s x sqrt(D), here 0.44 (the
  expected loss over ln(V) is half their variance, 0.097), and the input token's own logit
  (tied) stays small. An embedding of standard deviation 1 with logits divided by sqrt(D)
  gave the input token a logit near sqrt(D): 27 nats at step 0 at width 2048, vocabulary
  32768; 1/sqrt(D) with that divisor started right but learned the default job several times
  slower (its logits could not grow)."""
  return hk.initializers.TruncatedNormal(0.5 / math.sqrt(width))


def parameter_counts(params: hk.Params) -> tuple[int, int]:
  """(all parameters, the routed experts' of them) in `params` (arrays or shapes): the routed
  experts' are the MoE blocks' `wi_0`, `wi_1` and `wo`."""
  total = routed = 0
  for module, leaves in params.items():
    for name, leaf in leaves.items():
      size = math.prod(leaf.shape)
      total += size
      routed += size if module.endswith("/moe") and name in ("wi_0", "wi_1", "wo") else 0
  return total, routed


def attention_flops(config: ml_collections.ConfigDict) -> float:
  """Attention's score and value matmuls per step, forward and backward: 12 x layers x heads x
  head_dim x S / 2 per token (causal), which 6 x params x tokens leaves out."""
  tokens = config.data.batch_size * config.data.seq_len
  return (12 * config.num_layers * config.num_heads * config.head_dim *
          config.data.seq_len / 2 * tokens)
