#!/usr/bin/env bash
#
# Create what deploy/docker-compose.yml mounts: the authority, every
# certificate, the services' configurations, the rendered NATS configuration
# and the simulated nodes' fake devices. The compose file's `init` service runs
# it (as the image's llmgw-compose-init) before anything else starts, on every
# `docker compose up`; run it again after changing the ledger:
#
#   docker compose -f deploy/docker-compose.yml run --rm init
#   docker compose -f deploy/docker-compose.yml kill -s HUP nats   # reload
#
# It is idempotent: the authority is created once, a certificate is issued only
# when it is missing or was signed by another authority, and the configurations
# and nats.conf are written anew each time from the settings below.
#
# Three volumes, so that no container sees more keys than it needs:
#   $LLMGW_PKI       the authority: CA key, ledger, the server's certificate.
#                    Mounted by `init` and the `ctl` tool only.
#   $LLMGW_NATS_DIR  what the NATS container needs and nothing more: nats.conf,
#                    ca.pem, server.pem, server-key.pem. The NATS container
#                    mounts it at $LLMGW_PKI, the path the rendered nats.conf
#                    names, so it never sees the CA key.
#   $LLMGW_CONF      the services', operator's and simulated nodes'
#                    configurations and certificates, one directory each.
#
# Settings (environment):
#   LLMGW               the llmgw command (default: llmgw)
#   LLMGW_PKI           default /etc/llmgw/pki
#   LLMGW_NATS_DIR      default /export/nats
#   LLMGW_CONF          default /etc/llmgw/conf
#   NATS_HOST           the server's name on the compose network (default nats)
#   NATS_EXTRA_HOSTS    more names/IPs for the server certificate
#                       (default "localhost 127.0.0.1", for the published port)
#   NATS_STORE_DIR      JetStream's directory in the NATS container (default /data/jetstream)
#   SIM_NODES           simulated nodes as NODE:FABRIC (FABRIC empty: no fabric)
#                       (default: the seed's "node01:ib-a node02:ib-a node03:ib-b node04:ib-b";
#                       empty: none). The compose file's sim profile runs node01-node04.
#   SIM_GPUS            GPUs per simulated node (default 8)
#   HEARTBEAT_INTERVAL  default 5s
#   NODE_LOST_AFTER     default 60s
#   GATEWAY_LISTEN      default 0.0.0.0:8080
#   NATS_PUBLISHED_PORT the host port NATS is published on, for operator-host.yaml
#                       (default 4222)
#   SIM_FAULT_DIR       where a simulated node's GPU faults are kept ({node}: its
#                       id); default /var/lib/llmgw-agent/gpu-state, in the node
#                       container's own writable work dir
#   NATS_SERVERS        1 (default) or 3: a 3-server NATS cluster (nats, nats-2,
#                       nats-3; the compose file's nats-cluster profile runs the
#                       other two), JetStream R3, routes over mutual TLS
set -euo pipefail

LLMGW="${LLMGW:-llmgw}"
PKI="${LLMGW_PKI:-/etc/llmgw/pki}"
NATS_DIR="${LLMGW_NATS_DIR:-/export/nats}"
CONF="${LLMGW_CONF:-/etc/llmgw/conf}"
NATS_HOST="${NATS_HOST:-nats}"
NATS_EXTRA_HOSTS="${NATS_EXTRA_HOSTS-localhost 127.0.0.1}"
NATS_STORE_DIR="${NATS_STORE_DIR:-/data/jetstream}"
SIM_NODES="${SIM_NODES-node01:ib-a node02:ib-a node03:ib-b node04:ib-b}"
SIM_GPUS="${SIM_GPUS:-8}"
HEARTBEAT_INTERVAL="${HEARTBEAT_INTERVAL:-5s}"
NODE_LOST_AFTER="${NODE_LOST_AFTER:-60s}"
GATEWAY_LISTEN="${GATEWAY_LISTEN:-0.0.0.0:8080}"
NATS_PUBLISHED_PORT="${NATS_PUBLISHED_PORT:-4222}"
NATS_SERVERS="${NATS_SERVERS:-1}"
SIM_FAULT_DIR="${SIM_FAULT_DIR:-/var/lib/llmgw-agent/gpu-state}"
case "$NATS_SERVERS" in
  1) NATS_HOSTS=("$NATS_HOST");;
  3) NATS_HOSTS=("$NATS_HOST" "$NATS_HOST-2" "$NATS_HOST-3");;
  *) echo "compose-init: NATS_SERVERS must be 1 or 3 (a cluster needs a majority), got '$NATS_SERVERS'" >&2; exit 2;;
esac
# YAML for `server:`: one URL, or the list of the cluster's.
SERVER_URL="[$(printf 'tls://%s:4222, ' "${NATS_HOSTS[@]}" | sed 's/, $//')]"
KV_REPLICAS="$NATS_SERVERS"

say() { printf 'compose-init: %s\n' "$*"; }
# `command`: with the default LLMGW=llmgw, the function would call itself.
llmgw() { command "$LLMGW" "$@" >/dev/null; }
umask 077

# -- the authority and the server's certificate ---------------------------------
if [ ! -f "$PKI/ca-key.pem" ]; then
  say "creating the authority in $PKI"
  llmgw ctl cert init-ca --dir "$PKI"
fi
# The server certificate names every server's host: issued again when the set
# of hosts changes (1 -> 3 servers), or it would be refused by name.
SERVER_HOSTS="${NATS_HOSTS[*]} $NATS_EXTRA_HOSTS"
if [ ! -f "$PKI/server.pem" ] || [ "$(cat "$PKI/server-hosts" 2>/dev/null)" != "$SERVER_HOSTS" ]; then
  say "issuing the NATS server's certificate for $SERVER_HOSTS"
  # shellcheck disable=SC2086  # a list of names
  llmgw ctl cert issue-server $SERVER_HOSTS --dir "$PKI"
  printf '%s' "$SERVER_HOSTS" >"$PKI/server-hosts"
fi
if [ "$NATS_SERVERS" = 3 ]; then
  for i in 1 2 3; do
    if [ ! -f "$PKI/certs/route/nats$i.pem" ]; then
      say "issuing route certificate nats$i for ${NATS_HOSTS[$((i - 1))]}"
      llmgw ctl cert issue-route "nats$i" "${NATS_HOSTS[$((i - 1))]}" --dir "$PKI"
    fi
  done
fi

# A certificate is (re)issued when missing, or when its directory's ca.pem is
# not the authority's (the pki volume was recreated): a stale one would be
# refused at the TLS handshake with nothing but "bad certificate".
current() { [ -f "$1/$2.pem" ] && cmp -s "$PKI/ca.pem" "$1/ca.pem"; }
identity() { # DIR NAME ROLE
  if ! current "$1" "$2"; then
    say "issuing $3 certificate $2"
    if [ "$3" = node ]; then
      llmgw ctl cert issue-client "$2" --dir "$PKI" --out "$1"
    else
      llmgw ctl cert issue-service "$2" --role "$3" --dir "$PKI" --out "$1"
    fi
    install -m 0644 "$PKI/ca.pem" "$1/ca.pem"
  fi
}

# -- the four services and the operator ----------------------------------------
service_yaml() { # NAME SERVER
  cat <<YAML
# Written by compose-init.sh; format: the docstring of shared/config.py.
# tls paths are relative to this file.
server: $2
tls: {ca: ca.pem, cert: $1.pem, key: $1-key.pem}
YAML
}
for svc in registry health scheduler gateway; do
  dir="$CONF/$svc"
  mkdir -p "$dir"
  identity "$dir" "$svc" "$svc"
  {
    service_yaml "$svc" "$SERVER_URL"
    echo "metrics_listen: 0.0.0.0:9100"
    echo "kv_replicas: $KV_REPLICAS"
    case "$svc" in
      health) echo "health: {heartbeat_interval: $HEARTBEAT_INTERVAL, node_lost_after: $NODE_LOST_AFTER}";;
      gateway) echo "gateway: {listen: \"$GATEWAY_LISTEN\"}";;
    esac
  } >"$dir/$svc.yaml"
done
dir="$CONF/operator"
mkdir -p "$dir"
identity "$dir" operator operator
service_yaml operator "$SERVER_URL" >"$dir/operator.yaml"
# The same identity from the host, through the published port.
service_yaml operator "tls://127.0.0.1:$NATS_PUBLISHED_PORT" >"$dir/operator-host.yaml"

# -- simulated nodes: the seed's agent.yaml, the devices of `llmgw up`'s sim nodes
for spec in $SIM_NODES; do
  node="${spec%%:*}"
  fabric="${spec#*:}"
  [ "$fabric" != "$spec" ] || fabric=""
  dir="$CONF/nodes/$node"
  mkdir -p "$dir/tls"
  identity "$dir/tls" "$node" node

  # The same simulated nvidia-smi and sysfs tree as `llmgw up`'s nodes: every
  # query the agent makes (inventory, ECC and retired pages, compute apps) in
  # the real tool's shape, and GPU faults read from the node's own writable
  # work dir, where `llmgw sim gpu-fault NODE I --agent-config …` run in the
  # node's container writes them (this volume is read-only there). The
  # container is the machine: all its GPU-using processes are its own.
  hcas=""
  [ -z "$fabric" ] || hcas="mlx5_0,mlx5_1"
  llmgw sim node-devices "$dir" --node "$node" --gpus "$SIM_GPUS" --hcas "$hcas" \
    --state-dir "${SIM_FAULT_DIR//\{node\}/$node}" --own-machine

  fabrics="fabrics: []"
  if [ -n "$fabric" ]; then
    fabrics="fabrics:
  - name: $fabric
    hcas: [mlx5_0, mlx5_1]"
  fi
  cat >"$dir/agent.yaml" <<YAML
# $node (simulated, fabric ${fabric:-none})
#
# Written by compose-init.sh in the seed's agent.yaml format. Fabric membership
# is configuration and there is no way around it: OpenSM's default subnet
# prefix is the same on every fabric, so a matching prefix proves nothing and a
# wrong guess produces a replica that starts, passes health checks and then
# hangs on its first all-reduce. Relative paths are relative to this file.
node_id: $node
server: $SERVER_URL
tls:
  ca: tls/ca.pem
  cert: tls/$node.pem
  key: tls/$node-key.pem
# The container's name on the compose network. The agent resolves it at start
# and at every discovery; its engines bind the address it resolves to, and
# peers and the gateway reach them through the name.
mgmt_addr: "$node"
mgmt_interface: eth0
heartbeat_interval: $HEARTBEAT_INTERVAL
reconnect_base: 1s
reconnect_max: 10s
$fabrics
discovery:
  # The simulated nvidia-smi of the nodes of 'llmgw up', and a sysfs-shaped
  # directory with its fabric's HCAs ACTIVE: no GPU, no InfiniBand needed.
  nvidia_smi: bin/nvidia-smi
  ib_root: ib
  prefer_nvml: false
  skip_gpus: false
supervisor:
  work_dir: /var/lib/llmgw-agent
  log_lines: 512
  stop_timeout: 10s
  health_interval: 1s
YAML
done

# -- the NATS servers' configuration, rendered from the ledger --------------------
say "rendering the configuration of $NATS_SERVERS NATS server(s) from the ledger"
mkdir -p "$NATS_DIR"
install_nats() { # FILE under $PKI -> the same path under $NATS_DIR, atomically
  local to="$NATS_DIR/$1"
  mkdir -p "$(dirname "$to")"
  install -m 0600 "$PKI/$1" "$(dirname "$to")/.$(basename "$to").new"
  mv -f "$(dirname "$to")/.$(basename "$to").new" "$to"
}
for f in ca.pem server.pem server-key.pem; do install_nats "$f"; done
# Written atomically: a server reloading meanwhile never reads half a file.
if [ "$NATS_SERVERS" = 1 ]; then
  "$LLMGW" ctl nats-config --pki "$PKI" --listen 0.0.0.0:4222 --monitor 0.0.0.0:8222 \
    --store-dir "$NATS_STORE_DIR" --server-name llmgw --out "$NATS_DIR/nats.conf"
  rm -f "$NATS_DIR"/nats[123].conf
else
  for i in 1 2 3; do install_nats "certs/route/nats$i.pem"; install_nats "certs/route/nats$i-key.pem"; done
  "$LLMGW" ctl nats-config --pki "$PKI" --store-dir "$NATS_STORE_DIR" --out-dir "$NATS_DIR" \
    --server "nats1=${NATS_HOSTS[0]}" --server "nats2=${NATS_HOSTS[1]}" --server "nats3=${NATS_HOSTS[2]}" >/dev/null 2>&1
  # The compose file's `nats` service reads nats.conf: in a cluster, server 1's.
  mv -f "$NATS_DIR/nats1.conf" "$NATS_DIR/nats.conf"
fi
others=""
[ "$NATS_SERVERS" = 1 ] || others=" (nats2.conf, nats3.conf alike)"
say "done: $(grep -c '"user"' "$NATS_DIR/nats.conf") identities in nats.conf$others"
