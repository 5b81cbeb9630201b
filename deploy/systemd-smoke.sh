#!/usr/bin/env bash
#
# docs/node-onboarding.md, under a real systemd, end to end: two Debian
# bookworm containers booted with /lib/systemd/systemd on a private network
# with the doc's own addresses — the CA and NATS host (10.0.0.140) and a
# machine without GPUs or InfiniBand (sim01, 10.0.0.151) — then, typed in the
# CA host as the doc has the user type them:
#
#   1. the doc's "Once: the authority and the control plane" block, verbatim
#      (llmgw from its wheel into /opt/llmgw, the authority, the services'
#      certificates, the operator, nats.conf, the units, llmgw.target);
#   2. its "Machines with neither GPUs nor InfiniBand" block: the fake
#      nvidia-smi and ib_root over ssh, and deploy/onboard-node.sh for sim01;
#
# then it waits for sim01 ready with its address recorded, applies a
# one-replica sim deployment, serves a chat completion through the gateway,
# runs `systemctl restart llmgw-agent` on sim01 and checks that the new agent
# adopted the engine (same pid and start time, no second engine, "adopting"
# in its journal) and that the replica still serves. Containers, network and
# temporary files are removed on any exit; the base image stays.
#
#   deploy/systemd-smoke.sh [--rebuild-base]
#   deploy/systemd-smoke.sh --print-walkthrough
#
#   --rebuild-base       make the base image again even if it exists.
#   --print-walkthrough  print the two scripts taken from the doc (with the
#                        amendments below) and exit; needs no Docker.
#
# Where it departs from the doc, it says so as it goes:
# - LoadCredential= does not work in a container (the credentials directory
#   stays empty and root-only), so the four DynamicUser= service units get a
#   drop-in that runs them as root with no capabilities (like llmgw-nats) and
#   points --config at /etc/llmgw/<service>/<service>.yaml; the tls paths,
#   relative to that file, resolve the same way. Everything else about the
#   units is as shipped.
# - The doc's comment "the gateway also wants e.g. gateway: {listen: …}" is
#   carried out (the line is appended to gateway.yaml).
# - onboard-node.sh must run with --ssh-user ops (the user the preparation
#   below makes) and --install-wheel ./llmgw-*.whl (the machine has no llmgw
#   yet; this exercises the script's install path). The doc's recipe says both,
#   so its command runs as written; an option the doc lacks is appended and
#   marked "# [smoke] added", and another user or wheel is refused (exit 2).
# - Machine preparation a site has before onboarding: the user ops with
#   passwordless sudo and the CA host's ssh key, the machine's host key in the
#   CA host's known_hosts, and /etc/pip.conf pointing pip at a wheelhouse
#   built here (no package index inside the containers).
#
# The base image (default llmgw-systemd-base:bookworm) is made once with
# debootstrap (root, the debootstrap package; about a minute) and reused.
# The dependencies' wheels are kept in SMOKE_CACHE (default
# ~/.cache/llmgw-systemd-smoke), one directory per pyproject.toml; llmgw's own
# wheel is built from this checkout every run.
# Environment: SMOKE_PREFIX (names of the containers and the network, default
# llmgw-systemd-smoke), SMOKE_IMAGE, SMOKE_TIMEOUT (seconds per wait, default
# 180), SMOKE_DOC (the walk-through to follow, default docs/node-onboarding.md).
# Exit 0: the walk-through held; 1: a step failed (the journal of the units
# involved is printed); 2: bad usage, no Docker, or the doc's blocks not found.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DOC="${SMOKE_DOC:-$ROOT/docs/node-onboarding.md}"
IMAGE="${SMOKE_IMAGE:-llmgw-systemd-base:bookworm}"
PREFIX="${SMOKE_PREFIX:-llmgw-systemd-smoke}"
TIMEOUT="${SMOKE_TIMEOUT:-180}"
# What the image holds; recorded as a label, so a changed list makes a new image.
PACKAGES="systemd,systemd-sysv,dbus,openssh-server,openssh-client,sudo,python3,python3-venv,ca-certificates,procps"
# The doc's addresses, so its commands run unchanged.
SUBNET=10.0.0.0/24
CA_ADDR=10.0.0.140
NODE_ADDR=10.0.0.151
NODE_ID=sim01
NET="$PREFIX-net"
CA="$PREFIX-ca"
NODE="$PREFIX-$NODE_ID"
LABEL="llmgw.systemd-smoke=$PREFIX"
CACHE="${SMOKE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llmgw-systemd-smoke}"

REBUILD=0
PRINT=0
usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --rebuild-base) REBUILD=1; shift;;
    --print-walkthrough) PRINT=1; shift;;
    -h|--help) usage; exit 0;;
    *) echo "systemd-smoke: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done

T0="$EPOCHREALTIME"
TIMELINE=()
elapsed() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%6.1f", b - a }'; }
say() { printf '[%ss] %s\n' "$(elapsed)" "$*"; }
mark() { TIMELINE+=("$(elapsed)s  $*"); say "$*"; }
STEP="starting"
die() { printf 'systemd-smoke: FAILED at step "%s": %s\n' "$STEP" "$*" >&2; exit 1; }
step() { STEP="$1"; say "== $1"; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llmgw-systemd-smoke.XXXXXX")"

# -- the walk-through, taken from the doc ------------------------------------------
# Two scripts: the first ```sh block under "## Once: the authority and the
# control plane", and the ```sh block under "## Machines with neither GPUs nor
# InfiniBand" that runs onboard-node.sh; amended as the header says, nothing else.
extract_walkthrough() {
  python3 - "$DOC" "$WORK" "$NODE_ID" <<'PY'
import re
import sys
from pathlib import Path

doc, out, node = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
lines = doc.read_text().splitlines()


def fail(msg):
    print(f"systemd-smoke: {doc}: {msg}; the smoke follows the doc's blocks and cannot without it", file=sys.stderr)
    sys.exit(2)


def sh_block(heading, must_contain):
    try:
        start = lines.index(heading)
    except ValueError:
        fail(f"no heading {heading!r}")
    i = start + 1
    while i < len(lines) and not lines[i].startswith("## "):
        if lines[i].strip() == "```sh":
            j = lines.index("```", i + 1)
            body = lines[i + 1:j]
            if any(must_contain in b for b in body):
                return body
            i = j
        i += 1
    fail(f"no ```sh block containing {must_contain!r} under {heading!r}")


once = sh_block("## Once: the authority and the control plane", "systemctl enable --now llmgw.target")
for k, line in enumerate(once):
    if line.startswith("# the gateway also wants"):
        m = re.search(r"gateway: \{listen: [^}]+\}", line)
        if not m:
            fail(f"the gateway comment names no listen address: {line!r}")
        once.insert(k + 1, f"echo '{m.group(0)}' >> /etc/llmgw/gateway/gateway.yaml   # [smoke] the comment above, carried out")
        break
else:
    fail("no '# the gateway also wants …' line in the 'Once' block")

recipe = sh_block("## Machines with neither GPUs nor InfiniBand", "deploy/onboard-node.sh")
k = next(k for k, line in enumerate(recipe) if line.startswith("deploy/onboard-node.sh"))
end = k
while recipe[end].rstrip().endswith("\\"):
    end += 1
command = " ".join(recipe[k:end + 1])
if f"--node {node} " not in command:
    fail(f"the recipe's onboard-node.sh command is not for {node}: {command!r}")
# What this smoke's machines need of the command: ssh as ops (the user the
# machine preparation makes) and llmgw installed from the wheel the CA host's
# checkout holds (sim01 has none). The doc says both; a doc that lost one gets
# it back, marked; a doc that names another value is refused, since the
# machines here are prepared for these.
needs = [("--ssh-user", "ops"), ("--install-wheel", "./llmgw-*.whl")]
extra = []
for option, value in needs:
    said = re.findall(rf"(?:^|\s){re.escape(option)}\s+(\S+)", command)
    if not said:
        extra.append(f"{option} {value}")
    elif said != [value]:
        fail(f"the recipe's onboard-node.sh command has {option} {' '.join(said)}, the smoke's machines are prepared for {option} {value}")
if extra:
    recipe[end] += " " + " ".join(extra) + "   # [smoke] added"

(out / "once.sh").write_text("\n".join(once) + "\n")
(out / "sim-node.sh").write_text("\n".join(recipe) + "\n")
print(" ".join(extra))
PY
}

if [ "$PRINT" = 1 ]; then
  trap 'rm -rf "$WORK"' EXIT
  extract_walkthrough >/dev/null
  echo "# ---- once.sh (the CA host, as root, in a checkout with the wheel: ./llmgw-*.whl, deploy/)"
  cat "$WORK/once.sh"
  echo "# ---- sim-node.sh (the CA host, the same shell: LLMGW_CONFIG exported)"
  cat "$WORK/sim-node.sh"
  exit 0
fi

if ! docker info >/dev/null 2>&1; then
  rm -rf "$WORK"
  echo "systemd-smoke: no Docker engine answers ('docker info' fails); start dockerd first" >&2
  exit 2
fi
AMENDED="$(extract_walkthrough)" || { rm -rf "$WORK"; exit 2; }

# -- teardown, and what a failure prints ------------------------------------------------
# FOCUS: "CONTAINER UNIT" pairs whose journal a failure of the current step prints.
FOCUS=()
OK=0
in_ca() { docker exec -i -e USER=root -e LLMGW_CONFIG=/root/.llmgw/operator.yaml -w /root/llmgw "$CA" "$@"; }
in_node() { docker exec -i "$NODE" "$@"; }
dump_journals() {
  local pair c u
  for pair in "${FOCUS[@]}"; do
    read -r c u <<<"$pair"
    docker inspect "$c" >/dev/null 2>&1 || continue
    echo "---- journalctl -u $u on ${c#"$PREFIX-"} (last 40 lines) ----" >&2
    docker exec "$c" journalctl -u "$u" -n 40 --no-pager >&2 2>&1 || true
  done
  for c in "$CA" "$NODE"; do
    docker inspect "$c" >/dev/null 2>&1 || continue
    echo "---- systemctl --failed on ${c#"$PREFIX-"} ----" >&2
    docker exec "$c" systemctl --failed --no-pager >&2 2>&1 || true
  done
}
ours() { docker ps -aq --filter "label=$LABEL"; }
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # A signal's trap can run inside a function call whose output is redirected
  # to a log (in_ca … >"$WORK/once.log"); say what happens where the user looks.
  exec 1>&3 2>&4
  if [ "$OK" != 1 ] && [ "${#FOCUS[@]}" -gt 0 ]; then dump_journals; fi
  if [ -n "$(ours)" ] || docker network inspect "$NET" >/dev/null 2>&1; then
    say "tearing down (containers, their anonymous volumes, network)"
    mapfile -t ids < <(ours)
    [ "${#ids[@]}" -eq 0 ] || docker rm -f -v "${ids[@]}" >/dev/null 2>&1 || true
    docker network rm "$NET" >/dev/null 2>&1 || true
    if [ -n "$(ours)" ] || docker network inspect "$NET" >/dev/null 2>&1; then
      echo "systemd-smoke: teardown left containers or the network $NET behind" >&2
      rc=1
    fi
  fi
  rm -rf "$WORK"
  exit "$rc"
}
exec 3>&1 4>&2
trap cleanup EXIT
trap 'printf "systemd-smoke: interrupted at step \"%s\"\n" "$STEP" >&4; exit 130' INT TERM

# -- the base image -------------------------------------------------------------------
step "base image"
have="$(docker image inspect -f '{{index .Config.Labels "llmgw.packages"}}' "$IMAGE" 2>/dev/null || true)"
if [ "$REBUILD" = 0 ] && [ "$have" = "$PACKAGES" ]; then
  say "base image $IMAGE exists (bookworm, systemd, sshd, sudo, python3)"
else
  [ "$(id -u)" = 0 ] || die "making $IMAGE runs debootstrap, which needs root"
  command -v debootstrap >/dev/null || die "making $IMAGE needs debootstrap (apt-get install debootstrap)"
  say "making $IMAGE with debootstrap (bookworm, minbase + $PACKAGES)"
  debootstrap --variant=minbase --include="$PACKAGES" bookworm "$WORK/rootfs" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
  tar -C "$WORK/rootfs" -c . | docker import -c "LABEL llmgw.packages=$PACKAGES" - "$IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
  mark "base image $IMAGE made"
fi

# -- the wheelhouse: llmgw and its dependencies for the containers' Python -------------
step "wheelhouse"
PYVER="$(docker run --rm --network none "$IMAGE" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
  || die "cannot run python3 in $IMAGE"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "the host's python3 is older than 3.11"
WHEELHOUSE="$WORK/wheelhouse"
quietly() { "$@" >>"$WORK/pip.log" 2>&1 || { tail -30 "$WORK/pip.log" >&2; die "$*"; }; }
quietly python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
# The dependencies' wheels are kept between runs, keyed by pyproject.toml and
# the image's Python: resolving them against the index is most of a minute.
DEPS="$CACHE/py$PYVER-$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [ ! -f "$DEPS/.complete" ]; then
  rm -rf "$DEPS"
  mkdir -p "$DEPS"
  if [ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$PYVER" ]; then
    quietly "${PIP[@]}" wheel -w "$DEPS" "$ROOT"
  else
    # Another Python in the image: its dependencies as binary wheels for the
    # image's Python and this machine's architecture.
    quietly "${PIP[@]}" wheel --no-deps -w "$WORK/own" "$ROOT"
    ARCH="$(uname -m)"
    PLATFORMS=(--platform "manylinux2014_$ARCH" --platform "linux_$ARCH")
    for minor in $(seq 17 40); do PLATFORMS+=(--platform "manylinux_2_${minor}_$ARCH"); done
    quietly "${PIP[@]}" download -d "$DEPS" --only-binary=:all: --implementation cp \
      --python-version "$PYVER" "${PLATFORMS[@]}" "$WORK"/own/llmgw-*.whl
  fi
  # What building llmgw's own wheel needs, so later runs ask no index at all.
  quietly "${PIP[@]}" download -d "$DEPS" --only-binary=:all: "setuptools>=68" wheel
  rm -f "$DEPS"/llmgw-*.whl
  touch "$DEPS/.complete"
  say "dependency wheels cached in $DEPS"
fi
# llmgw itself from this checkout, every run.
quietly "${PIP[@]}" wheel --no-deps --no-index --find-links "$DEPS" -w "$WHEELHOUSE" "$ROOT"
cp "$DEPS"/*.whl "$WHEELHOUSE"/
WHEEL="$(cd "$WHEELHOUSE" && echo llmgw-*.whl)"
[ -f "$WHEELHOUSE/$WHEEL" ] || die "pip wheel made no llmgw wheel"
mark "wheelhouse ready ($(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels for Python $PYVER)"

# -- two machines -----------------------------------------------------------------------
step "boot the CA host and $NODE_ID under systemd"
if [ -n "$(ours)" ] || docker network inspect "$NET" >/dev/null 2>&1; then
  say "removing what an earlier run named $PREFIX left behind"
  mapfile -t ids < <(ours)
  [ "${#ids[@]}" -eq 0 ] || docker rm -f -v "${ids[@]}" >/dev/null
  docker network rm "$NET" >/dev/null 2>&1 || die "network $NET exists and cannot be removed (in use?)"
fi
# --internal: nothing leaves the two machines; the doc's addresses need a
# network of their own.
docker network create --internal --subnet "$SUBNET" --label "$LABEL" "$NET" >/dev/null 2>"$WORK/net.err" \
  || die "cannot create network $NET on $SUBNET (the doc's addresses): $(cat "$WORK/net.err")"
# The flags that boot systemd here (MACHINE.md): SYS_ADMIN for the units'
# namespaces (ProtectSystem=, PrivateTmp=), no seccomp/apparmor filter,
# tmpfs /run, the host's cgroup tree read-only.
boot() { # NAME HOSTNAME ADDR
  docker run -d --name "$1" --hostname "$2" --label "$LABEL" --network "$NET" --ip "$3" \
    --cap-add SYS_ADMIN --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
    --tmpfs /run --tmpfs /run/lock -v /sys/fs/cgroup:/sys/fs/cgroup:ro \
    -v "$WHEELHOUSE:/wheelhouse:ro" "$IMAGE" /lib/systemd/systemd >/dev/null \
    || die "docker run $1 failed"
}
boot "$CA" ca "$CA_ADDR"
boot "$NODE" "$NODE_ID" "$NODE_ADDR"
deadline=$((SECONDS + TIMEOUT))
for c in "$CA" "$NODE"; do
  # Until systemd has its socket, systemctl answers nothing; then "starting",
  # then "running" (or "degraded": a unit failed).
  state=""
  until case "$state" in running|degraded) true;; *) false;; esac || [ "$SECONDS" -ge "$deadline" ]; do
    sleep 0.5
    state="$(docker exec "$c" systemctl is-system-running 2>/dev/null || true)"
  done
  if [ "$state" != running ]; then
    docker logs --tail 30 "$c" >&2 2>&1 || true
    docker exec "$c" systemctl --failed --no-pager >&2 2>&1 || true
    die "${c#"$PREFIX-"} did not boot: systemd says '${state:-nothing}'"
  fi
done
mark "both machines booted (systemd $(docker exec "$CA" systemctl --version | awk 'NR == 1 { print $2 }'), state running)"

step "machine preparation (not in the doc: what a site has before onboarding)"
PIPCONF=$'[global]\nno-index = true\nfind-links = /wheelhouse\n'
for c in "$CA" "$NODE"; do printf '%s' "$PIPCONF" | docker exec -i "$c" tee /etc/pip.conf >/dev/null; done
say "/etc/pip.conf on both: no package index, the wheelhouse instead"
docker exec "$CA" mkdir -p /root/llmgw
in_ca sh -c 'umask 077; mkdir -p /root/.ssh; ssh-keygen -q -t ed25519 -N "" -f /root/.ssh/id_ed25519'
in_node sh -c 'useradd -m -s /bin/bash ops && echo "ops ALL=(ALL) NOPASSWD:ALL" > /etc/sudoers.d/ops && chmod 0440 /etc/sudoers.d/ops
  install -d -m 0700 -o ops -g ops ~ops/.ssh'
in_ca cat /root/.ssh/id_ed25519.pub | in_node sh -c 'cat > ~ops/.ssh/authorized_keys; chown ops:ops ~ops/.ssh/authorized_keys; chmod 0600 ~ops/.ssh/authorized_keys'
deadline=$((SECONDS + TIMEOUT))
until in_node systemctl is-active --quiet ssh; do
  [ "$SECONDS" -lt "$deadline" ] || { FOCUS=("$NODE ssh"); die "sshd on $NODE_ID not active"; }
  sleep 0.5
done
in_ca sh -c "ssh-keyscan -H $NODE_ADDR 2>/dev/null >> /root/.ssh/known_hosts"
in_ca ssh -o BatchMode=yes "ops@$NODE_ADDR" sudo -n true || { FOCUS=("$NODE ssh"); die "ssh ops@$NODE_ADDR with sudo does not work"; }
say "$NODE_ID: user ops (passwordless sudo) takes the CA host's root key; its host key is known"
# The checkout the doc's commands run in: deploy/ as it is here, and the wheel.
tar -C "$ROOT" --exclude=deploy/wheelhouse -c deploy | in_ca tar -C /root/llmgw -x
in_ca cp "/wheelhouse/$WHEEL" /root/llmgw/
say "CA host: /root/llmgw holds deploy/ from $ROOT and $WHEEL"
# LoadCredential= cannot work here (MACHINE.md): the four DynamicUser=
# services read their own files instead, as root without capabilities.
for s in registry health scheduler gateway; do
  in_ca sh -c "mkdir -p /etc/systemd/system/llmgw-$s.service.d && cat > /etc/systemd/system/llmgw-$s.service.d/smoke-no-credentials.conf" <<EOF
# systemd-smoke: LoadCredential= does not work in a container (the credentials
# directory stays empty and root-only), so read the files where they are. Root
# with no capabilities reads root's files and nothing else.
[Service]
LoadCredential=
DynamicUser=no
ExecStart=
ExecStart=/usr/local/bin/llmgw $s --config /etc/llmgw/$s/$s.yaml
EOF
done
say "CA host: drop-ins for llmgw-{registry,health,scheduler,gateway}: no LoadCredential=, --config /etc/llmgw/<service>/<service>.yaml"
mark "machines prepared"

# -- the doc, block 1 ----------------------------------------------------------------------
step "doc: Once: the authority and the control plane"
FOCUS=("$CA llmgw-nats" "$CA llmgw-registry" "$CA llmgw-health" "$CA llmgw-scheduler" "$CA llmgw-gateway")
in_ca bash -euo pipefail <"$WORK/once.sh" >"$WORK/once.log" 2>&1 \
  || { cat "$WORK/once.log" >&2; die "the doc's 'Once' block failed (its output above)"; }
mark "the 'Once' block ran (llmgw.target enabled and started)"
deadline=$((SECONDS + TIMEOUT))
for s in nats registry health scheduler gateway; do
  # "<role> <identity> running": the service is connected and serving.
  until case "$s" in
          nats) in_ca systemctl is-active --quiet llmgw-nats && in_ca journalctl -u llmgw-nats -o cat | grep 'Server is ready' >/dev/null;;
          *) in_ca journalctl -u "llmgw-$s" -o cat | grep -E "$s $s running" >/dev/null;;
        esac; do
    # Each service waits for NATS by itself, so any restart is a failure.
    restarts="$(in_ca systemctl show -p NRestarts --value "llmgw-$s")"
    if [ "$restarts" != 0 ] || ! in_ca systemctl is-active --quiet "llmgw-$s"; then
      FOCUS=("$CA llmgw-$s")
      die "llmgw-$s is $(in_ca systemctl is-active "llmgw-$s" || true) after $restarts restart(s) by systemd: it exited (its journal below)"
    fi
    [ "$SECONDS" -lt "$deadline" ] || { FOCUS=("$CA llmgw-$s"); die "llmgw-$s did not say it runs within ${TIMEOUT}s"; }
    sleep 0.5
  done
done
in_ca /opt/llmgw/bin/python - "http://$CA_ADDR:8080/healthz" <<'PY' || die "the gateway's /healthz does not answer on $CA_ADDR:8080"
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=5).read()
PY
mark "control plane up: llmgw-nats, -registry, -health, -scheduler, -gateway active and on the bus; gateway on $CA_ADDR:8080"

# -- the doc, block 2 ------------------------------------------------------------------------
step "doc: Machines with neither GPUs nor InfiniBand (onboard-node.sh for $NODE_ID)"
FOCUS=("$NODE llmgw-agent" "$CA llmgw-nats" "$CA llmgw-registry")
if [ -n "$AMENDED" ]; then say "onboard-node.sh amended with: $AMENDED"; else say "onboard-node.sh as the doc has it"; fi
# The user's shell still has block 1's export.
{ echo 'export LLMGW_CONFIG=~/.llmgw/operator.yaml'; cat "$WORK/sim-node.sh"; } \
  | in_ca bash -euo pipefail >"$WORK/onboard.log" 2>&1 \
  || { cat "$WORK/onboard.log" >&2; die "the recipe failed (its output above)"; }
sed 's/^/    /' "$WORK/onboard.log"
if grep -q WARNING "$WORK/onboard.log"; then die "onboard-node.sh warned (above)"; fi
mark "onboard-node.sh done"

ctl_json() { in_ca llmgw ctl "$@" -o json 2>/dev/null; }
node_view() { # -> "STATE ADDR VERIFIED GPUS"
  ctl_json nodes | python3 -c '
import json, sys
n = next((n for n in json.load(sys.stdin) if n["node_id"] == sys.argv[1]), None)
print("unknown - - -" if n is None else " ".join(str(n[k] or "-") for k in ("state", "mgmt_addr", "addr_verified", "gpus_total")))' "$NODE_ID"
}
deadline=$((SECONDS + TIMEOUT))
last=""
until case "$(node_view || echo "unknown - - -")" in "ready $NODE_ADDR True "*) true;; *) false;; esac; do
  view="$(node_view || echo "unknown - - -")"
  [ "$view" = "$last" ] || say "llmgw ctl nodes: $NODE_ID $view (state addr verified gpus)"
  last="$view"
  [ "$SECONDS" -lt "$deadline" ] || die "$NODE_ID not ready with its recorded address $NODE_ADDR after ${TIMEOUT}s (now: $view)"
  sleep 1
done
in_ca llmgw ctl nodes | sed 's/^/    /'
in_ca llmgw ctl events | grep "$NODE_ID" >/dev/null || die "'llmgw ctl events' names no event of $NODE_ID"
mark "$NODE_ID ready in 'llmgw ctl nodes', address $NODE_ADDR recorded (verified), its events listed"

# -- a replica, served -------------------------------------------------------------------------
step "deploy a sim replica on $NODE_ID and serve a chat completion"
FOCUS=("$CA llmgw-scheduler" "$NODE llmgw-agent" "$CA llmgw-gateway")
in_ca llmgw ctl deploy apply -f - >/dev/null <<'EOF' || die "llmgw ctl deploy apply failed"
name: smoke
model: sim-model
engine: sim
replicas: 1
nodes_per_replica: 1
gpus_per_node: 2
EOF
replica_view() { # -> "STATE ID GENERATION ENDPOINT"
  ctl_json replicas smoke | python3 -c '
import json, sys
rows = json.load(sys.stdin)
print(" ".join(str(rows[0][k] or "-") for k in ("state", "id", "generation", "endpoint")) if rows else "none - - -")'
}
deadline=$((SECONDS + TIMEOUT))
last=""
view=""
until [ "${view%% *}" = ready ] 2>/dev/null; do
  view="$(replica_view || echo "unknown - - -")"
  [ "$view" = "$last" ] || say "llmgw ctl replicas smoke: $view (state id generation endpoint)"
  last="$view"
  if [ "$SECONDS" -ge "$deadline" ]; then
    in_node sh -c 'tail -n 20 /var/lib/llmgw-agent/engines/*/engine.log' >&2 2>&1 || true
    die "the smoke replica not ready after ${TIMEOUT}s (now: $view)"
  fi
  sleep 1
done
read -r _ REPLICA GENERATION ENDPOINT <<<"$view"
chat() {
  in_ca /opt/llmgw/bin/python - "http://$CA_ADDR:8080/v1/chat/completions" <<'PY'
import json, sys, urllib.request

body = json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hello"}]}).encode()
req = urllib.request.Request(sys.argv[1], body, {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=30) as r:
    reply = json.load(r)
    print(f"replica {r.headers.get('x-llmgw-replica')}: {reply['choices'][0]['message']['content'][:60]!r}")
PY
}
served="$(chat)" || die "chat completion through the gateway failed"
say "served: $served"
case "$served" in "replica $REPLICA:"*) ;; *) die "served by another replica than $REPLICA";; esac
mark "replica $REPLICA (generation $GENERATION, $ENDPOINT) served a chat completion through the gateway"

# -- restart the agent: the engine is adopted, not relaunched ---------------------------------------
step "systemctl restart llmgw-agent on $NODE_ID"
FOCUS=("$NODE llmgw-agent" "$CA llmgw-scheduler")
# (The $ in these single quotes is for the shell and awk on the machine.)
# shellcheck disable=SC2016
engines() { in_node sh -c 'cd /var/lib/llmgw-agent/engines && for d in */; do printf "%s %s\n" "${d%/}" "$(cat "$d/pid")"; done'; }
mapfile -t before < <(engines)
[ "${#before[@]}" = 1 ] || die "expected one engine directory on $NODE_ID, found: ${before[*]:-none}"
read -r ENGINE_DIR PIDREC <<<"${before[0]}"
ENGINE_PID="$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["pid"])' "$PIDREC")"
# shellcheck disable=SC2016
start_time() { in_node awk '{ sub(/^.*\) /, ""); print $20 }' "/proc/$1/stat"; }
ENGINE_START="$(start_time "$ENGINE_PID")" || die "engine pid $ENGINE_PID from $ENGINE_DIR is not running"
AGENT_BEFORE="$(in_node systemctl show -p MainPID --value llmgw-agent)"
say "before: agent pid $AGENT_BEFORE, engine $ENGINE_DIR pid $ENGINE_PID (start time $ENGINE_START)"
in_node systemctl restart llmgw-agent || die "systemctl restart llmgw-agent failed"
AGENT_AFTER="$(in_node systemctl show -p MainPID --value llmgw-agent)"
[ "$AGENT_AFTER" != 0 ] && [ "$AGENT_AFTER" != "$AGENT_BEFORE" ] || die "no new agent process after the restart (MainPID $AGENT_AFTER)"
mark "agent restarted (pid $AGENT_BEFORE -> $AGENT_AFTER)"
INVOCATION="$(in_node systemctl show -p InvocationID --value llmgw-agent)"
deadline=$((SECONDS + TIMEOUT))
until in_node journalctl -o cat "_SYSTEMD_INVOCATION_ID=$INVOCATION" | grep "adopting .*: pid $ENGINE_PID, running" >/dev/null; do
  [ "$SECONDS" -lt "$deadline" ] || die "the new agent did not say 'adopting …: pid $ENGINE_PID, running' within ${TIMEOUT}s"
  sleep 0.5
done
now_start="$(start_time "$ENGINE_PID")" || die "engine pid $ENGINE_PID is gone after the agent restart"
[ "$now_start" = "$ENGINE_START" ] || die "pid $ENGINE_PID is another process now (start time $now_start, was $ENGINE_START)"
mapfile -t after < <(engines)
[ "${after[*]}" = "${before[*]}" ] || die "the engine directories changed across the restart: before ${before[*]}, after ${after[*]}"
mark "engine adopted: pid $ENGINE_PID, same start time, no second engine; the new agent said 'adopting'"
deadline=$((SECONDS + TIMEOUT))
until [ "$(replica_view || true)" = "ready $REPLICA $GENERATION $ENDPOINT" ]; do
  [ "$SECONDS" -lt "$deadline" ] || die "replica $REPLICA not ready on generation $GENERATION after the restart (now: $(replica_view || true))"
  sleep 1
done
served="$(chat)" || die "chat completion after the agent restart failed"
say "served: $served"
case "$served" in "replica $REPLICA:"*) ;; *) die "served by another replica than $REPLICA after the restart";; esac
mark "replica $REPLICA still ready on generation $GENERATION and serving"
# The doc's simulated devices answer every query the agent makes.
if in_node journalctl -u llmgw-agent -o cat --no-pager | grep "not read" >&2; then
  die "$NODE_ID's agent could not read what its nvidia-smi said (above)"
fi
mark "no 'not read' warning in $NODE_ID's agent journal"

OK=1
echo
echo "timeline (CA host $CA_ADDR, $NODE_ID $NODE_ADDR, each under systemd in a container):"
printf '  %s\n' "${TIMELINE[@]}"
echo "systemd-smoke: PASSED"
