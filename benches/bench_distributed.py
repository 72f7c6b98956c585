"""Sums over ranks (gloo, CPU processes on this machine): detsum's exact all-reduce against a
plain fp32 ``all_reduce`` of the same gradients, and an exact data-parallel step against DDP.

The pytest process is rank 0 of a gloo group of 2 or 4 processes; the other ranks are spawned
helpers. Before each case rank 0 broadcasts its name and how many calls it will time, and every
rank then makes the same calls, so the collectives pair up. The times are rank 0's: a step or a
collective ends there no sooner than the slowest rank lets it. Every process uses one thread
(4 ranks share the 2 cores of the CI machine).

Gradients (``extra_info["gradients"]``): the worked example's MLP (docs/distributed_example.py,
484 parameters: the all-reduce's fixed cost) and a wider MLP (256-1024-1024-10, 1.32M
parameters: its cost per byte), each rank's from the per-sample gradients of 4 samples.

Cases (group "distributed <W> ranks"):

- ``fp32-all_reduce``: ``torch.distributed.all_reduce`` of every parameter's fp32 gradient as
  one flat tensor (what DDP sends, without its buckets): the baseline;
- ``exact-all_reduce``: the exact sum over ranks of the same gradients' ``"exact"`` states,
  every parameter in one header and one payload (what ``GradAccumulator.result()`` does with a
  group before it rounds, and ``detsum.distributed.all_reduce_`` for one running sum);
- ``exact-whole-state``: the whole states all-reduced as they are (``L + 4`` int64 per element
  and the count) and normalised again, as ``state()``, ``all_reduce`` and ``load_state`` do:
  what the wire carried before the limb window;
- ``ddp-step``: one SGD step of the worked example with ``DistributedDataParallel``, 16
  samples per step shared by the ranks: the baseline of the steps;
- ``exact-step``: the same step with ``loss.batch_grad(mode="exact", group=...)``;
- ``exact-step-local``: the exact step without the sum over ranks (``group=None`` on the same
  shard): ``exact-step`` minus this is the exchange's share;
- ``per-sample-only``: the per-sample gradients of the shard alone (``loss.per_sample_grads``).

``extra_info``: ``elements`` (gradient elements), ``wire_bytes`` (the bytes each rank hands to
the all-reduces per call, header included; gloo's ring then sends about ``2 (W - 1) / W`` of
that per rank), ``bytes_per_element``, and the ratio to the case's baseline.
"""

from __future__ import annotations

import datetime
import importlib.util
import pathlib
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from conftest import run_case
from detsum import _kernel_ops, _limbs, distributed, loss

WORLD_SIZES = (2, 4)
ALL_REDUCE_IMPLS = ["fp32-all_reduce", "exact-all_reduce", "exact-whole-state"]
STEP_IMPLS = ["ddp-step", "exact-step", "exact-step-local", "per-sample-only"]
GRADIENTS = ("example", "mlp")
SAMPLES_PER_RANK = 4
ROUNDS = {"all_reduce": 30, "step": 100}
WARMUP = 3
PER_SAMPLE_LOSS = nn.CrossEntropyLoss(reduction="none")


def _example():
    path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "distributed_example.py"
    spec = importlib.util.spec_from_file_location("distributed_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Rank:
    """What one rank computes for each case: the same on every rank, in the same order."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.example = _example()
        self.last_sent: dict = {}

    def gradients(self, which: str):
        """(per-sample gradients of this rank's samples, the model)."""
        if which == "example":
            model = self.example.make_model()
            x, y = self.example.make_data()
        else:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024),
                                  nn.Tanh(), nn.Linear(1024, 10)).eval()
            g = torch.Generator().manual_seed(1)
            x = torch.randn(SAMPLES_PER_RANK * self.world_size, 256, generator=g)
            y = torch.randint(0, 10, (len(x),), generator=g)
        mine = slice(self.rank * SAMPLES_PER_RANK, (self.rank + 1) * SAMPLES_PER_RANK)
        return loss.per_sample_grads(model, PER_SAMPLE_LOSS, x[mine], y[mine]), model

    def all_reduce(self, impl: str, which: str):
        per_sample, model = self.gradients(which)
        accumulator = loss.GradAccumulator(model.named_parameters(), mode="exact",
                                           group=dist.group.WORLD)
        accumulator.add(per_sample)
        elements = sum(g[0].numel() for g in per_sample.values())
        if impl == "fp32-all_reduce":
            flat = torch.cat([g.mean(0).reshape(-1) for g in per_sample.values()])
            buffer = torch.empty_like(flat)

            def fp32_all_reduce():
                dist.all_reduce(buffer.copy_(flat))
            self.last_sent = {"payload_bytes": flat.numel() * 4, "header_bytes": 0}
            return fp32_all_reduce, elements
        states = [(block.state, accumulator.count) for block in accumulator._blocks.values()]
        if impl == "exact-all_reduce":
            # Into buffers allocated once, as GradAccumulator.result() does.
            out = [torch.empty_like(state) for state, _ in states]

            def exact_all_reduce():
                distributed.sum_over_ranks("bench", dist.group.WORLD, states,
                                           accumulator._fields, out=out, sent=self.last_sent)
            return exact_all_reduce, elements
        whole = torch.cat([torch.cat([torch.tensor([count]), state.reshape(-1)])
                           for state, count in states])
        buffer = torch.empty_like(whole)

        def whole_state():
            # state(), all_reduce, load_state: the limbs normalised again afterwards.
            dist.all_reduce(buffer.copy_(whole))
            start = 1
            for state, _ in states:
                summed = buffer[start:start + state.numel()].view(state.shape)
                _kernel_ops.normalise_limbs(summed[:state.shape[0] - _limbs.COUNTERS])
                start += state.numel() + 1
        self.last_sent = {"payload_bytes": whole.numel() * 8, "header_bytes": 0}
        return whole_state, elements

    def step(self, impl: str):
        example = self.example
        model = example.make_model()
        x, y = example.make_data()
        share = example.my_share(0, self.rank, self.world_size)
        elements = sum(p.numel() for p in model.parameters())
        if impl == "ddp-step":
            ddp = nn.parallel.DistributedDataParallel(model)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=example.LEARNING_RATE)

            def ddp_step():
                optimizer.zero_grad()
                F.cross_entropy(ddp(x[share]), y[share]).backward()
                optimizer.step()
            return ddp_step, elements
        if impl == "per-sample-only":
            return lambda: loss.per_sample_grads(model, PER_SAMPLE_LOSS, x[share],
                                                 y[share]), elements
        optimizer = torch.optim.SGD(model.parameters(), lr=example.LEARNING_RATE)
        group = dist.group.WORLD if impl == "exact-step" else None

        def exact_step():
            grads = loss.batch_grad(model, PER_SAMPLE_LOSS, x[share], y[share], mode="exact",
                                    group=group)
            for name, p in model.named_parameters():
                p.grad = grads[name]
            optimizer.step()
        return exact_step, elements

    def case(self, name: str):
        impl, _, which = name.partition("/")
        if impl in ALL_REDUCE_IMPLS:
            return self.all_reduce(impl, which)
        return self.step(impl)


def _helper(index: int, world_size: int, port: int) -> None:
    """Ranks 1 .. W-1: run what rank 0 orders until it orders nothing."""
    torch.set_num_threads(1)
    rank = index + 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=300))
    me = _Rank(rank, world_size)
    while True:
        order = [None]
        dist.broadcast_object_list(order, src=0)
        name, calls = order[0]
        if name is None:
            break
        fn, _ = me.case(name)
        for _ in range(calls):
            fn()
    dist.destroy_process_group()


class _Group:
    def __init__(self, world_size: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.helpers = mp.start_processes(_helper, args=(world_size, port),
                                          nprocs=world_size - 1, join=False,
                                          start_method="spawn")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=world_size, timeout=datetime.timedelta(seconds=300))
        self.me = _Rank(0, world_size)

    def case(self, name: str, calls: int):
        dist.broadcast_object_list([(name, calls)], src=0)
        return self.me.case(name)

    def close(self):
        dist.broadcast_object_list([(None, 0)], src=0)
        dist.destroy_process_group()
        while not self.helpers.join():
            pass


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"{w}ranks")
def ranks(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    group = _Group(request.param)
    yield group
    group.close()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("impl", ALL_REDUCE_IMPLS)
@pytest.mark.parametrize("gradients", GRADIENTS)
def test_all_reduce(benchmark, ranks, gradients, impl):
    world_size = dist.get_world_size()
    benchmark.group = f"distributed {world_size} ranks"
    rounds = ROUNDS["all_reduce"]
    fn, elements = ranks.case(f"{impl}/{gradients}", rounds + WARMUP)
    info = {"primitive": "distributed all-reduce", "device": "cpu", "dtype": "fp32",
            "impl": impl, "gradients": gradients, "world_size": world_size,
            "elements": elements}
    run_case(benchmark, fn, "cpu", rounds=rounds, warmup_rounds=WARMUP, info=info,
             baseline="torch.distributed.all_reduce of the fp32 gradients",
             baseline_case=f"test_all_reduce[{world_size}ranks-{gradients}-fp32-all_reduce]")
    sent = ranks.me.last_sent
    benchmark.extra_info["wire_bytes"] = sent["payload_bytes"] + sent["header_bytes"]
    benchmark.extra_info["bytes_per_element"] = benchmark.extra_info["wire_bytes"] / elements


@pytest.mark.parametrize("impl", STEP_IMPLS)
def test_step(benchmark, ranks, impl):
    world_size = dist.get_world_size()
    benchmark.group = f"distributed {world_size} ranks"
    rounds = ROUNDS["step"]
    fn, elements = ranks.case(impl, rounds + WARMUP)
    info = {"primitive": "distributed step", "device": "cpu", "dtype": "fp32", "impl": impl,
            "world_size": world_size, "elements": elements,
            "case": "docs/distributed_example.py, 16 samples per step over the ranks"}
    run_case(benchmark, fn, "cpu", rounds=rounds, warmup_rounds=WARMUP, info=info,
             baseline="a DistributedDataParallel step",
             baseline_case=f"test_step[{world_size}ranks-ddp-step]")
