#!/usr/bin/env bash
# Installs what building and testing optfuse needs, skipping what is already there:
# Debian packages (compiler, CMake, Ninja, GoogleTest, OpenBLAS) and Python packages (build tools, numpy,
# pytest, matplotlib, torch, expecttest: torch's optim_db, which the tests run, imports it). The
# CUDA toolkit (headers and NVRTC) is expected at /usr/local/cuda or on PATH; no GPU is needed to
# build or to run the CPU tests.
set -euo pipefail

missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
# OpenBLAS: the CPU products of Muon's matrix phase (loaded at run time; src/matrix/gemm_libraries.h).
{ /sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null || true; } | grep -q 'libopenblas\.so\.0' || missing+=(libopenblas0)
command -v python3 >/dev/null || missing+=(python3 python3-pip python3-venv python3-dev)
# The extension needs Python's headers (a Debian python3 has them in python3-dev).
if command -v python3 >/dev/null &&
   [ ! -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; then
  missing+=(python3-dev)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
if ! command -v nvcc >/dev/null && [ ! -f /usr/local/cuda/include/cuda.h ]; then
  echo "setup: the CUDA toolkit (cuda.h, NVRTC) was not found; install it (https://developer.nvidia.com/cuda-downloads)" >&2
  exit 1
fi
# The matrix phase includes cuBLAS's header for its types (the library itself is loaded at run time).
cuda_include="$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")/../include"
[ -f "$cuda_include/cublas_api.h" ] ||
  echo "setup: warning: cublas_api.h is not in $cuda_include; the build needs the CUDA toolkit's cuBLAS headers" >&2

py_missing=()
for mod in nanobind scikit_build_core numpy pytest matplotlib torch expecttest; do
  python3 -c "import $mod" 2>/dev/null || py_missing+=("$mod")
done
if [ ${#py_missing[@]} -gt 0 ]; then
  pkgs=("${py_missing[@]/scikit_build_core/scikit-build-core}")
  echo "setup: installing Python packages: ${pkgs[*]}"
  python3 -m pip install -q "${pkgs[@]}"
fi
# timm.optim (Lamb, Lars) is the reference of optfuse.torch.Lamb/Lars; installed after torch so that
# pip picks the torchvision built for that torch.
if ! python3 -c "import timm.optim" 2>/dev/null; then
  echo "setup: installing Python packages: timm"
  python3 -m pip install -q timm
fi
# lion-pytorch: a third-party optimizer fuse() traces in the tests (no dependencies beyond torch).
python3 -c "import lion_pytorch" 2>/dev/null || { echo "setup: installing Python packages: lion-pytorch"; python3 -m pip install -q lion-pytorch; }
# pytorch-optimizer and schedulefree: more third-party optimizers fuse() is checked against (match or
# refused). Their only dependencies (torch, numpy, typing-extensions) come with torch, so they are
# installed with --no-deps: installing them must never move torch to another version.
python3 -c "import pytorch_optimizer" 2>/dev/null || { echo "setup: installing Python packages: pytorch-optimizer"; python3 -m pip install -q --no-deps pytorch-optimizer; }
python3 -c "import schedulefree" 2>/dev/null || { echo "setup: installing Python packages: schedulefree"; python3 -m pip install -q --no-deps schedulefree; }
