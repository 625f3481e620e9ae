"""Seconds per train step at each buffer factor, from a run's own timed intervals.

The trainer times every clean fetch interval (`metrics.traffic.Timings`: n steps at one factor
f, K fallback chunks run in them, summed over steps and MoE layers, and the wall time). Per
interval the model is

  seconds = n * capped(f) + K * chunk(f)

`capped(f)` is a step whose layers all fit their buffers; `chunk(f)` one chunk of a layer's
fallback. Both are fitted per measured factor by least squares (`fit_factor`), with standard
errors from the residuals. To price a factor that has not run (`StepTimeModel`):

* `capped(f)`: the fit where f was measured; else the nearest measured factor's, scaled by the
  capped steps timed at f and at it (`timed`: `launch.planning.capped_timing` on this
  machine); else, with two or more measured factors whose errors are known, a line in f
  through their fits (weighted by their errors); else the measured time scaled by the step's
  matmul FLOPs at f over those at the measured factor. FLOPs:
  `StepFlops.fixed + f * StepFlops.per_factor` (`step_flops`): the expert matmuls over the
  receive buffer, whose rows are f x balanced; the rest does not depend on f. The FLOPs
  overstate a bigger buffer's cost where the grouped matmul skips its empty rows (measured on
  this CPU: +30% a unit of factor against +5-8%), so scaled down to a smaller buffer they
  give a lower bound of its step, not an estimate (`lower_bound`; scaled up, an upper bound).
* `chunk(f)`: a chunk runs one MoE layer's experts over a buffer of R(f) rows, so its time is
  proportional to f: the measured chunk times over their factors, averaged, times f. Where no
  interval separates the chunk's time from the step's (no fallback ran, or the fallback ran
  in the same proportion in every interval), a chunk is priced as one MoE layer's share of
  the capped step's row-proportional FLOPs.

`step(f, chunks_per_step)` adds the capped step and the expected fallback chunks per step at f:
the overflowing layers per step, replayed from the traffic (`launch.capacity`, the autopilot's
window), times `fallback_chunks(f)`.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Mapping, NamedTuple, Sequence

import haiku as hk
import ml_collections
import numpy as np

import moe_hk
from launch.training import model
from metrics import factor_advice
from metrics.traffic import Timings
from moe_hk import dispatch_plan, fallback


class Estimate(NamedTuple):
  seconds: float
  se: float  # standard error, from the spread of the intervals


class FactorFit(NamedTuple):
  """What the timed intervals at one factor say."""
  factor: float
  capped: Estimate          # seconds of a step without fallback
  chunk: Estimate | None    # seconds of one fallback chunk; None: not separable here
  intervals: int


class StepFlops(NamedTuple):
  """Matmul FLOPs of one train step: `fixed + factor * per_factor`."""
  fixed: float
  per_factor: float
  moe_layers: int

  def at(self, factor: float) -> float:
    return self.fixed + factor * self.per_factor

  def row_share(self, factor: float) -> float:
    """Share of the capped step's FLOPs that runs over the buffers' rows at `factor`."""
    return factor * self.per_factor / self.at(factor)


def step_flops(params: hk.Params, config: ml_collections.ConfigDict,
               layer: moe_hk.MoEConfig) -> StepFlops:
  """Matmul FLOPs of a train step of `config`'s model (MoE layers `layer`) with `params`
  (arrays or shapes): 6 x parameters x tokens (forward and backward) plus attention's, the
  routed experts' part per unit of buffer factor (at factor 1 the buffers hold the balanced
  K / E of the tokens per expert)."""
  total, routed = model.parameter_counts(params)
  tokens = config.data.batch_size * config.data.seq_len
  share = layer.num_experts_per_tok / layer.num_experts
  return StepFlops(6.0 * (total - routed) * tokens + model.attention_flops(config),
                   6.0 * routed * share * tokens,
                   moe_layers=config.num_layers // config.moe_every)


def fallback_chunks(factor: float, *, tokens_per_device: int, seq_len: int, k: int, shards: int,
                    local_experts: int, requested: int) -> float:
  """Chunks one layer's fallback runs at `factor`: the fixed fallback's count for the buffer of
  that factor (`moe_hk.fallback.fallback_num_chunks`; `requested` > 0: that count), NaN when
  no fallback fits the buffer. With adaptive chunking it is the most a fallback runs: the
  fixed rung bounds every rung's chunks."""
  try:
    rows = dispatch_plan.buffer_rows(shards, tokens_per_device, k, local_experts, factor)
    return float(fallback.fallback_num_chunks(
        batch=tokens_per_device // seq_len, seq=seq_len, k=k, shards=shards,
        local_experts=local_experts, rows=rows, requested=requested))
  except ValueError:
    return math.nan


def fit_factor(timings: Timings, factor: float, chunk_prior: float) -> FactorFit | None:
  """Least squares over the intervals at `factor`; `chunk_prior` is a chunk's time as a
  fraction of a capped step's, used when the intervals cannot separate the two. None when no
  interval ran at `factor`."""
  at = np.isclose(timings.factors, factor)
  n, chunks, seconds = (np.asarray(a, np.float64)[at] for a in
                        (timings.steps, timings.chunks, timings.seconds))
  m = len(seconds)
  if m == 0:
    return None
  per_step = seconds / n
  ratio = chunks / n
  if m >= 3 and np.ptp(ratio) > 0:
    design = np.stack([n, chunks], axis=1)
    theta, *_ = np.linalg.lstsq(design, seconds, rcond=None)
    sigma2 = float(np.sum((seconds - design @ theta) ** 2)) / (m - 2)
    cov = sigma2 * np.linalg.inv(design.T @ design)
    return FactorFit(float(factor), Estimate(float(theta[0]), math.sqrt(cov[0, 0])),
                     Estimate(float(theta[1]), math.sqrt(cov[1, 1])), m)
  # One unknown: the step's time, a chunk priced at `chunk_prior` steps.
  capped = per_step / (1.0 + chunk_prior * ratio)
  se = float(np.std(capped, ddof=1) / math.sqrt(m)) if m > 1 else math.inf
  return FactorFit(float(factor), Estimate(float(np.mean(capped)), se), None, m)


class StepTimeModel:
  """Predicted seconds per step at any buffer factor (module docstring)."""

  def __init__(self, timings: Timings, flops: StepFlops,
               timed: Mapping[float, float] | None = None):
    self.flops = flops
    self.timed = dict(timed or {})  # factor -> seconds of a capped step, timed apart
    self.fits = [fit for f in sorted(set(np.asarray(timings.factors).tolist()))
                 if (fit := fit_factor(timings, f, self._chunk_prior(f))) is not None]
    if not self.fits:
      raise ValueError("no timed interval: the model needs at least one (metrics.traffic "
                       "records one per fetch that ran one program and nothing else).")

  def _chunk_prior(self, factor: float) -> float:
    """A chunk's time as a fraction of a capped step's: one MoE layer's row-proportional
    share of the step's FLOPs."""
    return self.flops.row_share(factor) / self.flops.moe_layers

  def capped(self, factor: float) -> Estimate:
    """A capped step at `factor`: the fit where the run measured it; else scaled from a
    measured factor by the capped steps timed at both (`timed`); else a line through two or
    more measured factors with known errors; else scaled from the measured factor by the
    matmul FLOPs (`basis` says which)."""
    fits = {fit.factor: fit.capped for fit in self.fits}
    measured = next((f for f in fits if math.isclose(f, factor)), None)
    if measured is not None:
      return fits[measured]
    timed = self._timed_base(factor)
    if timed is not None:
      base, scale = timed
      return Estimate(fits[base].seconds * scale, fits[base].se * scale)
    known = {f: e for f, e in fits.items() if math.isfinite(e.se)}
    if len(known) >= 2:
      return _line(known, factor)
    base = self._flops_base(factor)
    scale = self.flops.at(factor) / self.flops.at(base)
    return Estimate(fits[base].seconds * scale, fits[base].se * scale)

  def _flops_base(self, factor: float) -> float:
    """The measured factor the FLOPs scale to `factor` from: the one whose error is known
    (the FLOPs are used with at most one), else the nearest measured."""
    known = [fit.factor for fit in self.fits if math.isfinite(fit.capped.se)]
    return known[0] if known else min((fit.factor for fit in self.fits),
                                      key=lambda f: abs(f - factor))

  def lower_bound(self, factor: float) -> bool:
    """Whether `capped(factor)` is only a lower bound: the FLOPs scaled down to a smaller
    buffer than the measured one overstate its saving (module docstring)."""
    return self.basis(factor) == "flops" and factor < self._flops_base(factor)

  def basis(self, factor: float) -> str:
    """What `capped(factor)` rests on: 'measured' (the run's intervals at it), 'timed' (capped
    steps timed apart), 'line' (two or more measured factors), or 'flops' (one measured factor
    scaled by the matmul FLOPs: they overstate a bigger buffer's cost)."""
    fits = {fit.factor: fit.capped for fit in self.fits}
    if any(math.isclose(f, factor) for f in fits):
      return "measured"
    if self._timed_base(factor) is not None:
      return "timed"
    return "line" if sum(math.isfinite(e.se) for e in fits.values()) >= 2 else "flops"

  def _timed_base(self, factor: float) -> tuple[float, float] | None:
    """(the measured factor nearest `factor` whose capped step was timed apart too, the timed
    steps' ratio of `factor` over it), or None when `factor` was not timed."""
    timed = lambda f: next((s for t, s in self.timed.items() if math.isclose(t, f)), None)
    at = timed(factor)
    bases = [fit.factor for fit in self.fits if timed(fit.factor) is not None]
    if at is None or not bases:
      return None
    base = min(bases, key=lambda f: abs(f - factor))
    return base, at / timed(base)

  def chunk(self, factor: float) -> Estimate:
    per_factor = [(fit.chunk.seconds / fit.factor, fit.chunk.se / fit.factor)
                  for fit in self.fits if fit.chunk is not None]
    if not per_factor:
      capped = self.capped(factor)
      prior = self._chunk_prior(factor)
      return Estimate(capped.seconds * prior, capped.se * prior)
    value, se = _weighted_mean(per_factor)
    return Estimate(value * factor, se * factor)

  def step(self, factor: float, chunks_per_step: float) -> Estimate:
    """Seconds of a step at `factor` whose fallbacks run `chunks_per_step` chunks on average."""
    return _with_chunks(self.capped(factor), self.chunk(factor), chunks_per_step)


def _with_chunks(capped: Estimate, chunk: Estimate, chunks_per_step: float) -> Estimate:
  """A capped step plus `chunks_per_step` fallback chunks."""
  return Estimate(capped.seconds + chunks_per_step * chunk.seconds,
                  math.hypot(capped.se, chunks_per_step * chunk.se))


def _weights(ses: Sequence[float]) -> np.ndarray:
  """Inverse-variance weights; equal where an error is zero or unknown."""
  ses = np.asarray(ses, np.float64)
  if np.all(np.isfinite(ses) & (ses > 0)):
    return 1.0 / ses ** 2
  return np.ones_like(ses)


def _weighted_mean(values: list[tuple[float, float]]) -> tuple[float, float]:
  x, ses = map(np.asarray, zip(*values))
  w = _weights(ses)
  mean = float(np.sum(w * x) / np.sum(w))
  finite = np.isfinite(ses)
  se = float(np.sqrt(np.sum((w * np.where(finite, ses, 0.0)) ** 2)) / np.sum(w))
  return mean, se if np.all(finite) else math.inf


def _line(points: dict[float, Estimate], factor: float) -> Estimate:
  """Weighted least-squares line through `{factor: estimate}` (two or more), at `factor`."""
  f = np.asarray(list(points), np.float64)
  y = np.asarray([e.seconds for e in points.values()])
  w = _weights([e.se for e in points.values()])
  design = np.stack([np.ones_like(f), f], axis=1)
  normal = design.T @ (w[:, None] * design)
  theta = np.linalg.solve(normal, design.T @ (w * y))
  x = np.array([1.0, factor])
  ses = np.asarray([e.se for e in points.values()])
  if np.all(np.isfinite(ses) & (ses > 0)):
    se = math.sqrt(float(x @ np.linalg.inv(normal) @ x))
  else:
    se = math.inf
  return Estimate(float(x @ theta), se)


def rule_price(timings: Timings, flops: StepFlops, chunks: Callable[[float], float],
               timed: Mapping[float, float] | None = None) -> factor_advice.Price | None:
  """The factor rule's price (`metrics.factor_advice.Price`) from timed intervals:
  `StepTimeModel.step` at a factor whose overflowing layers per step each run
  `chunks(factor)` fallback chunks (NaN: no fallback fits that factor's buffer, so it is not
  priced), and whether it is only a lower bound (`StepTimeModel.lower_bound`); None without a
  timed interval. What depends on the factor alone is computed once per factor (the telemetry
  prices every candidate at every step)."""
  if not len(timings.seconds):
    return None
  model = StepTimeModel(timings, flops, timed)

  @functools.cache
  def at(factor: float) -> tuple[float, Estimate, Estimate, bool] | None:
    per_layer = chunks(factor)
    if not math.isfinite(per_layer):
      return None
    return per_layer, model.capped(factor), model.chunk(factor), model.lower_bound(factor)

  def price(factor: float, overflowing_layers: float) -> tuple[float, float, bool]:
    known = at(factor)
    if known is None:
      return math.nan, math.nan, False
    per_layer, capped, chunk, lower_bound = known
    return (*_with_chunks(capped, chunk, overflowing_layers * per_layer), lower_bound)
  return price
