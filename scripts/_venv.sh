# Sourced by up.sh and test.sh: make .venv (if missing) and install the project into it.
# Usage: ensure_venv EXTRAS   (e.g. "engine" or "engine,test")
ensure_venv() {
    local extras="$1"
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    VENV="${BATON_VENV:-$root/.venv}"
    if [ ! -x "$VENV/bin/python" ]; then
        python3 -m venv "$VENV"
    fi
    local stamp="$VENV/.baton-installed-$extras"
    if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
        # CPU machines: the pinned CPU wheel. A GPU machine installs its own torch first.
        if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
            "$VENV/bin/pip" install -q "torch==2.13.0"
        fi
        "$VENV/bin/pip" install -q -e "$root[$extras]"
        touch "$stamp"
    fi
    # The router's hot modules compiled for these sources (services/router/native.py): a
    # second or two when built already; where they cannot be, the sources run.
    if ! "$VENV/bin/python" -m services.router.native_build > "$VENV/.baton-native-build.log" 2>&1; then
        echo "note: the router runs its source modules: $(tail -n 1 "$VENV/.baton-native-build.log")" >&2
    fi
}
