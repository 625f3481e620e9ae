"""The buffer-factor autopilot: picks `ragged_buffer_factor` from the measured traffic.

`FactorController` is pure host logic over the per-step required factors (the max over MoE
layers: one factor serves every layer, since the layer stack scans identical shapes). The
factor `f` would have made a recorded step fall back exactly when the step's required factor
exceeds `f` (received rows > floor(N f) <=> received / N > f for whole rows), so the window
predicts each candidate's fallback frequency. Rules:

* lower: once a full `window` of steps has been seen since the last change, to the smallest
  rung of the ladder (multiples of `rung`) whose predicted frequency is at most the target, if
  that is below the factor in force;
* raise: at once, when the fallback ran on more than twice the target fraction of the last
  `window // 4` steps, to the smallest rung above the factor in force whose predicted
  frequency over the window is at most the target.

The hysteresis: a lowered factor is only raised again on twice the target, and only lowered
again after another full window.

`ProgramCache` compiles the train step for a candidate factor in a background thread while
training goes on, checks its compiled memory against a budget, and hands it over at a step
boundary; parameters and optimiser state are untouched (only the MoE buffers change).
Changing the factor never changes the math: the fallback makes every factor dropless.
"""
from __future__ import annotations

import collections
import concurrent.futures
import math
from typing import Any, Callable, NamedTuple

import numpy as np


def ladder(rung: float, worst_case: float) -> np.ndarray:
  """Candidate factors: multiples of `rung` up to the worst case `min(P, E / K)` (included)."""
  top = math.floor(worst_case / rung + 1e-9)
  rungs = rung * np.arange(1, top + 1)
  return rungs if rungs.size and np.isclose(rungs[-1], worst_case) else np.append(rungs,
                                                                                 worst_case)


class Decision(NamedTuple):
  factor: float       # the factor to move to
  reason: str         # 'lower' or 'raise'
  evidence: dict      # what the window showed (for the alert)


def check_settings(*, target: float, window: int, max_programs: int = 1) -> None:
  """Checks the autopilot's settings (`config.autopilot`): ValueError naming the bad one."""
  if not 0 < target < 1:
    raise ValueError(f"config.autopilot.target_fallback_frequency={target} must be in (0, 1).")
  if window < 4:
    raise ValueError(f"config.autopilot.window={window} must be >= 4.")
  if max_programs < 1:
    raise ValueError(f"config.autopilot.max_programs={max_programs} must be >= 1.")


class FactorController:
  """Proposes the buffer factor from the required factors of recent steps."""

  def __init__(self, factor: float, *, target: float, worst_case: float, window: int = 100,
               rung: float = 0.125):
    check_settings(target=target, window=window)
    self.factor = float(factor)
    self.target = target
    self.window = window
    self.ladder = ladder(rung, worst_case)
    self._required = collections.deque(maxlen=window)  # max over layers, per step
    self._fell_back = collections.deque(maxlen=window)
    self._since_change = 0
    self.refused: set[float] = set()  # factors whose program does not fit the budget

  def observe(self, required_factor: float, fell_back: bool) -> None:
    """One finished step: its required factor (max over layers) and whether it fell back."""
    self._required.append(float(required_factor))
    self._fell_back.append(bool(fell_back))
    self._since_change += 1

  def predicted_frequency(self, factor: float) -> float:
    """Fraction of the window's steps that would have fallen back at `factor`."""
    return float(np.mean(np.asarray(self._required) > factor)) if self._required else 0.0

  def _smallest_fitting(self, above: float) -> float | None:
    for f in self.ladder:
      if (f > above + 1e-9 and float(f) not in self.refused and
          self.predicted_frequency(f) <= self.target):
        return float(f)
    return None

  def propose(self) -> Decision | None:
    """The factor to move to now, or None to keep the one in force."""
    short = max(1, self.window // 4)
    recent = list(self._fell_back)[-short:]
    observed = float(np.mean(recent)) if len(recent) == short else 0.0
    evidence = {"window_steps": len(self._required), "observed_recent_frequency": observed,
                "recent_steps": short, "target_fallback_frequency": self.target,
                "max_required_factor": max(self._required, default=0.0)}
    if observed > 2 * self.target:
      up = self._smallest_fitting(above=self.factor)
      if up is not None:
        return Decision(up, "raise",
                        {**evidence, "predicted_frequency": self.predicted_frequency(up)})
    if self._since_change >= self.window:
      down = self._smallest_fitting(above=0.0)
      if down is not None and down < self.factor - 1e-9:
        return Decision(down, "lower",
                        {**evidence, "predicted_frequency": self.predicted_frequency(down)})
    return None

  def switched(self, factor: float) -> None:
    """The trainer now runs `factor`."""
    self.factor = float(factor)
    self._since_change = 0

  def state_dict(self) -> dict:
    return {"factor": self.factor, "required": list(self._required),
            "fell_back": list(self._fell_back), "since_change": self._since_change,
            "refused": sorted(self.refused)}

  def load_state_dict(self, state: dict) -> None:
    self.factor = float(state["factor"])
    self._required.clear()
    self._required.extend(state["required"])
    self._fell_back.clear()
    self._fell_back.extend(bool(v) for v in state["fell_back"])
    self._since_change = int(state["since_change"])
    self.refused = {float(f) for f in state["refused"]}


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
  fields `[layers, ...]`) and `switch(step)` before every step, which returns the program to
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
    self.controller.observe(float(np.max(stats.required_factor)),
                            bool(np.any(np.asarray(stats.fallback) > 0)))
    if self._decision is None:
      decision = self.controller.propose()
      if decision is not None and self.cache.request(decision.factor):
        self._decision = decision

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
    evidence = {**decision.evidence, "memory_bytes_per_device": program.memory_bytes}
    self.on_change(step, old, decision.factor, decision._replace(evidence=evidence))
    return program
