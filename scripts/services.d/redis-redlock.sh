# redis-redlock: three independent Redis servers (no replication, no cluster, no
# persistence) on 127.0.0.1 ports 6381-6383, the instances of a Redlock. Each has
# its pidfile, log and working directory in $state_dir/redis-redlock/n<port>/.
# The Redlock tests kill and pause none of them; they cut instances off through
# a fault proxy instead.
# shellcheck shell=bash

# shellcheck source=_redis_lib.sh
. "$repo/scripts/services.d/_redis_lib.sh"

redis_redlock_ports=(6381 6382 6383)

redis_redlock_dir() { printf '%s\n' "$(svc_dir redis-redlock)/n$1"; }

svc_redis_redlock_install() { svc_redis_install; }

svc_redis_redlock_start() {
    redis_need_installed redis-redlock
    svc_lock redis-redlock
    local port
    for port in "${redis_redlock_ports[@]}"; do
        redis_instance_start "$(redis_redlock_dir "$port")" "redis-redlock instance $port" \
            "$port" --save "" --appendonly no
    done
}

svc_redis_redlock_stop() {
    svc_lock redis-redlock
    local port
    for port in "${redis_redlock_ports[@]}"; do
        redis_instance_stop "$(redis_redlock_dir "$port")" "redis-redlock instance $port"
    done
}

svc_redis_redlock_status() {
    local port failed=0
    for port in "${redis_redlock_ports[@]}"; do
        redis_instance_status "$(redis_redlock_dir "$port")" "redis-redlock instance $port" \
            "$port" || failed=1
    done
    return "$failed"
}
