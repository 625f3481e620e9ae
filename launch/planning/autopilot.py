"""The buffer-factor autopilot: the factor rule (`metrics.factor_rule`) applied as the run trains.

The run's `metrics.evidence.Evidence` (the window of required factors and fallbacks, the timed
intervals, the factor in force) evaluates the rule once per finished step; one factor serves
every MoE layer, since the layer stack scans identical shapes. `FactorController` moves:

* to the factor the rule names, when it is not the factor in force, once a full `window` of
  steps has passed since the last change (the early router transient passes through the
  window before it can pin a factor) and the factor in force has been timed (so the rule's
  answer weighed it; under the 'fallback_frequency' objective there are no times). A move between two measured factors is taken only
  when its compile pays back, at the measured gain, within the steps left; a factor never
  timed has no price yet: its own intervals then price it, and the rule compares it with the
  factors timed before (and only with those).
* at once, up to the smallest candidate that would have fallen back on at most
  `max_frequency` of the window, when the fallback ran on more than that share of the last
  `window // 4` steps (the guard: the only move that does not wait).

While a window fills after a change, the rule's current answer compiles ahead in the
background, so that the move costs no compile once the window allows it. `ProgramCache`
compiles a candidate's train step off the training thread, checks its memory against a budget
(a program over it is refused for good: `Evidence.refused`) and hands it over at a step
boundary; parameters and optimiser state are untouched (only the MoE buffers change), and
with a fallback every factor is dropless, so no switch changes the math. Host-only: the
compiler is handed in (`launch.compiling.programs`).
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Collection, NamedTuple

from metrics.evidence import Evidence

# 'throughput': the rule with the run's measured step times; 'fallback_frequency': without.
OBJECTIVES = ("throughput", "fallback_frequency")


class MoveEvidence(NamedTuple):
  """What the window showed when a move was decided (the alert's `evidence`)."""
  advice: str                      # why the move: the rule's reason, or the guard's
  window_steps: int                # steps in the window
  recent_steps: int                # the guard's recent steps (window // 4)
  observed_recent_frequency: float # the fallback's share of those
  predicted_frequency: float | None  # the new factor's share of the window (None: not a row)
  max_required_factor: float       # over the window's steps and layers
  measured_step_seconds: dict      # factor ('%g') -> [seconds per step, standard error]
  objective: str                   # 'throughput' or 'fallback_frequency'


class Decision(NamedTuple):
  factor: float       # the factor to move to
  reason: str         # 'frequency' or 'faster' (the rule's answer), 'raise' (the guard)
  evidence: MoveEvidence
  memory_bytes: int | None = None  # per device, of the program switched to (once it is)


def check_settings(section, layer, moe_metrics: bool = True) -> None:
  """Checks `config.autopilot` (`section`) for a run whose MoE layers are `layer`
  (`moe_hk.MoEConfig`) with the MoE telemetry on or off (`moe_metrics`): ValueError naming
  the first bad setting."""
  if section.memory_budget_gib < 0:
    raise ValueError(f"config.autopilot.memory_budget_gib={section.memory_budget_gib} must "
                     "be >= 0.")
  if not 1 <= section.min_steps <= section.window:
    raise ValueError(f"config.autopilot.min_steps={section.min_steps} must be in [1, "
                     f"config.autopilot.window={section.window}].")
  # Checked with the autopilot off too: a value is checked where it is defined, whatever
  # else the config says.
  if section.objective not in OBJECTIVES:
    raise ValueError(f"config.autopilot.objective={section.objective!r} is invalid: must be one "
                     f"of {', '.join(map(repr, OBJECTIVES))}.")
  if not section.enabled:
    return
  if not layer.falls_back or not layer.capped:
    raise ValueError(
        "config.autopilot.enabled=True needs a capped buffer (ragged_buffer_factor > 0) and a "
        "fallback (config.moe.moe_dropless_fallback 'layer' or 'step', not "
        f"{layer.moe_dropless_fallback!r}): a lower factor would otherwise drop rows.")
  if not moe_metrics:
    raise ValueError("config.autopilot.enabled=True needs config.moe_metrics=True: the "
                     "autopilot follows the factor rule on the MoE telemetry's evidence.")
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


class FactorController:
  """Proposes the buffer factor from the run's `evidence`."""

  def __init__(self, evidence: Evidence, *, window: int):
    self.evidence = evidence
    self.window = window
    self.since_change = 0  # finished steps since the last change

  @property
  def factor(self) -> float:
    return self.evidence.factor

  def propose(self, steps_left: int | None = None, compile_seconds: float = 0.0,
              compiled: Collection[float] = ()) -> Decision | None:
    """The factor to move to now, or None to keep the one in force. A move for speed must pay
    back `compile_seconds` (nothing for the factors in `compiled`, whose programs exist)
    within `steps_left` (None: no limit)."""
    ev, rule = self.evidence, self.evidence.rule
    recent = max(1, self.window // 4)
    observed = ev.frequency(recent)
    if ev.steps >= recent and observed > rule.max_frequency:
      up = ev.smallest(above=self.factor, frequency=rule.max_frequency)
      if up is not None:
        why = (f"the fallback ran on {observed:.0%} of the last {recent} steps, over "
               f"max_fallback_frequency {rule.max_frequency:.0%}: the guard raised it to the "
               "smallest factor that would have fallen back on at most that share of the "
               f"last {ev.steps} steps.")
        return Decision(up, "raise", self._evidence(up, why, recent))
    if self.since_change < self.window:
      return None
    return self._follow(steps_left, compile_seconds, compiled)

  def prospect(self, steps_left: int | None = None, compile_seconds: float = 0.0,
               compiled: Collection[float] = ()) -> float | None:
    """While the window fills after a change: the factor the rule would move to now (None:
    none), so that its program can compile ahead."""
    if self.since_change >= self.window:
      return None
    move = self._follow(steps_left, compile_seconds, compiled)
    return None if move is None else move.factor

  def _follow(self, steps_left: int | None, compile_seconds: float,
              compiled: Collection[float]) -> Decision | None:
    """The rule's factor as a move, when it is not the factor in force (and, named for its
    speed, its compile pays back at the measured gain)."""
    advice = self.evidence.advice
    if advice.factor is None or advice.keep:
      return None
    rows = {r.factor: r for r in advice.rows}
    new, now = rows[advice.factor], rows.get(self.factor)
    if self.evidence.priced and (now is None or now.price is None):
      return None  # the factor in force is timed before the rule's answer can leave it
    if new.price is not None and now is not None and now.price is not None:
      # Both measured: the move must pay back its compile at the measured gain.
      gain = now.price.seconds - new.price.seconds
      cost = 0.0 if any(abs(advice.factor - c) < 1e-9 for c in compiled) else compile_seconds
      if steps_left is not None and not (gain > 0 and cost / gain < steps_left):
        return None
    reason = "frequency" if advice.basis == "frequency" else "faster"
    return Decision(advice.factor, reason,
                    self._evidence(advice.factor, advice.reason, max(1, self.window // 4)))

  def _evidence(self, factor: float, why: str, recent: int) -> MoveEvidence:
    """What the alert of a move to `factor` reports."""
    ev = self.evidence
    row = next((r for r in ev.advice.rows if abs(r.factor - factor) < 1e-9), None)
    prices = {f"{f:g}": [p.seconds, p.se] for f, p in ev.prices().items()}
    return MoveEvidence(
        advice=why, window_steps=ev.steps, recent_steps=recent,
        observed_recent_frequency=ev.frequency(recent),
        predicted_frequency=None if row is None else row.fallback_frequency,
        max_required_factor=float(ev.required().max(initial=0.0)),
        measured_step_seconds=prices,
        objective="throughput" if ev.priced else "fallback_frequency")

  def switched(self, factor: float) -> None:
    """The trainer now runs `factor`."""
    self.evidence.set_factor(factor)
    self.since_change = 0


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

  def spare(self) -> bool:
    """Whether the budget holds more than one further compile: one is kept for a decision,
    so a compile ahead (a guess at the rule's answer) never spends the last."""
    return self.max_programs - self.compiled > 1

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

  The trainer calls `step_finished(steps_left)` after each finished step has reached the evidence
  (`saw_compile(seconds)` before, for a step that compiled), and `switch(step)` before every step,
  which returns the program to run from `step` on when a decided factor is compiled and fits, else
  None. `on_change(step, old, new, decision)` is called on every switch (the trainer raises
  `buffer_factor_changed`). With `wait`, a decision waits for its compile (a reproducible factor
  schedule); without, the old program keeps training until the new one is ready.
  """

  def __init__(self, controller: FactorController, cache: ProgramCache, *,
               on_change: Callable[[int, float, float, Decision], None], wait: bool = False):
    self.controller = controller
    self.cache = cache
    self.on_change = on_change
    self.wait = wait
    self._decision: Decision | None = None
    self._ahead: float | None = None  # the factor compiled ahead since the last change
    # What a new program costs, for a move's payback: the longest compile seen (`saw_compile`).
    self.compile_seconds = 0.0

  @property
  def factor(self) -> float:
    return self.controller.factor

  def state_dict(self) -> dict:
    """Steps since the last change and the programs compiled so far (the recompile budget
    spans the whole run, resumes included); the evidence is checkpointed with the metrics."""
    return {"since_change": self.controller.since_change, "compiled": self.cache.compiled}

  def load_state_dict(self, state: dict) -> None:
    # Checkpoints written before `metrics.evidence` nest it under 'controller'.
    old = state.get("controller", {})
    self.controller.since_change = int(state.get("since_change", old.get("since_change", 0)))
    self.cache.compiled = int(state["compiled"])

  def saw_compile(self, seconds: float) -> None:
    """A step compiled its program in `seconds` (its run included)."""
    self.compile_seconds = max(self.compile_seconds, seconds)

  def step_finished(self, steps_left: int) -> None:
    """A step reached the evidence: decide, or compile the likely move ahead. A decision
    whose program is still compiling is dropped when the rule's answer turns meanwhile: to
    the factor in force, or the other way (then the new answer is decided). An answer that
    only moves further the same way keeps it: its program lands, and the next window
    refines it."""
    self.controller.since_change += 1
    known = self.cache.known_factors()
    decision = self.controller.propose(steps_left, self.compile_seconds, known)
    if self._decision is not None:
      up = lambda d: d.factor > self.factor
      if decision is not None and up(decision) == up(self._decision):
        return
      self._decision = None
    if decision is not None:
      if self.cache.request(decision.factor):
        self._decision = decision
    elif self._ahead is None and not self.cache.busy() and self.cache.spare():
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
      self.controller.evidence.refuse(decision.factor)
      return None
    old = self.controller.factor
    self.controller.switched(decision.factor)
    self._ahead = None
    self.on_change(step, old, decision.factor,
                   decision._replace(memory_bytes=program.memory_bytes))
    return program
