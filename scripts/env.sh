# Sourced by scripts/test.sh and scripts/demo.sh: make ./.venv with everything dsv4 needs, then activate it.
# torch 2.13.0 goes in first: an unpinned torch requirement would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
stamp=".venv/.dsv4-installed${extras:+-$extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    python -m pip install -q --upgrade pip >/dev/null
    python -m pip install -q "torch==2.13.0"
    python -m pip install -q -e ".${extras:+[$extras]}"
    touch "$stamp"
fi
