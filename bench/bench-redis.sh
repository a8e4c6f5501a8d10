#!/usr/bin/env bash
# Runs idem-bench's mix suite against Redis, the store most idempotency-key
# libraries use: installs Debian's redis-server if missing, starts throwaway
# servers on loopback (appendonly yes, one with appendfsync always: an
# acknowledged write is on disk, as etcd's fsync; one with everysec: what
# most run; and a primary with two replicas, whose writes WAIT for one),
# runs the given idem-bench flags with --redis, then stops the servers and
# removes their data.
#
#   bench/bench-redis.sh                                   # mix, 64 clients
#   bench/bench-redis.sh --suite mix --concurrency 256     # any idem-bench flags
set -euo pipefail
cd "$(dirname "$0")"
export GOTOOLCHAIN=local

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! command -v redis-server >/dev/null; then
	$SUDO apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends redis-server
fi

data=$(mktemp -d /tmp/idem-bench-redis.XXXXXX)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	rm -rf "$data"
}
trap cleanup EXIT

start() { # name port [redis-server flags]
	local name=$1 port=$2
	shift 2
	mkdir -p "$data/$name"
	redis-server --bind 127.0.0.1 --port "$port" --dir "$data/$name" --save "" \
		--appendonly yes --maxclients 1000 --daemonize no --logfile "$data/$name.log" "$@" &
	pids+=($!)
	for _ in $(seq 100); do
		redis-cli -p "$port" ping >/dev/null 2>&1 && return
		sleep 0.05 # waiting for the server to listen
	done
	echo "redis-server $name did not start: $(tail -5 "$data/$name.log")" >&2
	exit 1
}

addrs=()
for fsync in always everysec; do
	port=$(free_port)
	start "$fsync" "$port" --appendfsync "$fsync"
	addrs+=("127.0.0.1:$port")
done
# Replicated: a primary and two replicas, every node with appendfsync
# always; idem-bench sees the replicas and makes each write WAIT for one
# (with the primary, a majority of three, as a raft quorum).
primary=$(free_port)
start primary "$primary" --appendfsync always --repl-diskless-sync-delay 0
for r in 1 2; do
	start "replica$r" "$(free_port)" --appendfsync always --replicaof 127.0.0.1 "$primary"
done
for _ in $(seq 200); do
	[ "$(redis-cli -p "$primary" info replication | tr -d '\r' | grep -c '^slave[0-9]*:.*state=online')" -eq 2 ] && break
	sleep 0.05 # waiting for both replicas to sync
done
addrs+=("127.0.0.1:$primary")

args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--suite mix)
go run ./cmd/idem-bench --redis "$(IFS=,; echo "${addrs[*]}")" "${args[@]}"
