#!/usr/bin/env bash
#
# The seed story in containers, end to end, against deploy/docker-compose.yml:
# build the image (llmgw installed from a wheelhouse made here, so the build
# needs no package index), bring up NATS, the four services and the sim
# profile's four nodes, apply deploy/seed-deployment.yaml, wait for both
# replicas from the host (`llmgw ctl replicas -o json` under the operator
# identity copied out of the conf volume), serve a chat completion from the
# host through the published gateway port with the official `openai` client,
# `docker kill` node02's container, wait for the replacement on ib-b, serve
# again, and print the timeline. Everything it started — containers, networks,
# volumes, the wheelhouse, its temporary directory — is removed on any exit;
# the images stay.
#
#   deploy/compose-smoke.sh [--make-base] [--base IMAGE] [--nats-servers 1|3]
#
#   --make-base   make the base image llmgw-base:bookworm (Debian bookworm by
#                 debootstrap: python3, python3-venv; needs root and the
#                 debootstrap package) unless it exists, and build on it. For
#                 machines that reach no image registry.
#   --base IMAGE  build on IMAGE (any image with Python >= 3.11 and venv)
#                 instead of the Dockerfile's default, python:3.11-slim.
#   --nats-servers 3
#                 NATS as a 3-server cluster (the nats-cluster profile,
#                 NATS_SERVERS=3, JetStream R3); nats-2 is killed before
#                 node02, and the story must hold on the two left.
#
# Along the way it also checks that no node's agent logs a "not read" warning
# (every nvidia-smi query answered in the real tool's shape), and that a GPU
# fault made on a node as 'llmgw sim gpu-fault … --agent-config' (run in the
# node's container) takes the GPU out of service and 'gpu-ok' brings it back.
#
# Environment: SMOKE_PROJECT (compose project, default llmgw-smoke, so a stack
# of your own under the default project is left alone), LLMGW_IMAGE (default
# llmgw:dev), SMOKE_TIMEOUT (seconds per wait, default 180). The nodes run with
# compressed timings (heartbeats every 1s, lost after 5s) through the compose
# file's HEARTBEAT_INTERVAL / NODE_LOST_AFTER; the published ports are free
# ones picked here. It uses `docker compose` where the plugin is installed,
# else docker-compose (1.28+). Exit 0: the story held; 1: a step failed (the
# containers' last log lines are printed first); 2: bad usage or no Docker.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMPOSE_FILE_PATH="$ROOT/deploy/docker-compose.yml"
WHEELHOUSE="$ROOT/deploy/wheelhouse"
LOCAL_BASE="llmgw-base:bookworm"
PROJECT="${SMOKE_PROJECT:-llmgw-smoke}"
TIMEOUT="${SMOKE_TIMEOUT:-180}"
export LLMGW_IMAGE="${LLMGW_IMAGE:-llmgw:dev}"

MAKE_BASE=0
BASE=""
NATS_SERVERS=1
usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --make-base) MAKE_BASE=1; shift;;
    --base) [ $# -ge 2 ] || { echo "compose-smoke: --base needs an image" >&2; exit 2; }; BASE="$2"; shift 2;;
    --nats-servers)
      case "${2:-}" in 1|3) NATS_SERVERS="$2"; shift 2;; *) echo "compose-smoke: --nats-servers takes 1 or 3" >&2; exit 2;; esac;;
    -h|--help) usage; exit 0;;
    *) echo "compose-smoke: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done

T0="$EPOCHREALTIME"
TIMELINE=()
elapsed() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%6.1f", b - a }'; }
say() { printf '[%ss] %s\n' "$(elapsed)" "$*"; }
mark() { TIMELINE+=("$(elapsed)s  $*"); say "$*"; }
die() { printf 'compose-smoke: FAILED: %s\n' "$*" >&2; exit 1; }

if ! docker info >/dev/null 2>&1; then
  echo "compose-smoke: no Docker engine answers ('docker info' fails); start dockerd first" >&2
  exit 2
fi
if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  COMPOSE=(docker-compose)
else
  echo "compose-smoke: neither 'docker compose' nor 'docker-compose' is installed" >&2
  exit 2
fi
if [ -e "$WHEELHOUSE" ]; then
  echo "compose-smoke: $WHEELHOUSE exists; remove it (this script makes and removes its own)" >&2
  exit 2
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llmgw-compose-smoke.XXXXXX")"
UP=0
OK=0
PROFILES=(--profile sim)
EXPECT_HEALTHY=9
export NATS_SERVERS
if [ "$NATS_SERVERS" = 3 ]; then
  PROFILES+=(--profile nats-cluster)
  EXPECT_HEALTHY=11
  PROJECT="$PROJECT-nats3"
fi
compose() { "${COMPOSE[@]}" -p "$PROJECT" -f "$COMPOSE_FILE_PATH" "$@"; }
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$UP" = 1 ]; then
    if [ "$OK" != 1 ]; then
      echo "---- the containers' last log lines ----" >&2
      compose "${PROFILES[@]}" --profile tools logs --no-color --tail=40 >&2 2>&1 || true
    fi
    say "tearing down (containers, network, volumes)"
    compose "${PROFILES[@]}" --profile tools down -v --remove-orphans >/dev/null 2>&1 || true
    left="$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")"
    if [ -n "$left" ]; then
      echo "compose-smoke: FAILED: containers left behind after down: $left" >&2
      rc=1
    fi
  fi
  rm -rf "$WHEELHOUSE" "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# -- the base image -------------------------------------------------------------
if [ "$MAKE_BASE" = 1 ]; then
  [ -n "$BASE" ] || BASE="$LOCAL_BASE"
  if docker image inspect "$BASE" >/dev/null 2>&1; then
    say "base image $BASE exists"
  else
    [ "$(id -u)" = 0 ] || die "--make-base runs debootstrap, which needs root"
    command -v debootstrap >/dev/null || die "--make-base needs debootstrap (apt-get install debootstrap)"
    say "making $BASE with debootstrap (bookworm, minbase + python3, python3-venv)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
      bookworm "$WORK/rootfs" >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
    tar -C "$WORK/rootfs" -c . | docker import - "$BASE" >/dev/null
    rm -rf "$WORK/rootfs"
    mark "base image $BASE made"
  fi
fi
export LLMGW_BASE="${BASE:-python:3.11-slim}"

# -- the host's llmgw and openai, and the wheelhouse for the image ------------------
PYVER="$(docker run --rm --entrypoint python3 "$LLMGW_BASE" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
  || die "cannot run python3 in $LLMGW_BASE"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "the host's python3 is older than 3.11"
say "host venv and wheelhouse (llmgw from $ROOT, wheels for Python $PYVER in $LLMGW_BASE)"
quietly() { "$@" >>"$WORK/pip.log" 2>&1 || { tail -30 "$WORK/pip.log" >&2; die "$*"; }; }
python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
quietly "$PY" -m pip install --disable-pip-version-check --upgrade pip
if [ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$PYVER" ]; then
  # The same Python here and in the image: what docs/operations.md has the user type.
  quietly "$PY" -m pip wheel -w "$WHEELHOUSE" "$ROOT"
else
  # Another Python in the image: llmgw's own wheel, and its dependencies as
  # binary wheels for the image's Python and this machine's architecture.
  quietly "$PY" -m pip wheel --no-deps -w "$WHEELHOUSE" "$ROOT"
  ARCH="$(uname -m)"
  PLATFORMS=(--platform "manylinux2014_$ARCH" --platform "linux_$ARCH")
  for minor in $(seq 17 40); do PLATFORMS+=(--platform "manylinux_2_${minor}_$ARCH"); done
  quietly "$PY" -m pip download -d "$WHEELHOUSE" --only-binary=:all: --implementation cp \
    --python-version "$PYVER" "${PLATFORMS[@]}" "$WHEELHOUSE"/llmgw-*.whl
fi
quietly "$PY" -m pip install "$WHEELHOUSE"/llmgw-*.whl openai
mark "wheelhouse ready ($(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels); host has llmgw and openai"

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export NATS_PORT NATS_MONITOR_PORT GATEWAY_PORT
NATS_PORT="$(free_port)"; NATS_MONITOR_PORT="$(free_port)"; GATEWAY_PORT="$(free_port)"
export HEARTBEAT_INTERVAL=1s NODE_LOST_AFTER=5s

# -- up: what docs/operations.md has the user type ------------------------------------
UP=1
say "docker compose ${PROFILES[*]} up -d --build (project $PROJECT, base $LLMGW_BASE, NATS_SERVERS=$NATS_SERVERS)"
compose "${PROFILES[@]}" up -d --build >"$WORK/up.log" 2>&1 || { tail -40 "$WORK/up.log" >&2; die "up failed"; }
if [ "$NATS_SERVERS" = 3 ]; then
  mark "up: nats, nats-2, nats-3 (a 3-server cluster), registry, health, scheduler, gateway, node01-node04 started"
else
  mark "up: nats, registry, health, scheduler, gateway, node01-node04 started"
fi
# `up -d` returns once the containers run; their health checks say when each
# is on the bus and serving (Compose v2 alone has `up --wait`).
health() {
  local ids
  mapfile -t ids < <(compose "${PROFILES[@]}" ps -q)
  [ "${#ids[@]}" -gt 0 ] || return 0
  docker inspect -f '{{.Name}} {{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "${ids[@]}" \
    | sed -e 's|^/||' | sort
}
deadline=$((SECONDS + TIMEOUT))
until [ "$(health | grep -c ' healthy$')" = "$EXPECT_HEALTHY" ]; do
  [ "$SECONDS" -lt "$deadline" ] || { health >&2; die "not every service healthy after ${TIMEOUT}s"; }
  sleep 1
done
mark "all $EXPECT_HEALTHY containers healthy ($NATS_SERVERS NATS server(s), 4 services, 4 nodes)"
deadline=$((SECONDS + TIMEOUT))
until compose run --rm -T ctl deploy apply -f /deploy/seed-deployment.yaml >"$WORK/apply.log" 2>&1; do
  [ "$SECONDS" -lt "$deadline" ] || { cat "$WORK/apply.log" >&2; die "deploy apply failed for ${TIMEOUT}s"; }
  sleep 2
done
mark "applied deploy/seed-deployment.yaml ($(grep -v '^Creating' "$WORK/apply.log" | tail -1))"
OPDIR="$WORK/operator"
mkdir -p "$OPDIR"
compose run --rm -T --entrypoint tar ctl -C /etc/llmgw/conf/operator -cf - . | tar -C "$OPDIR" --no-same-owner -xf -
export LLMGW_CONFIG="$OPDIR/operator-host.yaml"
LLMGW="$WORK/venv/bin/llmgw"

# -- waiting, from the host ------------------------------------------------------------
# ready_state: prints "N_READY FABRICS NODES" of the seed deployment's ready replicas.
ready_state() {
  "$LLMGW" ctl replicas seed -o json 2>/dev/null | "$PY" -c '
import json, sys
rows = [r for r in json.load(sys.stdin) if r["state"] == "ready"]
print(len(rows), ",".join(sorted(r["fabric"] or "-" for r in rows)) or "-",
      ",".join(sorted(m["node"] for r in rows for m in r["members"])) or "-")'
}
node_state() { # NODE -> its lease state
  "$LLMGW" ctl nodes -o json 2>/dev/null | "$PY" -c '
import json, sys
print(next((n["state"] for n in json.load(sys.stdin) if n["node_id"] == sys.argv[1]), "unknown"))' "$1"
}

deadline=$((SECONDS + TIMEOUT))
last=""
state=""
until [ "${state%% *}" = 2 ] 2>/dev/null; do
  state="$(ready_state || echo "0 - -")"
  [ "$state" = "$last" ] || say "ready replicas of seed: $state"
  last="$state"
  [ "$SECONDS" -lt "$deadline" ] || die "both replicas of seed not ready after ${TIMEOUT}s"
  sleep 1
done
mark "both replicas of seed ready ($state)"
# Each worker is seen joined to its leader (the agent matches the kernel's
# connections with the leader's name resolved: the kernel holds no names).
workers="$("$LLMGW" ctl replicas seed -o json | "$PY" -c '
import json, sys
print(" ".join("%s:%s" % (m["node"], m["engine_state"]) for r in json.load(sys.stdin) for m in r["members"] if m["rank"] > 0))')"
case " $workers " in *:joined\ *:joined\ ) ;; *) die "the workers are not all joined: $workers";; esac
mark "both workers joined their leaders ($workers)"

chat() {
  "$PY" - "http://127.0.0.1:$GATEWAY_PORT/v1" <<'PY'
import sys
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="none", max_retries=0, timeout=30)
raw = client.chat.completions.with_raw_response.create(model="sim-model", messages=[{"role": "user", "content": "hello"}])
reply = raw.parse()
print(f"replica {raw.headers.get('x-llmgw-replica')}: {reply.choices[0].message.content[:60]!r}")
PY
}
for i in 1 2; do served="$(chat)" || die "chat completion $i through the gateway failed"; say "served: $served"; done
mark "served chat completions from the host (openai client, 127.0.0.1:$GATEWAY_PORT)"

# -- a NATS server dies, then node02 ---------------------------------------------------
if [ "$NATS_SERVERS" = 3 ]; then
  docker kill "$(compose "${PROFILES[@]}" ps -q nats-2)" >/dev/null
  mark "docker kill nats-2 (one of three NATS servers)"
fi
node02="$(compose ps -q node02)"
[ -n "$node02" ] || die "no node02 container"
docker kill "$node02" >/dev/null
mark "docker kill node02 (agent and engines at once)"
deadline=$((SECONDS + TIMEOUT))
seen_lost=0 seen_down=0
while :; do
  if [ "$seen_lost" = 0 ] && [ "$(node_state node02)" = lost ]; then seen_lost=1; mark "node02 lost (health monitor)"; fi
  state="$(ready_state || echo "0 - -")"
  if [ "$seen_down" = 0 ] && [ "${state%% *}" -lt 2 ]; then seen_down=1; mark "node02's replica out of service ($state)"; fi
  case "$state" in
    "2 ib-b,ib-b "*) case "$state" in *node02*) ;; *) [ "$seen_lost" = 1 ] && break;; esac;;
  esac
  [ "$SECONDS" -lt "$deadline" ] || die "no replacement on ib-b after ${TIMEOUT}s (now: $state, node02 $(node_state node02))"
  sleep 0.5
done
mark "replacement ready on ib-b: both replicas on ib-b ($state)"
for i in 1 2; do served="$(chat)" || die "chat completion $i after the failover failed"; say "served: $served"; done
mark "served chat completions again"

# -- a GPU fault on a compose node, as on a node of `llmgw up` ------------------------------
gpu_out() { # NODE INDEX -> why the GPU is out of service, or nothing
  "$LLMGW" ctl nodes -o json 2>/dev/null | "$PY" -c '
import json, sys
row = next((n for n in json.load(sys.stdin) if n["node_id"] == sys.argv[1]), {})
print(row.get("gpus_out_of_service", {}).get(sys.argv[2], ""))' "$1" "$2"
}
sim_on() { # NODE VERB ARGS... : `llmgw sim VERB NODE ARGS --agent-config …` inside the node's container
  local node="$1" verb="$2"; shift 2
  compose exec -T "$node" llmgw sim "$verb" "$node" "$@" --agent-config "/etc/llmgw/conf/nodes/$node/agent.yaml"
}
gpu_fault() { # VERB OUT(yes|no) ARGS...: run `sim VERB node01 0 ARGS` and wait until GPU 0 is (not) out of service
  local verb="$1" want="$2"; shift 2
  sim_on node01 "$verb" 0 "$@" >"$WORK/fault.log" 2>&1 || { cat "$WORK/fault.log" >&2; die "llmgw sim $verb on node01 failed"; }
  local deadline=$((SECONDS + TIMEOUT)) out
  until out="$(gpu_out node01 0)"; if [ "$want" = yes ]; then [ -n "$out" ]; else [ -z "$out" ]; fi; do
    [ "$SECONDS" -lt "$deadline" ] || die "node01's GPU 0 out of service: '$out', ${TIMEOUT}s after 'llmgw sim $verb' (expected $want)"
    sleep 1
  done
}
gpu_fault gpu-fault yes --ecc 3
mark "sim gpu-fault node01 0 --ecc 3: GPU 0 out of service ($(gpu_out node01 0))"
gpu_fault gpu-ok no
mark "sim gpu-ok node01 0: GPU 0 back in service"

# -- every query the agents made was answered ----------------------------------------------
compose "${PROFILES[@]}" logs --no-color node01 node02 node03 node04 >"$WORK/nodes.log" 2>&1 || true
if grep -q "not read" "$WORK/nodes.log"; then
  grep "not read" "$WORK/nodes.log" | head -5 >&2
  die "an agent could not read what its nvidia-smi said (above)"
fi
mark "no 'not read' warning in any node's log ($(wc -l <"$WORK/nodes.log") lines)"

OK=1
echo
echo "timeline (compose project $PROJECT, $NATS_SERVERS NATS server(s), heartbeat $HEARTBEAT_INTERVAL, node lost after $NODE_LOST_AFTER;"
echo "each step as the host saw it, polling with llmgw ctl every second or two):"
printf '  %s\n' "${TIMELINE[@]}"
echo "compose-smoke: PASSED"
