"""The sum over ranks on a GPU: NCCL, world size 1, CUDA tensors, the code path of gloo's.

Run by ``bash benches/gpu_run.sh distributed`` on a lent GPU (one GPU: one rank). Every check
compares bits with ``torch.equal`` against the same computation without a group, and the
script exits with status 1 if any differs. It also times the exact sum over ranks against an
fp32 ``all_reduce`` of the same gradients (1.32M parameters): with one rank NCCL moves nothing
between GPUs, so the difference is the exact path's own work on the device.

``python benches/distributed_nccl.py --backend gloo --device cpu`` runs the same checks on a
CPU, as a dry run.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import detsum
from detsum import distributed, loss

PER_SAMPLE_LOSS = nn.CrossEntropyLoss(reduction="none")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check(name: str, same: bool, failures: list[str]) -> None:
    print(f"{'same bits' if same else 'DIFFERENT'}  {name}")
    if not same:
        failures.append(name)


def checks(device: torch.device, group) -> list[str]:
    failures: list[str] = []
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(37, 5, 3, generator=g, dtype=torch.float64)
            * torch.exp2(torch.randint(-40, 41, (37, 5, 3), generator=g).double()))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        data = rows.to(dtype).to(device)
        first = detsum.RunningSum((5, 3), dtype=dtype, device=device, mode="exact")
        first.add(data[:20])
        second = detsum.RunningSum((5, 3), dtype=dtype, device=device, mode="exact")
        second.add(data[20:])
        first.merge(second)
        running = detsum.RunningSum((5, 3), dtype=dtype, device=device, mode="exact")
        running.add(data)
        distributed.all_reduce_(running, group)
        check(f"all_reduce_ {dtype}: state of the merge", torch.equal(running.state(),
                                                                     first.state()), failures)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4)).eval().to(device)
    x = torch.randn(16, 10, generator=g).to(device)
    y = torch.randint(0, 4, (16,), generator=g).to(device)
    for reduction in ("mean", "sum"):
        alone = loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, reduction=reduction,
                                mode="exact")
        ranks = loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, reduction=reduction,
                                mode="exact", group=group)
        check(f"batch_grad {reduction}", all(torch.equal(alone[n], ranks[n]) for n in alone),
              failures)
    accumulator = loss.GradAccumulator(model.named_parameters(), mode="exact", group=group)
    accumulator.add(loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y))
    alone = loss.batch_grad(model, PER_SAMPLE_LOSS, x, y, mode="exact")
    result = accumulator.result()
    check("GradAccumulator mean", all(torch.equal(alone[n], result[n]) for n in alone),
          failures)
    losses = PER_SAMPLE_LOSS(model(x), y).detach()
    weights = torch.rand(16, generator=g).to(device)
    for weight in (None, weights):
        for reduction in ("mean", "sum"):
            check(f"reduce {reduction}{' weighted' if weight is not None else ''}",
                  torch.equal(loss.reduce(losses, reduction, weight=weight, mode="exact"),
                              loss.reduce(losses, reduction, weight=weight, mode="exact",
                                          group=group)), failures)

    # A few SGD steps, as in docs/distributed_example.py.
    trained = []
    for with_group in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4)).eval().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(5):
            share = slice(2 * step, 2 * step + 8)
            grads = loss.batch_grad(model, PER_SAMPLE_LOSS, x[share], y[share], mode="exact",
                                    group=group if with_group else None)
            for name, p in model.named_parameters():
                p.grad = grads[name]
            optimizer.step()
        trained.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    check("5 SGD steps", torch.equal(*trained), failures)

    try:
        distributed.all_reduce_(detsum.RunningSum((3,), device=device, mode="fp32"), group)
        failures.append("a fp32 running sum was not refused")
    except ValueError as error:
        print(f"refused as expected: {error}")
    return failures


def timings(device: torch.device, group, rounds: int = 20) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(),
                          nn.Linear(1024, 10)).eval().to(device)
    x = torch.randn(4, 256, device=device)
    y = torch.randint(0, 10, (4,), device=device)
    per_sample = loss.per_sample_grads(model, PER_SAMPLE_LOSS, x, y)
    accumulator = loss.GradAccumulator(model.named_parameters(), mode="exact", group=group)
    accumulator.add(per_sample)
    states = [(block.state, accumulator.count) for block in accumulator._blocks.values()]
    out = [torch.empty_like(state) for state, _ in states]
    flat = torch.cat([g.mean(0).reshape(-1) for g in per_sample.values()])
    buffer = torch.empty_like(flat)
    sent: dict = {}

    def exact():
        distributed.sum_over_ranks("timing", group, states, accumulator._fields, out=out,
                                   sent=sent)

    def fp32():
        dist.all_reduce(buffer.copy_(flat), group=group)

    for name, fn in (("fp32 all_reduce", fp32), ("exact sum over ranks", exact),
                     ("GradAccumulator.result (sum and rounding)", accumulator.result)):
        fn()
        times = []
        for _ in range(rounds):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - start)
        quartiles = statistics.quantiles(times, n=4)
        print(f"{name:45s} median {1e3 * statistics.median(times):8.2f} ms  "
              f"IQR {1e3 * (quartiles[2] - quartiles[0]):.2f} ms")
    print(f"{flat.numel()} elements: fp32 {4 * flat.numel()} bytes, exact "
          f"{sent['payload_bytes'] + sent['header_bytes']} bytes "
          f"({(sent['payload_bytes'] + sent['header_bytes']) / flat.numel():.1f} per element)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        # set_device wants an index: "cuda" alone is refused (torch 2.11).
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        print(f"backend {dist.get_backend()}, device {device}, torch {torch.__version__}")
        failures = checks(device, dist.group.WORLD)
        timings(device, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    if failures:
        print(f"{len(failures)} checks failed: {failures}")
        return 1
    print("every check gave the same bits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
