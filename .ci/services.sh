#!/usr/bin/env bash
# Sourced by .ci/run: install and start what the service tests use beyond Python packages.
# - PostgreSQL (Debian's packages) on 127.0.0.1:55432 -> TAGPLAN_TEST_DATABASE_URL
# - Chromium (Debian's packages) for the web view's headless smoke test
# - Node.js (Debian's nodejs) to run app.js's pure functions in a unit test
# Each step is best effort: when a package cannot be installed, the tests that need it skip with
# a reason saying so, and the rest of the suite still runs.

apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  local sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo -n"
  $sudo apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null 2>&1
}

pg_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do [ -x "$d/initdb" ] && { echo "$d"; return 0; }; done
  return 1
}

start_postgres() {
  local bin data=/tmp/tagplan-ci-pg port=55432 run_as=""
  bin=$(pg_bin) || { apt_install postgresql && bin=$(pg_bin); } || { echo "CI: PostgreSQL unavailable; its tests skip"; return 0; }
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd -r postgres >/dev/null 2>&1 || true
    run_as="runuser -u postgres --"
  fi
  rm -rf "$data" && mkdir -p "$data" && { [ -z "$run_as" ] || chown postgres "$data"; }
  $run_as "$bin/initdb" -D "$data" -U postgres -A trust >/dev/null || { echo "CI: initdb failed; PostgreSQL tests skip"; return 0; }
  $run_as "$bin/pg_ctl" -D "$data" -o "-p $port -k /tmp -c listen_addresses=127.0.0.1" -l "$data/log" -w start >/dev/null \
    || { echo "CI: PostgreSQL did not start; its tests skip"; return 0; }
  "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres tagplan
  export TAGPLAN_TEST_DATABASE_URL="postgresql+psycopg://postgres@127.0.0.1:$port/tagplan"
  echo "CI: PostgreSQL on 127.0.0.1:$port"
}

install_chromium() {
  command -v chromium >/dev/null 2>&1 || apt_install chromium || echo "CI: chromium unavailable; the browser test skips"
}

install_node() {
  command -v node >/dev/null 2>&1 || apt_install nodejs || echo "CI: node unavailable; app.js's deviceRuns unit check skips"
}

start_postgres
install_chromium
install_node
