#!/usr/bin/env bash
# Counts the user-space instructions pd-proxy or bootstrap-server executes per answered request,
# under valgrind's callgrind. Unlike req/s and CPU time, the count does not move with the
# machine's load: the same binaries and scenario give the same figure within about half a
# percent for the proxy (10% for the server, whose store's threads spin while they wait for
# each other), run after run. So it tells what a change to their own code bought even
# on a machine too noisy to time it. It leaves out the kernel's share (the system calls, the TCP
# traffic, the fsyncs), so check the changes it rates with pd-bench as well.
#
# It runs pd-bench's scenarios for that system (`proxy` at concurrency 16, `bootstrap` at 64)
# with the system under callgrind. That is about 50 times slower, so a scenario serves a few
# thousand requests. For each process pd-bench started (one per route: `GET /query` of 64 and of
# 4096 workers share one) it prints the requests answered and the instructions per request:
# start-up and set-up (the workers and ids registered first) included, so compare a row between
# two builds, not two rows.
#
# Usage: examples/bench/instructions.sh [proxy|bootstrap] [BIN_DIR] [OUT_DIR]
#   proxy | bootstrap  the system to count (default proxy)
#   BIN_DIR            the release binaries (default target/release)
#   OUT_DIR            where callgrind's files are kept, for callgrind_annotate (default: a temp
#                      folder, removed afterwards)
# Needs valgrind (Debian: apt-get install valgrind) and python3.
set -euo pipefail
cd "$(dirname "$0")/../.."
system=${1:-proxy}
bin_dir=$(realpath "${2:-target/release}")
keep=${3:-}
case "$system" in
  proxy) binary=pd-proxy row=pd-proxy suite=(--seconds 6 --concurrency 16 proxy) ;;
  # sled's threads spin on each other: without fair scheduling one may spin for minutes.
  bootstrap) binary=bootstrap-server row=pd-bootstrap suite=(--seconds 3 --concurrency 64 bootstrap) ;;
  *) echo "instructions.sh: the system is proxy or bootstrap, not $system" >&2; exit 2 ;;
esac
command -v valgrind >/dev/null || { echo "instructions.sh: valgrind is not installed" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out=${keep:-$work/out}
mkdir -p "$out" "$work/bin"
for file in "$bin_dir"/*; do
  [ -x "$file" ] && [ -f "$file" ] && ln -sf "$file" "$work/bin/"
done
rm -f "$work/bin/$binary"
cat >"$work/bin/$binary" <<EOF
#!/bin/sh
exec valgrind --tool=callgrind --fair-sched=yes --callgrind-out-file=$out/callgrind.out.%p \
  "$bin_dir/$binary" "\$@"
EOF
chmod +x "$work/bin/$binary"
"$bin_dir/pd-bench" --bin-dir "$work/bin" "${suite[@]}" \
  >"$work/report.md" 2>"$work/bench.log" || { cat "$work/bench.log" >&2; exit 1; }
# The scenarios by route: those of one route (`GET /query` of 64 and of 4096 workers) share a
# process, each route its own.
grep "| $row |" "$work/report.md" |
  awk -F'|' '{gsub(/^ +| +$/, "", $2); sub(/ \(.*$/, "", $2)} !seen[$2]++ {print $2}' \
  >"$work/scenarios"
# callgrind's files in start order (by pid) are the routes in the report's order. Requests are
# counted as the answers hyper's server wrote.
for file in "$out"/callgrind.out.*; do echo "${file##*.} $file"; done | sort -n | cut -d' ' -f2- |
  python3 -c '
import re, sys
names = [line.strip() for line in open(sys.argv[1])]
answer = "<hyper::proto::h1::role::Server as hyper::proto::h1::Http1Transaction>::encode"
print("| scenarios | requests | instructions per request |")
print("|---|---|---|")
for name, path in zip(names, (line.strip() for line in sys.stdin)):
    ids, calls, total, current = set(), 0, 0, None
    for line in open(path):
        match = re.match(r"(c?fn)=\((\d+)\)(?: (.*))?", line)
        if match:
            kind, key, label = match.groups()
            if label == answer:
                ids.add(key)
            current = (kind, key)
        elif line.startswith("calls=") and current and current[0] == "cfn" and current[1] in ids:
            calls += int(line.split("=")[1].split()[0])
        elif line.startswith(("summary:", "totals:")):
            total = int(line.split()[1])
    print(f"| {name} | {calls} | {total // max(calls, 1):,} |")
' "$work/scenarios"
