# etcd-cluster: three etcd members m0, m1, m2 on 127.0.0.1 (clients 23790-23792,
# peers 23800-23802), each with its data, log and pidfile in
# $state_dir/etcd-cluster/m<i>/. The safety tests kill the leader member and
# restart it (aiolease/testing/etcd_cluster.py), so `start` works per member: it
# starts every member that is not running and then waits until all three are
# healthy and agree on one leader. Needs etcd.sh (etcd_install, etcd_ctl, ...).
# shellcheck shell=bash disable=SC2154 # state_dir is set by services.sh
#
# Which --initial-cluster-state a member starts with:
# - it has a data dir: `existing`. etcd then restarts from its WAL and ignores
#   the --initial-cluster* flags (a killed member rejoins this way);
# - no member has data and none runs: `new` for all, a fresh bootstrap;
# - it has no data but the others run: it lost its data (or never started);
#   if the cluster knows it as a started member it is removed and added again
#   (a new member id), then it starts `existing` and is sent a snapshot;
# - some have data, none runs, and this one has none: the cluster cannot reach
#   a quorum to re-add it, so all data dirs are wiped and it bootstraps `new`.

etcd_cluster_ids=(0 1 2)
etcd_cluster_token="aiolease-test"
etcd_cluster_endpoints="127.0.0.1:23790,127.0.0.1:23791,127.0.0.1:23792"
etcd_cluster_initial="m0=http://127.0.0.1:23800,m1=http://127.0.0.1:23801,m2=http://127.0.0.1:23802"
etcd_cluster_timeout="${AIOLEASE_ETCD_CLUSTER_START_TIMEOUT:-60}"

etcd_cluster_client_port() { printf '%s\n' $((23790 + $1)); }
etcd_cluster_peer_url() { printf 'http://127.0.0.1:%s\n' $((23800 + $1)); }
etcd_cluster_dir() { printf '%s\n' "$state_dir/etcd-cluster/m$1"; }
etcd_cluster_has_data() { [ -d "$(etcd_cluster_dir "$1")/data/member" ]; }
etcd_cluster_ours() { pidfile_runs "$(etcd_cluster_dir "$1")/etcd.pid" etcd; }

# etcd_cluster_up I: member I accepts client connections (ours or someone else's).
etcd_cluster_up() { port_open "$(etcd_cluster_client_port "$1")"; }

# etcd_cluster_ready: all three members healthy, three started members in the
# member list, and exactly one of them says it is the leader.
etcd_cluster_ready() {
    local started leaders
    etcd_healthy "$etcd_cluster_endpoints" >/dev/null 2>&1 || return 1
    started="$(etcd_ctl --endpoints="$etcd_cluster_endpoints" member list -w simple 2>/dev/null \
        | grep -c ', started, m[0-2], ')" || return 1
    [ "$started" -eq 3 ] || return 1
    leaders="$(etcd_ctl --endpoints="$etcd_cluster_endpoints" endpoint status -w simple 2>/dev/null \
        | awk -F', ' '$5 == "true"' | wc -l)"
    [ "$leaders" -eq 1 ]
}

# etcd_cluster_leader: the name (m<i>) of the member that says it leads, if any.
etcd_cluster_leader() {
    etcd_ctl --endpoints="$etcd_cluster_endpoints" endpoint status -w simple 2>/dev/null \
        | awk -F', ' '$5 == "true" { sub(/^127\.0\.0\.1:2379/, "m", $1); print $1; exit }'
}

# etcd_cluster_running_endpoints: the client addresses that accept connections now.
etcd_cluster_running_endpoints() {
    local i addrs=()
    for i in "${etcd_cluster_ids[@]}"; do
        etcd_cluster_up "$i" && addrs+=("127.0.0.1:$(etcd_cluster_client_port "$i")")
    done
    local IFS=,
    printf '%s\n' "${addrs[*]}"
}

# etcd_cluster_readd I ENDPOINTS: member I lost its data while the others run:
# remove it from the cluster if it was a started member, and add it back.
etcd_cluster_readd() {
    local i="$1" eps="$2" peer line id
    peer="$(etcd_cluster_peer_url "$i")"
    line="$(etcd_ctl --endpoints="$eps" member list -w simple)" \
        || die "m$i has no data dir and the running members ($eps) cannot list members"
    line="$(grep -F ", $peer, " <<<"$line")" || line="absent"
    case "$line" in
        *", unstarted, "*) return 0 ;; # added but never started: start it `existing`
        absent) ;;
        *)
            id="${line%%,*}"
            log "m$i lost its data dir: removing member $id and adding it again"
            etcd_ctl --endpoints="$eps" member remove "$id" >/dev/null \
                || die "could not remove the data-less member m$i ($id); does the cluster have a quorum?"
            ;;
    esac
    # Right after a removal etcd's strict reconfig check refuses an add for a few
    # seconds ("unhealthy cluster"), so retry for a bounded time.
    local deadline=$((SECONDS + 20))
    until etcd_ctl --endpoints="$eps" member add "m$i" --peer-urls="$peer" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] \
            || die "could not add m$i back to the cluster in 20 s (running members: $eps)"
        sleep 0.5
    done
}

# etcd_cluster_start_member I STATE: start member I with --initial-cluster-state STATE.
etcd_cluster_start_member() {
    local i="$1" state="$2" dir client peer
    dir="$(etcd_cluster_dir "$i")"
    mkdir -p "$dir" || die "cannot create $dir"
    client="http://127.0.0.1:$(etcd_cluster_client_port "$i")"
    peer="$(etcd_cluster_peer_url "$i")"
    log "starting etcd-cluster member m$i on $client ($state; log: $dir/etcd.log)"
    start_daemon "$dir/etcd.pid" "$dir/etcd.log" etcd --name "m$i" --data-dir "$dir/data" \
        --listen-client-urls "$client" --advertise-client-urls "$client" \
        --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
        --initial-cluster "$etcd_cluster_initial" --initial-cluster-token "$etcd_cluster_token" \
        --initial-cluster-state "$state" --heartbeat-interval 100 --election-timeout 1000 \
        --logger zap 9>&-
}

# etcd_cluster_wait I...: wait until the cluster is ready; fail at once when one
# of the members I that we just started exits, and name every log on timeout.
etcd_cluster_wait() {
    local deadline=$((SECONDS + etcd_cluster_timeout)) i dir
    until etcd_cluster_ready; do
        for i in "$@"; do
            dir="$(etcd_cluster_dir "$i")"
            if ! pidfile_runs "$dir/etcd.pid" etcd; then
                log "etcd-cluster member m$i exited at start; its log is $dir/etcd.log:"
                tail -n 20 "$dir/etcd.log" >&2
                rm -f "$dir/etcd.pid"
                die "etcd-cluster member m$i exited instead of joining (log: $dir/etcd.log)"
            fi
        done
        if [ "$SECONDS" -ge "$deadline" ]; then
            # etcdctl's own retry warnings are JSON lines: keep only its verdicts.
            etcd_ctl --endpoints="$etcd_cluster_endpoints" endpoint health 2>&1 | grep -v '^{' >&2
            for i in "${etcd_cluster_ids[@]}"; do
                dir="$(etcd_cluster_dir "$i")"
                [ -f "$dir/etcd.log" ] || continue
                log "last lines of m$i's log $dir/etcd.log:"
                tail -n 5 "$dir/etcd.log" >&2
            done
            die "etcd-cluster is not healthy with a leader after ${etcd_cluster_timeout}s" \
                "(logs: $state_dir/etcd-cluster/m{0,1,2}/etcd.log)"
        fi
        sleep 0.2
    done
}

svc_etcd_cluster_install() { etcd_install; }

svc_etcd_cluster_start() {
    etcd_need etcdctl
    svc_lock etcd-cluster
    local i down=() running=() data=0
    for i in "${etcd_cluster_ids[@]}"; do
        etcd_cluster_has_data "$i" && data=$((data + 1))
        if etcd_cluster_ours "$i"; then
            running+=("$i")
            continue
        fi
        rm -f "$(etcd_cluster_dir "$i")/etcd.pid"
        if etcd_cluster_up "$i"; then
            log "etcd-cluster: m$i is already running on port $(etcd_cluster_client_port "$i") (not ours)"
            running+=("$i")
        else
            down+=("$i")
        fi
    done
    if [ ${#down[@]} -gt 0 ]; then
        etcd_need etcd
        etcd_cluster_start_down "${#running[@]}" "$data" "${down[@]}"
    else
        log "etcd-cluster: all members already running"
    fi
    etcd_cluster_wait "${down[@]}"
}

# etcd_cluster_start_down NRUNNING NDATA I...: start the members I that are down,
# each with the --initial-cluster-state that its data and the others call for.
etcd_cluster_start_down() {
    local nrunning="$1" ndata="$2" i eps
    shift 2
    if [ "$nrunning" -eq 0 ] && [ "$ndata" -gt 0 ] && [ "$ndata" -lt 3 ]; then
        log "etcd-cluster: nothing runs and only $ndata of 3 members have data; wiping and bootstrapping anew"
        for i in "${etcd_cluster_ids[@]}"; do
            rm -rf "$(etcd_cluster_dir "$i")/data"
        done
        ndata=0
    fi
    eps="$(etcd_cluster_running_endpoints)"
    for i in "$@"; do
        if etcd_cluster_has_data "$i"; then
            etcd_cluster_start_member "$i" existing
        elif [ "$ndata" -eq 0 ] && [ "$nrunning" -eq 0 ]; then
            etcd_cluster_start_member "$i" new
        else
            etcd_cluster_readd "$i" "$eps"
            etcd_cluster_start_member "$i" existing
        fi
    done
}

svc_etcd_cluster_stop() {
    local i dir
    svc_lock etcd-cluster
    for i in "${etcd_cluster_ids[@]}"; do
        dir="$(etcd_cluster_dir "$i")"
        forget_stale_pidfile "$dir/etcd.pid" "--data-dir $dir/data"
        stop_pidfile "$dir/etcd.pid" "etcd-cluster member m$i"
    done
}

svc_etcd_cluster_status() {
    local i members=() ours=0 leader
    for i in "${etcd_cluster_ids[@]}"; do
        if etcd_cluster_ours "$i"; then
            members+=("m$i=pid $(cat "$(etcd_cluster_dir "$i")/etcd.pid")")
            ours=$((ours + 1))
        elif etcd_cluster_up "$i"; then
            members+=("m$i=not ours")
        else
            members+=("m$i=down")
        fi
    done
    local summary
    summary="$(printf '%s, ' "${members[@]}")"
    summary="${summary%, }"
    if command -v etcdctl >/dev/null && etcd_cluster_ready; then
        leader="$(etcd_cluster_leader)"
        if [ "$ours" -eq 3 ]; then
            printf 'etcd-cluster: ready (started by services.sh, %s; leader %s)\n' "$summary" "$leader"
        elif [ "$ours" -eq 0 ]; then
            printf 'etcd-cluster: ready (not ours; leader %s)\n' "$leader"
        else
            printf 'etcd-cluster: ready (partly ours: %s; leader %s)\n' "$summary" "$leader"
        fi
        return 0
    fi
    if [ "$ours" -eq 0 ] && [ "$summary" = "m0=down, m1=down, m2=down" ]; then
        printf 'etcd-cluster: not running\n'
    else
        leader="$(etcd_cluster_leader)"
        printf 'etcd-cluster: not ready (%s; leader %s)\n' "$summary" "${leader:-none}"
    fi
    return 1
}
