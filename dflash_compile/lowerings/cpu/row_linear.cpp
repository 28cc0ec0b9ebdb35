// dflash_cpu::row_linear(x, weight, bias) = F.linear(x, weight, bias) for fp32 CPU tensors, with a kernel of its own
// for the row counts a speculative step has (a few rows per request: the verified block, the drafter's block).
//
// Why: at a few rows MKL's fp32 GEMM runs far below the rate at which the weights stream from memory (SmolLM2-135M's
// linears, one thread: 43.7 ms for one row, 102.6 ms for eight; docs/benchmarks.md), while a linear with that few rows
// is memory-bound; up to 128 rows the kernel still beats it (row_linear.py has the figures). The kernel reads the
// weight from a packed copy (panels of kLanes output columns, each panel's K rows of kLanes floats contiguous), so
// one pass streams it once, in order, and each loaded vector of weights is multiplied by every input row (one
// broadcast multiply-add per row): no horizontal sums, no strided reads.
//
// The packed copy of a weight is made at its first call and kept (as much memory again as the weight) while the
// weight's storage lives; it is made again when the weight changes in place (its version counter) or another tensor
// takes its address. Outside kMinRows..kMaxRows rows (1..128), and for other dtypes, layouts or devices and
// inference tensors (no version counter), the op calls at::linear itself. It has no derivative: with grad mode on,
// an input that requires grad is an error.
//
// Built on first use with the host compiler for the host CPU (-march=native: GCC's vector types become AVX-512,
// AVX2 or what the machine has); see row_linear.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/Storage.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <map>
#include <tuple>

#include "simd.h"

namespace {

constexpr int64_t kMinRows = DFLASH_ROW_LINEAR_MIN_ROWS;
constexpr int64_t kMaxRows = DFLASH_ROW_LINEAR_MAX_ROWS;
using dflash_simd::fmadd;
using dflash_simd::kLanes;
using dflash_simd::load;
using dflash_simd::vec;
#ifdef __AVX512F__
constexpr int kRowChunk = 8;  // rows per pass over a group of panels
constexpr int kPanels = 2;    // panels dotted together: 8 x 2 accumulators of the 32 registers
#else
constexpr int kRowChunk = 4;
constexpr int kPanels = 3;    // 4 x 3 accumulators, 3 weight vectors and a broadcast: the 16 registers
#endif

// ------------------------------------------------------------------------------------------------ packed weights
// packed[p][k][j] = weight[p * kLanes + j][k] (zero past the last row): [ceil(N / kLanes), K, kLanes]
// `parallel`: on torch's threads (a step's first call); else on the calling thread alone (a helper thread packing
// ahead of the step, which must not start a thread team of its own next to the step's).
at::Tensor pack(const at::Tensor& weight, bool parallel) {
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kLanes - 1) / kLanes;
  at::Tensor packed = at::empty({P, K, kLanes}, weight.options());
  const float* src = weight.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, P, parallel ? 8 : P, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int j = 0; j < kLanes; ++j) {
        const int64_t n = p * kLanes + j;
        float* d = dst + p * K * kLanes + j;
        if (n < N)
          for (int64_t k = 0; k < K; ++k) d[k * kLanes] = src[n * K + k];
        else
          for (int64_t k = 0; k < K; ++k) d[k * kLanes] = 0.f;
      }
  });
  return packed;
}

struct Packed {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // expired: the weight is gone (its address may be reused)
  int64_t version;
  at::Tensor packed;
};

// keyed by (address, rows, columns): two weights at one address (a fused weight and a slice of its first rows) keep
// a copy each
std::mutex cache_mutex;
std::map<std::tuple<const void*, int64_t, int64_t>, Packed> cache;

at::Tensor packed_for(const at::Tensor& weight, bool parallel = true) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  const auto key = std::make_tuple(static_cast<const void*>(weight.data_ptr()), weight.size(0), weight.size(1));
  const int64_t version = weight._version();
  auto it = cache.find(key);
  if (it != cache.end() && !it->second.storage.expired() && it->second.version == version)
    return it->second.packed;
  for (auto e = cache.begin(); e != cache.end();) e = e->second.storage.expired() ? cache.erase(e) : std::next(e);
  Packed entry{weight.storage().getWeakStorageImpl(), version, pack(weight, parallel)};
  cache.insert_or_assign(key, entry);
  return entry.packed;
}

// ------------------------------------------------------------------------------------------------ the kernel
// out[0:MC, columns of panels p .. p + NP) = x[0:MC] . weight^T (+ bias), the panels read once.
template <int MC, int NP>
void panels(const float* x, const float* packed, const float* bias, float* out, int64_t N, int64_t K, int64_t p) {
  vec acc[MC][NP];
  for (int m = 0; m < MC; ++m)
    for (int q = 0; q < NP; ++q) acc[m][q] = vec{};
  const float* w = packed + p * K * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    vec wv[NP];
    for (int q = 0; q < NP; ++q) wv[q] = load(w + (q * K + k) * kLanes);
    for (int m = 0; m < MC; ++m) {
      const float xv = x[m * K + k];
      for (int q = 0; q < NP; ++q) acc[m][q] = fmadd(xv, wv[q], acc[m][q]);
    }
  }
  for (int q = 0; q < NP; ++q) {
    const int64_t n0 = (p + q) * kLanes;
    const int cols = static_cast<int>(std::min<int64_t>(kLanes, N - n0));
    for (int m = 0; m < MC; ++m) {
      vec v = acc[m][q];
      if (bias)
        for (int j = 0; j < cols; ++j) v[j] += bias[n0 + j];
      if (cols == kLanes)
        __builtin_memcpy(out + m * N + n0, &v, sizeof(vec));
      else
        for (int j = 0; j < cols; ++j) out[m * N + n0 + j] = v[j];
    }
  }
}

template <int MC>
void panels_np(int np, const float* x, const float* packed, const float* bias, float* out, int64_t N, int64_t K,
               int64_t p) {
  if (np == kPanels)
    panels<MC, kPanels>(x, packed, bias, out, N, K, p);
  else
    for (int q = 0; q < np; ++q) panels<MC, 1>(x, packed, bias, out, N, K, p + q);
}

template <int... Ms>
struct Rows;
template <>
struct Rows<> {
  static void run(int64_t, int, const float*, const float*, const float*, float*, int64_t, int64_t, int64_t) {}
};
template <int M, int... Ms>
struct Rows<M, Ms...> {
  static void run(int64_t mc, int np, const float* x, const float* packed, const float* bias, float* out, int64_t N,
                  int64_t K, int64_t p) {
    if (mc == M)
      panels_np<M>(np, x, packed, bias, out, N, K, p);
    else
      Rows<Ms...>::run(mc, np, x, packed, bias, out, N, K, p);
  }
};

void run(int64_t rows, const float* x, const float* packed, const float* bias, float* out, int64_t N, int64_t K) {
  const int64_t P = (N + kLanes - 1) / kLanes, groups = (P + kPanels - 1) / kPanels;
  // a task: ~64 KB of packed weights; every row chunk of a group of panels while it is in the cache
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K * kLanes * kPanels / 16, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * kPanels;
      const int np = static_cast<int>(std::min<int64_t>(kPanels, P - p));
      for (int64_t r = 0; r < rows; r += kRowChunk) {
        const int64_t mc = std::min<int64_t>(kRowChunk, rows - r);
#ifdef __AVX512F__
        Rows<1, 2, 3, 4, 5, 6, 7, 8>::run(mc, np, x + r * K, packed, bias, out + r * N, N, K, p);
#else
        Rows<1, 2, 3, 4>::run(mc, np, x + r * K, packed, bias, out + r * N, N, K, p);
#endif
      }
    }
  });
}

bool takes(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (x.device().type() != at::kCPU || x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat ||
      weight.device().type() != at::kCPU || weight.dim() != 2 || !weight.is_contiguous() || x.dim() < 1 ||
      x.size(-1) != weight.size(1) || weight.size(1) == 0 || weight.is_inference() || x.layout() != at::kStrided ||
      weight.layout() != at::kStrided)
    return false;
  if (bias && (bias->scalar_type() != at::kFloat || !bias->is_contiguous() || bias->dim() != 1 ||
               bias->size(0) != weight.size(0) || bias->device().type() != at::kCPU))
    return false;
  const int64_t rows = x.numel() / x.size(-1);
  return rows >= kMinRows && rows <= kMaxRows;
}

at::Tensor row_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  // no derivative: a call that autograd would have to record is an error, never a result without a gradient
  TORCH_CHECK(!at::GradMode::is_enabled() ||
                  !(x.requires_grad() || weight.requires_grad() || (bias && bias->requires_grad())),
              "dflash_cpu::row_linear has no derivative: call it under torch.no_grad() (the compiled step does)");
  if (!takes(x, weight, bias)) return at::linear(x, weight, bias);
  const int64_t K = weight.size(1), N = weight.size(0), rows = x.numel() / K;
  // x's rows as one [rows, K] matrix; the output made in x's shape at once (no views: a step calls this ~200 times,
  // and each ATen call costs about a microsecond)
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  const at::Tensor packed = packed_for(weight);
  c10::SmallVector<int64_t, 4> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, x.options());
  run(rows, xc.data_ptr<float>(), packed.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
      out.data_ptr<float>(), N, K);
  return out;
}

// Packs `weight` now, as its first row_linear call would (any row count the op takes), on the calling thread alone:
// `row_linear.prepack` calls it from a helper thread while the step graphs load, so a warm start's first step does
// not pack every weight itself. A weight the op would not take (not an fp32 contiguous CPU matrix) is left alone.
void row_linear_prepack(const at::Tensor& weight) {
  const at::Tensor one_row = at::empty({1, weight.dim() == 2 ? weight.size(1) : 0}, weight.options());
  if (takes(one_row, weight, std::nullopt)) packed_for(weight, /*parallel=*/false);
}

// The packed copies the op holds now, (copies, bytes): a copy whose weight is gone counts until the next call that
// packs drops it. For tests and the memory figure in the docs.
std::tuple<int64_t, int64_t> packed_weights() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  int64_t bytes = 0;
  for (const auto& e : cache) bytes += e.second.packed.numel() * static_cast<int64_t>(sizeof(float));
  return {static_cast<int64_t>(cache.size()), bytes};
}

// How many threads at::parallel_for gives this library's kernels for `tasks` tasks: the calling thread's
// torch.get_num_threads() (capped by the tasks) when the library was built with OpenMP, 1 when it was not (its
// parallel_for is a header template compiled in here; a build without -fopenmp ran every kernel on one thread).
int64_t parallel_workers(int64_t tasks) {
  std::mutex m;
  int64_t most = 0;
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(m);
    most = std::max<int64_t>(most, at::get_thread_num() + 1);
  });
  return most;
}

at::Tensor row_linear_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  auto sizes = x.sym_sizes().vec();
  sizes.back() = weight.sym_size(0);
  return at::empty_symint(sizes, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash_cpu, m) {
  m.def("row_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("row_linear_packed_weights() -> (int, int)");
  m.def("row_linear_prepack(Tensor weight) -> ()");
  m.def("parallel_workers(int tasks) -> int");
}

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) { m.impl("row_linear", row_linear); }
TORCH_LIBRARY_IMPL(dflash_cpu, Meta, m) { m.impl("row_linear", row_linear_meta); }
TORCH_LIBRARY_IMPL(dflash_cpu, CompositeExplicitAutograd, m) {
  m.impl("row_linear_packed_weights", packed_weights);
  m.impl("row_linear_prepack", row_linear_prepack);
  m.impl("parallel_workers", parallel_workers);
}
