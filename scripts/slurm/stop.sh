#!/usr/bin/env bash
# Stop the SLURM cluster that scripts/slurm/start.sh started: cancel every job, stop every node's
# slurmd, slurmctld and munged (by their pid files), kill what is left in the node namespaces, and
# remove the namespaces, the veth pairs and the bridge. Safe to run when nothing is running.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
log() { echo "[slurm/stop] $*"; }

[[ $(id -u) -eq 0 ]] || { echo "[slurm/stop] error: run as root" >&2; exit 1; }
# shellcheck source=scripts/slurm/net.sh
. "$here/net.sh"

if command -v squeue >/dev/null && squeue -h >/dev/null 2>&1; then
  mapfile -t jobs < <(squeue -h -o %i | sort -u)
  if ((${#jobs[@]})); then
    log "cancelling jobs: ${jobs[*]}"
    scancel "${jobs[@]}" || true
    # Give the job steps KillWait seconds to end before slurmd goes away.
    for _ in $(seq 50); do [[ -z $(squeue -h -o %i) ]] && break; sleep 0.2; done
  fi
fi

# Stop one daemon by pid file and wait (up to 10 s) until it is gone.
stop_daemon() {
  local name=$1 pidfile=$2 pid
  [[ -f $pidfile ]] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    log "stopping $name ($pid)"
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { log "$name did not stop; killing it"; kill -9 "$pid" || true; }
  fi
  rm -f "$pidfile"
}

for pidfile in /run/slurmd-*.pid /run/slurmd.pid; do  # /run/slurmd.pid: the earlier single-node layout
  [[ -e $pidfile ]] || continue
  name=${pidfile#/run/}
  stop_daemon "${name%.pid}" "$pidfile"
done
stop_daemon slurmctld /run/slurmctld.pid
stop_daemon munged /run/munge/munged.pid
for ns in $(pf_existing_nodes); do
  log "removing node namespace $ns"
  pf_remove_node "$ns"
done
if ip link show "$PF_BRIDGE" >/dev/null 2>&1; then
  log "removing bridge $PF_BRIDGE"
  pf_bridge_down
fi
log "stopped"
