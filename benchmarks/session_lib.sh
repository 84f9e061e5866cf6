# Sourced by the benchmarks/session_*.sh device scripts; they set START, BUDGET, LOG, PY and ROOT first.
left() { echo $((START + BUDGET - $(date +%s))); }   # seconds left of the script's budget
say() { echo "$@" | tee -a "$LOG"; }
machine_header() {  # the date, the card, torch / transformers and the commit, at the top of the log
  {
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "no nvidia-smi"
    $PY -c "import sys; sys.path.insert(0, 'benchmarks'); import common
print(common.staging_line('torch', 'transformers', 'triton', 'fla'))"
    git -C "$ROOT" log --oneline -1 2>/dev/null || true
  } 2>&1 | tee -a "$LOG"
}
