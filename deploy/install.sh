#!/usr/bin/env bash
# The one install recipe of the dipaco image: deploy/Dockerfile runs it in its build stage, and
# tests/deploy/test_install.py runs it in a fresh virtual environment on every test run.
#
#   deploy/install.sh [--venv DIR] [--torch cpu|cuda|none] [--extras LIST] [SOURCE]
#
#   --venv DIR      virtual environment to create, or to reuse when DIR/bin/python exists (default /opt/dipaco/venv)
#   --torch KIND    cpu:  torch==$TORCH_VERSION from the PyTorch CPU index (no CUDA libraries; the default)
#                   cuda: torch==$TORCH_VERSION from PyPI, the build that bundles the CUDA runtime (needs only the
#                         host's NVIDIA driver); TORCH_INDEX_URL picks another CUDA build, e.g. .../whl/cu128
#                   none: leave torch to the project's own requirement (an environment that already has it)
#   --extras LIST   extras of the project, comma-separated (default s3: boto3 for an S3 blob store)
#   SOURCE          the project: a source directory or a built wheel (default: the checkout holding this script)
#
# pip's own environment variables are honoured as usual (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX,
# PIP_CACHE_DIR, ...): an air-gapped build points them at a wheel directory.
set -euo pipefail

# Kept in step with the Makefile's pin (tests/deploy/test_install.py checks).
TORCH_VERSION=2.13.0
CPU_INDEX_URL=https://download.pytorch.org/whl/cpu

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv=/opt/dipaco/venv
torch=cpu
extras=s3
source="$(dirname "$here")"

usage() { sed -n '4,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) venv="$2"; shift 2 ;;
        --torch) torch="$2"; shift 2 ;;
        --extras) extras="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "install.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) source="$1"; shift ;;
    esac
done
case "$torch" in cpu|cuda|none) ;; *) echo "install.sh: --torch must be cpu, cuda or none, got '$torch'" >&2; exit 2 ;; esac
[ -e "$source" ] || { echo "install.sh: no project at $source" >&2; exit 2; }

step() { echo "install.sh: $*" >&2; }

# 1. the environment (reused when it exists, so a caller may prepare one)
if [ ! -x "$venv/bin/python" ]; then
    step "creating $venv"
    "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --no-input --disable-pip-version-check)

# 2. the pinned torch build first: an unpinned `torch` pulled by the project would be the multi-GB CUDA build
case "$torch" in
    cpu)
        step "torch==$TORCH_VERSION (CPU build)"
        "${pip[@]}" --index-url "${TORCH_INDEX_URL:-$CPU_INDEX_URL}" "torch==$TORCH_VERSION" ;;
    cuda)
        step "torch==$TORCH_VERSION (CUDA build)"
        "${pip[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION" ;;
    none) step "torch: left to the project's requirement" ;;
esac

# 3. the project (not editable: the image holds no source tree) with its extras
step "dipaco from $source${extras:+ [$extras]}"
"${pip[@]}" "$source${extras:+[$extras]}"

# 4. the one entrypoint of every role
install -m 0755 "$here/entrypoint.sh" "$venv/bin/dipaco-entrypoint"

# 5. the installed command starts
"$venv/bin/dipaco" --help > /dev/null
step "done: $venv/bin/dipaco, $venv/bin/dipaco-entrypoint"
