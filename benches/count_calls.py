"""What each call of the issue "One plan, one launch" asks of a GPU, counted without one.

For every row of ``tests/launch_counter.py``'s ``ROWS`` (segment_sum, index_add and
scatter_reduce in "fp32" and "kahan" at each check level, a sorted index, forward + backward
of each primitive, an MoE layer, torch_scatter's ``scatter``), on the path CUDA tensors take
(the triton backend in Triton's interpreter, values checked as a GPU's): device ops (aten
compute ops + Triton launches), host reads, allocations and sorts of an index.
tests/test_launch_budget.py holds the calls to these numbers (none may grow) and to the
issue's targets.

    python benches/count_calls.py [--detail] [ROW-SUBSTRING ...]

``--detail`` lists, under each row, the aten ops by name, the launches with their grids,
where each host read happens and the dtype of each sort's keys.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

COLUMNS = ("device_ops", "launches", "aten_ops", "host_reads", "allocations", "sorts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--detail", action="store_true")
    parser.add_argument("rows", nargs="*", help="only the rows whose name holds one of these")
    args = parser.parse_args()
    # The calls run on CPU tensors in Triton's interpreter, on a machine with a GPU too: it
    # must be on before triton is first imported.
    os.environ["TRITON_INTERPRET"] = "1"
    # The harness lives with the tests: imported here, not at the top, so that pytest's
    # collection of benches/ never puts tests/ on the path.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    import launch_counter

    names = [name for name in launch_counter.ROWS
             if not args.rows or any(part in name for part in args.rows)]
    width = max(map(len, names), default=4)
    print(f"| {'call':{width}s} | " + " | ".join(c.replace("_", " ") for c in COLUMNS) + " |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * (len(c) + 2) for c in COLUMNS) + "|")
    for name in names:
        counts = launch_counter.count_row(name)
        summary = counts.summary()
        print(f"| {name:{width}s} | " + " | ".join(f"{summary[c]:{len(c)}d}" for c in COLUMNS)
              + " |")
        if args.detail:
            print(f"    ops: {dict(counts.ops)}")
            print(f"    launches: {counts.launches}")
            print(f"    host reads: {counts.host_reads}")
            print(f"    allocations: {dict(counts.allocations)}")
            print(f"    sorts' keys: {[str(dtype) for dtype in counts.sort_keys]}")


if __name__ == "__main__":
    main()
