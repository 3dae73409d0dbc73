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
fresh() { [ -f "$1" ] && [ ! pyproject.toml -nt "$1" ]; }
# The test extras include everything the plain install has.
if ! fresh "$stamp" && ! { [ -z "$extras" ] && fresh .venv/.dsv4-installed-test; }; then
    log=.venv/install.log
    if ! { python -m pip install -q "torch==2.13.0" && python -m pip install -q -e ".${extras:+[$extras]}"; } >"$log" 2>&1; then
        cat "$log" >&2
        echo "dsv4: installing into .venv failed (log above, also in $log)" >&2
        exit 1
    fi
    touch "$stamp"
fi
