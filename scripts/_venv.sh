# Sourced by the run scripts: find Python 3.12, create/reuse .venv, install the package when setup.py changed.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

find_python312() {
    if [[ -n "${ARMOR_PYTHON:-}" ]]; then echo "$ARMOR_PYTHON"; return; fi
    if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' >/dev/null 2>&1; then
        command -v python3.12; return
    fi
    if command -v pyenv >/dev/null 2>&1; then
        local root candidate
        root="$(pyenv root)"
        candidate="$(ls -d "$root"/versions/3.12*/bin/python3 2>/dev/null | sort -V | tail -n 1 || true)"
        if [[ -n "$candidate" ]]; then echo "$candidate"; return; fi
    fi
    return 1
}

if [[ ! -x .venv/bin/python ]]; then
    if ! PY="$(find_python312)"; then
        echo "error: Python 3.12 is required (megatron-core >= 0.17 needs it) and was not found." >&2
        echo "Install it (e.g. 'pyenv install 3.12' or your package manager's python3.12)," >&2
        echo "or point ARMOR_PYTHON=/path/to/python3.12 at one." >&2
        exit 1
    fi
    echo "[setup] creating .venv with $PY"
    "$PY" -m venv .venv
fi

STAMP=".venv/.armor-install-$(sha256sum setup.py | cut -c1-16)"
if [[ ! -f "$STAMP" ]]; then
    echo "[setup] installing megatron-armor and its dependencies into .venv (first run: a few minutes; log: .venv/install.log)"
    if ! { .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install -e .; } > .venv/install.log 2>&1; then
        tail -n 40 .venv/install.log >&2
        echo "error: installing into .venv failed (full log: .venv/install.log)" >&2
        exit 1
    fi
    rm -f .venv/.armor-install-*
    touch "$STAMP"
fi
