"""detsum.explain: honest rounding is never called a bug, real bugs still are (issue 12).

The verdicts are checked on real sums: detsum's own modes on the same bf16/fp16 rows, and the
worked example of docs/loss.md. The tests in tests/test_loss.py cover the original cases.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import detsum
from conftest import dtype_id, make_data

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
NARROW = (torch.bfloat16, torch.float16)
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11,
                 torch.bfloat16: 2.0**-8}
SMALLEST_SUBNORMAL = {torch.float64: 2.0**-1074, torch.float32: 2.0**-149,
                      torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}


def load_loss_example():
    """docs/loss_example.py as a module, for its four ways of averaging a gradient (not its
    main(), which tests/test_loss.py runs)."""
    path = pathlib.Path(__file__).parents[1] / "docs" / "loss_example.py"
    spec = importlib.util.spec_from_file_location("loss_example_ways", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def segment_sums(dtype, lengths, *, columns=16, seed=0, spread=False):
    """Rows of ``dtype`` cut into segments of ``lengths``; returns (rows, offsets, exact sum of
    |rows| per segment in float64: the magnitude of the sums)."""
    rows = make_data((sum(lengths), columns), dtype, seed=seed, spread=spread)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    magnitude = torch.stack([rows[lo:hi].double().abs().sum(0)
                             for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist())])
    return rows, offsets, magnitude


# ---- the seed scenario: docs/loss.md's snippet, no magnitude ----------------------------------

@pytest.fixture(scope="module")
def seed_scenario():
    example = load_loss_example()
    model, x, y = example.make_problem()
    per_sample_loss = torch.nn.CrossEntropyLoss(reduction="none")
    careful = {
        "1. 'none', backward each, average": example.none_then_average(model, x, y),
        "2. 'sum' / 16": example.sum_divided(model, x, y),
        "4. one at a time (careful)": example.one_at_a_time(model, x, y, careless=False),
    }
    for mode in ("fp32", "kahan"):  # the snippet's own call
        careful[f"batch_grad {mode}"] = example.flat(detsum.loss.batch_grad(
            model, per_sample_loss, x, y, reduction="mean", mode=mode, microbatch_size=8))
    careless = example.one_at_a_time(model, x, y, careless=True)
    return careful, careless, example.mean_reduction(model, x, y), len(x)


def test_seed_scenario_careful_ways_are_rounding_without_magnitude(seed_scenario):
    """Before: 4 to 26 of 837 elements (where the per-sample gradients cancel) were "not
    rounding", with the list of bug causes."""
    careful, _, autograd_grad, batch = seed_scenario
    for name, my_grad in careful.items():
        report = detsum.explain(my_grad, autograd_grad, terms=batch)
        assert report.verdict in ("identical", "rounding"), (name, str(report))
    report = detsum.explain(careful["batch_grad fp32"], autograd_grad, terms=batch)
    assert report.magnitude_estimated and report.largest_term == pytest.approx(
        max(careful["batch_grad fp32"].abs().max().item(), autograd_grad.abs().max().item()))
    assert "no magnitude given" in str(report) and "What to look for" not in str(report)


def test_seed_scenario_view_trap_still_caught_without_magnitude(seed_scenario):
    _, careless, autograd_grad, batch = seed_scenario
    report = detsum.explain(careless, autograd_grad, terms=batch)
    assert report.verdict == "not rounding" and report.exceeding > 0.9 * report.numel
    assert "view across zero_grad()" in str(report)


# ---- every figure at its own element -------------------------------------------------------------

def test_each_figure_names_its_own_element():
    """Largest absolute difference at [2], most ulps at [3] (opposite signs: the ulps from
    each value down to 0 add up), largest relative difference at [1] (opposite signs and
    equal sizes). Before: the report gave the largest ulps over all elements as if they were
    those of the largest difference's element."""
    a = torch.tensor([1.0, 1e-3, 100.0, 0.5])
    b = torch.tensor([1.0, -1e-3, 101.0, -0.25])
    report = detsum.explain(a, b, terms=4)
    ulps = detsum.reference.ulp_distance(a, b)
    assert (report.where, report.max_abs) == ((2,), 1.0)
    assert report.ulps_at_where == ulps[2].item() == 2**17  # fp32 steps of 2**-17 at 100
    assert (report.max_ulps_where, report.max_ulps) == ((3,), ulps[3].item())
    assert ulps[3] == 0x3F000000 + 0x3E800000  # the bit patterns of 0.5 and 0.25
    assert (report.max_rel_where, report.max_rel) == ((1,), 2.0)
    assert str(report).splitlines()[1:4] == [
        "largest difference 1 (131072 ulps of float32) at [2]: a = 100, b = 101; rounding "
        "bound there 0.000205",
        "largest distance 2105540608 ulps at [3]: a = 0.5, b = -0.25",
        "largest relative difference 2 at [1]: a = 0.00100000005, b = -0.00100000005"]


def test_seed_scenario_careless_report_names_each_figure_at_its_element(seed_scenario):
    """docs/loss.md's careless loop against 'mean': the largest difference and the most ulps
    are two elements (the latter where the two results have opposite signs). Before: the
    report put the largest ulps over all 837 elements at the largest difference's element."""
    _, careless, autograd_grad, batch = seed_scenario
    report = detsum.explain(careless, autograd_grad, terms=batch)
    difference = (careless.double() - autograd_grad.double()).abs()
    ulps = detsum.reference.ulp_distance(careless, autograd_grad)
    where, most_ulps = int(difference.argmax()), int(ulps.argmax())
    assert where != most_ulps and careless[most_ulps] * autograd_grad[most_ulps] < 0
    assert report.where == (where,) and report.max_ulps_where == (most_ulps,)
    assert report.ulps_at_where == ulps[where].item() < report.max_ulps == ulps.max().item()
    text = str(report)
    assert f"({ulps[where].item():.0f} ulps of float32) at [{where}]: " in text
    assert f"largest distance {ulps.max().item():.0f} ulps at [{most_ulps}]: " in text


# ---- dicts of tensors: name by name --------------------------------------------------------------

def split_like(flat: torch.Tensor, shapes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A flat gradient cut into ``shapes``' names and shapes, in their order."""
    parts = flat.split([t.numel() for t in shapes.values()])
    return {name: part.view(t.shape) for (name, t), part in zip(shapes.items(), parts)}


@pytest.fixture(scope="module")
def batch_grads():
    """loss.batch_grad's dicts in "fp32" and "kahan" mode, the careless loop's gradient cut
    into the same names, and each name's magnitude (the mean of |per-sample gradient|)."""
    example = load_loss_example()
    model, x, y = example.make_problem()
    per_sample_loss = torch.nn.CrossEntropyLoss(reduction="none")
    fp32, kahan = (detsum.loss.batch_grad(model, per_sample_loss, x, y, mode=mode)
                   for mode in ("fp32", "kahan"))
    careless = split_like(example.one_at_a_time(model, x, y, careless=True), fp32)
    per_sample = detsum.loss.per_sample_grads(model, per_sample_loss, x, y)
    magnitude = {name: g.abs().mean(0) for name, g in per_sample.items()}
    return fp32, kahan, careless, magnitude, len(x)


def test_dicts_compare_name_by_name(batch_grads):
    """Before: TypeError "a must be a float tensor, got dict"."""
    fp32, kahan, careless, magnitude, batch = batch_grads
    honest = detsum.explain(fp32, kahan, terms=batch, magnitude=magnitude)
    assert isinstance(honest, detsum.Explanations) and list(honest) == list(fp32)
    assert honest.verdict in ("identical", "rounding")
    for name in fp32:
        assert honest[name] == detsum.explain(fp32[name], kahan[name], terms=batch,
                                              magnitude=magnitude[name])
    assert "What to look for" not in str(honest)

    mixed = dict(careless, **{"2.bias": fp32["2.bias"]})  # one name honest
    report = detsum.explain(mixed, fp32, terms=batch)
    assert report.verdict == "not rounding"
    assert {name: part.verdict for name, part in report.items()} == {
        "0.weight": "not rounding", "0.bias": "not rounding", "2.weight": "not rounding",
        "2.bias": "identical"}
    lines = str(report).splitlines()
    assert lines[0] == "verdict: not rounding (of 4 tensors: 3 not rounding, 1 identical)"
    assert "'2.bias', float32 [5]: identical" in lines
    weight = report["0.weight"]
    assert "'0.weight', float32 [32, 20]: not rounding" in lines
    assert (f"  largest distance {weight.max_ulps:.0f} ulps at {list(weight.max_ulps_where)}"
            in str(report))
    assert str(report).count("view across zero_grad()") == 1
    # Without magnitude, each name's bound takes its own largest value.
    assert weight.largest_term == max(careless["0.weight"].abs().max().item(),
                                      fp32["0.weight"].abs().max().item())


def test_identical_dicts_and_empty_dicts():
    grads = {"w": torch.ones(3), "b": torch.zeros(1)}
    report = detsum.explain(grads, {k: v.clone() for k, v in grads.items()})
    assert report.verdict == "identical" and len(report) == 2
    assert str(report) == "identical: all 2 tensors have the same bits"
    assert detsum.explain({}, {}).verdict == "identical"


def test_dict_arguments_are_refused_in_detsums_words():
    grads = {"w": torch.ones(3), "b": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"detsum\.explain: a and b hold different names: "
                                         r"\['b'\] in a only, \['bias'\] in b only; expected "
                                         r"the same names"):
        detsum.explain(grads, {"w": torch.ones(3), "bias": torch.zeros(1)})
    with pytest.raises(TypeError, match=r"detsum\.explain: a is a dict but b is a Tensor; "
                                        r"expected two tensors, or two dicts of tensors"):
        detsum.explain(grads, torch.ones(3))
    with pytest.raises(TypeError, match=r"detsum\.explain: b\['b'\] must be a float tensor, "
                                        r"got torch.int64"):
        detsum.explain(grads, {"w": torch.ones(3), "b": torch.zeros(1, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"a\['w'\] is torch.float32 \(3,\) but b\['w'\] is "
                                         r"torch.float32 \(2,\)"):
        detsum.explain(grads, {"w": torch.ones(2), "b": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"a and magnitude hold different names: \['b'\] in a "
                                         r"only"):
        detsum.explain(grads, grads, magnitude={"w": 1.0})
    with pytest.raises(ValueError, match=r"magnitude\['w'\] has shape \(2,\); expected one "
                                         r"number or a tensor broadcastable to a\['w'\]'s shape "
                                         r"\(3,\)"):
        detsum.explain(grads, grads, magnitude={"w": torch.ones(2), "b": 1.0})
    with pytest.raises(TypeError, match=r"magnitude is a tensor of shape \(3,\) but a and b "
                                        r"are dicts"):
        detsum.explain(grads, grads, magnitude=torch.ones(3))
    with pytest.raises(TypeError, match=r"terms=1\.5"):
        detsum.explain(grads, grads, terms=1.5)
    assert detsum.explain(grads, grads, magnitude=2.0, terms=4).verdict == "identical"


# ---- "fp32" mode against "autograd" mode: per-add rounding in the dtype -----------------------

@pytest.mark.parametrize("dtype", NARROW, ids=dtype_id)
@pytest.mark.parametrize("length", [3, 8, 64, 300])  # 2 terms: the same bits both ways
def test_fp32_mode_against_autograd_mode_is_rounding(dtype, length):
    """"autograd" mode rounds to bf16/fp16 after every add; "fp32" mode once. Before: "not
    rounding" (the bound assumed every add in fp32), with or without magnitude."""
    rows, offsets, magnitude = segment_sums(dtype, [length] * 40)
    once = detsum.segment_sum(rows, offsets, mode="fp32")
    every_add = detsum.segment_sum(rows, offsets, mode="autograd")
    assert not torch.equal(once, every_add)
    for given_magnitude in (None, magnitude):
        report = detsum.explain(once, every_add, terms=length, magnitude=given_magnitude)
        assert report.verdict == "rounding", str(report)
        assert not report.rounded_once
    # Told (wrongly) that both rounded once, the sharper bound no longer covers "autograd".
    told_once = detsum.explain(once, every_add, terms=length, magnitude=magnitude,
                               rounded_once=True)
    assert told_once.verdict == "not rounding" and told_once.rounded_once


@pytest.mark.parametrize("dtype", NARROW, ids=dtype_id)
def test_fp32_mode_against_kahan_mode_is_rounding_when_rounded_once(dtype):
    rows, offsets, magnitude = segment_sums(dtype, [1, 5, 33, 200, 0, 17], spread=True)
    fp32 = detsum.segment_sum(rows, offsets, mode="fp32")
    kahan = detsum.segment_sum(rows, offsets, mode="kahan")
    report = detsum.explain(fp32, kahan, terms=200, magnitude=magnitude, rounded_once=True)
    assert report.verdict in ("identical", "rounding"), str(report)


@pytest.mark.parametrize("dtype", NARROW, ids=dtype_id)
def test_a_dropped_term_and_a_wrong_scale_are_still_bugs(dtype):
    lengths = [8] * 40
    rows, offsets, magnitude = segment_sums(dtype, lengths)
    honest = detsum.segment_sum(rows, offsets, mode="autograd")
    dropped = rows.clone()
    dropped[3] = 0  # the 4th term of the first segment never arrives
    buggy = detsum.segment_sum(dropped, offsets, mode="fp32")
    report = detsum.explain(buggy, honest, terms=8, magnitude=magnitude)
    assert report.verdict == "not rounding" and report.where[0] == 0, str(report)
    scaled = detsum.explain(honest * 2, honest, terms=8, magnitude=magnitude)
    assert scaled.verdict == "not rounding" and scaled.constant_ratio == 2


@PROPERTY
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       modes=st.sampled_from([("fp32", "autograd"), ("kahan", "autograd"), ("fp32", "kahan")]),
       lengths=st.lists(st.integers(0, 120), min_size=1, max_size=6).filter(any),
       spread=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_two_honest_modes_are_never_a_bug(dtype, modes, lengths, spread, seed):
    """Any two of detsum's modes on the same rows: never "not rounding", with the exact
    magnitude or without one. Without one the bound assumes no term is larger than the largest
    result, so one column holds copies of the largest term to make that true."""
    rows, offsets, magnitude = segment_sums(dtype, lengths, columns=6, seed=seed,
                                            spread=spread and dtype != torch.float16)
    rows[:, 0] = rows.abs().max()
    magnitude[:, 0] = rows[:, 0].double().abs().max() * torch.tensor(lengths).double()
    a, b = (detsum.segment_sum(rows, offsets, mode=mode) for mode in modes)
    terms = max(max(lengths), 1)
    note(f"{dtype} {modes} lengths={lengths}")
    for given_magnitude in (magnitude, None):
        report = detsum.explain(a, b, terms=terms, magnitude=given_magnitude)
        assert report.verdict != "not rounding", str(report)
    if "autograd" not in modes:
        report = detsum.explain(a, b, terms=terms, magnitude=magnitude, rounded_once=True)
        assert report.verdict != "not rounding", str(report)


def test_underflow_to_a_subnormal_is_rounding():
    """Three fp16 terms scaled by 1/3 before the sum underflow to 0, after it give the smallest
    subnormal: both honest. Before: "not rounding" (the bound was relative only)."""
    x = torch.full((3,), 2.0**-24, dtype=torch.float16)
    each_scaled = (x * (1 / 3)).sum()
    sum_scaled = (x.float().sum() / 3).half()
    assert each_scaled.item() == 0 and sum_scaled.item() == 2.0**-24
    report = detsum.explain(each_scaled, sum_scaled, terms=3, magnitude=2.0**-24)
    assert report.verdict == "rounding", str(report)


# ---- the bound: its formula, large term counts -------------------------------------------------

def next_up(t: torch.Tensor) -> torch.Tensor:
    """The next representable value above positive ``t``, by its bit pattern (any dtype)."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return (t.view(bits) + 1).view(t.dtype)


def expected_bound(a, b, *, n, magnitude, u_op, dtype):
    """The docstring's formula, computed independently in Python floats."""
    growth = 0.0
    for _ in range(n):  # (1 + u_op)**n - 1, one rounding at a time
        growth = growth + (1 + growth) * u_op
    u, eta = UNIT_ROUNDOFF[dtype], SMALLEST_SUBNORMAL[dtype]
    side = [min(growth * magnitude + u * abs(v) + n * eta, abs(v) + magnitude) for v in (a, b)]
    return side[0] + side[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64],
                         ids=dtype_id)
@pytest.mark.parametrize("rounded_once", [False, True])
def test_bound_is_the_documented_formula(dtype, rounded_once):
    a = torch.tensor([1.0], dtype=dtype)
    b = next_up(a)
    u = UNIT_ROUNDOFF[dtype]
    u_acc = UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    # Rounding to the dtype after an add done in the acc type rounds twice (acc, then dtype).
    u_op = u_acc if rounded_once or dtype in (torch.float32, torch.float64) else (
        (1 + u) * (1 + u_acc) - 1)
    report = detsum.explain(a, b, terms=4, magnitude=3.0, rounded_once=rounded_once)
    assert report.bound == pytest.approx(
        expected_bound(a.item(), b.item(), n=4, magnitude=3.0, u_op=u_op, dtype=dtype),
        rel=1e-12)
    assert report.verdict == "rounding" and report.rounded_once == rounded_once


@pytest.mark.parametrize("terms", [2**23, 2**24, 2**25, 2**40, 10**400],
                         ids=["2^23", "2^24", "2^25", "2^40", "10^400"])
def test_many_terms_give_a_valid_finite_bound(terms):
    """Before: 2**24 raised ZeroDivisionError and 2**25 gave a negative bound ("not rounding"
    for 1 ulp). n u >= 1 is no reason for either: (1 + u)^n - 1 is valid for every n."""
    a = torch.tensor([1.0, -3.0])
    b = torch.nextafter(a, torch.tensor([2.0, 2.0]))
    report = detsum.explain(a, b, terms=terms)
    assert report.verdict == "rounding" and 0 < report.bound < math.inf, str(report)
    assert report.terms == terms


def test_a_bound_beyond_the_magnitude_is_capped_and_says_so():
    """bf16 rounding after every add of 1024 terms: the per-term bound exceeds the terms'
    magnitude itself. The bound stays finite (|a| + |b| + 2 magnitude) and the report says
    the verdict cannot tell a bug from rounding."""
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    report = detsum.explain(a, a * 3, magnitude=4.0)
    assert report.vacuous and report.where == (1,)
    assert report.bound == pytest.approx(2 + 6 + 2 * 4.0)
    assert report.verdict == "rounding" and "cannot tell" in str(report)
    sharp = detsum.explain(a, a * 3, magnitude=4.0, rounded_once=True)
    assert not sharp.vacuous and sharp.verdict == "not rounding"


def test_a_constant_ratio_within_rounding_is_not_called_a_scale_mismatch():
    """Before: a 1-ulp difference on equal values was reported as "a scale mismatch"."""
    a = torch.ones(4)
    report = detsum.explain(a, next_up(a), terms=2)
    assert report.verdict == "rounding" and "scale mismatch" not in str(report)


# ---- NaN and infinities -----------------------------------------------------------------------

@pytest.mark.parametrize("pair", [
    (float("nan"), 1.0), (1.0, float("nan")), (float("inf"), -float("inf")),
    (float("inf"), 3.0e38), (-float("inf"), 1.0), (float("nan"), float("inf")),
], ids=["nan-1", "1-nan", "inf--inf", "inf-max", "-inf-1", "nan-inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_nan_or_inf_on_one_side_only_is_never_rounding(pair, dtype):
    """Before: NaN against 1.0 and +inf against -inf were "rounding" (an inf or NaN bound)."""
    a = torch.tensor([pair[0], 1.0, 2.0]).to(dtype)
    b = torch.tensor([pair[1], 1.0, 2.0]).to(dtype)
    for terms in (None, 1, 10**6):
        report = detsum.explain(a, b, terms=terms)
        assert report.verdict == "not rounding", str(report)
        assert report.nonfinite_mismatches == 1 and report.where == (0,)
        assert "NaN or infinite" in str(report)


def test_matching_nan_and_inf_do_not_hide_a_bug_or_call_rounding_one():
    special = torch.tensor([float("nan"), float("inf"), -float("inf")])
    a = torch.cat([special, torch.tensor([1.0, 2.0, 3.0])])
    near = torch.cat([special, torch.nextafter(a[3:], torch.tensor(4.0))])
    report = detsum.explain(a, near, terms=4)
    assert report.verdict == "rounding" and report.nonfinite_mismatches == 0, str(report)
    assert math.isfinite(report.bound) and report.largest_term == near[5].item()
    # The infinities must not make the norm-wise bound infinite: a wrong scale is still a bug.
    wrong = torch.cat([special, a[3:] * 1.5])
    assert detsum.explain(a, wrong, terms=4).verdict == "not rounding"


# ---- arguments: errors in detsum's words ------------------------------------------------------

@pytest.mark.parametrize("terms", [True, False, 1.9, 16.0, "abc", [16], object()])
def test_terms_of_the_wrong_type_are_refused(terms):
    with pytest.raises(TypeError, match=r"detsum\.explain: terms=.*; expected a positive int"):
        detsum.explain(torch.ones(2), torch.ones(2), terms=terms)


@pytest.mark.parametrize("terms", [0, -3])
def test_terms_below_one_are_refused(terms):
    with pytest.raises(ValueError, match=rf"detsum\.explain: terms={terms}; expected a positive"):
        detsum.explain(torch.ones(2), torch.ones(2), terms=terms)


def test_terms_accepts_integer_likes():
    import numpy as np
    for terms in (np.int64(16), torch.tensor(16)):
        assert detsum.explain(torch.ones(2), torch.ones(2), terms=terms).terms == 16


def test_magnitude_is_checked():
    a = torch.ones(5)
    with pytest.raises(ValueError, match=r"detsum\.explain: magnitude has shape \(3,\); expected "
                                         r"one number or a tensor broadcastable to a's shape "
                                         r"\(5,\)"):
        detsum.explain(a, a, magnitude=torch.ones(3))
    with pytest.raises(ValueError, match=r"magnitude has shape \(2, 5\)"):
        detsum.explain(a, a, magnitude=torch.ones(2, 5))  # would broadcast a, not magnitude
    with pytest.raises(ValueError, match=r"magnitude=-1\.0; expected finite and >= 0"):
        detsum.explain(a, a, magnitude=-1.0)
    with pytest.raises(ValueError, match=r"magnitude holds nan; expected finite and >= 0"):
        detsum.explain(a, a, magnitude=torch.tensor([1.0, float("nan"), 1, 1, 1]))
    for bad in (True, "1", torch.ones(5, dtype=torch.bool), [1.0]):
        with pytest.raises(TypeError, match=r"detsum\.explain: magnitude(=| has dtype)"):
            detsum.explain(a, a, magnitude=bad)
    assert detsum.explain(a, a + 1e-3, magnitude=torch.full((1,), 10.0)).verdict == "rounding"
    assert detsum.explain(a, a + 1e-3, magnitude=30).verdict == "rounding"


def test_rounded_once_is_a_bool():
    with pytest.raises(TypeError, match=r"detsum\.explain: rounded_once='yes'; expected True or "
                                        r"False"):
        detsum.explain(torch.ones(2), torch.ones(2), rounded_once="yes")
