#!/usr/bin/env bash
# Know before users do: install the NEWEST releases inside the package's ranges (only torch held to the CPU build the
# lock names) in a scratch venv, run the whole suite, and print which locked versions moved and what broke.
#     scripts/check_latest.sh [DIR]            # DIR: the scratch folder (default /tmp/ftcli-latest)
# Exit code: the suite's. When it passes, raise the lock from that venv (scripts/lock_cpu.sh says how).
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-/tmp/ftcli-latest}"
rm -rf "$dir" && mkdir -p "$dir"
grep -E '^torch==' "$repo/constraints/cpu.txt" > "$dir/torch-only.txt"
python3 -m venv "$dir/.venv"
. "$dir/.venv/bin/activate"
pip install -q --upgrade -c "$dir/torch-only.txt" -e "$repo[dev]" 2>&1 | grep -v "is ignored: it is neither" || true
echo "== releases newer than constraints/cpu.txt"
python - "$repo/constraints/cpu.txt" <<'PY'
import importlib.metadata as md, sys
pins = {}
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if "==" in line:
        name, ver = line.split("==", 1)
        pins[name.strip().lower().replace("_", "-")] = ver.strip()
seen = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions()}
moved = [f"  {n}: {pins[n]} -> {v}" for n, v in sorted(seen.items()) if n in pins and v.split("+")[0] != pins[n]]
new = [f"  {n} {v} (not in the lock)" for n, v in sorted(seen.items()) if n not in pins and n not in ("ftcli", "pip", "setuptools", "wheel")]
print("\n".join(moved + new) or "  none: the lock is the newest")
PY
echo "== the suite on the newest releases"
cd "$repo" && pytest -p no:cacheprovider 2>&1 | tail -40
status=${PIPESTATUS[0]}
echo "== check_latest: pytest exit $status"
exit "$status"
