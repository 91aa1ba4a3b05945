# postgres: Debian's PostgreSQL cluster "main" on 127.0.0.1:5432, database "test".
# shellcheck shell=bash
#
# The tests connect as postgresql://postgres@127.0.0.1:5432/test, without a
# password. The cluster is Debian's own (the package creates it; its data and
# server log stay in /var/lib/postgresql and /var/log/postgresql). When
# loopback TCP does not let postgres in without a password (a fresh install uses
# scram), two "trust" lines for the postgres user go to the top of the cluster's
# pg_hba.conf, once, and the server reloads. We start the cluster with
# pg_ctlcluster only when nothing serves the port; $state_dir/postgres/ then
# holds the postmaster's pid, and `stop` stops the cluster only while that pid
# is still the running postmaster.

pg_host=127.0.0.1
pg_port=5432
pg_cluster=main
pg_start_timeout=60
pg_hba_marker="# aiolease scripts/services.sh: the tests log in as postgres over loopback TCP"

pg_installed() {
    command -v pg_ctlcluster >/dev/null && command -v pg_lsclusters >/dev/null \
        && command -v psql >/dev/null && command -v pg_isready >/dev/null \
        && compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null
}

# pg_newest_version: the newest PostgreSQL major whose server is installed.
pg_newest_version() {
    local bin
    bin="$(compgen -G '/usr/lib/postgresql/*/bin/postgres' | sort -V | tail -n 1)"
    bin="${bin#/usr/lib/postgresql/}"
    printf '%s\n' "${bin%%/*}"
}

# pg_cluster_field VERSION FIELD: one column of pg_lsclusters for VERSION/main
# (3 port, 4 status, 6 data directory, 7 log file); fails when there is no such cluster.
pg_cluster_field() {
    pg_lsclusters -h 2>/dev/null | awk -v v="$1" -v c="$pg_cluster" -v f="$2" \
        '$1 == v && $2 == c { print $f; found = 1 } END { exit !found }'
}

# pg_version: the version of our cluster: the "main" on our port, else the
# newest installed version (whose "main" may not exist yet).
pg_version() {
    pg_lsclusters -h 2>/dev/null | awk -v c="$pg_cluster" -v p="$pg_port" \
        '$2 == c && $3 == p { print $1; found = 1; exit } END { exit !found }' \
        || pg_newest_version
}

# pg_postmaster_pid VERSION: the pid of the running postmaster of VERSION/main.
pg_postmaster_pid() {
    local datadir pid
    datadir="$(pg_cluster_field "$1" 6)" || return 1
    pid="$(head -n 1 "$datadir/postmaster.pid" 2>/dev/null)" || return 1
    [ -n "$pid" ] && pid_alive "$pid" && printf '%s\n' "$pid"
}

# pg_sql DATABASE SQL: run SQL as postgres over loopback TCP, without a password.
pg_sql() {
    PGCONNECT_TIMEOUT=5 timeout 10 psql -X -w -q -v ON_ERROR_STOP=1 -tA \
        -h "$pg_host" -p "$pg_port" -U postgres -d "$1" -c "$2"
}

pg_login_ok() { [ "$(pg_sql postgres 'SELECT 1' 2>/dev/null)" = 1 ]; }
pg_ready() { [ "$(pg_sql test 'SELECT 1' 2>/dev/null)" = 1 ]; }
pg_accepting() { pg_isready -q -h "$pg_host" -p "$pg_port" -t 5; }

# pg_ours: the postmaster we started (its pid is in our pidfile) is running.
pg_ours() {
    local dir ver pid
    dir="$(svc_dir postgres)"
    [ -f "$dir/postgres.pid" ] || return 1
    ver="$(cat "$dir/version" 2>/dev/null)" || return 1
    pid="$(pg_postmaster_pid "$ver")" || return 1
    [ "$pid" = "$(cat "$dir/postgres.pid")" ]
}

svc_postgres_install() {
    if ! pg_installed; then
        # The "postgresql" package depends on the major version Debian ships.
        apt_install postgresql
        pg_installed || die "PostgreSQL is still incomplete after apt-get install postgresql"
    fi
    local ver
    ver="$(pg_version)"
    if ! pg_cluster_field "$ver" 3 >/dev/null; then
        # Debian's postinst makes it, unless createcluster.conf says not to.
        log "creating PostgreSQL cluster $ver/$pg_cluster on port $pg_port"
        pg_createcluster --port "$pg_port" "$ver" "$pg_cluster" >/dev/null \
            || die "pg_createcluster $ver $pg_cluster failed"
    fi
}

# pg_allow_trust VERSION: put our trust lines at the top of the cluster's
# pg_hba.conf (once) and reload it if it is running.
pg_allow_trust() {
    local ver="$1" hba tmp
    hba="$(pg_conftool -s "$ver" "$pg_cluster" show hba_file 2>/dev/null)" \
        || hba="/etc/postgresql/$ver/$pg_cluster/pg_hba.conf"
    [ -f "$hba" ] || die "no pg_hba.conf for cluster $ver/$pg_cluster at $hba"
    if ! grep -qxF "$pg_hba_marker" "$hba"; then
        log "allowing postgres over loopback TCP without a password in $hba"
        tmp="$(mktemp)"
        {
            printf '%s\n' "$pg_hba_marker"
            printf 'host    all             postgres        127.0.0.1/32            trust\n'
            printf 'host    all             postgres        ::1/128                 trust\n'
            cat "$hba"
        } >"$tmp"
        # Rewrite in place, so that the file keeps its owner and mode.
        cat "$tmp" >"$hba"
        rm -f "$tmp"
    fi
    if pg_postmaster_pid "$ver" >/dev/null; then
        pg_ctlcluster --skip-systemctl-redirect "$ver" "$pg_cluster" reload \
            || die "could not reload cluster $ver/$pg_cluster"
    fi
}

# pg_start_cluster VERSION: start VERSION/main on 127.0.0.1 only and remember
# its postmaster as ours.
pg_start_cluster() {
    local ver="$1" dir="$2" port startlog serverlog pid
    port="$(pg_cluster_field "$ver" 3)" \
        || die "no cluster $ver/$pg_cluster; run: bash scripts/services.sh install postgres"
    [ "$port" = "$pg_port" ] \
        || die "cluster $ver/$pg_cluster is set to port $port, not $pg_port (see pg_lsclusters)"
    startlog="$dir/pg_ctlcluster.log"
    serverlog="$(pg_cluster_field "$ver" 7)" \
        || serverlog="/var/log/postgresql/postgresql-$ver-$pg_cluster.log"
    log "starting PostgreSQL $ver/$pg_cluster on $pg_host:$pg_port (log: $serverlog)"
    printf '\n--- %s: services.sh starts %s/%s\n' "$(date)" "$ver" "$pg_cluster" >>"$startlog"
    # pg_ctl waits until the server accepts connections or has failed.
    # 9>&-: the postmaster must not inherit (and hold) svc_lock's lock.
    if ! timeout "$pg_start_timeout" pg_ctlcluster --skip-systemctl-redirect \
        -o "-c listen_addresses=$pg_host" "$ver" "$pg_cluster" start >>"$startlog" 2>&1 9>&-; then
        # Timed out, but the postmaster may run on: it is ours to stop.
        if pid="$(pg_postmaster_pid "$ver")"; then
            printf '%s\n' "$ver" >"$dir/version"
            printf '%s\n' "$pid" >"$dir/postgres.pid"
        fi
        log "PostgreSQL $ver/$pg_cluster did not start; $startlog and $serverlog end with:"
        tail -n 5 "$startlog" >&2
        [ -f "$serverlog" ] && tail -n 20 "$serverlog" >&2
        die "PostgreSQL did not start (logs: $serverlog, $startlog)"
    fi
    pid="$(pg_postmaster_pid "$ver")" \
        || die "PostgreSQL started but has no postmaster.pid (log: $serverlog)"
    printf '%s\n' "$ver" >"$dir/version"
    printf '%s\n' "$pid" >"$dir/postgres.pid"
}

svc_postgres_start() {
    pg_installed \
        || die "PostgreSQL is not installed; run: bash scripts/services.sh install postgres"
    svc_lock postgres
    local dir ver serverlog
    dir="$(svc_dir postgres)"
    ver="$(pg_version)"
    serverlog="$(pg_cluster_field "$ver" 7)" \
        || serverlog="/var/log/postgresql/postgresql-$ver-$pg_cluster.log"
    if ! port_open "$pg_port" "$pg_host"; then
        pg_start_cluster "$ver" "$dir"
    fi
    wait_ready "$pg_start_timeout" "$serverlog" "PostgreSQL on $pg_host:$pg_port" pg_accepting
    if ! pg_login_ok; then
        pg_postmaster_pid "$ver" >/dev/null \
            || die "the PostgreSQL on $pg_host:$pg_port is not Debian's cluster $ver/$pg_cluster" \
                "and refuses postgres without a password; fix its auth or set AIOLEASE_POSTGRES_URL"
        pg_allow_trust "$ver"
        wait_ready 10 "$serverlog" "PostgreSQL login as postgres over TCP" pg_login_ok
    fi
    if [ "$(pg_sql postgres "SELECT 1 FROM pg_database WHERE datname = 'test'")" != 1 ]; then
        log "creating database test"
        # Another start may have created it meanwhile: only the final check counts.
        pg_sql postgres 'CREATE DATABASE test OWNER postgres' >/dev/null 2>&1 || true
    fi
    pg_ready || die "PostgreSQL is up but database test is not usable (log: $serverlog)"
}

svc_postgres_stop() {
    svc_lock postgres
    local dir ver
    dir="$(svc_dir postgres)"
    if ! pg_ours; then
        if [ -f "$dir/postgres.pid" ]; then
            log "postgres: the server we started is no longer running; forgetting it"
        else
            log "postgres: not started by this script; left alone"
        fi
        rm -f "$dir/postgres.pid" "$dir/version"
        return 0
    fi
    ver="$(cat "$dir/version")"
    log "stopping PostgreSQL $ver/$pg_cluster (pid $(cat "$dir/postgres.pid"))"
    pg_ctlcluster --skip-systemctl-redirect "$ver" "$pg_cluster" stop \
        || die "pg_ctlcluster $ver $pg_cluster stop failed"
    rm -f "$dir/postgres.pid" "$dir/version"
}

svc_postgres_status() {
    local ours=""
    if pg_installed && pg_ours; then
        ours="started by services.sh, pid $(cat "$(svc_dir postgres)/postgres.pid")"
    fi
    if pg_installed && pg_ready; then
        printf 'postgres: ready (%s)\n' "${ours:-not ours}"
    elif [ -n "$ours" ] || port_open "$pg_port" "$pg_host"; then
        printf 'postgres: not ready (%s; no passwordless login to database test)\n' \
            "${ours:-not ours}"
        return 1
    else
        printf 'postgres: not running\n'
        return 1
    fi
}
