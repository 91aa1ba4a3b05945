# redis-aof: a second Redis on 127.0.0.1:6380 that persists every write before
# it answers (--appendonly yes --appendfsync always), so that the fencing-token
# counters survive a crash. The safety tests SIGKILL it and start it again
# (server-restart); its append-only file lives in $state_dir/redis-aof/.
# shellcheck shell=bash

# shellcheck source=_redis_lib.sh
. "$repo/scripts/services.d/_redis_lib.sh"

redis_aof_port=6380

svc_redis_aof_install() { svc_redis_install; }

svc_redis_aof_start() {
    redis_need_installed redis-aof
    svc_lock redis-aof
    redis_instance_start "$(svc_dir redis-aof)" redis-aof "$redis_aof_port" \
        --save "" --appendonly yes --appendfsync always
}

svc_redis_aof_stop() {
    svc_lock redis-aof
    redis_instance_stop "$(svc_dir redis-aof)" redis-aof
}

svc_redis_aof_status() {
    redis_instance_status "$(svc_dir redis-aof)" redis-aof "$redis_aof_port"
}
