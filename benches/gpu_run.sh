#!/usr/bin/env bash
# The whole GPU pass, for a lent GPU machine (no package registry there; torch, triton, numba,
# pytest, pytest-benchmark and hypothesis are preinstalled). From the repository root:
#
#   bash benches/gpu_run.sh            # everything: tests, benchmarks, report, distributed
#   bash benches/gpu_run.sh tests      # one stage: tests | benches | report | distributed
#   bash benches/gpu_run.sh targets    # the GPU issue's targets alone, in about 8 minutes
#   bash benches/gpu_run.sh switch     # the switch's CUDA tests against torch, about 2 minutes
#   bash benches/gpu_run.sh profile    # the MoE backward's parts, and ncu on its launch
#   bash benches/gpu_run.sh lease      # a 15-minute lease's first command, about 5 minutes
#   bash benches/gpu_run.sh rest       # the checks that lease leaves out, 5.5 minutes
#
# A short lease narrows the two long stages: TEST_ARGS replaces the tests stage's selection (the
# whole suite by default), BENCH_ARGS the benches stage's (default "-k cuda"), for example
#   TEST_ARGS="-n 14 -k 'cuda or triton' tests" BENCH_ARGS="-k 'cuda and dispatch'"
# (-n: pytest-xdist, on the GPU machine; "cuda or triton" keeps the cuda-marked tests and
# every test that names the triton backend, in 3 minutes on an H200).
#
# The GPU machine has no package registry and no expecttest, which torch's OpInfo database (the
# switch stage's samples) imports: carry its wheel, and any other missing package's, in .whl/
# (kept out of git), made on a machine with a registry by
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl expecttest==0.3.0
# and this script installs them into /tmp/site first.
#
# Each stage fits in one 10-minute device command; run them one by one when a session's device
# time is short (on an H200 with a cold cache, 2026-11-26: switch 2 minutes; targets 4.5 up to
# the report, whose timings were then cut while its kernels compiled, before the GNN size). Everything is written to $OUT (default benches/results/gpu-<date>/): the
# environment (GPU name, torch, triton and CUDA versions, date), the test log and JUnit XML,
# the pytest-benchmark JSON with its summary table and targets, the report's JSON, and the
# sum over ranks on NCCL (world size 1: the gloo tests' code path on CUDA tensors).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benches/results/gpu-$(date +%F)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES=${*:-tests benches report distributed}
TEST_ARGS=${TEST_ARGS:-}
BENCH_ARGS=${BENCH_ARGS:--k cuda}

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . || exit 1
python3 - <<'PY' | tee "$OUT/gpu_env.txt"
import datetime, numba, torch, triton
print("date", datetime.date.today().isoformat())
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "numba", numba.__version__)
PY

status=0
for stage in $STAGES; do
    case $stage in
    tests)
        # The whole suite: the CPU tests, test_triton.py on CUDA tensors, the cuda-marked ones.
        # The whole log goes to tests-full.txt as it is written, so a run stopped at the device's
        # time limit still leaves what it printed.
        eval "python3 -m pytest -q -p no:cacheprovider --junitxml=\"\$OUT/tests.xml\" \
            --durations=20 $TEST_ARGS" 2>&1 | tee "$OUT/tests-full.txt" | tail -n 60 \
            | tee "$OUT/tests.txt" || status=1 ;;
    benches)
        eval "python3 -m pytest benches $BENCH_ARGS --benchmark-only -q -p no:cacheprovider \
            --benchmark-json=\"\$OUT/bench-gpu.json\"" 2>&1 | tail -n 20 || status=1
        python3 benches/summarize.py "$OUT/bench-gpu.json" | tee "$OUT/bench-gpu.txt" ;;
    report)
        python3 -m detsum report --json "$OUT/report-gpu.json" | tee "$OUT/report-gpu.txt" \
            || status=1 ;;
    lease)
        # What a 15-minute lease measures first, each part cut at its own limit so that the
        # rest still runs (on an H200, 2026-11-27: tests 80 s cold, call cost 80 s, the
        # benchmarks' targets 165 s, the Zipf parts 25 s): the switch on the Zipf index; the
        # CUDA tests of the kernels, plans and relaunches, the counting sort's; what a call
        # costs by how it is called; the Zipf call's parts and a wide table's sort; the
        # benchmarks of the GPU issues' other targets; where host time goes, with a plan and
        # without. It writes 16 files: where fewer come
        # back from a machine, point OUT at a folder and pack it afterwards (OUT=$DIR/r bash
        # benches/gpu_run.sh lease; tar czf r.tgz -C $DIR r).
        # First, the switch's open target: its Zipf index_add_ and index_put_ against torch's
        # atomics and its deterministic mode (about a minute, the kernels compiling first).
        timeout 120 python3 -m pytest benches/bench_enable.py -q -p no:cacheprovider \
            --benchmark-only -k "test_enable_cuda and not calls" \
            --benchmark-json="$OUT/bench-switch-zipf.json" 2>&1 | tail -n 5 || status=1
        python3 benches/summarize.py "$OUT/bench-switch-zipf.json" \
            | tee "$OUT/bench-switch-zipf.txt"
        timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -m cuda \
            tests/test_triton_launch.py tests/test_plan.py tests/test_triton.py \
            tests/test_moe_check.py tests/test_loss.py 2>&1 \
            | tee "$OUT/tests-cuda.txt" | tail -n 25 || status=1
        # The counting sort's tests run on CUDA tensors where a GPU is: every one of them.
        timeout 90 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_counting_sort.py \
            2>&1 | tee "$OUT/tests-counting-sort.txt" | tail -n 15 || status=1
        timeout 200 python3 benches/gpu_call_cost.py --json "$OUT/call-cost.json" 2>&1 \
            | grep -v "Warning\|_warn_once\|sync_debug_mode" | tee "$OUT/call-cost.txt" \
            || status=1
        timeout 60 python3 benches/gpu_moe_profile.py --shape zipf --reps 100 \
            --json "$OUT/zipf-profile.json" | tee "$OUT/zipf-profile.txt" || status=1
        # A few keys into a wide table: its rows zeroed by many ranking programs or by one.
        timeout 60 python3 benches/gpu_moe_profile.py --shape wide --reps 30 \
            --json "$OUT/wide-profile.json" | tee "$OUT/wide-profile.txt" || status=1
        timeout 200 python3 -m pytest benches -q -p no:cacheprovider --benchmark-only \
            -k "cuda and (index_add_moe or copy_yardstick or zipf or small_index_add_) or enable_cuda_calls" \
            --benchmark-json="$OUT/bench-targets.json" 2>&1 | tail -n 5 || status=1
        python3 benches/summarize.py "$OUT/bench-targets.json" | tee "$OUT/bench-targets.txt"
        timeout 60 python3 benches/host_launch.py --cuda --rounds 100 \
            --json "$OUT/host-launch.json" > "$OUT/host-launch.txt" 2>&1 || status=1
        head -n 50 "$OUT/host-launch.txt"
        # Where a call without a plan spends its host time, op by op (about 30 s).
        timeout 60 python3 benches/gpu_no_plan_profile.py > "$OUT/no-plan-profile.txt" 2>&1 \
            || status=1
        head -n 4 "$OUT/no-plan-profile.txt" ;;
    rest)
        # A lease's command when the lease stage's benchmarks are fresh (no kernel changed since):
        # the GPU issues' checks that the lease stage leaves out, each part cut at its own limit
        # (on an H200, 2026-11-27: 5.5 minutes with Triton's cache cold). Host time by call,
        # the CUDA tests of the kernels, plans, checks (CUDA graph, no host sync) and losses,
        # the counting sort's, the sum over ranks on NCCL, then the report ("exact" against
        # "fp32"; its kernels compile first, 80 s).
        timeout 60 python3 benches/host_launch.py --cuda --rounds 100 \
            --json "$OUT/host-launch.json" > "$OUT/host-launch.txt" 2>&1 || status=1
        head -n 40 "$OUT/host-launch.txt"
        timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -m cuda \
            tests/test_triton_launch.py tests/test_plan.py tests/test_triton.py \
            tests/test_moe_check.py tests/test_loss.py tests/test_check.py 2>&1 \
            | tee "$OUT/tests-cuda.txt" | tail -n 25 || status=1
        timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_counting_sort.py \
            2>&1 | tee "$OUT/tests-counting-sort.txt" | tail -n 15 || status=1
        timeout 60 python3 benches/distributed_nccl.py > "$OUT/distributed-nccl.txt" 2>&1 \
            || status=1
        tail -n 20 "$OUT/distributed-nccl.txt"
        timeout 170 python3 -m detsum report --json "$OUT/report-gpu.json" \
            > "$OUT/report-gpu.txt" 2>&1 || status=1
        tail -n 40 "$OUT/report-gpu.txt" ;;
    targets)
        # What a call costs by how it is called (plan, check level, torch's form), the MoE
        # backward against a copy, the Zipf-skewed index, the small call, then the report
        # ("exact" against "fp32", segment_sum 16384x64), the CUDA-graph and no-sync tests, the
        # switch on CUDA (its tests and its cost on the Zipf index) and the sum over ranks:
        # every row of the GPU issues' tables that one GPU can measure.
        python3 benches/gpu_call_cost.py --json "$OUT/call-cost.json" 2>&1 \
            | grep -v "Warning\|_warn_once\|sync_debug_mode" | tee "$OUT/call-cost.txt" || status=1
        # Where a small call's host time goes: each case of the stubbed CPU run on CUDA
        # tensors with the real driver, and a profile of a call with a plan (about 30 s).
        python3 benches/host_launch.py --cuda --rounds 100 --profile \
            --json "$OUT/host-launch.json" > "$OUT/host-launch.txt" 2>&1 || status=1
        head -n 30 "$OUT/host-launch.txt"
        # Narrow rows one segment a program, the layout before the tiles of segments.
        python3 benches/gpu_call_cost.py --sizes mid gnn --tile-bytes 0 \
            --json "$OUT/call-cost-untiled.json" 2>&1 \
            | grep -v "Warning\|_warn_once\|sync_debug_mode" | tee "$OUT/call-cost-untiled.txt" \
            || status=1
        python3 -m pytest benches -q -p no:cacheprovider --benchmark-only \
            -k "cuda and (index_add_moe or copy_yardstick or zipf or small_index_add_) or enable_cuda" \
            --benchmark-json="$OUT/bench-targets.json" 2>&1 | tail -n 5 || status=1
        python3 benches/summarize.py "$OUT/bench-targets.json" | tee "$OUT/bench-targets.txt"
        python3 -m detsum report --json "$OUT/report-gpu.json" > "$OUT/report-gpu.txt" \
            || status=1
        python3 -m pytest tests -q -p no:cacheprovider -m cuda \
            -k "graph or synchronisation or test_enable_cuda" 2>&1 | tail -n 30 \
            | tee "$OUT/tests-graph.txt" || status=1
        python3 benches/distributed_nccl.py > "$OUT/distributed-nccl.txt" 2>&1 || status=1 ;;
    switch)
        # The switch (detsum.enable) on CUDA: every switched form and torch's OpInfo samples,
        # "autograd" against torch under use_deterministic_algorithms(True), every mode the
        # same bits twice, and every scatter index form's sum and mean against torch; then
        # which CUDA kernel torch runs for each form (its arithmetic follows the kernel).
        python3 -m pytest -q -p no:cacheprovider -n 8 -m cuda tests/test_enable_cuda.py \
            tests/test_enable.py tests/test_scatter_reduce_forms.py 2>&1 | tail -n 40 \
            | tee "$OUT/tests-switch.txt" || status=1
        python3 benches/probe_torch_cuda.py 2>/dev/null | tee "$OUT/torch-cuda-kernels.txt" \
            || status=1 ;;
    profile)
        # Where the MoE backward's time goes: the call's parts timed against a copy (without a
        # plan, the sort alone, with a plan), then Nsight Compute on one launch with a plan and
        # one without (clocks left as they are).
        python3 benches/gpu_moe_profile.py --json "$OUT/moe-profile.json" \
            | tee "$OUT/moe-profile.txt" || status=1
        # The same parts on the Zipf-skewed index (the switch's case: no plan), with the chunk
        # programs first (the default) and last.
        python3 benches/gpu_moe_profile.py --shape zipf --json "$OUT/zipf-profile.json" \
            | tee "$OUT/zipf-profile.txt" || status=1
        NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)}
        if [ -n "$NCU" ]; then
            for form in plan off; do
                timeout 240 "$NCU" --clock-control none --kernel-name regex:_segment_kernel \
                    --launch-skip 2 --launch-count 1 --section SpeedOfLight \
                    --section Occupancy --section LaunchStats --section WarpStateStats \
                    --section MemoryWorkloadAnalysis \
                    python3 benches/gpu_moe_profile.py --only $form \
                    > "$OUT/ncu-moe-$form.txt" 2>&1 || status=1
                tail -n 40 "$OUT/ncu-moe-$form.txt"
            done
            # The Zipf index's launch with a plan (its long segments' chunk programs first).
            timeout 240 "$NCU" --clock-control none --kernel-name regex:_segment_kernel \
                --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy \
                --section LaunchStats --section WarpStateStats \
                python3 benches/gpu_moe_profile.py --shape zipf --only plan \
                > "$OUT/ncu-zipf-plan.txt" 2>&1 || status=1
            tail -n 30 "$OUT/ncu-zipf-plan.txt"
        else
            echo "no ncu on this machine: the profile stage timed the parts only"
        fi ;;
    distributed)
        # detsum.distributed and the loss functions' group= on NCCL, one GPU as one rank:
        # every result against the same call without a group (torch.equal), then the exact
        # sum over ranks timed against an fp32 all_reduce of the same gradients.
        python3 benches/distributed_nccl.py 2>&1 | tee "$OUT/distributed-nccl.txt" || status=1 ;;
    *)
        echo "unknown stage $stage (expected tests, benches, report, distributed, targets," \
             "switch, profile, lease or rest)"
        exit 2 ;;
    esac
done
exit $status
