"""detsum.loss.batch_grad on a 10M-parameter MLP, against plain ``loss.mean().backward()``.

The batch-loss issue's case: an MLP of 10.1M fp32 parameters (1024 -> 2048 -> 2048 -> 1792 ->
100, ReLU), a batch of 256, cross-entropy, per-sample gradients evaluated 32 samples at a time.

Cases (group "loss batch_grad <device>"):

- ``torch-mean-backward``: ``F.cross_entropy(model(x), y).backward()``, the baseline: autograd
  sums over the batch inside its matmuls (fast, and the order is the matmul's);
- ``per-sample-only``: the per-sample gradients as ``batch_grad`` evaluates them (each sample
  alone, its ``nn.Linear`` weights as factors: ``detsum._sample_gradients``), dropped as they
  come: the inherent cost;
- ``per-sample-grads``: ``loss.per_sample_grads`` in 8 blocks of 32, which also forms every
  weight's rows;
- ``detsum-fp32`` / ``detsum-kahan``: ``loss.batch_grad(..., chunk_size=32)``;
- ``reduction-fp32`` / ``reduction-kahan``: the deterministic reduction alone, a
  ``GradAccumulator`` fed 8 blocks of 32 per-sample gradients in the form ``batch_grad`` feeds
  it (the weights as ``OuterProducts``; one block, computed once, added 8 times: the same work
  as 256 samples). Its ratio is to the ``detsum-<mode>`` case of the
  same run: the reduction's share of ``batch_grad``'s time (the issue's target: < 10%).

Every ``detsum-*`` case also records ``peak_mib``: the peak memory of one ``batch_grad`` call
above what the model and the batch hold, measured in a fresh process (CPU: the growth of the
resident set; CUDA: ``torch.cuda.max_memory_allocated``), for chunk sizes 8, 32 and 64; and
``unchunked_per_sample_mib``, what the per-sample gradients of the whole batch would take
(256 x parameters x 4 bytes), for comparison.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import DEVICES, run_case, sync
from detsum import _sample_gradients, loss

BATCH, CHUNK, CLASSES = 256, 32, 100
WIDTHS = (1024, 2048, 2048, 1792, CLASSES)
IMPLS = ["torch-mean-backward", "per-sample-only", "per-sample-grads", "detsum-fp32",
         "detsum-kahan", "reduction-fp32", "reduction-kahan"]
ROUNDS = {"cpu": 3, "cuda": 10}
PEAK_CHUNKS = (8, 32, 64)
PER_SAMPLE_LOSS = nn.CrossEntropyLoss(reduction="none")

_problems: dict[str, tuple] = {}
_peaks: dict[str, dict] = {}


def make_problem(device: str):
    torch.manual_seed(0)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers).to(device).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTHS[0], generator=gen).to(device)
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen).to(device)
    return model, x, y


def problem(device: str):
    if device not in _problems:
        _problems[device] = make_problem(device)
    return _problems[device]


def _fn(impl: str, model, x, y):
    if impl == "torch-mean-backward":
        def mean_backward():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
        return mean_backward
    if impl == "per-sample-only":
        def per_sample_only():
            gradients = _sample_gradients.SampleGradients("bench", model, PER_SAMPLE_LOSS)
            for _ in gradients.each(x, y, 0, BATCH):
                pass
        return per_sample_only
    if impl == "per-sample-grads":
        def per_sample_grads():
            for start in range(0, BATCH, CHUNK):
                loss.per_sample_grads(model, PER_SAMPLE_LOSS, x[start:start + CHUNK],
                                      y[start:start + CHUNK])
        return per_sample_grads
    mode = impl.split("-", 1)[1]
    if impl.startswith("detsum-"):
        return lambda: loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, mode=mode,
                                       chunk_size=CHUNK)
    block = factored_block(model, x[:CHUNK], y[:CHUNK])

    def reduction():
        accumulator = loss.GradAccumulator(model.named_parameters(), mode=mode)
        for _ in range(BATCH // CHUNK):
            accumulator.add(block)
        return accumulator.result("mean")
    return reduction


def factored_block(model, x, y) -> dict:
    """The per-sample gradients of ``x`` in the form batch_grad gathers them: OuterProducts
    for the nn.Linear weights, rows for the rest."""
    gradients = _sample_gradients.SampleGradients("bench", model, PER_SAMPLE_LOSS)
    samples = list(gradients.each(x, y, 0, x.shape[0]))
    block = {}
    for name, first in samples[0].items():
        if isinstance(first, loss.OuterProducts):
            block[name] = loss.OuterProducts(torch.stack([s[name].left for s in samples]),
                                             torch.stack([s[name].right for s in samples]))
        else:
            block[name] = torch.stack([s[name] for s in samples])
    return block


def measure_peak_mib(device: str, chunk_size: int, mode: str) -> float:
    """One batch_grad call's peak memory above the model and batch, in a fresh process."""
    model, x, y = make_problem(device)
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, mode=mode, chunk_size=chunk_size)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    # Warm-up on 2 samples first, so that Numba's compiled kernels are not counted.
    loss.batch_grad(model, PER_SAMPLE_LOSS, x[:2], y[:2], mode=mode, chunk_size=2)
    before_kib = _status_kib("VmRSS")
    loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, mode=mode, chunk_size=chunk_size)
    return (_status_kib("VmHWM") - before_kib) / 1024


def _status_kib(field: str) -> int:
    """A memory figure of this process from /proc: VmRSS (now) or VmHWM (its peak). Not
    getrusage's ru_maxrss: Linux carries the parent's peak into a child across fork and exec,
    while VmHWM belongs to the process's own address space, new at exec."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peaks(device: str, mode: str) -> dict:
    """{chunk size: peak MiB}, each from its own process (a process's peak only grows)."""
    key = f"{device}-{mode}"
    if key not in _peaks:
        _peaks[key] = {}
        for chunk_size in PEAK_CHUNKS:
            out = subprocess.run(
                [sys.executable, str(pathlib.Path(__file__).resolve()), device,
                 str(chunk_size), mode],
                check=True, capture_output=True, text=True,
                cwd=pathlib.Path(__file__).resolve().parents[1])
            _peaks[key][chunk_size] = json.loads(out.stdout.strip().splitlines()[-1])
    return _peaks[key]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("device", DEVICES)
def test_batch_grad(benchmark, device, impl):
    benchmark.group = f"loss batch_grad {device}"
    model, x, y = problem(device)
    fn = _fn(impl, model, x, y)
    fn()
    sync(device)
    parameters = sum(p.numel() for p in model.parameters())
    info = {"primitive": "loss.batch_grad", "device": device, "dtype": "fp32", "impl": impl,
            "case": f"MLP {parameters} parameters, batch {BATCH}, chunk {CHUNK}"}
    baseline = "loss.mean().backward()"
    baseline_case = f"test_batch_grad[{device}-torch-mean-backward]"
    if impl.startswith("reduction-"):
        baseline = "batch_grad (the reduction's share of it)"
        baseline_case = f"test_batch_grad[{device}-detsum-{impl.split('-', 1)[1]}]"
    if impl.startswith("detsum-"):
        info["peak_mib"] = peaks(device, impl.split("-", 1)[1])
        info["unchunked_per_sample_mib"] = BATCH * parameters * 4 / 2**20
    run_case(benchmark, fn, device, rounds=ROUNDS[device], warmup_rounds=0, info=info,
             baseline=baseline, baseline_case=baseline_case)


if __name__ == "__main__":
    # python benches/bench_loss.py DEVICE CHUNK MODE: print one peak, in MiB (see peaks()).
    print(json.dumps(measure_peak_mib(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
