# mariadb-restart: a MariaDB of our own on 127.0.0.1:3307, root without a password, database "test".
# shellcheck shell=bash
#
# The safety tests SIGKILL this server and start it again (server-restart), so they
# never touch the shared MariaDB on :3306 that the rest of the suite uses. It runs on
# a datadir of its own in $state_dir/mariadb-restart/ (made by mariadb-install-db,
# with root@127.0.0.1 and no password), with its socket, pid file and log next to
# it, ignoring /etc/mysql (--no-defaults). Every commit is flushed to disk before
# the server answers (innodb_flush_log_at_trx_commit=1), so tokens survive a kill.

# shellcheck source=mariadb.sh
. "$repo/scripts/services.d/mariadb.sh"

mariadb_restart_port=3307

# mariadb_restart_sql SQL [DATABASE]: run SQL as root over TCP, without a password.
mariadb_restart_sql() {
    timeout 10 mariadb --no-defaults --protocol=tcp -h "$mariadb_host" -P "$mariadb_restart_port" \
        -u root --connect-timeout=5 -N -B -e "$1" ${2:+"$2"}
}

mariadb_restart_login_ok() { [ "$(mariadb_restart_sql 'SELECT 1' 2>/dev/null)" = 1 ]; }
mariadb_restart_ready() { [ "$(mariadb_restart_sql 'SELECT 1' test 2>/dev/null)" = 1 ]; }

svc_mariadb_restart_install() { svc_mariadb_install; }

svc_mariadb_restart_start() {
    mariadb_installed \
        || die "MariaDB is not installed; run: bash scripts/services.sh install mariadb-restart"
    svc_lock mariadb-restart
    local dir pidfile logfile
    dir="$(svc_dir mariadb-restart)"
    pidfile="$dir/mariadb.pid"
    logfile="$dir/mariadb.log"
    forget_stale_pidfile "$pidfile" "--datadir=$dir/data"
    if pidfile_alive "$pidfile" || port_open "$mariadb_restart_port" "$mariadb_host"; then
        wait_ready "$mariadb_start_timeout" "$logfile" \
            "MariaDB on $mariadb_host:$mariadb_restart_port" mariadb_restart_login_ok
    else
        rm -f "$pidfile"
        mariadb_init_datadir "$dir"
        log "starting MariaDB on $mariadb_host:$mariadb_restart_port (log: $logfile)"
        printf '\n--- %s: services.sh starts mariadbd\n' "$(date)" >>"$logfile"
        # As mariadb.sh's server, plus a smaller buffer pool (a second server on a
        # small machine) and durable commits spelled out.
        start_daemon "$pidfile" "$logfile" "$mariadb_server" --no-defaults \
            --datadir="$dir/data" --bind-address="$mariadb_host" --port="$mariadb_restart_port" \
            --user=root --skip-name-resolve --socket="$dir/mariadb.sock" \
            --pid-file="$dir/mariadbd.pid" --character-set-server=utf8mb4 \
            --collation-server=utf8mb4_general_ci --innodb-buffer-pool-size=32M \
            --innodb-flush-log-at-trx-commit=1 9>&-
        wait_started "$mariadb_start_timeout" "$pidfile" "$logfile" "MariaDB (mariadb-restart)" \
            mariadb_restart_login_ok
    fi
    mariadb_restart_sql 'CREATE DATABASE IF NOT EXISTS test' || die "could not create database test"
    mariadb_restart_ready \
        || die "MariaDB on :$mariadb_restart_port is up, but database test is unusable ($logfile)"
}

svc_mariadb_restart_stop() {
    svc_lock mariadb-restart
    local dir
    dir="$(svc_dir mariadb-restart)"
    forget_stale_pidfile "$dir/mariadb.pid" "--datadir=$dir/data"
    stop_pidfile "$dir/mariadb.pid" mariadb-restart
}

mariadb_restart_usable() { mariadb_installed && mariadb_restart_ready; }

svc_mariadb_restart_status() {
    local dir
    dir="$(svc_dir mariadb-restart)"
    pidfile_status mariadb-restart "$dir/mariadb.pid" "--datadir=$dir/data" "$mariadb_host" \
        "$mariadb_restart_port" mariadb_restart_usable
}
