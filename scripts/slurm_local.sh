#!/bin/bash
# A single-node Slurm cluster on this host, for tests/e2e/test_slurm_e2e.py (and by hand):
#
#   scripts/slurm_local.sh start    writes slurm.conf for this host under $FTCLI_SLURM_DIR, starts munged,
#                                   slurmctld and slurmd (as root), waits until the node is idle, and prints
#                                   the line to use it:  export SLURM_CONF=$FTCLI_SLURM_DIR/slurm.conf
#   scripts/slurm_local.sh stop     stops the three daemons it started (by their pid files)
#   scripts/slurm_local.sh status   sinfo of the local cluster
#
# Needs Debian's slurm-wlm and munge (apt-get install -y slurm-wlm munge: ~1 minute) and root. The daemons use
# their own dir, munge socket and ports (FTCLI_SLURM_PORT, FTCLI_SLURM_PORT+1), so a system Slurm is left alone.
set -euo pipefail

dir=${FTCLI_SLURM_DIR:-/tmp/ftcli-slurm}
port=${FTCLI_SLURM_PORT:-16817}
conf=$dir/slurm.conf

die() { echo "slurm_local.sh: $*" >&2; exit 1; }

stop_pidfile() {
    local file=$1 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$file"
}

start() {
    for tool in munged slurmctld slurmd sinfo slurmd; do
        command -v "$tool" >/dev/null || die "$tool not found: apt-get install -y slurm-wlm munge"
    done
    [ "$(id -u)" = 0 ] || die "run as root (slurmd starts jobs as their users)"
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
    chmod 700 "$dir/munge"
    local host node
    host=$(hostname -s)
    node=$(slurmd -C | head -n 1)  # NodeName=<host> CPUs=... RealMemory=... as slurmd sees this machine
    cat > "$conf" <<EOF
ClusterName=ftcli-local
SlurmctldHost=$host
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: a requeued job may start again after 10 s (default 120)
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
KillWait=120
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    if ! [ -S "$dir/munge/munge.socket" ]; then
        munged --force --socket="$dir/munge/munge.socket" --key-file=/etc/munge/munge.key \
            --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
            --seed-file="$dir/munge/munged.seed"
    fi
    export SLURM_CONF=$conf
    [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null || slurmctld -f "$conf"
    [ -f "$dir/slurmd.pid" ] && kill -0 "$(cat "$dir/slurmd.pid")" 2>/dev/null || slurmd -f "$conf"
    for _ in $(seq 100); do
        if sinfo -h -o %t 2>/dev/null | grep -qx "idle"; then
            echo "export SLURM_CONF=$conf"
            return 0
        fi
        sleep 0.2
    done
    die "the node did not come up idle in 20 s; see $dir/slurmctld.log and $dir/slurmd.log"
}

case "${1:-}" in
    start) start ;;
    stop)
        stop_pidfile "$dir/slurmd.pid"
        stop_pidfile "$dir/slurmctld.pid"
        stop_pidfile "$dir/munge/munged.pid"
        ;;
    status) SLURM_CONF=$conf sinfo ;;
    *) die "usage: $0 start|stop|status" ;;
esac
