"""launch.model against independent dense references: blocked attention, chunked loss, RMSNorm
and SwiGLU, and the MoE block's shared expert."""
import functools
import math

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_hk
from launch import model as model_lib
from launch.configs import tiny
from tests.tree_close import assert_trees_close, relative_error


def _normal(seed, *shapes):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, shapes)]


def _vjp(fn, args, cotangent):
  """`fn(*args)` and the gradients of `sum(fn(*args) * cotangent)` with respect to each arg
  (compiled)."""
  def run(args_, cotangent_):
    out, pullback = jax.vjp(fn, *args_)
    return out, pullback(cotangent_)
  return jax.jit(run)(args, cotangent)


def reference_attention(q, k, v):
  """Causal grouped-query attention, one head at a time: query head (g, r) of `q [B, S, G, R,
  Dh]` attends with key/value head g of `k, v [B, S, G, Dh]` (repeated R times)."""
  b, s, g, r, dh = q.shape
  queries = q.reshape(b, s, g * r, dh)  # head h = g * R + r
  keys, values = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
  causal = np.tril(np.ones((s, s), bool))  # query i sees keys 0..i
  heads = []
  for h in range(g * r):
    scores = jnp.einsum("bsd,btd->bst", queries[:, :, h], keys[:, :, h]) / math.sqrt(dh)
    scores = jnp.where(causal, scores, -jnp.inf)
    e = jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
    heads.append(jnp.einsum("bst,btd->bsd", e / e.sum(-1, keepdims=True), values[:, :, h]))
  return jnp.stack(heads, axis=2).reshape(q.shape)


@pytest.mark.parametrize("block", [0, 1, 4, 16])
def test_blocked_causal_attention_matches_dense_reference(block):
  """Outputs and gradients of q, k, v; 0 < block < S runs the checkpointed query-block scan."""
  b, s, g, r, dh = 2, 16, 2, 3, 8
  q, k, v, cot = _normal(block, (b, s, g, r, dh), (b, s, g, dh), (b, s, g, dh), (b, s, g, r, dh))
  attention = functools.partial(model_lib.causal_attention, block=block)
  assert ("scan" in str(jax.make_jaxpr(attention)(q, k, v))) == (0 < block < s)
  out, grads = _vjp(attention, (q, k, v), cot)
  out_ref, grads_ref = _vjp(reference_attention, (q, k, v), cot)
  assert_trees_close(out, out_ref, what="attention")
  assert_trees_close(grads, grads_ref, what="d attention / d(q, k, v)")


def test_attention_block_must_divide_the_sequence():
  q, k = _normal(0, (1, 12, 1, 2, 4), (1, 12, 1, 4))
  with pytest.raises(ValueError, match="attention_block=5"):
    model_lib.causal_attention(q, k, k, 5)


def reference_cross_entropy(hidden, embeddings, targets):
  """Mean of -log_softmax(hidden @ E.T / sqrt(D))[target] over every position."""
  logits = jnp.einsum("bsd,vd->bsv", hidden, embeddings) / math.sqrt(hidden.shape[-1])
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


@pytest.mark.parametrize("chunk", [1, 4])
def test_chunked_cross_entropy_matches_whole_sequence_and_reference(chunk):
  """Value and gradients of hidden and the embeddings."""
  b, s, d, vocab = 2, 16, 8, 32
  hidden, embeddings = _normal(chunk, (b, s, d), (vocab, d))
  hidden = 4 * hidden  # confident logits: the loss is far from log(V)
  targets = jax.random.randint(jax.random.key(chunk), (b, s), 0, vocab)
  def value_and_grads(loss):
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, embeddings)
  loss_of = lambda c: lambda h, e: model_lib.cross_entropy(h, e, targets, c)
  chunked, whole = value_and_grads(loss_of(chunk)), value_and_grads(loss_of(0))
  ref = value_and_grads(lambda h, e: reference_cross_entropy(h, e, targets))
  assert "scan" in str(jax.make_jaxpr(loss_of(chunk))(hidden, embeddings))
  assert_trees_close(chunked, whole, what="chunked vs whole sequence")
  assert_trees_close(chunked, ref, what="chunked vs reference")
  assert_trees_close(whole, ref, what="whole sequence vs reference")
  assert abs(float(ref[0]) - math.log(vocab)) > 0.5


def test_rms_norm_and_swiglu_match_formulas():
  """`swiglu(rms_norm(x))` through hk.transform: output and gradients of x and parameters."""
  x, cot = _normal(3, (2, 4, 8), (2, 4, 8))
  block = hk.without_apply_rng(hk.transform(
      lambda x_: model_lib.swiglu(model_lib.rms_norm(x_, "norm"), 16)))
  params = block.init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, params) == {
      "~": {"norm": (8,), "wi_0": (8, 16), "wi_1": (8, 16), "wo": (16, 8)}}
  params = {"~": {**params["~"], "norm": 1 + _normal(4, (8,))[0]}}  # a scale that matters

  def reference(p, x_):
    p = p["~"]
    normed = x_ / jnp.sqrt(jnp.mean(x_ ** 2, axis=-1, keepdims=True) + 1e-6) * p["norm"]
    return (jax.nn.silu(normed @ p["wi_0"]) * (normed @ p["wi_1"])) @ p["wo"]
  out, grads = _vjp(block.apply, (params, x), cot)
  out_ref, grads_ref = _vjp(reference, (params, x), cot)
  assert_trees_close(out, out_ref, what="swiglu(rms_norm(x))")
  assert_trees_close(grads, grads_ref, what="grad")


def _tiny_config(shared_expert: bool):
  c = tiny.get_config()
  c.moe.shared_expert = shared_expert
  c.moe.ragged_buffer_factor = -1.0  # worst-case buffer: no overflow cond, faster to compile
  return c


@pytest.mark.slow
def test_shared_expert_parameters_gradients_and_contribution():
  """The tiny launcher model with `moe.shared_expert`: its parameters exist, get gradients,
  reach the output, and with `wo = 0` leave exactly the model without a shared expert."""
  mesh = moe_hk.make_mesh(data=1, fsdp=1, expert=8)
  def model(config):
    return hk.transform(lambda t: model_lib.Transformer(config, mesh, name="model")(t))
  c = _tiny_config(shared_expert=True)
  shared, plain = model(c), model(_tiny_config(shared_expert=False))
  tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, c.vocab_size)
  params = jax.jit(shared.init)(jax.random.key(1), tokens)
  (scope,) = [name for name in params if name.endswith("/shared_expert")]
  n, d, f = c.num_layers // c.moe_every, c.emb_dim, c.moe.mlp_dim
  assert jax.tree.map(jnp.shape, params[scope]) == {
      "wi_0": (n, d, f), "wi_1": (n, d, f), "wo": (n, f, d)}
  with_shared = lambda **leaves: {**params, scope: {**params[scope], **leaves}}

  def loss(p):
    out = shared.apply(p, None, tokens)
    targets = jnp.roll(tokens, -1, axis=1)
    return model_lib.cross_entropy(out.hidden, out.embeddings, targets), out.hidden
  # One compiled program for every variant of the parameters below.
  run = jax.jit(jax.grad(loss, has_aux=True))
  grads, hidden = run(params)
  for name, g in grads[scope].items():
    assert np.linalg.norm(g) > 0, f"shared expert {name} gets no gradient"
  _, bumped = run(with_shared(wi_1=2 * params[scope]["wi_1"]))
  assert relative_error(bumped, hidden) > 1e-2, "the shared expert does not reach the output"
  # With wo = 0 the shared expert adds exactly 0: the model without it, bit for bit.
  _, zeroed = run(with_shared(wo=jnp.zeros_like(params[scope]["wo"])))
  without = jax.jit(lambda p: plain.apply(p, None, tokens).hidden)(
      {name: leaves for name, leaves in params.items() if name != scope})
  np.testing.assert_array_equal(zeroed, without)
  assert relative_error(hidden, without) > 1e-2
