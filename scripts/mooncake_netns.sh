#!/usr/bin/env bash
# Run a command next to a Mooncake master (and optionally a storage node) inside a private
# network namespace, then stop everything.
#
# Why a namespace: every Mooncake client process (our store, mooncake_client) opens its
# handshake and TCP-transport listeners on 0.0.0.0 / [::] whatever address it is given, so
# tests and benchmarks must not run on the host network. `unshare -n` gives a namespace
# with only `lo` (brought up here); nothing inside is reachable from outside.
#
# usage: scripts/mooncake_netns.sh [--port N] [--node SIZE | --no-node] [--keep-logs] -- CMD...
#   --port N       master RPC port on 127.0.0.1 (default 50051; metrics on N+1)
#   --node SIZE    start a mooncake_client storage node with this segment (default 1GB,
#                  Mooncake's own size syntax); --no-node: clients bring their own memory
#   --keep-logs    keep master.log / node.log (their tails are printed on failure anyway)
# Inside CMD: MOONCAKE_MASTER=127.0.0.1:N, MOONCAKE_METRICS=127.0.0.1:N+1, MOONCAKE_LOG_DIR,
# and MC_STORE_CLIENT_SETUP_RETRIES=1 unless already set. Exit status: CMD's, or 90-93 when
# the namespace, master or node could not be started.
# Needs: root (or unprivileged user namespaces: `unshare -rn` is used then), util-linux
# unshare, iproute2 `ip`, and mooncake_master / mooncake_client in $MOONCAKE_BIN_DIR, on
# PATH or in the repo's .venv/bin.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
port=50051
node_size=1GB
keep_logs=0

while (($#)); do
    case "$1" in
    --port) port="$2"; shift 2 ;;
    --node) node_size="$2"; shift 2 ;;
    --no-node) node_size=""; shift ;;
    --keep-logs) keep_logs=1; shift ;;
    --) shift; break ;;
    *) echo "mooncake_netns.sh: unknown option '$1' (see the header of $0)" >&2; exit 2 ;;
    esac
done
if ! [[ "$port" =~ ^[0-9]+$ ]] || ((port < 1 || port > 65500)); then
    echo "mooncake_netns.sh: --port must be a number in 1-65500, got '$port'" >&2
    exit 2
fi
if (($# == 0)); then
    echo "mooncake_netns.sh: no command given after --" >&2
    exit 2
fi

if [[ "${UCM_MOONCAKE_NETNS:-}" != inside ]]; then
    flags=(-n)
    [[ "$(id -u)" == 0 ]] || flags=(-r -n)
    args=(--port "$port")
    if [[ -n "$node_size" ]]; then args+=(--node "$node_size"); else args+=(--no-node); fi
    ((keep_logs)) && args+=(--keep-logs)
    UCM_MOONCAKE_NETNS=inside exec unshare "${flags[@]}" bash "$0" "${args[@]}" -- "$@"
fi

find_bin() {  # $MOONCAKE_BIN_DIR, then PATH, then the repo's .venv/bin
    local name="$1"
    if [[ -n "${MOONCAKE_BIN_DIR:-}" && -x "$MOONCAKE_BIN_DIR/$name" ]]; then
        echo "$MOONCAKE_BIN_DIR/$name"
    elif command -v "$name" >/dev/null 2>&1; then command -v "$name"
    elif [[ -x "$repo/.venv/bin/$name" ]]; then echo "$repo/.venv/bin/$name"
    else echo "mooncake_netns.sh: '$name' not found (pip install mooncake-transfer-engine-non-cuda)" >&2
        return 1
    fi
}
master_bin="$(find_bin mooncake_master)" || exit 91
node_bin="$(find_bin mooncake_client)" || exit 91

ip_bin="$(command -v ip || echo /usr/sbin/ip)"
"$ip_bin" link set lo up || { echo "mooncake_netns.sh: cannot bring up lo (iproute2 missing?)" >&2; exit 90; }
# /proc/self/net/dev lists this namespace's interfaces (/sys/class/net may show the host's)
if [[ "$(awk -F: 'NR > 2 { gsub(/ /, "", $1); print $1 }' /proc/self/net/dev)" != lo ]]; then
    echo "mooncake_netns.sh: refusing to run: namespace has interfaces other than lo" >&2
    exit 90
fi

log_dir="$(mktemp -d "${TMPDIR:-/tmp}/mooncake-netns.XXXXXX")"
metrics_port=$((port + 1))
master_pid=""
node_pid=""

stop() {  # SIGTERM, then SIGKILL after 5 s; only the processes started here
    local pid
    for pid in "$node_pid" "$master_pid"; do
        [[ -n "$pid" ]] || continue
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}
show_logs() {
    local f
    for f in "$log_dir"/master.log "$log_dir"/node.log; do
        [[ -f "$f" ]] || continue
        echo "---- tail of $f" >&2
        grep -v 'Master Admin Metrics' "$f" | tail -n 20 >&2 || true
    done
}
finish() {
    local rc=$?
    stop
    if ((rc != 0)); then show_logs; fi
    if ((keep_logs)); then echo "mooncake_netns.sh: logs in $log_dir" >&2; else rm -rf "$log_dir"; fi
    exit "$rc"
}
trap finish EXIT

wait_for() {  # wait_for SECONDS PID DESCRIPTION COMMAND...: poll COMMAND while PID lives
    local deadline=$((SECONDS + $1)) pid="$2" what="$3"
    shift 3
    until "$@" >/dev/null 2>&1; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "mooncake_netns.sh: exited before $what" >&2
            return 1
        fi
        if ((SECONDS >= deadline)); then
            echo "mooncake_netns.sh: timed out waiting for $what" >&2
            return 1
        fi
        sleep 0.1
    done
}
port_open() { (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
metrics_summary() {
    local url="http://127.0.0.1:$metrics_port/metrics/summary"
    if command -v curl >/dev/null 2>&1; then curl -s -m 2 "$url"
    else python3 -c 'import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=2).read().decode())' "$url"
    fi
}
node_registered() { [[ "$(metrics_summary)" =~ Clients:\ [1-9] ]]; }

"$master_bin" -rpc_address=127.0.0.1 -rpc_port="$port" \
    -metrics_host=127.0.0.1 -metrics_port="$metrics_port" >"$log_dir/master.log" 2>&1 &
master_pid=$!
wait_for 30 "$master_pid" "the master on 127.0.0.1:$port" port_open "$port" || exit 92

if [[ -n "$node_size" ]]; then
    "$node_bin" -host=127.0.0.1 -port=$((port + 2)) -global_segment_size="$node_size" \
        -local_buffer_size=16MB -master_server_address="127.0.0.1:$port" \
        -metadata_server=P2PHANDSHAKE -protocol=tcp >"$log_dir/node.log" 2>&1 &
    node_pid=$!
    wait_for 30 "$node_pid" "the storage node to register" node_registered || exit 93
fi

export MOONCAKE_MASTER="127.0.0.1:$port"
export MOONCAKE_METRICS="127.0.0.1:$metrics_port"
export MOONCAKE_LOG_DIR="$log_dir"
export MC_STORE_CLIENT_SETUP_RETRIES="${MC_STORE_CLIENT_SETUP_RETRIES:-1}"
unset UCM_MOONCAKE_NETNS
set +e
"$@"
rc=$?
set -e
exit "$rc"
