# redis-sentinel: a Redis master on 127.0.0.1:6390 with one replica on 6391, and
# one Sentinel on 26379 that monitors them as service "aiolease" (quorum 1,
# down-after 1 s, failover-timeout 3 s). Each process has its directory under
# $state_dir/redis-sentinel/ (n6390, n6391, s26379). The failover test kills the
# master; `start` then starts it again, and Sentinel turns it into a replica of
# the new master.
# shellcheck shell=bash

# shellcheck source=_redis_lib.sh
. "$repo/scripts/services.d/_redis_lib.sh"

redis_sentinel_master=6390
redis_sentinel_replica=6391
redis_sentinel_port=26379
redis_sentinel_service=aiolease

redis_sentinel_dir() { printf '%s\n' "$(svc_dir redis-sentinel)/$1"; }

# redis_sentinel_ready: the Sentinel names a master, and that master says it is one.
redis_sentinel_ready() {
    local addr port
    addr="$(timeout 5 redis-cli -p "$redis_sentinel_port" sentinel get-master-addr-by-name \
        "$redis_sentinel_service" 2>/dev/null | tr -d '\r')" || return 1
    port="$(printf '%s\n' "$addr" | sed -n 2p)"
    [ -n "$port" ] || return 1
    timeout 5 redis-cli -p "$port" role 2>/dev/null | head -n 1 | grep -qx master
}

svc_redis_sentinel_install() { svc_redis_install; }

svc_redis_sentinel_start() {
    redis_need_installed redis-sentinel
    svc_lock redis-sentinel
    local sdir conf
    redis_instance_start "$(redis_sentinel_dir n$redis_sentinel_master)" \
        "redis-sentinel master" "$redis_sentinel_master" --save "" --appendonly no
    redis_instance_start "$(redis_sentinel_dir n$redis_sentinel_replica)" \
        "redis-sentinel replica" "$redis_sentinel_replica" --save "" --appendonly no \
        --replicaof 127.0.0.1 "$redis_sentinel_master"
    sdir="$(redis_sentinel_dir s$redis_sentinel_port)"
    conf="$sdir/sentinel.conf"
    mkdir -p "$sdir"
    # Sentinel rewrites its config file (the current master, the known replicas):
    # it is written once, and kept across restarts.
    if [ ! -s "$conf" ]; then
        cat >"$conf" <<CONF
sentinel monitor $redis_sentinel_service 127.0.0.1 $redis_sentinel_master 1
sentinel down-after-milliseconds $redis_sentinel_service 1000
sentinel failover-timeout $redis_sentinel_service 3000
sentinel parallel-syncs $redis_sentinel_service 1
CONF
    fi
    redis_instance_start "$sdir" "redis-sentinel sentinel" "$redis_sentinel_port" "$conf" \
        --sentinel
    wait_ready 60 "$sdir/redis.log" "redis-sentinel (a master named by the Sentinel)" \
        redis_sentinel_ready
}

svc_redis_sentinel_stop() {
    svc_lock redis-sentinel
    local name
    for name in "s$redis_sentinel_port" "n$redis_sentinel_replica" "n$redis_sentinel_master"; do
        redis_instance_stop "$(redis_sentinel_dir "$name")" "redis-sentinel $name"
    done
}

svc_redis_sentinel_status() {
    local rc=0
    redis_instance_status "$(redis_sentinel_dir n$redis_sentinel_master)" \
        "redis-sentinel node 6390" "$redis_sentinel_master" || rc=1
    redis_instance_status "$(redis_sentinel_dir n$redis_sentinel_replica)" \
        "redis-sentinel node 6391" "$redis_sentinel_replica" || rc=1
    redis_instance_status "$(redis_sentinel_dir s$redis_sentinel_port)" \
        "redis-sentinel sentinel" "$redis_sentinel_port" || rc=1
    return "$rc"
}
