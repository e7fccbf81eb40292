#!/bin/sh
# System packages hicache-tiers needs beyond pip (Debian/Ubuntu).
#
# libibverbs1: the Mooncake Transfer Engine (remote tier, pool daemons, the
#   mooncake_store tier) links against it even when it moves pages over TCP;
#   without it `from mooncake.engine import TransferEngine` fails with
#   "libibverbs.so.1: cannot open shared object file".
# ibverbs-providers: the user-space drivers of RDMA NICs (mlx5, efa, ...);
#   needed for protocol = "rdma", harmless without a NIC.
# g++, ninja-build, libssl-dev: SGLang's server compiles its page-hash helper
#   (OpenSSL SHA-256) on first use; without them a real server fails its
#   first request that hashes a page.
# libxxhash-dev: xxhash.h, so the compiled copy (tiers/_guardcopy.c) also hashes pages
#   (the end-to-end checksums) in one call a batch; without it they are hashed in Python.
# rdma-core tools (ibverbs-utils: ibv_devices, ibv_devinfo) help check the
#   NIC names that go into device_name.
#
# Usage: sudo scripts/install-system-deps.sh [--rdma-tools]
set -eu

PACKAGES="libibverbs1 ibverbs-providers g++ ninja-build libssl-dev libxxhash-dev"
if [ "${1:-}" = "--rdma-tools" ]; then
    PACKAGES="$PACKAGES ibverbs-utils rdmacm-utils"
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-system-deps: no apt-get here; install the equivalents of: $PACKAGES" >&2
    exit 1
fi

apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null
echo "install-system-deps: installed $PACKAGES"
