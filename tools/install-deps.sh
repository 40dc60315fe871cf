#!/usr/bin/env bash
# Installs every build dependency from Debian packages (idempotent; skips what is present).
# CUDA (nvcc, cuBLASLt, NCCL) comes from /usr/local/cuda where present; without it the build
# has the CPU backend only.
set -euo pipefail
pkgs=(
  cmake ninja-build ccache pkg-config g++
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libboost-dev libhwloc-dev libgoogle-glog-dev
  libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libpcre2-dev libicu-dev libsystemd-dev
  libgtest-dev libgmock-dev libbenchmark-dev python3 openssl coinor-libcbc-dev libcairo2-dev libgloo-dev
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
