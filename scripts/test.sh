#!/usr/bin/env bash
# The whole check, as CI runs it: servers, a virtualenv, the tests, mypy, ruff.
#
#   bash scripts/test.sh [pytest args...]
#
# Idempotent and runnable from any directory. Every async test runs under both
# asyncio and trio (the tests parametrise that themselves). Extra arguments go to
# pytest, e.g. `bash scripts/test.sh -k sqlite -x`. Exits non-zero if any step
# fails, including when pytest collects no tests.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
venv="$repo/.venv"

step() { printf '\n==> [%4ss] %s\n' "$SECONDS" "$*"; }

# python3-venv must be there before a virtualenv can be made.
step "services: install"
bash scripts/services.sh install

if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    step "creating $venv"
    # A half-made venv (e.g. from before python3-venv was installed) lacks pip.
    rm -rf "$venv"
    python3 -m venv "$venv"
fi

step "installing aiolease[all,test,dev,docs] (editable)"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[all,test,dev,docs]'

step "services: start"
bash scripts/services.sh start

failed=()

step "pytest $*"
set +e
# Two workers (pytest-xdist): most of a test is waiting on a server or a ttl. Tests
# that kill a server stay on one worker each (tests/conftest.py, SERVER_GROUPS).
"$venv/bin/python" -m pytest -n 2 "$@"
rc=$?
set -e
case $rc in
    0) ;;
    5) failed+=("pytest (exit 5: no tests were collected)") ;;
    *) failed+=("pytest (exit $rc)") ;;
esac

step "mypy"
"$venv/bin/python" -m mypy || failed+=("mypy")

step "ruff check"
"$venv/bin/python" -m ruff check . || failed+=("ruff")

step "ruff format --check"
"$venv/bin/python" -m ruff format --check aiolease tests benchmarks docs/examples || failed+=("ruff format")

echo
echo "test.sh: took ${SECONDS}s"
if [ ${#failed[@]} -eq 0 ]; then
    echo "test.sh: OK: pytest, mypy, ruff and ruff format passed"
else
    summary="$(printf '%s, ' "${failed[@]}")"
    echo "test.sh: FAILED: ${summary%, }"
    exit 1
fi
