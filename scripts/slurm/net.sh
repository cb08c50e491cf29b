# shellcheck shell=bash
# The private network of the one-machine SLURM cluster (sourced by start.sh and stop.sh; see
# [Note: N nodes on one machine] in start.sh): a bridge in the root namespace and, per node, a
# network namespace joined to it by a veth pair. Every function is idempotent.

PF_NET=${PF_SLURM_NET:-10.250.17}        # first three octets of the /24 the cluster uses
PF_BRIDGE=pfslurm0                       # bridge in the root namespace
PF_BRIDGE_ADDR=$PF_NET.1                 # the controller's address on it
PF_NODE_PREFIX=pfnode                    # node I is network namespace and hostname pfnodeI

pf_node_name() { echo "$PF_NODE_PREFIX$1"; }
pf_node_addr() { echo "$PF_NET.$((10 + $1))"; }

# Node namespaces that exist now (pfnode*), one a line.
pf_existing_nodes() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^$PF_NODE_PREFIX" || true; }

pf_bridge_up() {
  ip link show "$PF_BRIDGE" >/dev/null 2>&1 || ip link add "$PF_BRIDGE" type bridge
  [[ $(ip addr show dev "$PF_BRIDGE") == *"inet $PF_BRIDGE_ADDR/24 "* ]] || ip addr add "$PF_BRIDGE_ADDR/24" dev "$PF_BRIDGE"
  ip link set "$PF_BRIDGE" up
}

# Namespace pfnodeI with eth0 (address pf_node_addr I) on the bridge, loopback up.
pf_node_up() {
  local i=$1 ns veth addr
  ns=$(pf_node_name "$i") addr=$(pf_node_addr "$i")
  veth="pfslurm$i"  # root-namespace end of the node's veth pair (interface names: 15 characters at most)
  [[ -e /run/netns/$ns ]] || ip netns add "$ns"
  if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
    ip link del "$veth" 2>/dev/null || true
    ip link add "$veth" type veth peer name eth0 netns "$ns"
  fi
  ip link set "$veth" master "$PF_BRIDGE" up
  ip -n "$ns" link set lo up
  [[ $(ip -n "$ns" addr show dev eth0) == *"inet $addr/24 "* ]] || ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
}

# /etc/netns/pfnodeI/hosts for nodes 1..$1: the controller and every node by name (start.sh mounts
# it on the node's /etc/hosts, so node names resolve inside the nodes as DNS would on a cluster).
pf_write_hosts() {
  local n=$1 i j ns
  for ((i = 1; i <= n; i++)); do
    ns=$(pf_node_name "$i")
    install -d -m 0755 "/etc/netns/$ns"
    {
      echo "127.0.0.1 localhost"
      echo "$PF_BRIDGE_ADDR $(hostname -s)"
      for ((j = 1; j <= n; j++)); do echo "$(pf_node_addr "$j") $(pf_node_name "$j")"; done
    } >"/etc/netns/$ns/hosts"  # rewritten in place: a running node's bind mount keeps this inode
  done
}

# Kill every process left in node namespace $1 (job steps of a stopped slurmd), then remove it.
pf_remove_node() {
  local ns=$1 i pids
  i=${ns#"$PF_NODE_PREFIX"}
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [[ -n $pids ]] && kill -9 $pids 2>/dev/null || true
  ip netns del "$ns" 2>/dev/null || true
  ip link del "pfslurm$i" 2>/dev/null || true
  rm -rf "/etc/netns/$ns"
}

pf_bridge_down() { ip link del "$PF_BRIDGE" 2>/dev/null || true; }
