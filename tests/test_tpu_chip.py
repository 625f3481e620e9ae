"""On a real TPU chip (`make test-tpu`): the kernels through the train step, the fallback's
exactness, and the device's memory figures. Everywhere else these skip; their CPU twins are
tests/test_attention.py (splash in interpret mode through the train step),
tests/test_grouped_matmul.py (megablox interpreted), tests/test_fallback.py (the fallback
against the dense reference) and benchmarks/chip_step.py's own CPU run.

Tolerances: the layer comparison runs at 'highest' matmul precision (tests/conftest.py), so
float32 as on CPU (1e-5). The train step's comparison is against the XLA forms on the same
chip: the splash kernels compute at the default TPU precision (bfloat16 passes; Mosaic
refuses 'highest' for them), so its loss and gradients agree leaf by leaf to bfloat16's 2e-2.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_hk
from benchmarks import chip_step
from launch.model import attention as attention_lib, train_step as steps_lib
from launch.model.train_step import make_steps
from tests.helpers import settings_of, tiny_config
from tests.moe_inputs import outputs_and_grads, reference_outputs_and_grads, skewed_inputs
from tests.tree_close import TOLERANCE, assert_trees_close, relative_error

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(jax.devices()[0].platform != "tpu",
                       reason="needs a TPU chip: `make test-tpu` on a TPU host"),
]


def _chip_config(attention: str, gmm: str):
  """The tiny config in `attention` and `gmm`'s forms on the chip (one expert shard), 128
  positions (one splash tile), every token routed to every expert (top-k = E: the gradients
  then follow the routing smoothly, where bfloat16 noise would move a top-2 token to another
  expert)."""
  config = tiny_config(attention_impl=attention)
  config.data.seq_len = 128
  config.mesh.update(data=1, fsdp=1, expert=jax.device_count())
  config.moe.update(gmm_impl=gmm, num_experts_per_tok=config.moe.num_experts)
  return config


def _loss_and_gradients(config, params, batch):
  """The launcher's training loss (`steps.loss_fn`) of `config`'s model at `params` on
  `batch`, and its gradients."""
  settings = settings_of(config)
  model = steps_lib._transformed(settings, moe_hk.make_mesh(**config.mesh))
  loss = lambda p: steps_lib.loss_fn(model, config, p, batch, jnp.zeros((), jnp.int32))[0]
  return jax.device_get(jax.jit(jax.value_and_grad(loss))(params))


def test_train_step_with_splash_and_megablox_matches_the_xla_forms(monkeypatch):
  """The launcher's loss and gradients with the TPU kernels (splash attention, megablox
  experts) against the XLA forms' (attention, ragged_dot), from the same parameters and
  batch, leaf by leaf within bfloat16's 2e-2 (module docstring). Measured on CPU with the
  XLA forms: the attention's inputs rounded to bfloat16 moved each leaf by at most 0.6%, the
  whole model computing in bfloat16 by 2.2% (with top-2 routing, the rounded attention moved
  a leaf by 8%). Control: splash with its queries scaled by 1.05, a softmax temperature 5%
  off, fails the comparison (on CPU the XLA form so wrong moved a leaf by 9.7%, its loss by
  6e-5 and its gradient norm by 1.1e-2)."""
  batch = np.random.default_rng(0).integers(0, 256, (8, 129), np.int32)
  xla, kernels = _chip_config("xla", "ragged_dot"), _chip_config("splash", "megablox")
  params = make_steps(settings_of(xla), moe_hk.make_mesh(**xla.mesh)).init(
      jax.random.key(0)).params
  expected = _loss_and_gradients(xla, params, batch)
  bf16 = TOLERANCE[np.dtype("bfloat16")]
  assert_trees_close(_loss_and_gradients(kernels, params, batch), expected, rtol=bf16,
                     what="(loss, gradients): splash + megablox vs XLA")
  causal = attention_lib.causal_attention
  monkeypatch.setattr(attention_lib, "causal_attention",
                      lambda q, k, v, **kwargs: causal(q * 1.05, k, v, **kwargs))
  with pytest.raises(AssertionError, match="relative error"):
    assert_trees_close(_loss_and_gradients(kernels, params, batch), expected, rtol=bf16,
                       what="control: splash at 1.05 x the temperature")


@pytest.mark.parametrize("gmm", ["ragged_dot", "megablox"])
def test_layer_fallback_equals_dropless_on_the_chip(gmm):
  """One expert shard at factor 0.75: every row of a balanced load overflows the buffer, so
  the layer falls back; outputs and gradients equal the dense reference, and the capped layer
  without the fallback drops rows and diverges."""
  mesh = moe_hk.make_mesh(data=jax.device_count(), expert=1)
  config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=2, emb_dim=128, mlp_dim=256,
                            ragged_buffer_factor=0.75, moe_dropless_fallback="layer",
                            gmm_impl=gmm)
  params, x = skewed_inputs(config, 8 * jax.device_count(), 128, skew=1.5)
  cot = jax.random.normal(jax.random.key(3), x.shape)
  run = lambda c: jax.jit(functools.partial(
      outputs_and_grads, functools.partial(moe_hk.moe_forward, config=c, mesh=mesh)))(
          params, x, cot)
  y, stats, grads = run(config)
  y_ref, _, grads_ref = reference_outputs_and_grads(params, x, cot, k=2)
  assert int(stats.would_drop_rows) > 0 and int(stats.fallback) == 1
  assert_trees_close(y, y_ref, what=f"y ({gmm})")
  assert_trees_close(grads, grads_ref, what=f"grad ({gmm})")
  y_cap, stats_cap, _ = run(config.replace(moe_dropless_fallback="none"))
  assert int(stats_cap.dropped_rows) > 0 and relative_error(y_cap, y_ref) > 1e-2


def test_the_chips_memory_figure_is_what_the_step_holds():
  """benchmarks/chip_step.py's memory figure on the tiny model: the bytes the runtime holds
  for the step (live arrays + the reservation for the program's temporaries) agree with the
  largest ballast the device holds beside a step that still runs (two independent readings,
  within 5%), and are more than the train state alone."""
  config = tiny_config(attention_impl="auto")
  config.data.seq_len = 128
  config.mesh.update(data=1, fsdp=1, expert=jax.device_count())
  figures = chip_step.measure(config, steps=3, warmup=2, headroom=True)
  stats = figures["memory_stats"]
  assert figures["mfu"] > 0 and stats["peak_bytes_reserved"] > 0, figures
  assert figures["chip_bytes"] > stats["peak_bytes_in_use"], figures
  assert abs(figures["chip_bytes_by_ballast"] - figures["chip_bytes"]) <= max(
      0.05 * figures["chip_bytes"], 128 << 20), figures
