"""Causal grouped-query attention in three forms: blockwise XLA, splash (TPU Pallas), cuDNN.

Shapes: B batch, S sequence, G key/value heads, R query heads per key/value head, Dh head dim.
Every form takes `q [B, S, G, R, Dh]` and `k, v [B, S, G, Dh]` in the compute dtype, scales
scores by 1/sqrt(Dh), takes the softmax in float32 and returns `[B, S, G, R, Dh]` in q's dtype.
`causal_attention` runs the form `launch.setup.choices.resolve_attention` names for
`config.attention_impl` on the platform.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import Mesh, PartitionSpec as P

from launch.setup.choices import ATTENTION_IMPLS

# Splash tile sizes, tried largest first: the largest that divides S is used for every query
# and key/value tile of the forward, dq and dkv kernels. 512 is MaxText's default for long
# sequences (fewer grid steps, still small in VMEM: a [512, 512] float32 score tile is 1 MiB);
# 128 is the floor, since the kernel computes key/value tiles a multiple of 128 lanes wide.
_SPLASH_BLOCKS = (512, 256, 128)
# The most key/value tiles a sequence may have for the fused backward kernel (whose dq partials,
# one per tile, are each the size of q): `splash_block_sizes`.
_FUSED_DQ_PARTIALS = 4
# The name splash gives its forward's residuals, the output and the log-sum-exp
# (`checkpoint_name`): a remat policy that saves it ('save_matmuls') keeps them for the
# backward kernel instead of running the forward kernel again.
KERNEL_RESIDUALS = "attention_kernel"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str, block: int,
                     mesh: Mesh | None, chunk: int = 0) -> jax.Array:
  """`q [B, S, G, R, Dh]`, `k, v [B, S, G, Dh]` -> `[B, S, G, R, Dh]` with the resolved `impl`.

  `block` is the XLA form's query block (0: one block); `mesh` is where 'splash' runs its
  shard_map (the batch sharded over every mesh axis); `chunk` > 0 lets a query attend only to
  the keys of its own chunk of that many positions (chunks start at multiples of `chunk`:
  Llama 4's chunked attention; 'xla' and 'splash'); a chunk of the whole sequence or more is
  the causal mask, and runs as one. Each form ignores what it does not use.
  """
  if chunk >= q.shape[1]:
    chunk = 0
  if impl == "xla":
    return xla_attention(q, k, v, block, chunk)
  if impl == "splash":
    if mesh is None:
      raise ValueError("attention_impl='splash' runs in shard_map and needs the mesh (got None).")
    return splash_attention(q, k, v, mesh, chunk)
  if impl == "cudnn":
    if chunk:
      raise ValueError(f"attention_chunk_size={chunk}: chunked attention runs in the 'xla' and "
                       "'splash' forms, not 'cudnn'.")
    return cudnn_attention(q, k, v)
  raise ValueError(f"causal_attention(impl={impl!r}): expected a resolved form, one of "
                   f"{ATTENTION_IMPLS[1:]} (see launch.setup.choices.resolve_attention).")


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int, chunk: int = 0
                  ) -> jax.Array:
  """Pure-XLA form: `q [B, S, G, R, Dh]`, `k, v [B, S, G, Dh]` -> like q.

  `block` > 0 computes queries in blocks of that many positions in a checkpointed scan, so
  at most a `[B, G, R, block, S]` score block is live (forward and backward) instead of
  `[B, G, R, S, S]`; `block` = 0 does one block of S. `chunk` > 0: within chunks only.
  """
  seq, head_dim = q.shape[1], q.shape[-1]
  block = block or seq
  if seq % block:
    raise ValueError(f"attention_block={block} must divide the sequence length {seq}.")

  def one_block(q_blk, start):  # [B, block, G, R, Dh], scalar -> [B, block, G, R, Dh]
    scores = jnp.einsum("bsgrd,btgd->bgrst", q_blk, k, preferred_element_type=jnp.float32)
    query_pos = start + jnp.arange(q_blk.shape[1])
    key_pos = jnp.arange(seq)
    causal = query_pos[:, None] >= key_pos[None, :]
    if chunk:
      causal &= query_pos[:, None] // chunk == key_pos[None, :] // chunk
    probs = jax.nn.softmax(jnp.where(causal, scores / math.sqrt(head_dim), -1e30), axis=-1)
    return jnp.einsum("bgrst,btgd->bsgrd", probs.astype(v.dtype), v)

  if block == seq:
    return one_block(q, 0)
  blocks = q.reshape(q.shape[0], seq // block, block, *q.shape[2:]).swapaxes(0, 1)
  starts = jnp.arange(seq // block) * block
  # Recompute each block's scores in the backward rather than saving n [.., block, S] of them.
  body = jax.checkpoint(one_block, policy=jax.checkpoint_policies.nothing_saveable)
  out = jax.lax.scan(lambda c, xs: (c, body(*xs)), None, (blocks, starts))[1]
  return out.swapaxes(0, 1).reshape(q.shape)


def splash_block_sizes(seq: int) -> splash.BlockSizes:
  """Splash tiles for sequence length `seq`: the largest of `_SPLASH_BLOCKS` dividing it.

  The backward is one fused kernel for dq, dk and dv while `seq / block` is at most
  `_FUSED_DQ_PARTIALS`: that kernel writes one dq partial per key/value tile (`[seq / block,
  *q.shape]`, in q's dtype) and sums them after, so its memory grows with the sequence (on a
  v5e chip at S=2048, 4 partials, it took 0.459 s a step of `tpu_chip.py` against 0.469 with
  separate kernels, docs/tpu-chip.md). Longer sequences get the separate dq kernel, which
  accumulates dq in place: Maverick at S=8192 (16 partials) held 8.75 GiB more per v5p chip
  with the fused kernel (docs/aot-memory.md).
  """
  block = next((b for b in _SPLASH_BLOCKS if seq % b == 0), None)
  if block is None:
    raise ValueError(
        f"splash attention needs the sequence length {seq} to be a multiple of "
        f"{_SPLASH_BLOCKS[-1]} (its tiles are {_SPLASH_BLOCKS}).")
  fused = seq // block <= _FUSED_DQ_PARTIALS
  dq_tiles = {} if fused else dict(block_q_dq=block, block_kv_dq=block)
  return splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                           block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                           use_fused_bwd_kernel=fused, **dq_tiles)


def splash_kernel(seq: int, heads: int, interpret: bool, chunk: int = 0
                  ) -> splash.SplashAttentionKernel:
  """The causal MQA splash kernel for `heads` query heads of length `seq` (one key/value
  head), within chunks of `chunk` positions when > 0, in Pallas interpret mode when
  `interpret`.

  Built with every array it holds concrete: the kernel converts its block masks with
  `jnp.array`, which inside a transform (the layer group's remat, the scan over groups)
  stages them into that trace, and a kernel holding another trace's values fails the step
  with an UnexpectedTracerError (its custom_vjp, and ours, close over them).
  """
  mask = splash.MultiHeadMask([_chunked_mask(seq, chunk) if chunk else
                               splash.CausalMask((seq, seq))] * heads)
  with jax.ensure_compile_time_eval():
    return splash.make_splash_mqa_single_device(mask, block_sizes=splash_block_sizes(seq),
                                                interpret=interpret,
                                                residual_checkpoint_name=KERNEL_RESIDUALS)


def _chunked_mask(seq: int, chunk: int) -> splash.NumpyMask:
  """Causal within chunks of `chunk` positions, as a `[S, S]` boolean array (splash in this
  jax has no chunked mask of its own; the kernel keeps only the blocks that hold a key)."""
  position = np.arange(seq)
  return splash.NumpyMask((position[:, None] >= position[None, :]) &
                          (position[:, None] // chunk == position[None, :] // chunk))


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mesh: Mesh, chunk: int = 0
                     ) -> jax.Array:
  """Splash form: `q [B, S, G, R, Dh]`, `k, v [B, S, G, Dh]` -> like q, B sharded over `mesh`.

  Runs in shard_map because Mosaic kernels cannot be partitioned automatically (and so that
  TPU programs AOT-compile from a CPU host). Each shard runs one MQA kernel per example and
  key/value head: `[R, S, Dh]` queries against `[S, Dh]` keys and values. On a mesh of
  other devices than TPUs the kernel runs in Pallas interpret mode (the tests' CPU meshes).
  """
  seq, _, per_group, head_dim = q.shape[1:]
  kernel = splash_kernel(seq, per_group, interpret=mesh.devices.flat[0].platform != "tpu",
                         chunk=chunk)
  # The kernel does not scale scores. Scaling q (in its dtype) touches [.., S, Dh], not the
  # [.., S, S] scores the XLA form scales in float32.
  q = q / math.sqrt(head_dim)
  kernels = _at_default_precision(jax.vmap(jax.vmap(kernel)))  # over examples, kv heads

  def shard_fn(q_local, k_local, v_local):
    heads = jnp.transpose(q_local, (0, 2, 3, 1, 4))        # [b, G, R, S, Dh]
    keys = jnp.transpose(k_local, (0, 2, 1, 3))            # [b, G, S, Dh]
    values = jnp.transpose(v_local, (0, 2, 1, 3))          # [b, G, S, Dh]
    out = kernels(heads, keys, values)                     # [b, G, R, S, Dh]
    return jnp.transpose(out, (0, 3, 1, 2, 4))             # [b, S, G, R, Dh]

  batch = P(tuple(mesh.axis_names))
  # check_vma=False: the kernel's pallas_call declares its outputs without varying-axes types.
  # Nothing here crosses shards, so the batch-sharded out_specs is right as stated.
  return jax.shard_map(shard_fn, mesh=mesh, in_specs=(batch, batch, batch), out_specs=batch,
                       check_vma=False)(q, k, v)


def _at_default_precision(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """`fn` with its forward and backward traced at the default matmul precision.

  The splash kernels' dots leave precision to `jax_default_matmul_precision`, and Mosaic
  refuses 'highest' for bf16 operands ("Bad lhs type") and 'high' outright; the test suite
  sets 'highest'. A custom_vjp because autodiff traces the kernels' backward after `fn` has
  returned, outside any context entered around the call.
  """
  @jax.custom_vjp
  def pinned(*args):
    with jax.default_matmul_precision("default"):
      return fn(*args)

  def forward(*args):
    with jax.default_matmul_precision("default"):
      return jax.vjp(fn, *args)  # (out, pullback): the pullback holds the residuals.

  def backward(pullback, cotangent):
    with jax.default_matmul_precision("default"):
      return pullback(cotangent)

  pinned.defvjp(forward, backward)
  return pinned


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """cuDNN form: `q [B, S, G, R, Dh]`, `k, v [B, S, G, Dh]` -> like q (GPU; bf16 or fp16).

  `jax.nn.dot_product_attention` takes grouped heads directly: query head h = g * R + r
  attends with key/value head g. It does not trace without cuDNN (so not on a CPU host).
  """
  b, s, g, r, dh = q.shape
  out = jax.nn.dot_product_attention(q.reshape(b, s, g * r, dh), k, v, is_causal=True,
                                     implementation="cudnn")
  return out.reshape(q.shape)
