#!/usr/bin/env bash
# Regenerates the flag listing of `idem serve` in docs/CLI.md from the
# binary's own -h output (the text between "```\nFlags:" and the closing
# fence of that block). TestCLIDocNamesEveryFlag checks that every flag is
# there.
set -euo pipefail
cd "$(dirname "$0")/.."
help=$(go run ./cmd/idem serve -h 2>&1 | sed -n '/^Flags:/,$p' | grep -v '^exit status' || true)
python3 - "$help" <<'PY'
import sys, re
help = sys.argv[1]
p = 'docs/CLI.md'
s = open(p).read()
start = s.index('```\nFlags:\n')
end = s.index('```', start + 3)
s = s[:start] + '```\n' + help.rstrip('\n') + '\n' + s[end:]
open(p, 'w').write(s)
PY
