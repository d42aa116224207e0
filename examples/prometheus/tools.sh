#!/usr/bin/env bash
# The tools of examples/tests/prometheus.rs: `prometheus` (the server the test scrapes the
# cluster with) and `promtool` (which checks and unit-tests docs/prometheus/*.yml). Both come
# from Debian's `prometheus` package (2.42 on bookworm).
#
# Run as root with apt-get, this installs it when missing:
#   apt-get install -y --no-install-recommends prometheus
# --no-install-recommends leaves out the node exporter and friends. The package's postinst asks
# invoke-rc.d to start the prometheus service; in a container without an init that is refused
# ("could not determine current runlevel") and the install still succeeds, as tested on
# Debian 12. A policy-rc.d that denies every start (exit 101) is put in place for the install so
# that no service is started on a machine that has an init either; it is removed afterwards if
# this script made it. Without root, it only checks and says what to install.
set -euo pipefail

missing=()
for tool in prometheus promtool; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done

if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "tools.sh: installing Debian's prometheus package (missing: ${missing[*]})" >&2
    made_policy=
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
      chmod +x /usr/sbin/policy-rc.d
      made_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    status=0
    { apt-get install -y -qq --no-install-recommends prometheus >/dev/null ||
      { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
    } || status=$?
    [[ -n $made_policy ]] && rm -f /usr/sbin/policy-rc.d
    ((status == 0)) || { echo "tools.sh: apt-get install prometheus failed" >&2; exit 1; }
  else
    echo "tools.sh: ${missing[*]} not found: install Debian's prometheus package" \
      "(apt-get install --no-install-recommends prometheus, as root) or put Prometheus 2.x's" \
      "prometheus and promtool on PATH" >&2
    exit 1
  fi
fi

prometheus --version 2>&1 | head -n 1
promtool --version 2>&1 | head -n 1
