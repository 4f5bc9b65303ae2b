#!/usr/bin/env bash
# The recovery benchmark (bench_recovery.py) on a node of 4 GPUs with Python 3.12 and no network. It
# needs the ignored folder .device/ of the node benchmark, built here by
#   python benchmarks/device_carry.py --load-formats
# (its site.tar.xz and whl/ hold what megamoe-convert imports; tree.tar is `git archive HEAD`: the
# committed code). See benchmarks/README.md.
#
#   benchmarks/device_recovery.sh setup        # unpack, install, what the machine is (device_node.sh's)
#   benchmarks/device_recovery.sh run [FLAGS]  # bench_recovery.py [FLAGS] now, in the foreground
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/recovery}
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

case "${1:-}" in
    setup) bash benchmarks/device_node.sh setup ;;
    run) shift; python3 /tmp/tree/benchmarks/bench_recovery.py --work "$WORK" --layers 4 --experts 64 --ep-size 4 \
        --lost 2 --rounds 1 "$@" ;;
    *) echo "usage: $0 setup|run [FLAGS]" >&2; exit 2 ;;
esac
