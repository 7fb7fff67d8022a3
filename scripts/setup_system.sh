#!/usr/bin/env bash
# System packages the tests need (idempotent; Debian). Mooncake Store's non-CUDA wheel
# links libibverbs / libnuma / libcurl; `unshare` (util-linux) and `ip` (iproute2) run the
# Mooncake master and clients inside a private loopback-only network namespace.
set -euo pipefail
need=()
for pkg in libibverbs1 libnuma1 libcurl4 iproute2 util-linux; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing system packages: ${need[*]} (run as root or install them)" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
