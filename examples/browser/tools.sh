#!/usr/bin/env bash
# The tools of examples/tests/live_pages: a headless Chromium and its WebDriver server,
# Debian's `chromium` and `chromium-driver` packages (the same version, from the same source).
# Run as root with apt-get, this installs them when missing; otherwise it only checks and says
# what to install.
set -euo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)

if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "tools.sh: installing Debian's ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null ||
      { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }
    } || { echo "tools.sh: apt-get install chromium chromium-driver failed" >&2; exit 1; }
  else
    echo "tools.sh: ${missing[*]} not found: install Debian's chromium and chromium-driver" \
      "(apt-get install --no-install-recommends chromium chromium-driver, as root)" >&2
    exit 1
  fi
fi

# (The launcher script complains on stderr about this machine's memory size; the version is on stdout.)
chromium --version 2>/dev/null | head -n 1
chromedriver --version 2>&1 | head -n 1
