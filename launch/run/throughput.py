"""Model FLOPs utilisation: the model's FLOPs per step over the chips' peak.

`model_flops` is the model's own count of a train step's matmul FLOPs: 6 x active parameters
x tokens (forward and backward; a token runs K of the E routed experts) plus attention's score
and value matmuls. It leaves out what the implementation adds (the rematerialised forward, the
experts' computation over the empty rows of a receive buffer larger than the balanced rows),
so MFU compares runs of one model across implementations, as MFU is usually quoted.

`PEAK_TFLOPS` holds the dense bfloat16 peak per chip, by device kind; `config.peak_tflops_per_
device` overrides it (0 keeps the table's). On CPU there is no MFU.
"""
from __future__ import annotations

import math

from launch.model import transformer

# Dense bfloat16 TFLOP/s per chip (the vendors' figures), keyed by a lower-case substring of
# `jax.Device.device_kind` ('TPU v5p', 'TPU v5 lite', 'NVIDIA H200', ...). Longest match wins.
PEAK_TFLOPS = {
    "tpu v4": 275.0,
    "tpu v5 lite": 197.0,
    "tpu v5e": 197.0,
    "tpu v5p": 459.0,
    "tpu v5": 459.0,
    "tpu v6 lite": 918.0,
    "tpu v6e": 918.0,
    "h100": 989.0,
    "h200": 989.0,
}


def peak_tflops(device_kind: str, platform: str, override: float = 0.0) -> float | None:
  """Dense bf16 TFLOP/s of one device of `device_kind` on `platform`: `override` when > 0,
  else the table's; None on CPU or for a kind the table does not know (no MFU)."""
  if override > 0:
    return float(override)
  if platform == "cpu":
    return None
  kind = device_kind.lower()
  matches = [key for key in PEAK_TFLOPS if key in kind]
  return PEAK_TFLOPS[max(matches, key=len)] if matches else None


def model_flops(params, config, layer) -> float:
  """The model's matmul FLOPs of one train step of `config`'s model with `params` (arrays or
  shapes) and MoE layers `layer` (`moe_hk.MoEConfig`): 6 x active parameters x tokens (each
  token runs K of the E routed experts) plus attention's."""
  total, routed = transformer.parameter_counts(params)
  active = total - routed + routed * layer.num_experts_per_tok / layer.num_experts
  tokens = config.data.batch_size * config.data.seq_len
  return 6.0 * active * tokens + transformer.attention_flops(config)


def mfu(flops_per_step: float, seconds_per_step: float, devices: int,
        peak: float | None) -> tuple[float, float | None]:
  """`(TFLOP/s per device, MFU)` of steps of `flops_per_step` model FLOPs taking
  `seconds_per_step` on `devices` devices of `peak` TFLOP/s (MFU None without a peak)."""
  per_device = flops_per_step / seconds_per_step / devices / 1e12
  return per_device, (per_device / peak if peak and math.isfinite(per_device) else None)
