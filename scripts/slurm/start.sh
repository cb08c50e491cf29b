#!/usr/bin/env bash
# Start a single-node SLURM cluster on this machine (for tests and `cluster=slurm` trials).
#
#   sudo scripts/slurm/start.sh      # idempotent: installs, configures and starts what is missing
#   scripts/slurm/stop.sh            # cancels all jobs and stops the daemons
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge when missing, writes
# /etc/slurm/slurm.conf from slurm.conf.in for this host (CPUs and memory from `slurmd -C`),
# starts munged, slurmctld and slurmd as plain daemons (no systemd, no cgroups) and waits until
# `sinfo` shows the node idle and a one-task test job has run. Needs root. Logs: /var/log/slurm/.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
conf=/etc/slurm/slurm.conf
t0=$(date +%s%3N)  # ms

log() { echo "[slurm/start] $*"; }
die() { echo "[slurm/start] error: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root (the daemons run as root; packages are installed with apt-get)"

# --- 1. packages -------------------------------------------------------------------------------
missing=()
for pkg in slurmctld slurmd slurm-client munge; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Package scripts try to start the services; without an init system that fails harmlessly.
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
fi

# --- 2. munge ----------------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
  log "creating /etc/munge/munge.key"
  mungekey --create --keyfile=/etc/munge/munge.key
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || die "munged does not answer; see /var/log/munge/munged.log"
fi

# --- 3. slurm.conf -----------------------------------------------------------------------------
host=$(hostname -s)
# `slurmd -C` prints e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2
# ThreadsPerCore=1 RealMemory=24105"; it is this node's line as slurmd will report it.
node_line=$(slurmd -C | head -n 1)
[[ $node_line == NodeName=* ]] || die "unexpected 'slurmd -C' output: $node_line"
install -d -m 0755 /etc/slurm /var/log/slurm /var/spool/slurmctld /var/spool/slurmd
new=$(sed -e "s|@HOST@|$host|" -e "s|@NODE_LINE@|$node_line|" "$here/slurm.conf.in")
changed=0
if [[ ! -f $conf ]] || [[ "$(cat "$conf")" != "$new" ]]; then
  printf '%s\n' "$new" >"$conf"
  changed=1
  log "wrote $conf ($node_line)"
fi

# --- 4. daemons --------------------------------------------------------------------------------
running() { [[ -f $1 ]] && kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }
if ((changed)); then
  # A new configuration: restart what runs (the controller keeps its job state on disk).
  for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    running "$pidfile" && kill "$(cat "$pidfile")" && while running "$pidfile"; do sleep 0.1; done
  done
fi
if ! running /run/slurmctld.pid; then
  log "starting slurmctld"
  slurmctld
fi
if ! running /run/slurmd.pid; then
  log "starting slurmd"
  slurmd
fi

# --- 5. wait for the node ----------------------------------------------------------------------
state=""
for _ in $(seq 300); do
  state=$(sinfo -h -n "$host" -o %t 2>/dev/null | head -n 1 || true)
  case $state in
    idle | mix | alloc) break ;;
    drain* | down* | drng*)  # left over from an earlier run: return it to service
      scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 0.2
done
case $state in
  idle | mix | alloc) ;;
  *) die "node $host is '${state:-not answering}' after 60 s; see /var/log/slurm/slurmctld.log and slurmd.log" ;;
esac
# The controller may report the node from its saved state before slurmd has registered: a one-task
# job proves the whole chain (munge, slurmctld, slurmd, slurmstepd).
timeout 120 srun --quiet -n 1 -t 1 -J start-probe true \
  || die "a test job (srun true) did not run; see /var/log/slurm/slurmctld.log and slurmd.log"
ms=$(($(date +%s%3N) - t0))
log "node $host is $state; SLURM ready in $((ms / 1000)).$((ms % 1000 / 100)) s"
