#!/usr/bin/env bash
# Set up ./.venv (first run only) and run the whole test suite on two workers (pytest-xdist; CI has 2 cores), each
# with one torch thread: the interpreted Triton kernels run many tiny torch / numpy ops, which a second thread per
# worker only slows. `--dist worksteal`: a worker that runs out of tests takes queued ones from the other, so a few
# tests of one to two minutes near the end of one worker's share do not leave the other idle. Extra arguments go to
# pytest.
source "$(dirname "$0")/env.sh" test
export TRITON_INTERPRET=1 PYTHONWARNINGS="ignore::UserWarning:modelopt" OMP_NUM_THREADS=1
exec python -m pytest -n 2 --dist worksteal --durations=20 "$@"
