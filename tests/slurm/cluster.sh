#!/usr/bin/env bash
# Stand up a single-host Slurm cluster on this machine (idempotent): munged, slurmctld, slurmd, from
# Debian's slurm-wlm and munge. Partitions: "cpu" (default) and "gpu" (same node, no GRES: resolve
# mode needs none). Used by .ci/run and by the slurm tests. Needs root.
#   tests/slurm/cluster.sh start | stop | status
set -euo pipefail
STATE=/var/lib/serving-truth-slurm
CONF=/etc/slurm/slurm.conf
host=$(hostname -s)

up() { scontrol ping 2>/dev/null | grep -q "is UP" && sinfo -h -n "$host" -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }

case "${1:-start}" in
status) up && echo up || { echo down; exit 1; } ;;
stop)
  pkill -x slurmd || true; pkill -x slurmctld || true ;;
start)
  if up; then echo "slurm: already up"; exit 0; fi
  command -v slurmctld >/dev/null || { echo "slurm-wlm is not installed (apt-get install slurm-wlm munge)"; exit 1; }
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  fi
  pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 - 2048 ))
  mkdir -p "$STATE/ctld" "$STATE/d" /etc/slurm
  cat > "$CONF" <<CONF
ClusterName=serving-truth
SlurmctldHost=$host
AuthType=auth/munge
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
MinJobAge=3600
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurmctld.log
SlurmdLogFile=/var/log/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=$host CPUs=$cpus RealMemory=$mem Feature=cpu State=UNKNOWN
PartitionName=cpu Nodes=$host Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$host MaxTime=INFINITE State=UP
CONF
  pgrep -x slurmctld >/dev/null || slurmctld
  pgrep -x slurmd >/dev/null || slurmd
  for _ in $(seq 60); do up && break; sleep 1; done
  scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
  for _ in $(seq 30); do up && break; sleep 1; done
  if up; then echo "slurm: up"; sinfo; else
    echo "slurm did not come up"; tail -20 /var/log/slurmctld.log /var/log/slurmd.log || true; exit 1; fi ;;
esac
