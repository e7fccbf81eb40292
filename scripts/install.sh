#!/usr/bin/env bash
# Install hicache-tiers and everything it needs on a fresh Debian/Ubuntu machine
# with Python 3.10+ and pip.  Idempotent: a second run installs nothing new.
#
#   scripts/install.sh            the daemons, the SGLang backend (CPU build of the engine side)
#   scripts/install.sh --test     ... and the test dependencies
#   scripts/install.sh --gpu      the CUDA build of the Mooncake Transfer Engine instead of the CPU one
#   scripts/install.sh --no-engine  only the daemons (no torch, no sglang): for pool and storage nodes
set -euo pipefail
cd "$(dirname "$0")/.."

extras="remote-cpu"
engine=1
for arg in "$@"; do
    case "$arg" in
        --test) extras="$extras,test" ;;
        --gpu) extras="${extras/remote-cpu/remote-gpu}" ;;
        --no-engine) engine=0 ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $arg" >&2; exit 2 ;;
    esac
done

# 1. Debian packages (the Transfer Engine links libibverbs even for TCP; SGLang's
#    server compiles its page-hash helper with g++, ninja and OpenSSL; our compiled
#    copy hashes pages with xxhash.h).
if ! dpkg -s libibverbs1 ibverbs-providers g++ ninja-build libssl-dev libxxhash-dev >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then
        sh scripts/install-system-deps.sh
    else
        sudo sh scripts/install-system-deps.sh
    fi
fi

# --no-warn-conflicts: sglang is installed without its CUDA-only dependencies on
# purpose, so pip's resolver would list ~50 "sglang requires X, which is not
# installed" lines (and a few pins it calls incompatible) that are not errors.
export PIP_ROOT_USER_ACTION=ignore  # a root install in a container is the common case here
PIP="python3 -m pip --disable-pip-version-check"
PIP_INSTALL="$PIP install --quiet --no-warn-conflicts"
# 2. The engine side: torch at the version SGLang pins, SGLang without its CUDA-only
#    dependencies, then the pure-Python packages its HiCache modules import.
if [ "$engine" -eq 1 ]; then
    $PIP_INSTALL torch==2.14.1 torchvision==0.29.1
    $PIP_INSTALL --no-deps sglang==0.5.23
    $PIP_INSTALL --no-deps -r scripts/sglang-cpu-requirements.txt
    # What `python -m sglang.launch_server` imports beyond the HiCache modules (its HTTP server).
    $PIP_INSTALL --no-deps -r scripts/sglang-server-requirements.txt
fi

# 3. This project.
$PIP_INSTALL -e ".[$extras]"
echo "install.sh: hicache-tiers $(python3 -c 'import tiers; print(tiers.__version__)') installed ($extras)"
