#!/usr/bin/env bash
# Runs idem-bench's peer comparison against PostgreSQL: installs Debian's
# PostgreSQL if missing, starts a throwaway server on loopback (fsync and
# synchronous_commit on, the defaults), runs the given idem-bench suites
# with --pg, then stops the server and removes its data.
#
#   bench/bench-pg.sh                      # the mix suite
#   bench/bench-pg.sh --suite mix --json   # any idem-bench flags
set -euo pipefail
cd "$(dirname "$0")"
export GOTOOLCHAIN=local

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
	$SUDO apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends postgresql
fi
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)

data=$(mktemp -d /tmp/idem-bench-pg.XXXXXX)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
as_pg() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
[ "$(id -u)" -eq 0 ] && chown postgres "$data"
cleanup() {
	as_pg "$bin/pg_ctl" -D "$data/db" -m fast stop >/dev/null 2>&1 || true
	rm -rf "$data"
}
trap cleanup EXIT

as_pg "$bin/initdb" -D "$data/db" -A trust -U idem >/dev/null
as_pg "$bin/pg_ctl" -D "$data/db" -l "$data/log" -w \
	-o "-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$data -c max_connections=300 -c fsync=on -c synchronous_commit=on" start >/dev/null
as_pg "$bin/createdb" -h 127.0.0.1 -p "$port" -U idem idem

# What fsync costs PostgreSQL on this disk (its WAL uses fdatasync here):
# the ratios move with it, so the run says what it was.
echo "PostgreSQL fsync on this machine (pg_test_fsync, 8 kB writes):"
as_pg "$bin/pg_test_fsync" -s 2 -f "$data/fsync.test" 2>/dev/null | grep -E "^\s+(fdatasync|open_datasync) " | head -2 || true

args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--suite mix)
go run ./cmd/idem-bench --pg "postgres://idem@127.0.0.1:$port/idem?sslmode=disable" "${args[@]}"
