# etcd: one etcd 3.4 node (Debian etcd-server + etcd-client) on 127.0.0.1:2379,
# peer port 2380, data and log under $state_dir/etcd/.
# Also the helpers that etcd-cluster.sh shares (etcd_install, etcd_healthy, ...).
# shellcheck shell=bash disable=SC2154 # state_dir is set by services.sh
#
# The Debian package's postinst starts Debian's own etcd (user etcd, data in
# /var/lib/etcd/default, on localhost:2379) when the machine lets it: through
# the init script when there is no policy-rc.d denying it, or through systemd.
# That copy is started by our install, so etcd_install stops it again; the
# tests then use ours. An etcd that was already running before is left alone.
#
# Note: services.sh runs each service as `if ! (svc_...)`, where `set -e` does
# not apply: every step that can fail says `|| die` itself.

etcd_client_url="http://127.0.0.1:2379"
etcd_peer_url="http://127.0.0.1:2380"
etcd_start_timeout="${AIOLEASE_ETCD_START_TIMEOUT:-30}"

# etcd_ctl ARG...: etcdctl (API v3) with short timeouts, so a dead endpoint fails fast.
etcd_ctl() {
    ETCDCTL_API=3 etcdctl --dial-timeout=1s --command-timeout=3s "$@"
}

# etcd_healthy ENDPOINTS: every endpoint (comma-separated) answers a quorum read.
etcd_healthy() {
    etcd_ctl --endpoints="$1" endpoint health
}

# etcd_install: install etcd and etcdctl if missing (shared with etcd-cluster).
etcd_install() {
    local pkgs=()
    command -v etcd >/dev/null || pkgs+=(etcd-server)
    command -v etcdctl >/dev/null || pkgs+=(etcd-client)
    # The TLS tests (tests/backends/etcd/test_etcd_tls.py) make their certificates with openssl.
    command -v openssl >/dev/null || apt_install openssl
    [ ${#pkgs[@]} -gt 0 ] || return 0
    apt_install "${pkgs[@]}" || die "could not install ${pkgs[*]}"
    if [ "${pkgs[0]}" = etcd-server ]; then
        etcd_stop_debian_service
    fi
    if ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null; then
        die "etcd or etcdctl still missing after installing ${pkgs[*]}"
    fi
}

# etcd_stop_debian_service: stop the etcd that etcd-server's postinst has just
# started (see the top of this file), if it did.
etcd_stop_debian_service() {
    if [ -d /run/systemd/system ]; then
        if systemctl is-active --quiet etcd.service 2>/dev/null; then
            log "stopping etcd.service, which the etcd-server package just started"
            systemctl stop etcd.service || die "could not stop Debian's etcd.service"
        fi
    elif pidfile_alive /run/etcd.pid; then
        # Not checked to be an etcd: start-stop-daemon writes the pidfile before it
        # execs etcd, and the package was not installed before, so this pid is its.
        # Not `/etc/init.d/etcd stop`: it also SIGKILLs every /usr/bin/etcd on the
        # machine (start-stop-daemon --exec), ours and other people's included.
        log "stopping the etcd that the etcd-server package's init script just started"
        stop_pidfile /run/etcd.pid "Debian's etcd"
        ! pidfile_alive /run/etcd.pid || die "could not stop Debian's etcd (/run/etcd.pid)"
    fi
}

# etcd_need BINARY...: die with the install hint when one is missing.
etcd_need() {
    local b
    for b in "$@"; do
        command -v "$b" >/dev/null || die "$b is not installed; run: bash scripts/services.sh install"
    done
}

svc_etcd_install() { etcd_install; }

svc_etcd_start() {
    local dir pidfile logfile
    dir="$(svc_dir etcd)" || die "cannot create $state_dir/etcd"
    pidfile="$dir/etcd.pid"
    logfile="$dir/etcd.log"
    etcd_need etcdctl
    svc_lock etcd
    if pidfile_runs "$pidfile" etcd; then
        wait_started "$etcd_start_timeout" "$pidfile" "$logfile" etcd \
            etcd_healthy 127.0.0.1:2379
        log "etcd: already running (pid $(cat "$pidfile"))"
        return 0
    fi
    rm -f "$pidfile"
    if port_open 2379; then
        # Someone else's server: use it if it is a healthy etcd (it may be starting).
        wait_ready "$etcd_start_timeout" "(not ours: no log)" "the server on 127.0.0.1:2379" \
            etcd_healthy 127.0.0.1:2379
        log "etcd: using the etcd already running on 127.0.0.1:2379 (not ours)"
        return 0
    fi
    etcd_need etcd
    log "starting etcd on 127.0.0.1:2379 (log: $logfile)"
    start_daemon "$pidfile" "$logfile" etcd --name aiolease --data-dir "$dir/data" \
        --listen-client-urls "$etcd_client_url" --advertise-client-urls "$etcd_client_url" \
        --listen-peer-urls "$etcd_peer_url" --initial-advertise-peer-urls "$etcd_peer_url" \
        --initial-cluster "aiolease=$etcd_peer_url" --logger zap 9>&-
    wait_started "$etcd_start_timeout" "$pidfile" "$logfile" etcd etcd_healthy 127.0.0.1:2379
}

svc_etcd_stop() {
    local pidfile="$state_dir/etcd/etcd.pid"
    svc_lock etcd
    forget_stale_pidfile "$pidfile" "--data-dir $state_dir/etcd/data"
    stop_pidfile "$pidfile" etcd
}

svc_etcd_status() {
    local pidfile="$state_dir/etcd/etcd.pid"
    if command -v etcdctl >/dev/null && etcd_healthy 127.0.0.1:2379 >/dev/null 2>&1; then
        if pidfile_runs "$pidfile" etcd; then
            printf 'etcd: ready (started by services.sh, pid %s)\n' "$(cat "$pidfile")"
        else
            printf 'etcd: ready (not ours)\n'
        fi
        return 0
    fi
    if ! command -v etcdctl >/dev/null; then
        printf 'etcd: not ready (no etcdctl to check it; run: bash scripts/services.sh install etcd)\n'
    elif pidfile_runs "$pidfile" etcd; then
        printf 'etcd: not ready (started by services.sh, pid %s; log: %s)\n' \
            "$(cat "$pidfile")" "$state_dir/etcd/etcd.log"
    elif port_open 2379; then
        printf 'etcd: not ready (127.0.0.1:2379 is open but is not a healthy etcd)\n'
    else
        printf 'etcd: not running\n'
    fi
    return 1
}
