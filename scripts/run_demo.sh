#!/usr/bin/env bash
# The main job: a tiny ARMOR run with tensor parallel size 2 on CPU (extra args go to `armor train`).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec .venv/bin/armor train --config examples/tiny/armor.yaml --nproc 2 --run-dir "${RUN_DIR:-runs/tiny-armor}" "$@"
