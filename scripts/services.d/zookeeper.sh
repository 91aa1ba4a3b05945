# zookeeper: a standalone ZooKeeper 3.8 on 127.0.0.1:2181.
# shellcheck shell=bash
#
# Debian's libzookeeper-java has the server jar. Debian's `zookeeper` package
# adds only init scripts for a system-wide server, a system user, and a
# dependency on the full (graphical) default-jre, none of which is used here:
# the server runs as a plain java process with our own zoo.cfg, data and log in
# $state_dir/zookeeper/. slf4j-simple sends its log to stderr, i.e. to the log
# file. Short ticks keep session expiry (2-20 ticks) quick for the tests.
#
# A server that already answers on the port is used as it is.

zk_host=127.0.0.1
zk_port=2181
zk_start_timeout="${AIOLEASE_SERVICES_TIMEOUT:-60}"
zk_classpath=/usr/share/java/zookeeper.jar:/usr/share/java/slf4j-api.jar:/usr/share/java/slf4j-simple.jar

zk_installed() {
    command -v java >/dev/null || return 1
    local jar
    for jar in ${zk_classpath//:/ }; do
        [ -f "$jar" ] || return 1
    done
}

# zk_4lw WORD: send a four-letter command and print the answer.
zk_4lw() {
    # shellcheck disable=SC2016 # the inner bash expands its own arguments
    timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2" && printf %s "$3" >&3 && cat <&3' \
        _ "$zk_host" "$zk_port" "$1" 2>/dev/null
}

# zk_ready: the server is alive (ruok) and serving requests (srvr reports a mode).
zk_ready() {
    [ "$(zk_4lw ruok)" = imok ] && zk_4lw srvr | grep -q '^Mode: '
}

# zk_write_config DIR: (re)write DIR/zoo.cfg.
zk_write_config() {
    cat >"$1/zoo.cfg" <<EOF
# Written by scripts/services.sh (zookeeper); rewritten on every start.
dataDir=$1/data
clientPort=$zk_port
clientPortAddress=$zk_host
admin.enableServer=false
tickTime=500
minSessionTimeout=1000
maxClientCnxns=0
4lw.commands.whitelist=ruok,srvr,stat,mntr,envi
EOF
}

svc_zookeeper_install() {
    command -v java >/dev/null || apt_install default-jre-headless
    [ -f /usr/share/java/zookeeper.jar ] || apt_install libzookeeper-java libslf4j-java
    [ -f /usr/share/java/slf4j-simple.jar ] || apt_install libslf4j-java
    zk_installed || die "java or a jar of $zk_classpath is still missing after apt-get install"
}

svc_zookeeper_start() {
    local dir pidfile logfile
    dir="$(svc_dir zookeeper)"
    pidfile="$dir/zookeeper.pid"
    logfile="$dir/zookeeper.log"
    forget_stale_pidfile "$pidfile" "$dir/zoo.cfg"
    if pidfile_alive "$pidfile"; then
        wait_started "$zk_start_timeout" "$pidfile" "$logfile" "zookeeper" zk_ready
        return 0
    fi
    if port_open "$zk_port" "$zk_host"; then
        wait_ready "$zk_start_timeout" "(none: not started by services.sh)" \
            "zookeeper on $zk_host:$zk_port (not started by services.sh)" zk_ready
        return 0
    fi
    zk_installed || die "zookeeper is not installed; run: bash scripts/services.sh install zookeeper"
    mkdir -p "$dir/data" || die "cannot create $dir/data"
    zk_write_config "$dir" || die "cannot write $dir/zoo.cfg"
    # Keep the previous run's log apart, so that a failure shows only this one.
    [ ! -f "$logfile" ] || mv -f "$logfile" "$logfile.1"
    log "starting zookeeper on $zk_host:$zk_port (log: $logfile)"
    start_daemon "$pidfile" "$logfile" java -Xms32m -Xmx256m -XX:+UseSerialGC \
        -Djava.net.preferIPv4Stack=true -Dorg.slf4j.simpleLogger.showDateTime=true \
        "-Dorg.slf4j.simpleLogger.dateTimeFormat=yyyy-MM-dd HH:mm:ss.SSS" \
        -Dorg.slf4j.simpleLogger.log.org.apache.zookeeper.server.NIOServerCnxn=warn \
        -cp "$zk_classpath" org.apache.zookeeper.server.quorum.QuorumPeerMain "$dir/zoo.cfg"
    wait_started "$zk_start_timeout" "$pidfile" "$logfile" "zookeeper" zk_ready
}

svc_zookeeper_stop() {
    local dir
    dir="$(svc_dir zookeeper)"
    forget_stale_pidfile "$dir/zookeeper.pid" "$dir/zoo.cfg"
    stop_pidfile "$dir/zookeeper.pid" zookeeper
}

svc_zookeeper_status() {
    local dir pidfile
    dir="$(svc_dir zookeeper)"
    pidfile="$dir/zookeeper.pid"
    forget_stale_pidfile "$pidfile" "$dir/zoo.cfg"
    if ! zk_ready; then
        if pidfile_alive "$pidfile"; then
            printf 'zookeeper: not ready (started by services.sh, pid %s)\n' "$(cat "$pidfile")"
        elif port_open "$zk_port" "$zk_host"; then
            printf 'zookeeper: not ready (not ours: %s:%s does not answer ruok/srvr)\n' \
                "$zk_host" "$zk_port"
        else
            printf 'zookeeper: not running\n'
        fi
        return 1
    fi
    if pidfile_alive "$pidfile"; then
        printf 'zookeeper: ready (started by services.sh, pid %s)\n' "$(cat "$pidfile")"
    else
        printf 'zookeeper: ready (not ours)\n'
    fi
}
