#!/bin/sh
# Makes a lent GPU machine (its own python3 with jax's CUDA plugin, absl-py, optax,
# orbax-checkpoint, flax, chex, numpy; no network) ready for `python3 -m benchmarks.gpu_native`:
# unpacks the wheels in .device/wheels (tokamax 0.0.17 and the packages moe_hk and launch need
# beyond those) into .device/site, plus those in .device/wheels_if_missing whose module the
# machine lacks. A wheel is a zip of site-packages, so no pip runs and the machine's Python is
# left as it was. Then run with PYTHONPATH=.device/site (and --stub_xprof: tokamax imports xprof).
#
#   sh benchmarks/gpu_setup.sh && PYTHONPATH=.device/site python3 -m benchmarks.gpu_native --stub_xprof
set -eu
site=.device/site
mkdir -p "$site"
for wheel in .device/wheels/*.whl; do
  python3 -m zipfile -e "$wheel" "$site"
done
for wheel in .device/wheels_if_missing/*.whl; do
  [ -e "$wheel" ] || continue
  module=$(basename "$wheel" | cut -d- -f1)  # jaxtyping-0.3.11-py3-none-any.whl -> jaxtyping
  python3 -c "import $module" 2>/dev/null || python3 -m zipfile -e "$wheel" "$site"
done
PYTHONPATH="$site" python3 -c "from benchmarks.gpu_native import stub_xprof; stub_xprof()
import haiku, ml_collections, tokamax
print('tokamax', tokamax.__version__, 'from', tokamax.__file__)"
