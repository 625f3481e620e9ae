"""`launch.setup.results`: the commit a result is stamped with."""
import json
import os
import subprocess

from launch.setup import results


def _git(root, *args):
  return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                        check=True).stdout.strip()


def test_rewriting_a_committed_result_stamps_the_clean_commit(tmp_path, monkeypatch):
  """Overwriting a committed result from a clean checkout records that commit, not
  `+changes` (the file being rewritten is not a change to the code); a tracked file edited
  is one."""
  folder = tmp_path / "benchmarks" / "results"
  folder.mkdir(parents=True)
  (folder / "figures.json").write_text("{}\n")
  (tmp_path / "model.py").write_text("width = 1\n")
  _git(tmp_path, "init", "-q")
  _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
  _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
  head = _git(tmp_path, "rev-parse", "--short=12", "HEAD")
  monkeypatch.setattr(results, "ROOT", str(tmp_path))
  monkeypatch.setattr(results, "RESULTS", str(folder))

  path = results.write("figures", {"x": 1}, argv=["bench"])
  assert json.load(open(path))["commit"] == head

  (tmp_path / "model.py").write_text("width = 2\n")
  assert json.load(open(results.write("figures", {"x": 2}, argv=["bench"])))["commit"] == (
      head + "+changes")
  assert os.path.basename(path) == "figures.json"
