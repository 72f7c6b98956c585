"""Every class of bad input raises the documented exception, names what is wrong, writes nothing."""

from __future__ import annotations

import pytest
import torch

import detsum


def _index_add_args():
    return (torch.zeros(4, 3), 0, torch.tensor([0, 3, 1]), torch.ones(3, 3))


def _bad_calls():
    """(id, callable, exception, words the message must contain)."""
    x, dim, idx, src = _index_add_args()
    calls = [
        ("index_out_of_range", lambda: detsum.index_add(x, 0, torch.tensor([0, 4, 1]), src),
         IndexError, ["index[1] = 4", "input.size(0) = 4"]),
        ("index_negative", lambda: detsum.index_add(x, 0, torch.tensor([0, 1, -1]), src),
         IndexError, ["index[2] = -1"]),
        ("index_float", lambda: detsum.index_add(x, 0, torch.tensor([0.0, 1.0, 2.0]), src),
         TypeError, ["index", "float32"]),
        ("data_int", lambda: detsum.index_add(torch.zeros(4, 3, dtype=torch.int32), 0, idx,
                                              torch.ones(3, 3, dtype=torch.int32)),
         TypeError, ["input", "int32"]),
        ("mode_unknown", lambda: detsum.index_add(x, 0, idx, src, mode="fast"),
         ValueError, ["'fast'", "autograd", "kahan", "fp32"]),
        ("index_length", lambda: detsum.index_add(x, 0, torch.tensor([0, 1]), src),
         ValueError, ["length 2", "source.size(0) = 3"]),
        ("source_shape", lambda: detsum.index_add(x, 0, idx, torch.ones(3, 2)),
         ValueError, ["(3, 2)", "(4, 3)"]),
        ("dtype_mismatch", lambda: detsum.index_add(x, 0, idx, src.double()),
         ValueError, ["float64", "float32"]),
        ("dim_out_of_range", lambda: detsum.index_add(x, 2, idx, src),
         IndexError, ["dim=2"]),
        ("index_2d", lambda: detsum.index_add(x, 0, idx.view(3, 1), src),
         ValueError, ["1-D"]),
        ("alpha_not_number", lambda: detsum.index_add(x, 0, idx, src, alpha="2"),
         TypeError, ["alpha"]),
        ("meta_device", lambda: detsum.index_add(x, 0, idx, src.to("meta")),
         ValueError, ["device", "meta"]),
        ("reduce_unknown", lambda: detsum.scatter_reduce(x, 0, idx, src, "median"),
         ValueError, ["'median'", "amax"]),
        # torch_scatter's and PyG's names: the error names torch.scatter_reduce's for them.
        ("reduce_max", lambda: detsum.scatter_reduce(x, 0, idx, src, "max"),
         ValueError, ["reduce='max' is not supported", "('amax' for 'max')"]),
        ("reduce_add", lambda: detsum.scatter_reduce(x, 0, idx, src, "add"),
         ValueError, ["('sum' for 'add')"]),
        ("reduce_mul", lambda: detsum.scatter_reduce(x, 0, idx, src, "mul"),
         ValueError, ["('prod' for 'mul')"]),
        ("scatter_index_shape", lambda: detsum.scatter_reduce(x, 0, idx.view(3, 1), src, "sum"),
         ValueError, ["(3, 1)", "(3, 3)"]),
        ("scatter_out_of_range_elementwise",
         lambda: detsum.scatter_reduce(x, 0, torch.tensor([[0, 1, 2], [3, 4, 0], [0, 0, 0]]),
                                       src, "sum"),
         IndexError, ["index[1, 1] = 4"]),
        ("sorted_but_unsorted",
         lambda: detsum.scatter_reduce(x, 0, torch.tensor([0, 2, 1]), src, "sum", sorted=True),
         ValueError, ["sorted=True", "position 2"]),
        ("sorted_elementwise",
         lambda: detsum.scatter_reduce(x, 0, torch.zeros(3, 3, dtype=torch.long), src, "sum",
                                       sorted=True),
         ValueError, ["sorted=True", "1-D"]),
        ("offsets_start", lambda: detsum.segment_sum(src, torch.tensor([1, 3])),
         ValueError, ["offsets[0] = 1", "expected 0"]),
        ("offsets_end", lambda: detsum.segment_sum(src, torch.tensor([0, 2])),
         ValueError, ["offsets[-1] = 2", "= 3"]),
        ("offsets_decreasing", lambda: detsum.segment_sum(src, torch.tensor([0, 2, 1, 3])),
         ValueError, ["decrease", "position 2"]),
        ("offsets_dtype", lambda: detsum.segment_sum(src, torch.tensor([0.0, 3.0])),
         ValueError, ["offsets", "float32"]),
        ("offsets_empty", lambda: detsum.segment_sum(src, torch.tensor([], dtype=torch.long)),
         ValueError, ["offsets"]),
        ("perm_out_of_range",
         lambda: detsum.segment_sum(src, torch.tensor([0, 3]), perm=torch.tensor([0, 3, 1])),
         IndexError, ["perm[1] = 3"]),
        ("perm_length",
         lambda: detsum.segment_sum(src, torch.tensor([0, 3]), perm=torch.tensor([0, 1])),
         ValueError, ["perm", "length 2"]),
        ("zero_dim", lambda: detsum.segment_sum(torch.tensor(1.0), torch.tensor([0, 1])),
         ValueError, ["0-dimensional"]),
        ("backend_unknown", lambda: detsum.backend("cuda-graphs").__enter__(),
         ValueError, ["'cuda-graphs'", "numba"]),
        ("include_self_none", lambda: detsum.scatter_reduce(x, 0, idx, src, "sum",
                                                            include_self=None),
         TypeError, ["detsum.scatter_reduce", "include_self=None", "True or False"]),
        ("include_self_int", lambda: detsum.scatter_reduce(x, 0, idx, src, "sum", include_self=1),
         TypeError, ["include_self=1"]),
        ("sorted_string", lambda: detsum.scatter_reduce(x, 0, idx, src, "sum", sorted="yes"),
         TypeError, ["sorted='yes'", "True or False"]),
        ("running_sum_negative_size", lambda: detsum.RunningSum((-1,)),
         ValueError, ["detsum.RunningSum", "shape=(-1,)", "non-negative ints"]),
        ("running_sum_string_shape", lambda: detsum.RunningSum("abc"),
         TypeError, ["detsum.RunningSum", "shape='abc'"]),
        ("running_sum_int_shape", lambda: detsum.RunningSum(5),
         TypeError, ["shape=5", "such as (4, 3)"]),
        ("running_sum_bool_size", lambda: detsum.RunningSum((2, True)),
         TypeError, ["holds True"]),
        ("running_sum_device", lambda: detsum.RunningSum((2,), device="gpu"),
         ValueError, ["device='gpu'", "cuda:0"]),
        ("moe_permute_check_none",
         lambda: detsum.moe.permute(torch.ones(2, 3), torch.tensor([1, 0]), 1, check=None),
         TypeError, ["detsum.moe.permute", "check=None"]),
        ("moe_unpermute_reduce_string",
         lambda: detsum.moe.unpermute(torch.ones(2, 3), torch.tensor([1, 0]), 1, reduce="no"),
         TypeError, ["detsum.moe.unpermute", "reduce='no'"]),
        ("moe_route_zero_dim", lambda: detsum.moe.route(torch.tensor(1), 3),
         ValueError, ["detsum.moe.route", "[T, topk] or [T], got shape ()"]),
        ("moe_route_check_int",
         lambda: detsum.moe.route(torch.tensor([[0, 1]]), 2, check=1),
         TypeError, ["detsum.moe.route", "check=1"]),
        # Sparse and nested tensors: refused by their layout, before any kernel reads them.
        ("input_sparse", lambda: detsum.index_add(x.to_sparse(), 0, idx, src),
         TypeError, ["detsum.index_add", "input is a sparse_coo tensor", "dense"]),
        ("source_sparse_in_place", lambda: detsum.index_add_(x, 0, idx, src.to_sparse()),
         TypeError, ["detsum.index_add_", "source is a sparse_coo tensor"]),
        ("index_sparse", lambda: detsum.index_add(x, 0, idx.to_sparse(), src),
         TypeError, ["index is a sparse_coo tensor"]),
        ("src_sparse_csr", lambda: detsum.segment_sum(src.to_sparse_csr(), torch.tensor([0, 3])),
         TypeError, ["detsum.segment_sum", "src is a sparse_csr tensor"]),
        ("scatter_src_sparse", lambda: detsum.scatter_reduce(x, 0, idx, src.to_sparse(), "sum"),
         TypeError, ["detsum.scatter_reduce", "src is a sparse_coo tensor"]),
        ("source_nested", lambda: detsum.index_add(
            x, 0, idx, torch.nested.nested_tensor([torch.ones(1, 3), torch.ones(2, 3)])),
         TypeError, ["source is a nested tensor"]),
        ("segment_sum_plan_int", lambda: detsum.segment_sum(src, plan=3),
         TypeError, ["detsum.segment_sum", "plan must be a detsum.Plan", "got int"]),
        ("reduce_list", lambda: detsum.scatter_reduce(x, 0, idx, src, ["sum"]),
         TypeError, ["detsum.scatter_reduce", "reduce=['sum'] is a list", "expected a str"]),
        # A product recording its gradient makes a plan of its own: its errors are still the
        # caller's, with the caller's names.
        ("prod_with_grad_out_of_range", lambda: detsum.scatter_reduce(
            x, 0, torch.tensor([0, 1, 4]), src.clone().requires_grad_(), "prod"),
         IndexError, ["detsum.scatter_reduce: index[2] = 4", "input.size(0) = 4"]),
        ("prod_with_grad_unsorted", lambda: detsum.scatter_reduce(
            x, 0, torch.tensor([0, 2, 1]), src.clone().requires_grad_(), "prod", sorted=True),
         ValueError, ["detsum.scatter_reduce: sorted=True"]),
        ("in_place_on_meta", lambda: detsum.index_add_(
            x.to("meta"), 0, idx.to("meta"), src.to("meta")),
         NotImplementedError, ["detsum.index_add_", "no backend for meta tensors"]),
        ("scatter_std_src_list", lambda: detsum.scatter_std([1.0, 2.0], torch.tensor([0, 1])),
         TypeError, ["detsum.scatter_std", "src must be a torch.Tensor, got list"]),
        ("scatter_logsumexp_src_list",
         lambda: detsum.scatter_logsumexp([1.0, 2.0], torch.tensor([0, 1])),
         TypeError, ["detsum.scatter_logsumexp", "src must be a torch.Tensor, got list"]),
        ("scatter_std_unbiased_string",
         lambda: detsum.scatter_std(torch.ones(2), torch.tensor([0, 1]), unbiased="no"),
         TypeError, ["detsum.scatter_std", "unbiased='no'", "True or False"]),
        ("scatter_out_leaf_requiring_grad", lambda: detsum.scatter_mean(
            src, torch.tensor([0, 1, 0]), 0, out=torch.zeros(2, 3, requires_grad=True)),
         RuntimeError, ["detsum.scatter_mean: out is a leaf tensor that requires grad"]),
        ("segment_csr_out_leaf_requiring_grad", lambda: detsum.segment_sum_csr(
            src, torch.tensor([0, 1, 3]), out=torch.zeros(2, 3, requires_grad=True)),
         RuntimeError, ["detsum.segment_sum_csr: out is a leaf tensor"]),
    ]
    return calls


@pytest.mark.parametrize("call,exception,words", [c[1:] for c in _bad_calls()],
                         ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises_clear_error(call, exception, words):
    with pytest.raises(exception) as raised:
        call()
    message = str(raised.value)
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"


@pytest.mark.parametrize("bad_index", [torch.tensor([0, 4, 1]), torch.tensor([-1, 0, 1])],
                         ids=["too_large", "negative"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
def test_failing_inplace_call_leaves_input_untouched(bad_index, contiguous):
    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    if not contiguous:
        x = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    before = x.clone()
    with pytest.raises(IndexError):
        detsum.index_add_(x, 0, bad_index, torch.ones(3, 3), mode="kahan")
    assert torch.equal(x, before)


@pytest.mark.parametrize("offsets,perm", [
    ([0, 3], None), ([1, 3], None), ([0, 2], None), ([0, 2, 1, 3], None), ([2, 1, 5], None),
    ([0, 3], [0, 3, 1]), ([0, 3], [-1, 0, 1]), ([0, 3], [2, 1, 0]), ([0, 3], []),
    ([0, 1, 1, 3], [0, 2, 1]), ([0, 1, 3], [0, 5, 1])])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_segment_sums_two_host_checks_agree(offsets, perm, dtype):
    """CPU tensors are checked in NumPy, a GPU's with torch ops and one host read: both
    raise the same error for the same values (or none), the first check that fails winning."""
    from detsum.ops import segment_sum as primitive

    offsets = torch.tensor(offsets, dtype=dtype)
    perm = None if perm is None else torch.tensor(perm, dtype=dtype)
    outcomes = []
    for check in (primitive._check_on_cpu, primitive._check_on_host):
        try:
            check(offsets, perm, 3)
            outcomes.append(None)
        except (ValueError, IndexError) as error:
            outcomes.append((type(error), str(error)))
    assert outcomes[0] == outcomes[1]


def test_mode_accepts_enum_members():
    x, dim, idx, src = _index_add_args()
    for mode in detsum.Mode:
        assert torch.equal(detsum.index_add(x, dim, idx, src, mode=mode),
                           detsum.index_add(x, dim, idx, src, mode=mode.value))
    assert detsum.MODES == ("autograd", "kahan", "fp32", "exact")


def test_out_of_range_value_at_the_last_position_is_found():
    """The one pass over the index reaches its end before anything is launched."""
    n = 10_000
    index = torch.zeros(n, dtype=torch.long)
    index[-1] = 7
    with pytest.raises(IndexError, match=rf"index\[{n - 1}\] = 7"):
        detsum.index_add(torch.zeros(7, 2), 0, index, torch.ones(n, 2))


# ---- in-place targets: refused before any work, as torch refuses them -------------------------

def _inplace_refusals():
    """(id, make: () -> (target, index, source), exception, words)."""

    def source_is_input():
        z = torch.arange(5.0)
        return z, torch.tensor([4, 3, 2, 1, 0]), z

    def overlapping_slices():
        buf = torch.arange(6.0)
        return buf[0:4], torch.tensor([0, 1, 2, 3]), buf[1:5]

    def index_in_input_memory():
        x = torch.zeros(4)
        return x, x.view(torch.int32)[:2], torch.ones(2)

    def expanded_input():
        return torch.zeros(1, 3).expand(4, 3), torch.tensor([0, 1]), torch.ones(2, 3)

    def leaf_requires_grad():
        return torch.zeros(4, 3, requires_grad=True), torch.tensor([0, 1]), torch.ones(2, 3)

    def graph_path_source_in_input():
        y = torch.ones(4, 3, requires_grad=True) * 2  # not a leaf: the autograd path
        return y, torch.tensor([0, 1, 2]), y[1:4]

    def inference_input():
        with torch.inference_mode():
            x = torch.zeros(4, 3)
        return x, torch.tensor([0, 1]), torch.ones(2, 3)

    return [
        ("source_is_input", source_is_input, ValueError, ["source shares memory with input"]),
        ("overlapping_slices", overlapping_slices, ValueError, ["source shares memory"]),
        ("index_in_input_memory", index_in_input_memory, ValueError,
         ["index shares memory with input"]),
        ("expanded_input", expanded_input, ValueError,
         ["input has elements that share memory", "(0, 1)", "input.clone()"]),
        ("leaf_requires_grad", leaf_requires_grad, RuntimeError,
         ["leaf tensor that requires grad", "torch.no_grad()"]),
        ("graph_path_source_in_input", graph_path_source_in_input, ValueError,
         ["source shares memory with input"]),
        ("inference_input", inference_input, RuntimeError,
         ["detsum.index_add_: input is an inference tensor", "input.clone()",
          "under torch.inference_mode()"]),
    ]


@pytest.mark.parametrize("backend_name", ["numba", "reference"])
@pytest.mark.parametrize("make,exception,words", [c[1:] for c in _inplace_refusals()],
                         ids=[c[0] for c in _inplace_refusals()])
def test_inplace_refusals_come_before_any_work(make, exception, words, backend_name,
                                               monkeypatch):
    from detsum import _segments, reference

    def no_work(*args, **kwargs):
        raise AssertionError("planned or launched before the in-place checks")

    monkeypatch.setattr(_segments, "launch", no_work)
    monkeypatch.setattr(_segments, "plan_from_index", no_work)
    monkeypatch.setattr(reference, "index_add", no_work)
    target, index, source = make()
    before = target.detach().clone()
    with detsum.backend(backend_name), pytest.raises(exception) as raised:
        detsum.index_add_(target, 0, index, source)
    for word in words:
        assert word in str(raised.value), f"{word!r} missing from {str(raised.value)!r}"
    assert torch.equal(target.detach(), before)


class _Operators(torch.overrides.TorchFunctionMode):
    """Any function mode sends detsum's calls through its registered operators."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _operators_index_add_(target):
    with _Operators():
        detsum.index_add_(target, 0, torch.tensor([0, 2]), torch.ones(2, 3))


_SOURCE, _INDEX = torch.arange(6.0).view(2, 3), torch.tensor([0, 2])

# (id, a call that writes into its argument, a [4, 3] fp32 tensor, and what the refusal names)
_WRITES_IN_PLACE = [
    ("index_add_", lambda t: detsum.index_add_(t, 0, _INDEX, _SOURCE), "detsum.index_add_: input"),
    ("index_add_ operator", _operators_index_add_, "detsum.index_add_: input"),
    ("scatter_sum", lambda t: detsum.scatter_sum(_SOURCE, _INDEX, 0, out=t),
     "detsum.scatter_sum: out"),
    ("scatter_mean", lambda t: detsum.scatter_mean(_SOURCE, _INDEX, 0, out=t),
     "detsum.scatter_mean: out"),
    ("scatter_max", lambda t: detsum.scatter_max(_SOURCE, _INDEX, 0, out=t),
     "detsum.scatter_max: out"),
    ("scatter_logsumexp", lambda t: detsum.scatter_logsumexp(_SOURCE, _INDEX, 0, out=t),
     "detsum.scatter_logsumexp: out"),
    ("scatter_std", lambda t: detsum.scatter_std(_SOURCE, _INDEX, 0, out=t),
     "detsum.scatter_std: out"),
    ("segment_csr", lambda t: detsum.segment_csr(torch.ones(5, 3), torch.tensor([0, 1, 2, 3, 5]),
                                                 out=t), "detsum.segment_csr: out"),
    ("segment_coo", lambda t: detsum.segment_coo(_SOURCE, _INDEX, out=t),
     "detsum.segment_coo: out"),
    ("gather_csr", lambda t: detsum.gather_csr(torch.ones(4, 3), torch.tensor([0, 1, 2, 3, 4]),
                                               out=t), "detsum.gather_csr: out"),
    ("gather_coo", lambda t: detsum.gather_coo(torch.ones(4, 3), torch.tensor([3, 2, 1, 0]),
                                               out=t), "detsum.gather_coo: out"),
]


@pytest.mark.parametrize("write,refused", [c[1:] for c in _WRITES_IN_PLACE],
                         ids=[c[0] for c in _WRITES_IN_PLACE])
def test_inference_tensors_change_only_under_inference_mode(write, refused):
    """As torch: an inference tensor (made under torch.inference_mode()) cannot change in place
    outside inference mode. torch raises only after its kernel has written; detsum refuses
    first, with the same exception type, in its own words; under inference mode it writes
    what it writes into a normal tensor."""
    with torch.inference_mode():
        target = torch.full((4, 3), 0.5)
    with pytest.raises(RuntimeError) as raised:
        write(target)
    assert str(raised.value).startswith(f"{refused} is an inference tensor (made under "
                                        f"torch.inference_mode())"), str(raised.value)
    assert "torch.inference_mode()" in str(raised.value).split("expected")[1]
    assert torch.equal(target, torch.full((4, 3), 0.5))
    normal = torch.full((4, 3), 0.5)
    write(normal)
    with torch.inference_mode():
        write(target)
    assert torch.equal(target, normal)


@pytest.mark.parametrize("mode", ["fp32", "kahan", "exact"])
def test_a_running_sum_made_under_inference_mode_changes_only_under_it(mode):
    rows = torch.arange(12.0).view(4, 3)
    with torch.inference_mode():
        running = detsum.RunningSum((3,), mode=mode)
        running.add(rows[:2])
    before = running.sum()
    calls = {"add": lambda: running.add(rows)}
    if mode == "exact":
        other = detsum.RunningSum((3,), mode=mode)
        other.add(rows)
        calls.update(merge=lambda: running.merge(other),
                     load_state=lambda: running.load_state(other.state()))
    for name, call in calls.items():
        with pytest.raises(RuntimeError) as raised:
            call()
        assert str(raised.value).startswith(
            f"detsum.RunningSum.{name}: the running sum's state is an inference tensor"), name
        assert "make the running sum outside torch.inference_mode()" in str(raised.value)
        assert torch.equal(running.sum(), before) and running.count == 2, name
    with torch.inference_mode():
        running.add(rows[2:])
    assert torch.equal(running.sum(), rows.sum(0)) and running.count == 4


@pytest.mark.parametrize("mode", ["fp32", "exact"])
def test_an_accumulator_made_under_inference_mode_changes_only_under_it(mode):
    model = torch.nn.Linear(3, 2)
    with torch.inference_mode():
        accumulator = detsum.loss.GradAccumulator(model.named_parameters(), mode=mode)
    grads = {name: torch.ones(2, *p.shape) for name, p in model.named_parameters()}
    with pytest.raises(RuntimeError) as raised:
        accumulator.add(grads)
    assert str(raised.value).startswith("detsum.loss.GradAccumulator.add: the accumulator's "
                                        "state is an inference tensor"), str(raised.value)
    assert "make the accumulator outside torch.inference_mode()" in str(raised.value)
    assert accumulator.count == 0
    with torch.inference_mode():
        accumulator.add(grads)
        assert all(torch.equal(g, torch.full_like(g, 2.0))
                   for g in accumulator.result("sum").values())


def test_interleaved_views_are_separate_memory():
    """x[::2] and x[1::2] share a storage but no element: allowed, as torch allows it."""
    buf = torch.arange(10.0)
    expected = buf[::2].clone().index_add_(0, torch.tensor([0, 1]), buf[1::2][:2].clone())
    detsum.index_add_(buf[::2], 0, torch.tensor([0, 1]), buf[1::2][:2])
    assert torch.equal(buf[::2], expected)


def test_inplace_on_a_leaf_is_fine_without_grad():
    x = torch.zeros(4, 3, requires_grad=True)
    with torch.no_grad():
        detsum.index_add_(x, 0, torch.tensor([0, 0]), torch.ones(2, 3))
    assert torch.equal(x.detach()[0], torch.full((3,), 2.0))


@pytest.mark.parametrize("call", [
    lambda: detsum.index_add(torch.zeros(4, 3), 0, torch.tensor([0]), torch.ones(1, 3)),
    lambda: detsum.segment_sum(torch.ones(3, 2), torch.tensor([0, 3])),
    lambda: detsum.scatter_reduce(torch.zeros(4), 0, torch.tensor([1]), torch.ones(1), "amax"),
    lambda: detsum.RunningSum((2,)).add(torch.ones(300, 2)),
], ids=["index_add", "segment_sum", "scatter_reduce", "running_sum"])
def test_triton_on_cpu_without_the_interpreter_names_the_function(call, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with detsum.backend("triton"), pytest.raises(ValueError) as raised:
        call()
    message = str(raised.value)
    assert message.startswith("detsum.") and "TRITON_INTERPRET=1" in message, message


# ---- checks remembered for calls without a plan --------------------------------------------------

def _counting_checks(monkeypatch, module):
    """Every run of ``module._check`` appended to the returned list, with ``plans``' memory of
    the checks of calls without a plan emptied first (other tests fill it)."""
    from detsum import plans

    monkeypatch.setattr(plans, "_CHECKED", {})
    runs = []
    real = module._check

    def counted(*args, **kwargs):
        runs.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_check", counted)
    return runs


def test_checks_of_a_call_without_a_plan_are_remembered_by_its_arguments(monkeypatch):
    """A call whose checks passed, made again with equal arguments (each tensor's dtype, shape
    and device, the other arguments), takes their answer without checking again; a call with
    any of them changed checks, and a call whose checks fail raises every time."""
    from detsum import plans
    from detsum.ops import index_add as module

    runs = _counting_checks(monkeypatch, module)
    x, index, source = torch.zeros(4, 3), torch.tensor([0, 3, 1]), torch.ones(3, 3)
    first = detsum.index_add(x, 0, index, source)
    assert len(runs) == 1
    # Other tensors, other values, equal arguments: the same answer, the right result.
    again = detsum.index_add(x + 1, 0, torch.tensor([2, 2, 0]), source * 2)
    assert len(runs) == 1
    assert torch.equal(again, torch.tensor([[3.0] * 3, [1.0] * 3, [5.0] * 3, [1.0] * 3]))
    assert torch.equal(first, torch.tensor([[1.0] * 3, [1.0] * 3, [0.0] * 3, [1.0] * 3]))
    for changed in (dict(alpha=2), dict(mode="kahan"), dict(check="off")):
        detsum.index_add(x, 0, index, source, **changed)
    detsum.index_add(x, -2, index, source)
    detsum.index_add(x.double(), 0, index, source.double())
    detsum.index_add(x, 0, index.int(), source)
    assert len(runs) == 7
    # Refused every time, and nothing remembered of it.
    for _ in range(2):
        with pytest.raises(ValueError, match="source has dtype torch.float64"):
            detsum.index_add(x, 0, index, source.double())
        with pytest.raises(ValueError, match="index has length 2"):
            detsum.index_add(x, 0, index[:2], source)
        with pytest.raises(IndexError, match="dim=2"):
            detsum.index_add(x, 2, index, source)
    assert len(runs) == 13
    # The oldest go first past _CHECKED_KEPT.
    monkeypatch.setattr(plans, "_CHECKED_KEPT", 2)
    detsum.index_add(torch.zeros(5, 3), 0, index, source)
    detsum.index_add(torch.zeros(6, 3), 0, index, source)
    detsum.index_add(x, 0, index, source)
    assert len(runs) == 16


def test_a_scatter_mean_is_checked_at_every_call(monkeypatch):
    """The exact mean's bound is a setting the checks read: changed between two equal calls,
    the second sees it."""
    from detsum import _validation
    from detsum.ops import scatter_reduce as module

    runs = _counting_checks(monkeypatch, module)
    x, index, src = torch.zeros(2, 3), torch.tensor([0, 1, 0]), torch.ones(3, 3)
    detsum.scatter_reduce(x, 0, index, src, "mean", mode="exact")
    monkeypatch.setattr(_validation, "MAX_TERMS_PER_STATE", 3)
    with pytest.raises(ValueError, match="sums at most 3 terms per output element"):
        detsum.scatter_reduce(x, 0, index, src, "mean", mode="exact")
    detsum.scatter_reduce(x, 0, index, src, "amax")
    detsum.scatter_reduce(x, 0, index, src, "amax")
    assert len(runs) == 3


def test_segment_sum_checks_are_remembered_and_its_offsets_checked_every_time(monkeypatch):
    """segment_sum's argument checks are remembered as index_add's; its offsets' values are
    not among them, and bad ones are refused at every call."""
    from detsum.ops import segment_sum as module

    runs = _counting_checks(monkeypatch, module)
    src = torch.ones(4, 3)
    detsum.segment_sum(src, torch.tensor([0, 1, 2, 4]))
    detsum.segment_sum(src * 2, torch.tensor([0, 3, 3, 4]))
    assert len(runs) == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="offsets decrease at position 2"):
            detsum.segment_sum(src, torch.tensor([0, 3, 2, 4]))
        with pytest.raises(ValueError, match=r"offsets\[-1\] = 3"):
            detsum.segment_sum(src, torch.tensor([0, 2, 3, 3]))
    assert len(runs) == 1
    detsum.segment_sum(src, torch.tensor([0, 1, 4]), perm=torch.tensor([3, 2, 1, 0]))
    detsum.segment_sum(src, torch.tensor([0, 1, 4]), perm=torch.tensor([3, 2, 1, 0]))
    with pytest.raises(TypeError, match="offsets is missing"):
        detsum.segment_sum(src, None)
    assert len(runs) == 4
