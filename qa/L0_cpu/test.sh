#!/usr/bin/env bash
# CPU test set (what CI runs): every test under tests/, GPU ones skip.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -m pytest -n "${PYTEST_WORKERS:-2}" -q -p no:cacheprovider tests "$@"
