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
SERVER_URL="tls://$NATS_HOST:4222"

say() { printf 'compose-init: %s\n' "$*"; }
# `command`: with the default LLMGW=llmgw, the function would call itself.
llmgw() { command "$LLMGW" "$@" >/dev/null; }
umask 077

# -- the authority and the server's certificate ---------------------------------
if [ ! -f "$PKI/ca-key.pem" ]; then
  say "creating the authority in $PKI"
  llmgw ctl cert init-ca --dir "$PKI"
fi
if [ ! -f "$PKI/server.pem" ]; then
  say "issuing the NATS server's certificate for $NATS_HOST $NATS_EXTRA_HOSTS"
  # shellcheck disable=SC2086  # NATS_EXTRA_HOSTS is a list of names
  llmgw ctl cert issue-server "$NATS_HOST" $NATS_EXTRA_HOSTS --dir "$PKI"
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

# -- simulated nodes: the seed's agent.yaml, a fake nvidia-smi, a sysfs-shaped ib_root
gpu_uuid() { # NODE INDEX -> a stable UUID-shaped id
  printf '%s' "$1.gpu$2" | md5sum | sed -E 's/^(.{8})(.{4})(.{4})(.{4})(.{12}).*/GPU-\1-\2-\3-\4-\5/'
}
for spec in $SIM_NODES; do
  node="${spec%%:*}"
  fabric="${spec#*:}"
  [ "$fabric" != "$spec" ] || fabric=""
  dir="$CONF/nodes/$node"
  mkdir -p "$dir/tls" "$dir/bin" "$dir/ib"
  identity "$dir/tls" "$node" node

  # nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id --format=csv,noheader,nounits
  {
    echo '#!/bin/sh'
    echo "# Simulated nvidia-smi for $node: its inventory in the real query's CSV shape."
    echo "cat <<'EOF'"
    i=0
    while [ "$i" -lt "$SIM_GPUS" ]; do
      printf '%d, %s, NVIDIA H200, 143771, 00000000:%02X:00.0\n' "$i" "$(gpu_uuid "$node" "$i")" $((0x18 + i * 0x10))
      i=$((i + 1))
    done
    echo "EOF"
  } >"$dir/bin/nvidia-smi"
  chmod 0755 "$dir/bin/nvidia-smi"

  fabrics="fabrics: []"
  if [ -n "$fabric" ]; then
    fabrics="fabrics:
  - name: $fabric
    hcas: [mlx5_0, mlx5_1]"
    for hca in mlx5_0 mlx5_1; do
      mkdir -p "$dir/ib/$hca/ports/1"
      echo "4: ACTIVE" >"$dir/ib/$hca/ports/1/state"
      echo "5: LinkUp" >"$dir/ib/$hca/ports/1/phys_state"
      echo "200 Gb/sec (4X HDR)" >"$dir/ib/$hca/ports/1/rate"
      echo "InfiniBand" >"$dir/ib/$hca/ports/1/link_layer"
    done
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
server: "$SERVER_URL"
tls:
  ca: tls/ca.pem
  cert: tls/$node.pem
  key: tls/$node-key.pem
# The container's name on the compose network: engines bind it, peers and the
# gateway reach them through it.
mgmt_addr: "$node"
mgmt_interface: eth0
heartbeat_interval: $HEARTBEAT_INTERVAL
reconnect_base: 1s
reconnect_max: 10s
$fabrics
discovery:
  # A fake nvidia-smi printing this node's GPUs, and a sysfs-shaped directory
  # with its fabric's HCAs ACTIVE: no GPU, no InfiniBand needed.
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

# -- the NATS server's configuration, rendered from the ledger --------------------
say "rendering nats.conf from the ledger"
mkdir -p "$NATS_DIR"
for f in ca.pem server.pem server-key.pem; do
  install -m 0600 "$PKI/$f" "$NATS_DIR/.$f.new"
  mv -f "$NATS_DIR/.$f.new" "$NATS_DIR/$f"
done
# Written atomically: a server reloading meanwhile never reads half a file.
"$LLMGW" ctl nats-config --pki "$PKI" --listen 0.0.0.0:4222 --monitor 0.0.0.0:8222 \
  --store-dir "$NATS_STORE_DIR" --server-name llmgw --out "$NATS_DIR/nats.conf"
say "done: $(grep -c '"user"' "$NATS_DIR/nats.conf") identities in nats.conf"
