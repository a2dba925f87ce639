#!/usr/bin/env bash
# The package as a user installs it: a wheel built from this checkout, installed into a fresh
# venv outside the checkout (torch from the package index, nothing else), then run from another
# directory: the doctor, a 20-step demo, and gpu_report's "needs a checkout" message.
set -euo pipefail
checkout=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$checkout/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

echo "+ wheel smoke test: building the wheel"
"$python" -m pip wheel --no-deps --quiet -w dist "$checkout"
wheel=$(ls dist/scaledoptim-*.whl)
echo "+ wheel smoke test: installing $(basename "$wheel") into a fresh venv"
"$python" -m venv venv
venv/bin/pip install --quiet --no-compile torch==2.13.0 "$wheel"

# -I: nothing from the checkout or PYTHONPATH can shadow the installed package.
export SCALEDOPTIM_CACHE_DIR=$work/cache
echo "+ wheel smoke test: python -m scaledoptim.doctor"
venv/bin/python -I -m scaledoptim.doctor
echo "+ wheel smoke test: python -m scaledoptim.examples.demo --steps 20"
venv/bin/python -I -m scaledoptim.examples.demo --compare --steps 20 --no-progress
echo "+ wheel smoke test: python -m scaledoptim.doctor.gpu_report says it needs a checkout"
status=0
venv/bin/python -I -m scaledoptim.doctor.gpu_report 2> gpu_report.err || status=$?
cat gpu_report.err
[ "$status" -eq 2 ] && grep -q "needs a checkout of scaledoptim" gpu_report.err
echo "+ wheel smoke test: passed"
