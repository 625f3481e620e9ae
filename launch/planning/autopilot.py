"""The buffer-factor autopilot: picks `ragged_buffer_factor` from the run's own measurements.

`FactorController` is pure host logic over the per-step, per-layer required factors (one
factor serves every layer, since the layer stack scans identical shapes). A layer overflows at
factor `f` exactly when its required factor exceeds `f` (received rows > floor(N f) <=>
received / N > f for whole rows), so the last `window` steps predict, for every candidate, the
fallback frequency (steps with an overflowing layer) and the overflowing layers per step.
Candidates are the multiples of `factor_step` up to the worst case. Two objectives:

* `'throughput'` (the default): the timed fetch intervals (`observe_interval`) fit
  `launch.planning.step_model`'s model, which predicts seconds per step at every candidate
  (the capped step, plus the overflowing layers x the fallback's chunks x a chunk's time).
  Once a full `window` has passed since the last change, move to the factor the shared rule
  names (`metrics.factor_advice`: the fastest whose predicted fallback frequency is at most
  `max_frequency`, when it saves at least `min_gain` of the step and more than twice the
  prediction's standard error), or, when the rule cannot decide because a smaller factor is
  priced only by a lower bound (the FLOPs), to that factor as a trial: its own intervals then
  price it. Either move is made only when its compile pays for itself within the steps left
  at its price (a factor compiled or compiling costs none, so a move that measures slower
  than predicted is undone for free once the new factor's intervals correct the model).
  While the window fills, the move the intervals already favour compiles ahead in the
  background (once per change), so that it costs no compile when the window allows it.
  The guard: when the fallback ran on more than `max_frequency` of the last `window // 4`
  steps, raise at once to the smallest candidate whose predicted frequency is at most
  `max_frequency`.
* `'fallback_frequency'`: lower, once a full window has passed since the last change, to the
  smallest candidate whose predicted frequency is at most `target`; raise at once, when the
  fallback ran on more than twice the target of the last `window // 4` steps, to the smallest
  candidate above the factor in force whose predicted frequency is at most the target.

Either way a change waits a full window (the early router transient passes through the window
before it can pin a factor) and the guard is the only immediate move.

`ProgramCache` compiles the train step for a candidate factor in a background thread while
training goes on, checks its compiled memory against a budget, and hands it over at a step
boundary; parameters and optimiser state are untouched (only the MoE buffers change).
Changing the factor never changes the math: the fallback makes every factor dropless.
"""
from __future__ import annotations

import collections
import concurrent.futures
import math
from typing import Any, Callable, Collection, NamedTuple

import numpy as np

from launch.planning import step_model
from metrics import factor_advice
from metrics.traffic import Timings

OBJECTIVES = ("throughput", "fallback_frequency")


class Decision(NamedTuple):
  factor: float       # the factor to move to
  reason: str         # 'lower', 'raise', or 'faster' or 'trial' (the throughput objective)
  evidence: dict      # what the window showed (for the alert)


def check_settings(section, layer) -> None:
  """Checks `config.autopilot` (`section`) for a run whose MoE layers are `layer`
  (`moe_hk.MoEConfig`): ValueError naming the first bad setting."""
  if section.memory_budget_gib < 0:
    raise ValueError(f"config.autopilot.memory_budget_gib={section.memory_budget_gib} must "
                     "be >= 0.")
  if not section.enabled:
    return
  if layer.moe_dropless_fallback == "none" or not layer.capped:
    raise ValueError(
        "config.autopilot.enabled=True needs a capped buffer (ragged_buffer_factor > 0) and a "
        "fallback (config.moe.moe_dropless_fallback 'layer' or 'step', not "
        f"{layer.moe_dropless_fallback!r}): a lower factor would otherwise drop rows.")
  if section.objective not in OBJECTIVES:
    raise ValueError(f"config.autopilot.objective={section.objective!r} is invalid: must be one "
                     f"of {', '.join(map(repr, OBJECTIVES))}.")
  if not 0 < section.target_fallback_frequency < 1:
    raise ValueError("config.autopilot.target_fallback_frequency="
                     f"{section.target_fallback_frequency} must be in (0, 1).")
  if not 0 < section.max_fallback_frequency <= 1:
    raise ValueError("config.autopilot.max_fallback_frequency="
                     f"{section.max_fallback_frequency} must be in (0, 1].")
  if section.window < 4:
    raise ValueError(f"config.autopilot.window={section.window} must be >= 4.")
  if section.max_programs < 1:
    raise ValueError(f"config.autopilot.max_programs={section.max_programs} must be >= 1.")


class Pricing(NamedTuple):
  """What the throughput objective needs besides the timings."""
  flops: step_model.StepFlops                 # the step's matmul FLOPs per factor
  chunks: Callable[[float], float]           # fallback chunks per overflowing layer at a
                                             # factor (NaN: no fallback fits its buffer)


class FactorController:
  """Proposes the buffer factor from the required factors and timings of recent steps."""

  def __init__(self, factor: float, *, target: float, worst_case: float, window: int = 100,
               factor_step: float = 0.125, objective: str = "fallback_frequency",
               max_frequency: float = 0.5, pricing: Pricing | None = None,
               min_gain: float = 0.03, max_intervals: int = 256):
    # The settings were checked where they are defined (`check_settings`, from the config).
    assert objective in OBJECTIVES and (objective != "throughput" or pricing is not None)
    self.factor = float(factor)
    self.target = target
    self.window = window
    self.objective = objective
    self.max_frequency = max_frequency
    self.pricing = pricing
    self.min_gain = min_gain
    self.worst_case = float(worst_case)
    self.candidates = factor_advice.candidate_factors(worst_case, factor_step)
    self._required = collections.deque(maxlen=window)  # per step: [layers]
    self._matrix: np.ndarray | None = None  # _required as [steps, layers], when built
    self._fell_back = collections.deque(maxlen=window)
    self._intervals = collections.deque(maxlen=max_intervals)  # (factor, steps, chunks, s)
    self._since_change = 0
    self.refused: set[float] = set()  # factors whose program did not fit the budget

  def observe(self, required_factors, fell_back: bool) -> None:
    """One finished step: its required factor per MoE layer (a number: one layer) and whether
    it fell back."""
    self._required.append(tuple(np.atleast_1d(np.asarray(required_factors, float)).tolist()))
    self._matrix = None
    self._fell_back.append(bool(fell_back))
    self._since_change += 1

  def observe_interval(self, factor: float, steps: int, chunks: int, seconds: float) -> None:
    """A cleanly timed fetch interval: `steps` steps at `factor` that ran `chunks` fallback
    chunks (summed over steps and layers) in `seconds`."""
    self._intervals.append((float(factor), int(steps), int(chunks), float(seconds)))

  def _refused(self, factor: float) -> bool:
    """Whether `factor`'s program is known not to fit: memory grows with the factor, so every
    factor from the smallest refused one up."""
    return bool(self.refused) and factor >= min(self.refused) - 1e-9

  def predicted_frequency(self, factor: float) -> float:
    """Fraction of the window's steps that would have fallen back at `factor`."""
    return factor_advice.replay(self._window(), factor)[0]

  def _window(self) -> np.ndarray:
    """The window's required factors `[steps, layers]`."""
    if self._matrix is None:
      # A step restored from a checkpoint written before per-layer factors holds one number
      # (the max over layers): its other layers count as not overflowing.
      width = max((len(r) for r in self._required), default=1)
      self._matrix = np.array([r + (0.0,) * (width - len(r))
                               for r in self._required]).reshape(-1, width)
    return self._matrix

  def timings(self) -> Timings:
    """The observed intervals as `metrics.traffic.Timings`."""
    rows = list(zip(*self._intervals)) or [()] * 4
    factors, steps, chunks, seconds = (np.asarray(c, t) for c, t in
                                       zip(rows, (np.float64, np.int64, np.int64, np.float64)))
    # fallback_steps is not kept: the step-time model needs the chunks only.
    return Timings(factors, steps, np.zeros_like(steps), chunks, seconds)

  def _price(self) -> factor_advice.Price | None:
    """The step-time model of the observed intervals as the rule's price (None before any
    interval ran at the factor in force)."""
    timings = self.timings()
    if self.pricing is None or not np.any(np.isclose(timings.factors, self.factor)):
      return None
    return step_model.rule_price(timings, self.pricing.flops, self.pricing.chunks)

  def advice(self, price: bool = True) -> factor_advice.Advice:
    """The shared rule (`metrics.factor_advice`) on the window: by the observed intervals'
    prices under the throughput objective (when `price` and there are any), else the smallest
    factor whose predicted fallback frequency is at most the target."""
    priced = self._price() if price and self.objective == "throughput" else None
    return factor_advice.advise(
        self._window(), worst_case=self.worst_case, current=self.factor,
        max_frequency=self.max_frequency if priced else 1.0, target=self.target, price=priced,
        min_gain=self.min_gain, fits=lambda f: not self._refused(f), factors=self.candidates)

  def prices(self) -> dict[float, step_model.Estimate]:
    """Predicted seconds per step of every admissible candidate and the factor in force
    (`advice`'s); {} before any interval ran at the factor in force."""
    advice = self.advice()
    if advice.objective != "throughput":
      return {}
    return {c.factor: step_model.Estimate(c.seconds, c.se) for c in advice.candidates
            if math.isfinite(c.seconds) and (c.factor == self.factor or (
                c.fallback_frequency <= self.max_frequency and not self._refused(c.factor)))}

  def _smallest_fitting(self, above: float, frequency: float) -> float | None:
    for f in self.candidates:
      if (f > above + 1e-9 and not self._refused(float(f)) and
          self.predicted_frequency(f) <= frequency):
        return float(f)
    return None

  def propose(self, steps_left: int | None = None, compile_seconds: float = 0.0,
              price: bool = True, compiled: Collection[float] = ()) -> Decision | None:
    """The factor to move to now, or None to keep the one in force. `steps_left` and
    `compile_seconds` (what a new program costs; nothing for the factors in `compiled`, whose
    programs exist) bound the throughput objective's moves; `price=False` skips them (the
    prices change only with a new timed interval, so the autopilot prices once per interval,
    not once per step)."""
    short = max(1, self.window // 4)
    recent = list(self._fell_back)[-short:]
    observed = float(np.mean(recent)) if len(recent) == short else 0.0
    required = [max(r) for r in self._required]
    evidence = {"window_steps": len(self._required), "observed_recent_frequency": observed,
                "recent_steps": short, "objective": self.objective,
                "target_fallback_frequency": self.target,
                "max_fallback_frequency": self.max_frequency,
                "max_required_factor": max(required, default=0.0)}
    guard = 2 * self.target if self.objective == "fallback_frequency" else self.max_frequency
    bound = self.target if self.objective == "fallback_frequency" else self.max_frequency
    if observed > guard:
      up = self._smallest_fitting(above=self.factor, frequency=bound)
      if up is not None:
        return Decision(up, "raise",
                        {**evidence, "predicted_frequency": self.predicted_frequency(up)})
    if self._since_change < self.window:
      return None
    if self.objective == "fallback_frequency":
      down = self.advice().factor
      if down is not None and down < self.factor - 1e-9:
        return Decision(down, "lower",
                        {**evidence, "predicted_frequency": self.predicted_frequency(down)})
      return None
    return self._faster(evidence, steps_left, compile_seconds, compiled) if price else None

  def _move(self, steps_left: int | None, compile_seconds: float,
            compiled: Collection[float]):
    """The throughput objective's move: the rule's factor, else the factor it says to time
    (`Advice.trial`: its intervals then price it), as (factor, its candidate, the factor in
    force's, the compile it costs, the rule's reason, 'faster' or 'trial'), when it differs
    from the factor in force and its compile (none for the factors in `compiled`) pays back
    within `steps_left` at its price; else None."""
    advice = self.advice()
    if advice.objective != "throughput":
      return None
    named = advice.factor not in (None, self.factor)
    factor = advice.factor if named else advice.trial
    if factor is None:
      return None
    by_factor = {c.factor: c for c in advice.candidates}
    new, now = by_factor[factor], by_factor[self.factor]
    cost = 0.0 if any(math.isclose(factor, c) for c in compiled) else compile_seconds
    gain = now.seconds - new.seconds
    if steps_left is not None and not (gain > 0 and cost / gain < steps_left):
      return None
    return factor, new, now, cost, advice.reason, "faster" if named else "trial"

  def _faster(self, evidence: dict, steps_left: int | None, compile_seconds: float,
              compiled: Collection[float]) -> Decision | None:
    """The throughput objective's move after a full window (module docstring)."""
    move = self._move(steps_left, compile_seconds, compiled)
    if move is None:
      return None
    factor, new, now, cost, reason, kind = move
    return Decision(factor, kind, {
        **evidence, "predicted_frequency": new.fallback_frequency, "advice": reason,
        "predicted_step_seconds": {"old": now.seconds, "new": new.seconds},
        "predicted_step_seconds_se": {"old": now.se, "new": new.se},
        "payback_steps": cost / (now.seconds - new.seconds)})

  def prospect(self, steps_left: int | None = None, compile_seconds: float = 0.0,
               compiled: Collection[float] = ()) -> float | None:
    """Under the throughput objective, while a window fills after a change: the factor the
    controller would move to if the window were full (None: none), so that its program can
    compile ahead and the move, once the window allows it, costs no compile."""
    if self.objective != "throughput" or self._since_change >= self.window:
      return None
    move = self._move(steps_left, compile_seconds, compiled)
    return None if move is None else move[0]

  def switched(self, factor: float) -> None:
    """The trainer now runs `factor`."""
    self.factor = float(factor)
    self._since_change = 0

  def state_dict(self) -> dict:
    return {"factor": self.factor, "required": [list(r) for r in self._required],
            "fell_back": list(self._fell_back), "since_change": self._since_change,
            "refused": sorted(self.refused), "intervals": [list(i) for i in self._intervals]}

  def load_state_dict(self, state: dict) -> None:
    self.factor = float(state["factor"])
    self._required.clear()
    # Checkpoints before per-layer factors hold one number (the max over layers) per step.
    self._required.extend(tuple(np.atleast_1d(np.asarray(r, float)).tolist())
                          for r in state["required"])
    self._matrix = None
    self._fell_back.clear()
    self._fell_back.extend(bool(v) for v in state["fell_back"])
    self._since_change = int(state["since_change"])
    self.refused = {float(f) for f in state["refused"]}
    self._intervals.clear()
    self._intervals.extend(tuple(i) for i in state.get("intervals", []))


class Program(NamedTuple):
  """A compiled train step for one buffer factor."""
  factor: float
  step: Any                # callable (state, batch) -> (state, outputs)
  memory_bytes: int | None


class ProgramCache:
  """Compiles train-step programs for candidate factors off the training thread.

  `compile_fn(factor) -> Program` does the lowering and compiling (it runs in a worker
  thread). `request(factor)` starts it unless it is known, under way, or over the recompile
  budget `max_programs`; `ready(factor)` returns the program once compiled and within
  `budget_bytes` (None: no budget), else None; a program over the budget is refused for good.
  """

  def __init__(self, compile_fn: Callable[[float], Program], *, budget_bytes: int | None,
               max_programs: int):
    self._compile = compile_fn
    self.budget_bytes = budget_bytes
    self.max_programs = max_programs
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                       thread_name_prefix="moe-autopilot")
    self._futures: dict[float, concurrent.futures.Future] = {}
    self.compiled = 0

  def add(self, program: Program) -> None:
    """Registers an already-compiled program (the one training starts with)."""
    future = concurrent.futures.Future()
    future.set_result(program)
    self._futures[program.factor] = future

  def compile_now(self, factor: float) -> Program:
    """Compiles `factor` on this thread and registers it (the program a resumed run starts
    with; not counted against the recompile budget)."""
    program = self._compile(factor)
    self.add(program)
    return program

  def request(self, factor: float) -> bool:
    """Starts compiling `factor` in the background; False if the budget forbids it."""
    if factor in self._futures:
      return True
    if self.compiled >= self.max_programs:
      return False
    self.compiled += 1
    self._futures[factor] = self._pool.submit(self._compile, factor)
    return True

  def known_factors(self) -> set[float]:
    """The factors whose programs are compiled or compiling (taking one costs no further
    compile: the cost is sunk)."""
    return {f for f, future in self._futures.items()
            if not future.done() or (not future.cancelled() and future.exception() is None)}

  def busy(self) -> bool:
    """Whether a background compile is under way."""
    return any(not future.done() for future in self._futures.values())

  def ready(self, factor: float) -> Program | None:
    future = self._futures.get(factor)
    if future is None or not future.done():
      return None
    return future.result()

  def wait(self, factor: float) -> None:
    """Blocks until `factor`'s compile (if requested) has finished."""
    future = self._futures.get(factor)
    if future is not None:
      concurrent.futures.wait([future])

  def fits(self, program: Program) -> bool:
    return (self.budget_bytes is None or program.memory_bytes is None or
            program.memory_bytes <= self.budget_bytes)

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)


class Autopilot:
  """The controller and the program cache in the training loop.

  The trainer calls `observe(stats)` for every finished step (the step's `MoEStats`, numpy,
  fields `[layers, ...]`), `observe_interval(...)` for every cleanly timed fetch interval,
  and `switch(step)` before every step, which returns the program to
  run from `step` on when a candidate is compiled and fits, else None. `on_change(step, old,
  new, decision)` is called on every switch (the trainer raises `buffer_factor_changed`).
  With `wait`, a decision waits for its compile (a reproducible factor schedule); without, the
  old program keeps training until the new one is ready.
  """

  def __init__(self, controller: FactorController, cache: ProgramCache, *,
               on_change: Callable[[int, float, float, Decision], None], wait: bool = False):
    self.controller = controller
    self.cache = cache
    self.on_change = on_change
    self.wait = wait
    self._decision: Decision | None = None
    self._ahead: float | None = None  # the factor compiled ahead since the last change
    # What a new program costs, for the throughput objective's payback: the longest compile
    # seen (the trainer sets the first step's).
    self.compile_seconds = 0.0

  @property
  def factor(self) -> float:
    return self.controller.factor

  def state_dict(self) -> dict:
    """The controller's state and the programs compiled so far (the recompile budget spans
    the whole run, resumes included)."""
    return {"controller": self.controller.state_dict(), "compiled": self.cache.compiled}

  def load_state_dict(self, state: dict) -> None:
    self.controller.load_state_dict(state["controller"])
    self.cache.compiled = int(state["compiled"])

  def observe(self, stats) -> None:
    """One finished step's `MoEStats`: the fallback-frequency rules and the guard."""
    self.controller.observe(np.asarray(stats.required_factor, float).reshape(-1),
                            bool(np.any(np.asarray(stats.fallback) > 0)))
    self._propose(price=False)

  def observe_interval(self, factor: float, steps: int, chunks: int, seconds: float,
                       steps_left: int) -> None:
    """A cleanly timed fetch interval (`FactorController.observe_interval`), `steps_left` in
    the run after it: the throughput objective prices the candidates."""
    self.controller.observe_interval(factor, steps, chunks, seconds)
    self._propose(price=True, steps_left=steps_left)

  def _propose(self, price: bool, steps_left: int | None = None) -> None:
    if self._decision is not None:
      return
    known = self.cache.known_factors()
    decision = self.controller.propose(steps_left, self.compile_seconds, price=price,
                                       compiled=known)
    if decision is not None:
      if self.cache.request(decision.factor):
        self._decision = decision
    elif price and self._ahead is None and not self.cache.busy():
      # While the window fills: compile the likely move ahead, once per change.
      ahead = self.controller.prospect(steps_left, self.compile_seconds, known)
      if ahead is not None and self.cache.request(ahead):
        self._ahead = ahead

  def switch(self, step: int) -> Program | None:
    decision = self._decision
    if decision is None:
      return None
    if self.wait:
      self.cache.wait(decision.factor)
    program = self.cache.ready(decision.factor)
    if program is None:
      return None
    self._decision = None
    if not self.cache.fits(program):
      self.controller.refused.add(decision.factor)
      return None
    old = self.controller.factor
    self.controller.switched(decision.factor)
    self._ahead = None
    evidence = {**decision.evidence, "memory_bytes_per_device": program.memory_bytes}
    self.on_change(step, old, decision.factor, decision._replace(evidence=evidence))
    return program
