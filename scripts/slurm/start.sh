#!/usr/bin/env bash
# Start a SLURM cluster of N nodes on this one machine (for tests and `cluster=slurm` trials).
#
#   sudo scripts/slurm/start.sh              # 1 node  (pfnode1)
#   sudo scripts/slurm/start.sh --nodes 2    # 2 nodes (pfnode1, pfnode2): multi-node jobs
#   sudo scripts/slurm/stop.sh               # cancels all jobs, stops the daemons, removes the network
#
# Idempotent: installs, configures and starts what is missing, and brings a running cluster to N
# nodes (a changed node count restarts the daemons; jobs on a node that goes away are lost).
#
# [Note: N nodes on one machine]
# Every node is a slurmd in its own network namespace and UTS namespace (`nsenter --net=... unshare
# --uts`), so its jobs see their own hostname (pfnodeI) and their own address; the nodes
# reach each other and the controller over a Linux bridge through veth pairs:
#
#   root namespace: munged, slurmctld (answers on 10.250.17.1) ── bridge pfslurm0 (10.250.17.1/24)
#                                                                  ├─ veth ─ pfnode1: eth0 10.250.17.11, slurmd
#                                                                  └─ veth ─ pfnode2: eth0 10.250.17.12, slurmd
#
# Only addresses of the private range PF_SLURM_NET (default 10.250.17, a /24 that this script
# creates on the bridge) are used; no route leaves the machine. Node names resolve inside the nodes
# through /etc/netns/pfnodeI/hosts (bind-mounted over /etc/hosts in the node's mount namespace); the
# machine's own /etc/hosts is not touched. munge is shared (a Unix socket on the one file system).
#
# Needs: root; iproute2 (`ip`), util-linux (`unshare`); Debian packages slurmctld, slurmd,
# slurm-client and munge (installed with apt-get when missing). Writes /etc/slurm/slurm.conf from
# slurm.conf.in (CPUs and memory from `slurmd -C`; every node reports the whole machine), starts the
# daemons as plain processes (no systemd, no cgroups) and waits until `sinfo` shows every node idle
# and a job with one task per node has run. Logs: /var/log/slurm/ (slurmd-pfnodeI.log per node).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
conf=/etc/slurm/slurm.conf
t0=$(date +%s%3N)  # ms

log() { echo "[slurm/start] $*"; }
die() { echo "[slurm/start] error: $*" >&2; exit 1; }

nodes=1
while (($#)); do
  case $1 in
    --nodes) nodes=${2:-}; shift 2 || die "--nodes needs a number" ;;
    --nodes=*) nodes=${1#--nodes=}; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (usage: start.sh [--nodes N])" ;;
  esac
done
[[ $nodes =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= 200)) || die "--nodes must be a number from 1 to 200, not '$nodes'"
[[ $(id -u) -eq 0 ]] || die "run as root (the daemons run as root, namespaces need it, packages are installed with apt-get)"

# shellcheck source=scripts/slurm/net.sh
. "$here/net.sh"

# --- 1. packages -------------------------------------------------------------------------------
missing=()
for pkg in slurmctld slurmd slurm-client munge iproute2 util-linux; do
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
# ThreadsPerCore=1 RealMemory=24105": the hardware every node reports as its own.
hw=$(slurmd -C | head -n 1)
[[ $hw == NodeName=* ]] || die "unexpected 'slurmd -C' output: $hw"
hw=${hw#NodeName=* }
node_lines=""
for ((i = 1; i <= nodes; i++)); do
  node_lines+="NodeName=$(pf_node_name "$i") NodeHostname=$(pf_node_name "$i") NodeAddr=$(pf_node_addr "$i") $hw State=UNKNOWN"$'\n'
done
install -d -m 0755 /etc/slurm /var/log/slurm /var/spool/slurmctld /var/spool/slurmd
new=$(<"$here/slurm.conf.in")
new=${new//@HOST@/$host}
new=${new//@CTLD_ADDR@/$PF_BRIDGE_ADDR}
new=${new//@NUM_NODES@/$nodes}
new=${new//@NODE_LINES@/${node_lines%$'\n'}}
changed=0
if [[ ! -f $conf ]] || [[ "$(cat "$conf")" != "$new" ]]; then
  printf '%s\n' "$new" >"$conf"
  changed=1
  log "wrote $conf ($nodes node(s): $hw)"
fi

# --- 4. network: bridge, one namespace per node --------------------------------------------------
running() { [[ -f $1 ]] && kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }
pf_stop_pidfile() {  # stop the daemon of a pid file, wait up to 10 s, then kill it
  local pidfile=$1 pid
  running "$pidfile" || { rm -f "$pidfile"; return 0; }
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
  rm -f "$pidfile"
}
# A slurmd of the earlier single-node layout (root namespace, /run/slurmd.pid) or of a node beyond N.
pf_stop_pidfile /run/slurmd.pid
for ns in $(pf_existing_nodes); do
  i=${ns#"$PF_NODE_PREFIX"}
  if ! [[ $i =~ ^[0-9]+$ ]] || ((i > nodes)); then
    log "removing node $ns"
    pf_stop_pidfile "/run/slurmd-$ns.pid"
    pf_remove_node "$ns"
  fi
done
pf_bridge_up
for ((i = 1; i <= nodes; i++)); do pf_node_up "$i"; done
pf_write_hosts "$nodes"

# --- 5. daemons --------------------------------------------------------------------------------
if ((changed)); then
  # A new configuration: restart what runs (the controller keeps its job state on disk).
  pf_stop_pidfile /run/slurmctld.pid
  for ((i = 1; i <= nodes; i++)); do pf_stop_pidfile "/run/slurmd-$(pf_node_name "$i").pid"; done
fi
if ! running /run/slurmctld.pid; then
  log "starting slurmctld"
  slurmctld
fi
for ((i = 1; i <= nodes; i++)); do
  name=$(pf_node_name "$i")
  if ! running "/run/slurmd-$name.pid"; then
    log "starting slurmd of $name ($(pf_node_addr "$i"))"
    install -d -m 0755 "/var/spool/slurmd/$name"
    # Join the node's network namespace and make a UTS namespace (the node's, and every job step's,
    # own hostname) and a mount namespace (its own /etc/hosts). Not `ip netns exec`: it remounts
    # /sys, hiding /sys/fs/cgroup, without which slurmd does not start.
    nsenter --net="/run/netns/$name" unshare --uts --mount --propagation private -- sh -c \
      "mount --bind /etc/netns/$name/hosts /etc/hosts && hostname $name && exec slurmd -N $name"
  fi
done

# --- 6. wait for the nodes ---------------------------------------------------------------------
names=$(for ((i = 1; i <= nodes; i++)); do pf_node_name "$i"; done | paste -sd,)
states=""
for _ in $(seq 300); do
  states=$(sinfo -h -N -n "$names" -o '%N=%t' 2>/dev/null | sort -u | paste -sd' ' || true)
  not_up=$(tr ' ' '\n' <<<"$states" | grep -cvE '=(idle|mix|alloc)$' || true)
  if [[ -n $states ]] && ((not_up == 0)) && (($(wc -w <<<"$states") == nodes)); then break; fi
  for s in $states; do  # down or drained, left over from an earlier run: return it to service
    [[ ${s#*=} =~ ^(drain|down|drng) ]] && scontrol update nodename="${s%%=*}" state=resume >/dev/null 2>&1 || true
  done
  sleep 0.2
done
[[ -n $states ]] && ((not_up == 0)) && (($(wc -w <<<"$states") == nodes)) \
  || die "nodes not up after 60 s (${states:-no answer}); see /var/log/slurm/slurmctld.log and slurmd-*.log"
# The controller may report a node from its saved state before its slurmd registered: a job with a
# task on every node proves the whole chain (munge, slurmctld, each slurmd and slurmstepd).
timeout 120 srun --quiet -N "$nodes" -n "$nodes" -t 1 -J start-probe true \
  || die "a test job (srun -N $nodes true) did not run; see /var/log/slurm/slurmctld.log and slurmd-*.log"
ms=$(($(date +%s%3N) - t0))
log "$nodes node(s) up ($states); SLURM ready in $((ms / 1000)).$((ms % 1000 / 100)) s"
