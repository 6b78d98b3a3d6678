#!/usr/bin/env bash
# Fetches, here (where pip reaches an index), the wheels that a GPU machine without a package index
# lacks for maxtrain: grain (+ array-record, portpicker), tensorboardX and jax-triton. They go in
# .whl/ (ignored by git); bench/gpu_check.sh installs them from there when the folder exists, so a
# device call names `.whl` in its carry. Built for CPython 3.12 on x86-64 (that machine's python3).
#
#   bash bench/gpu_wheels.sh [DIR]        # default .whl; about 5 MB
#
# jax-triton is pinned at 0.3.1: 0.4 needs triton >= 3.7, and such images carry triton 3.6.
# --no-deps: the image has the rest (absl, etils, cloudpickle, protobuf, psutil, numpy). Keep one
# Python version's wheels in DIR: pip refuses the whole install otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PY_VERSION="${PY_VERSION:-3.12}"
WHEELS=(grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5 jax-triton==0.3.1)
mkdir -p "$DIR"
if [ "$DIR" = .whl ] && [ -d .git ] && ! grep -qx '/.whl/' .git/info/exclude 2>/dev/null; then
  mkdir -p .git/info && echo '/.whl/' >>.git/info/exclude
fi
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
for w in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${platforms[@]}" -d "$DIR" "$w" 2>&1 | grep -v '^WARNING: Location' || true
  name="${w%%==*}"
  name="${name//-/_}"
  shopt -s nocaseglob
  compgen -G "$DIR/${name}-${w##*==}-*.whl" >/dev/null || { echo "gpu_wheels: could not fetch $w" >&2; exit 1; }
  shopt -u nocaseglob
done
ls -l "$DIR"
