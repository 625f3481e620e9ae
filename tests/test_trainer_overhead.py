"""`benchmarks.trainer_overhead`'s pairing and verdict (the benchmark itself is not run here)."""
import os
import sys

import pytest

from benchmarks.trainer_overhead import run_round, verdict

# Prints a line of noise, then the lowest core it may run on, plus a half.
_REPORT_CORE = [sys.executable, "-c",
                "import os; print('a log line'); print(min(os.sched_getaffinity(0)) + 0.5)"]


def test_a_round_pins_each_run_to_its_core_or_runs_them_in_turn():
  cores = sorted(os.sched_getaffinity(0))  # on a one-core machine both runs get that core
  pinned = run_round([_REPORT_CORE, _REPORT_CORE], [cores[-1], cores[0]])
  assert pinned == [cores[-1] + 0.5, cores[0] + 0.5]
  assert run_round([_REPORT_CORE, _REPORT_CORE], None) == [cores[0] + 0.5] * 2


def test_a_failed_run_names_its_command_and_status():
  with pytest.raises(RuntimeError, match=r"-c import sys; sys.exit\(3\) exited with status 3"):
    run_round([[sys.executable, "-c", "import sys; sys.exit(3)"]], None)


def test_verdict_needs_three_rounds_and_says_whether_the_spread_holds_the_goal():
  assert verdict({"median": 1.0, "p25": 0.9, "p75": 1.1}, 2, 0.98).startswith("no verdict")
  held = verdict({"median": 0.99, "p25": 0.97, "p75": 1.01}, 5, 0.98)
  assert held.startswith("meets the goal: on / off median 0.990") and "more rounds" in held
  clear = verdict({"median": 0.95, "p25": 0.93, "p75": 0.96}, 5, 0.98)
  assert clear.startswith("misses the goal") and "the spread is clear of the goal" in clear
