# zookeeper-ensemble: three ZooKeeper 3.8 members z1, z2, z3 on 127.0.0.1 (clients
# 21811-21813, quorum 21821-21823, leader election 21831-21833), each with its
# zoo.cfg, myid, data, log and pidfile in $state_dir/zookeeper-ensemble/z<i>/.
# The safety tests kill the leader member (or every member) and start it again
# (tests/backends/zookeeper/support.py), so `start` works per member: it starts
# every member that is not running, then waits until all three serve and exactly
# one of them leads. A killed member rejoins from its own data (sessions and
# transaction ids go on). Same jars, ticks and session bounds as zookeeper.sh.
# shellcheck shell=bash disable=SC2154 # state_dir is set by services.sh

zk_ens_ids=(1 2 3)
zk_ens_timeout="${AIOLEASE_SERVICES_TIMEOUT:-60}"

zk_ens_client_port() { printf '%s\n' $((21810 + $1)); }
zk_ens_dir() { printf '%s\n' "$state_dir/zookeeper-ensemble/z$1"; }

# zk_ens_4lw I WORD: member I's answer to a four-letter command.
zk_ens_4lw() {
    # shellcheck disable=SC2016 # the inner bash expands its own arguments
    timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2" && printf %s "$3" >&3 && cat <&3' \
        _ 127.0.0.1 "$(zk_ens_client_port "$1")" "$2" 2>/dev/null
}

# zk_ens_mode I: leader, follower, or nothing (not serving).
zk_ens_mode() { zk_ens_4lw "$1" srvr | sed -n 's/^Mode: //p'; }

# zk_ens_ready: every member serves, and exactly one leads.
zk_ens_ready() {
    local i mode leaders=0
    for i in "${zk_ens_ids[@]}"; do
        mode="$(zk_ens_mode "$i")"
        case "$mode" in
            leader) leaders=$((leaders + 1)) ;;
            follower) ;;
            *) return 1 ;;
        esac
    done
    [ "$leaders" -eq 1 ]
}

zk_ens_write_config() {
    local i="$1" dir
    dir="$(zk_ens_dir "$i")"
    mkdir -p "$dir/data" || die "cannot create $dir/data"
    printf '%s\n' "$i" >"$dir/data/myid"
    cat >"$dir/zoo.cfg" <<CFG
# Written by scripts/services.sh (zookeeper-ensemble); rewritten on every start.
dataDir=$dir/data
clientPort=$(zk_ens_client_port "$i")
clientPortAddress=127.0.0.1
admin.enableServer=false
tickTime=500
initLimit=10
syncLimit=5
minSessionTimeout=1000
maxClientCnxns=0
4lw.commands.whitelist=ruok,srvr,stat,mntr,envi
server.1=127.0.0.1:21821:21831
server.2=127.0.0.1:21822:21832
server.3=127.0.0.1:21823:21833
CFG
}

zk_ens_start_member() {
    local i="$1" dir
    dir="$(zk_ens_dir "$i")"
    zk_ens_write_config "$i" || die "cannot write $dir/zoo.cfg"
    [ ! -f "$dir/zookeeper.log" ] || mv -f "$dir/zookeeper.log" "$dir/zookeeper.log.1"
    log "starting zookeeper-ensemble member z$i on 127.0.0.1:$(zk_ens_client_port "$i") (log: $dir/zookeeper.log)"
    start_daemon "$dir/zookeeper.pid" "$dir/zookeeper.log" java -Xms32m -Xmx192m -XX:+UseSerialGC \
        -Djava.net.preferIPv4Stack=true -Dorg.slf4j.simpleLogger.showDateTime=true \
        "-Dorg.slf4j.simpleLogger.dateTimeFormat=yyyy-MM-dd HH:mm:ss.SSS" \
        -Dorg.slf4j.simpleLogger.log.org.apache.zookeeper.server.NIOServerCnxn=warn \
        -cp "$zk_classpath" org.apache.zookeeper.server.quorum.QuorumPeerMain "$dir/zoo.cfg" 9>&-
}

svc_zookeeper_ensemble_install() { svc_zookeeper_install; }

svc_zookeeper_ensemble_start() {
    svc_lock zookeeper-ensemble
    local i dir started=()
    for i in "${zk_ens_ids[@]}"; do
        dir="$(zk_ens_dir "$i")"
        forget_stale_pidfile "$dir/zookeeper.pid" "$dir/zoo.cfg"
        pidfile_alive "$dir/zookeeper.pid" && continue
        if port_open "$(zk_ens_client_port "$i")"; then
            log "zookeeper-ensemble: z$i is already running (not ours)"
            continue
        fi
        zk_installed || die "zookeeper is not installed; run: bash scripts/services.sh install zookeeper-ensemble"
        zk_ens_start_member "$i"
        started+=("$i")
    done
    local deadline=$((SECONDS + zk_ens_timeout))
    until zk_ens_ready; do
        for i in "${started[@]}"; do
            dir="$(zk_ens_dir "$i")"
            if ! pidfile_alive "$dir/zookeeper.pid"; then
                tail -n 20 "$dir/zookeeper.log" >&2
                rm -f "$dir/zookeeper.pid"
                die "zookeeper-ensemble member z$i exited while starting (log: $dir/zookeeper.log)"
            fi
        done
        if [ "$SECONDS" -ge "$deadline" ]; then
            die "zookeeper-ensemble has no leader with three members serving after" \
                "${zk_ens_timeout}s (logs: $state_dir/zookeeper-ensemble/z{1,2,3}/zookeeper.log)"
        fi
        sleep 0.1
    done
}

svc_zookeeper_ensemble_stop() {
    svc_lock zookeeper-ensemble
    local i dir
    for i in "${zk_ens_ids[@]}"; do
        dir="$(zk_ens_dir "$i")"
        forget_stale_pidfile "$dir/zookeeper.pid" "$dir/zoo.cfg"
        stop_pidfile "$dir/zookeeper.pid" "zookeeper-ensemble member z$i"
    done
}

svc_zookeeper_ensemble_status() {
    local i dir members=() summary
    for i in "${zk_ens_ids[@]}"; do
        dir="$(zk_ens_dir "$i")"
        forget_stale_pidfile "$dir/zookeeper.pid" "$dir/zoo.cfg"
        members+=("z$i=$(zk_ens_mode "$i" || true)")
    done
    summary="$(printf '%s, ' "${members[@]}")"
    summary="${summary%, }"
    if zk_ens_ready; then
        printf 'zookeeper-ensemble: ready (%s)\n' "$summary"
        return 0
    fi
    printf 'zookeeper-ensemble: not ready (%s)\n' "$summary"
    return 1
}
