#!/usr/bin/env bash
# Every GPU check of the Python package, as one command on a machine with one CUDA GPU
# and its own torch (no network needed). Run from the repository's root:
#
#     python/benches/gpu_checks.sh target/wheels/dist/rankscope-*.whl OUT_DIR
#
# 1. pip's plan for the wheel in this environment (a dry run: what it would install
#    beside the torch already there), then the wheel installed into a folder of its own
#    (--no-deps --target), what the extension links, and `import rankscope`;
# 2. the device side's numbers against the float64 oracle (gpu_accuracy.py);
# 3. the agent's cost on the GPT, 2 interleaved rounds of 7 of its arms, with a profiled
#    window (gpu_overhead.py);
# 4. one DDP rank under torchrun (NCCL) sending to a collector: the rows that landed, and
#    what the metrics threads spent per sample (`compute_ms`, by method and by layer) on a
#    float32 GPT of the overhead part's shape, whose layers the sketch measures;
# 5. the device's Krylov process as deep as each layer needs against always to the last
#    depth (the arms full@10 and full@10-deepest, 2 rounds, in what is left of about 10
#    minutes).
#
# WHEEL is the user's wheel (`make wheel`: target/wheels/dist, over an hour from an empty
# target/ on 2 cores) or the dev wheel (`make python-dev`, which `make demo` and `make
# test` run: target/wheels/dev, about 11 minutes from empty). In the dev wheel the code a
# sampled step runs (the extension, the agent, its algebra) is optimized and the rest is
# not: the transport thread's CPU time, which the default budget counts, is higher, and
# the extension needs the build machine's glibc (2.36 on Debian 12) or newer.
#
# Writes gpu-checks.log, pip-report.json and the profiled arms' kernel tables to OUT_DIR.
# Each part has its own time limit; a failing part is reported and the next one runs.
set -u
wheel=${1:?usage: gpu_checks.sh WHEEL OUT_DIR}
out=${2:?usage: gpu_checks.sh WHEEL OUT_DIR}
py=${PYTHON:-python3}
mkdir -p "$out"
work=$(mktemp -d)
site=$work/site
export PYTHONUNBUFFERED=1

part() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }

{
    part machine
    nvidia-smi -L
    echo "cores: $(nproc)"
    $py -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda)"

    part "pip's plan for the wheel here (dry run)"
    $py -m pip install --no-index --dry-run --quiet --report "$out/pip-report.json" "$wheel"
    $py - "$out/pip-report.json" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
print("would install:", [(i["metadata"]["name"], i["metadata"]["version"]) for i in report["install"]])
EOF

    part "install (--no-deps --target) and import"
    $py -m pip install --quiet --no-index --no-deps --target "$site" "$wheel" || exit 1
    export PYTHONPATH=$site PATH=$site/bin:$PATH
    readelf -d "$site/rankscope/_native.abi3.so" | grep NEEDED
    $py -c "import rankscope, torch; print('rankscope', rankscope.__version__, 'imported beside torch', torch.__version__)"
    $py -m pip list 2>/dev/null | grep -E "^torch "

    part "accuracy against the float64 oracle"
    timeout 90 $py python/benches/gpu_accuracy.py --out "$work/accuracy" || echo "accuracy: exit $?"

    part "overhead: 2 rounds, profiled"
    timeout 380 $py python/benches/gpu_overhead.py --rounds 2 --profile --profile-out "$out" \
        --arms none,steps,full@10,full@10-inline,full@10-1thread,full@1,default || echo "overhead: exit $?"

    part "one DDP rank under torchrun, to a collector"
    rankscope collector --listen 127.0.0.1:0 --out "$work/ddp" >"$work/collector.log" 2>&1 &
    collector=$!
    sleep 2
    addr=$(grep -o '127\.0\.0\.1:[0-9]*' "$work/collector.log" | head -1)
    RANKSCOPE_COLLECTOR=$addr RANKSCOPE_RUN_ID=gpu-ddp RANKSCOPE_SAMPLE_EVERY=10 RANKSCOPE_OVERHEAD_BUDGET=100% \
        RANKSCOPE_SPILL_DIR=$work/spill timeout 90 $py -m torch.distributed.run --standalone --nproc-per-node 1 \
        -m rankscope.examples.ddp_train --steps 200 --d-model 1024 --layers 8 --heads 16 --seq 512 --vocab 8192 \
        || echo "ddp: exit $?"
    kill -TERM $collector
    wait $collector
    $py - "$work/ddp" <<'EOF'
import sys
import pyarrow.dataset as ds
root = sys.argv[1]
for name in ("steps", "layers", "comm", "events"):
    try:
        rows = [r for r in ds.dataset(f"{root}/{name}", format="parquet", partitioning="hive").to_table().to_pylist() if r["run_id"] == "gpu-ddp"]
    except Exception as e:  # a table no row reached
        print(f"{name}: none ({type(e).__name__})")
        continue
    filled = {c: sum(r[c] is not None for r in rows) for c in rows[0]} if rows else {}
    print(f"{name}: {len(rows)} rows; non-null per column: {filled}")
    if name == "steps" and rows:
        for c in ("step_ms", "overhead_ms", "overhead_device_ms", "overhead_observed_ms", "comm_ms", "device_peak_bytes"):
            values = sorted(r[c] for r in rows if r.get(c) is not None)
            if values:
                print(f"  {c}: median {values[len(values) // 2]:.3f}, max {values[-1]:.3f}")
    if name == "layers" and rows:
        print(f"  measured (stable_rank set): {sum(r['stable_rank'] is not None for r in rows)} of {len(rows)}; steps {sorted({r['step'] for r in rows})}")
        for method in sorted({r["method"] for r in rows}):
            ms = sorted(r["compute_ms"] for r in rows if r["method"] == method and r.get("compute_ms") is not None)
            if ms:
                print(f"  compute_ms ({method!r}, {len(ms)}): median {ms[len(ms) // 2]:.1f}, p90 {ms[int(len(ms) * 0.9)]:.1f}, max {ms[-1]:.1f}")
        by_layer = {}
        for r in rows:
            if r.get("compute_ms") is not None:
                by_layer.setdefault(r["layer"], []).append(r["compute_ms"])
        slowest = sorted(by_layer.items(), key=lambda kv: -sorted(kv[1])[len(kv[1]) // 2])[:6]
        print("  slowest layers (median compute_ms):", ", ".join(f"{k} {sorted(v)[len(v) // 2]:.1f}" for k, v in slowest))
    if name == "events":
        for r in rows:
            print(f"  {r['kind']}: {str(r.get('message'))[:200]}")
EOF

    # The last part takes what is left of about 10 minutes in all.
    left=$((580 - SECONDS))
    if [ "$left" -gt 60 ]; then
        part "the Krylov process as deep as each layer needs, or to the last depth (${left} s at most)"
        timeout "$left" $py python/benches/gpu_overhead.py --rounds 2 --arms none,full@10,full@10-deepest \
            || echo "depths: exit $?"
    else
        part "the Krylov process's depths: skipped (${left} s left of 580)"
    fi
    part done
} 2>&1 | tee "$out/gpu-checks.log"
