"""Data-parallel SGD whose parameters are the same bits on 1, 2 and 4 ranks, next to plain DDP.

Run: ``python docs/distributed_example.py`` (it starts gloo processes on this machine; the test
suite runs the same functions, tests/test_distributed.py).

A small MLP is trained for 20 SGD steps on a fixed dataset of 64 samples, 16 per step, with 1,
2 and 4 ranks; each rank holds its share of every step's batch. Two ways:

- exact: every rank computes ``loss.batch_grad(..., mode="exact", group=group)`` on its share:
  the mean gradient over the whole step batch, summed over the ranks as integers, the same bits
  for any number of ranks. Then a plain ``torch.optim.SGD`` step, elementwise, so the same too;
- DDP: ``torch.nn.parallel.DistributedDataParallel``: each rank's ``cross_entropy`` mean,
  averaged over the ranks by a floating-point all-reduce. Its gradient is rounded differently
  for every number of ranks, and the difference grows over the steps.

The example prints, for each world size, how far its parameters after the last step are from
those of one rank. Equality across world sizes holds on one machine type, torch build and
thread count (the per-sample gradients come from torch's kernels); every process here uses one
thread.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from detsum import loss

STEPS, SAMPLES, STEP_BATCH = 20, 64, 16
FEATURES, HIDDEN, CLASSES = 10, 32, 4
LEARNING_RATE = 0.5
WORLD_SIZES = (1, 2, 4)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # eval(): no dropout or batch-norm statistics, so one well-defined gradient per sample.
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, CLASSES)).eval()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    targets = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    return inputs, targets


def my_share(step: int, rank: int, world_size: int) -> slice:
    """This rank's samples of the step's batch: an equal contiguous share (DDP's mean of the
    ranks' means is the batch mean only for equal shares)."""
    first = (step * STEP_BATCH) % SAMPLES + rank * (STEP_BATCH // world_size)
    return slice(first, first + STEP_BATCH // world_size)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_exact(group) -> torch.Tensor:
    model = make_model()
    inputs, targets = make_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    per_sample_loss = nn.CrossEntropyLoss(reduction="none")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    for step in range(STEPS):
        share = my_share(step, rank, world_size)
        grads = loss.batch_grad(model, per_sample_loss, inputs[share], targets[share],
                                mode="exact", group=group)
        for name, p in model.named_parameters():
            p.grad = grads[name]
        optimizer.step()
    return flat_parameters(model)


def train_ddp(group) -> torch.Tensor:
    model = make_model()
    inputs, targets = make_data()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    for step in range(STEPS):
        share = my_share(step, rank, world_size)
        optimizer.zero_grad()
        F.cross_entropy(ddp(inputs[share]), targets[share]).backward()
        optimizer.step()
    return flat_parameters(model)


def train(group) -> dict[str, torch.Tensor]:
    """Both trainings on the ranks of ``group`` (every rank calls it): the parameters after
    the last step, flattened."""
    return {"exact": train_exact(group), "DDP": train_ddp(group)}


def compare(parameters: dict[int, dict[str, torch.Tensor]]) -> dict:
    """``parameters[world_size][way]`` against one rank's: print a table, return the figures."""
    one_rank = parameters[1]
    summary = {}
    print(f"{'world size':>10}  {'exact: differing parameters':>28}  "
          f"{'DDP: differing parameters':>26}  {'DDP: max |diff|':>15}")
    for world_size, by_way in sorted(parameters.items()):
        row = {}
        for way, values in by_way.items():
            differ = values != one_rank[way]
            row[way] = {"differing": int(differ.sum()), "of": values.numel(),
                        "max_abs": float((values - one_rank[way]).abs().max()),
                        "same_bits": torch.equal(values, one_rank[way])}
        summary[world_size] = row
        exact, ddp = row["exact"], row["DDP"]
        print(f"{world_size:>10}  {exact['differing']:>14} of {exact['of']:<10}  "
              f"{ddp['differing']:>12} of {ddp['of']:<10}  {ddp['max_abs']:>15.3g}")
    return summary


# ---- starting the processes (the test suite starts its own, and calls train() in them) -------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world_size: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)  # the per-sample gradients' bits follow the thread count
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        result = train(dist.group.WORLD)
        if rank == 0:
            torch.save(result, os.path.join(folder, f"{world_size}.pt"))
    finally:
        dist.destroy_process_group()


def main() -> dict:
    import torch.multiprocessing as mp

    parameters = {}
    with tempfile.TemporaryDirectory() as folder:
        for world_size in WORLD_SIZES:
            mp.spawn(worker, args=(world_size, free_port(), folder), nprocs=world_size)
            parameters[world_size] = torch.load(os.path.join(folder, f"{world_size}.pt"))
    return compare(parameters)


if __name__ == "__main__":
    main()
