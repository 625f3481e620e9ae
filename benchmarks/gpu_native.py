"""The GPU path on one real GPU: grouped-matmul backends, the layer, the trainer's MFU.

  python -m benchmarks.gpu_native [--stub_xprof] [--rounds=20] [--sections=check,gmm,layer,trainer]
  python -m benchmarks.gpu_native --dry_run    # small shapes on the CPU (tokamax's XLA reference)

Sections, in order (each prints how long it took; the JSON is rewritten after each, so a run
cut short keeps what it measured):

* `check`: correctness on the device, against dense references computed at 'highest'
  precision. tokamax's grouped matmul and expert MLP (bfloat16: the Mosaic GPU kernels;
  float32: XLA's ragged_dot) with NaN planted in the padding rows: the padding rows of the
  output and of x's gradient must come back exactly 0, everything finite, and the rest within
  the dtype's tolerance (float32 1e-5, bfloat16 2e-2, per leaf, relative Frobenius norm); the
  layer (one shard; the `layer` fallback and the worst-case buffer) with the blocked and the
  tokamax backends against the dense top-k reference. Any failure makes the exit status 1.
* `gmm`: one grouped matmul, M x K x N over G experts (32,768 x 5,120 x 8,192 over 8), bfloat16,
  forward and forward + backward, balanced and skewed group sizes (half the rows in one
  expert, two experts empty, 2,048 padding rows past the groups), against a dense batched
  matmul of the same useful FLOPs: XLA's `ragged_dot`, `blocked`, `tokamax` (the layer's
  wrapper), tokamax unwrapped (`tokamax.ragged_dot`, its own backward), and tokamax with
  three pinned kernel configs. Interleaved rounds (benchmarks/timing.py): median and p25-p75
  of each per-round ratio to the dense time, and TFLOP/s of useful FLOPs.
* `layer`: one bfloat16 layer's value-and-grad on one shard, the full buffer (factor 1) vs the
  `layer` fallback (factor 0.5 always overflows on one shard), blocked vs tokamax: time
  ratios to the full-buffer blocked step and compiled memory.
* `trainer`: the launcher's train step on the one GPU (`launch.model.train_step`, real batches
  from `launch.data.loader`), for the default config (float32, as configured), the same in
  bfloat16, and a larger bfloat16 MoE model: tokens/s, model TFLOP/s per device and MFU
  (`launch.run.throughput`), per grouped-matmul backend, interleaved windows of steps.

Writes `benchmarks/results/gpu_native.json` (`--output`; a dry run writes to the temp folder):
command, commit ($GIT_COMMIT, else `git rev-parse HEAD`), date, machine and the figures.
On the lent GPU machine tokamax's wheel comes without xprof, which tokamax 0.0.17 imports at
import time for its own profiling: `--stub_xprof` stands in for it.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import functools
import json
import logging
import os
import sys
import tempfile
import time
import types
from typing import Callable, NamedTuple

import numpy as np

SECTIONS = ("check", "gmm", "layer", "trainer")
# Per-leaf relative tolerances of the checks (tests/tree_close.py's, per dtype).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class Shapes(NamedTuple):
  """Every size the run uses: the device run's, or the dry run's small ones."""
  gmm: tuple[int, int, int, int]              # M, K, N, G of the timed grouped matmul
  skewed_sizes: tuple[int, ...]               # its skewed group sizes (sum < M)
  check_gmm: tuple[int, int, int]             # M, K, N of the checked matmuls (G = 8)
  check_sizes: tuple[int, ...]                # their group sizes: empty groups, padding
  check_layer: tuple[int, int, int, int]      # width, hidden, batch, seq (8 experts, top-2)
  layer: tuple[int, int, int, int, int]       # experts, width, hidden, batch, seq (top-1)
  trainer_overrides: tuple[tuple[str, str], ...]  # applied to every trainer config
  large: tuple[tuple[str, str], ...]          # the larger bf16 MoE model's overrides
  steps: int                                  # trainer steps per timed window
  trainer_rounds: int                         # timed windows per backend


DEVICE = Shapes(
    gmm=(32768, 5120, 8192, 8),
    skewed_sizes=(16384, 0, 6144, 2048, 0, 3072, 1024, 2048),  # 30,720 rows, 2,048 padding
    check_gmm=(4096, 512, 1024),
    check_sizes=(1500, 0, 700, 300, 0, 600, 200, 400),  # 3,700 rows, 396 padding
    check_layer=(256, 512, 4, 256),
    layer=(16, 1024, 4096, 8, 4096),
    trainer_overrides=(),
    # emb 2048, dense and expert SwiGLU 8192, 8 experts top-2, 4 blocks (2 MoE), 16 x 128
    # heads, 8 x 2048 tokens a step: about 1.0e9 parameters, 3.4e13 model FLOPs a step.
    large=(("emb_dim", "2048"), ("mlp_dim", "8192"), ("moe.mlp_dim", "8192"),
           ("num_heads", "16"), ("num_kv_heads", "8"), ("head_dim", "128"),
           ("data.batch_size", "8"), ("data.seq_len", "2048")),
    steps=10,
    trainer_rounds=3)

DRY_RUN = Shapes(
    gmm=(512, 256, 256, 8),
    skewed_sizes=(256, 0, 96, 32, 0, 48, 16, 32),
    check_gmm=(512, 64, 128),
    check_sizes=(150, 0, 70, 30, 0, 60, 20, 40),
    check_layer=(32, 64, 2, 32),
    layer=(8, 64, 128, 2, 128),
    trainer_overrides=(("num_layers", "2"), ("data.batch_size", "4"), ("data.seq_len", "32")),
    large=(("emb_dim", "64"), ("mlp_dim", "128"), ("moe.mlp_dim", "128"), ("num_heads", "4"),
           ("num_kv_heads", "2"), ("head_dim", "16")),
    steps=2,
    trainer_rounds=2)


# ----------------------------------------------------------------------------------------
# Setup.

def stub_xprof() -> bool:
  """Installs empty `xprof` modules where xprof is not installed (tokamax 0.0.17 imports
  `xprof.cli.tools.get_kernel_stats_tool` at import time, used only by its own benchmarking's
  xprof timer). Returns whether it stubbed."""
  try:
    import xprof.cli.tools  # noqa: F401
    return False
  except ImportError:
    pass
  names = ("xprof", "xprof.cli", "xprof.cli.tools", "xprof.cli.tools.get_kernel_stats_tool")
  for name in names:
    sys.modules[name] = types.ModuleType(name)
  sys.modules["xprof.cli.tools"].get_kernel_stats_tool = sys.modules[names[-1]]
  return True


class _DropCacheMisses(logging.Filter):
  """tokamax logs a warning, with the whole op, for every kernel without a tuned config."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Autotuning cache miss")


def tokamax_version() -> str | None:
  try:
    return importlib.metadata.version("tokamax")
  except importlib.metadata.PackageNotFoundError:
    return None


def rel(actual, expected) -> float:
  """|a - b| / |b| (Frobenius), in float64 on the host; 0 when both are 0."""
  a = np.asarray(actual, np.float64)
  b = np.asarray(expected, np.float64)
  norm = np.linalg.norm(b)
  return float(np.linalg.norm(a - b) / (norm if norm > 0 else 1.0))


def _f32(tree):
  import jax
  import jax.numpy as jnp
  return jax.tree.map(lambda a: np.asarray(jnp.asarray(a, jnp.float32)), tree)


# ----------------------------------------------------------------------------------------
# Shared pieces: dense references and the layer's inputs.

def dense_grouped(x, w, sizes):
  """Each group's rows of `x [M, K]` times its `w [G, K, N]` (static slices), padding rows 0,
  in float32."""
  import jax.numpy as jnp
  x, w = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
  starts = np.concatenate([[0], np.cumsum(sizes)])
  blocks = [x[starts[g]:starts[g + 1]] @ w[g] for g in range(len(sizes))]
  padding = jnp.zeros((x.shape[0] - starts[-1], w.shape[2]), jnp.float32)
  return jnp.concatenate([*blocks, padding])


def dense_mlp(x, wi_0, wi_1, wo, sizes):
  """SwiGLU experts per row (float32), padding rows 0."""
  import jax
  h = jax.nn.silu(dense_grouped(x, wi_0, sizes)) * dense_grouped(x, wi_1, sizes)
  return dense_grouped(h, wo, sizes)


def skewed_layer(num_experts: int, k: int, width: int, hidden: int, batch: int, seq: int,
                 skew: float, seed: int = 0):
  """Params (float32) and input whose router sends most tokens to the first k experts."""
  import jax.numpy as jnp
  import moe_hk
  rng = np.random.default_rng(seed)
  mu = rng.normal(size=width)
  x = rng.normal(size=(batch, seq, width)) + mu
  router = rng.normal(size=(width, num_experts)) / np.sqrt(width)
  router[:, :k] += skew * (mu / (mu @ mu))[:, None]
  params = moe_hk.MoEParams(
      router, rng.normal(size=(num_experts, width, hidden)) / np.sqrt(width),
      rng.normal(size=(num_experts, width, hidden)) / np.sqrt(width),
      rng.normal(size=(num_experts, hidden, width)) / np.sqrt(hidden))
  return (moe_hk.MoEParams(*(jnp.asarray(p, jnp.float32) for p in params)),
          jnp.asarray(x, jnp.float32))


def dense_moe(params, x, k: int):
  """Every expert on every token (float32), then the top-k softmax-weighted sum (no drops)."""
  import jax
  import jax.numpy as jnp
  x = x.astype(jnp.float32)
  logits = jnp.einsum("bsd,de->bse", x, params.router_w)
  top, ids = jax.lax.top_k(logits, k)
  weights = jax.nn.softmax(top, axis=-1)
  h = jax.nn.silu(jnp.einsum("bsd,edf->bsef", x, params.wi_0)) * jnp.einsum(
      "bsd,edf->bsef", x, params.wi_1)
  every = jnp.einsum("bsef,efd->bsed", h, params.wo)
  return jnp.einsum("bsk,bskd->bsd", weights, jnp.take_along_axis(every, ids[..., None], 2))


def one_shard_mesh():
  import jax
  import moe_hk
  return moe_hk.make_mesh(expert=1, devices=jax.devices()[:1])


# ----------------------------------------------------------------------------------------
# Section `check`.

def _check_gmm(shapes: Shapes, on_cpu: bool) -> dict:
  """tokamax's grouped matmul and expert MLP with NaN padding rows vs float32 references."""
  import jax
  import jax.numpy as jnp
  from moe_hk import tokamax_gmm
  m, k, n = shapes.check_gmm
  sizes = np.asarray(shapes.check_sizes)
  used = int(sizes.sum())
  g = len(sizes)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(m, k)).astype(np.float32)
  x[used:] = np.nan
  clean = np.where(np.isnan(x), 0, x)
  w = rng.normal(size=(g, k, n)).astype(np.float32) / np.sqrt(k)
  wi_0, wi_1 = (rng.normal(size=(g, k, n)).astype(np.float32) / np.sqrt(k) for _ in range(2))
  wo = rng.normal(size=(g, n, k)).astype(np.float32) / np.sqrt(n)
  cot_n = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)  # nonzero on padding rows too
  cot_k = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
  group_sizes = jnp.asarray(sizes, jnp.int32)

  def value_and_grads(fn, cot, *args):
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot)
    return fn(*args), jax.grad(loss, argnums=tuple(range(len(args))))(*args)

  out = {}
  cases = [("grouped_matmul", jnp.bfloat16, (x, w), cot_n),
           ("expert_mlp", jnp.bfloat16, (x, wi_0, wi_1, wo), cot_k),
           ("expert_mlp", jnp.float32, (x, wi_0, wi_1, wo), cot_k)]
  for name, dtype, args, cot in cases:
    dname = jnp.dtype(dtype).name
    impl = tokamax_gmm.implementation(dtype, reference=on_cpu)
    if name == "grouped_matmul":
      fn = lambda a, b: tokamax_gmm.grouped_matmul(a, b, group_sizes, impl)
      ref_fn = lambda a, b: dense_grouped(a, b, sizes)
    else:
      fn = lambda *a: tokamax_gmm.expert_mlp(*a, group_sizes, reference=on_cpu)
      ref_fn = lambda *a: dense_mlp(*a, sizes)
    inputs = [jnp.asarray(a, dtype) for a in args]
    got = _f32(jax.jit(functools.partial(value_and_grads, fn, cot))(*inputs))
    rounded = [jnp.asarray(jnp.asarray(a, dtype), jnp.float32) for a in (clean, *args[1:])]
    with jax.default_matmul_precision("highest"):
      want = _f32(value_and_grads(ref_fn, cot, *rounded))
    leaves = [("y", got[0], want[0])] + [
        (f"d{i}", a, b) for i, (a, b) in enumerate(zip(got[1], want[1]))]
    errors = {leaf: rel(a, b) for leaf, a, b in leaves}
    padding_zero = bool(np.all(got[0][used:] == 0) and np.all(got[1][0][used:] == 0))
    finite = all(bool(np.isfinite(a).all()) for _, a, _ in leaves)
    ok = padding_zero and finite and max(errors.values()) <= TOLERANCE[dname]
    out[f"{name}_{dname}"] = {"implementation": impl, "rel_err": errors,
                              "padding_rows_zero": padding_zero, "finite": finite,
                              "tolerance": TOLERANCE[dname], "ok": ok}
  # What the bare kernel leaves in the padding rows (the reason for the wrapper's selects).
  import tokamax
  impl = tokamax_gmm.implementation(jnp.bfloat16, reference=on_cpu)
  bare = jax.jit(lambda a, b: tokamax.ragged_dot(a, b, group_sizes, implementation=impl))(
      jnp.asarray(clean, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
  bare_pad = np.asarray(jnp.asarray(bare[used:], jnp.float32))
  out["bare_kernel_padding_rows"] = {
      "implementation": impl, "nonzero_fraction": float(np.mean(bare_pad != 0)),
      "nonfinite_fraction": float(np.mean(~np.isfinite(bare_pad)))}
  return out


def _check_layer(shapes: Shapes) -> dict:
  """The layer (one shard, top-2 of 8) vs the dense reference: the `layer` fallback and the
  worst-case buffer, blocked and tokamax, bfloat16 (and float32 on the worst case)."""
  import jax
  import jax.numpy as jnp
  import moe_hk
  mesh = one_shard_mesh()
  width, hidden, batch, seq = shapes.check_layer
  k = 2
  params, x = skewed_layer(8, k, width, hidden, batch, seq, skew=4.0)
  cot = jax.random.normal(jax.random.key(1), x.shape)

  def value_and_grads(fn):
    """`fn(params, x) -> (y, stats)`: y, the gradients of sum(y * cot), stats (one compile)."""
    def loss(p, xx):
      y, stats = fn(p, xx)
      return jnp.sum(y.astype(jnp.float32) * cot), (y, stats)
    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x)
    return _f32((y, grads)), stats

  (y_ref, g_ref), _ = value_and_grads(lambda p, xx: (dense_moe(p, xx, k), None))
  out, layers = {}, {}
  for name, factor, mode, dtype, gmm in [
      ("fallback", 0.5, "layer", "bfloat16", "blocked"),
      ("fallback", 0.5, "layer", "bfloat16", "tokamax"),
      ("worst_case", -1, "none", "bfloat16", "blocked"),
      ("worst_case", -1, "none", "bfloat16", "tokamax"),
      ("worst_case", -1, "none", "float32", "blocked"),
      ("worst_case", -1, "none", "float32", "tokamax")]:
    config = moe_hk.MoEConfig(num_experts=8, num_experts_per_tok=k, emb_dim=width,
                              mlp_dim=hidden, ragged_buffer_factor=factor,
                              moe_dropless_fallback=mode, dropless_fallback_chunking="fixed",
                              gmm_impl=gmm, dtype=dtype)
    (y, grads), stats = value_and_grads(functools.partial(moe_hk.moe_forward, config=config,
                                                          mesh=mesh))
    errors = [rel(y, y_ref)] + [rel(a, b) for a, b in zip(jax.tree.leaves(grads),
                                                          jax.tree.leaves(g_ref))]
    key = f"{name}_{dtype}_{gmm}"
    layers[key] = (y, grads)
    out[key] = {"y_rel_err": errors[0], "grad_rel_err_max": max(errors[1:]),
                "fallback": int(stats.fallback), "dropped_rows": int(stats.dropped_rows),
                "tolerance": TOLERANCE[dtype],
                "ok": max(errors) <= TOLERANCE[dtype] and int(stats.dropped_rows) == 0
                and int(stats.fallback) == (mode == "layer")}
  for name in ("fallback_bfloat16", "worst_case_bfloat16", "worst_case_float32"):
    (y_a, g_a), (y_b, g_b) = layers[f"{name}_tokamax"], layers[f"{name}_blocked"]
    errors = [rel(y_a, y_b)] + [rel(a, b) for a, b in zip(jax.tree.leaves(g_a),
                                                          jax.tree.leaves(g_b))]
    out[f"{name}_tokamax_vs_blocked"] = {
        "rel_err_max": max(errors), "tolerance": TOLERANCE[name.split("_")[-1]],
        "ok": max(errors) <= TOLERANCE[name.split("_")[-1]]}
  return out


def section_check(shapes: Shapes, on_cpu: bool, **_) -> dict:
  import jax
  # The references, and the layer's float32 router, at full float32 precision (a GPU runs
  # float32 matmuls as TF32 by default): the checks compare arithmetic, not TF32's rounding.
  with jax.default_matmul_precision("highest"):
    return {"grouped_matmul": _check_gmm(shapes, on_cpu), "layer": _check_layer(shapes)}


def failed_checks(check: dict) -> list[str]:
  return [f"{part}/{name}" for part, cases in check.items() if isinstance(cases, dict)
          for name, case in cases.items() if isinstance(case, dict) and case.get("ok") is False]


# ----------------------------------------------------------------------------------------
# Section `gmm`.

def pinned_kernels() -> dict:
  """tokamax's Mosaic GPU ragged_dot (sm90) with pinned configs beside its heuristic one
  (block_m 64, block_n 64, block_k 128, 2 stages, not persistent): bigger row tiles, a deeper
  pipeline, the persistent grid. Each fits the H200's 227 KiB of shared memory."""
  from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as pmg
  from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as common
  m_major, n_major = common.MatmulDimension.M, common.MatmulDimension.N
  configs = {
      "m128_k128_s4": dict(block_m=128, block_k=128, num_stages=4, persistent=False,
                           grid_minor_dim=m_major, grid_tile_width=1),
      "m128_k256_s2": dict(block_m=128, block_k=256, num_stages=2, persistent=False,
                           grid_minor_dim=m_major, grid_tile_width=1),
      "m64_k128_s4_persistent": dict(block_m=64, block_k=128, num_stages=4, persistent=True,
                                     grid_minor_dim=n_major, grid_tile_width=4),
  }
  return {name: (pmg.PallasMosaicGpuRaggedDot(config=pmg.Config(block_n=64, split_k=1, **c)),)
          for name, c in configs.items()}


def section_gmm(shapes: Shapes, on_cpu: bool, rounds: int, **_) -> dict:
  import jax
  import jax.numpy as jnp
  import tokamax
  from benchmarks import timing
  from moe_hk import grouped_matmul, tokamax_gmm
  m, kk, n, g = shapes.gmm
  dtype = jnp.bfloat16
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.normal(size=(m, kk)), dtype)
  rhs = jnp.asarray(rng.normal(size=(g, kk, n)) / np.sqrt(kk), dtype)
  impl = tokamax_gmm.implementation(dtype, reference=on_cpu)
  # Group sizes are arguments, so both layouts run one compiled program per variant.
  variants: dict[str, Callable] = {
      "ragged_dot": lambda a, b, s: jax.lax.ragged_dot(a, b, s),
      "blocked": lambda a, b, s: grouped_matmul.blocked_grouped_matmul(a, b, s, block_rows=512),
      "tokamax": lambda a, b, s: tokamax_gmm.grouped_matmul(a, b, s, impl),
      "tokamax_unwrapped": lambda a, b, s: tokamax.ragged_dot(a, b, s, implementation=impl),
  }
  skipped = {}
  try:
    pinned = pinned_kernels()
  except Exception as e:  # noqa: BLE001  (an older tokamax: measure the rest)
    pinned, skipped["pinned"] = {}, f"{type(e).__name__}: {e}"
  if on_cpu:  # the Mosaic GPU kernels cannot run on a CPU
    skipped.update({f"tokamax_{name}": "Mosaic GPU kernel: GPU only" for name in pinned})
    pinned = {}
  for name, op in pinned.items():
    variants[f"tokamax_{name}"] = lambda a, b, s, op=op: tokamax_gmm.grouped_matmul(a, b, s, op)

  def fwd_bwd(f):
    return jax.grad(lambda a, b, s: jnp.sum(f(a, b, s).astype(jnp.float32)), argnums=(0, 1))
  compiled = {}
  for name, f in variants.items():
    compiled[name] = jax.jit(f)
    compiled[f"{name}_fwd_bwd"] = jax.jit(fwd_bwd(f))

  results = {"shape": [m, kk, n, g], "dtype": "bfloat16", "not_run": skipped}
  for layout, sizes in (("balanced", (m // g,) * g), ("skewed", shapes.skewed_sizes)):
    used = int(sum(sizes))
    s = jnp.asarray(sizes, jnp.int32)
    # Dense batched matmul with the same useful FLOPs: G groups of used / G rows.
    a_dense = lhs[:used].reshape(g, used // g, kk)
    dense = lambda a, b: jnp.einsum("gmk,gkn->gmn", a, b)
    fns = {"dense_batched": functools.partial(jax.jit(dense), a_dense, rhs),
           "dense_batched_fwd_bwd": functools.partial(
               jax.jit(jax.grad(lambda a, b: jnp.sum(dense(a, b).astype(jnp.float32)),
                                argnums=(0, 1))), a_dense, rhs)}
    errors = {}
    for name, fn in compiled.items():
      call = functools.partial(fn, lhs, rhs, s)
      try:
        jax.block_until_ready(call())  # compile here: a variant that fails is reported
        fns[name] = call
      except Exception as e:  # noqa: BLE001
        errors[name] = f"{type(e).__name__}: {str(e)[:400]}"
    samples = timing.interleaved(fns, rounds)
    fwd_names = [k for k in fns if not k.endswith("_fwd_bwd")]
    flops = 2.0 * used * kk * n
    summary = {"group_sizes": list(sizes), "useful_rows": used, "errors": errors}
    for part, names, base, f in (("forward", fwd_names, "dense_batched", flops),
                                 ("forward_backward", [f"{k}_fwd_bwd" for k in fwd_names
                                                       if f"{k}_fwd_bwd" in fns],
                                  "dense_batched_fwd_bwd", 3 * flops)):
      table = timing.ratio_summary({k: samples[k] for k in names}, base)
      for name, stats in table.items():
        stats["tflops"] = f / stats["median_s"] / 1e12
      summary[part] = {name.removesuffix("_fwd_bwd"): stats for name, stats in table.items()}
    results[layout] = summary
  return results


# ----------------------------------------------------------------------------------------
# Section `layer`.

def section_layer(shapes: Shapes, rounds: int, **_) -> dict:
  """Value-and-grad step of one bf16 layer: the full buffer vs the `layer` fallback.

  With one shard the worst case is the balanced size (N rows), so a factor of 1 is never
  capped, and 0.5 always overflows and falls back to 2 sequence chunks of N / 2 rows.
  """
  import jax
  import jax.numpy as jnp
  import moe_hk
  from benchmarks import timing
  mesh = one_shard_mesh()
  experts, width, hidden, batch, seq = shapes.layer
  params, x = skewed_layer(experts, 1, width, hidden, batch, seq, skew=0.0, seed=2)
  x = x.astype(jnp.bfloat16)
  fns, memory, errors = {}, {}, {}
  for (name, factor), gmm in [(case, gmm) for case in (("full_buffer", 1.0),
                                                       ("fallback_2_chunks", 0.5))
                              for gmm in ("blocked", "tokamax")]:
    name = f"{name}_{gmm}"
    config = moe_hk.MoEConfig(num_experts=experts, num_experts_per_tok=1, emb_dim=width,
                              mlp_dim=hidden, ragged_buffer_factor=factor,
                              moe_dropless_fallback="layer", dropless_fallback_chunking="fixed",
                              gmm_impl=gmm, dtype="bfloat16")

    def loss(p, xx, config=config):
      y, stats = moe_hk.moe_forward(p, xx, config=config, mesh=mesh)
      return jnp.mean(jnp.square(y.astype(jnp.float32))), stats
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    try:
      compiled = step.lower(params, x).compile()
      fell_back = int(compiled(params, x)[0][1].fallback)
      assert fell_back == (factor < 1), f"{name}: fallback {fell_back}"
      m = compiled.memory_analysis()
      memory[name] = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                      - m.alias_size_in_bytes) / 2 ** 20
      fns[name] = functools.partial(compiled, params, x)
    except Exception as e:  # noqa: BLE001
      errors[name] = f"{type(e).__name__}: {str(e)[:400]}"
  base = "full_buffer_blocked"
  summary = timing.ratio_summary(timing.interleaved(fns, rounds), base) if base in fns else {}
  for name, s in summary.items():
    s["memory_MiB"] = memory[name]
  return {"shape": {"experts": experts, "top_k": 1, "width": width, "hidden": hidden,
                    "batch": batch, "seq": seq, "dtype": "bfloat16"},
          "baseline": base, "steps": summary, "errors": errors}


# ----------------------------------------------------------------------------------------
# Section `trainer`.

def _trainer_steps(overrides):
  """(config, settings, steps) the way the launcher builds them, on this process's devices."""
  import jax
  import moe_hk
  from launch.model.train_step import make_steps
  from launch.setup import settings as settings_lib
  config = settings_lib.load(os.path.join(settings_lib.CONFIGS, "default.py"), overrides)
  settings = settings_lib.build(config, jax.device_count())
  return config, settings, make_steps(settings, moe_hk.make_mesh(**settings.mesh))


def _time_trainer(overrides, shapes: Shapes) -> dict:
  """Both backends' train steps on real batches, in interleaved windows of `shapes.steps`
  steps (each window ends by blocking on the state and the step's outputs)."""
  import jax
  from benchmarks import timing
  from launch.data import loader as data_lib
  from launch.run import throughput
  device = jax.devices()[0]
  runs, out = {}, {"backends": {}}
  for gmm in ("blocked", "tokamax"):
    start = time.perf_counter()
    try:
      config, settings, steps = _trainer_steps([*overrides, ("moe.gmm_impl", gmm)])
      data = data_lib.make_data(config)
      batches = [jax.device_put(data.train_batch(i), steps.batch_sharding) for i in range(4)]
      box = {"state": steps.init(jax.random.key(config.seed)), "i": 0}
      flops = throughput.model_flops(box["state"].params, config, settings.layer)

      def window(box=box, steps=steps, batches=batches):
        for _ in range(shapes.steps):
          box["state"], outputs = steps.train(box["state"], batches[box["i"] % len(batches)])
          box["i"] += 1
        return box["state"], outputs
      jax.block_until_ready(window())  # compiles, then runs a first window
    except Exception as e:  # noqa: BLE001  (measure the other backend all the same)
      out["backends"][gmm] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
      continue
    runs[gmm] = window
    out["backends"][gmm] = {"flops_per_step": flops,
                            "setup_and_compile_s": time.perf_counter() - start}
    out.update(dtype=config.dtype, tokens_per_step=config.data.batch_size * config.data.seq_len,
               attention_impl=config.attention_impl)
  if not runs:
    return out
  samples = timing.interleaved(runs, shapes.trainer_rounds, warmup=0)
  summary = timing.ratio_summary(samples, "blocked" if "blocked" in runs else next(iter(runs)))
  peak = throughput.peak_tflops(device.device_kind, device.platform)
  for gmm, s in summary.items():
    seconds = s["median_s"] / shapes.steps
    per_device, mfu = throughput.mfu(out["backends"][gmm]["flops_per_step"], seconds,
                                     devices=1, peak=peak)
    out["backends"][gmm].update(step_ms=seconds * 1e3, tokens_per_s=out["tokens_per_step"] /
                                seconds, tflops_per_device=per_device, mfu=mfu,
                                time_ratio_to_blocked=s["ratio_median"],
                                ratio_p25=s["ratio_p25"], ratio_p75=s["ratio_p75"])
  out["peak_tflops_per_device"] = peak
  return out


def section_trainer(shapes: Shapes, save: Callable[[dict], None], deadline: float,
                    **_) -> dict:
  """The default config (float32, as configured), its bfloat16 variant and a larger bf16 MoE
  model, each with the blocked and the tokamax grouped matmul, on one device. Where the
  blocked step fails in cuDNN's attention ('auto' on GPU), the config runs again with XLA's.
  Saves after each config; starts none after `deadline` (time.monotonic())."""
  mesh = (("mesh.data", "1"), ("mesh.fsdp", "1"), ("mesh.expert", "1"))
  base = (*mesh, *shapes.trainer_overrides)
  configs = {"default": base,
             "default_bfloat16": (*base, ("dtype", "bfloat16")),
             "large_bfloat16": (*base, *shapes.large, ("dtype", "bfloat16"))}
  out = {}
  for name, overrides in configs.items():
    if time.monotonic() > deadline:
      out[name] = {"skipped": "past --budget_s"}
      continue
    start = time.perf_counter()
    out[name] = _time_trainer(overrides, shapes)
    error = out[name]["backends"]["blocked"].get("error", "")
    if "cudnn" in error.lower() or "attention" in error.lower():
      out[name] = {**_time_trainer((*overrides, ("attention_impl", "xla")), shapes),
                   "error_with_auto_attention": error}
    out[name]["wall_s"] = time.perf_counter() - start
    print(f"  trainer {name}: {out[name]['wall_s']:.1f} s", flush=True)
    save(out)
  return out


# ----------------------------------------------------------------------------------------
# Tables.

def print_tables(result: dict) -> None:
  check = result.get("check", {})
  if "grouped_matmul" in check:
    print("\n### check (exit status 1 when a case is not ok)\n")
    print("| case | implementation | max rel err | tolerance | padding rows 0 | ok |")
    print("|---|---|---|---|---|---|")
    for name, c in check["grouped_matmul"].items():
      if "rel_err" in c:
        print(f"| {name} | {c['implementation']} | {max(c['rel_err'].values()):.2e} | "
              f"{c['tolerance']:g} | {c['padding_rows_zero']} | {c['ok']} |")
    bare = check["grouped_matmul"].get("bare_kernel_padding_rows", {})
    print(f"\nbare tokamax.ragged_dot ({bare.get('implementation')}): padding rows nonzero "
          f"{bare.get('nonzero_fraction', float('nan')):.3f}, non-finite "
          f"{bare.get('nonfinite_fraction', float('nan')):.3f}")
    print("\n| layer case | y rel err | max grad rel err | fallback | ok |")
    print("|---|---|---|---|---|")
    for name, c in check.get("layer", {}).items():
      if "y_rel_err" in c:
        print(f"| {name} | {c['y_rel_err']:.2e} | {c['grad_rel_err_max']:.2e} | "
              f"{c['fallback']} | {c['ok']} |")
      else:
        print(f"| {name} | {c['rel_err_max']:.2e} (max) | | | {c['ok']} |")
  gmm = result.get("grouped_matmul", {})
  for layout in ("balanced", "skewed"):
    if layout not in gmm:
      continue
    r = gmm[layout]
    print(f"\n### grouped matmul {gmm['shape']} bf16, {layout} "
          f"({r['useful_rows']} useful rows)\n")
    print("| variant | fwd ms | fwd / dense (p25-p75) | fwd TFLOP/s | fwd+bwd ms | "
          "fwd+bwd / dense (p25-p75) | fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for name, f in r["forward"].items():
      b = r["forward_backward"].get(name)
      bwd = (f"{b['median_s'] * 1e3:.2f} | {b['ratio_median']:.2f} ({b['ratio_p25']:.2f}-"
             f"{b['ratio_p75']:.2f}) | {b['tflops']:.1f}") if b else "- | - | -"
      print(f"| {name} | {f['median_s'] * 1e3:.2f} | {f['ratio_median']:.2f} "
            f"({f['ratio_p25']:.2f}-{f['ratio_p75']:.2f}) | {f['tflops']:.1f} | {bwd} |")
    for name, e in {**r["errors"], **gmm.get("not_run", {})}.items():
      print(f"- {name}: {e}")
  layer = result.get("layer", {})
  if layer.get("steps"):
    print(f"\n### one bf16 layer's value-and-grad {layer['shape']}\n")
    print(f"| variant | median ms | ratio to {layer['baseline']} (p25-p75) | memory MiB |")
    print("|---|---|---|---|")
    for name, s in layer["steps"].items():
      print(f"| {name} | {s['median_s'] * 1e3:.2f} | {s['ratio_median']:.2f} "
            f"({s['ratio_p25']:.2f}-{s['ratio_p75']:.2f}) | {s['memory_MiB']:.0f} |")
  trainer = result.get("trainer", {})
  if trainer:
    print("\n### trainer, one device\n")
    print("| config | gmm | step ms | tokens/s | TFLOP/s/dev | MFU | time / blocked (p25-p75) |")
    print("|---|---|---|---|---|---|---|")
    for name, t in trainer.items():
      if not isinstance(t, dict):
        continue
      for gmm, b in t.get("backends", {}).items():
        if "step_ms" not in b:
          continue
        mfu = "-" if b["mfu"] is None else f"{b['mfu']:.1%}"
        print(f"| {name} ({t['dtype']}) | {gmm} | {b['step_ms']:.1f} | "
              f"{b['tokens_per_s']:,.0f} | {b['tflops_per_device']:.1f} | {mfu} | "
              f"{b['time_ratio_to_blocked']:.2f} ({b['ratio_p25']:.2f}-{b['ratio_p75']:.2f}) |")
      if "skipped" in t:
        print(f"- {name}: skipped, {t['skipped']}")
      for gmm, b in t.get("backends", {}).items():
        if "error" in b:
          print(f"- {name}, {gmm}: {b['error']}")
      if "error_with_auto_attention" in t:
        print(f"- {name}: ran with attention_impl='xla'; with 'auto': "
              f"{t['error_with_auto_attention']}")
  for key in ("check", "grouped_matmul", "layer", "trainer"):
    for what in ("error", "skipped"):
      if isinstance(result.get(key), dict) and what in result[key]:
        print(f"\n{key}: {what}: {result[key][what]}")
  print("\n### section wall times: " + ", ".join(
      f"{k} {v:.0f} s" for k, v in result.get("section_seconds", {}).items()))


# ----------------------------------------------------------------------------------------

def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds (gmm, layer)")
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated subset of {', '.join(SECTIONS)}")
  parser.add_argument("--dry_run", action="store_true",
                      help="small shapes on the CPU (tokamax's XLA reference), few rounds")
  parser.add_argument("--stub_xprof", action="store_true",
                      help="stand in for xprof where it is not installed (tokamax imports it)")
  parser.add_argument("--output", default=None, help="the JSON's path (default: "
                      "benchmarks/results/gpu_native.json; a dry run: the temp folder)")
  parser.add_argument("--budget_s", type=float, default=450.0,
                      help="start no section (and no trainer config) after this many seconds")
  args = parser.parse_args()
  sections = [s for s in args.sections.split(",") if s]
  if unknown := set(sections) - set(SECTIONS):
    parser.error(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
  if args.stub_xprof:
    stub_xprof()
  logging.getLogger("absl").addFilter(_DropCacheMisses())
  from launch.setup import platform
  platform.setup(cpu_devices=1, cpu_only=args.dry_run)
  import jax
  if not args.dry_run and jax.default_backend() != "gpu":
    sys.exit(f"benchmarks.gpu_native needs a GPU (or --dry_run); jax runs on "
             f"{platform.describe()}.")
  shapes = DRY_RUN if args.dry_run else DEVICE
  rounds = min(args.rounds, 3) if args.dry_run else args.rounds
  output = args.output or (os.path.join(tempfile.gettempdir(), "gpu_native_dry_run.json")
                           if args.dry_run else os.path.join(RESULTS, "gpu_native.json"))
  from launch.setup import results  # after the platform is set up: it reads the devices
  result = {"command": results.command(), "commit": results.commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {**results.machine(), "tokamax": tokamax_version()},
            "dry_run": args.dry_run, "rounds": rounds, "section_seconds": {}}
  print(json.dumps({k: result[k] for k in ("command", "commit", "machine")}), flush=True)
  functions = {"check": section_check, "gmm": section_gmm, "layer": section_layer,
               "trainer": section_trainer}
  keys = {"check": "check", "gmm": "grouped_matmul", "layer": "layer", "trainer": "trainer"}
  deadline = time.monotonic() + args.budget_s

  def save(key=None, value=None):
    if key is not None:
      result[key] = value
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
      json.dump(result, f, indent=2)

  failed = []
  for section in sections:
    if time.monotonic() > deadline:
      save(keys[section], {"skipped": "past --budget_s"})
      continue
    start = time.perf_counter()
    try:
      save(keys[section], functions[section](
          shapes=shapes, on_cpu=args.dry_run, rounds=rounds, deadline=deadline,
          save=functools.partial(save, keys[section])))
    except Exception as e:  # noqa: BLE001  (report every section, even when one fails)
      result[keys[section]] = {"error": f"{type(e).__name__}: {str(e)[:1000]}"}
      failed.append(f"{section}: {result[keys[section]]['error']}")
    result["section_seconds"][section] = time.perf_counter() - start
    print(f"[{section}] {result['section_seconds'][section]:.1f} s", flush=True)
    save()
  failed += failed_checks(result.get("check", {}))
  result["failed"] = failed
  save()
  print(json.dumps(result, indent=2))
  print_tables(result)
  print(f"\nwrote {output}")
  if failed:
    print("FAILED: " + "; ".join(failed))
    sys.exit(1)


if __name__ == "__main__":
  main()
