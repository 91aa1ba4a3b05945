# redis-cluster: a Redis Cluster of three masters (no replicas) on 127.0.0.1
# ports 7000-7002, each with its data, nodes.conf, log and pidfile in
# $state_dir/redis-cluster/n<port>/. `start` starts every node that is not
# running; if no node has slots yet, it creates the cluster with
# `redis-cli --cluster create ... --cluster-yes`; then it waits until every node
# says cluster_state:ok. A restarted node rejoins from its nodes.conf.
# shellcheck shell=bash

# shellcheck source=_redis_lib.sh
. "$repo/scripts/services.d/_redis_lib.sh"

redis_cluster_ports=(7000 7001 7002)
redis_cluster_timeout=60

redis_cluster_dir() { printf '%s\n' "$(svc_dir redis-cluster)/n$1"; }

# redis_cluster_info PORT FIELD: one field of CLUSTER INFO on that node.
redis_cluster_info() {
    timeout 5 redis-cli -h 127.0.0.1 -p "$1" cluster info 2>/dev/null \
        | tr -d '\r' | awk -F: -v f="$2" '$1 == f { print $2 }'
}

# redis_cluster_ok: every node answers and says the cluster is ok.
redis_cluster_ok() {
    local port
    for port in "${redis_cluster_ports[@]}"; do
        [ "$(redis_cluster_info "$port" cluster_state)" = ok ] || return 1
    done
}

# redis_cluster_unassigned: no node has any slot (a fresh cluster, not created yet).
redis_cluster_unassigned() {
    local port
    for port in "${redis_cluster_ports[@]}"; do
        [ "$(redis_cluster_info "$port" cluster_slots_assigned)" = 0 ] || return 1
    done
}

svc_redis_cluster_install() { svc_redis_install; }

svc_redis_cluster_start() {
    redis_need_installed redis-cluster
    svc_lock redis-cluster
    local port dir addrs=()
    for port in "${redis_cluster_ports[@]}"; do
        dir="$(redis_cluster_dir "$port")"
        redis_instance_start "$dir" "redis-cluster node $port" "$port" \
            --cluster-enabled yes --cluster-config-file "$dir/nodes.conf" \
            --cluster-node-timeout 2000 --save "" --appendonly no
        addrs+=("127.0.0.1:$port")
    done
    if redis_cluster_unassigned; then
        log "creating the Redis Cluster on ${addrs[*]}"
        redis-cli --cluster create "${addrs[@]}" --cluster-replicas 0 --cluster-yes >&2 \
            || die "redis-cli --cluster create failed"
    fi
    wait_ready "$redis_cluster_timeout" "$(redis_cluster_dir 7000)/redis.log" \
        "redis-cluster (cluster_state:ok on every node)" redis_cluster_ok
}

svc_redis_cluster_stop() {
    svc_lock redis-cluster
    local port
    for port in "${redis_cluster_ports[@]}"; do
        redis_instance_stop "$(redis_cluster_dir "$port")" "redis-cluster node $port"
    done
}

svc_redis_cluster_status() {
    local port rc=0
    for port in "${redis_cluster_ports[@]}"; do
        redis_instance_status "$(redis_cluster_dir "$port")" "redis-cluster node $port" "$port" \
            || rc=1
    done
    if [ "$rc" -eq 0 ] && ! redis_cluster_ok; then
        printf 'redis-cluster: the nodes run but cluster_state is not ok\n'
        rc=1
    fi
    return "$rc"
}
