// The switch's (detsum.enable's) CPU kernels for the small in-place sums, maxima and minima
// that a small model's step makes most: index_add_, scatter_add_, scatter_reduce_ (a sum from
// self, amax, amin) and index_put_ with accumulate=True (the backward of x[idx]).
//
// Why C++: the dispatcher's way into a Python kernel, with nothing done there but a pass back
// to torch, costs a 200-node PyG training step 1.10-1.15x (benches/NOTES.md); a kernel here
// costs what torch's own does. Each one computes, for the one form it takes, what
// kernels/numba/small.py's kernels compute for it (index_add_small_in_place,
// extreme_small_in_place: the segment kernel's rules WIDE, ROUND_EACH and KAHAN on float32
// and float64 data, whose acc type is the data type, and its AMAX and AMIN), term by term in
// the index's order, element by element: the same additions, multiplications and comparisons
// in the same order, so the same bits. Compiled without contraction (-ffp-contract=off): a
// fused multiply-add would round once where the rule rounds twice. Vectorising the loop over a
// row's elements changes nothing: each element's operations and their order stay.
//
// Every other call, and any call of those forms that does not fit (another dtype or layout,
// "exact" mode's sums, a launch larger than small.MAX_ELEMENTS, a row of more than CHUNK_TERMS
// terms under WIDE or KAHAN but in one column (add_column), an index value out of range,
// memory shared, an inference tensor outside inference mode), goes unchanged to the kernel
// that was registered before this one: the switch's Python kernel, which gives detsum's
// answer or torch's, its error or detsum's. Nothing is written before that decision.
//
// The Python side (detsum/switch.py through detsum/kernels/native) loads this library with
// ctypes, installs the kernels over its own Python ones, and tells it the switch's state
// (detsum_native_configure) and when a switched call runs detsum's code, whose own calls of
// these ops must go to torch (detsum_native_set_inside).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

// The operators, in the order of detsum_native_take_counts's counts.
enum Op { kIndexAdd = 0, kScatterAdd, kScatterReduce, kIndexPut, kOps };
const char* const kOpNames[kOps] = {"index_add_", "scatter_add_", "scatter_reduce_.two",
                                    "_index_put_impl_"};

// How a sum is added (configure's sum_rule): not here, WIDE ("fp32" mode), ROUND_EACH
// ("autograd" mode: never split), KAHAN ("kahan" mode). WIDE and KAHAN split a row of more
// than CHUNK_TERMS terms into chunks, another arithmetic, so such a call is not taken. On
// float32 and float64 data WIDE and ROUND_EACH add term by term in the data type, and KAHAN
// compensates in it. (One column takes such rows: add_column cuts them as the segment kernel
// does.)
enum SumRule { kNoSum = 0, kWide = 1, kRoundEach = 2, kKahan = 3 };

// The switch's state, set from Python. on: a mode is set (the switch is on). active: it is on
// and every CPU primitive runs on Numba (no detsum.backend block forces another anywhere).
// autograd: the mode is "autograd" (a sum scaled by an alpha other than 1 or -1 goes to the
// Python kernel, as there).
std::atomic<int> g_on{0};
std::atomic<int> g_active{0};
std::atomic<int> g_sum_rule{kNoSum};
std::atomic<int> g_autograd{0};
std::atomic<int64_t> g_max_elements{0};
std::atomic<int64_t> g_chunk_terms{0};
std::atomic<int64_t> g_counts[kOps];
std::atomic<int64_t> g_torch_counts[kOps];
thread_local bool t_inside = false;

// The kernels registered before these (the switch's Python ones), called for every call not
// taken here. Shared pointers, replaced atomically at each install, so that a call running in
// another thread keeps the one it loaded.
std::shared_ptr<const c10::SafeKernelFunction> g_fallback[kOps];
// torch's own kernels, where detsum_native_capture_torch took them before the switch
// registered its Python kernels: a call while the switch is off, or one of detsum's own calls
// inside a switched call, goes straight to them, as the Python kernel would send it (that way
// costs a small PyG step about a tenth: benches/NOTES.md). Else such calls take the fallback.
std::shared_ptr<const c10::SafeKernelFunction> g_torch[kOps];
std::unique_ptr<torch::Library> g_library;
std::string g_error;

void to_fallback(Op op, const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                 torch::jit::Stack* stack) {
  if (t_inside || !g_on.load(std::memory_order_relaxed)) {
    if (auto torch_kernel = std::atomic_load(&g_torch[op])) {
      g_torch_counts[op].fetch_add(1, std::memory_order_relaxed);
      // torch's CPU kernels read no key set; the Python kernel hands them this one too.
      torch_kernel->callBoxed(handle, c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
      return;
    }
  }
  auto fallback = std::atomic_load(&g_fallback[op]);
  TORCH_CHECK(fallback, "detsum.enable: no kernel to hand ", kOpNames[op], " to");
  fallback->callBoxed(handle, keys, stack);
}

bool fast_calls_on() {
  return !t_inside && g_active.load(std::memory_order_relaxed);
}

// The bytes from a tensor's first element to its last: two tensors whose spans do not meet
// share no memory (detsum/_validation.py's address_ranges_meet, the test the Python way
// makes).
bool spans_meet(const at::Tensor& a, const at::Tensor& b) {
  auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    return (last + 1) * static_cast<int64_t>(t.element_size());
  };
  auto a_start = reinterpret_cast<uintptr_t>(a.data_ptr());
  auto b_start = reinterpret_cast<uintptr_t>(b.data_ptr());
  return a_start < b_start + span(b) && b_start < a_start + span(a);
}

// CPU, strided, no lazy negation: what _short_plain asks of each tensor.
bool plain(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided && !t.is_neg();
}

// A target the call may write: contiguous (so its elements are distinct), not an inference
// tensor outside inference mode (torch refuses that, and its error is the one to give).
bool writable_target(const at::Tensor& target) {
  return target.is_contiguous() && (!target.is_inference() || c10::InferenceMode::is_enabled());
}

// Where a row index lies: n values of type I, stride apart (elements).
template <typename I>
struct Rows {
  const I* values;
  int64_t stride;
  int64_t n;
  int64_t at(int64_t i) const { return static_cast<int64_t>(values[i * stride]); }
};

// Every value in [0, rows), and under a rule that splits (WIDE, KAHAN) no row of more than
// chunk_terms terms (counted only past chunk_terms terms in all, as small.py's _counted does).
template <typename I>
bool rows_fit(const Rows<I>& index, int64_t rows, bool splits, int64_t chunk_terms) {
  if (splits && index.n > chunk_terms) {
    std::vector<int64_t> counts(rows, 0);
    for (int64_t i = 0; i < index.n; ++i) {
      int64_t v = index.at(i);
      if (v < 0 || v >= rows || ++counts[v] > chunk_terms) return false;
    }
    return true;
  }
  for (int64_t i = 0; i < index.n; ++i) {
    int64_t v = index.at(i);
    if (v < 0 || v >= rows) return false;
  }
  return true;
}

// target[o, index[i], j] += source[o, i, j] * alpha, i in order: small.py's _index_add_at
// for data whose acc type is the data type (the alpha rounded to it first, as cvt does).
template <typename T, typename I>
void add_rows(T* target, const T* source, const Rows<I>& index, int64_t outer, int64_t rows,
              int64_t inner, double alpha) {
  const T a = static_cast<T>(alpha);
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < index.n; ++i) {
      T* out = target + (o * rows + index.at(i)) * inner;
      const T* term = source + (o * index.n + i) * inner;
      for (int64_t j = 0; j < inner; ++j) out[j] = out[j] + term[j] * a;
    }
  }
}

// One term's row into a row's sums and compensations (common.py's neumaier), in a function
// of its own on rows apart in memory, so that the loop vectorises (inlined into the row loop,
// a small call took 20 us, Numba's 5).
template <typename T>
__attribute__((noinline)) void add_row_compensated(T* __restrict sums, T* __restrict errors,
                                                   const T* __restrict term, T a,
                                                   int64_t inner) {
  for (int64_t j = 0; j < inner; ++j) {
    const T s = sums[j], t = term[j] * a;
    const T u = s + t;
    // Both errors computed, one selected (as common.py's neumaier): the loop stays branch-free.
    const T error_of_t = (s - u) + t, error_of_s = (t - u) + s;
    const T d = std::abs(s) >= std::abs(t) ? error_of_t : error_of_s;
    sums[j] = u;
    errors[j] = errors[j] + d;
  }
}

// The same under KAHAN: small.py's _index_add_at for that rule, each element's sum and its
// compensation in the data type (common.py's neumaier per term, from the target's value and
// a zero compensation; kahan_result at the end: s + c, or s where s is not finite or c is 0).
// The sums accumulate in the target itself; a row without terms ends as it was (c is 0).
template <typename T, typename I>
void add_rows_compensated(T* target, const T* source, const Rows<I>& index, int64_t outer,
                          int64_t rows, int64_t inner, double alpha) {
  const T a = static_cast<T>(alpha);
  std::vector<T> compensation(rows * inner);
  for (int64_t o = 0; o < outer; ++o) {
    T* block = target + o * rows * inner;
    std::fill(compensation.begin(), compensation.end(), T(0));
    for (int64_t i = 0; i < index.n; ++i) {
      T* sums = block + index.at(i) * inner;
      T* errors = compensation.data() + index.at(i) * inner;
      const T* term = source + (o * index.n + i) * inner;
      add_row_compensated(sums, errors, term, a, inner);
    }
    for (int64_t k = 0; k < rows * inner; ++k) {
      const T s = block[k], c = compensation[k];
      block[k] = std::isfinite(s) && c != 0 ? s + c : s;
    }
  }
}

// Each target row the largest (maximum) or smallest of its terms, and of its own values first
// under include_base: small.py's _extreme_at (NaN propagates; of equal values the earlier
// stays). A row without terms keeps its values.
// Each of out's elements y replaced by term's x where (x is NaN or beyond y) and y is not
// NaN: a select, not a branch, in a function of its own, rows apart in memory (reduce_rows
// checked): so the loop vectorises. With a branch, or inlined into pick_rows (where GCC 12
// left the amax loop scalar), an amax of 256 rows of 64 took 15-21 us, torch's kernel 5.
template <bool maximum, typename T>
__attribute__((noinline)) void pick_row(T* __restrict out, const T* __restrict term,
                                        int64_t inner) {
  for (int64_t j = 0; j < inner; ++j) {
    const T x = term[j], y = out[j];
    const bool picked = ((x != x) | (maximum ? x > y : x < y)) & (y == y);
    out[j] = picked ? x : y;
  }
}

template <bool maximum, typename T, typename I>
void pick_rows(T* target, const T* source, const Rows<I>& index, int64_t outer, int64_t rows,
               int64_t inner, bool include_base) {
  std::vector<char> started(rows);
  for (int64_t o = 0; o < outer; ++o) {
    std::fill(started.begin(), started.end(), include_base ? 1 : 0);
    for (int64_t i = 0; i < index.n; ++i) {
      int64_t v = index.at(i);
      T* out = target + (o * rows + v) * inner;
      const T* term = source + (o * index.n + i) * inner;
      if (!started[v]) {
        started[v] = 1;
        std::memcpy(out, term, inner * sizeof(T));
        continue;
      }
      pick_row<maximum>(out, term, inner);
    }
  }
}

// One column (outer and inner 1: a 1-D target, or one row or column of one): each row's state
// apart from the target, in one pass that checks each index value as it reads it, written
// after it (small.py's index_add_one_column and extreme_one_column, whose arithmetic is
// index_add_small's and extreme_small_in_place's: the same bits). A sum takes rows of any
// length: under WIDE and KAHAN a row of more than chunk_terms terms is cut into chunks as the
// segment kernel cuts it (the first chunk_terms terms added to the row's own value, each later
// chunk summed from its first term and added once complete, the last, shorter one at the end;
// KAHAN's chunk compensation added to the row's as its sum is). A row's count lies beside its
// sum (8 bytes a float32 row: 4000 rows' state in the L1 cache) and stops below
// 2 * chunk_terms (past the first chunk it only places a term in its chunk). Before, two
// passes over the index (rows_fit's check, then the sum) and an inner loop of one made a 1-D
// scatter_add_ of 10,000 terms 3.1x torch's (benches/NOTES.md). Returns whether it wrote the
// target: false, nothing written, at an index value outside [0, rows).
template <typename T>
using CountOf = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;

template <bool kahan, typename T>
struct SumRow {
  T sum;
  CountOf<T> count;
};
template <typename T>
struct SumRow<true, T> {
  T sum, compensation;
  CountOf<T> count;
};

// Neumaier's step (common.py's neumaier): s + t into s, the addition's exact error into c.
template <typename T>
inline void neumaier_step(T& s, T& c, T t) {
  const T u = s + t;
  const T d = std::abs(s) >= std::abs(t) ? (s - u) + t : (t - u) + s;
  s = u;
  c = c + d;
}

template <bool kahan, bool splits, typename T, typename I>
bool add_column(T* target, const T* source, const Rows<I>& index, int64_t rows, double alpha,
                int64_t chunk_terms) {
  const T a = static_cast<T>(alpha);
  std::vector<SumRow<kahan, T>> state(rows);
  // A later chunk's partial sum (and compensation), set at its first term.
  std::vector<T> chunk(splits ? rows : 0), chunk_compensation(splits && kahan ? rows : 0);
  auto fold = [&](int64_t s) {
    if constexpr (kahan) {
      neumaier_step(state[s].sum, state[s].compensation, chunk[s]);
      state[s].compensation = state[s].compensation + chunk_compensation[s];
    } else {
      state[s].sum = state[s].sum + chunk[s];
    }
  };
  for (int64_t s = 0; s < rows; ++s) {
    state[s].sum = target[s];
    state[s].count = 0;
    if constexpr (kahan) state[s].compensation = T(0);
  }
  for (int64_t i = 0; i < index.n; ++i) {
    const int64_t v = index.at(i);
    if (v < 0 || v >= rows) return false;
    auto& row = state[v];
    const T x = source[i] * a;
    const int64_t c = row.count;
    if (!splits || c < chunk_terms) {
      row.count = static_cast<CountOf<T>>(c + 1);
      if constexpr (kahan)
        neumaier_step(row.sum, row.compensation, x);
      else
        row.sum = row.sum + x;
      continue;
    }
    const int64_t place = c - chunk_terms;
    if (place == 0) {
      chunk[v] = x;
      if constexpr (kahan) chunk_compensation[v] = T(0);
    } else if constexpr (kahan) {
      neumaier_step(chunk[v], chunk_compensation[v], x);
    } else {
      chunk[v] = chunk[v] + x;
    }
    if (place == chunk_terms - 1) {
      fold(v);
      row.count = static_cast<CountOf<T>>(chunk_terms);
    } else {
      row.count = static_cast<CountOf<T>>(c + 1);
    }
  }
  for (int64_t s = 0; s < rows; ++s) {
    if (splits && state[s].count > chunk_terms) fold(s);  // the last chunk, shorter
    const T total = state[s].sum;
    if constexpr (kahan) {
      const T c = state[s].compensation;
      target[s] = std::isfinite(total) && c != 0 ? total + c : total;
    } else {
      target[s] = total;
    }
  }
  return true;
}

// A max or min of one column (see add_column): a row without terms keeps its value.
template <bool maximum, typename T, typename I>
bool pick_column(T* target, const T* source, const Rows<I>& index, int64_t rows,
                 bool include_base) {
  std::vector<SumRow<false, T>> state(rows);  // the pick; count: whether the row has one
  for (int64_t s = 0; s < rows; ++s) {
    state[s].sum = target[s];
    state[s].count = include_base ? 1 : 0;
  }
  for (int64_t i = 0; i < index.n; ++i) {
    const int64_t v = index.at(i);
    if (v < 0 || v >= rows) return false;
    auto& row = state[v];
    const T x = source[i], y = row.sum;
    if (row.count == 0) {
      row.count = 1;
      row.sum = x;
      continue;
    }
    const bool picked = ((x != x) | (maximum ? x > y : x < y)) & (y == y);
    row.sum = picked ? x : y;
  }
  for (int64_t s = 0; s < rows; ++s)
    if (state[s].count != 0) target[s] = state[s].sum;
  return true;
}

enum class Reduce { kSum, kMax, kMin };

// target reduced in place along dim with source's rows at the row index (values of `index`,
// stride apart, n of them), as the Python way's _segments.small_reduce_in_place would:
// whether it was (else nothing written). The shapes were checked by the caller: target and
// source agree on every dim but dim, source has n rows along it.
template <typename I>
bool reduce_rows_as(const at::Tensor& target, int64_t dim, const I* index_values,
                    int64_t index_stride, int64_t n, const at::Tensor& source, Reduce reduce,
                    bool include_base, double alpha) {
  const int sum_rule = g_sum_rule.load(std::memory_order_relaxed);
  if (reduce == Reduce::kSum && sum_rule == kNoSum) return false;
  const int64_t rows = target.size(dim);
  int64_t outer = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= target.size(d);
  const int64_t inner = target.numel() / (outer * rows);
  Rows<I> index{index_values, index_stride, n};
  const int64_t chunk_terms = g_chunk_terms.load(std::memory_order_relaxed);
  const bool is_float = target.scalar_type() == at::kFloat;
  if (outer == 1 && inner == 1) {
    auto column = [&](auto* out, const auto* in) {
      if (reduce == Reduce::kSum) {
        if (sum_rule == kKahan) return add_column<true, true>(out, in, index, rows, alpha,
                                                               chunk_terms);
        if (sum_rule == kWide) return add_column<false, true>(out, in, index, rows, alpha,
                                                               chunk_terms);
        return add_column<false, false>(out, in, index, rows, alpha, chunk_terms);
      }
      if (reduce == Reduce::kMax) return pick_column<true>(out, in, index, rows, include_base);
      return pick_column<false>(out, in, index, rows, include_base);
    };
    if (is_float) return column(target.mutable_data_ptr<float>(), source.const_data_ptr<float>());
    return column(target.mutable_data_ptr<double>(), source.const_data_ptr<double>());
  }
  if (!rows_fit(index, rows, reduce == Reduce::kSum && (sum_rule == kWide || sum_rule == kKahan),
                chunk_terms))
    return false;
  if (reduce == Reduce::kSum) {
    auto add = [&](auto* out, const auto* in) {
      if (sum_rule == kKahan)
        add_rows_compensated(out, in, index, outer, rows, inner, alpha);
      else
        add_rows(out, in, index, outer, rows, inner, alpha);
    };
    if (is_float)
      add(target.mutable_data_ptr<float>(), source.const_data_ptr<float>());
    else
      add(target.mutable_data_ptr<double>(), source.const_data_ptr<double>());
  } else {
    auto pick = [&](auto* out, const auto* in) {
      if (reduce == Reduce::kMax)
        pick_rows<true>(out, in, index, outer, rows, inner, include_base);
      else
        pick_rows<false>(out, in, index, outer, rows, inner, include_base);
    };
    if (is_float)
      pick(target.mutable_data_ptr<float>(), source.const_data_ptr<float>());
    else
      pick(target.mutable_data_ptr<double>(), source.const_data_ptr<double>());
  }
  return true;
}

// The signs of the zeros among n values, added to *positive and *negative.
template <typename T>
void zero_signs(const T* values, int64_t n, bool* positive, bool* negative) {
  // First how many zeros there are, in a loop without an exit or a branch (it vectorises):
  // most data has none, and the call then pays one fast pass.
  int64_t zeros = 0;
  for (int64_t i = 0; i < n; ++i) zeros += values[i] == T(0);
  if (zeros == 0) return;
  for (int64_t i = 0; i < n && !(*positive && *negative); ++i)
    if (values[i] == T(0)) (std::signbit(values[i]) ? *negative : *positive) = true;
}

void zero_signs(const at::Tensor& t, bool* positive, bool* negative) {
  if (t.scalar_type() == at::kFloat)
    zero_signs(t.const_data_ptr<float>(), t.numel(), positive, negative);
  else
    zero_signs(t.const_data_ptr<double>(), t.numel(), positive, negative);
}

// Whether an amax or amin compares zeros of both signs (in source, or in target too with
// include_base): in "autograd" mode torch's kernel breaks such ties its own way
// (_torch_breaks_zero_ties), so the Python kernel hands the call to it.
bool zero_ties(const at::Tensor& target, const at::Tensor& source, bool include_base) {
  bool positive = false, negative = false;
  zero_signs(source, &positive, &negative);
  if (include_base) zero_signs(target, &positive, &negative);
  return positive && negative;
}

// The checks every form shares (_short_plain, _changeable and small_reduce_in_place's): CPU
// strided tensors without lazy negation, target and source of one dtype, float32 or float64,
// an int32 or int64 index, all nonempty, a contiguous writable target and source, small, no
// memory shared; in "autograd" mode an amax or amin without zeros of both signs to compare
// (_torch_breaks_zero_ties: torch's kernel breaks such ties its own way); then the reduction.
bool reduce_rows(const at::Tensor& target, int64_t dim, const at::Tensor& index,
                 int64_t index_stride, int64_t n, const at::Tensor& source, Reduce reduce,
                 bool include_base, double alpha) {
  const auto dtype = target.scalar_type();
  if (!plain(target) || !plain(index) || !plain(source) || source.scalar_type() != dtype ||
      (dtype != at::kFloat && dtype != at::kDouble) || target.numel() == 0 ||
      source.numel() == 0 || !writable_target(target) || !source.is_contiguous() ||
      source.numel() + target.numel() > g_max_elements.load(std::memory_order_relaxed) ||
      spans_meet(target, source) || spans_meet(target, index))
    return false;
  if (reduce != Reduce::kSum && g_autograd.load(std::memory_order_relaxed) &&
      zero_ties(target, source, include_base))
    return false;
  if (index.scalar_type() == at::kLong)
    return reduce_rows_as(target, dim, index.const_data_ptr<int64_t>(), index_stride, n, source,
                          reduce, include_base, alpha);
  if (index.scalar_type() == at::kInt)
    return reduce_rows_as(target, dim, index.const_data_ptr<int32_t>(), index_stride, n, source,
                          reduce, include_base, alpha);
  return false;
}

// dim in [-ndim, ndim) made non-negative, or -1.
int64_t wrapped_dim(int64_t dim, int64_t ndim) {
  if (dim < -ndim || dim >= ndim) return -1;
  return dim < 0 ? dim + ndim : dim;
}

// target and source agree on every dim but dim.
bool same_but(const at::Tensor& a, const at::Tensor& b, int64_t dim) {
  if (a.dim() != b.dim()) return false;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (d != dim && a.size(d) != b.size(d)) return false;
  return true;
}

// Whether index_add_(Tensor(a!) self, int dim, Tensor index, Tensor source, *,
// Scalar alpha=1), its arguments args, ran here (_index_add_short): a 1-D index; in
// "autograd" mode only an alpha of 1 or -1.
bool index_add_ran_here(c10::ArrayRef<c10::IValue> args) {
  const at::Tensor& self = args[0].toTensor();
  const at::Tensor& index = args[2].toTensor();
  const at::Tensor& source = args[3].toTensor();
  const c10::Scalar alpha = args[4].toScalar();
  if (!alpha.isFloatingPoint() && !alpha.isIntegral(false)) return false;
  const double a = alpha.toDouble();
  const int64_t dim = wrapped_dim(args[1].toInt(), self.dim());
  return dim >= 0 && index.dim() == 1 &&
         !(g_autograd.load(std::memory_order_relaxed) && a != 1.0 && a != -1.0) &&
         same_but(self, source, dim) && source.size(dim) == index.size(0) &&
         reduce_rows(self, dim, index, index.stride(0), index.size(0), source, Reduce::kSum,
                     true, a);
}

// A scatter's index of src's shape that broadcasts one row index along every dim but dim by
// its layout (stride 0 or size 1 there: scatter_reduce.stride_zero_rows); the caller then
// reads it along dim with its stride.
bool stride_zero_rows(const at::Tensor& index, int64_t dim) {
  for (int64_t d = 0; d < index.dim(); ++d)
    if (d != dim && index.stride(d) != 0 && index.size(d) != 1) return false;
  return true;
}

// The scatter forms (_scatter_short): an index of src's shape whose rows broadcast, self of
// that shape but along dim; a sum from self, amax or amin.
bool scatter_rows(const at::Tensor& self, int64_t dim_arg, const at::Tensor& index,
                  const at::Tensor& src, Reduce reduce, bool include_self) {
  const int64_t ndim = self.dim();
  const int64_t dim = wrapped_dim(dim_arg, ndim);
  if (ndim == 0 || dim < 0 || index.dim() != ndim || index.sizes() != src.sizes() ||
      index.numel() == 0 || !same_but(self, index, dim) || !stride_zero_rows(index, dim))
    return false;
  return reduce_rows(self, dim, index, index.stride(dim), index.size(dim), src, reduce,
                     include_self, 1.0);
}

// scatter_add_(Tensor(a!) self, int dim, Tensor index, Tensor src)
bool scatter_add_ran_here(c10::ArrayRef<c10::IValue> args) {
  return scatter_rows(args[0].toTensor(), args[1].toInt(), args[2].toTensor(),
                      args[3].toTensor(), Reduce::kSum, true);
}

// scatter_reduce_.two(Tensor(a!) self, int dim, Tensor index, Tensor src, str reduce, *,
// bool include_self=True): a sum from self, amax, amin (a mean, a product and a sum from
// zero go to the Python kernel).
bool scatter_reduce_ran_here(c10::ArrayRef<c10::IValue> args) {
  const auto reduce_name = args[4].toStringView();
  const bool include_self = args[5].toBool();
  Reduce reduce = Reduce::kSum;
  if (reduce_name == "amax")
    reduce = Reduce::kMax;
  else if (reduce_name == "amin")
    reduce = Reduce::kMin;
  else if (reduce_name != "sum" || !include_self)
    return false;
  return scatter_rows(args[0].toTensor(), args[1].toInt(), args[2].toTensor(),
                      args[3].toTensor(), reduce, include_self);
}

// _index_put_impl_(Tensor(a!) self, Tensor?[] indices, Tensor values, bool accumulate=False,
// bool unsafe=False) with accumulate=True and one 1-D index along the first dim, values of
// the indexed shape (_index_put_short). Not in "exact" mode: configure sets no sum rule then.
bool index_put_ran_here(c10::ArrayRef<c10::IValue> args) {
  if (!args[3].toBool()) return false;
  const auto indices = args[1].toListRef();
  if (indices.size() != 1 || !indices[0].isTensor()) return false;
  const at::Tensor& self = args[0].toTensor();
  const at::Tensor& index = indices[0].toTensor();
  const at::Tensor& values = args[2].toTensor();
  return self.dim() >= 1 && index.dim() == 1 && values.dim() == self.dim() &&
         values.size(0) == index.size(0) && same_but(self, values, 0) &&
         reduce_rows(self, 0, index, index.stride(0), index.size(0), values, Reduce::kSum,
                     true, 1.0);
}

// The kernel of operator op, of `arguments` arguments: ran_here runs the call here where it
// fits (then counted, and its arguments on the stack replaced by its result, the target, the
// first argument, itself); else to_fallback.
template <Op op, size_t arguments, bool (*ran_here)(c10::ArrayRef<c10::IValue>)>
void switched_kernel(const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack) {
  if (fast_calls_on() && ran_here(torch::jit::last(*stack, arguments))) {
    g_counts[op].fetch_add(1, std::memory_order_relaxed);
    at::Tensor target = (*stack)[stack->size() - arguments].toTensor();
    torch::jit::drop(*stack, arguments);
    stack->emplace_back(std::move(target));
    return;
  }
  to_fallback(op, handle, keys, stack);
}

// Overriding a kernel is the point here: c10's warning that it happens is not printed.
class QuietWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

const char* const kSchemas[kOps][2] = {{"aten::index_add_", ""},
                                       {"aten::scatter_add_", ""},
                                       {"aten::scatter_reduce_", "two"},
                                       {"aten::_index_put_impl_", ""}};

// Each operator's kernel at the CPU key now, into into[op].
void capture_cpu_kernels(std::shared_ptr<const c10::SafeKernelFunction> (&into)[kOps]) {
  auto& dispatcher = c10::Dispatcher::singleton();
  for (int op = 0; op < kOps; ++op) {
    auto handle = dispatcher.findSchemaOrThrow(kSchemas[op][0], kSchemas[op][1]);
    std::atomic_store(&into[op], std::shared_ptr<const c10::SafeKernelFunction>(
                                     std::make_shared<c10::SafeKernelFunction>(
                                         handle.getComputedKernelForDispatchKey(
                                             c10::DispatchKey::CPU))));
  }
}

}  // namespace

extern "C" {

// Takes the kernels registered at the CPU key now as torch's own: call it before the switch
// registers its Python kernels. 0, or -1 with detsum_native_error's message.
int detsum_native_capture_torch() {
  try {
    capture_cpu_kernels(g_torch);
    return 0;
  } catch (const std::exception& error) {
    g_error = error.what();
    return -1;
  }
}

// Installs the kernels at the CPU key over the ones registered there now (the switch's
// Python kernels), which become their fallbacks: 0, or -1 with detsum_native_error's message.
int detsum_native_install() {
  try {
    QuietWarnings quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    capture_cpu_kernels(g_fallback);
    auto library = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", std::optional<c10::DispatchKey>(c10::DispatchKey::CPU),
        __FILE__, __LINE__);
    library->impl("index_add_",
                  torch::CppFunction::makeFromBoxedFunction<
                      &switched_kernel<kIndexAdd, 5, &index_add_ran_here>>());
    library->impl("scatter_add_",
                  torch::CppFunction::makeFromBoxedFunction<
                      &switched_kernel<kScatterAdd, 4, &scatter_add_ran_here>>());
    library->impl("scatter_reduce_.two",
                  torch::CppFunction::makeFromBoxedFunction<
                      &switched_kernel<kScatterReduce, 6, &scatter_reduce_ran_here>>());
    library->impl("_index_put_impl_",
                  torch::CppFunction::makeFromBoxedFunction<
                      &switched_kernel<kIndexPut, 5, &index_put_ran_here>>());
    g_library = std::move(library);
    return 0;
  } catch (const std::exception& error) {
    g_error = error.what();
    return -1;
  }
}

// Removes the kernels: the ones they were installed over run again.
void detsum_native_uninstall() {
  QuietWarnings quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  g_library.reset();
}

const char* detsum_native_error() { return g_error.c_str(); }

// The switch's state: see g_active and the others above.
void detsum_native_configure(int on, int active, int sum_rule, int autograd,
                             int64_t max_elements, int64_t chunk_terms) {
  g_on.store(on);
  g_sum_rule.store(sum_rule);
  g_autograd.store(autograd);
  g_max_elements.store(max_elements);
  g_chunk_terms.store(chunk_terms);
  g_active.store(active);
}

// While set in a thread, its calls of these ops go to torch's kernel (detsum's own code inside
// a switched call asks for it).
void detsum_native_set_inside(int inside) { t_inside = inside != 0; }

// The calls run here since the last take, per operator (kOpNames's order): into counts[op]
// those run on detsum, into counts[kOps + op] those handed straight to torch's kernel; those
// counts are zeroed.
void detsum_native_take_counts(int64_t* counts) {
  for (int op = 0; op < kOps; ++op) {
    counts[op] = g_counts[op].exchange(0);
    counts[kOps + op] = g_torch_counts[op].exchange(0);
  }
}

const char* detsum_native_op_name(int op) { return op >= 0 && op < kOps ? kOpNames[op] : ""; }

int detsum_native_op_count() { return kOps; }

}  // extern "C"
