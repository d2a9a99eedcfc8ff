#!/usr/bin/env bash
# Smoke test of the container deployment, for a host with a Docker engine and Compose.
# Builds the image, starts poolserve + Prometheus + Grafana, waits for readiness, sends one
# embedding request, and checks that Prometheus scrapes poolserve and Grafana has the dashboard.
#   bash scripts/docker-smoke.sh         # CPU image (profile "cpu"), no GPU needed
#   bash scripts/docker-smoke.sh gpu     # CUDA image with a GPU reservation
# KEEP=1 leaves the stack running afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."

variant="${1:-cpu}"
declare -A SERVICE_FOR_VARIANT=([cpu]=poolserve-cpu [gpu]=poolserve)
service="${SERVICE_FOR_VARIANT[$variant]:-}"
if [ -z "$service" ]; then
    echo "usage: $0 [cpu|gpu]" >&2
    exit 2
fi

# Ports away from the defaults so a running deployment on this host is not disturbed.
export POOLSERVE_PUBLISH_PORT="${POOLSERVE_PUBLISH_PORT:-18000}"
export PROMETHEUS_PUBLISH_PORT="${PROMETHEUS_PUBLISH_PORT:-19090}"
export GRAFANA_PUBLISH_PORT="${GRAFANA_PUBLISH_PORT:-13000}"
server="http://127.0.0.1:${POOLSERVE_PUBLISH_PORT}"
prometheus="http://127.0.0.1:${PROMETHEUS_PUBLISH_PORT}"
grafana="http://127.0.0.1:${GRAFANA_PUBLISH_PORT}"

if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
else
    compose=(docker-compose)
fi
compose+=(--project-name poolserve-smoke --profile cpu)

cleanup() {
    if [ "${KEEP:-0}" != 1 ]; then
        "${compose[@]}" down --volumes --remove-orphans >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

log() { printf 'docker-smoke: %s\n' "$*" >&2; }

# Polls a command until it succeeds; fails after $2 seconds.
wait_for() {
    local what="$1" timeout_s="$2"
    shift 2
    local deadline=$((SECONDS + timeout_s))
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "timed out after ${timeout_s}s waiting for ${what}"
            "${compose[@]}" logs --tail 50 "$service" >&2 || true
            exit 1
        fi
        sleep 2
    done
}

prometheus_target_up() {
    curl -fsS "${prometheus}/api/v1/query" --data-urlencode 'query=up{job="poolserve"}' \
        | python3 -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"]; sys.exit(0 if r and r[0]["value"][1] == "1" else 1)'
}

log "building ${service}"
"${compose[@]}" build "$service"
log "starting ${service}, prometheus, grafana"
"${compose[@]}" up -d "$service" prometheus grafana

wait_for "${server}/ready" 600 curl -fsS "${server}/ready"
log "server ready"

model="$(curl -fsS "${server}/v1/models" \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
count="$(curl -fsS "${server}/v1/embeddings" -H 'Content-Type: application/json' \
    -d "{\"input\": [\"hello world\"], \"model\": \"${model}\"}" \
    | python3 -c 'import json, sys; print(len(json.load(sys.stdin)["data"]))')"
if [ "$count" != 1 ]; then
    log "expected one embedding, got ${count}"
    exit 1
fi
log "embedding request answered (model ${model})"

wait_for "Prometheus to scrape poolserve" 120 prometheus_target_up
log "prometheus target up"

wait_for "Grafana's provisioned dashboard" 120 \
    curl -fsS -u "admin:${GRAFANA_ADMIN_PASSWORD:-admin}" "${grafana}/api/dashboards/uid/poolserve"
log "grafana dashboard provisioned"
log "OK"
