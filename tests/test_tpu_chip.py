"""On a real TPU chip (`make test-tpu`): the kernels through the train step, the fallback's
exactness, and the device's memory figures. Everywhere else these skip; their CPU twins are
tests/test_attention.py (splash in interpret mode through the train step),
tests/test_grouped_matmul.py (megablox interpreted), tests/test_fallback.py (the fallback
against the dense reference) and benchmarks/chip_step.py's own CPU run.

Tolerances: the layer comparison runs at 'highest' matmul precision (tests/conftest.py), so
float32 as on CPU (1e-5). The train-step comparison is against the XLA forms on the same
chip: the splash kernels compute at the default TPU precision (bfloat16 passes; Mosaic
refuses 'highest' for them), so its loss and gradient norm agree to 2e-2.
"""
import functools

import jax
import numpy as np
import pytest

import moe_hk
from benchmarks import chip_step
from launch.training.steps import make_steps
from tests.helpers import settings_of, tiny_config
from tests.moe_inputs import outputs_and_grads, reference_outputs_and_grads, skewed_inputs
from tests.tree_close import assert_trees_close, relative_error

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(jax.devices()[0].platform != "tpu",
                       reason="needs a TPU chip: `make test-tpu` on a TPU host"),
]


def test_train_step_with_splash_and_megablox_matches_the_xla_forms():
  """The launcher's step with the TPU kernels (splash attention, megablox experts) against
  the same step with XLA's attention and ragged_dot, from the same state and batch."""
  batch = np.random.default_rng(0).integers(0, 256, (8, 129), np.int32)

  def one_step(attention: str, gmm: str):
    config = tiny_config(attention_impl=attention)
    config.data.seq_len, config.warmup_steps = 128, 0
    config.mesh.update(data=1, fsdp=1, expert=jax.device_count())
    config.moe.gmm_impl = gmm
    steps = make_steps(settings_of(config), moe_hk.make_mesh(**config.mesh))
    state, out = steps.train(steps.init(jax.random.key(0)),
                             jax.device_put(batch, steps.batch_sharding))
    return jax.device_get((out["loss"], out["grad_norm"],
                           steps.eval_loss(state.params, batch)))
  kernels, xla = one_step("splash", "megablox"), one_step("xla", "ragged_dot")
  assert_trees_close(kernels, xla, rtol=2e-2, what="train step: splash + megablox vs XLA")


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
