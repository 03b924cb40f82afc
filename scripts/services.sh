#!/usr/bin/env bash
# Make sure Redis and PostgreSQL answer on this machine at their default ports (127.0.0.1:6379
# and :5432, what OCRQ_BROKER_URL and OCRQ_DATABASE_URL default to); it does not read those
# settings, so for servers elsewhere it is not needed. Where one is not running, start the local
# one, installing Debian's package if missing.
# With --for-tests (scripts/test.sh), also PgBouncer's binary for tests/test_pgbouncer.py.
set -euo pipefail
for_tests=""
[ "${1:-}" = "--for-tests" ] && for_tests=1

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=""
apt_install() {
  if [ -z "$apt_updated" ]; then as_root apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

redis_host=127.0.0.1; redis_port=6379
pg_host=127.0.0.1; pg_port=5432

# The tests start private servers from the binary too (tests/servers.py), also when a Redis
# already answers on the port: a master, its replica, and `redis-server --sentinel` (Debian's
# redis-sentinel package adds only a service unit and a config file to this binary).
command -v redis-server >/dev/null || apt_install redis-server

if ! port_open "$redis_host" "$redis_port"; then
  echo "starting redis-server on $redis_port" >&2
  mkdir -p /tmp/ocrq-redis
  redis-server --daemonize yes --bind 127.0.0.1 --port "$redis_port" --save "" \
    --appendonly no --dir /tmp/ocrq-redis --logfile /tmp/ocrq-redis/redis.log
  for _ in $(seq 50); do port_open "$redis_host" "$redis_port" && break; sleep 0.2; done
fi

if ! port_open "$pg_host" "$pg_port"; then
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    apt_install postgresql
  fi
  ver=$(ls /etc/postgresql | sort -V | tail -n1)
  echo "starting PostgreSQL $ver on $pg_port" >&2
  as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
  for _ in $(seq 100); do port_open "$pg_host" "$pg_port" && break; sleep 0.2; done
  # A fresh Debian cluster asks for a password over TCP: trust local connections, as tests do.
  hba=/etc/postgresql/$ver/main/pg_hba.conf
  if ! grep -q "ocrq-trust" "$hba"; then
    as_root sed -i '1i host all all 127.0.0.1/32 trust # ocrq-trust\nhost all all ::1/128 trust # ocrq-trust' "$hba"
    as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main reload
  fi
fi

# PgBouncer: tests/test_pgbouncer.py starts one of its own in front of PostgreSQL (the setup
# docs/operations.md recommends for GPU hosts); only the binary is needed, never its service.
if [ -n "$for_tests" ] && ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then
  apt_install pgbouncer
fi

port_open "$redis_host" "$redis_port" || { echo "Redis is not reachable on $redis_port" >&2; exit 1; }
port_open "$pg_host" "$pg_port" || { echo "PostgreSQL is not reachable on $pg_port" >&2; exit 1; }
echo "redis and postgresql are up" >&2
