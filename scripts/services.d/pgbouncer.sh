# pgbouncer: PgBouncer in transaction mode on 127.0.0.1:6432, in front of the postgres service.
# shellcheck shell=bash
#
# The tests connect as postgresql://postgres@127.0.0.1:6432/test: every transaction
# (an autocommitted statement is one) may run on a different server connection, as
# in production behind a transaction pooler. Debian's pgbouncer package brings the
# binary; its init script and /etc/pgbouncer are not used: ours runs in the
# foreground under start_daemon with its own config (rewritten on every start), an
# auth file that lets postgres in without a password (auth_type trust still needs
# the user listed), and its log (stderr) and pidfile in $state_dir/pgbouncer/.
# PgBouncer refuses to run as root: as root, it reads its files first and then
# switches to the "postgres" user that Debian's PostgreSQL package creates (-u).
# It routes database test, and any other (the "*" entry), to the postgres service.
#
# A PgBouncer that already answers on the port (e.g. one Debian's init script
# started) is used as it is, and never stopped.

# shellcheck source=postgres.sh
. "$repo/scripts/services.d/postgres.sh"

pgb_host=127.0.0.1
pgb_port=6432
pgb_start_timeout="${AIOLEASE_SERVICES_TIMEOUT:-60}"
pgb_user=postgres

pgb_installed() { command -v pgbouncer >/dev/null && command -v psql >/dev/null; }

# pgb_sql DATABASE SQL: run SQL through PgBouncer as postgres, without a password.
pgb_sql() {
    PGCONNECT_TIMEOUT=5 timeout 10 psql -X -w -q -v ON_ERROR_STOP=1 -tA \
        -h "$pgb_host" -p "$pgb_port" -U postgres -d "$1" -c "$2"
}

# pgb_admin_ok: PgBouncer itself answers (its admin console; needs no PostgreSQL).
pgb_admin_ok() { pgb_sql pgbouncer 'SHOW VERSION' 2>/dev/null | grep -q PgBouncer; }

# pgb_ready: a statement through PgBouncer reaches database test and is answered.
pgb_ready() { [ "$(pgb_sql test 'SELECT 1' 2>/dev/null)" = 1 ]; }

# pgb_write_config DIR: (re)write DIR/pgbouncer.ini and DIR/userlist.txt.
pgb_write_config() {
    printf '"postgres" ""\n' >"$1/userlist.txt"
    cat >"$1/pgbouncer.ini" <<EOF
; Written by scripts/services.sh (pgbouncer); rewritten on every start.
[databases]
test = host=$pg_host port=$pg_port dbname=test
* = host=$pg_host port=$pg_port

[pgbouncer]
listen_addr = $pgb_host
listen_port = $pgb_port
; no unix socket: /var/run/postgresql is the shared cluster's
unix_socket_dir =
pool_mode = transaction
auth_type = trust
auth_file = $1/userlist.txt
admin_users = postgres
; fewer server connections than the tests open client ones: statements really move
default_pool_size = 10
max_client_conn = 1000
ignore_startup_parameters = extra_float_digits
; the log goes to stderr (start_daemon's log file); no pidfile of its own
logfile =
pidfile =
log_connections = 0
log_disconnections = 0
EOF
}

svc_pgbouncer_install() {
    command -v psql >/dev/null || apt_install postgresql-client
    command -v pgbouncer >/dev/null || apt_install pgbouncer
    pgb_installed || die "pgbouncer or psql is still missing after apt-get install"
    if have_root; then
        id "$pgb_user" >/dev/null 2>&1 \
            || die "no user $pgb_user to run PgBouncer as (Debian's postgresql creates it)"
    fi
}

svc_pgbouncer_start() {
    pgb_installed \
        || die "pgbouncer is not installed; run: bash scripts/services.sh install pgbouncer"
    svc_lock pgbouncer
    local dir pidfile logfile
    dir="$(svc_dir pgbouncer)"
    pidfile="$dir/pgbouncer.pid"
    logfile="$dir/pgbouncer.log"
    forget_stale_pidfile "$pidfile" "$dir/pgbouncer.ini"
    if pidfile_alive "$pidfile"; then
        wait_started "$pgb_start_timeout" "$pidfile" "$logfile" "pgbouncer" pgb_admin_ok
    elif port_open "$pgb_port" "$pgb_host"; then
        wait_ready "$pgb_start_timeout" "(none: not started by services.sh)" \
            "pgbouncer on $pgb_host:$pgb_port (not started by services.sh)" pgb_admin_ok
    else
        if have_root; then
            id "$pgb_user" >/dev/null 2>&1 \
                || die "no user $pgb_user to run PgBouncer as; run: bash scripts/services.sh install pgbouncer"
        fi
        rm -f "$pidfile"
        pgb_write_config "$dir" || die "cannot write $dir/pgbouncer.ini"
        chmod 0644 "$dir/pgbouncer.ini" "$dir/userlist.txt"
        # Keep the previous run's log apart, so that a failure shows only this one.
        [ ! -f "$logfile" ] || mv -f "$logfile" "$logfile.1"
        log "starting pgbouncer on $pgb_host:$pgb_port (log: $logfile)"
        local as_user=()
        if have_root; then as_user=(-u "$pgb_user"); fi
        start_daemon "$pidfile" "$logfile" pgbouncer "${as_user[@]}" "$dir/pgbouncer.ini" 9>&-
        wait_started "$pgb_start_timeout" "$pidfile" "$logfile" "pgbouncer" pgb_admin_ok
    fi
    # PgBouncer is up; statements need the postgres service behind it too.
    wait_ready "$pgb_start_timeout" "$logfile" \
        "database test through pgbouncer on $pgb_host:$pgb_port (is postgres started?)" pgb_ready
}

svc_pgbouncer_stop() {
    svc_lock pgbouncer
    local dir
    dir="$(svc_dir pgbouncer)"
    forget_stale_pidfile "$dir/pgbouncer.pid" "$dir/pgbouncer.ini"
    # SIGTERM is PgBouncer's immediate shutdown (SIGINT waits for clients).
    stop_pidfile "$dir/pgbouncer.pid" pgbouncer
}

pgb_usable() { pgb_installed && pgb_ready; }

svc_pgbouncer_status() {
    local dir
    dir="$(svc_dir pgbouncer)"
    pidfile_status pgbouncer "$dir/pgbouncer.pid" "$dir/pgbouncer.ini" "$pgb_host" "$pgb_port" \
        pgb_usable "no statement reaches database test; is postgres running?"
}
