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
