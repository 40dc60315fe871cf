#!/usr/bin/env bash
# On the GPU machine: unpack .gpu/bundle.tar.xz (made by tools/gpu/bundle.sh) into .gpu/.
set -euo pipefail
cd "$(dirname "$0")/../.."
if command -v xz >/dev/null; then
  xz -dc .gpu/bundle.tar.xz | tar -xf - -C .gpu
else
  python3 -c "import tarfile; tarfile.open('.gpu/bundle.tar.xz').extractall('.gpu')"
fi
