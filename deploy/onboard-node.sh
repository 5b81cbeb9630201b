#!/usr/bin/env bash
#
# Give a machine an identity in an llmgw cluster.
#
# Run on the host that holds the certificate authority, because that is the one
# thing that cannot be delegated: this script issues the credential by which the
# control plane will believe the node is who it says it is.
#
# What it does, in the order it matters:
# 0. check everything it can before changing anything: the node id, the URL,
#    the fabrics, ssh to the machine, llmgw there
# 1. issue a client certificate whose subject is CN=<node id>,OU=node (and
#    whose URI SAN is urn:llmgw:node:<node id>), which adds the node to the
#    authority's ledger
# 2. re-render the NATS server's configuration from the ledger and reload the
#    server, so the server knows the new identity before the agent first
#    connects (the server maps a certificate to a user by that SAN; a node
#    not in the rendered config is refused at connect); then record the node's
#    management address with the registry ('llmgw ctl node set-addr'): clients'
#    requests go to that address, so it is the operator's word, not the node's
# 3. copy the CA root, the certificate and its key (0600) to the machine
# 4. install the configuration and the unit (and llmgw itself, --install-wheel)
# 5. start the agent
#
# The node id, the VM name, the hostname and the certificate common name are all
# the same string. They do not have to be, and every time they are not, someone
# spends an afternoon working out which of the four a message is talking about.
set -euo pipefail

SELF_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
  cat >&2 <<USAGE
usage: $0 --node ID --addr HOST --server URL [options]
  --node ID           node id, hostname and certificate common name:
                      lowercase letters, digits and '-' (it is also a NATS
                      subject token)
  --addr HOST         how to reach the machine over ssh
  --server URL        the NATS server agents connect to, e.g. tls://10.0.0.140:4222
                      (a list: repeat --server for each server of a cluster)
  --fabric NAME       InfiniBand fabric this node is attached to; repeatable as
  --fabric NAME:hca1,hca2 . Without HCAs, mlx5_0,mlx5_1. Omit for a node with no
                      fabric, which can host single-node replicas and will never
                      be given a multi-node one.
  --mgmt-addr ADDR    address engines are reachable on (default: --addr)
  --mgmt-if NAME      interface NCCL bootstraps over (default eth0)
  --nvidia-smi PATH   where nvidia-smi lives, when it is not on PATH. Containerized
                      driver installs routinely put it somewhere else.
  --ib-root DIR       the sysfs InfiniBand directory (default /sys/class/infiniband)
  --pki DIR           where the authority lives (default /etc/llmgw/pki)
  --binary PATH       the llmgw command used here (default: the one on PATH)
  --ssh-user NAME     (default: you, $(id -un))
  --operator-config F operator.yaml for 'llmgw ctl' (default: \$LLMGW_CONFIG, then
                      ./.llmgw/operator.yaml), used to record the address
  --no-record-addr    do not record the address now; run
                      'llmgw ctl node set-addr NODE ADDR' yourself (until then the
                      node's own claim is taken and 'ctl nodes' marks it unverified)

 the NATS server (step 2); the defaults match deploy/systemd/llmgw-nats.service:
  --nats-config FILE  the server configuration to re-render (default /etc/llmgw/nats.conf)
  --nats-listen H:P   its client address (default 0.0.0.0:<port of the first --server>)
  --nats-monitor H:P  its monitoring address, or 'off' (default 127.0.0.1:8222)
  --nats-store-dir D  its JetStream directory (default /var/lib/llmgw-nats/jetstream)
  --reload-cmd CMD    how to make the server reload, run with sh -c
                      (default: systemctl reload llmgw-nats; or e.g.
                      'nats-server --signal reload=/run/nats.pid')
  --no-reload         render only; reload yourself before the agent can connect

 the machine (steps 3-5):
  --unit FILE         the agent's unit (default: systemd/llmgw-agent.service
                      next to this script)
  --install-wheel WHL install this llmgw wheel into /opt/llmgw on the machine and
                      link /usr/local/bin/llmgw; without it, llmgw must already be
                      installed there as /usr/local/bin/llmgw
  --trust-root        also add the CA to the machine's system trust store. Off by
                      default: the agent names its CA file itself, and a CA
                      without name constraints in the system store could vouch
                      for any TLS server that machine talks to.
USAGE
  exit 2
}

die() { echo "onboard-node: $*" >&2; exit 1; }
say() { printf '  %s\n' "$*"; }

NODE='' ADDR='' MGMT='' MGMT_IF=eth0
SERVERS=()
FABRICS=()
NVIDIA_SMI='' IB_ROOT=/sys/class/infiniband
PKI=/etc/llmgw/pki BINARY='' SSH_USER="$(id -un)"
NATS_CONFIG=/etc/llmgw/nats.conf NATS_LISTEN='' NATS_MONITOR=127.0.0.1:8222
NATS_STORE_DIR=/var/lib/llmgw-nats/jetstream
RELOAD_CMD="systemctl reload llmgw-nats" RELOAD=yes
UNIT="$SELF_DIR/systemd/llmgw-agent.service" WHEEL='' TRUST_ROOT=no
OPCONF="${LLMGW_CONFIG:-}" RECORD_ADDR=yes

need() {
  if [ $# -lt 2 ] || [ -z "$2" ]; then
    echo "onboard-node: $1 needs a value" >&2
    usage
  fi
}
while [ $# -gt 0 ]; do
  case "$1" in
    --node) need "$@"; NODE="$2"; shift 2;;
    --addr) need "$@"; ADDR="$2"; shift 2;;
    --server) need "$@"; SERVERS+=("$2"); shift 2;;
    --fabric) need "$@"; FABRICS+=("$2"); shift 2;;
    --mgmt-addr) need "$@"; MGMT="$2"; shift 2;;
    --mgmt-if) need "$@"; MGMT_IF="$2"; shift 2;;
    --nvidia-smi) need "$@"; NVIDIA_SMI="$2"; shift 2;;
    --ib-root) need "$@"; IB_ROOT="$2"; shift 2;;
    --pki) need "$@"; PKI="$2"; shift 2;;
    --binary) need "$@"; BINARY="$2"; shift 2;;
    --ssh-user) need "$@"; SSH_USER="$2"; shift 2;;
    --nats-config) need "$@"; NATS_CONFIG="$2"; shift 2;;
    --nats-listen) need "$@"; NATS_LISTEN="$2"; shift 2;;
    --nats-monitor) need "$@"; NATS_MONITOR="$2"; shift 2;;
    --nats-store-dir) need "$@"; NATS_STORE_DIR="$2"; shift 2;;
    --reload-cmd) need "$@"; RELOAD_CMD="$2"; shift 2;;
    --no-reload) RELOAD=no; shift;;
    --unit) need "$@"; UNIT="$2"; shift 2;;
    --install-wheel) need "$@"; WHEEL="$2"; shift 2;;
    --trust-root) TRUST_ROOT=yes; shift;;
    --operator-config) need "$@"; OPCONF="$2"; shift 2;;
    --no-record-addr) RECORD_ADDR=no; shift;;
    -h|--help) usage;;
    *) echo "onboard-node: unknown option $1" >&2; usage;;
  esac
done
if [ -z "$NODE" ] || [ -z "$ADDR" ] || [ ${#SERVERS[@]} -eq 0 ]; then usage; fi

# -- 0. everything that can be checked before anything changes ---------------

# One token of lowercase letters, digits and inner '-' (shared/names.py): the
# id is a NATS subject token, a hostname and a certificate CN at once, and it
# is pasted into remote shell commands below, so nothing else may pass.
TOKEN='^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$'
if ! [[ "$NODE" =~ $TOKEN ]]; then
  die "invalid node id '$NODE': use 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit"
fi

for url in "${SERVERS[@]}"; do
  case "$url" in
    http://*|https://*)
      die "--server $url is an HTTP(S) endpoint from the earlier design; agents now reach the control plane through NATS: give the NATS server's URL, e.g. tls://HOST:4222";;
    tls://?*|nats://?*) ;;
    *) die "--server $url: expected a NATS URL, e.g. tls://HOST:4222";;
  esac
done
if [ -z "$NATS_LISTEN" ]; then
  port="${SERVERS[0]##*:}"
  [[ "$port" =~ ^[0-9]+$ ]] || port=4222
  NATS_LISTEN="0.0.0.0:$port"
fi

# Fabric membership is configuration (see the comment written into agent.yaml),
# so it is checked here as carefully as the agent will check it at start.
FABRIC_YAML=""
SEEN_HCAS=" "
SEEN_FABRICS=" "
for spec in "${FABRICS[@]}"; do
  name="${spec%%:*}"
  hcas="mlx5_0,mlx5_1"
  if [ "${spec#*:}" != "$spec" ]; then hcas="${spec#*:}"; fi
  [[ "$name" =~ $TOKEN ]] || die "--fabric $spec: invalid fabric name '$name' (lowercase letters, digits and '-')"
  case "$SEEN_FABRICS" in *" $name "*) die "--fabric $name is given twice";; esac
  SEEN_FABRICS="$SEEN_FABRICS$name "
  [ -n "$hcas" ] || die "--fabric $spec: no HCA after ':'"
  list=""
  IFS=',' read -r -a hca_array <<<"$hcas"
  for hca in "${hca_array[@]}"; do
    # The rule of llmgw/shared/names.py (HCA_NAME_PATTERN), which the agent applies again on start.
    [[ "$hca" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ ]] || die "--fabric $spec: '$hca' is not an HCA name (as under /sys/class/infiniband, e.g. mlx5_0)"
    case "$SEEN_HCAS" in *" $hca "*) die "--fabric $spec: HCA $hca is already listed; a port is cabled to one fabric";; esac
    SEEN_HCAS="$SEEN_HCAS$hca "
    list="${list:+$list, }$hca"
  done
  FABRIC_YAML="$FABRIC_YAML
  - name: $name
    hcas: [$list]"
done
if [ -n "$FABRIC_YAML" ]; then
  FABRIC_YAML="fabrics:$FABRIC_YAML"
else
  FABRIC_YAML="fabrics: []"
fi

MGMT="${MGMT:-$ADDR}"
# A bare host (IP or DNS name): it becomes http://HOST:PORT for clients' requests.
case "$MGMT" in
  *://*|*/*|*@*|*\[*|*\]*) die "--mgmt-addr '$MGMT' must be a bare host (an IP address or DNS name): no scheme, path, user or brackets";;
esac
if [[ "$MGMT" =~ ^[^:]+:[0-9]+$ ]]; then
  die "--mgmt-addr '$MGMT' has a port; give the bare host (the scheduler chooses ports)"
fi
[[ "$MGMT_IF" =~ ^[A-Za-z0-9_.-]{1,15}$ ]] || die "--mgmt-if '$MGMT_IF' is not a network interface name"
BINARY="${BINARY:-$(command -v llmgw || true)}"
if [ -z "$BINARY" ] || [ ! -x "$BINARY" ]; then die "no llmgw command here; pass --binary"; fi
[ -f "$PKI/ca-key.pem" ] || die "no authority in $PKI; run 'llmgw ctl cert init-ca --dir $PKI' first"
[ -f "$UNIT" ] || die "no agent unit at $UNIT; pass --unit"
[ -z "$WHEEL" ] || [ -f "$WHEEL" ] || die "--install-wheel $WHEEL: no such file"

SSH=(ssh -o BatchMode=yes -o ConnectTimeout=10 "$SSH_USER@$ADDR")
SCP=(scp -q -o BatchMode=yes -o ConnectTimeout=10)
# Staged in the ssh user's home, in a directory only that user can enter: not
# in /tmp, where another user could swap a file between copy and install.
STAGE=".llmgw-onboard-$NODE"

echo "onboarding $NODE at $ADDR"
"${SSH[@]}" true || die "cannot reach $SSH_USER@$ADDR over ssh"
if [ -z "$WHEEL" ]; then
  "${SSH[@]}" 'test -x /usr/local/bin/llmgw' ||
    die "llmgw is not installed on $ADDR as /usr/local/bin/llmgw; install it there or pass --install-wheel"
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# -- 1. The certificate ---------------------------------------------------------
# Issued fresh every time: re-onboarding a machine should not depend on finding
# an old key. The server pins the ledger's certificates, so the node's older
# certificate stops working at the reload below; refusing the node altogether
# is 'llmgw ctl cert revoke', a separate decision.
say "issuing a certificate (CN=$NODE,OU=node)"
"$BINARY" ctl cert issue-client "$NODE" --dir "$PKI" --out "$TMP" >/dev/null

# -- 2. The server learns the identity ----------------------------------------
say "rendering $NATS_CONFIG from the ledger"
"$BINARY" ctl nats-config --pki "$PKI" --listen "$NATS_LISTEN" --monitor "$NATS_MONITOR" \
  --store-dir "$NATS_STORE_DIR" --out "$NATS_CONFIG"
if [ "$RELOAD" = yes ]; then
  say "reloading the NATS server: $RELOAD_CMD"
  sh -c "$RELOAD_CMD" ||
    die "the reload command failed; the server does not know $NODE yet. Reload it ('nats-server --signal reload'), then run this again"
else
  say "not reloading (--no-reload): reload the server before $NODE can connect"
fi
if [ "$RECORD_ADDR" = yes ]; then
  say "recording $NODE's management address $MGMT with the registry"
  if ! "$BINARY" ctl node set-addr "$NODE" "$MGMT" ${OPCONF:+--config "$OPCONF"} >/dev/null; then
    echo "onboard-node: WARNING: could not record the address (is the registry running, is there an operator.yaml?)." >&2
    echo "onboard-node: until you run '$BINARY ctl node set-addr $NODE $MGMT', $NODE's own claim is taken and 'llmgw ctl nodes' shows it unverified." >&2
  fi
fi

# -- 3 and 4. Identity, configuration, unit -------------------------------------
say "writing the configuration"
if [ ${#SERVERS[@]} -eq 1 ]; then
  SERVER_YAML="server: \"${SERVERS[0]}\""
else
  SERVER_YAML="server:"
  for url in "${SERVERS[@]}"; do SERVER_YAML="$SERVER_YAML
  - \"$url\""; done
fi
cat >"$TMP/agent.yaml" <<YAML
# $NODE
#
# Written by onboard-node.sh. Fabric membership is configuration and there is no
# way around it: OpenSM's default subnet prefix is the same on every fabric, so
# a matching prefix proves nothing and a wrong guess produces a replica that
# starts, passes health checks and then hangs on its first all-reduce.
node_id: $NODE
# The NATS server (tls://HOST:4222), or a list of a cluster's servers.
$SERVER_YAML
tls:
  ca: /etc/llmgw/ca.pem
  cert: /etc/llmgw/agent.pem
  key: /etc/llmgw/agent-key.pem
mgmt_addr: "$MGMT"
mgmt_interface: $MGMT_IF
heartbeat_interval: 5s
reconnect_base: 1s
reconnect_max: 30s
$FABRIC_YAML
discovery:
  # Empty means look on PATH. Worth setting where the driver lives outside the
  # default paths, which containerized installs routinely do.
  nvidia_smi: "$NVIDIA_SMI"
  ib_root: $IB_ROOT
  prefer_nvml: false
  skip_gpus: false
supervisor:
  work_dir: /var/lib/llmgw-agent
  log_lines: 512
  stop_timeout: 60s
  health_interval: 2s
YAML
cp "$UNIT" "$TMP/llmgw-agent.service"
FILES=("$PKI/ca.pem" "$TMP/$NODE.pem" "$TMP/$NODE-key.pem" "$TMP/agent.yaml" "$TMP/llmgw-agent.service")
if [ -n "$WHEEL" ]; then
  WHEEL_NAME="$(basename "$WHEEL")"
  FILES+=("$WHEEL")
fi

say "copying the certificate, its key, agent.yaml and the unit"
"${SSH[@]}" "set -e; umask 077; rm -rf $STAGE; mkdir -m 0700 $STAGE"
"${SCP[@]}" "${FILES[@]}" "$SSH_USER@$ADDR:$STAGE/"

if [ -n "$WHEEL" ]; then
  say "installing llmgw from $WHEEL_NAME into /opt/llmgw"
  "${SSH[@]}" "set -e
sudo python3 -m venv /opt/llmgw
sudo /opt/llmgw/bin/pip install --quiet $STAGE/$WHEEL_NAME
sudo ln -sf /opt/llmgw/bin/llmgw /usr/local/bin/llmgw"
fi

say "installing them"
"${SSH[@]}" "set -e
sudo install -d -m 0755 /etc/llmgw
sudo install -m 0644 $STAGE/ca.pem /etc/llmgw/ca.pem
sudo install -m 0644 $STAGE/$NODE.pem /etc/llmgw/agent.pem
sudo install -m 0600 $STAGE/$NODE-key.pem /etc/llmgw/agent-key.pem
sudo install -m 0644 $STAGE/agent.yaml /etc/llmgw/agent.yaml
sudo install -m 0644 $STAGE/llmgw-agent.service /etc/systemd/system/llmgw-agent.service"

if [ "$TRUST_ROOT" = yes ]; then
  say "adding the CA to the system trust store"
  "${SSH[@]}" "set -e
sudo install -D -m 0644 $STAGE/ca.pem /usr/local/share/ca-certificates/llmgw-ca.crt
sudo update-ca-certificates >/dev/null 2>&1 || true"
fi
"${SSH[@]}" "rm -rf $STAGE"

# -- 5. The agent ------------------------------------------------------------------
# restart, not start: a re-onboarded node must pick up its new certificate.
# KillMode=process in the unit keeps running engines alive across it.
say "starting the agent"
"${SSH[@]}" 'set -e
sudo systemctl daemon-reload
sudo systemctl enable --quiet llmgw-agent
sudo systemctl restart llmgw-agent'

echo
echo "$NODE onboarded. It should appear in 'llmgw ctl nodes' within a few seconds."
echo "If it does not: 'journalctl -u llmgw-agent' on $ADDR says why. A certificate"
echo "whose common name does not match node_id is refused by the agent at start,"
echo "and one the NATS server does not know (not re-rendered, not reloaded) at connect."
