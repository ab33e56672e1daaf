#!/usr/bin/env bash
# Check the in-engine loader against the real SGLang on CPU (see benchmarks/sglang_check.py, docs/sglang.md).
#   bash benchmarks/sglang_check.sh [--sglang-version X] [--no-install] [--strict] ...
# VENV (default /tmp/sglang-check-venv) is created or reused; it takes about 11 GB, outside the repository.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
exec "${PYTHON:-python3}" -m benchmarks.sglang_check --venv "${VENV:-/tmp/sglang-check-venv}" "$@"
