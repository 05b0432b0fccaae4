#!/usr/bin/env bash
# Installs tailserve's build and test dependencies from the distribution's packages (Debian 12 /
# Ubuntu 24.04). Nothing is vendored. The CUDA toolkit is expected at /usr/local/cuda when present.
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config libabsl-dev nlohmann-json3-dev libgtest-dev libgmock-dev
      libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc
      libpcre2-dev libsentencepiece-dev python3-venv libtsan2)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all packages present"
fi
