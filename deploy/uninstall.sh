#!/usr/bin/env bash
# deploy/uninstall.sh: remove what deploy/install.sh installed.
#
#   sudo deploy/uninstall.sh            stop + disable the service, remove the unit,
#                                       binaries (and their .prev copies), PREFIX/share/specd,
#                                       PREFIX/share/doc/specd; daemon-reload
#   sudo deploy/uninstall.sh --purge    also /etc/specd (env file, API key), /var/lib/specd
#                                       (models!) and the specd user and group
#   deploy/uninstall.sh --dry-run       print every action, change nothing
#   deploy/uninstall.sh --root /tmp/r   undo a staged install (no systemctl, no user)
#
# Kept without --purge: /etc/specd/specd.env, /etc/specd/api-key, /var/lib/specd
# (with the models under it) and the user specd, so a reinstall picks up the same
# configuration. Shared directories that existed before (PREFIX/bin,
# /etc/systemd/system) are never removed, even when empty.
# Every action is printed as "+ ..." before it runs.
set -euo pipefail

PREFIX=/usr/local
ROOT=
DRY=0
SYSTEMD=1
PURGE=0

while [ $# -gt 0 ]; do
    case "$1" in
    --prefix) PREFIX=${2:?--prefix needs a value}; shift 2 ;;
    --prefix=*) PREFIX=${1#*=}; shift ;;
    --root) ROOT=${2:?--root needs a value}; shift 2 ;;
    --root=*) ROOT=${1#*=}; shift ;;
    --dry-run) DRY=1; shift ;;
    --no-systemd) SYSTEMD=0; shift ;;
    --purge) PURGE=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        echo "options: --prefix DIR, --root DIR, --dry-run, --no-systemd, --purge"; exit 0 ;;
    *) echo "uninstall.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$PREFIX" in /*) ;; *) echo "uninstall.sh: --prefix must be absolute: $PREFIX" >&2; exit 2 ;; esac
PREFIX=${PREFIX%/}
MANAGE_USER=1
if [ -n "$ROOT" ]; then
    case "$ROOT" in /*) ;; *) ROOT=$(pwd)/$ROOT ;; esac
    ROOT=${ROOT%/}
    [ "$ROOT" != "" ] || { echo "uninstall.sh: --root / is the real system: omit --root instead" >&2; exit 2; }
    SYSTEMD=0
    MANAGE_USER=0
elif [ "$(id -u)" != 0 ] && [ "$DRY" = 0 ]; then
    echo "uninstall.sh: removing from the system needs root (or --root DIR for a staged install)" >&2
    exit 1
fi

act() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    [ "$DRY" = 1 ] || "$@"
}
note() { printf '= %s\n' "$*"; }
rm_file() { if [ -e "$1" ] || [ -L "$1" ]; then act rm -f "$1"; fi; }
rm_tree() { if [ -e "$1" ]; then act rm -rf "$1"; fi; }
rmdir_empty() { if [ -d "$1" ] && [ -z "$(ls -A "$1")" ]; then act rmdir "$1"; fi; }

R=$ROOT
UNIT=$R/etc/systemd/system/specd.service

if [ "$SYSTEMD" = 1 ] && command -v systemctl >/dev/null && [ -e "$UNIT" ]; then
    # stop drains in-flight requests (SIGTERM, up to TimeoutStopSec)
    act systemctl disable --now specd.service
fi
rm_file "$UNIT"
if [ -d "$UNIT.d" ]; then note "keeping drop-ins in $UNIT.d (yours)"; fi
if [ "$SYSTEMD" = 1 ] && command -v systemctl >/dev/null; then act systemctl daemon-reload; fi

for b in specd specd-bench; do
    rm_file "$R$PREFIX/bin/$b"
    rm_file "$R$PREFIX/bin/$b.prev"
done
rm_tree "$R$PREFIX/share/specd"
rm_tree "$R$PREFIX/share/doc/specd"

if [ "$PURGE" = 1 ]; then
    rm_tree "$R/etc/specd"
    rm_tree "$R/var/lib/specd"
    if [ "$MANAGE_USER" = 1 ]; then
        if getent passwd specd >/dev/null; then act userdel specd; fi
        if getent group specd >/dev/null; then act groupdel specd; fi
    fi
else
    # an install that never got its env file written leaves nothing to keep
    rmdir_empty "$R/var/lib/specd/models"
    rmdir_empty "$R/var/lib/specd"
    rmdir_empty "$R/etc/specd"
    note "kept: $R/etc/specd (env file, API key), $R/var/lib/specd (models), user specd; --purge removes them"
fi
note "done"
