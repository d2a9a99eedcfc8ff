#!/usr/bin/env bash
# Installs the external tools the deployment tests run (promtool, prometheus, docker-compose).
# Idempotent: installs only what is missing. Needs root and Debian's apt.
set -euo pipefail

declare -A PACKAGE_FOR_COMMAND=(
    [promtool]=prometheus
    [prometheus]=prometheus
    [docker-compose]=docker-compose
)

missing=()
for command in "${!PACKAGE_FOR_COMMAND[@]}"; do
    if ! command -v "$command" >/dev/null 2>&1; then
        missing+=("${PACKAGE_FOR_COMMAND[$command]}")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi
mapfile -t packages < <(printf '%s\n' "${missing[@]}" | sort -u)

if [ "$(id -u)" -ne 0 ]; then
    echo "install-test-tools: missing ${packages[*]}; run as root (apt-get install)" >&2
    exit 1
fi

# The prometheus package would start a daemon on port 9090; policy-rc.d exit code 101 tells
# invoke-rc.d not to start any service. Keep an existing policy, restore the state afterwards.
policy=/usr/sbin/policy-rc.d
created_policy=false
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    created_policy=true
fi
restore_policy() {
    if [ "$created_policy" = true ]; then
        rm -f "$policy"
    fi
}
trap restore_policy EXIT

export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${packages[@]}"

# Without systemd, a post-install script may still have launched the daemon; stop only that one.
if [ -f /run/prometheus/prometheus.pid ]; then
    kill "$(cat /run/prometheus/prometheus.pid)" 2>/dev/null || true
fi
