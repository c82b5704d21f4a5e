#!/usr/bin/env bash
# The Slurm lane: a real Slurm (Debian's slurm-wlm) on this host, two slurmd as two nodes, and tests/slurm run
# against it through sbatch. Installs slurmctld/slurmd/munge if absent (root), writes everything under one
# temporary state directory, and on exit - tests failed or not - stops exactly the daemons it started (by pid)
# and removes that directory.
#
#   SLURM_LANE_PYTHON=.venv/bin/python tools/slurm_lane.sh              # what `make test-slurm` runs
#   SLURM_LANE_PYTHON=... tools/slurm_lane.sh -- bash                   # a shell on the cluster instead of the tests
#   SLURM_LANE_PYTHON=... tools/slurm_lane.sh -k chain                  # arguments go to pytest
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${SLURM_LANE_PYTHON:?set SLURM_LANE_PYTHON: the python of the environment the jobs run (make test-slurm sets it)}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")   # absolute: jobs run in other directories
say() { printf 'slurm lane: %s\n' "$*" >&2; }

install_if_absent() {
    local missing=()
    for tool in sbatch slurmctld slurmd munged mungekey; do command -v "$tool" > /dev/null || missing+=("$tool"); done
    [[ ${#missing[@]} == 0 ]] && return
    say "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge > /dev/null
}

if [[ $(id -u) != 0 ]]; then say "needs root (to install the packages; slurmd starts job steps as their user)"; exit 2; fi
install_if_absent
# Debian's packages start nothing here (no systemd in a container); were they running, ours would not touch them.

STATE=$(mktemp -d "${TMPDIR:-/tmp}/slurm-lane.XXXXXX")
chmod 755 "$STATE"   # munged checks the modes of the directories above its socket and key
PIDS=()
stop() {  # the daemons this script started, newest first, by pid; then the state directory
    local rc=$?
    if [[ -n ${RUNNING:-} ]] && kill -0 "$RUNNING" 2> /dev/null; then kill -TERM "$RUNNING"; wait "$RUNNING" || true; fi
    # slurmctld (PIDS[1]) still up: cancel what is left, so that no job step (slurmstepd and its tasks, which
    # outlive slurmd) survives the lane
    if [[ -n ${SLURM_CONF:-} ]] && kill -0 "${PIDS[1]:-0}" 2> /dev/null; then
        squeue -h -o %A 2> /dev/null | xargs -r scancel 2> /dev/null || true
        for _ in $(seq 120); do [[ -z $(squeue -h -o %A 2> /dev/null) ]] && break; sleep 0.5; done
    fi
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill -TERM "${PIDS[i]}" 2> /dev/null || true; done
    for pid in ${PIDS[@]+"${PIDS[@]}"}; do
        for _ in $(seq 100); do kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2> /dev/null || true
        wait "$pid" 2> /dev/null || true
    done
    if [[ $rc != 0 && -d $STATE/log ]]; then tail -n 20 "$STATE"/log/*.log >&2 || true; fi
    rm -rf "$STATE"
    exit $rc
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_ports() {  # n TCP ports free now on 127.0.0.1
    "$PY" -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}
read -r CTLD_PORT PORT1 PORT2 <<< "$(free_ports 3)"

# Two nodes, each half this machine: its own CPUs (each slurmd, and so every task it starts, is pinned to them with
# taskset: nxdtrain and ckptconv size their threads by the affinity mask, as under a real node's Slurm) and half
# the memory. A machine with one CPU gives both nodes that CPU.
read -r CPUS1 CPUS2 NCPU1 NCPU2 <<< "$("$PY" -c 'import os
cpus = sorted(os.sched_getaffinity(0)); half = max(1, len(cpus) // 2)
a, b = cpus[:half], (cpus[half:] or cpus)
print(",".join(map(str, a)), ",".join(map(str, b)), len(a), len(b))')"
MEM=$(($(slurmd -C | head -n 1 | grep -o 'RealMemory=[0-9]*' | cut -d= -f2) / 2))
HOST=$(hostname -s)
mkdir -p "$STATE"/{ctld,spool/n1,spool/n2,log,munge}
cat > "$STATE/slurm.conf" <<EOF
# written by tools/slurm_lane.sh for one run of the Slurm lane
ClusterName=lane
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.%n.log
# cgroup-free: processes tracked through /proc, no task confinement or accounting gather
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
# no slurmdbd: the job completion log is where exit codes are read (tests/slurm/cluster.py)
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=3600
MailProg=/bin/true
# Preemption by partition priority: a job in "urgent" requeues what runs in "lane" after its GraceTime
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# two slurmd on this host, one per node, each pinned to its CPUs (taskset)
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$PORT1 CPUs=$NCPU1 Sockets=1 CoresPerSocket=$NCPU1 ThreadsPerCore=1 RealMemory=$MEM
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$PORT2 CPUs=$NCPU2 Sockets=1 CoresPerSocket=$NCPU2 ThreadsPerCore=1 RealMemory=$MEM
PartitionName=lane Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=20
PartitionName=urgent Nodes=n1,n2 MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
export SLURM_CONF=$STATE/slurm.conf

start() {  # a daemon in the foreground of a background job: its pid is $!, ours to stop
    local name=$1; shift
    "$@" > "$STATE/log/$name.stderr" 2>&1 &
    PIDS+=($!)
}
# munge: a fresh key for this run only
dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
chmod 755 "$STATE/munge"; chmod 400 "$STATE/munge/munge.key"
start munged munged --foreground --force --socket="$STATE/munge/munge.socket" --key-file="$STATE/munge/munge.key" \
    --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/seed"
for _ in $(seq 100); do [[ -S $STATE/munge/munge.socket ]] && break; sleep 0.1; done
start slurmctld slurmctld -D -i -f "$SLURM_CONF"
start slurmd.n1 taskset -c "$CPUS1" slurmd -D -N n1 -f "$SLURM_CONF"
start slurmd.n2 taskset -c "$CPUS2" slurmd -D -N n2 -f "$SLURM_CONF"

say "state in $STATE; waiting for n1 and n2 to be idle"
for i in $(seq 120); do
    states=$(sinfo -h -N -p lane -o '%N %T' 2> /dev/null | sort -u | tr '\n' ' ' || true)
    [[ $states == "n1 idle n2 idle " ]] && break
    if ((i == 120)); then say "nodes not idle after 60 s: $states"; exit 1; fi
    sleep 0.5
done
say "nodes idle: $states"

export SLURM_LANE_STATE=$STATE PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export PATH=$(dirname "$PY"):$PATH   # the jobs' ckptconv and python: the environment's, as after `activate`
if [[ ${1:-} == -- ]]; then shift; else set -- "$PY" -m pytest -q -n 0 -p no:cacheprovider "$REPO/tests/slurm" "$@"; fi
# In the background and waited for: a signal to this script runs its trap at once, not after the tests end.
"$@" &
RUNNING=$!
wait "$RUNNING"
