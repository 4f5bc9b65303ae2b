#!/usr/bin/env bash
# The node benchmark (bench_node.py) on a machine of several GPUs with Python 3.12 and no network.
# It needs the ignored folder .device/, built here by
#   python benchmarks/device_carry.py --load-formats
# vLLM 0.33.0's own folder with its transformers (vllm-0.33.0.tar.xz, no compiled libraries: the CPU
# platform loads without them), the pure-Python part of the import chain (site.tar.xz), cp312 wheels
# of the compiled packages it imports and of the load formats' packages (whl/: fastsafetensors,
# instanttensor, runai-model-streamer), and tree.tar (`git archive HEAD`: the committed code,
# whatever the working tree holds). See benchmarks/README.md.
#
#   benchmarks/device_node.sh setup            # unpack, install, what the machine is
#   benchmarks/device_node.sh job SECONDS [FLAGS]  # bench_node.py [FLAGS] in the background, nothing new after SECONDS
#   benchmarks/device_node.sh wait DEST [S]    # wait (at most S seconds) for the job, copy its results to DEST
#   benchmarks/device_node.sh run [FLAGS]      # bench_node.py [FLAGS] now, in the foreground
#
# SGLang 0.5.23's forms (bench_node.py --engine sglang) from .device/sglang/, built by
#   python benchmarks/device_carry.py --engines sglang==0.5.23 --out .device/sglang
# (SGLang's own folder and its transformers, its import chain, its wheels and its own tree.tar), unpacked
# to folders of their own (/tmp/sglang, /tmp/sgsite, /tmp/sgtree) beside the vLLM ones:
#   benchmarks/device_node.sh sglang-setup
#   benchmarks/device_node.sh sglang-job SECONDS [FLAGS]   # Qwen3-235B-A22B's FP8 dims, 2 MoE layers, 1 round
#   benchmarks/device_node.sh sglang-wait DEST [S]
#   benchmarks/device_node.sh sglang-formats DEST [S]   # gpu_load_formats.py --engine sglang, gpu_sglang_weight_cache.py
# (the formats' wheels: carry the vLLM set's fastsafetensors, instanttensor, runai_model_streamer and humanize
# wheels beside .device/sglang; sglang-setup installs them)
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-/tmp/node-results}  # device_boot.sh's setup writes its machine.log into its own
WORK=${WORK:-/tmp/node}
export PYTHONPATH=/tmp/site:/tmp/v33 PYTHONUNBUFFERED=1 VLLM_TARGET_DEVICE=cpu  # vLLM's CPU platform: no vllm._C
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

compiled() {  # byte-compiled as pip installs a package, so no rank process compiles at its start
    # a tree's stray files of other Python versions fail to compile (never imported): counted, not fatal
    failed=$(python3 -m compileall -q -j 0 "$@" 2>&1 | grep -c "^\*\*\*")
    echo "byte-compiled $* ($failed files did not compile); PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}"
}

setup() {
    mkdir -p /tmp/v33 /tmp/site /tmp/tree "$RESULTS"
    tar xJf .device/vllm-0.33.0.tar.xz -C /tmp/v33 && tar xJf .device/site.tar.xz -C /tmp/site \
        && tar xf .device/tree.tar -C /tmp/tree || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .device/whl/*.whl > "$RESULTS/pip.log" 2>&1 || { tail -n 20 "$RESULTS/pip.log"; exit 1; }
    compiled /tmp/v33 /tmp/site /tmp/tree
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c 'import torch, os; print(torch.__version__, torch.cuda.device_count(), "GPUs", os.cpu_count(), "cpus")'
      df -h /tmp; free -g; lsblk -d -o NAME,SIZE,ROTA,MODEL 2>/dev/null; } | tee "$RESULTS/machine.log"
}

job() {
    rm -f "$RESULTS/done"  # an earlier job's end is not this one's
    setsid nohup bash -c "python3 /tmp/tree/benchmarks/bench_node.py --work $WORK --budget-s $1 ${*:2} \
        --save $RESULTS/node.json > $RESULTS/node.log 2>&1; touch $RESULTS/done" > /dev/null 2>&1 < /dev/null &
}

wait_for() {
    for _ in $(seq 1 "${2:-560}"); do [ -e "$RESULTS/done" ] && break; sleep 1; done
    cp "$RESULTS"/node.json "$RESULTS"/node.log "$RESULTS"/machine.log "$1"/ 2>/dev/null
    tar czf "$1/logs.tgz" -C "$WORK" logs 2>/dev/null
    tail -n 60 "$RESULTS/node.log"
}

SG_RESULTS=/tmp/node-sglang-results
SG_PATH=/tmp/sgsite:/tmp/sglang

sglang_setup() {
    mkdir -p /tmp/sglang /tmp/sgsite /tmp/sgtree "$SG_RESULTS"
    tar xJf .device/sglang/sglang-0.5.23.tar.xz -C /tmp/sglang && tar xJf .device/sglang/site.tar.xz -C /tmp/sgsite \
        && tar xf .device/sglang/tree.tar -C /tmp/sgtree || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sgsite \
        .device/sglang/whl/*.whl > "$SG_RESULTS/pip.log" 2>&1 || { tail -n 20 "$SG_RESULTS/pip.log"; exit 1; }
    # The load formats' packages (gpu_load_formats.py --engine sglang): the vLLM set's wheels, where a
    # call before carried them (the two sets do not fit one call's carry).
    formats=$(ls .device/whl/{fastsafetensors,instanttensor,runai_model_streamer,humanize}-*.whl 2>/dev/null)
    [ -z "$formats" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/sgsite $formats >> "$SG_RESULTS/pip.log" 2>&1 || { tail -n 20 "$SG_RESULTS/pip.log"; exit 1; }
    compiled /tmp/sglang /tmp/sgsite /tmp/sgtree
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c 'import torch, os; print(torch.__version__, torch.cuda.device_count(), "GPUs", os.cpu_count(), "cpus")'
      df -h /tmp; free -g; } | tee "$SG_RESULTS/machine.log"
}

sglang_job() {  # nothing new after SECONDS from its start (set-up included); rows saved as they go
    rm -f "$SG_RESULTS/done"
    setsid nohup bash -c "PYTHONPATH=$SG_PATH python3 /tmp/sgtree/benchmarks/bench_node.py --engine sglang \
        --layers 2 --rounds 1 --batch 4 --work $WORK-sglang --budget-s $1 ${*:2} --save $SG_RESULTS/node.json \
        > $SG_RESULTS/node.log 2>&1; touch $SG_RESULTS/done" > /dev/null 2>&1 < /dev/null &
}

sglang_formats() {  # SGLang's GPU load formats and its daemon over CUDA IPC, byte for byte; logs to DEST
    (cd /tmp/sgtree && PYTHONPATH=$SG_PATH:/tmp/sgtree MEGAMOE_ENGINE=sglang==0.5.23 \
        timeout "${2:-240}" python3 benchmarks/gpu_load_formats.py --engine sglang --work /tmp/gpu-formats-sglang \
        > "$1/sglang-0.5.23.log" 2>&1
     PYTHONPATH=$SG_PATH:/tmp/sgtree MEGAMOE_ENGINE=sglang==0.5.23 timeout "${2:-240}" \
        python3 tests/engines/gpu_sglang_weight_cache.py --device cuda --work /tmp/gpu-swc > "$1/weight-cache.log" 2>&1)
    tail -n 8 "$1/sglang-0.5.23.log" "$1/weight-cache.log"
}

sglang_wait() {
    for _ in $(seq 1 "${2:-560}"); do [ -e "$SG_RESULTS/done" ] && break; sleep 1; done
    cp "$SG_RESULTS"/node.json "$SG_RESULTS"/node.log "$SG_RESULTS"/machine.log "$1"/ 2>/dev/null
    tar czf "$1/logs.tgz" -C "$WORK-sglang" logs 2>/dev/null
    tail -n 40 "$SG_RESULTS/node.log"
}

case "${1:-}" in
    setup) setup ;;
    job) shift; job "${1:-900}" "${@:2}" ;;
    wait) wait_for "$2" "${3:-560}" ;;
    run) shift; python3 /tmp/tree/benchmarks/bench_node.py --work "$WORK" "$@" ;;
    sglang-setup) sglang_setup ;;
    sglang-job) shift; sglang_job "${1:-300}" "${@:2}" ;;
    sglang-wait) sglang_wait "$2" "${3:-560}" ;;
    sglang-formats) sglang_formats "$2" "${3:-240}" ;;
    *) echo "usage: $0 setup|job SECONDS [FLAGS]|wait DEST [SECONDS]|run [FLAGS]|sglang-setup|sglang-job SECONDS [FLAGS]|sglang-wait DEST [SECONDS]|sglang-formats DEST [SECONDS]" >&2
       exit 2 ;;
esac
