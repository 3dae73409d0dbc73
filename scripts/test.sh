#!/usr/bin/env bash
# Set up ./.venv (first run only) and run the whole test suite. Extra arguments go to pytest.
source "$(dirname "$0")/env.sh" test
export TRITON_INTERPRET=1 PYTHONWARNINGS="ignore::UserWarning:modelopt"
exec python -m pytest "$@"
