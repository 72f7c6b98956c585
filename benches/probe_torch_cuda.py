"""Which accumulating CUDA kernel torch runs, under ``use_deterministic_algorithms(True)``, for
each form of the ops whose bits "autograd" mode reproduces (torch picks its arithmetic by the
kernel: see docs/determinism.md). Prints one line per form; with a path, also saves every
input and output there (``torch.save``) for checking detsum's rules offline against the
reference's (``detsum.reference._cuda_small_stride`` and its neighbours):

    python3 benches/probe_torch_cuda.py [OUT.pt]

Needs a CUDA device. ``benches/results/gpu-h200-2026-11-26-fourth/torch-cuda-kernels.txt`` is
its output on an H200 with torch 2.11.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

ROWS, COLUMNS = 7, 5


def hot_index(n: int, seed: int) -> torch.Tensor:
    """``n`` rows into ``ROWS``, about 70% of them into row 0."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, ROWS, (n,), generator=generator)
    index[torch.rand(n, generator=generator) < 0.7] = 0
    return index


def forms(n: int) -> dict:
    """(name -> function of (x, src, row index, elementwise index))."""
    def wide(i):
        return i.view(-1, 1).expand(n, COLUMNS)  # a stride-0 broadcast of the row index

    def column(t):
        return t[:, 0].contiguous()

    return {
        "scatter_add wide": lambda x, s, i, e: x.scatter_add(0, wide(i), s),
        "scatter_add elementwise": lambda x, s, i, e: x.scatter_add(0, e, s),
        "scatter_add 1d": lambda x, s, i, e: column(x).scatter_add(0, i, column(s)),
        "index_add": lambda x, s, i, e: x.index_add(0, i, s),
        "index_add 1d": lambda x, s, i, e: column(x).index_add(0, i, column(s)),
        "index_put": lambda x, s, i, e: x.index_put((i,), s, accumulate=True),
        "scatter_reduce sum": lambda x, s, i, e: x.scatter_reduce(0, e, s, "sum"),
        "scatter_reduce mean": lambda x, s, i, e: x.scatter_reduce(0, e, s, "mean"),
        "scatter_reduce mean noself": lambda x, s, i, e: x.scatter_reduce(
            0, e, s, "mean", include_self=False),
        "scatter_reduce mean wide": lambda x, s, i, e: x.scatter_reduce(0, wide(i), s, "mean"),
        "index_reduce mean": lambda x, s, i, e: x.index_reduce(0, i, s, "mean"),
    }


def kernels_of(call, arguments) -> tuple[torch.Tensor | None, str]:
    """(the result on the host or None, the accumulating kernels it ran or torch's refusal)."""
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as profiled:
            out = call(*arguments)
            torch.cuda.synchronize()
    except RuntimeError as error:
        return None, "refused: " + str(error)[:60] + "..."
    names = [e.name.replace("void ", "").replace("(anonymous namespace)::", "").split("<")[0]
             for e in profiled.events() if e.device_type.name == "CUDA"]
    ran = [n for n in dict.fromkeys(names) if "indexing_backward" in n or "scatter_gather" in n]
    return out.cpu(), " + ".join(ran)


def main(path: str | None) -> None:
    records, seen = [], {}
    torch.use_deterministic_algorithms(True)
    for n in (5, 33, 40, 100, 600, 2000):
        for dtype in (torch.float32, torch.bfloat16):
            generator = torch.Generator().manual_seed(n)
            x = torch.randn(ROWS, COLUMNS, generator=generator).to(dtype)
            src = torch.randn(n, COLUMNS, generator=generator).to(dtype)
            index = hot_index(n, n + 1)
            elementwise = hot_index(COLUMNS * n, n + 2).view(n, COLUMNS)
            on_device = [t.cuda() for t in (x, src, index, elementwise)]
            for name, call in forms(n).items():
                out, ran = kernels_of(call, on_device)
                seen.setdefault(name, set()).add(ran)
                records.append(dict(n=n, dtype=str(dtype), name=name, x=x, src=src,
                                    index=index, elementwise=elementwise, out=out, kernels=ran))
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}, under "
          "use_deterministic_algorithms(True): the accumulating CUDA kernel of each form "
          f"(x of {ROWS}x{COLUMNS}, float32 and bfloat16, n = 5..2000 source rows, about 70% "
          "into row 0)")
    for name, ran in seen.items():
        print(f"  {name:28s} {' | '.join(sorted(ran))}")
    if path:
        torch.save(dict(torch=torch.__version__, records=records), path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
