# Sourced by the scripts: create .venv (or $STORAGED_VENV) and install the package with extras.
VENV="${STORAGED_VENV:-$PWD/.venv}"
ensure_venv() {
  local extras="$1" stamp
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
  fi
  # Reinstall only when pyproject.toml, the test constraints or the extras changed.
  stamp="$VENV/.storaged-$(cat pyproject.toml scripts/test-constraints.txt | sha256sum | cut -c1-16)-${extras//,/_}"
  if [ ! -f "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q -e ".[$extras]" -c scripts/test-constraints.txt
    touch "$stamp"
  fi
}

# Debian's etcd-server, for the etcd coordinator (storaged up --coordinator etcd, its tests):
# installed when missing and we may (root, apt-get present); otherwise say so and go on
# (storaged up then refuses in one line, the etcd tests skip saying why).
ensure_etcd() {
  if command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ]; then
    return 0
  fi
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client) >&2 \
      || echo "$(basename "$0"): could not install etcd-server" >&2
  else
    echo "$(basename "$0"): etcd is not installed (apt-get install etcd-server, as root)" >&2
  fi
}

# Debian's OpenStack Swift and memcached, the S3-compatible server the archive tier's tests
# start (tests/s3server.py): installed when missing and we may (root, apt-get present);
# otherwise say so and go on (those tests skip saying why).
ensure_swift() {
  if command -v swift-proxy-server >/dev/null 2>&1 && command -v memcached >/dev/null 2>&1; then
    return 0
  fi
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      swift swift-proxy swift-account swift-container swift-object python3-swift memcached) >&2 \
      || echo "$(basename "$0"): could not install swift and memcached" >&2
  else
    echo "$(basename "$0"): swift is not installed (apt-get install swift swift-proxy swift-account swift-container swift-object memcached, as root)" >&2
  fi
}
