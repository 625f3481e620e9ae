"""The trainer's finished steps as records (`launch.training.step_record`), handed by the
`Reporter` to every consumer registered in `Hooks`, in order, each step before the fetch; how a
fetch's time may be read; the `Totals` consumer. Host-only: fake fetched outputs, no compile."""
import numpy as np
import pytest

from launch.training import step_consumers
from launch.training.reporter import Pending, Reporter
from launch.training.step_hooks import Hook, Hooks
from moe_hk.stats import MoEStats

LAYERS, EXPERTS = 2, 4


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


def _pending(step: int, *, skipped=False, spike=None, dropless=None, **stats) -> Pending:
  out = {"loss": np.float32(2.0 + step), "grad_norm": np.float32(0.5),
         "learning_rate": np.float32(1e-3), "skipped": np.bool_(skipped),
         "moe_stats": _stats(**stats)}
  if spike is not None:
    out.update(spike=np.bool_(spike), spike_mean=np.float32([2.0, 0.5]),
               spike_std=np.float32([0.1, 0.1]))
  if dropless is not None:
    out["dropless"] = np.bool_(dropless)
  return Pending(step, out, factor=1.5)


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
  way or started, even by a consumer of its own steps, or a stop cut it short."""
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
  totals = step_consumers.Totals()
  hooks = Hooks()
  hooks.add("totals", totals)
  reporter = Reporter(hooks, lambda: (0, False))
  reporter.flush([_pending(0, fallback=(1, 0)), _pending(1, skipped=True),
                  _pending(2, spike=True), _pending(3, dropped=(2, 5))])
  assert (totals.steps, totals.fallback_steps, totals.dropped_rows) == (4, 1, 7)
  assert (totals.skipped, totals.spikes, totals.consecutive_skipped) == (1, 1, 0)
  assert totals.losses == [2.0, 3.0, 4.0, 5.0]
  reporter.flush([_pending(4, skipped=True), _pending(5, spike=True)])
  assert totals.consecutive_skipped == 2
