"""Where a run's TensorBoard events live inside its workdir (no TensorFlow import: the
launcher names the folder before anything loads the writers)."""
from __future__ import annotations

import os

EVENTS = "events.out.tfevents"  # how TensorFlow's event files begin


def run_dir(workdir: str) -> str:
  """The run folder inside `workdir` that TensorBoard shows as the run (`tensorboard --logdir
  WORKDIR`): the one an earlier start of the run wrote events to, else `workdir`'s own name
  (so a run named `default` shows as "default", not "."). Only the run's events live there:
  checkpoints, traffic and alerts stay beside it."""
  workdir = os.path.abspath(workdir)
  if os.path.isdir(workdir):
    for name in sorted(os.listdir(workdir)):
      folder = os.path.join(workdir, name)
      if os.path.isdir(folder) and any(f.startswith(EVENTS) for f in os.listdir(folder)):
        return folder
  return os.path.join(workdir, os.path.basename(workdir) or "run")
