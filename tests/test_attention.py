"""launch.model.attention: the XLA and splash forms against a dense reference (outputs and
gradients), the splash form compiled for a v5p topology, and the choice of form per platform
(the splash form in the model under every remat policy: tests/test_model.py).

The cuDNN form is not tested here: `jax.nn.dot_product_attention(implementation='cudnn')` does
not even trace without cuDNN ("cuDNN is not detected"), and this suite runs on CPU devices.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import moe_hk
from launch.compiling import topology
from launch.model import attention
from launch.setup import choices
from moe_hk import mesh as mesh_lib
from tests.helpers import require_libtpu
from tests.tree_close import assert_trees_close


def _inputs(seed: int, b: int, s: int, g: int, r: int, dh: int) -> list[np.ndarray]:
  """Standard normal float32 q [B, S, G, R, Dh], k, v [B, S, G, Dh] and a cotangent like q
  (numpy: nothing to compile before the code under test)."""
  rng = np.random.default_rng(seed)
  shapes = [(b, s, g, r, dh), (b, s, g, dh), (b, s, g, dh), (b, s, g, r, dh)]
  return [rng.standard_normal(shape, np.float32) for shape in shapes]


def _value_and_vjp(fn, q, k, v, cotangent):
  """`fn(q, k, v)` and the gradients of `sum(fn(q, k, v) * cotangent)` wrt q, k, v (compiled)."""
  def run(q_, k_, v_, cotangent_):
    out, pullback = jax.vjp(fn, q_, k_, v_)
    return out, pullback(cotangent_)
  return jax.jit(run)(q, k, v, cotangent)


def reference_attention(q, k, v, chunk: int = 0):
  """Dense causal GQA in one einsum: query head (g, r) of `q [B, S, G, R, Dh]` attends with
  key/value head g of `k, v [B, S, G, Dh]`, repeated R times; `chunk` > 0: only to the keys of
  its own chunk (positions c x chunk .. (c + 1) x chunk - 1)."""
  b, s, g, r, dh = q.shape
  queries = q.reshape(b, s, g * r, dh)  # head h = g * R + r
  keys, values = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
  scores = jnp.einsum("bshd,bthd->bhst", queries, keys) / math.sqrt(dh)
  causal = np.tril(np.ones((s, s), bool))  # query i sees keys 0..i
  if chunk:
    chunks = np.arange(s) // chunk
    causal &= chunks[:, None] == chunks[None, :]
  probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  return jnp.einsum("bhst,bthd->bshd", probs, values).reshape(q.shape)


def _assert_matches_reference(fn, inputs, what: str, chunk: int = 0) -> None:
  out, grads = _value_and_vjp(fn, *inputs)
  ref_out, ref_grads = _value_and_vjp(lambda q, k, v: reference_attention(q, k, v, chunk),
                                      *inputs)
  assert out.dtype == jnp.float32
  assert_trees_close(out, ref_out, rtol=1e-5, what=what)
  assert_trees_close(grads, ref_grads, rtol=1e-5, what=f"d {what} / d(q, k, v)")


@pytest.mark.parametrize("block", [0, 4, 16])
def test_xla_form_matches_dense_reference(block):
  """0 < block < S runs the checkpointed query-block scan; 0 and S compute one block."""
  inputs = _inputs(block, 2, 16, 2, 3, 8)

  def fn(q, k, v):
    return attention.causal_attention(q, k, v, impl="xla", block=block, mesh=None)
  assert ("scan" in str(jax.make_jaxpr(fn)(*inputs[:3]))) == (0 < block < 16)
  _assert_matches_reference(fn, inputs, f"xla attention (block {block})")


@pytest.mark.parametrize("block", [0, 4])
def test_xla_form_attends_within_chunks(block):
  """Chunks of 6 positions in a sequence of 16 (the last one short), whole or in query blocks
  that straddle chunks; the causal reference without chunks is far off."""
  inputs = _inputs(block + 1, 2, 16, 2, 3, 8)

  def fn(q, k, v):
    return attention.causal_attention(q, k, v, impl="xla", block=block, mesh=None, chunk=6)
  _assert_matches_reference(fn, inputs, f"chunked xla attention (block {block})", chunk=6)
  assert not np.allclose(jax.jit(fn)(*inputs[:3]), reference_attention(*inputs[:3]), atol=1e-2)


def test_a_chunk_of_the_whole_sequence_is_the_causal_mask():
  """Maverick's chunks of 8192 at seq_len 8192: no chunk mask is built, the program is the
  causal one's; a shorter chunk's is not."""
  q, k, v, _ = _inputs(5, 1, 16, 2, 3, 8)

  def program(chunk):
    return str(jax.make_jaxpr(lambda q, k, v: attention.causal_attention(
        q, k, v, impl="xla", block=0, mesh=None, chunk=chunk))(q, k, v))
  assert program(16) == program(32) == program(0) != program(8)

def test_splash_form_attends_within_chunks_in_interpret_mode():
  """Chunks of 192 positions over 128-wide tiles: a chunk boundary crosses a tile."""
  mesh = moe_hk.make_mesh(data=2, expert=4)

  def fn(q, k, v):
    return attention.splash_attention(q, k, v, mesh, chunk=192)
  _assert_matches_reference(fn, _inputs(1, 8, 384, 2, 2, 32), "chunked splash attention",
                            chunk=192)


def test_splash_form_in_interpret_mode_matches_dense_reference():
  """Pallas interpret mode runs the TPU kernels (forward, dq, dkv) on the CPU devices: one
  example per shard of a (data 2, expert 4) mesh, S = 384 in 128-wide tiles, so tiles above
  the diagonal are skipped, those on it masked and those below it computed whole."""
  mesh = moe_hk.make_mesh(data=2, expert=4)
  assert attention.splash_block_sizes(384).block_q == 128

  def fn(q, k, v):
    return attention.splash_attention(q, k, v, mesh)
  _assert_matches_reference(fn, _inputs(0, 8, 384, 2, 2, 32), "splash attention")


@pytest.mark.parametrize("s", [256, 4096])
def test_splash_form_compiles_for_v5p(s, monkeypatch):
  """Value and grad of bf16 splash attention, batch sharded over a 4-chip v5p mesh, under the
  suite's 'highest' default matmul precision (which Mosaic refuses unless the form pins it).
  At S=256 (2 key/value tiles) the backward is one fused kernel; at S=4096 (8 tiles) it is
  the dq and dkv kernels, and the step holds less than with the fused kernel's dq partials."""
  require_libtpu()
  mesh = moe_hk.make_mesh(data=2, expert=2, devices=topology.tpu_topology_devices("v5p:2x2x1"))
  sharding = NamedSharding(mesh, mesh_lib.batch_spec(mesh))
  b, g, r, dh = 4, 2, 2, 128
  q = jax.ShapeDtypeStruct((b, s, g, r, dh), jnp.bfloat16, sharding=sharding)
  kv = jax.ShapeDtypeStruct((b, s, g, dh), jnp.bfloat16, sharding=sharding)

  def loss(q_, k_, v_):
    out = attention.causal_attention(q_, k_, v_, impl="splash", block=0, mesh=mesh)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  def compile_step():
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
  program = compile_step()
  # One Mosaic call for the forward, and the backward's (vmap batches each into one).
  fused = attention.splash_block_sizes(s).use_fused_bwd_kernel
  assert fused == (s == 256)
  assert program.as_text().count('custom_call_target="tpu_custom_call"') == (2 if fused else 3)
  temp = program.memory_analysis().temp_size_in_bytes
  assert temp > 0
  if not fused:
    chosen = attention.splash_block_sizes
    monkeypatch.setattr(attention, "splash_block_sizes", lambda seq: dataclasses.replace(
        chosen(seq), use_fused_bwd_kernel=True, block_q_dq=None, block_kv_dq=None))
    partials = compile_step().memory_analysis().temp_size_in_bytes
    assert temp < partials, (temp, partials)


@pytest.mark.parametrize("seq,block,fused", [(8192, 512, False), (2048, 512, True),
                                             (2560, 512, False), (768, 256, True),
                                             (384, 128, True), (128, 128, True)])
def test_splash_tiles_are_the_largest_that_divide_the_sequence(seq, block, fused):
  """The largest tile that divides S, every kernel's; the fused backward (no dq tiles of its
  own) up to 4 key/value tiles, then the separate dq kernel."""
  sizes = dataclasses.asdict(attention.splash_block_sizes(seq))
  tiles = {name: value for name, value in sizes.items()
           if name.startswith("block_") and value is not None}
  assert sizes["use_fused_bwd_kernel"] == fused, sizes
  assert set(tiles.values()) == {block} and len(tiles) == (6 if fused else 8), tiles


def test_splash_needs_a_sequence_multiple_of_128():
  with pytest.raises(ValueError, match="sequence length 200 to be a multiple of 128"):
    attention.splash_block_sizes(200)


@pytest.mark.parametrize("impl,platform,form", [
    ("auto", "tpu", "splash"), ("auto", "gpu", "cudnn"), ("auto", "cuda", "cudnn"),
    ("auto", "cpu", "xla"), ("xla", "tpu", "xla"), ("xla", "cpu", "xla"),
    ("splash", "tpu", "splash"), ("cudnn", "gpu", "cudnn"), ("cudnn", "cuda", "cudnn"),
])
def test_resolve_impl(impl, platform, form):
  assert choices.resolve_attention(impl, platform) == form


@pytest.mark.parametrize("impl,platform,valid", [
    ("flash", "tpu", attention.ATTENTION_IMPLS),
    ("splash", "cpu", ("auto", "xla")),
    ("splash", "gpu", ("auto", "xla", "cudnn")),
    ("cudnn", "tpu", ("auto", "xla", "splash")),
    ("cudnn", "cpu", ("auto", "xla")),
])
def test_resolve_impl_names_the_value_and_the_valid_choices(impl, platform, valid):
  with pytest.raises(ValueError) as error:
    choices.resolve_attention(impl, platform)
  message = str(error.value)
  assert message.startswith(f"config.attention_impl={impl!r}"), message
  assert str(valid) in message, message


def test_xla_block_must_divide_the_sequence():
  q, k, v, _ = _inputs(0, 1, 12, 1, 2, 4)
  with pytest.raises(ValueError, match="attention_block=5 must divide the sequence length 12"):
    attention.causal_attention(q, k, v, impl="xla", block=5, mesh=None)


@pytest.mark.parametrize("impl,chunk,message", [
    ("splash", 0, "needs the mesh"), ("auto", 0, "expected a resolved form"),
    ("cudnn", 64, r"attention_chunk_size=64: chunked attention runs in the 'xla' and 'splash'")])
def test_causal_attention_refuses_what_it_cannot_run(impl, chunk, message):
  q, k, v, _ = _inputs(0, 1, 128, 1, 2, 4)
  with pytest.raises(ValueError, match=message):
    attention.causal_attention(q, k, v, impl=impl, block=0, mesh=None, chunk=chunk)
