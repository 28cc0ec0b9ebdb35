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
// A weight whose values are exactly block-quantised ones (a model loaded from a GGUF file: transformers dequantises
// it to fp32) is also packed as int8 codes with a scale and offset per block, for calls of up to kCodesMaxRows rows:
// the same fp32 values, rebuilt in registers, from a third of the bytes (see "packed weights" below).
//
// The packed copies of a weight are made at its first call of each kind and kept (as much memory again as the
// weight, and 0.31x for codes) while the weight's storage lives; they are made again when the weight changes in
// place (its version counter) or another tensor takes its address. Outside kMinRows..kMaxRows rows (1..128), and for
// other dtypes, layouts or devices and inference tensors (no version counter), the op calls at::linear itself. It
// has no derivative: with grad mode on, an input that requires grad is an error.
//
// Built on first use with the host compiler for the host CPU (-march=native: GCC's vector types become AVX-512,
// AVX2 or what the machine has); see row_linear.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/Storage.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
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
// One row through the codes form dots twice as many panels at once: each panel's sum is a chain of dependent
// multiply-adds, and kPanels chains leave the two FMA units waiting on their latency once decoding, not memory,
// sets the pace (SmolLM2's linears, one row: 15.6 -> 13.8 ms a pass; 8 panels 13.7, 12 panels 14.0; two rows, whose
// 2 x kPanels chains already overlap, gain ~1 %).
constexpr int kOneRowPanels = 2 * kPanels;

// ------------------------------------------------------------------------------------------------ packed weights
// Two forms of the packed copy, both in panels of kLanes output columns:
// - fp32: packed[p][k][j] = weight[p * kLanes + j][k] (zero past the last row): [ceil(N / kLanes), K, kLanes] floats.
// - codes, when every value of the weight is exactly fma(q, d, m) for an int8 code q and a scale d and offset m per
//   block of kCodeBlock values along K of a row (fp32, one rounding): a weight dequantised from a block-quantised
//   file is (GGUF's Q8_0, Q4_0, Q5_0: d * q, signed codes; Q4_1, Q5_1: d * q + m, codes from 0; the product is exact
//   in fp32, so one rounding either way), and transformers loads a GGUF file as such fp32 values. Not found: the
//   K-quants (Q4_K, Q6_K, ...), whose block scale is an fp16 times a 6-bit integer, not an fp16. Per panel and
//   block: d[kLanes], m[kLanes] (floats), then q[kCodeBlock][kLanes] (int8): 1.25 bytes a value instead of 4. The
//   kernel turns a block back into the same fp32 values, bit for bit, before it multiplies them: results are those
//   of the fp32 form, the weights stream from memory at a third of the bytes. Found at packing, by trying the scales
//   such a file would hold and checking every value; one value that does not fit keeps the fp32 form for the whole
//   weight. DFLASH_ROW_LINEAR_CODES=0 keeps every weight in fp32.
constexpr int64_t kCodeBlock = 32;
constexpr int64_t kCodesMaxRows = 4;  // more rows: the fp32 form (decoding costs more than the bytes it saves there)
constexpr int64_t kCodeBytes = kLanes * (2 * sizeof(float) + kCodeBlock);  // a panel's block: d, m, codes

inline uint32_t bits(float v) {
  uint32_t u;
  __builtin_memcpy(&u, &v, sizeof(u));
  return u;
}

// Codes q for v[0:kCodeBlock) with fma(q, d, m) == v bit for bit, if they exist (q in [-128, 127]).
bool fits(const float* v, float d, float m, int8_t* q) {
  for (int64_t i = 0; i < kCodeBlock; ++i) {
    const double r = d == 0.f ? 0.0 : (static_cast<double>(v[i]) - m) / d;
    if (!(r > -128.5 && r < 127.5)) return false;
    q[i] = static_cast<int8_t>(std::nearbyint(r));
    // the float of the int8 code, as the kernel makes it (+0, never the -0 that rounding -0.3 gives)
    if (bits(std::fma(static_cast<float>(q[i]), d, m)) != bits(v[i])) return false;
  }
  return true;
}

// A scale d, offset m and codes for one block of a row: the offset -0 (x + -0 is x) with the largest magnitude over
// 127 (Q8_0), 8 (Q4_0), 16 (Q5_0) or the symmetric 7 and 15, or the offset the block's minimum with the range over 15
// (Q4_1) or 31 (Q5_1); each scale as a file holds it (the nearest fp16) and its two neighbours either side.
bool encode(const float* v, float& d, float& m, int8_t* q) {
  float lo = v[0], hi = v[0], amax = 0.f;
  for (int64_t i = 0; i < kCodeBlock; ++i) {
    lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  const std::pair<float, float> guesses[] = {{-0.f, amax / 127.f}, {-0.f, amax / 8.f}, {-0.f, amax / 7.f},
                                             {-0.f, amax / 16.f}, {-0.f, amax / 15.f},
                                             {lo, (hi - lo) / 15.f}, {lo, (hi - lo) / 31.f}};
  for (const auto& [offset, scale] : guesses) {
    const uint16_t h = c10::Half(scale).x;
    for (int step = -2; step <= 2; ++step) {
      const int32_t hb = static_cast<int32_t>(h) + step;
      if (hb < 0 || hb > 0x7bff) continue;  // positive finite halves
      const float dd = static_cast<float>(c10::Half(static_cast<uint16_t>(hb), c10::Half::from_bits()));
      // either sign: a negative scale (Q4_0's, Q5_0's) makes the zeros -0
      for (const float signed_d : {dd, -dd})
        if (fits(v, signed_d, offset, q)) {
          d = signed_d, m = offset;
          return true;
        }
    }
  }
  return false;
}

bool codes_allowed() {
  const char* e = std::getenv("DFLASH_ROW_LINEAR_CODES");
  return !(e && std::string(e) == "0");
}

// The codes form of `weight`, or an undefined tensor when a value does not fit (or K is not whole blocks).
at::Tensor pack_codes(const at::Tensor& weight, bool parallel) {
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kLanes - 1) / kLanes, B = K / kCodeBlock;
  if (K % kCodeBlock || !codes_allowed()) return at::Tensor();
  at::Tensor packed = at::empty({P, B, kCodeBytes}, weight.options().dtype(at::kByte));
  const float* src = weight.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, P, parallel ? 8 : P, [&](int64_t p0, int64_t p1) {
    int8_t q[kCodeBlock];
    for (int64_t p = p0; p < p1 && ok; ++p)
      for (int64_t b = 0; b < B && ok; ++b) {
        uint8_t* blk = dst + (p * B + b) * kCodeBytes;
        float* d = reinterpret_cast<float*>(blk);
        float* m = d + kLanes;
        int8_t* codes = reinterpret_cast<int8_t*>(m + kLanes);
        for (int j = 0; j < kLanes; ++j) {
          const int64_t n = p * kLanes + j;
          if (n >= N) {  // past the last row: zeros
            d[j] = 0.f, m[j] = 0.f;
            for (int64_t k = 0; k < kCodeBlock; ++k) codes[k * kLanes + j] = 0;
            continue;
          }
          if (!encode(src + n * K + b * kCodeBlock, d[j], m[j], q)) {
            ok = false;
            break;
          }
          for (int64_t k = 0; k < kCodeBlock; ++k) codes[k * kLanes + j] = q[k];
        }
      }
  });
  return ok ? packed : at::Tensor();
}

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
  at::Tensor packed;  // float: the fp32 form; uint8: the codes form; undefined: the weight has no codes form
};

// keyed by (address, rows, columns, codes): two weights at one address (a fused weight and a slice of its first
// rows) keep a copy each; a weight read at both kinds of row count keeps both forms
std::mutex cache_mutex;
std::map<std::tuple<const void*, int64_t, int64_t, bool>, Packed> cache;

// `weight`'s entry of one form, if it is there and still made from the weight as it is (call with the lock held).
const Packed* cached(const at::Tensor& weight, bool codes) {
  const auto it =
      cache.find(std::make_tuple(static_cast<const void*>(weight.data_ptr()), weight.size(0), weight.size(1), codes));
  return it != cache.end() && !it->second.storage.expired() && it->second.version == weight._version() ? &it->second
                                                                                                      : nullptr;
}

// `weight`'s packed copy in the codes form (undefined when it has none) or the fp32 form, made now if need be.
at::Tensor packed_for(const at::Tensor& weight, bool codes, bool parallel = true) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (const Packed* hit = cached(weight, codes)) return hit->packed;
  const auto key = std::make_tuple(static_cast<const void*>(weight.data_ptr()), weight.size(0), weight.size(1), codes);
  const int64_t version = weight._version();
  for (auto e = cache.begin(); e != cache.end();) e = e->second.storage.expired() ? cache.erase(e) : std::next(e);
  Packed entry{weight.storage().getWeakStorageImpl(), version,
               codes ? pack_codes(weight, parallel) : pack(weight, parallel)};
  cache.insert_or_assign(key, entry);
  return entry.packed;
}

// ------------------------------------------------------------------------------------------------ the kernel
// A group of kPanels panels is read in blocks of kKBlock of its K rows, and every row chunk runs over a block while
// it is in L1: the multiply-adds of the second and later row chunks overlap the weights' stream from memory instead
// of following it from L2. Each chunk's accumulators rest in `part` between blocks; every output still sums its
// products in the order k = 0, 1, ... K - 1 into one accumulator, so a row's result does not depend on the rows
// computed with it, nor on the form the weight is packed in.
constexpr int64_t kKBlock = kCodeBlock;

// part[m * kPanels + q] += x[m][0:kn) . w's panel q rows 0:kn, for MC rows (x: row stride xs) and NP panels (panel
// q at w + q * ws * kLanes)
template <int MC, int NP>
void accumulate(const float* x, int64_t xs, const float* w, int64_t ws, int64_t kn, vec* part) {
  vec acc[MC][NP];
  for (int m = 0; m < MC; ++m)
    for (int q = 0; q < NP; ++q) acc[m][q] = part[m * kPanels + q];
  for (int64_t k = 0; k < kn; ++k) {
    vec wv[NP];
    for (int q = 0; q < NP; ++q) wv[q] = load(w + (q * ws + k) * kLanes);
    for (int m = 0; m < MC; ++m) {
      const float xv = x[m * xs + k];
      for (int q = 0; q < NP; ++q) acc[m][q] = fmadd(xv, wv[q], acc[m][q]);
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int q = 0; q < NP; ++q) part[m * kPanels + q] = acc[m][q];
}

template <int MC>
void accumulate_np(int np, const float* x, int64_t xs, const float* w, int64_t ws, int64_t kn, vec* part) {
  if (np == kPanels)
    accumulate<MC, kPanels>(x, xs, w, ws, kn, part);
  else
    for (int q = 0; q < np; ++q) accumulate<MC, 1>(x, xs, w + q * ws * kLanes, ws, kn, part + q);
}

template <int... Ms>
struct Rows;
template <>
struct Rows<> {
  static void run(int64_t, int, const float*, int64_t, const float*, int64_t, int64_t, vec*) {}
};
template <int M, int... Ms>
struct Rows<M, Ms...> {
  static void run(int64_t mc, int np, const float* x, int64_t xs, const float* w, int64_t ws, int64_t kn, vec* part) {
    if (mc == M)
      accumulate_np<M>(np, x, xs, w, ws, kn, part);
    else
      Rows<Ms...>::run(mc, np, x, xs, w, ws, kn, part);
  }
};

// kn (<= kKBlock) K rows of a group's np panels, every row chunk.
inline void block_rows(int64_t rows, int np, const float* x, int64_t K, const float* w, int64_t ws, int64_t kn,
                       vec* part) {
  for (int64_t r = 0; r < rows; r += kRowChunk) {
    const int64_t mc = std::min<int64_t>(kRowChunk, rows - r);
#ifdef __AVX512F__
    Rows<1, 2, 3, 4, 5, 6, 7, 8>::run(mc, np, x + r * K, K, w, ws, kn, part + r * kPanels);
#else
    Rows<1, 2, 3, 4>::run(mc, np, x + r * K, K, w, ws, kn, part + r * kPanels);
#endif
  }
}

// kLanes int8 codes as floats (exact). GCC's vector conversion of int8 lanes goes one lane at a time; the
// instructions do it whole.
inline vec code_floats(const int8_t* c) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
#else
  vec f;
  for (int j = 0; j < kLanes; ++j) f[j] = static_cast<float>(c[j]);
#endif
  vec v;
  __builtin_memcpy(&v, &f, sizeof(v));
  return v;
}

// part[m * kPanels + q] += x[m][0:kCodeBlock) . panel q's block of codes for MC (<= kCodesMaxRows) rows, each
// weight vector decoded in registers (fma(q, d, m), rounded once, as encode checked) right before its multiply-adds,
// in the fp32 form's order. blk: panel 0's block; panel q's at blk + q * stride.
template <int MC, int NP>
void accumulate_codes(const float* x, int64_t xs, const uint8_t* blk, int64_t stride, vec* part) {
  vec acc[MC][NP], d[NP], m[NP];
  const int8_t* codes[NP];
  for (int q = 0; q < NP; ++q) {
    const float* f = reinterpret_cast<const float*>(blk + q * stride);
    d[q] = load(f), m[q] = load(f + kLanes);
    codes[q] = reinterpret_cast<const int8_t*>(f + 2 * kLanes);
    for (int r = 0; r < MC; ++r) acc[r][q] = part[r * kPanels + q];
  }
  for (int64_t k = 0; k < kCodeBlock; ++k)
    for (int q = 0; q < NP; ++q) {
      const vec w = fmadd(code_floats(codes[q] + k * kLanes), d[q], m[q]);
      for (int r = 0; r < MC; ++r) acc[r][q] = fmadd(x[r * xs + k], w, acc[r][q]);
    }
  for (int r = 0; r < MC; ++r)
    for (int q = 0; q < NP; ++q) part[r * kPanels + q] = acc[r][q];
}

template <int MC>
void codes_np(int np, const float* x, int64_t xs, const uint8_t* blk, int64_t stride, vec* part) {
  if (np == kPanels && MC <= 2)
    accumulate_codes<MC, kPanels>(x, xs, blk, stride, part);
  else if (np == 3) {
    accumulate_codes<MC, 2>(x, xs, blk, stride, part);
    accumulate_codes<MC, 1>(x, xs, blk + 2 * stride, stride, part + 2);
  } else
    for (int q = 0; q < np; ++q) accumulate_codes<MC, 1>(x, xs, blk + q * stride, stride, part + q);
}

void run(int64_t rows, const float* x, const at::Tensor& packed, const float* bias, float* out, int64_t N, int64_t K) {
  const bool codes = packed.scalar_type() == at::kByte;
  const int64_t gp = codes && rows == 1 ? kOneRowPanels : kPanels;  // panels a group
  const int64_t P = (N + kLanes - 1) / kLanes, groups = (P + gp - 1) / gp;
  const float* wf = codes ? nullptr : packed.data_ptr<float>();
  const uint8_t* wc = codes ? packed.data_ptr<uint8_t>() : nullptr;
  // a task: ~64 KB of fp32 weights
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K * kLanes * gp / 16, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    vec part[std::max<int64_t>(kMaxRows * kPanels, kOneRowPanels)];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * gp;
      const int np = static_cast<int>(std::min<int64_t>(gp, P - p));
      for (int64_t i = 0; i < std::max<int64_t>(rows * kPanels, gp); ++i) part[i] = vec{};
      for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
        if (codes) {  // rows <= kCodesMaxRows
          const int64_t B = K / kCodeBlock;
          const uint8_t* blk = wc + (p * B + k0 / kCodeBlock) * kCodeBytes;
          if (rows == 1 && np == kOneRowPanels)
            accumulate_codes<1, kOneRowPanels>(x + k0, K, blk, B * kCodeBytes, part);
          else if (rows == 1)  // the last, partial group
            for (int q = 0; q < np; q += kPanels)
              codes_np<1>(std::min(kPanels, np - q), x + k0, K, blk + q * B * kCodeBytes, B * kCodeBytes, part + q);
          else if (rows == 2)
            codes_np<2>(np, x + k0, K, blk, B * kCodeBytes, part);
          else if (rows == 3)
            codes_np<3>(np, x + k0, K, blk, B * kCodeBytes, part);
          else
            codes_np<4>(np, x + k0, K, blk, B * kCodeBytes, part);
        } else {
          block_rows(rows, np, x + k0, K, wf + (p * K + k0) * kLanes, K, std::min<int64_t>(kKBlock, K - k0), part);
        }
      }
      for (int q = 0; q < np; ++q) {
        const int64_t n0 = (p + q) * kLanes;
        const int cols = static_cast<int>(std::min<int64_t>(kLanes, N - n0));
        for (int64_t m = 0; m < rows; ++m) {
          vec v = part[m * kPanels + q];
          if (bias)
            for (int j = 0; j < cols; ++j) v[j] += bias[n0 + j];
          if (cols == kLanes)
            __builtin_memcpy(out + m * N + n0, &v, sizeof(vec));
          else
            for (int j = 0; j < cols; ++j) out[m * N + n0 + j] = v[j];
        }
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
  at::Tensor packed;
  if (rows <= kCodesMaxRows) packed = packed_for(weight, /*codes=*/true);
  if (!packed.defined()) packed = packed_for(weight, /*codes=*/false);
  c10::SmallVector<int64_t, 4> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, x.options());
  run(rows, xc.data_ptr<float>(), packed, bias ? bias->data_ptr<float>() : nullptr,
      out.data_ptr<float>(), N, K);
  return out;
}

// Packs `weight` now, in both forms (the codes form when it has one), as its first row_linear calls would, on the
// calling thread alone:
// `row_linear.prepack` calls it from a helper thread while the step graphs load, so a warm start's first step does
// not pack every weight itself. A weight the op would not take (not an fp32 contiguous CPU matrix) is left alone.
void row_linear_prepack(const at::Tensor& weight) {
  const at::Tensor one_row = at::empty({1, weight.dim() == 2 ? weight.size(1) : 0}, weight.options());
  if (!takes(one_row, weight, std::nullopt)) return;
  packed_for(weight, /*codes=*/true, /*parallel=*/false);
  packed_for(weight, /*codes=*/false, /*parallel=*/false);
}

// The packed copies the op holds now, (copies, bytes): a copy whose weight is gone counts until the next call that
// packs drops it. For tests and the memory figure in the docs.
std::tuple<int64_t, int64_t> packed_weights() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  int64_t copies = 0, bytes = 0;
  for (const auto& e : cache)
    if (e.second.packed.defined()) ++copies, bytes += static_cast<int64_t>(e.second.packed.nbytes());
  return {copies, bytes};
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

// The forms `weight` is packed in now: "codes", "fp32", "codes fp32", or "" (not packed, or packed before it changed).
std::string packed_form(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  std::string forms;
  for (const bool codes : {true, false})
    if (const Packed* hit = cached(weight, codes); hit && hit->packed.defined())
      forms += forms.empty() ? "" : " ", forms += codes ? "codes" : "fp32";
  return forms;
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
  m.def("row_linear_packed_form(Tensor weight) -> str");
  m.def("parallel_workers(int tasks) -> int");
}

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) { m.impl("row_linear", row_linear); }
TORCH_LIBRARY_IMPL(dflash_cpu, Meta, m) { m.impl("row_linear", row_linear_meta); }
TORCH_LIBRARY_IMPL(dflash_cpu, CompositeExplicitAutograd, m) {
  m.impl("row_linear_packed_weights", packed_weights);
  m.impl("row_linear_prepack", row_linear_prepack);
  m.impl("row_linear_packed_form", packed_form);
  m.impl("parallel_workers", parallel_workers);
}
