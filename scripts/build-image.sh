#!/usr/bin/env bash
# Builds the Dockerfile for real on a machine with no container registry, the way the test
# suite does (tests/it/image.rs, IDEMPROXY_TEST_IMAGE=1): buildah, chroot isolation, base
# images made here from Debian packages:
#   - a Debian bookworm base, made with debootstrap (minbase) from the machine's apt mirror;
#   - a builder from it with gcc, taking this machine's Rust toolchain and cargo registry as
#     bind mounts (the toolchain read-only; Cargo.lock's crates are fetched first and the
#     build runs offline).
# The Dockerfile itself is unchanged: its RUST_IMAGE and BASE_IMAGE arguments name them.
# Needs root, buildah and debootstrap (apt-get install buildah debootstrap).
# Usage: scripts/build-image.sh [TAG]        (default: localhost/idemproxy:test)
# Base images are made once and kept (buildah images); the rootfs tarball is kept in
# target/image/. Delete both to start over.
set -euo pipefail
cd "$(dirname "$0")/.."

tag=${1:-localhost/idemproxy:test}
cache=target/image
base=localhost/idemproxy-build/debian:bookworm
builder=localhost/idemproxy-build/rust:bookworm
mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
mirror=${mirror:-http://deb.debian.org/debian}

have_image() { buildah inspect --type image "$1" >/dev/null 2>&1; }

mkdir -p "$cache"
if ! have_image "$base"; then
  if [ ! -f "$cache/rootfs.tar" ]; then
    echo "debootstrap: Debian bookworm (minbase) from $mirror"
    rm -rf "$cache/rootfs"
    debootstrap --variant=minbase bookworm "$cache/rootfs" "$mirror" >"$cache/debootstrap.log"
    tar -C "$cache/rootfs" -cf "$cache/rootfs.tar.tmp" .
    mv "$cache/rootfs.tar.tmp" "$cache/rootfs.tar"
    rm -rf "$cache/rootfs"
  fi
  ctr=$(buildah from scratch)
  buildah add "$ctr" "$cache/rootfs.tar" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  buildah commit -q "$ctr" "$base" >/dev/null
  buildah rm "$ctr" >/dev/null
fi
if ! have_image "$builder"; then
  ctr=$(buildah from "$base")
  buildah run --isolation chroot "$ctr" -- sh -c 'apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null \
    && rm -rf /var/lib/apt/lists/*'
  # What the official rust image sets, with the toolchain mounted at /usr/local/rust.
  buildah config --env CARGO_HOME=/usr/local/cargo --env CARGO_NET_OFFLINE=true \
    --env PATH=/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  buildah commit -q "$ctr" "$builder" >/dev/null
  buildah rm "$ctr" >/dev/null
fi

toolchain=$(rustc --print sysroot)
registry=${CARGO_HOME:-$HOME/.cargo}/registry
cargo fetch --locked >/dev/null
buildah bud --isolation chroot --layers=false --format docker \
  --build-arg RUST_IMAGE="$builder" --build-arg BASE_IMAGE="$base" \
  -v "$toolchain:/usr/local/rust:ro" -v "$registry:/usr/local/cargo/registry" \
  -t "$tag" .
