#!/usr/bin/env bash
# Install, start, stop and report the servers that aiolease's tests use.
#
#   bash scripts/services.sh install|start|stop|status [service...]
#
# With no service named, the command applies to every service in SERVICES, in
# that order. Servers bind to 127.0.0.1 only. Data, logs and pidfiles live under
# $AIOLEASE_SERVICES_DIR/<service>/, by default ~/.local/state/aiolease/services
# (per machine, not per checkout: the servers hold machine-wide ports, so every
# checkout, a CI clone included, sees what another one started). A server that is already
# running (started by someone else) is used as it is and never stopped: `stop`
# stops only what this script started (what it holds a pidfile for).
#
# Each service lives in scripts/services.d/<service>.sh and defines
# svc_<service>_install, _start, _stop and _status (a '-' in the service name is
# '_' in the function names). scripts/services.d/_lib.sh has the shared helpers.
# The addresses the tests use, and the env vars that override them, are in
# aiolease/testing/servers.py. Facts about each server on this machine kind are
# in /work/shared/SERVICES.md.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
state_dir="${AIOLEASE_SERVICES_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/aiolease/services}"
# One spelling of the path, symlinks resolved: pidfiles are checked against the
# command lines of the processes, which name their files by this path.
state_dir="$(realpath -m "$state_dir")"

# Every service the test suite needs, in start order. "python" checks that
# python3 has venv and sqlite3 (the memory and SQLite backends need no server).
SERVICES=(python redis redis-aof redis-cluster redis-sentinel redis-redlock postgres pgbouncer postgres-restart mariadb mariadb-restart etcd etcd-cluster mongo mongo-standalone kafka kafka-restart zookeeper zookeeper-ensemble)

# shellcheck source=services.d/_lib.sh
. "$repo/scripts/services.d/_lib.sh"
for _svc in "${SERVICES[@]}"; do
    # shellcheck disable=SC1090
    . "$repo/scripts/services.d/$_svc.sh"
done

usage() {
    printf 'usage: bash scripts/services.sh install|start|stop|status [service...]\n' >&2
    printf 'services: %s\n' "${SERVICES[*]}" >&2
    exit 2
}

known() {
    local s
    for s in "${SERVICES[@]}"; do [ "$s" = "$1" ] && return 0; done
    return 1
}

main() {
    [ $# -ge 1 ] || usage
    local action="$1"
    shift
    case "$action" in
        install | start | stop | status) ;;
        *) usage ;;
    esac
    local targets=("$@")
    [ ${#targets[@]} -gt 0 ] || targets=("${SERVICES[@]}")
    local name failed=()
    for name in "${targets[@]}"; do
        known "$name" || die "unknown service '$name' (known: ${SERVICES[*]})"
    done
    mkdir -p "$state_dir"
    trap 'rm -f "$state_dir/.apt-updated.$$"' EXIT
    local rc
    for name in "${targets[@]}"; do
        # Each service runs in a subshell with errexit on (a condition context
        # such as `if ! (...)` would turn errexit off inside it), so that one
        # failure is reported and the others are still tried.
        set +e
        (
            set -e
            "svc_${name//-/_}_${action}"
        )
        rc=$?
        set -e
        [ "$rc" -eq 0 ] || failed+=("$name")
    done
    if [ ${#failed[@]} -gt 0 ]; then
        log "$action failed for: ${failed[*]}"
        return 1
    fi
}

main "$@"
