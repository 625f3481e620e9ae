"""The trainer's finished steps as records (`launch.run.records`), handed by the
`Reporter` to every consumer registered in `Hooks`, in order, each step before the fetch; how a
fetch's time may be read; what a fetch tells the loop; the `Totals` consumer; the trainer's own
consumers and their order. Host-only: fake fetched outputs, no compile."""
import types

import numpy as np
import pytest

from launch.run import console as console_lib, consumers, trainer
from launch.run.hooks import Hook, Hooks
from launch.model.spikes import SpikeCheck
from launch.model.train_step import StepOutputs
from launch.run.loop import Run
from launch.run.records import Pending
from launch.run.reporter import Reporter
from moe_hk.stats import MoEStats
from tests.helpers import settings_of, tiny_config

LAYERS, EXPERTS = 2, 8  # the tiny config's (the trainer's traffic recording checks them)


def _stats(fallback=(0, 0), dropped=(0, 0)) -> MoEStats:
  """A step's stacked `MoEStats` `[layers, ...]`, numpy."""
  zeros = np.zeros(LAYERS, np.int32)
  return MoEStats(
      fallback=np.asarray(fallback, np.int32), required_factor=np.ones(LAYERS, np.float32),
      would_drop_rows=np.asarray(dropped, np.int32), dropped_rows=np.asarray(dropped, np.int32),
      tokens_per_expert=np.ones((LAYERS, EXPERTS), np.int32), nonfinite_tokens=zeros,
      lb_loss=np.zeros(LAYERS, np.float32), z_loss=np.zeros(LAYERS, np.float32),
      fallback_chunks=np.asarray(fallback, np.int32) * 4,
      router_entropy=np.zeros(LAYERS, np.float32),
      receiver_overflow_rows=np.zeros((LAYERS, 2), np.int32),
      routed_rows_per_device=np.zeros((LAYERS, 8, EXPERTS), np.int32))


def _pending(step: int, *, skipped=False, spike=None, dropless=None, compile_seconds=None,
             **stats) -> Pending:
  """Step `step`'s outputs as fetched (numpy), loss `2 + step`, run at factor 1.5."""
  check = None if spike is None else SpikeCheck(
      np.bool_(spike), np.float32([2.0, 0.5]), np.float32([0.1, 0.1]))
  out = StepOutputs(
      loss=np.float32(2.0 + step), grad_norm=np.float32(0.5), learning_rate=np.float32(1e-3),
      skipped=np.bool_(skipped), moe_stats=_stats(**stats), spike=check,
      dropless=None if dropless is None else np.bool_(dropless))
  return Pending(step, out, factor=1.5, compile_seconds=compile_seconds)


class _Log(Hook):
  """Writes down what reaches it, into a log shared with other consumers."""

  def __init__(self, name: str, log: list):
    self.name, self.log = name, log

  def on_step(self, record):
    self.log.append((self.name, "step", record))

  def on_interval(self, interval):
    self.log.append((self.name, "interval", interval))


class _Compiles:
  """A stand-in for the autopilot's compile counter (started, whether one is under way)."""

  def __init__(self):
    self.started, self.busy = 0, False

  def __call__(self):
    return self.started, self.busy


def _reporter(*names):
  log, hooks, compiles = [], Hooks(), _Compiles()
  for name in names:
    hooks.add(name, _Log(name, log))
  return Reporter(hooks, compiles), log, compiles


def test_every_consumer_gets_each_step_in_order_then_the_fetch():
  """One registration is all a consumer needs: it gets every step's record, after the ones
  registered before it, and the fetch once every step went round."""
  reporter, log, _ = _reporter("first", "second")
  pending = [_pending(0), _pending(1, fallback=(0, 1)), _pending(2, dropped=(3, 0))]
  reporter.flush(pending)
  assert pending == []  # emptied
  assert [(name, kind, getattr(r, "step", None)) for name, kind, r in log] == [
      ("first", "step", 0), ("second", "step", 0), ("first", "step", 1), ("second", "step", 1),
      ("first", "step", 2), ("second", "step", 2), ("first", "interval", None),
      ("second", "interval", None)]
  records = [r for name, kind, r in log if name == "first" and kind == "step"]
  assert [r.loss for r in records] == [2.0, 3.0, 4.0] and all(type(r.loss) is float
                                                              for r in records)
  assert [r.fell_back for r in records] == [False, True, False]
  assert [r.dropped_rows for r in records] == [0, 0, 3]
  assert all(r.spike is None and r.dropless is None and r.factor == 1.5 for r in records)
  interval = log[-1][2]
  assert interval.steps == tuple(records) and interval.last is records[-1]
  # The same record objects reach every consumer: built once.
  assert all(a is b for a, b in zip(records, [r for n, k, r in log if n == "second" and
                                              k == "step"]))


def test_spike_and_step_mode_fields():
  reporter, log, _ = _reporter("only")
  reporter.flush([_pending(0, spike=True, dropless=True), _pending(1, spike=False,
                                                                    dropless=False)])
  spiked, calm = (r for _, kind, r in log if kind == "step")
  assert spiked.spiked and spiked.unapplied and spiked.spike.mean == pytest.approx((2.0, 0.5))
  assert not calm.spiked and not calm.unapplied
  assert (spiked.dropless, calm.dropless) == (True, False)


def test_how_a_fetchs_time_may_be_read():
  """The first fetch compiled the step: not timed. Then timed and clean, unless something
  else happened in it (an eval, a checkpoint: `disturbed`), a background compile was under
  way (at either end, or at both: one still compiling across fetches) or started, even by a
  consumer of its own steps, or a stop cut it short."""
  reporter, log, compiles = _reporter("only")
  def fetch(**kwargs):
    reporter.flush([_pending(len(log))], **kwargs)
    return log[-1][2]
  first = fetch()
  assert (first.timed, first.clean) == (False, False)
  second = fetch()
  assert (second.timed, second.clean) == (True, True)
  reporter.disturbed()
  assert (fetch().timed, log[-1][2].clean) == (True, False)
  assert fetch().clean
  compiles.busy = True
  assert not fetch().clean
  assert not fetch().clean  # still under way: the same compile at both ends
  compiles.busy = False
  assert not fetch().clean  # it was under way at the fetch's start
  assert fetch().clean
  class StartsACompile(Hook):
    def on_step(self, record):
      compiles.started += 1
  reporter.hooks.add("autopilot", StartsACompile())
  assert not fetch().clean
  cut = fetch(stopping=True, cut_short=True)
  assert cut.stopping and not cut.timed


def test_a_name_is_registered_once():
  hooks = Hooks()
  hooks.add("totals", Hook())
  with pytest.raises(ValueError, match=r"Hooks.add\('totals'\): .* names: totals\."):
    hooks.add("totals", Hook())
  assert hooks.names() == ["totals"]


def test_totals_count_the_run():
  totals = consumers.Totals()
  hooks = Hooks()
  hooks.add("totals", totals)
  reporter = Reporter(hooks, lambda: (0, False))
  reporter.flush([_pending(0, fallback=(1, 0)), _pending(1, skipped=True),
                  _pending(2, spike=True), _pending(3, dropped=(2, 5))])
  assert (totals.steps, totals.fallback_steps, totals.dropped_rows) == (4, 1, 7)
  assert (totals.skipped, totals.spikes) == (1, 1)
  assert totals.losses == [2.0, 3.0, 4.0, 5.0]


def test_a_fetch_counts_the_steps_in_a_row_the_state_did_not_take():
  """What the loop stops on, from the fetches' records (no consumer counts it): the steps in a
  row whose update was skipped or caught as a spike, through each fetch's last, carried from
  the fetch before."""
  reporter = Reporter(Hooks(), lambda: (0, False))
  first = reporter.flush([_pending(0, skipped=True), _pending(1, spike=True), _pending(2),
                          _pending(3, skipped=True)])
  assert first.unapplied_in_a_row(0) == 1
  second = reporter.flush([_pending(4, spike=True), _pending(5, skipped=True)])
  assert second.unapplied_in_a_row(first.unapplied_in_a_row(0)) == 3
  assert second.unapplied_in_a_row(0) == 2
  assert reporter.flush([]) is None


class _World:
  """What the trainer's consumers act on, faked: the event writer (`write_scalars`, `flush`),
  the MoE telemetry (`report_step`, `write_expert_load`, its `alerts`' `send`), the evidence
  (`add_interval`) and the autopilot (`step_finished`). Each call goes into `log`, in order."""

  def __init__(self, log: list):
    self.log, self.alerts = log, self

  def write_scalars(self, step, scalars):
    self.log.append(("scalars", step, dict(scalars)))

  def flush(self, wait=True):
    self.log.append(("flush",))

  def report_step(self, step, stats, dropless_steps=None):
    self.log.append(("moe step", step))

  def write_expert_load(self, step):
    self.log.append(("expert load", step))

  def send(self, alert, limited=True):
    self.log.append(("alert", alert.rule, alert.step))

  def add_interval(self, factor, steps, seconds):
    self.log.append(("priced", factor, steps))

  def saw_compile(self, seconds):
    self.log.append(("compiled", seconds))

  def step_finished(self, steps_left):
    self.log.append(("autopilot", steps_left))


class _Terminal:
  """The console's stream: each line it prints goes into `log`."""

  def __init__(self, log: list):
    self.log = log

  def write(self, text):
    if text != "\n":
      self.log.append(("console", text))

  def flush(self):
    pass


def _trainer_hooks(workdir, config, log: list, *, pilot: bool) -> Hooks:
  """`trainer._hooks` of a run of `config` in `workdir`, acting on `_World(log)` (the autopilot
  too when `pilot`), its console printing into `log`."""
  settings = settings_of(config)
  world = _World(log)
  data = types.SimpleNamespace(position=lambda step: {"step": step})
  console = console_lib.Console(config.train_steps, stream=_Terminal(log))
  run = Run(settings, str(workdir), mesh=None, data=data, steps=None, console=console,
            checkpoints=None, restored=None)
  state = types.SimpleNamespace(params={})  # no parameters: the MFU is not the subject here
  return trainer._hooks(run, consumers.Totals(), world, world, world,
                        world if pilot else None, state)


def test_the_trainers_consumers_in_their_order(tmp_path):
  """`trainer._hooks` registers the consumers docs/design.md lists, in that order (the next
  test shows what the order does); the MoE telemetry, the autopilot and the traffic recording
  only when they are on."""
  every = _trainer_hooks(tmp_path / "every", tiny_config(), [], pilot=True)
  assert every.names() == ["totals", "moe_telemetry", "train_scalars", "skip_alerts",
                           "autopilot", "interval_timings", "traffic", "flush_writer",
                           "progress"]
  config = tiny_config(moe_metrics=False)
  config.moe.emit_fallback_events = config.traffic.record = False
  fewest = _trainer_hooks(tmp_path / "fewest", config, [], pilot=False)
  assert fewest.names() == ["totals", "train_scalars", "skip_alerts", "interval_timings",
                            "flush_writer", "progress"]


def test_what_the_trainers_consumers_do_in_order(tmp_path):
  """One clean fetch of a skipped step and a good one through the trainer's own consumers:
  the scalars count the skipped step at that step; each step's MoE telemetry (its evidence,
  its overflow alerts) comes before its skip alert and before the autopilot decides on it (the
  first step's compile time before its decision); the writer's flush comes after the fetch's
  last write (its expert-load image, its rates) and the console's line after everything."""
  log = []
  config = tiny_config()
  steps = config.train_steps  # the autopilot hears the steps left after each
  hooks = _trainer_hooks(tmp_path, config, log, pilot=True)
  reporter = Reporter(hooks, lambda: (0, False))
  reporter.flush([_pending(0, compile_seconds=12.5)])  # compiles: not timed
  assert [entry for entry in log if entry[0] in ("compiled", "autopilot")] == [
      ("compiled", 12.5), ("autopilot", steps - 1)], log
  del log[:]
  reporter.flush([_pending(1, skipped=True), _pending(2)])
  scalars = [(entry[1], entry[2].get("train/skipped_steps")) for entry in log
             if entry[0] == "scalars"]
  assert scalars == [(1, 1), (2, 1), (2, None)], log  # (2, None): the fetch's rates
  shown = {"scalars": 2, "console": 1}  # the entries' fields compared here (the rest above)
  assert [entry[:shown.get(entry[0])] for entry in log] == [
      ("moe step", 1), ("scalars", 1), ("alert", "nonfinite_step", 1), ("autopilot", steps - 2),
      ("moe step", 2), ("scalars", 2), ("autopilot", steps - 3),
      ("expert load", 2), ("scalars", 2), ("priced", 1.5, 2), ("flush",), ("console",)], log
  assert log[-1][1].startswith(f"step 2 (3/{steps}) | loss 4 | "), log[-1]
