# python: the interpreter every backend's tests run in.
# shellcheck shell=bash

python_ok() {
    python3 -c 'import sqlite3, ensurepip, venv' >/dev/null 2>&1
}

svc_python_install() {
    command -v python3 >/dev/null || apt_install python3
    # The scripts tell live processes from zombies with ps.
    command -v ps >/dev/null || apt_install procps
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
