#!/usr/bin/env bash
# deploy/install.sh: build specd and install it as a systemd service.
#
#   sudo deploy/install.sh                  build (cmake Release), install to /usr/local,
#                                           create user specd, install the unit, keep or
#                                           create /etc/specd/specd.env, daemon-reload
#   deploy/install.sh --dry-run             print every action, change nothing
#   deploy/install.sh --root /tmp/r --no-build --build-dir build
#                                           stage into /tmp/r (no user, no chown, no
#                                           systemctl): how the tests run it, no root needed
#   sudo deploy/install.sh --rollback       swap PREFIX/bin/specd and specd.prev
#
# What it installs (R = --root, empty by default; P = --prefix, /usr/local):
#   R/P/bin/specd, R/P/bin/specd-bench     (a replaced binary is kept as *.prev)
#   R/P/share/specd/env/*.env              the example env files (deploy/env/)
#   R/P/share/specd/heads/NAME/            draft heads committed under draft/heads/
#   R/P/share/doc/specd/README.md          deploy/README.md
#   R/etc/systemd/system/specd.service     deploy/specd.service, /usr/local -> P
#   R/etc/specd/specd.env                  only if absent (never overwritten), from
#                                          --env (default smollm2-cpu), /usr/local -> P
#   R/etc/specd/api-key                    only if absent: 32 random bytes as hex, 0640
#   R/var/lib/specd, R/var/lib/specd/models   state and model directories
# Idempotent: a second run with the same build changes nothing (files are compared
# before they are written; an unchanged binary does not become *.prev).
# Every action is printed as "+ ..." before it runs.
set -euo pipefail

SRC=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=/usr/local
ROOT=
DRY=0
SYSTEMD=1
BUILD_STEP=1
BUILD_DIR=
ENV_NAME=smollm2-cpu
JOBS=$(nproc 2>/dev/null || echo 2)
ROLLBACK=0

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    cat <<EOF
options:
  --prefix DIR      install prefix (default /usr/local)
  --root DIR        stage everything under DIR; implies --no-systemd, no user, no chown
  --dry-run         print the actions, change nothing
  --no-systemd      do not run systemctl (containers, staging)
  --no-build        do not build; take the binaries from --build-dir
  --build-dir DIR   cmake build directory (default SRC/build-release)
  --env NAME|FILE   env file for a first install: a name in deploy/env/ or a path
                    (default smollm2-cpu)
  --jobs N          parallel build jobs (default nproc)
  --rollback        swap each binary with its .prev copy (then: systemctl restart specd)
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
    --prefix) PREFIX=${2:?--prefix needs a value}; shift 2 ;;
    --prefix=*) PREFIX=${1#*=}; shift ;;
    --root) ROOT=${2:?--root needs a value}; shift 2 ;;
    --root=*) ROOT=${1#*=}; shift ;;
    --dry-run) DRY=1; shift ;;
    --no-systemd) SYSTEMD=0; shift ;;
    --no-build) BUILD_STEP=0; shift ;;
    --build-dir) BUILD_DIR=${2:?--build-dir needs a value}; shift 2 ;;
    --build-dir=*) BUILD_DIR=${1#*=}; shift ;;
    --env) ENV_NAME=${2:?--env needs a value}; shift 2 ;;
    --env=*) ENV_NAME=${1#*=}; shift ;;
    --jobs) JOBS=${2:?--jobs needs a value}; shift 2 ;;
    --rollback) ROLLBACK=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "install.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
done

case "$PREFIX" in /*) ;; *) echo "install.sh: --prefix must be absolute: $PREFIX" >&2; exit 2 ;; esac
PREFIX=${PREFIX%/}
[ -n "$PREFIX" ] || PREFIX=/
if [ -n "$ROOT" ]; then
    case "$ROOT" in /*) ;; *) ROOT=$(pwd)/$ROOT ;; esac
    ROOT=${ROOT%/}
    [ "$ROOT" != "" ] || { echo "install.sh: --root / is the real system: omit --root instead" >&2; exit 2; }
    SYSTEMD=0
fi
BUILD_DIR=${BUILD_DIR:-$SRC/build-release}
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR=$(pwd)/$BUILD_DIR ;; esac

# Ownership: only a real install as root creates the user and chowns.
AS_ROOT=0
[ "$(id -u)" = 0 ] && AS_ROOT=1
MANAGE_USER=0
if [ -z "$ROOT" ]; then
    if [ "$AS_ROOT" = 0 ] && [ "$DRY" = 0 ]; then
        echo "install.sh: installing into the system needs root (or stage with --root DIR)" >&2
        exit 1
    fi
    MANAGE_USER=1
fi

act() { # act CMD ARGS...: print, then run unless --dry-run
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    [ "$DRY" = 1 ] || "$@"
}
note() { printf '= %s\n' "$*"; }

# own MODE OWNER:GROUP PATH: chmod always; chown only when managing the user
own() {
    act chmod "$1" "$3"
    if [ "$MANAGE_USER" = 1 ]; then act chown "$2" "$3"; fi
}

mkdir_own() { # mkdir_own MODE OWNER:GROUP DIR
    if [ -d "$3" ]; then
        local m
        m=$(stat -c '%a' "$3")
        [ "$m" = "${1#0}" ] || act chmod "$1" "$3"
        if [ "$MANAGE_USER" = 1 ] && [ "$(stat -c '%U:%G' "$3")" != "$2" ]; then act chown "$2" "$3"; fi
    else
        act install -d -m "$1" "$3"
        if [ "$MANAGE_USER" = 1 ]; then act chown "$2" "$3"; fi
    fi
}

# put_file MODE SRC DST [PREV]: install SRC as DST unless identical; PREV=1 keeps the old DST as DST.prev
put_file() {
    local mode=$1 src=$2 dst=$3 prev=${4:-0}
    if [ -f "$dst" ] && cmp -s "$src" "$dst"; then
        [ "$(stat -c '%a' "$dst")" = "${mode#0}" ] || act chmod "$mode" "$dst"
        note "unchanged $dst"
        return 0
    fi
    if [ "$prev" = 1 ] && [ -f "$dst" ]; then act mv -f "$dst" "$dst.prev"; fi
    act install -m "$mode" "$src" "$dst"
}

# put_subst MODE SRC DST: SRC with /usr/local replaced by PREFIX, written only if different
put_subst() {
    local mode=$1 src=$2 dst=$3
    if [ -f "$dst" ] && subst <"$src" | cmp -s - "$dst"; then
        [ "$(stat -c '%a' "$dst")" = "${mode#0}" ] || act chmod "$mode" "$dst"
        note "unchanged $dst"
        return 0
    fi
    printf '+ sed s#/usr/local#%s#g %q > %q && chmod %s %q\n' "$PREFIX" "$src" "$dst" "$mode" "$dst"
    if [ "$DRY" = 0 ]; then
        subst <"$src" >"$dst.tmp.$$"
        chmod "$mode" "$dst.tmp.$$"
        mv -f "$dst.tmp.$$" "$dst"
    fi
}
subst() { if [ "$PREFIX" = /usr/local ]; then cat; else sed "s#/usr/local#${PREFIX}#g"; fi; }

R=$ROOT
BIN=$R$PREFIX/bin
SHARE=$R$PREFIX/share/specd
DOC=$R$PREFIX/share/doc/specd
ETC=$R/etc/specd
UNIT_DIR=$R/etc/systemd/system
STATE=$R/var/lib/specd

MODE=install
[ "$DRY" = 1 ] && MODE="dry run (nothing is changed)"
note "specd $MODE: src $SRC, prefix $PREFIX${ROOT:+, root $ROOT}"

# ---- rollback: swap binary <-> .prev ----
if [ "$ROLLBACK" = 1 ]; then
    found=0
    for b in specd specd-bench; do
        if [ -f "$BIN/$b.prev" ]; then
            found=1
            act mv -f "$BIN/$b" "$BIN/$b.rollback.$$"
            act mv -f "$BIN/$b.prev" "$BIN/$b"
            act mv -f "$BIN/$b.rollback.$$" "$BIN/$b.prev"
        else
            note "no $BIN/$b.prev: $b left as is"
        fi
    done
    [ "$found" = 1 ] || { echo "install.sh: nothing to roll back" >&2; exit 1; }
    note "rolled back; now: systemctl restart specd"
    exit 0
fi

# ---- env file choice (checked before anything is done) ----
case "$ENV_NAME" in
*/*) ENV_SRC=$ENV_NAME ;;
*) ENV_SRC=$SRC/deploy/env/$ENV_NAME.env ;;
esac
[ -f "$ENV_SRC" ] || { echo "install.sh: no env file $ENV_SRC (see deploy/env/)" >&2; exit 2; }

# ---- build ----
if [ "$BUILD_STEP" = 1 ]; then
    act cmake -S "$SRC" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release
    act cmake --build "$BUILD_DIR" -j "$JOBS" --target specd specd-bench
fi
SPECD_BIN=$BUILD_DIR/server/specd
BENCH_BIN=$BUILD_DIR/bench/specd-bench
if [ "$DRY" = 0 ] || [ "$BUILD_STEP" = 0 ]; then
    for f in "$SPECD_BIN" "$BENCH_BIN"; do
        [ -x "$f" ] || { echo "install.sh: $f is missing (build first, or drop --no-build)" >&2; exit 1; }
    done
fi

# ---- user and group ----
if [ "$MANAGE_USER" = 1 ]; then
    if getent group specd >/dev/null; then note "group specd exists"; else act groupadd --system specd; fi
    if getent passwd specd >/dev/null; then
        note "user specd exists"
    else
        act useradd --system --gid specd --home-dir /var/lib/specd --no-create-home \
            --shell /usr/sbin/nologin --comment "specd inference server" specd
    fi
    # GPU device nodes may be group-restricted (video, render)
    for g in video render; do
        if getent group "$g" >/dev/null && ! id -nG specd 2>/dev/null | tr ' ' '\n' | grep -qx "$g"; then
            act usermod -a -G "$g" specd
        fi
    done
else
    note "user specd: not managed here (--root staging)"
fi

# ---- directories ----
for d in "$BIN" "$R$PREFIX/share" "$SHARE" "$SHARE/env" "$R$PREFIX/share/doc" "$DOC" "$R/etc" "$UNIT_DIR" "$R/var" "$R/var/lib"; do
    [ -d "$d" ] || act install -d -m 0755 "$d"
done
mkdir_own 0750 root:specd "$ETC"
mkdir_own 0750 specd:specd "$STATE"
mkdir_own 0750 root:specd "$STATE/models"

# ---- binaries (the replaced one stays as .prev for rollback) ----
put_file 0755 "$SPECD_BIN" "$BIN/specd" 1
put_file 0755 "$BENCH_BIN" "$BIN/specd-bench" 1

# ---- shared data: env examples, draft heads, README ----
for f in "$SRC"/deploy/env/*.env; do put_file 0644 "$f" "$SHARE/env/$(basename "$f")"; done
if [ -d "$SRC/draft/heads" ]; then
    (cd "$SRC/draft/heads" && find . -type d | sort) | while read -r d; do
        [ -d "$SHARE/heads/$d" ] || act install -d -m 0755 "$SHARE/heads/$d"
    done
    (cd "$SRC/draft/heads" && find . -type f | sort) | while read -r f; do
        put_file 0644 "$SRC/draft/heads/$f" "$SHARE/heads/$f"
    done
else
    note "no draft/heads/ in the source tree: no draft heads installed"
fi
put_file 0644 "$SRC/deploy/README.md" "$DOC/README.md"

# ---- unit ----
put_subst 0644 "$SRC/deploy/specd.service" "$UNIT_DIR/specd.service"

# ---- configuration: never overwritten ----
if [ -e "$ETC/specd.env" ]; then
    note "keeping existing $ETC/specd.env (examples in $SHARE/env/)"
else
    put_subst 0640 "$ENV_SRC" "$ETC/specd.env"
    if [ "$MANAGE_USER" = 1 ]; then act chown root:specd "$ETC/specd.env"; fi
fi
if [ -e "$ETC/api-key" ]; then
    note "keeping existing $ETC/api-key"
else
    printf '+ write 32 random bytes as hex > %q (0640)\n' "$ETC/api-key"
    if [ "$DRY" = 0 ]; then
        (umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$ETC/api-key.tmp.$$" && echo >>"$ETC/api-key.tmp.$$")
        mv -f "$ETC/api-key.tmp.$$" "$ETC/api-key"
    fi
    own 0640 root:specd "$ETC/api-key"
fi

# ---- systemd ----
if [ "$SYSTEMD" = 1 ]; then
    act systemctl daemon-reload
    note "start:   systemctl enable --now specd     (put the model where SPECD_MODEL in /etc/specd/specd.env points)"
    note "upgrade: systemctl restart specd          (a running service keeps the old binary until then)"
else
    note "systemd not touched (--no-systemd / --root)"
fi
note "done"
