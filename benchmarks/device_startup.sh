#!/usr/bin/env bash
# The one-GPU benchmarks on a GPU machine with Python 3.12 and no network. They need the ignored
# folder .device/, built here by
#   python benchmarks/device_carry.py --engines vllm==0.33.0,vllm==0.32.0
# vLLM 0.33.0's and 0.32.0's own folders (vllm-0.3x.0.tar.xz, no compiled libraries: the CPU
# platform loads without them), the pure-Python part of their import chain (site.tar.xz) and cp312
# wheels of the compiled packages it imports (whl/). See benchmarks/README.md.
#
#   benchmarks/device_startup.sh setup     # unpack, install, CUDA tests, a tiny smoke run
#   benchmarks/device_startup.sh job       # the start-up runs (about 15 min), results in /tmp/startup-results
#   benchmarks/device_startup.sh wait DEST # wait for the job, copy its results to DEST
#   benchmarks/device_startup.sh daemon    # vLLM 0.33's weight-cache daemon (bench_daemon.py), warm and cold
#   benchmarks/device_startup.sh store     # one store vs the per-rank form (bench_store.py), in the background;
#                                          # then `wait DEST` as for job
#   benchmarks/device_startup.sh probe     # the layout probe beside a whole Flash rank's first load (bench_probe.py)
#   benchmarks/device_startup.sh load      # one rank in one process: the host's paths (bench_load.py, probe_register.py)
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=/tmp/startup-results
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_TARGET_DEVICE=cpu  # vLLM's CPU platform: no vllm._C
BENCH="python3 benchmarks/bench_startup.py --vllm 0.33=/tmp/v33 --vllm 0.32=/tmp/v32"

setup() {
    mkdir -p /tmp/v33 /tmp/v32 /tmp/site "$RESULTS"
    tar xJf .device/vllm-0.33.0.tar.xz -C /tmp/v33 && tar xJf .device/vllm-0.32.0.tar.xz -C /tmp/v32 \
        && tar xJf .device/site.tar.xz -C /tmp/site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .device/whl/*.whl || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch, os; print(torch.__version__, torch.cuda.get_device_name(0), os.cpu_count(), "cpus")'
    [ -n "${SKIP_TESTS:-}" ] || PYTHONPATH=/tmp/site:. python3 -m pytest -q -p no:cacheprovider -m cuda tests/unit/test_loader.py \
        tests/unit/test_layout.py tests/unit/test_convert.py > "$RESULTS/cuda-tests.log" 2>&1
    tail -n 3 "$RESULTS/cuda-tests.log" 2>/dev/null
    $BENCH --work /tmp/smoke --layers 1 --experts 16 --ep-size 4 --redundant 4 --caches warm \
        --methods ours,vllm033_all,vllm033_ep_filter,ours_v032,vllm032,ours_redundant,vllm033_redundant \
        --save "$RESULTS/smoke.json" 2>&1 | grep -v "^convert:"
}

job() {
    # Start-up time against checkpoint size (one rank, warm and cold), then the full 4-layer run.
    for layers in 1 2; do
        $BENCH --work /tmp/size$layers --layers $layers --methods ours,vllm033_all,vllm033_ep_filter,vllm032 \
            --save "$RESULTS/size-$layers.json" > "$RESULTS/size-$layers.log" 2>&1
        rm -rf /tmp/size$layers
    done
    $BENCH --work /tmp/flash4 --layers 4 --redundant 16 --node 8 \
        --methods ours,vllm033_all,vllm033_ep_filter,ours_v032,vllm032,ours_redundant,vllm033_redundant \
        --save "$RESULTS/flash4.json" > "$RESULTS/flash4.log" 2>&1
    # The loader's reader lanes, ours only (cold and warm): a deeper read queue, a shallower one.
    for knobs in "MEGAMOE_READ_THREADS=32" "MEGAMOE_READ_THREADS=8"; do
        name=$(echo "$knobs" | tr ' =' '_-')
        env $knobs $BENCH --work /tmp/flash4 --layers 4 --methods ours --save "$RESULTS/knobs-$name.json" \
            > "$RESULTS/knobs-$name.log" 2>&1
    done
    touch "$RESULTS/done"
}

daemon() {
    # A daemon's cold start (pre-baked vs source), an ipc_cache engine restart, install(): 4 MoE layers, rank 0 of EP 8.
    for cache in warm cold; do
        flag=$([ $cache = cold ] && echo --cold)
        PYTHONPATH=/tmp/v33:/tmp/site python3 benchmarks/bench_daemon.py --work /tmp/daemon $flag \
            --save "$RESULTS/daemon-h100/$cache.json" > "$RESULTS/daemon-h100/$cache.log" 2>&1
        tail -n 30 "$RESULTS/daemon-h100/$cache.log"
    done
}

store() {
    # Flash dims, 2 MoE layers, rank 0 of EP 8 and EP 16, warm and cold.
    python3 benchmarks/bench_store.py --preset flash --layers 2 --ep-sizes 8,16 --no-last-rank --cold \
        --save "$RESULTS/store.json" > "$RESULTS/store.log" 2>&1
    touch "$RESULTS/done"
}

probe() {
    # The layout probe beside a whole Flash rank's first load (44 MoE layers, 32 experts, EP 1), warm.
    python3 benchmarks/bench_probe.py --vllm /tmp/v33 --layers 44 --experts 32 --ep-size 1 --work /tmp/probe \
        --save "$RESULTS/44-layers.json" > "$RESULTS/probe.log" 2>&1
    tail -n 30 "$RESULTS/probe.log"
}

load() {
    # One rank in one process (1, 2 and 4 MoE layers), then registering the page cache with CUDA.
    PYTHONPATH=/tmp/site:. python3 benchmarks/bench_load.py --repeats 5 --save "$RESULTS/load-h100.json" \
        > "$RESULTS/load.log" 2>&1
    PYTHONPATH=/tmp/site:. python3 benchmarks/probe_register.py > "$RESULTS/probe-register-h100.log" 2>&1
    tail -n 20 "$RESULTS/load.log" "$RESULTS/probe-register-h100.log"
}

case "${1:-}" in
    setup) setup ;;
    store) mkdir -p "$RESULTS"; setsid nohup bash "$0" store-fg > "$RESULTS/job.log" 2>&1 < /dev/null & ;;
    store-fg) store ;;
    daemon) mkdir -p "$RESULTS/daemon-h100"; daemon ;;
    probe) mkdir -p "$RESULTS"; probe ;;
    load) mkdir -p "$RESULTS"; load ;;
    job) setsid nohup bash "$0" job-fg > "$RESULTS/job.log" 2>&1 < /dev/null & ;;
    job-fg) job ;;
    wait)
        for _ in $(seq 1 ${WAIT_S:-560}); do [ -e "$RESULTS/done" ] && break; sleep 1; done
        tar czf "$2/startup-results.tgz" -C "$RESULTS" .
        tail -n 40 "$RESULTS"/*.log ;;
    *) echo "usage: $0 setup|job|daemon|store|probe|load|wait DEST" >&2; exit 2 ;;
esac
