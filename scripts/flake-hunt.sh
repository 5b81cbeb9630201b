#!/usr/bin/env bash
# flake-hunt: run the test suite (or the tests named) N times while every core is
# kept busy, and report each test that failed at least once.
#
#   scripts/flake-hunt.sh [-n N] [--no-load] [--keep] [--] [PYTEST_ARGS...]
#
#   -n N, --runs N   how many runs (default 5)
#   --no-load        do not start the background CPU load
#   --keep           keep the per-run logs and JUnit reports even when all passed
#
# The load is Debian's stress-ng (`stress-ng --cpu $(nproc)`), installed with apt-get
# when missing; it is stopped on any exit. A flake is a bug to fix, not a test to
# retry: see docs/testing.md. Exits 1 if any run failed, 2 on bad usage.
set -euo pipefail

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }

runs=5
load=1
keep=0
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        -n | --runs)
            [ $# -ge 2 ] || { echo "flake-hunt: $1 needs a number" >&2; exit 2; }
            runs=$2
            shift 2
            ;;
        -n*) runs=${1#-n}; shift ;;
        --runs=*) runs=${1#--runs=}; shift ;;
        --no-load) load=0; shift ;;
        --keep) keep=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; args+=("$@"); break ;;
        *) args+=("$1"); shift ;;
    esac
done
case "$runs" in
    '' | *[!0-9]* | 0) echo "flake-hunt: the number of runs must be a positive integer, not '$runs'" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.."

if [ -x .venv/bin/pytest ]; then
    pytest=.venv/bin/pytest
    python=.venv/bin/python
else
    pytest=$(command -v pytest) || { echo "flake-hunt: no .venv/bin/pytest and no pytest on PATH" >&2; exit 2; }
    python=$(command -v python3)
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/flake-hunt.XXXXXX")
load_pid=""

stop_load() {
    if [ -n "$load_pid" ]; then
        # stress-ng runs in its own session (setsid): end its whole process group.
        kill -TERM -- "-$load_pid" 2>/dev/null || kill -TERM "$load_pid" 2>/dev/null || true
        wait "$load_pid" 2>/dev/null || true
        load_pid=""
    fi
}

cleanup() {
    local rc=$?
    stop_load
    if [ "$keep" = 1 ] || [ "$rc" != 0 ]; then
        echo "flake-hunt: logs and JUnit reports kept in $work" >&2
    else
        rm -rf "$work"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

install_stress_ng() {
    local sudo=()
    if [ "$(id -u)" != 0 ]; then
        command -v sudo >/dev/null || { echo "flake-hunt: stress-ng is missing and installing it needs root (or use --no-load)" >&2; return 1; }
        sudo=(sudo)
    fi
    echo "flake-hunt: installing stress-ng (apt-get)" >&2
    if ! DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q stress-ng >"$work/apt.log" 2>&1; then
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get update -q >>"$work/apt.log" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q stress-ng >>"$work/apt.log" 2>&1 || {
            tail -n 20 "$work/apt.log" >&2
            return 1
        }
    fi
}

load_desc="no background load"
if [ "$load" = 1 ]; then
    command -v stress-ng >/dev/null || install_stress_ng || { echo "flake-hunt: cannot install stress-ng" >&2; exit 2; }
    cores=$(nproc)
    # --timeout is only a safety net should this script be killed with SIGKILL (no trap runs then).
    setsid stress-ng --cpu "$cores" --timeout "${FLAKE_HUNT_LOAD_MAX_S:-7200}s" --quiet >"$work/stress-ng.log" 2>&1 &
    load_pid=$!
    sleep 0.5  # only to see whether it started at all
    kill -0 "$load_pid" 2>/dev/null || { cat "$work/stress-ng.log" >&2; echo "flake-hunt: stress-ng did not start" >&2; exit 2; }
    load_desc="stress-ng --cpu $cores"
fi

echo "flake-hunt: $runs run(s) of: $pytest -q ${args[*]:-(whole suite)}; $load_desc"
failed_runs=0
last_line=""
for i in $(seq 1 "$runs"); do
    log="$work/run-$i.log"
    rc=0
    "$pytest" -q -rfE --color=no -p no:cacheprovider -o junit_family=xunit1 \
        --junitxml="$work/run-$i.xml" "${args[@]}" >"$log" 2>&1 || rc=$?
    echo "$rc" >"$work/run-$i.rc"
    # pytest's closing line, e.g. "12 passed, 1 skipped in 3.21s" (with or without ===)
    line=$(grep -E ' in [0-9.]+s( \([0-9:]+\))?( =+)?$' "$log" | tail -n 1 || true)
    [ -n "$line" ] || line="(no summary line; exit $rc) $(tail -n 1 "$log")"
    last_line=$line
    if [ "$rc" != 0 ]; then
        failed_runs=$((failed_runs + 1))
        echo "flake-hunt: run $i/$runs FAILED (exit $rc): $line"
    else
        echo "flake-hunt: run $i/$runs ok: $line"
    fi
done

stop_load

"$python" - "$work" "$runs" <<'PY'
import pathlib
import re
import sys
import xml.etree.ElementTree as ET

work, runs = pathlib.Path(sys.argv[1]), int(sys.argv[2])
failures: dict[str, dict] = {}  # node id -> {"runs": [...], "summary": str, "text": str}


def node_id(case) -> str:
    file, cls, name = case.get("file") or "", case.get("classname") or "", case.get("name") or ""
    if file.endswith(".py"):
        module = file[:-3].replace("/", ".")
        inner = cls[len(module) + 1 :].split(".") if cls.startswith(module + ".") else []
        return "::".join([file, *[c for c in inner if c], name])
    return "::".join(p for p in (cls.replace(".", "/"), name) if p) or "(unknown)"


def same(a: str, b: str) -> bool:
    return a == b or a.endswith("/" + b) or b.endswith("/" + a)


for i in range(1, runs + 1):
    log = (work / f"run-{i}.log").read_text(errors="replace") if (work / f"run-{i}.log").exists() else ""
    rc = (work / f"run-{i}.rc").read_text().strip() if (work / f"run-{i}.rc").exists() else "?"
    summary = [l for l in log.splitlines() if re.match(r"^(FAILED|ERROR) ", l)]
    found = set()
    xml = work / f"run-{i}.xml"
    if xml.exists():
        try:
            root = ET.parse(xml).getroot()
        except ET.ParseError:
            root = None
        for case in root.iter("testcase") if root is not None else ():
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            if bad is None:
                continue
            nid = node_id(case)
            # prefer pytest's own node id (the report's paths are relative to the rootdir)
            line = next((l for l in summary if same(l.split(" ", 2)[1], nid)), "")
            nid = line.split(" ", 2)[1] if line else nid
            found.add(nid)
            entry = failures.setdefault(nid, {"runs": [], "summary": "", "text": ""})
            if i not in entry["runs"]:
                entry["runs"].append(i)
            if not entry["text"]:
                entry["text"] = (bad.text or bad.get("message") or "").strip()
            if not entry["summary"]:
                first = (bad.get("message") or "").splitlines()[:1]
                entry["summary"] = line or f"{'ERROR' if bad.tag == 'error' else 'FAILED'} {nid} - {''.join(first)}"
    # summary lines for what the report did not hold (a crash, a collection error, no XML at all)
    for l in summary:
        nid = l.split(" ", 2)[1]
        if nid not in found:
            entry = failures.setdefault(nid, {"runs": [], "summary": l, "text": ""})
            if i not in entry["runs"]:
                entry["runs"].append(i)
    if rc not in ("0", "?") and not summary and not found:
        entry = failures.setdefault(f"(run {i} itself: exit {rc})", {"runs": [], "summary": "", "text": "\n".join(log.splitlines()[-40:])})
        entry["runs"].append(i)

if failures:
    print()
    print(f"flake-hunt: tests that failed at least once in {runs} run(s):")
    for nid, e in sorted(failures.items(), key=lambda kv: (-len(kv[1]["runs"]), kv[0])):
        print(f"\n  {nid}: failed {len(e['runs'])} of {runs} run(s) (run {', '.join(map(str, e['runs']))})")
        if e["summary"]:
            print(f"    {e['summary']}")
        if e["text"]:
            lines = e["text"].splitlines()
            print(f"    first failure (run {e['runs'][0]}):")
            for l in lines[-60:] if len(lines) > 60 else lines:
                print(f"      {l}")
    print()
PY

echo "$last_line"
echo "flake-hunt: $failed_runs of $runs runs failed"
[ "$failed_runs" = 0 ]
