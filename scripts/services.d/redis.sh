# redis: Debian's redis-server on 127.0.0.1:6379, no persistence.
# shellcheck shell=bash
#
# A Redis that already answers on the port (e.g. one that Debian's init script
# started; the package's postinst does not start it without an init system) is
# used as it is. Ours runs in the foreground under start_daemon, with its
# pidfile, log and working directory in $state_dir/redis/.

redis_host=127.0.0.1
redis_port=6379
redis_start_timeout=30

redis_installed() { command -v redis-server >/dev/null && command -v redis-cli >/dev/null; }

# redis_ping: the server on the port answers PING with PONG.
redis_ping() {
    [ "$(timeout 5 redis-cli -h "$redis_host" -p "$redis_port" ping 2>/dev/null)" = PONG ]
}

svc_redis_install() {
    redis_installed || apt_install redis-server redis-tools
    redis_installed || die "redis-server or redis-cli is still missing after apt-get install"
}

svc_redis_start() {
    redis_installed \
        || die "redis-server is not installed; run: bash scripts/services.sh install redis"
    svc_lock redis
    local dir pidfile logfile
    dir="$(svc_dir redis)"
    pidfile="$dir/redis.pid"
    logfile="$dir/redis.log"
    forget_stale_pidfile "$pidfile" redis-server
    if pidfile_alive "$pidfile" || port_open "$redis_port" "$redis_host"; then
        # Ours, or someone else's: either way wait until it answers (it may be loading).
        wait_ready "$redis_start_timeout" "$logfile" "redis on $redis_host:$redis_port" redis_ping
        return 0
    fi
    rm -f "$pidfile"
    log "starting redis on $redis_host:$redis_port (log: $logfile)"
    printf '\n--- %s: services.sh starts redis-server\n' "$(date)" >>"$logfile"
    start_daemon "$pidfile" "$logfile" redis-server --daemonize no \
        --bind "$redis_host" --port "$redis_port" --save "" --appendonly no --dir "$dir" 9>&-
    wait_started "$redis_start_timeout" "$pidfile" "$logfile" "redis" redis_ping
}

svc_redis_stop() {
    svc_lock redis
    local pidfile
    pidfile="$(svc_dir redis)/redis.pid"
    forget_stale_pidfile "$pidfile" redis-server
    stop_pidfile "$pidfile" redis
}

svc_redis_status() {
    local pidfile
    pidfile="$(svc_dir redis)/redis.pid"
    forget_stale_pidfile "$pidfile" redis-server
    if ! redis_installed || ! redis_ping; then
        if pidfile_alive "$pidfile"; then
            printf 'redis: not ready (started by services.sh, pid %s)\n' "$(cat "$pidfile")"
        else
            printf 'redis: not running\n'
        fi
        return 1
    fi
    if pidfile_alive "$pidfile"; then
        printf 'redis: ready (started by services.sh, pid %s)\n' "$(cat "$pidfile")"
    else
        printf 'redis: ready (not ours)\n'
    fi
}
