#!/usr/bin/env bash
# Counts the user-space instructions pd-proxy executes per proxied request, under valgrind's
# callgrind. Unlike req/s and CPU time, the count does not move with the machine's load: the same
# binaries and scenario give the same figure within about half a percent, run after run. So it
# tells what a change to the proxy's own code bought even on a machine too noisy to time it. It
# leaves out the kernel's share (the system calls and the TCP traffic), so check the changes it
# rates with pd-bench as well.
#
# It runs `pd-bench proxy` at concurrency 16 with pd-proxy under callgrind. That is about 50 times
# slower, so a run serves a few thousand requests. For each of pd-bench's proxy scenarios it
# prints the requests served and the instructions per request (start-up included, spread over
# the requests).
#
# Usage: examples/bench/instructions.sh [BIN_DIR] [OUT_DIR]
#   BIN_DIR  the release binaries (default target/release)
#   OUT_DIR  where callgrind's files are kept, for callgrind_annotate (default: a temp folder,
#            removed afterwards)
# Needs valgrind (Debian: apt-get install valgrind) and python3.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin_dir=$(realpath "${1:-target/release}")
keep=${2:-}
command -v valgrind >/dev/null || { echo "instructions.sh: valgrind is not installed" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out=${keep:-$work/out}
mkdir -p "$out" "$work/bin"
for binary in "$bin_dir"/*; do
  [ -x "$binary" ] && [ -f "$binary" ] && ln -sf "$binary" "$work/bin/"
done
rm -f "$work/bin/pd-proxy"
cat >"$work/bin/pd-proxy" <<EOF
#!/bin/sh
exec valgrind --tool=callgrind --callgrind-out-file=$out/callgrind.out.%p "$bin_dir/pd-proxy" "\$@"
EOF
chmod +x "$work/bin/pd-proxy"
"$bin_dir/pd-bench" --bin-dir "$work/bin" --seconds 6 --concurrency 16 proxy \
  >"$work/report.md" 2>"$work/bench.log" || { cat "$work/bench.log" >&2; exit 1; }
grep '| pd-proxy |' "$work/report.md" | awk -F'|' '!seen[$2]++ {gsub(/^ +| +$/, "", $2); print $2}' \
  >"$work/scenarios"
# Each scenario started its own proxy: callgrind's files in start order (by pid) are the
# scenarios in the report's order. Requests are counted as calls of Body::parse (one per request).
ls "$out"/callgrind.out.* | sort -t. -k3 -n | python3 -c '
import re, sys
names = [line.strip() for line in open(sys.argv[1])]
print("| scenario | requests | instructions per request |")
print("|---|---|---|")
for name, path in zip(names, (line.strip() for line in sys.stdin)):
    ids, calls, total, current = set(), 0, 0, None
    for line in open(path):
        match = re.match(r"(c?fn)=\((\d+)\)(?: (.*))?", line)
        if match:
            kind, key, label = match.groups()
            if label is not None and label.endswith("pd_proxy::body::Body::parse"):
                ids.add(key)
            current = (kind, key)
        elif line.startswith("calls=") and current and current[0] == "cfn" and current[1] in ids:
            calls += int(line.split("=")[1].split()[0])
        elif line.startswith(("summary:", "totals:")):
            total = int(line.split()[1])
    print(f"| {name} | {calls} | {total // max(calls, 1):,} |")
' "$work/scenarios"
