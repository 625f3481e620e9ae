"""launch.model.transformer against independent dense references: chunked loss, RMSNorm and SwiGLU,
the MoE block's shared expert, and the remat policies and units (attention:
tests/test_attention.py)."""
import math
import os

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

import moe_hk
from launch.model import loss as loss_lib, transformer as model_lib
from launch.model.train_step import make_steps
from launch.setup import choices, settings as settings_lib
from tests.helpers import settings_of, tiny_config
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


def reference_cross_entropy(hidden, embeddings, targets):
  """Mean of -log_softmax(hidden @ E.T)[target] over every position."""
  logits = jnp.einsum("bsd,vd->bsv", hidden, embeddings)
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
  loss_of = lambda c: lambda h, e: loss_lib.cross_entropy(h, e, targets, c)
  chunked, whole = value_and_grads(loss_of(chunk)), value_and_grads(loss_of(0))
  ref = value_and_grads(lambda h, e: reference_cross_entropy(h, e, targets))
  assert "scan" in str(jax.make_jaxpr(loss_of(chunk))(hidden, embeddings))
  # The gradient is made where the logits are: three matmuls a chunk (logits, then the
  # gradients of hidden and of the embeddings), none run again in the backward.
  grad_jaxpr = str(jax.make_jaxpr(jax.grad(loss_of(chunk), argnums=(0, 1)))(hidden, embeddings))
  assert grad_jaxpr.count("dot_general[") == 3, grad_jaxpr
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
  c = tiny_config()
  c.shared_expert = shared_expert
  c.moe.ragged_buffer_factor = -1.0  # worst-case buffer: no overflow cond, faster to compile
  return c


@pytest.mark.slow
def test_shared_expert_parameters_gradients_and_contribution():
  """The tiny launcher model with `shared_expert`: its parameters exist, get gradients,
  reach the output, and with `wo = 0` leave exactly the model without a shared expert."""
  mesh = moe_hk.make_mesh(data=1, fsdp=1, expert=8)
  def model(config):
    layer = settings_of(config).layer
    return hk.transform(lambda t: model_lib.Transformer(config, layer, mesh, name="model")(t))
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
    return loss_lib.cross_entropy(out.hidden, out.embeddings, targets), out.hidden
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


@pytest.mark.slow
def test_every_remat_policy_computes_the_same_step_with_splash_and_keeps_fallback_events(
    monkeypatch):
  """Loss and gradients under every `remat_policy`, attention by the splash kernel (Pallas
  interpret mode on the CPU mesh) in the rematerialised, scanned layer groups, equal the XLA
  form's without remat, on a batch whose MoE layers overflow and fall back. Under each policy
  every layer that fell back reaches the host as one fallback event (the trainer's alerts come
  from them) with the step's stats: the model sends them after its layer stack, so the
  backward's recomputation of a rematerialised group does not send them again. A splash
  kernel built inside the group's trace failed this with an UnexpectedTracerError."""
  monkeypatch.setitem(choices._RUNS_ON, "splash", ("tpu", "cpu"))  # interpret mode here
  mesh = moe_hk.make_mesh(data=1, fsdp=1, expert=8)
  tokens = jax.random.randint(jax.random.key(0), (8, 128), 0, 256)  # one 128-wide splash tile
  received = []

  def value_and_grad(impl: str, policy: str, params=None):
    c = tiny_config(attention_impl=impl, remat_policy=policy)
    c.data.seq_len = tokens.shape[1]
    layer = settings_of(c).layer
    net = hk.transform(lambda t, s: model_lib.Transformer(c, layer, mesh, name="model")(t, s))
    if params is None:  # the policy and the attention form change no parameter
      params = jax.jit(net.init)(jax.random.key(1), tokens, None)
    def loss(p):
      out = net.apply(p, None, tokens, jnp.int32(7))
      ce = loss_lib.cross_entropy(out.hidden, out.embeddings, jnp.roll(tokens, -1, axis=1))
      return ce, out.moe_stats
    (value, stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    jax.effects_barrier()
    return params, value, stats, grads

  moe_hk.events.add_sink(received.append)
  try:
    params, expected, _, expected_grads = value_and_grad("xla", "none")
    for policy in model_lib.REMAT_POLICIES:
      received.clear()
      _, value, stats, grads = value_and_grad("splash", policy, params)
      assert int(jnp.max(stats.fallback)) == 1, f"{policy}: the batch must overflow"
      fell_back = [e for e in received if e.name == moe_hk.events.FALLBACK_EVENT]
      assert sorted(e.layer for e in fell_back) == list(np.flatnonzero(stats.fallback)), policy
      for e in fell_back:
        assert e.step == 7 and e.process == 0
        for name, field in zip(moe_hk.MoEStats._fields, e.stats):
          np.testing.assert_allclose(field, np.asarray(getattr(stats, name))[e.layer],
                                     rtol=1e-6, err_msg=f"{policy}: {name}")
      np.testing.assert_allclose(value, expected, rtol=1e-5, err_msg=policy)
      assert_trees_close(grads, expected_grads, what=f"splash, remat_policy={policy!r}")
  finally:
    moe_hk.events.remove_sink(received.append)


@pytest.fixture(scope="module")
def llama4_pattern():
  """Maverick's pattern (every 2nd block MoE, every 4th without RoPE) in 8 layers of the tiny
  model, in 'step' fallback mode: its config, settings, a batch and the parameters, which
  every remat unit shares."""
  mesh = moe_hk.make_mesh(data=1, fsdp=1, expert=8)
  tokens = jax.random.randint(jax.random.key(0), (8, 32), 0, 256)
  c = tiny_config(num_layers=8, moe_every=2, nope_every=4, attention_chunk_size=8,
                  rope_layout="interleaved", qk_l2_norm=True, attn_temperature_tuning=True,
                  floor_scale=4.0)
  c.moe.moe_dropless_fallback = "step"
  settings = settings_of(c)
  params = jax.jit(_transformer(c, settings.layer, mesh).init)(jax.random.key(1), tokens, None)
  return c, settings, mesh, tokens, params


def _transformer(c, layer, mesh):
  """The launcher's model of config `c`: `(tokens [B, S], step) -> ModelOutput`."""
  return hk.transform(lambda t, s: model_lib.Transformer(c, layer, mesh, name="model")(t, s))


def test_llama4_layer_pattern_groups_its_blocks_and_labels_every_moe_layer(llama4_pattern):
  """Maverick's pattern in 8 layers: 2 groups of 4 blocks, MoE in the 2nd and 4th; the 4 MoE
  layers' stats in layer order, each fallback event labelled with its layer; in step mode the
  flag crosses the blocks of a group, so every MoE layer from the first that overflowed on
  runs dropless."""
  c, settings, mesh, tokens, params = llama4_pattern
  assert model_lib.block_kinds(c) == [(False, True), (True, True), (False, True), (True, False)]
  net = _transformer(c, settings.layer, mesh)
  group = "model/groups/model/~_group/"
  assert {m for m in params if m.startswith(group) and m.endswith("/moe")} == {
      group + "block_1/moe", group + "block_3/moe"}
  assert params[group + "block_1/moe"]["wi_0"].shape[0] == 2  # the layer stack: 2 groups
  received = []
  moe_hk.events.add_sink(received.append)
  try:
    stats = jax.jit(lambda p: net.apply(p, None, tokens, jnp.int32(3)).moe_stats)(params)
    jax.effects_barrier()
  finally:
    moe_hk.events.remove_sink(received.append)
  assert stats.fallback.shape == (4,) == (settings.moe_layers,)
  overflowed = np.asarray(stats.would_drop_rows) > 0
  assert overflowed.any(), "the batch must overflow a layer"
  first = int(np.argmax(overflowed))
  np.testing.assert_array_equal(stats.fallback, np.arange(4) >= first)
  fell_back = [e for e in received if e.name == moe_hk.events.FALLBACK_EVENT]
  assert sorted(e.layer for e in fell_back) == list(range(first, 4))
  for e in fell_back:
    np.testing.assert_allclose(e.stats.required_factor, stats.required_factor[e.layer])


def _count_equations(jaxpr, primitive) -> int:
  """Equations of `primitive` (a primitive or its name) in `jaxpr` and in every jaxpr nested
  in its equations."""
  name = getattr(primitive, "name", primitive)
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = sub.jaxpr if isinstance(sub, jax_core.ClosedJaxpr) else sub
        if isinstance(sub, jax_core.Jaxpr):
          count += _count_equations(sub, primitive)
  return count


@pytest.mark.slow
def test_a_remat_unit_per_block_computes_the_groups_step(llama4_pattern):
  """`remat_unit='block'` makes each block of a layer group its own remat unit: its program
  holds `layer_period - 1` more remat units than `'group'`'s (3 with 4 blocks; a model that
  ignored the key would hold as many), and its step is the group's: the loss, every gradient
  and the MoE stats, float32 within 1e-5. On Maverick's pattern in 'step' mode, where the
  overflow flag crosses the block units, on a batch that overflows, under the policy that
  moves each unit's input to the host ('full_inputs_on_host'). The block unit's run unrolls
  the scan over the 2 groups (`layer_scan_unroll`), which must not change the step either."""
  c, _, mesh, tokens, params = llama4_pattern
  # A remat unit's primitive, as this jax names it.
  remat = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive
  remat_units, steps = {}, {}
  for unit in choices.REMAT_UNITS:
    config = c.copy_and_resolve_references()
    config.update(remat_unit=unit, remat_policy="full_inputs_on_host",
                  layer_scan_unroll=2 if unit == "block" else 1)
    net = _transformer(config, settings_of(config).layer, mesh)
    def loss(p, net=net):
      out = net.apply(p, None, tokens, None)
      ce = loss_lib.cross_entropy(out.hidden, out.embeddings, jnp.roll(tokens, -1, axis=1))
      return ce, out.moe_stats
    remat_units[unit] = _count_equations(jax.make_jaxpr(loss)(params).jaxpr, remat)
    steps[unit] = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  assert remat_units["block"] - remat_units["group"] == model_lib.layer_period(c) - 1 == 3, (
      remat_units)
  ((block_loss, block_stats), block_grads), ((loss, stats), grads) = (
      steps["block"], steps["group"])
  assert int(jnp.max(stats.fallback)) == 1, "the batch must overflow"
  np.testing.assert_allclose(block_loss, loss, rtol=1e-5)
  assert_trees_close(block_grads, grads, what="block unit vs group unit")
  for name, block_field, field in zip(stats._fields, block_stats, stats):
    np.testing.assert_allclose(block_field, field, rtol=1e-5, err_msg=name)


def test_save_matmuls_runs_no_matmul_or_attention_kernel_again(monkeypatch):
  """`remat_policy='save_matmuls'` keeps what 'save_dots' keeps (the projections) and the
  experts' three grouped matmuls and splash's forward residuals: the gradient's program holds
  3 fewer grouped matmuls per MoE block and one fewer splash kernel per block than under
  'save_dots' (whose backward runs those again), and as many as with no remat at all.
  Counted in the traced program, not compiled: `ragged_dot_general` (the 'ragged_dot'
  backend) and `pallas_call` (splash, interpreted on the CPU mesh). `layer_scan_unroll`
  reaches the scan over groups."""
  monkeypatch.setitem(choices._RUNS_ON, "splash", ("tpu", "cpu"))  # interpret mode here
  mesh = moe_hk.make_mesh(data=1, fsdp=1, expert=8)
  tokens = jax.random.randint(jax.random.key(0), (8, 128), 0, 256)  # one 128-wide splash tile
  counts = {}
  for policy in ("none", "save_dots", "save_matmuls"):
    c = tiny_config(attention_impl="splash", remat_policy=policy, num_layers=4,
                    layer_scan_unroll=2)
    c.moe.update(gmm_impl="ragged_dot", moe_dropless_fallback="none")
    net = _transformer(c, settings_of(c).layer, mesh)
    params = jax.eval_shape(net.init, jax.random.key(1), tokens, None)
    def loss(p, net=net):
      out = net.apply(p, None, tokens, None)
      return loss_lib.cross_entropy(out.hidden, out.embeddings, jnp.roll(tokens, -1, axis=1))
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    counts[policy] = {name: _count_equations(jaxpr, name)
                      for name in ("ragged_dot_general", "pallas_call")}
    groups = [e.params["unroll"] for e in jaxpr.eqns
              if e.primitive.name == "scan" and e.params["length"] == 2]
    assert groups == [2, 2], groups  # the scan over the 2 groups, forward and backward
  # Per group (the scan's body, traced once): 2 blocks, one of them MoE.
  assert counts["save_dots"]["ragged_dot_general"] - counts["save_matmuls"][
      "ragged_dot_general"] == 3, counts
  assert counts["save_dots"]["pallas_call"] - counts["save_matmuls"]["pallas_call"] == 2, counts
  assert counts["save_matmuls"] == counts["none"], counts


def test_a_layer_pattern_that_does_not_fit_the_layers_is_refused():
  c = tiny_config(num_layers=6, moe_every=2, nope_every=4)
  with pytest.raises(settings_lib.UserError, match=r"config.num_layers=6 must be a multiple of "
                     r"4, the period of the layer pattern \(moe_every=2, nope_every=4\)"):
    settings_of(c)


# A fresh model's logits `h . e_v` (`model_lib.embedding_init`): unit-RMS hidden states, the
# embedding drawn by haiku's TruncatedNormal(0.5 / sqrt(D)), which is 0.5 / sqrt(D) times a
# standard normal cut at +-2 (not rescaled: variance 1 - 4 phi(2) / erf(sqrt 2) = 0.774), so
# logits of variance 0.25 x 0.774. Their mean exp is exp(variance / 2) and the target's logit
# is 0 on average: the first loss is ln(V) + variance / 2 = ln(V) + 0.097 (less
# (e^variance - 1) / 2V, 0.0004 at V = 256). The batch's mean target logit varies: over its
# 8 x 32 positions, std sqrt(variance / 256) = 0.027; the band is 3 of those. Measured over 8
# seeds of each case below: + 0.091 to 0.101 on average, std 0.021 to 0.035 per seed.
_LOGIT_VARIANCE = 0.25 * (1 - 4 * math.exp(-2) / math.sqrt(2 * math.pi) / math.erf(math.sqrt(2)))
_FIRST_EXCESS = _LOGIT_VARIANCE / 2
_FIRST_BAND = 3 * math.sqrt(_LOGIT_VARIANCE / (8 * 32))


@pytest.mark.parametrize("name,tied", [("tiny", True), ("demo", True), ("default", True),
                                       ("tpu_chip", True), ("maverick", True),
                                       ("tpu_chip", False)])
def test_a_fresh_models_first_loss_is_ln_vocabulary(name, tied):
  """Step 0's loss is ln(vocab_size) + 0.097 within 0.082 (above: the embedding's initial
  scale) for every shipped config at its own width (32 to 5120; the tied embedding's own-token
  logit once made it 27 nats at 2048; an embedding 1/sqrt(width) too narrow starts at ln V
  plus nothing) and untied. Each is cut to one layer group (Maverick's: 2 dense and 2 MoE
  blocks, one without RoPE) of two heads and 8 narrow experts on the 8 CPU devices and a
  vocabulary of at most 4096 (the rule is about the width; drawing and applying Maverick's
  embedding at 32768 x 5120 took 18 s more of the CPU); embedding, output and norms as shipped."""
  config = settings_lib.load(os.path.join(settings_lib.CONFIGS, f"{name}.py"))
  config.update(num_layers=model_lib.layer_period(config), mlp_dim=64,
                vocab_size=min(config.vocab_size, 4096),
                tie_embeddings=tied, attention_impl="xla", attention_block=0, loss_chunk=0,
                remat_policy="none", num_heads=2, num_kv_heads=1)
  config.mesh.update(data=1, fsdp=1, expert=8)
  config.moe.update(num_experts=8, mlp_dim=64, gmm_impl="ragged_dot",
                    dropless_fallback_num_chunks=0)
  config.data.update(batch_size=8, seq_len=32)
  steps = make_steps(settings_of(config), moe_hk.make_mesh(**config.mesh))
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (8, 33), np.int32)
  loss = float(steps.eval_loss(steps.init(jax.random.key(0)).params, tokens))
  excess = loss - math.log(config.vocab_size)
  assert abs(excess - _FIRST_EXCESS) <= _FIRST_BAND, (
      f"{name} (emb_dim {config.emb_dim}, tied {tied}): first loss {loss:.4f} = "
      f"ln({config.vocab_size}) + {excess:.4f}, not + {_FIRST_EXCESS:.4f} within "
      f"{_FIRST_BAND:.4f}")
