#!/usr/bin/env bash
# The whole test suite (CI runs exactly this through .ci/run). Arguments go to pytest; when some of them are test
# paths (relative to the repository root, e.g. tests/test_config.py or tests/x.py::test_y), only those run.
# Test files run on ARMOR_TEST_WORKERS pytest-xdist workers (default 2), a file's tests on one worker in order (module
# fixtures are built once); most tests run one single-threaded process, so one worker alone leaves a core idle.
# `-n 0` runs everything in this process (e.g. for pdb).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
set +e
selected=0
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then selected=1; fi
done
if [[ $selected -eq 0 ]]; then set -- tests "$@"; fi
.venv/bin/python -m pytest -q -n "${ARMOR_TEST_WORKERS:-2}" --dist loadfile "$@"
code=$?
# pytest exits 5 when it collects no tests; that is not a failure.
if [[ $code -eq 5 ]]; then code=0; fi
exit $code
