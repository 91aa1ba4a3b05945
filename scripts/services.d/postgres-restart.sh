# postgres-restart: a PostgreSQL cluster of our own on 127.0.0.1:5433 (trust, database "test").
# shellcheck shell=bash
#
# The safety tests SIGKILL this server and start it again (server-restart), so they
# never touch the shared cluster on :5432 that the rest of the suite uses. It is made
# with initdb from the newest installed PostgreSQL (15 on bookworm), runs fsync on,
# and its postmaster runs in the foreground under start_daemon, so that
# $state_dir/postgres-restart/postgres.pid is the postmaster's own pid.
#
# PostgreSQL refuses to run as root: when this script runs as root, the cluster
# belongs to, and runs as, the "postgres" user that Debian's package creates. Its data
# directory is $state_dir/postgres-restart/data when that user can reach it, else
# (e.g. the state dir is under a 0700 /root) postgres's home directory holds it; the
# path chosen is kept in $state_dir/postgres-restart/datadir. The server log stays in
# $state_dir/postgres-restart/ (opened by this script, not by the server).

# shellcheck source=postgres.sh
. "$repo/scripts/services.d/postgres.sh"

pgr_host=127.0.0.1
pgr_port=5433
pgr_start_timeout=60
pgr_user=postgres

# pgr_bin [DATA]: the binaries of DATA's PostgreSQL version, else of the newest installed.
pgr_bin() {
    local ver
    ver="$(cat "${1:-/nonexistent}/PG_VERSION" 2>/dev/null)" || ver="$(pg_newest_version)"
    printf '/usr/lib/postgresql/%s/bin\n' "$ver"
}

# pgr_owner_prefix: the words that run a command as the cluster's owner (postgres,
# when we are root; none otherwise). setpriv execs the command in place, so a daemon
# started through it keeps its pid.
pgr_owner_prefix() {
    if have_root; then
        printf '%s\n' setpriv "--reuid=$pgr_user" "--regid=$pgr_user" --init-groups --reset-env --
    fi
}

# pgr_as_owner CMD...: run CMD as the cluster's owner.
pgr_as_owner() {
    local prefix
    mapfile -t prefix < <(pgr_owner_prefix)
    "${prefix[@]}" "$@"
}

# pgr_owned_dir DIR: make DIR, owned by the cluster's owner.
pgr_owned_dir() {
    mkdir -p "$1"
    if have_root; then chown "$pgr_user:" "$1"; fi
}

# pgr_sql DATABASE SQL: run SQL as postgres over loopback TCP, without a password.
pgr_sql() {
    PGCONNECT_TIMEOUT=5 timeout 10 psql -X -w -q -v ON_ERROR_STOP=1 -tA \
        -h "$pgr_host" -p "$pgr_port" -U postgres -d "$1" -c "$2"
}

pgr_login_ok() { [ "$(pgr_sql postgres 'SELECT 1' 2>/dev/null)" = 1 ]; }
pgr_ready() { [ "$(pgr_sql test 'SELECT 1' 2>/dev/null)" = 1 ]; }

# pgr_datadir DIR: the cluster's data directory (chosen once, then remembered).
pgr_datadir() {
    local dir="$1" data home
    if [ -f "$dir/datadir" ]; then
        cat "$dir/datadir"
        return 0
    fi
    data="$dir/data"
    pgr_owned_dir "$data"
    if ! pgr_as_owner test -w "$data"; then
        rmdir "$data"
        home="$(getent passwd "$pgr_user" | cut -d: -f6)"
        [ -n "$home" ] && [ -d "$home" ] || die "user $pgr_user has no home directory"
        pgr_owned_dir "$home/aiolease-services"
        data="$home/aiolease-services/postgres-restart"
        log "postgres-restart: $pgr_user cannot reach $dir; its data goes to $data"
    fi
    printf '%s\n' "$data" >"$dir/datadir"
    printf '%s\n' "$data"
}

# pgr_init DIR: make the cluster once (a half-made one is redone).
pgr_init() {
    local dir="$1" data
    data="$(pgr_datadir "$dir")"
    [ -f "$data/.aiolease-initialized" ] && return 0
    log "creating a PostgreSQL cluster in $data (log: $dir/initdb.log)"
    rm -rf "$data"
    pgr_owned_dir "$data"
    chmod 0700 "$data"
    if ! pgr_as_owner "$(pgr_bin)/initdb" -D "$data" -U postgres -A trust -E UTF8 \
        --no-locale >"$dir/initdb.log" 2>&1; then
        tail -n 20 "$dir/initdb.log" >&2
        die "initdb failed (log: $dir/initdb.log)"
    fi
    pgr_as_owner touch "$data/.aiolease-initialized"
}

# pgr_leftovers_gone DATA: no process of a killed postmaster still holds its shared
# memory (a new postmaster refuses to start while one does).
pgr_leftovers_gone() {
    local shmid
    shmid="$(sed -n 7p "$1/postmaster.pid" 2>/dev/null | awk '{ print $2 }')"
    [ -n "$shmid" ] || return 0
    ! awk -v id="$shmid" '$2 == id && $7 > 0 { found = 1 } END { exit !found }' \
        /proc/sysvipc/shm 2>/dev/null
}

# pgr_forget_lockfile DATA: remove the postmaster.pid of a killed postmaster. Where
# nothing reaps orphans (no init), it lingers as a zombie, which PostgreSQL's own
# check (kill -0) takes for a running postmaster.
pgr_forget_lockfile() {
    local pid
    pid="$(head -n 1 "$1/postmaster.pid" 2>/dev/null)" || return 0
    if [ -n "$pid" ] && ! pid_alive "$pid"; then
        log "postgres-restart: removing the lock file of postmaster $pid, which is gone"
        rm -f "$1/postmaster.pid"
    fi
}

svc_postgres_restart_install() {
    pg_installed || apt_install postgresql
    pg_installed || die "PostgreSQL is still incomplete after apt-get install postgresql"
    if have_root; then
        id "$pgr_user" >/dev/null 2>&1 || die "no user $pgr_user (Debian's postgresql creates it)"
        command -v setpriv >/dev/null || apt_install util-linux
    fi
}

svc_postgres_restart_start() {
    pg_installed \
        || die "PostgreSQL is not installed; run: bash scripts/services.sh install postgres-restart"
    svc_lock postgres-restart
    local dir pidfile logfile data prefix
    dir="$(svc_dir postgres-restart)"
    pidfile="$dir/postgres.pid"
    logfile="$dir/postgres.log"
    forget_stale_pidfile "$pidfile" "-p $pgr_port"
    if pidfile_alive "$pidfile" || port_open "$pgr_port" "$pgr_host"; then
        wait_ready "$pgr_start_timeout" "$logfile" "PostgreSQL on $pgr_host:$pgr_port" pgr_login_ok
    else
        rm -f "$pidfile"
        pgr_init "$dir"
        data="$(pgr_datadir "$dir")"
        wait_ready 30 "$logfile" "the end of the killed postmaster's processes" \
            pgr_leftovers_gone "$data"
        pgr_forget_lockfile "$data"
        log "starting PostgreSQL on $pgr_host:$pgr_port (log: $logfile)"
        printf '\n--- %s: services.sh starts postgres\n' "$(date)" >>"$logfile"
        # No unix socket: the shared cluster's socket directory is not ours to use.
        mapfile -t prefix < <(pgr_owner_prefix)
        start_daemon "$pidfile" "$logfile" "${prefix[@]}" "$(pgr_bin "$data")/postgres" -D "$data" \
            -p "$pgr_port" -c listen_addresses="$pgr_host" -c unix_socket_directories= \
            -c fsync=on -c synchronous_commit=on -c max_connections=200 \
            -c shared_buffers=32MB 9>&-
        wait_started "$pgr_start_timeout" "$pidfile" "$logfile" "PostgreSQL (postgres-restart)" \
            pgr_login_ok
    fi
    if [ "$(pgr_sql postgres "SELECT 1 FROM pg_database WHERE datname = 'test'")" != 1 ]; then
        log "creating database test on port $pgr_port"
        pgr_sql postgres 'CREATE DATABASE test' >/dev/null 2>&1 || true
    fi
    pgr_ready \
        || die "PostgreSQL on :$pgr_port is up but database test is not usable (log: $logfile)"
}

svc_postgres_restart_stop() {
    svc_lock postgres-restart
    local dir
    dir="$(svc_dir postgres-restart)"
    forget_stale_pidfile "$dir/postgres.pid" "-p $pgr_port"
    # SIGTERM is PostgreSQL's "smart" shutdown: it waits for clients; SIGINT is "fast".
    if pidfile_alive "$dir/postgres.pid"; then
        log "postgres-restart: fast shutdown of pid $(cat "$dir/postgres.pid")"
        kill -INT "$(cat "$dir/postgres.pid")" 2>/dev/null || true
    fi
    stop_pidfile "$dir/postgres.pid" postgres-restart
}

pgr_usable() { pg_installed && pgr_ready; }

svc_postgres_restart_status() {
    local dir
    dir="$(svc_dir postgres-restart)"
    pidfile_status postgres-restart "$dir/postgres.pid" "-p $pgr_port" "$pgr_host" "$pgr_port" \
        pgr_usable
}
