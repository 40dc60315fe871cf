#!/usr/bin/env bash
# Installs slidedp as a systemd service on this machine: binaries, units, example config, the
# slidedp system user/group. Idempotent; an existing /etc/slidedp/hostd.yaml is kept.
#
#   sudo deploy/install.sh [--build-dir build] [--prefix /usr/local] [--gpus N|auto] [--no-enable]
#   sudo deploy/install.sh --uninstall [--purge]     # --purge also removes /etc/slidedp and /var/lib/slidedp
#   deploy/install.sh --verify-only                  # systemd-analyze verify the units (no root needed)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build_dir="$here/../build"
prefix=/usr/local
gpus=auto
enable=1
action=install
purge=0
unit_dir=/etc/systemd/system

while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) build_dir="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    --gpus) gpus="$2"; shift 2 ;;
    --no-enable) enable=0; shift ;;
    --uninstall) action=uninstall; shift ;;
    --purge) purge=1; shift ;;
    --verify-only) action=verify; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

units=(slidedp-hostd.service slidedp-worker@.service slidedp.target)

# Units reference /usr/local/bin; rewrite for another prefix.
render_unit() {
  sed "s#/usr/local/bin/#${prefix}/bin/#g; s#/usr/local/share/#${prefix}/share/#g" "$here/$1"
}

verify_units() {
  if ! command -v systemd-analyze >/dev/null; then
    echo "systemd-analyze not found; skipping verification"
    return 0
  fi
  local tmp
  tmp="$(mktemp -d)"
  for u in "${units[@]}"; do render_unit "$u" >"$tmp/$u"; done
  cp "$tmp/slidedp-worker@.service" "$tmp/slidedp-worker@0.service"
  # verify wants the ExecStart binaries to exist; point it at stand-ins when not installed yet.
  if [[ ! -x "$prefix/bin/slidedp-hostd" ]]; then
    mkdir -p "$tmp/bin"
    for b in slidedp-hostd slidedp-worker; do printf '#!/bin/sh\n' >"$tmp/bin/$b"; chmod +x "$tmp/bin/$b"; done
    sed -i "s#${prefix}/bin/#$tmp/bin/#g" "$tmp"/*.service
  fi
  (cd "$tmp" && SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=no \
      ./slidedp-hostd.service ./slidedp-worker@0.service ./slidedp.target)
  local rc=$?
  rm -rf "$tmp"
  return $rc
}

need_root() {
  if [[ $EUID -ne 0 ]]; then echo "install.sh: run as root (sudo)" >&2; exit 1; fi
}

count_gpus() {
  if [[ "$gpus" != auto ]]; then echo "$gpus"; return; fi
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || echo 0
  elif [[ -x "$prefix/bin/slidedp-worker" ]]; then
    "$prefix/bin/slidedp-worker" --count-gpus 2>/dev/null || echo 0
  else
    echo 0
  fi
}

install_all() {
  need_root
  for b in slidedp-hostd slidedp-worker slidedp; do
    [[ -x "$build_dir/bin/$b" ]] || { echo "install.sh: $build_dir/bin/$b not built" >&2; exit 1; }
  done
  getent group slidedp >/dev/null || groupadd --system slidedp
  getent passwd slidedp >/dev/null ||
    useradd --system --gid slidedp --home-dir /var/lib/slidedp --no-create-home --shell /usr/sbin/nologin \
      --comment "slidedp training service" slidedp
  # GPU device nodes are group video on some distributions.
  getent group video >/dev/null && usermod -a -G video slidedp || true

  # Stop a running node first: SIGTERM makes hostd drain (see docs/operations.md, "Upgrade").
  local was_active=0
  if systemctl is-active --quiet slidedp-hostd.service 2>/dev/null; then
    was_active=1
    echo "stopping slidedp (hostd drains the running job)..."
    systemctl stop slidedp.target 'slidedp-worker@*.service' slidedp-hostd.service
  fi

  install -d -m 0755 "$prefix/bin" "$prefix/share/doc/slidedp"
  for b in slidedp-hostd slidedp-worker slidedp; do
    install -m 0755 "$build_dir/bin/$b" "$prefix/bin/$b.new"
    mv -f "$prefix/bin/$b.new" "$prefix/bin/$b"  # atomic replace: a running binary is never truncated
  done
  [[ -f "$here/../docs/operations.md" ]] && install -m 0644 "$here/../docs/operations.md" "$prefix/share/doc/slidedp/"

  install -d -m 0750 -o root -g slidedp /etc/slidedp
  if [[ -f /etc/slidedp/hostd.yaml ]]; then
    install -m 0640 -o root -g slidedp "$here/hostd.yaml" /etc/slidedp/hostd.yaml.example
    echo "kept /etc/slidedp/hostd.yaml (new example: /etc/slidedp/hostd.yaml.example)"
  else
    install -m 0640 -o root -g slidedp "$here/hostd.yaml" /etc/slidedp/hostd.yaml
  fi

  for u in "${units[@]}"; do
    render_unit "$u" >"$unit_dir/$u.tmp"
    chmod 0644 "$unit_dir/$u.tmp"
    mv -f "$unit_dir/$u.tmp" "$unit_dir/$u"
  done
  systemctl daemon-reload

  if [[ $enable -eq 1 ]]; then
    local n
    n="$(count_gpus)"
    systemctl enable slidedp.target slidedp-hostd.service
    for ((i = 0; i < n; i++)); do systemctl enable "slidedp-worker@$i.service"; done
    echo "enabled hostd and $n GPU worker(s)"
  fi
  if [[ $was_active -eq 1 ]]; then systemctl start slidedp.target; fi
  echo "installed. start: systemctl start slidedp.target; logs: journalctl -u slidedp-hostd -f"
}

uninstall_all() {
  need_root
  systemctl stop slidedp.target 'slidedp-worker@*.service' slidedp-hostd.service 2>/dev/null || true
  systemctl disable slidedp.target slidedp-hostd.service 2>/dev/null || true
  for f in "$unit_dir"/multi-user.target.wants/slidedp.target "$unit_dir"/slidedp.target.wants/slidedp-worker@*.service; do
    [[ -e "$f" || -L "$f" ]] && rm -f "$f"
  done
  rm -rf "$unit_dir/slidedp.target.wants"
  for u in "${units[@]}"; do rm -f "$unit_dir/$u"; done
  systemctl daemon-reload
  rm -f "$prefix/bin/slidedp-hostd" "$prefix/bin/slidedp-worker" "$prefix/bin/slidedp"
  rm -rf "$prefix/share/doc/slidedp"
  # hostd unlinks its segments on a clean stop; remove leftovers of a crashed one.
  # (only the service user's: embedded `slidedp run` sessions of other users are left alone).
  getent passwd slidedp >/dev/null && find /dev/shm -maxdepth 1 -name 'slidedp.*' -user slidedp -delete 2>/dev/null || true
  if [[ $purge -eq 1 ]]; then
    rm -rf /etc/slidedp /var/lib/slidedp /run/slidedp
    getent passwd slidedp >/dev/null && userdel slidedp || true
    getent group slidedp >/dev/null && groupdel slidedp || true
  fi
  echo "uninstalled"
}

case "$action" in
  install) verify_units; install_all ;;
  uninstall) uninstall_all ;;
  verify) verify_units ;;
esac
