#!/usr/bin/env bash
# Installs the external tools the deployment tests run, from Debian/Ubuntu apt: promtool and
# prometheus (package prometheus), docker-compose (package docker-compose), haproxy, kubectl
# (package kubernetes-client) and openssl (the TLS tests' self-signed certificates); and the
# library `--core-malloc tcmalloc` preloads into the engine core (libtcmalloc-minimal4), which the
# image installs too.
# Idempotent: installs only what is missing, and prints nothing when nothing is.
# Needs root or passwordless sudo. Without either (or without apt) it prints what to install and
# exits 0, and the tests that need a missing tool skip saying so; under CI (CI=true) a missing
# tool is an error instead.
set -euo pipefail

declare -A PACKAGE_FOR_COMMAND=(
    [promtool]=prometheus
    [prometheus]=prometheus
    [docker-compose]=docker-compose
    [haproxy]=haproxy
    [kubectl]=kubernetes-client
    [openssl]=openssl
)

# Shared libraries, by the name the dynamic loader's cache lists them under.
declare -A PACKAGE_FOR_LIBRARY=(
    [libtcmalloc_minimal.so.4]=libtcmalloc-minimal4
)

missing=()
for command in "${!PACKAGE_FOR_COMMAND[@]}"; do
    if ! command -v "$command" >/dev/null 2>&1; then
        missing+=("${PACKAGE_FOR_COMMAND[$command]}")
    fi
done
ldconfig=$(command -v ldconfig || echo /sbin/ldconfig) # /sbin is not on every user's PATH
# read whole first: `grep -q` leaving a pipe early could fail ldconfig under pipefail
library_cache=$("$ldconfig" -p 2>/dev/null || true)
for library in "${!PACKAGE_FOR_LIBRARY[@]}"; do
    if ! grep -q -F "$library " <<<"$library_cache"; then
        missing+=("${PACKAGE_FOR_LIBRARY[$library]}")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi
mapfile -t packages < <(printf '%s\n' "${missing[@]}" | sort -u)

case "${CI:-}" in
    1 | true | TRUE | True | yes) in_ci=true ;;
    *) in_ci=false ;;
esac

cannot_install() {
    echo "install-test-tools: missing Debian packages: ${packages[*]} ($1)." >&2
    echo "install-test-tools: install them with: sudo apt-get install --no-install-recommends ${packages[*]}" >&2
    if [ "$in_ci" = true ]; then
        echo "install-test-tools: CI is set, so this is an error" >&2
        exit 1
    fi
    echo "install-test-tools: the tests that need them will be skipped" >&2
    exit 0
}

if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    cannot_install "not root, and no passwordless sudo"
fi
if ! command -v apt-get >/dev/null 2>&1; then
    cannot_install "no apt-get on this system"
fi

# The prometheus package would start a daemon on port 9090; policy-rc.d exit code 101 tells
# invoke-rc.d not to start any service. Keep an existing policy, restore the state afterwards.
policy=/usr/sbin/policy-rc.d
created_policy=false
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee "$policy" >/dev/null
    "${as_root[@]}" chmod 755 "$policy"
    created_policy=true
fi
restore_policy() {
    if [ "$created_policy" = true ]; then
        "${as_root[@]}" rm -f "$policy"
    fi
}
trap restore_policy EXIT

"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${packages[@]}"

# Without systemd, a post-install script may still have launched the daemon; stop only that one.
if [ -f /run/prometheus/prometheus.pid ]; then
    "${as_root[@]}" kill "$(cat /run/prometheus/prometheus.pid)" 2>/dev/null || true
fi
