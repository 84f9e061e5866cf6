#!/usr/bin/env bash
# The Slurm launcher end to end on a real single-node Slurm (tests/e2e/test_slurm_e2e.py): installs Debian's
# slurm-wlm and munge when sbatch is missing (root, apt), then runs the module, which starts munged, slurmctld and
# slurmd through scripts/slurm_local.sh, sbatches tiny-qwen-cpu, stops it with SIGTERM and checks the requeued
# job's resume against an uninterrupted run. ~2 minutes on 2 idle cores (+ the install on a fresh machine).
# .ci/run calls it after the suite; by hand: `. .venv/bin/activate && scripts/slurm_e2e.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v sbatch >/dev/null; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "slurm_e2e: sbatch is missing and this is not a root Debian machine: install slurm-wlm and munge" >&2
    exit 1
  fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
status=0
pytest -n 0 -m slurm tests/e2e/test_slurm_e2e.py -rs || status=$?
exit "$status"
