#!/usr/bin/env bash
#
# Run the deploy kits end to end, as users run them: the compose kit's seed
# story on one NATS server and on a 3-server cluster (deploy/compose-smoke.sh
# --make-base [--nats-servers 3]) and the onboarding doc under a real systemd
# (deploy/systemd-smoke.sh). CI runs this after the test suite (.ci/run, the
# README's test command): a file users run is run by CI, or it is not shipped.
#
#   scripts/deploy-smokes.sh [--only compose|compose3|systemd]...
#
# What it needs, it makes: as root on a machine with apt-get it installs
# docker.io, docker-compose and debootstrap when missing, starts dockerd when no
# engine answers (and stops the one it started on exit), and the smokes make
# their base images with debootstrap once; the images stay in Docker's store,
# so later runs on the same machine reuse them. Every smoke runs even when an
# earlier one failed; each failing smoke prints its containers' last log lines.
#
# Only where Docker cannot run at all — not root and no engine answering, or
# no package manager to install it — are the smokes skipped, with one line
# saying so and why (exit 0).
#
# Exit 0: every smoke passed (or none could run, said so); 1: a smoke failed;
# 2: bad usage, or Docker could not be set up although it should have been.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ALL=(compose compose3 systemd)
ONLY=()
usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --only)
      [ $# -ge 2 ] || { echo "deploy-smokes: --only needs one of: ${ALL[*]}" >&2; exit 2; }
      case "$2" in compose|compose3|systemd) ONLY+=("$2");; *) echo "deploy-smokes: unknown smoke '$2' (one of: ${ALL[*]})" >&2; exit 2;; esac
      shift 2;;
    -h|--help) usage; exit 0;;
    *) echo "deploy-smokes: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done
[ ${#ONLY[@]} -gt 0 ] || ONLY=("${ALL[@]}")

say() { printf 'deploy-smokes: %s\n' "$*"; }
skip() { say "SKIPPED the deploy kits' smokes: $*"; exit 0; }

STARTED_DOCKERD=""
DOCKERD_LOG=""
# shellcheck disable=SC2329  # run by the EXIT trap below
cleanup() {
  local rc=$?
  if [ -n "$STARTED_DOCKERD" ]; then
    say "stopping the dockerd this run started (pid $STARTED_DOCKERD)"
    kill -TERM "$STARTED_DOCKERD" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$STARTED_DOCKERD" 2>/dev/null || true
  fi
  [ -z "$DOCKERD_LOG" ] || rm -f "$DOCKERD_LOG"
  exit "$rc"
}
trap cleanup EXIT

engine_answers() { command -v docker >/dev/null && docker info >/dev/null 2>&1; }
compose_cli() { docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; }

# -- what the smokes need ------------------------------------------------------------
missing=()
command -v dockerd >/dev/null || engine_answers || missing+=(docker.io)
command -v docker-compose >/dev/null || { engine_answers && compose_cli; } || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    if ! { engine_answers && compose_cli && command -v debootstrap >/dev/null; }; then
      skip "${missing[*]} missing, and installing it needs root (this is uid $(id -u))"
    fi
  elif ! command -v apt-get >/dev/null; then
    skip "${missing[*]} missing, and this machine has no apt-get to install it with"
  else
    say "installing ${missing[*]} (apt-get)"
    LOG="$(mktemp)"
    if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } >"$LOG" 2>&1; then
      tail -20 "$LOG" >&2; rm -f "$LOG"
      echo "deploy-smokes: FAILED: could not install ${missing[*]} with apt-get (its last lines above)" >&2
      exit 2
    fi
    rm -f "$LOG"
  fi
fi

if ! engine_answers; then
  [ "$(id -u)" = 0 ] || skip "no Docker engine answers and starting dockerd needs root (this is uid $(id -u))"
  DOCKERD_LOG="$(mktemp)"
  say "no Docker engine answers: starting dockerd"
  dockerd >"$DOCKERD_LOG" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq 1 120); do
    engine_answers && break
    kill -0 "$STARTED_DOCKERD" 2>/dev/null || break
    sleep 0.5
  done
  if ! engine_answers; then
    tail -20 "$DOCKERD_LOG" >&2
    echo "deploy-smokes: FAILED: dockerd did not answer within 60s (its last lines above)" >&2
    exit 2
  fi
fi
say "Docker engine $(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'); compose: $(docker compose version --short 2>/dev/null || docker-compose version --short 2>/dev/null || echo '?')"

# -- the smokes ------------------------------------------------------------------------
declare -A RESULT SECONDS_TAKEN
failed=0
for smoke in "${ONLY[@]}"; do
  case "$smoke" in
    compose) cmd=("$ROOT/deploy/compose-smoke.sh" --make-base);;
    compose3) cmd=("$ROOT/deploy/compose-smoke.sh" --make-base --nats-servers 3);;
    systemd) cmd=("$ROOT/deploy/systemd-smoke.sh");;
  esac
  say "== $smoke: ${cmd[*]#"$ROOT/"}"
  t0=$SECONDS
  if "${cmd[@]}"; then
    RESULT[$smoke]=passed
  else
    RESULT[$smoke]="FAILED (exit $?)"
    failed=1
  fi
  SECONDS_TAKEN[$smoke]=$((SECONDS - t0))
done
for smoke in "${ONLY[@]}"; do say "$smoke: ${RESULT[$smoke]} in ${SECONDS_TAKEN[$smoke]}s"; done
exit "$failed"
