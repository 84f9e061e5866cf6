#!/usr/bin/env bash
# Write constraints/cpu.txt, the dev/CI lock, from the packages installed in the active venv (after the suite passed
# with them): every distribution pinned exactly, ftcli itself left out. Updating the lock is a deliberate commit:
#     scripts/check_latest.sh            # newest releases in a scratch venv, the whole suite
#     . /tmp/ftcli-latest/.venv/bin/activate && scripts/lock_cpu.sh && deactivate
#     git diff constraints/cpu.txt       # what moved; then commit with the suite's result
set -euo pipefail
cd "$(dirname "$0")/.."
out=constraints/cpu.txt
{
  echo "# Dev/CI lock (written by scripts/lock_cpu.sh on $(date -u +%Y-%m-%d)): the exact versions the whole suite passed"
  echo "# with on CPU; .ci/run and the README's test command install with -c constraints/cpu.txt. The package's own"
  echo "# dependencies stay ranges (users get the newest releases). torch: the CPU build on the dev machines' disk."
  python -m pip freeze --exclude-editable --all 2>/dev/null | grep -viE '^(ftcli|pip|setuptools|wheel)(==| @)' \
    | sed -E 's/^torch==([0-9.]+)\+cpu$/torch==\1/' | LC_ALL=C sort -f
} > "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out ($(grep -c '==' "$out") pins)"
