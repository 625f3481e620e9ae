"""The launcher: a few-step run, exact resume, and clear errors for bad configs."""
import os
import subprocess
import sys

import numpy as np
import pytest

from launch import trainer
from launch.configs import default
from tests.test_metrics_tensorboard import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**overrides):
  c = default.get_config()
  c.emb_dim, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim = 32, 2, 2, 1, 16
  c.mlp_dim = c.moe.mlp_dim = 64
  c.data.batch_size, c.data.seq_len, c.data.max_bytes = 8, 32, 200_000
  c.train_steps, c.warmup_steps, c.eval_every, c.checkpoint_every = 8, 2, 4, 4
  c.moe.ragged_buffer_factor = 1.0  # small enough that the fallback runs now and then
  c.update(overrides)
  return c


@pytest.mark.slow
def test_few_steps_train_log_and_checkpoint(tmp_path):
  losses = trainer.train_and_evaluate(tiny_config(), str(tmp_path))
  assert len(losses) == 8 and all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  scalars = read_scalars(str(tmp_path))
  for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "eval/loss",
              "learning/moe_dropless_fallback_layers", "moe/required_ragged_buffer_factor/layer_0"):
    assert tag in scalars, tag
  assert sorted(scalars["train/loss"]) == list(range(8))
  np.testing.assert_allclose([scalars["train/loss"][s] for s in range(8)], losses, rtol=1e-6)
  assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "8"


@pytest.mark.slow
def test_resumed_run_matches_uninterrupted_run(tmp_path):
  straight = trainer.train_and_evaluate(tiny_config(), str(tmp_path / "straight"))
  first = trainer.train_and_evaluate(tiny_config(), str(tmp_path / "resumed"), stop_after=3)
  rest = trainer.train_and_evaluate(tiny_config(), str(tmp_path / "resumed"))
  assert len(first) == 3 and len(rest) == 5  # resumed from a step that is not a save interval
  np.testing.assert_allclose(first + rest, straight, rtol=1e-6)


@pytest.mark.parametrize("flag,message", [
    ("--config.moe.num_experts=12", "config.moe.num_experts=12 must be divisible by "
                                    "config.mesh.expert=8"),
    ("--config.moe.ragged_buffer_factor=0", "MoEConfig.ragged_buffer_factor=0.0 is invalid"),
    ("--config.data.batch_size=12", "config.data.batch_size=12 must be divisible by the 8"),
])
def test_bad_config_gives_a_short_clear_error(tmp_path, flag, message):
  result = subprocess.run(
      [sys.executable, "-m", "launch.train", f"--workdir={tmp_path}", flag], cwd=ROOT,
      capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert message in result.stderr
  assert "Traceback" not in result.stderr
