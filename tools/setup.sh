#!/usr/bin/env bash
# Sets up everything Thermocline needs on a fresh Debian-like machine, idempotently:
#   system packages: redis-server (the mesh's Redis), docker-compose (checks compose.yaml),
#   prometheus (its promtool checks and unit-tests deploy/prometheus/alerts.yml), make,
#   dict-devil (The Devil's Dictionary, public domain: the text bench/kv_quality.py and its test read)
#   a virtual environment in .venv with the project and its dev tools installed (editable).
# Knobs: THERMOCLINE_VENV (default .venv), THERMOCLINE_TORCH_SPEC (default torch==2.13.0, the CPU build
# this workplace keeps on disk; set e.g. "torch" for the newest build from your index).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${THERMOCLINE_VENV:-.venv}"
torch_spec="${THERMOCLINE_TORCH_SPEC:-torch==2.13.0}"

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v promtool >/dev/null || missing+=(prometheus)
[ -f /usr/share/dictd/devil.dict.dz ] || missing+=(dict-devil)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "installing system packages: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "warning: please install ${missing[*]} (no apt-get here); the tests that need them will fail" >&2
  fi
fi

# deploy/k8s renders with kubectl's built-in kustomize (or kustomize itself); Debian's kubernetes-client
# is too old for the overlays, so it is not installed here: tests/test_k8s.py skips its rendering
# tests without one, and fails them under CI=true.
if ! command -v kubectl >/dev/null && ! command -v kustomize >/dev/null; then
  echo "warning: neither kubectl nor kustomize is installed: deploy/k8s's rendering tests will skip" >&2
fi

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -c "import torch" 2>/dev/null || "$venv/bin/python" -m pip install -q "$torch_spec"
"$venv/bin/python" -m pip install -q -e ".[dev]"
echo "set up: $venv ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
