# Helpers shared by the extra Redis services (redis-aof, redis-cluster,
# redis-sentinel): one redis-server (or sentinel) process per port, each with
# its pidfile, log and working directory under the service's directory.
# Sourced by those service files; needs _lib.sh and redis.sh (redis_installed).
# shellcheck shell=bash

# redis_port_ping PORT: the server on 127.0.0.1:PORT answers PING with PONG.
redis_port_ping() {
    [ "$(timeout 5 redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null)" = PONG ]
}

# redis_need_installed SERVICE: die with the install hint unless redis is installed.
redis_need_installed() {
    redis_installed \
        || die "redis-server is not installed; run: bash scripts/services.sh install $1"
}

# redis_instance_start DIR WHAT PORT ARG...: start `redis-server ARG...` (bound to
# 127.0.0.1:PORT, working directory DIR) unless our pidfile in DIR names a live
# one or something already answers on PORT; then wait until it answers PING.
# ARG may be a config file to load first (redis-server takes it as the first
# argument). Extra options are always given on the command line.
redis_instance_start() {
    local dir="$1" what="$2" port="$3"
    shift 3
    local pidfile="$dir/redis.pid" logfile="$dir/redis.log"
    mkdir -p "$dir"
    forget_stale_pidfile "$pidfile" redis-
    if pidfile_alive "$pidfile" || port_open "$port"; then
        wait_ready 30 "$logfile" "$what on 127.0.0.1:$port" redis_port_ping "$port"
        return 0
    fi
    rm -f "$pidfile"
    log "starting $what on 127.0.0.1:$port (log: $logfile)"
    printf '\n--- %s: services.sh starts %s\n' "$(date)" "$what" >>"$logfile"
    start_daemon "$pidfile" "$logfile" redis-server "$@" --daemonize no \
        --bind 127.0.0.1 --port "$port" --dir "$dir" 9>&-
    wait_started 30 "$pidfile" "$logfile" "$what" redis_port_ping "$port"
}

# redis_instance_stop DIR WHAT: stop the server whose pidfile is in DIR, if ours.
redis_instance_stop() {
    forget_stale_pidfile "$1/redis.pid" redis-
    stop_pidfile "$1/redis.pid" "$2"
}

# redis_instance_status DIR WHAT PORT: print one line; fail unless it answers.
redis_instance_status() {
    local dir="$1" what="$2" port="$3" pidfile="$1/redis.pid"
    forget_stale_pidfile "$pidfile" redis-
    if ! redis_installed || ! redis_port_ping "$port"; then
        if pidfile_alive "$pidfile"; then
            printf '%s: not ready (started by services.sh, pid %s)\n' "$what" "$(cat "$pidfile")"
        else
            printf '%s: not running\n' "$what"
        fi
        return 1
    fi
    if pidfile_alive "$pidfile"; then
        printf '%s: ready (started by services.sh, pid %s)\n' "$what" "$(cat "$pidfile")"
    else
        printf '%s: ready (not ours)\n' "$what"
    fi
}
