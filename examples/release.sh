#!/usr/bin/env bash
# Release binaries for a host without Rust: bootstrap-server, pd-proxy, pd-epp and worker-client,
# built once with `cargo build --release --locked` (the commit in the servers' build_info gauges),
# stripped, their debug info kept apart (objcopy --only-keep-debug, linked back with
# --add-gnu-debuglink, so that gdb and perf find it beside the binary), packed, with SHA-256
# checksums.
#
#   examples/release.sh [--out DIR] [--bin-dir DIR]
#
# --out      where the archives go (default: target/dist)
# --bin-dir  pack the binaries already built there instead of building (the test packs its
#            debug build this way)
#
# Writes DIR/pd-bootstrap-VERSION-ARCH-linux.tar.gz (bin/ and the docs a user needs),
# DIR/pd-bootstrap-VERSION-ARCH-linux-debug.tar.gz (bin/NAME.debug) and DIR/SHA256SUMS;
# check them with `sha256sum -c SHA256SUMS`. Needs objcopy (binutils) and sha256sum.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

out=target/dist
bin_dir=
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    --bin-dir) bin_dir=$2; shift 2 ;;
    *) echo "release.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
binaries=(bootstrap-server pd-proxy pd-epp worker-client)
for tool in objcopy sha256sum tar; do
  command -v "$tool" >/dev/null || { echo "release.sh: $tool is needed" >&2; exit 1; }
done

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
name="pd-bootstrap-$version-$(uname -m)-linux"

if [[ -z $bin_dir ]]; then
  export PD_BUILD_COMMIT=$commit
  cargo build --release --locked -p bootstrap-server -p pd-proxy -p pd-epp -p worker-client --bins
  bin_dir=target/release
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/$name/bin" "$stage/$name-debug/bin" "$out"
for binary in "${binaries[@]}"; do
  built="$bin_dir/$binary"
  [[ -x $built ]] || { echo "release.sh: $built is not built" >&2; exit 1; }
  objcopy --only-keep-debug "$built" "$stage/$name-debug/bin/$binary.debug"
  # The link holds the debug file's name and checksum: gdb and perf look for it beside the
  # binary or in its .debug/ folder.
  objcopy --strip-all --add-gnu-debuglink="$stage/$name-debug/bin/$binary.debug" \
    "$built" "$stage/$name/bin/$binary"
done
cp README.md docs/compatibility.md docs/deploy.md "$stage/$name/"
printf '%s %s\n' "$version" "$commit" > "$stage/$name/VERSION"
tar -C "$stage" -czf "$out/$name.tar.gz" "$name"
tar -C "$stage" -czf "$out/$name-debug.tar.gz" "$name-debug"
(cd "$out" && sha256sum "$name.tar.gz" "$name-debug.tar.gz" > SHA256SUMS)
echo "release.sh: $out/$name.tar.gz ($(du -h "$out/$name.tar.gz" | cut -f1)), its debug info and SHA256SUMS"
