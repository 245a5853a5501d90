#!/usr/bin/env bash
# Debian packages fdx needs beyond PyPI: libibverbs1/libnuma1 (the Mooncake
# wheel links them: `make serve` then `fdx serve --cache-backend mooncake`) and
# redis-server (the redis backend and dp queues of the test-suite).
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
ldconfig -p | grep -q 'libibverbs.so.1' || need+=(libibverbs1)
ldconfig -p | grep -q 'libnuma.so.1' || need+=(libnuma1)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
