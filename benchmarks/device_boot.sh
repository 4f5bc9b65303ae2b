#!/usr/bin/env bash
# The whole-start benchmark (bench_boot.py) on a machine of several GPUs with Python 3.12 and no network.
# It needs the ignored folder .device/, built here by
#   python benchmarks/device_carry.py
# vLLM 0.33.0's own folder with its transformers (vllm-0.33.0.tar.xz, no compiled libraries: the CPU
# platform loads without them), the pure-Python part of the import chain (site.tar.xz), cp312 wheels
# of the compiled packages it imports (whl/), and tree.tar (`git archive HEAD`: the committed code).
# See benchmarks/README.md.
#
#   benchmarks/device_boot.sh setup                 # unpack, install, what the machine is
#   benchmarks/device_boot.sh job SECONDS [FLAGS]   # bench_boot.py [FLAGS] in the background, nothing new after SECONDS
#   benchmarks/device_boot.sh wait DEST [S]         # wait (at most S seconds) for the job, copy its results to DEST
#
# SGLang 0.5.23 (bench_boot.py --engine sglang) from .device/sglang/, built by
#   python benchmarks/device_carry.py --engines sglang==0.5.23 --out .device/sglang
# and unpacked as device_node.sh unpacks it (/tmp/sglang, /tmp/sgsite, /tmp/sgtree):
#   benchmarks/device_boot.sh sglang-setup
#   benchmarks/device_boot.sh sglang-job SECONDS [FLAGS]   # Qwen3-235B-A22B's FP8 dims: slice (24 MoE layers), node
#   benchmarks/device_boot.sh sglang-wait DEST [S]
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=/tmp/boot-results
WORK=${WORK:-/tmp/boot}
export PYTHONPATH=/tmp/site:/tmp/v33 PYTHONUNBUFFERED=1 VLLM_TARGET_DEVICE=cpu  # vLLM's CPU platform: no vllm._C
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

job() {
    # The slice (ranks 0..N-1 of EP 4N, 44 MoE layers) cold and warm, then the node (EP N) at 1, 2
    # and 4 MoE layers warm: the per-layer slope. Each shape's files are removed once it is measured.
    rm -f "$RESULTS/done"  # an earlier job's end is not this one's
    setsid nohup bash -c "python3 /tmp/tree/benchmarks/bench_boot.py --work $WORK --budget-s $1 --clean \
        --node-caches warm ${*:2} --save $RESULTS/boot.json > $RESULTS/boot.log 2>&1; touch $RESULTS/done" \
        > /dev/null 2>&1 < /dev/null &
}

wait_for() {
    for _ in $(seq 1 "${2:-560}"); do [ -e "$RESULTS/done" ] && break; sleep 1; done
    cp "$RESULTS"/boot.json "$RESULTS"/boot.log "$RESULTS"/machine.log "$1"/ 2>/dev/null
    tar czf "$1/logs.tgz" -C "$WORK" logs 2>/dev/null
    tail -n 40 "$RESULTS/boot.log"
}

SG_RESULTS=/tmp/boot-sglang-results
SG_PATH=/tmp/sgsite:/tmp/sglang

sglang_job() {  # the same shapes with SGLang's Qwen3MoeForCausalLM; nothing new after SECONDS
    mkdir -p "$SG_RESULTS" && rm -f "$SG_RESULTS/done"
    setsid nohup bash -c "PYTHONPATH=$SG_PATH python3 /tmp/sgtree/benchmarks/bench_boot.py --engine sglang \
        --work $WORK-sglang --budget-s $1 --clean --node-caches warm ${*:2} --save $SG_RESULTS/boot.json \
        > $SG_RESULTS/boot.log 2>&1; touch $SG_RESULTS/done" > /dev/null 2>&1 < /dev/null &
}

case "${1:-}" in
    setup) RESULTS=$RESULTS bash benchmarks/device_node.sh setup ;;  # the same folders as the node benchmark
    job) shift; job "${1:-480}" "${@:2}" ;;
    wait) wait_for "$2" "${3:-560}" ;;
    sglang-setup) bash benchmarks/device_node.sh sglang-setup && mkdir -p "$SG_RESULTS" \
        && cp /tmp/node-sglang-results/machine.log "$SG_RESULTS"/ ;;  # the same folders as the node benchmark's
    sglang-job) shift; sglang_job "${1:-480}" "${@:2}" ;;
    sglang-wait) RESULTS=$SG_RESULTS WORK=$WORK-sglang wait_for "$2" "${3:-560}" ;;
    *) echo "usage: $0 setup|job SECONDS [FLAGS]|wait DEST [SECONDS]|sglang-setup|sglang-job SECONDS [FLAGS]|sglang-wait DEST [SECONDS]" >&2
       exit 2 ;;
esac
