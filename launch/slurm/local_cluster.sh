#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for trying launch/slurm/train.sbatch without a
# cluster and for the tests (tests/test_slurm.py). Needs root and Debian's packages:
#
#   apt-get install -y slurm-wlm munge
#   eval "$(bash launch/slurm/local_cluster.sh start /tmp/slurm)"   # prints `export SLURM_CONF=...`
#   sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 \
#       launch/slurm/train.sbatch configs/tiny.yaml mesh.data=2
#   bash launch/slurm/local_cluster.sh stop /tmp/slurm
#
# Everything lives under DIR: the munge key and socket, slurm.conf, the daemons' state, spool, logs
# and pid files, on free ports, so it touches nothing of the machine's own Slurm or munge (if any)
# and two clusters can run side by side. The node is this host with its cores (nproc) and memory;
# one partition `local`, default, without a time limit; jobs may share the node's cores
# (OverSubscribe) so tasks asking for more CPUs than a small machine has still start. Processes are
# tracked by process group (no cgroups in most containers). The node is named `localhost` (so
# job steps find their coordinator without DNS); slurmd finds it by this host's name. `start` returns once `sinfo` shows the
# node idle (exit 1 with the daemons' log tails if it does not within 60 s); `stop` kills the
# daemons and every job step they started.
set -euo pipefail

usage() { echo "usage: $0 start|stop|status DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
ACTION=$1
DIR=$(mkdir -p "$2" && cd "$2" && pwd)

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

stop() {
    for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
        [ -s "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$pidfile"
    done
    # job steps outlive slurmd (slurmstepd is its own daemon): kill what this cluster started
    pkill -KILL -f "slurmstepd.*$DIR" 2>/dev/null || true
}

start() {
    for tool in munged slurmctld slurmd sinfo; do
        command -v "$tool" >/dev/null || { echo "local_cluster: $tool not found; apt-get install -y slurm-wlm munge" >&2; exit 1; }
    done
    [ "$(id -u)" -eq 0 ] || { echo "local_cluster: slurmd must run as root (it starts jobs as their users)" >&2; exit 1; }
    stop
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge"
    chmod 755 "$DIR/munge"  # munged wants its socket directory searchable by all
    # munge: a fresh key and a private socket (AuthInfo/AuthAltParameters point Slurm at it)
    head -c 1024 /dev/urandom > "$DIR/munge/munge.key"
    chmod 400 "$DIR/munge/munge.key"
    munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munge/munged.seed"

    local host cpus mem_mb
    host=$(hostname -s)
    cpus=$(nproc)
    mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
    cat > "$DIR/slurm.conf" <<EOF
ClusterName=maxtrain-local
# job ids (and so the coordinator ports maxtrain derives from them) differ between clusters side by side
FirstJobId=$(( (RANDOM << 8 | RANDOM & 255) % 900000 + 1000 ))
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it may start again (default 120 s, at least 5)
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# look at pending jobs every second (default 60 s): a requeued job starts once its begin time passes
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
KillWait=30
InactiveLimit=0
MinJobAge=3600
SlurmdTimeout=60
MessageTimeout=5
NodeName=localhost NodeHostname=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE OverSubscribe=FORCE:4 State=UP
EOF
    export SLURM_CONF="$DIR/slurm.conf"
    slurmctld -f "$SLURM_CONF" -i
    slurmd -f "$SLURM_CONF"
    local deadline=$((SECONDS + 60))
    while [ $SECONDS -lt $deadline ]; do
        if [ "$(timeout 5 sinfo -h -n localhost -o %t 2>/dev/null)" = "idle" ]; then
            echo "export SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.5
    done
    echo "local_cluster: node localhost ($host) not idle after 60 s; sinfo: $(timeout 5 sinfo -h 2>&1 | head -1)" >&2
    for log in munged slurmctld slurmd; do tail -n 5 "$DIR/$log.log" >&2 2>/dev/null || true; done
    stop
    exit 1
}

case "$ACTION" in
    start) start ;;
    stop) stop ;;
    status) SLURM_CONF="$DIR/slurm.conf" sinfo ;;
    *) usage ;;
esac
