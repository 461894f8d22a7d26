#!/usr/bin/env bash
# One entry point for users and CI: sets up .venv on first use, then runs a job.
#   bash scripts/run.sh demo     # the main job: plain vs compressed training on bundled data
#   bash scripts/run.sh test     # the test suite (without tests marked slow)
#   bash scripts/run.sh slow     # only the tests marked slow
#   bash scripts/run.sh setup    # only the setup
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ACGC_VENV:-.venv}"
PY="$VENV/bin/python"

setup() {
    [ -x "$PY" ] || python3 -m venv "$VENV"
    local stamp="$VENV/.acgc-setup"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        # torch first and pinned: on a CPU machine this takes the local CPU build;
        # everything after it sees torch satisfied and pulls no CUDA wheels.
        "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
        "$PY" -m pip install -q --disable-pip-version-check -e ".[dev,recipes]"
        if "$PY" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
            echo "setup: CUDA wheels were pulled in; refusing to go on" >&2
            exit 1
        fi
        touch "$stamp"
    fi
}

job="${1:-demo}"
shift || true
setup
case "$job" in
    setup) ;;
    demo) exec "$PY" -m recipes.compare "$@" ;;
    test) exec "$PY" -m pytest -m "not slow" "$@" ;;
    slow) exec "$PY" -m pytest -m slow "$@" ;;
    *) echo "usage: scripts/run.sh {demo|test|slow|setup} [args]" >&2; exit 2 ;;
esac
