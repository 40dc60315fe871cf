#!/usr/bin/env bash
# On the GPU machine: unpack .gpu/bundle.tar.xz (made by tools/gpu/bundle.sh) into .gpu/ and mark
# it done (.gpu/.unpacked, which tools/gpu/suite_lib.sh compares with the archive's time).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .gpu/bin .gpu/lib .gpu/tests
if command -v xz >/dev/null; then
  xz -dc .gpu/bundle.tar.xz | tar -xf - -C .gpu
else
  python3 -c "import tarfile; tarfile.open('.gpu/bundle.tar.xz').extractall('.gpu')"
fi
touch .gpu/.unpacked
