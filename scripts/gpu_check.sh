#!/usr/bin/env bash
# The GPU check on the lent GPU machine (docs/gpu.md, "The GPU check"): installs what that machine lacks, offline,
# then runs scripts/gpu_check.py with the arguments given here.
#   1. the wheels carried in gpu_wheels/ (diffusers, omegaconf, torchao for the seeds part's FP8 explorer, and
#      whatever else was downloaded there), without dependencies and without an index, when diffusers or omegaconf
#      is missing, or when a torchao wheel is carried and torchao is missing: every dependency of theirs is already
#      on that machine;
#   2. this repository, editable and without dependencies, so that flowrl and its rewards package import under
#      the names pyproject.toml gives them (today `rewards`, later `flowrl_rewards`);
#   3. python3 scripts/gpu_check.py "$@" (default --out: $OUT).
# PYTHON picks the interpreter (default python3). Exit status: gpu_check.py's, or 3 when an install failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --no-index --no-deps --no-cache-dir --disable-pip-version-check)
shopt -s nullglob
wheels=(gpu_wheels/*.whl)
torchao_wheels=(gpu_wheels/torchao-*.whl)

missing=()
"$PY" -c "import diffusers, omegaconf" 2>/dev/null || missing+=("diffusers or omegaconf")
if [ ${#torchao_wheels[@]} -gt 0 ] && ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchao') is None)"; then
  missing+=("torchao")  # found without importing it: torchao's import makes diffusers warn
fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "gpu_check.sh: ${missing[*]} is missing and gpu_wheels/ holds no wheel: fill it here with" \
         "the pip download line of docs/gpu.md and name gpu_wheels in the run's carry" >&2
    exit 3
  fi
  "${PIP[@]}" "${wheels[@]}" || { echo "gpu_check.sh: installing ${wheels[*]} failed" >&2; exit 3; }
fi

if ! "${PIP[@]}" --no-build-isolation -e . >/tmp/gpu_check_install.log 2>&1; then
  cat /tmp/gpu_check_install.log >&2
  echo "gpu_check.sh: pip install --no-deps --no-build-isolation -e . failed (log above)" >&2
  exit 3
fi

export PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check.py "$@"
