#!/usr/bin/env bash
# Remakes docs/images/tensorboard_*.png: what TensorBoard shows of a short overflowing run.
# Needs the venv (`make install`) and Debian's chromium (`apt-get install chromium`). Run from
# the repository root: bash docs/images/screenshots.sh
set -euo pipefail
run=$(mktemp -d)/default
port=6123
.venv/bin/python -m launch.train --workdir="$run" --config=launch/configs/default.py \
    --config.train_steps=160 --config.autopilot.enabled=True
.venv/bin/tensorboard --logdir "$run" --host 127.0.0.1 --port $port >/dev/null 2>&1 &
board=$!
trap 'kill $board' EXIT
sleep 10
shot() {  # shot FILE WIDTH HEIGHT URL-FRAGMENT
  chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars \
      --force-device-scale-factor="${SCALE:-1}" --window-size="$2,$3" \
      --virtual-time-budget=20000 --screenshot="$1" \
      "http://127.0.0.1:$port/?darkMode=false#$4" 2>/dev/null
}
# The factor story with smoothing 0, so the factor in force and the recommendation are steps.
shot docs/images/tensorboard_factor.png 1300 1000 "custom_scalars&_smoothingWeight=0"
# The expert-load heatmap at twice the pixels, cropped to the run list and the card.
SCALE=2 shot docs/images/tensorboard_expert_load.png 1000 450 images
.venv/bin/python -c "
from PIL import Image
path = 'docs/images/tensorboard_expert_load.png'
Image.open(path).crop((0, 0, 1500, 880)).save(path)"
