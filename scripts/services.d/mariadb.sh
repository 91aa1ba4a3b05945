# mariadb: MariaDB on 127.0.0.1:3306, root without a password over TCP, database "test".
# shellcheck shell=bash
#
# The tests connect as mysql://root@127.0.0.1:3306/test. A server that already
# serves the port is used; if it refuses root without a password over TCP (as
# Debian's own does: root@localhost is unix_socket only), root is given an empty
# password there, through the server's unix socket as the OS root user. Else we
# run our own mariadbd on a datadir of our own in $state_dir/mariadb/ (made by
# mariadb-install-db, with root@127.0.0.1 and no password), with its socket, pid
# file and log next to it, ignoring /etc/mysql (--no-defaults).

mariadb_host=127.0.0.1
mariadb_port=3306
mariadb_start_timeout=60
mariadb_server=/usr/sbin/mariadbd

mariadb_installed() {
    [ -x "$mariadb_server" ] && command -v mariadb-install-db >/dev/null \
        && command -v mariadb >/dev/null && command -v mariadb-admin >/dev/null
}

# mariadb_sql SQL [DATABASE]: run SQL as root over TCP, without a password.
mariadb_sql() {
    timeout 10 mariadb --no-defaults --protocol=tcp -h "$mariadb_host" -P "$mariadb_port" \
        -u root --connect-timeout=5 -N -B -e "$1" ${2:+"$2"}
}

mariadb_login_ok() { [ "$(mariadb_sql 'SELECT 1' 2>/dev/null)" = 1 ]; }
mariadb_ready() { [ "$(mariadb_sql 'SELECT 1' test 2>/dev/null)" = 1 ]; }

# mariadb_alive: a server answers on the port (even if it refuses our login).
mariadb_alive() {
    timeout 10 mariadb-admin --no-defaults --protocol=tcp -h "$mariadb_host" -P "$mariadb_port" \
        -u root --connect-timeout=5 ping >/dev/null 2>&1
}

# mariadb_admin_socket: a unix socket of the server on our port, where the OS
# root user may log in as root (unix_socket auth). Ours, /etc/mysql's, Debian's.
mariadb_admin_socket() {
    local sock defaults_sock
    defaults_sock="$(mariadb --print-defaults 2>/dev/null | tr ' ' '\n' \
        | sed -n 's/^--socket=//p' | tail -n 1)"
    for sock in "$(svc_dir mariadb)/mariadb.sock" $defaults_sock /run/mysqld/mysqld.sock; do
        [ -S "$sock" ] || continue
        if [ "$(timeout 10 mariadb --no-defaults -S "$sock" -u root -N -B -e 'SELECT @@port' \
            2>/dev/null)" = "$mariadb_port" ]; then
            printf '%s\n' "$sock"
            return 0
        fi
    done
    return 1
}

# mariadb_allow_root: let root in over loopback TCP without a password.
# root@localhost also matches TCP from 127.0.0.1 when the server resolves names.
mariadb_allow_root() {
    local sock
    sock="$(mariadb_admin_socket)" \
        || die "the MariaDB on $mariadb_host:$mariadb_port refuses root without a password" \
            "over TCP, and no unix socket of it lets the OS root user in to fix that;" \
            "fix its auth or set AIOLEASE_MYSQL_URL"
    log "MariaDB on $mariadb_host:$mariadb_port: giving root an empty password for TCP (via $sock)"
    timeout 30 mariadb --no-defaults -S "$sock" -u root -e "
        CREATE USER IF NOT EXISTS 'root'@'127.0.0.1';
        GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
        ALTER USER 'root'@'localhost'
            IDENTIFIED VIA mysql_native_password USING PASSWORD('') OR unix_socket;" \
        || die "could not change root's authentication through $sock"
}

# mariadb_init_datadir DIR: our datadir, made once (a half-made one is redone).
mariadb_init_datadir() {
    local dir="$1" data="$1/data"
    [ -f "$data/.aiolease-initialized" ] && return 0
    log "creating a MariaDB datadir in $data (log: $dir/install-db.log)"
    rm -rf "$data"
    if ! mariadb-install-db --no-defaults --datadir="$data" --user=root \
        --auth-root-authentication-method=normal --skip-test-db >"$dir/install-db.log" 2>&1; then
        tail -n 20 "$dir/install-db.log" >&2
        die "mariadb-install-db failed (log: $dir/install-db.log)"
    fi
    touch "$data/.aiolease-initialized"
}

svc_mariadb_install() {
    mariadb_installed || apt_install mariadb-server mariadb-client
    mariadb_installed || die "mariadbd, mariadb-install-db or the mariadb client is still missing"
}

svc_mariadb_start() {
    mariadb_installed \
        || die "MariaDB is not installed; run: bash scripts/services.sh install mariadb"
    svc_lock mariadb
    local dir pidfile logfile
    dir="$(svc_dir mariadb)"
    pidfile="$dir/mariadb.pid"
    logfile="$dir/mariadb.log"
    forget_stale_pidfile "$pidfile" "--datadir=$dir/data"
    if pidfile_alive "$pidfile" || port_open "$mariadb_port" "$mariadb_host"; then
        wait_ready "$mariadb_start_timeout" "$logfile" "MariaDB on $mariadb_host:$mariadb_port" \
            mariadb_alive
        mariadb_login_ok || mariadb_allow_root
        wait_ready 10 "$logfile" "MariaDB login as root over TCP" mariadb_login_ok
    else
        rm -f "$pidfile"
        mariadb_init_datadir "$dir"
        log "starting MariaDB on $mariadb_host:$mariadb_port (log: $logfile)"
        printf '\n--- %s: services.sh starts mariadbd\n' "$(date)" >>"$logfile"
        # --user=root: mariadbd refuses to run as root without it. utf8mb4 as
        # Debian's /etc/mysql configures it (MariaDB 10.11's own default is latin1).
        start_daemon "$pidfile" "$logfile" "$mariadb_server" --no-defaults --datadir="$dir/data" \
            --bind-address="$mariadb_host" --port="$mariadb_port" --user=root --skip-name-resolve \
            --socket="$dir/mariadb.sock" --pid-file="$dir/mariadbd.pid" \
            --character-set-server=utf8mb4 --collation-server=utf8mb4_general_ci 9>&-
        wait_started "$mariadb_start_timeout" "$pidfile" "$logfile" MariaDB mariadb_login_ok
    fi
    mariadb_sql 'CREATE DATABASE IF NOT EXISTS test' || die "could not create database test"
    mariadb_ready || die "MariaDB is up but database test is not usable (log: $logfile)"
}

svc_mariadb_stop() {
    svc_lock mariadb
    local dir
    dir="$(svc_dir mariadb)"
    forget_stale_pidfile "$dir/mariadb.pid" "--datadir=$dir/data"
    stop_pidfile "$dir/mariadb.pid" mariadb
}

mariadb_usable() { mariadb_installed && mariadb_ready; }

svc_mariadb_status() {
    local dir
    dir="$(svc_dir mariadb)"
    pidfile_status mariadb "$dir/mariadb.pid" "--datadir=$dir/data" "$mariadb_host" \
        "$mariadb_port" mariadb_usable "no passwordless root login to database test"
}
