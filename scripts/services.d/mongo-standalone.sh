# mongo-standalone: a standalone mongod of our own on 127.0.0.1:27018 (no replica set).
# shellcheck shell=bash
#
# Two uses: the MongoDB backend's path without change streams (a standalone server
# refuses them, error 40573: waiters sleep until the holder's ttl runs out), and the
# safety tests that SIGKILL the server and start it again (server-restart), which
# never touch the shared replica set rs0 on :27017 that the rest of the suite uses.
# It is the same mongod as the mongo service's (installed by it), journaling as
# mongod 6.0 always does, so a majority-acknowledged write survives the kill. Its
# pidfile, log and data are in $state_dir/mongo-standalone/.

# shellcheck source=mongo.sh
. "$repo/scripts/services.d/mongo.sh"

mongo_standalone_port=27018

# mongo_standalone_answers: the server on our port answers hello.
mongo_standalone_answers() {
    port_open "$mongo_standalone_port" "$mongo_host" && mongo_port="$mongo_standalone_port" mongo_py answers
}

svc_mongo_standalone_install() {
    mongo_installed || svc_mongo_install
}

svc_mongo_standalone_start() {
    mongo_installed || die "mongod is not installed; run: bash scripts/services.sh install mongo-standalone"
    svc_lock mongo-standalone
    local dir pidfile logfile
    dir="$(svc_dir mongo-standalone)"
    pidfile="$dir/mongod.pid"
    logfile="$dir/mongod.log"
    forget_stale_pidfile "$pidfile" "$(mongo_mongod)"
    if ! pidfile_alive "$pidfile"; then
        if port_open "$mongo_standalone_port" "$mongo_host"; then
            wait_ready "$mongo_start_timeout" "(none: not started by services.sh)" \
                "mongo-standalone on $mongo_host:$mongo_standalone_port (not ours)" \
                mongo_standalone_answers
            return 0
        fi
        mkdir -p "$dir/data" || die "cannot create $dir/data"
        [ ! -f "$logfile" ] || mv -f "$logfile" "$logfile.1"
        log "starting mongod (standalone) on $mongo_host:$mongo_standalone_port (log: $logfile)"
        # A SIGKILLed mongod leaves mongod.lock behind; mongod recovers from its
        # journal on the next start by itself.
        start_daemon "$pidfile" "$logfile" "$(mongo_mongod)" --dbpath "$dir/data" \
            --bind_ip "$mongo_host" --port "$mongo_standalone_port" \
            --wiredTigerCacheSizeGB 0.25 --nounixsocket \
            --setParameter diagnosticDataCollectionEnabled=false 9>&-
    fi
    wait_started "$mongo_start_timeout" "$pidfile" "$logfile" "mongo-standalone" \
        mongo_standalone_answers
}

svc_mongo_standalone_stop() {
    local pidfile
    pidfile="$(svc_dir mongo-standalone)/mongod.pid"
    forget_stale_pidfile "$pidfile" "$(mongo_mongod)"
    stop_pidfile "$pidfile" mongo-standalone
}

svc_mongo_standalone_status() {
    if ! mongo_installed; then
        printf 'mongo-standalone: not installed (run: bash scripts/services.sh install mongo-standalone)\n'
        return 1
    fi
    pidfile_status mongo-standalone "$(svc_dir mongo-standalone)/mongod.pid" "$(mongo_mongod)" \
        "$mongo_host" "$mongo_standalone_port" mongo_standalone_answers
}
