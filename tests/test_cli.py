"""The entry points' command line (`launch.setup.cli`, `launch.setup.settings`): every user mistake
is one line on stderr, exit status 2 for flag misuse and 1 for an invalid value, no traceback, no
usage dump. In this process where the parsing is the subject; three subprocesses prove the exit
status and the streams of the real commands."""
import os
import re
import subprocess
import sys

import ml_collections
import pytest
from absl import app, flags
from absl.testing import flagsaver

from launch import aot, capacity  # noqa: F401  (their flags)
from launch.setup import cli, settings
from launch.configs import tiny
from launch.setup.errors import UserError, user_errors
from tests.helpers import ROOT


def parse_fails(capsys, monkeypatch, *args: str) -> tuple[int, str]:
  """`cli.parse` of `prog ARGS`, which must end the program: (exit status, its stderr)."""
  argv = ["prog", *args]
  monkeypatch.setattr(sys, "argv", argv)  # where ml_collections reads overrides from
  with flagsaver.flagsaver(), pytest.raises(SystemExit) as exit_:
    cli.parse(argv)
  return exit_.value.code, capsys.readouterr().err


def one_line(stderr: str) -> str:
  """The message of the one line `stderr` must be."""
  assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
  program, message = stderr[:-1].split(": error: ", 1)
  assert program and " " not in program, stderr
  return message


@pytest.mark.parametrize("args,message", [
    (["--nosuch=1"], "Unknown command line flag 'nosuch' (--help lists the flags)"),
    (["--time_steps=x"], "flag --time_steps=x: invalid literal for int() with base 10: 'x'"),
    (["--format=csv"], "flag --format=csv: value should be one of <table|json>"),
    # launch.aot's --config, on its default file (launch/configs/maverick.py).
    (["--config.moe.num_expert=4"], "--config.moe.num_expert: no such config key (closest: "
                                    "config.moe.num_experts, "),
    (["--config.train_steps=abc"], "--config.train_steps=abc: not a valid int (the key holds "
                                   "250000; --print_config lists every key and its value)."),
    (["--config.moe.use_ring_of_experts=maybe"], "--config.moe.use_ring_of_experts=maybe: not "
                                                 "a valid bool"),
    (["--config.moe=1"], "--config.moe is a section: set its keys (a2a_impl, "),
])
def test_flag_misuse_is_one_line_exit_2(capsys, monkeypatch, args, message):
  status, stderr = parse_fails(capsys, monkeypatch, *args)
  assert status == cli.FLAG_MISUSE
  assert one_line(stderr).startswith(message)


def test_a_missing_config_file_names_the_shipped_ones(capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  status, stderr = parse_fails(capsys, monkeypatch, "--config=launch/configs/tny.py")
  assert status == cli.USER_ERROR
  assert one_line(stderr) == (
      f"--config=launch/configs/tny.py: no such file (from {tmp_path}). Shipped configs: "
      f"default.py, demo.py, maverick.py, scout.py, tiny.py, tpu_chip.py in {ROOT}/launch/configs.")


@pytest.mark.parametrize("source,message", [
    ("def get_config(:\n", r"line 1: .*; a config file is Python with a get_config\(\)\."),
    ("CONFIG = {}\n", r"defines no get_config\(\)\. Shipped configs: default\.py"),
])
def test_a_config_file_that_gives_no_config_is_one_line(capsys, monkeypatch, tmp_path, source,
                                                        message):
  path = tmp_path / "bad.py"
  path.write_text(source)
  status, stderr = parse_fails(capsys, monkeypatch, f"--aot_config={path}")
  assert status == cli.USER_ERROR
  line = one_line(stderr)
  assert line.startswith(f"--aot_config={path}: ") and re.search(message, line), line


def test_the_default_config_is_found_from_another_folder(tmp_path, monkeypatch):
  """launch.aot's --config without a value: its shipped default, with the overrides applied
  in order (either form, `--config.KEY=V` and `--config.KEY V`), wherever the command runs."""
  monkeypatch.chdir(tmp_path)
  # --workdir: launch.capacity's required flag (one flag registry for the modules loaded here).
  argv = ["prog", "--workdir=unused", "--config.moe.ragged_buffer_factor=1.75",
          "--config.data.seq_len", "64", "--config.moe.ragged_buffer_factor=1.5"]
  with flagsaver.flagsaver():
    assert cli.parse(argv) == ["prog"]
    config = aot._CONFIG.value
    assert config.moe.ragged_buffer_factor == 1.5 and config.data.seq_len == 64
    assert config.num_layers == 48  # maverick.py


def test_the_config_file_is_loaded_once(monkeypatch):
  """The file runs once however many overrides the command line has."""
  loads = []
  load = settings.load
  monkeypatch.setattr(settings, "load", lambda *a, **k: loads.append(a) or load(*a, **k))
  with flagsaver.flagsaver():
    cli.parse(["prog", "--workdir=unused", "--config.train_steps=3", "--config.seed=4"])
  assert [a[0] for a in loads] == [f"{ROOT}/launch/configs/maverick.py"]
  assert aot._CONFIG.value.train_steps == 3 and aot._CONFIG.value.seed == 4


def test_config_flag_help_lists_the_shipped_configs_and_print_config():
  help_text = flags.FLAGS["config"].help
  assert (f"Shipped configs: default.py, demo.py, maverick.py, scout.py, tiny.py, tpu_chip.py in {ROOT}/launch/configs"
          in help_text)
  assert "--print_config" in help_text
  assert flags.FLAGS["config"].default == f"{ROOT}/launch/configs/maverick.py"


def raising(error: Exception):
  """A main that raises `error`."""
  def main(argv):
    raise error
  return main


@pytest.mark.parametrize("error,status", [
    (UserError("config.train_steps=0 must be >= 1."), cli.USER_ERROR),
    (app.UsageError("--a and --b go together."), cli.USER_ERROR),
    (app.UsageError("--a and --b go together.", exitcode=2), cli.FLAG_MISUSE),
])
def test_a_mains_user_error_is_one_line(capsys, error, status):
  with pytest.raises(SystemExit) as exit_:
    cli.one_line_errors(raising(error))(["prog"])
  assert exit_.value.code == status
  assert one_line(capsys.readouterr().err) == str(error)


def test_a_mains_bug_keeps_its_traceback():
  with pytest.raises(ZeroDivisionError):
    cli.one_line_errors(raising(ZeroDivisionError("a bug")))(["prog"])


def test_arguments_that_are_not_flags_are_flag_misuse(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.one_line_errors(raising(AssertionError("not reached")))(["prog", "train", "fast"])
  assert exit_.value.code == cli.FLAG_MISUSE
  assert one_line(capsys.readouterr().err).startswith("unexpected arguments train fast: ")


def test_user_errors_turns_value_errors_into_user_errors():
  with pytest.raises(UserError, match=r"^config.x=1 must be 2\.$"):
    with user_errors():
      raise ValueError("config.x=1 must be 2.")
  with pytest.raises(KeyError):
    with user_errors():
      raise KeyError("a bug")


def test_print_config_lines_set_every_key():
  lines = settings.as_flags(tiny.get_config())
  assert "--config.moe.num_experts=8" in lines and "--config.dtype=float32" in lines
  assert "--config.data.pattern=''" in lines  # an empty string, as a shell reads it
  assert "--config.moe.use_ring_of_experts=False" in lines
  nested = ml_collections.ConfigDict(dict(a=1, b=dict(c="x y", d=dict(e=0.5))))
  assert settings.as_flags(nested, "cfg") == ["--cfg.a=1", "--cfg.b.c='x y'",
                                              "--cfg.b.d.e=0.5"]


def test_capacity_aot_config_without_topology_is_flag_misuse(tmp_path):
  with flagsaver.flagsaver():
    cli.parse(["capacity", f"--workdir={tmp_path}", f"--aot_config={ROOT}/launch/configs/tiny.py"])
    with pytest.raises(app.UsageError, match="go together") as raised:
      capacity.main(["capacity"])
  assert raised.value.exitcode == cli.FLAG_MISUSE


def command(module: str, *args: str, cwd=ROOT) -> subprocess.CompletedProcess:
  """`python -m MODULE ARGS` run from `cwd`, the package importable."""
  return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True,
                        text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})


def assert_no_traceback_or_usage(stderr: str) -> None:
  for text in ("Traceback", "flags:", "USAGE", "Try --help"):
    assert text not in stderr, stderr


def test_invalid_config_value_from_another_folder(tmp_path):
  """The default config (found from /tmp), a bad value: the trainer's message is the last line
  of stderr, exit status 1."""
  done = command("launch.train", f"--workdir={tmp_path}/run", "--config.moe.num_experts=12",
                 cwd=tmp_path)
  assert done.returncode == cli.USER_ERROR, done.stderr
  assert done.stderr.splitlines()[-1] == ("launch.train: error: MoEConfig.num_experts=12 must "
                                          "be divisible by the size of mesh axis 'expert' (8).")
  assert_no_traceback_or_usage(done.stderr)


def test_unknown_flag_exit_2():
  done = command("launch.train", "--workdir=unused", "--nosuch=1")
  assert (done.returncode, done.stderr) == (
      cli.FLAG_MISUSE, "launch.train: error: Unknown command line flag 'nosuch' (--help lists "
                       "the flags)\n")


def test_demo_bad_flag_is_one_line_exit_1():
  """The demo's layer comes from its config, checked by the launcher's one path."""
  done = command("launch.demo", "--config.moe.num_experts_per_tok=0")
  assert (done.returncode, done.stderr.splitlines()[-1]) == (
      cli.USER_ERROR, "launch.demo: error: MoEConfig.num_experts_per_tok=0 is invalid: must be a "
                      "positive integer.")


def test_train_without_config_resumes_with_the_runs_record(tmp_path):
  """`launch.train --workdir=W` without --config takes W/config.json (the run's record, here
  with train_steps=0, so the start stops in one line before compiling: proof it was read),
  its --config.KEY overrides applied on top; a workdir without one gets default.py."""
  config = tiny.get_config()
  config.train_steps = 0
  settings.save(config, str(tmp_path))
  run = lambda *flags: subprocess.run(
      [sys.executable, "-m", "launch.train", f"--workdir={tmp_path}", *flags], cwd=ROOT,
      capture_output=True, text=True, timeout=300)
  done = run("--config.seed=3")
  assert done.returncode == 1, done.stderr[-2000:]
  assert done.stdout.startswith(f"config: {tmp_path}/config.json (the run's record")
  assert done.stderr.strip().splitlines()[-1] == ("launch.train: error: config.train_steps=0 "
                                                  "must be > 0.")
  explicit = run("--config=launch/configs/tiny.py", "--config.train_steps=0")
  assert "the run's record" not in explicit.stdout and explicit.returncode == 1
