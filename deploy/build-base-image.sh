#!/usr/bin/env bash
# Build the local Python 3.11 base image kvhandoff-base:bookworm without any
# container registry: debootstrap a minimal Debian bookworm root filesystem
# (python3 + python3-venv) from the apt mirror and `docker import` it.
# Idempotent: does nothing if the image already exists (FORCE=1 rebuilds).
set -euo pipefail

IMAGE=${KVHANDOFF_BASE_IMAGE:-kvhandoff-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [[ ${FORCE:-0} != 1 ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE already exists, skipping (FORCE=1 to rebuild)"
    exit 0
fi

if ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
fi

start=$SECONDS
tmp=$(mktemp -d /var/tmp/kvhandoff-base.XXXXXX)
# --one-file-system: never descend into a /proc or /sys that a failed
# debootstrap may have left mounted inside the tree.
trap 'rm -rf --one-file-system "$tmp"' EXIT
rootfs=$tmp/rootfs

# One pass: --include pulls python3/python3-venv and their dependencies in
# with the base system, much faster than a second apt-get step in a chroot.
# python3-venv brings the pip/setuptools wheels that `python3 -m venv` needs.
debootstrap --variant=minbase --components=main \
    --include=python3,python3-venv \
    bookworm "$rootfs" "$MIRROR"

# Slim down: apt caches and lists, docs, man pages, locales, logs, and the
# host's resolv.conf/hostname that debootstrap copied (Docker supplies its own).
rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/usr/share/locale/* "$rootfs"/var/cache/debconf/*-old \
    "$rootfs"/var/log/* "$rootfs"/tmp/* "$rootfs"/etc/resolv.conf "$rootfs"/etc/hostname

# Mirror what python:3.11-slim offers so the Dockerfile works on either base.
ln -sf python3 "$rootfs"/usr/bin/python

tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    --message "debootstrap minbase bookworm + python3, python3-venv" \
    - "$IMAGE" >/dev/null

echo "built $IMAGE in $((SECONDS - start))s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | numfmt --to=iec))"
