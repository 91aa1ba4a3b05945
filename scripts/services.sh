#!/usr/bin/env bash
# Install, start, stop and report the servers that aiolease's tests use.
#
#   bash scripts/services.sh install|start|stop|status [service...]
#
# With no service named, the command applies to every service in SERVICES.
# Servers bind to 127.0.0.1 only. Data, logs and pidfiles live under
# ${AIOLEASE_SERVICES_DIR:-<repo>/.services}/<service>/. A server that is
# already running (started by someone else) is used as it is and never stopped.
#
# Adding a service (redis, postgres, mariadb, etcd, mongo, kafka, zookeeper):
# define svc_<name>_install, svc_<name>_start, svc_<name>_stop and
# svc_<name>_status below, and append <name> to SERVICES. Facts about each
# server on this machine kind are in /work/shared/SERVICES.md.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
state_dir="${AIOLEASE_SERVICES_DIR:-$repo/.services}"

# Every service the test suite needs today. The memory and SQLite backends need
# no server; "python" checks that python3 has venv and sqlite3.
SERVICES=(python)

log() { printf 'services: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

have_root() { [ "$(id -u)" -eq 0 ]; }

apt_install() {
    have_root || die "need root to install Debian packages: $*"
    command -v apt-get >/dev/null || die "apt-get not found; install by hand: $*"
    log "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# -- python: the interpreter every backend's tests run in -----------------------

python_ok() {
    python3 -c 'import sqlite3, ensurepip, venv' >/dev/null 2>&1
}

svc_python_install() {
    command -v python3 >/dev/null || apt_install python3
    if ! python_ok; then
        # Debian splits ensurepip (needed by "python3 -m venv") into python3-venv.
        apt_install python3-venv
    fi
    python_ok || die "python3 lacks sqlite3 or venv even after installing python3-venv"
}

svc_python_start() { python_ok || die "python3 is not ready; run: bash scripts/services.sh install"; }
svc_python_stop() { :; }

svc_python_status() {
    if python_ok; then
        printf 'python: ready (%s, sqlite %s)\n' \
            "$(python3 -c 'import sys; print(sys.version.split()[0])')" \
            "$(python3 -c 'import sqlite3; print(sqlite3.sqlite_version)')"
    else
        printf 'python: missing sqlite3 or venv\n'
        return 1
    fi
}

# -- dispatch --------------------------------------------------------------------

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
    local name failed=0
    for name in "${targets[@]}"; do
        known "$name" || die "unknown service '$name' (known: ${SERVICES[*]})"
    done
    mkdir -p "$state_dir"
    for name in "${targets[@]}"; do
        "svc_${name}_${action}" || failed=1
    done
    return "$failed"
}

main "$@"
