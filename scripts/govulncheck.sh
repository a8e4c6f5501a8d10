#!/usr/bin/env bash
# Scans idem and its dependencies for known vulnerabilities, offline: the
# vulnerability database is the golang.org/x/vulndb module, fetched through the
# Go module proxy like any dependency (vuln.go.dev is never contacted), and
# read by govulncheck as a directory of OSV entries.
#
#   scripts/govulncheck.sh                       # with the Go release production builds use
#   IDEM_SCAN_GO=local scripts/govulncheck.sh    # with the Go installed here
#   scripts/govulncheck.sh -show verbose         # extra govulncheck flags
#
# Exit status: 0 when nothing is found; 3 (govulncheck's) when the code calls
# a vulnerable symbol, in a module or in the standard library of the toolchain
# used. Standard-library findings depend on the Go release: see docs/SECURITY.md.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned so a scan is reproducible; move both forward together.
VULNDB=golang.org/x/vulndb@v0.0.0-20261105234957-e22db6528018
GOVULNCHECK=golang.org/x/vuln/cmd/govulncheck@v1.9.0
# The release docs/SECURITY.md says to build production binaries with (the
# go command fetches it from the module proxy), or "local".
export GOTOOLCHAIN="${IDEM_SCAN_GO:-go1.27.3}"

dir=$(GOTOOLCHAIN=local GOFLAGS=-mod=mod go mod download -json "$VULNDB" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
if [ ! -d "$dir/data/osv" ]; then
	echo "govulncheck.sh: $VULNDB has no data/osv directory at $dir" >&2
	exit 1
fi
echo "govulncheck: database $VULNDB ($(ls "$dir/data/osv" | wc -l) entries), $(go env GOVERSION)" >&2
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
GOBIN="$bin" go install "$GOVULNCHECK"
"$bin/govulncheck" -db "file://$dir/data/osv" "$@" ./...
