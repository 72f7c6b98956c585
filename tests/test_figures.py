"""``python -m detsum figures --quick``: the documentation's pictures are drawn by a command, and
the accuracy data says what the pictures claim."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

RESULTS = pathlib.Path(__file__).parents[1] / "benches" / "results"


def test_figures_command_draws_both_pictures(tmp_path):
    data_path = tmp_path / "figures.json"
    command = [sys.executable, "-m", "detsum", "figures", "--quick", "--out", str(tmp_path),
               "--json", str(data_path)]
    for bench in sorted(RESULTS.glob("*.json")):
        command += ["--bench", str(bench)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for picture in ("accuracy.png", "speed.png"):
        assert (tmp_path / picture).read_bytes().startswith(b"\x89PNG"), picture
    data = json.loads(data_path.read_text())
    accuracy = data["accuracy"]
    for dtype, datasets in accuracy["ulps"].items():
        for dataset, methods in datasets.items():
            assert max(methods["kahan"]["max"]) <= 1, (dtype, dataset)
            assert accuracy["autograd_equals_index_put"][dtype][dataset], (dtype, dataset)
    # The stagnation the picture shows: bf16 rounding after every add, positive terms.
    well = accuracy["ulps"]["bf16"]["well-conditioned"]
    assert well["autograd"]["max"][-1] > 10 and well["fp32"]["max"][-1] == 0
    # Each panel names its machine: the CPU from pytest-benchmark's machine_info, the GPU from
    # the environment the benchmark conftest records.
    # A panel holds one machine's measurements: CPU results of an Intel Xeon and of an AMD EPYC
    # were once drawn as one "cpu" panel titled with both.
    for name, panel in data["speed"]["devices"].items():
        assert panel["machine"], name
        assert name == f"{panel['device']}: {panel['machine']}"
        sources = {bar["source"] for case in panel["cases"] for bar in case["bars"]}
        assert {_machine(source, panel["device"]) for source in sources} == {panel["machine"]}


def _machine(path: str, device: str) -> str:
    results = json.loads(pathlib.Path(path).read_text())
    if device == "cuda":
        return results["detsum_environment"]["gpu"]
    return results["machine_info"]["cpu"]["brand_raw"]
