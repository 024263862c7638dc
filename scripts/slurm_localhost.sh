#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (Debian's slurm-wlm + munge), for the SLURM test.
#
#   scripts/slurm_localhost.sh start STATE_DIR   # install if needed, configure, start, wait until idle
#   scripts/slurm_localhost.sh stop STATE_DIR    # stop what `start` started (by its pid files), remove its slurm.conf
#
# `start` writes /etc/slurm/slurm.conf (where srun inside jobs finds it; an existing one that
# this script did not write is left alone: exit 3), with state and logs in STATE_DIR. It
# needs root (apt-get, the daemons). Exit status 3: cannot set up here (no root, apt
# unreachable, a foreign slurm.conf); anything else non-zero: a failure. It starts munged
# only if none is running, and stops only the daemons it started.
set -euo pipefail

cmd=${1:?usage: $0 start|stop STATE_DIR}
state=$(mkdir -p "${2:?usage: $0 start|stop STATE_DIR}" && cd "$2" && pwd)
conf=/etc/slurm/slurm.conf
marker="# written by mergepipe scripts/slurm_localhost.sh"

stop() {
    for name in slurmd slurmctld munged; do
        pidfile=$state/$name.pid
        [[ -f $pidfile ]] || continue
        pid=$(cat "$pidfile")
        if kill "$pid" 2>/dev/null; then
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$pidfile"
    done
    # Our slurm.conf goes too: with a configuration but no controller, every sinfo/sacct
    # (which Snakemake's slurm plugin runs at each start) waits seconds for a timeout.
    if [[ -f $conf ]] && grep -qxF "$marker" "$conf"; then rm -f "$conf"; fi
}

install() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null && return 0
    [[ $(id -u) == 0 ]] || { echo "slurm_localhost: need root to install slurm-wlm and munge" >&2; return 3; }
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends slurm-wlm munge >"$state/apt.log" 2>&1; then
        apt-get update -q >>"$state/apt.log" 2>&1 || { echo "slurm_localhost: apt unreachable (see $state/apt.log)" >&2; return 3; }
        apt-get install -y -q --no-install-recommends slurm-wlm munge >>"$state/apt.log" 2>&1 \
            || { echo "slurm_localhost: apt-get install slurm-wlm munge failed (see $state/apt.log)" >&2; return 3; }
    fi
}

start() {
    install
    # munge: the key the Debian package made (or a new one), one daemon for the machine
    if ! pgrep -x munged >/dev/null; then
        mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
        [[ -s /etc/munge/munge.key ]] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
        chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
        if id munge >/dev/null 2>&1; then
            runuser -u munge -- /usr/sbin/munged
        else
            /usr/sbin/munged --force
        fi
        for _ in $(seq 50); do [[ -S /run/munge/munge.socket.2 ]] && break; sleep 0.1; done
        pgrep -x -n munged >"$state/munged.pid"
    fi

    if [[ -e $conf ]] && ! grep -qxF "$marker" "$conf"; then
        echo "slurm_localhost: $conf exists and is not ours; not touching this machine's SLURM" >&2
        return 3
    fi
    if pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null; then
        echo "slurm_localhost: a slurmctld or slurmd is already running; stop it first" >&2
        return 3
    fi
    cpus=$(nproc)
    mem=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) / 1024 / 2 ))
    mkdir -p "$state/ctld" "$state/d" "$(dirname "$conf")"
    cat >"$conf" <<EOF
$marker
ClusterName=mergepipe-test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MpiDefault=none
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    slurmctld -f "$conf"
    slurmd -f "$conf" -N localhost
    for _ in $(seq 100); do
        state_now=$(sinfo -h -N -o %T 2>/dev/null || true)
        [[ $state_now == idle* ]] && { echo "slurm_localhost: node idle ($cpus CPUs, ${mem} MB), $conf"; return 0; }
        sleep 0.3
    done
    echo "slurm_localhost: node not idle (sinfo: ${state_now:-nothing}); logs in $state" >&2
    return 1
}

case $cmd in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop STATE_DIR" >&2; exit 2 ;;
esac
