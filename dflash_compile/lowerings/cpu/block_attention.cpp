// dflash_cpu::block_attention: dflash::block_attention (lowerings/ops.py, same contract) for fp32 CPU tensors,
// reading the context's K/V in place in the paged pool.
//
// Why: the ATen form of the op (block_attention.py) gathers every row's context K/V out of the pool into dense
// [B, Hkv, S, D] buffers, then multiplies: each layer of a batched decode step copies its whole context once more
// before reading it (SmolLM2-135M at batch 8, one thread: the gather kernels 8 ms and the score/value bmm 6 ms of a
// 65 ms step; docs/benchmarks.md). Here each (row, KV head) task walks the row's block table and reads every visible
// key and value once from its slot, for all the query heads that share it (GQA without a repeat), with no copy.
//
// Per task, as two small matrix products. The scores S = K Q^T ([G * T, keys]) come kLanes keys at a time for one
// query: each dot product runs across the head dim in the vector lanes, and the lanes of kLanes such products are
// summed into one vector of kLanes scores (a tree of shuffles and adds, the same for every lane). A query's scores
// are thus one vector per kLanes keys whatever the number of queries: plain decoding (G * T = 3 queries per KV head
// on SmolLM2, 2 on the tiny pair) fills every lane, where a layout with the queries across the lanes would fill G * T
// of them (every key's score, exp and weight computed 8 / 3 times over; docs/kernels.md has the figures). Then the
// softmax along each query's row in fp32 (a vectorised exp), and out = S^T V a few queries by four value vectors at a
// time. Buffers per worker thread, reused from task to task. A key no query of the
// task sees (a masked position, a context position at or past the row's length, whose page may be unallocated, -1) is
// never read, so garbage or NaN at unallocated or stale slots cannot reach the output; a key some query sees has
// weight 0 (exp of -inf) for the queries that do not. A query that sees no key returns zeros. Each query's result is
// the same operations in the same order whatever the queries computed with it (block length, query heads, rows): a
// score is one chain of fused multiply-adds per lane and one fixed tree, the softmax's sum one chain per lane (keys
// l, l + kLanes, ..; keys it does not see add exactly 0) then the lanes in order, an output one chain over the keys.
// Summation order differs from the ATen form's BLAS calls (equal to rounding, not bit for bit).
//
// Built with row_linear.cpp into one library (row_linear.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace {

using dflash_simd::fmadd;
using dflash_simd::kLanes;
using dflash_simd::load;
using dflash_simd::store;
using dflash_simd::vec;

// Two vectors' even lanes, then their odd lanes: [x0, x2, .., y0, y2, ..] and [x1, x3, .., y1, y3, ..].
template <std::size_t... I>
inline vec evens(vec x, vec y, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, y, (2 * I)...);
}
template <std::size_t... I>
inline vec odds(vec x, vec y, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, y, (2 * I + 1)...);
}

// Lane j of the result: the sum of a[j]'s lanes, by the same pairwise tree for every j (((0+1)+(2+3))+((4+5)+(6+7))
// with 8 lanes): each level adds neighbouring lanes of two vectors into one. a[] is overwritten.
inline vec sum_lanes(vec* a) {
#if defined(__AVX__) && !defined(__AVX512F__) && !defined(DFLASH_GENERIC_SUM_LANES)
  // the same tree with AVX's in-lane horizontal adds (the generic form below, whose shuffles cross the 128-bit halves,
  // measured 0.20 against 0.17 ms a call for 8 rows of SmolLM2's plain step, 0.97 against 0.78 for a verify of 8):
  // each 128-bit half of u0 / u1 holds the sums of lanes 0-3 / 4-7 of four of the vectors, which the last add pairs up.
  // (DFLASH_GENERIC_SUM_LANES: the generic form, which AVX-512 machines build, checked here by a test.)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_permute2f128_ps(u0, u1, 0x20) + _mm256_permute2f128_ps(u0, u1, 0x31);
#else
  const auto half = std::make_index_sequence<kLanes>{};
  for (int n = kLanes; n > 1; n /= 2)
    for (int k = 0; k < n / 2; ++k) a[k] = evens(a[2 * k], a[2 * k + 1], half) + odds(a[2 * k], a[2 * k + 1], half);
  return a[0];
#endif
}

// kLanes dot products scale * (key . query) summed into one vector, one product a lane: the head dim across
// the lanes (one chain of fused multiply-adds per lane, in order), then sum_lanes. A score is the same operations
// whatever its lane, its tile or the queries beside it. Each query holds Dp >= D floats, zeros past D; a head dim that
// is no multiple of the vector reads the keys' last values into a zeroed vector. Lane q * NK + j: query q, key j; two
// forms, kLanes keys for one query and kLanes / 2 keys for two queries (each key vector loaded serves both).
template <int NK, int NQ>
inline vec score_tile(const float* const* keys, const float* const* qs, int64_t D, float scale) {
  static_assert(NK * NQ == kLanes, "one lane per (query, key)");
  vec acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = vec{};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    vec kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = load(keys[j] + d);
    for (int q = 0; q < NQ; ++q) {
      const vec qv = load(qs[q] + d);
      for (int j = 0; j < NK; ++j) acc[q * NK + j] = fmadd(kv[j], qv, acc[q * NK + j]);
    }
  }
  if (d < D) {
    vec kv[NK];
    for (int j = 0; j < NK; ++j) {
      kv[j] = vec{};
      __builtin_memcpy(&kv[j], keys[j] + d, (D - d) * sizeof(float));
    }
    for (int q = 0; q < NQ; ++q) {
      const vec qv = load(qs[q] + d);
      for (int j = 0; j < NK; ++j) acc[q * NK + j] = fmadd(kv[j], qv, acc[q * NK + j]);
    }
  }
  return sum_lanes(acc) * scale;
}

// The [R, Lp] scores of R queries (qt: [R, Dp]) for the Lp keys: two queries at a time, then the last one alone.
inline void scores_of(const float* const* keys, int64_t Lp, const float* qt, int64_t R, int64_t Dp, int64_t D,
                      float scale, float* s) {
  constexpr int H = kLanes / 2;
  for (int64_t i = 0; i < Lp; i += kLanes) {
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) {
      const float* qs[2] = {qt + r * Dp, qt + (r + 1) * Dp};
      for (int64_t h = 0; h < kLanes; h += H) {
        const vec v = score_tile<H, 2>(keys + i + h, qs, D, scale);
        __builtin_memcpy(s + r * Lp + i + h, &v, H * sizeof(float));
        __builtin_memcpy(s + (r + 1) * Lp + i + h, reinterpret_cast<const float*>(&v) + H, H * sizeof(float));
      }
    }
    if (r < R) {
      const float* qs[1] = {qt + r * Dp};
      store(s + r * Lp + i, score_tile<kLanes, 1>(keys + i, qs, D, scale));
    }
  }
}

// out[q * D + d] = sum_i w[q * Lp + i] * values[i][d] for the NQ queries of a tile and the head dims d0 .. d0 +
// NC * kLanes, in key order
template <int NQ, int NC>
void value_tile(const float* w, int64_t Lp, const float* const* values, int64_t L, int64_t d0, int64_t D,
                float* out) {
  vec acc[NQ][NC];
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) acc[q][c] = vec{};
  for (int64_t i = 0; i < L; ++i) {
    vec wv[NQ];  // the key's weight for each query, in every lane
    for (int q = 0; q < NQ; ++q) wv[q] = w[q * Lp + i] - vec{};
    for (int c = 0; c < NC; ++c) {  // one value vector at a time: NQ * NC + NQ + 1 registers
      const vec vv = load(values[i] + d0 + c * kLanes);
      for (int q = 0; q < NQ; ++q) acc[q][c] = fmadd(wv[q], vv, acc[q][c]);
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) store(out + q * D + d0 + c * kLanes, acc[q][c]);
}

template <int NQ>
void value_queries(const float* w, int64_t Lp, const float* const* values, int64_t L, int64_t D, float* out) {
  constexpr int NC = NQ == 1 ? 8 : 4;  // value vectors a pass: NQ * NC accumulators, at most 12
  int64_t d = 0;
  for (; d + NC * kLanes <= D; d += NC * kLanes) value_tile<NQ, NC>(w, Lp, values, L, d, D, out);
  for (; d + kLanes <= D; d += kLanes) value_tile<NQ, 1>(w, Lp, values, L, d, D, out);
  for (; d < D; ++d)  // a head dim that is no multiple of the vector: the last values one at a time
    for (int q = 0; q < NQ; ++q) {
      float a = 0.f;
      for (int64_t i = 0; i < L; ++i) a = __builtin_fmaf(w[q * Lp + i], values[i][d], a);
      out[q * D + d] = a;
    }
}

// exp(x) for a vector, x <= 0 (scores minus their maximum): 2^n * e^r with |r| <= ln2 / 2, e^r by its degree-6
// Taylor polynomial (its remainder r^7 / 7! is at most 1.2e-7 there); x below -87 (and -inf: a key the query does not
// see) gives exactly 0, so such a key adds nothing to that query's output. Against one scalar std::exp per score: 435
// -> 383 us a layer at SmolLM2's shape, 8 rows, 200 tokens of context.
typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vec exp_nonpositive(vec x) {
  const ivec live = x >= -87.f;  // all ones where exp(x) is a normal float
  x = live ? x : vec{} - 87.f;
  const vec t = x * 1.44269504088896341f;  // x / ln 2
  ivec n = __builtin_convertvector(t, ivec);  // truncates toward zero: floor for t <= 0 ...
  n -= __builtin_convertvector(n, vec) > t ? 1 : 0;  // ... once the truncation above t is taken back
  const vec nf = __builtin_convertvector(n, vec);
  const vec r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;  // x - n ln 2, ln 2 in two parts
  vec p = r * (1.f / 720) + (1.f / 120);
  p = p * r + (1.f / 24);
  p = p * r + (1.f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  vec scale;
  const ivec bits = (n + 127) << 23;
  __builtin_memcpy(&scale, &bits, sizeof(vec));
  const vec out = p * scale;
  ivec raw;
  __builtin_memcpy(&raw, &out, sizeof(vec));
  raw &= live;
  vec res;
  __builtin_memcpy(&res, &raw, sizeof(vec));
  return res;
}

inline int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

struct Rule {  // MaskSpec.visible: primitives/masks.py
  bool causal;
  int64_t window, chunk;
  bool sees(int64_t P, int64_t p) const {
    return (!causal || p <= P) && (window == 0 || P - p < window) &&
           (chunk == 0 || floor_div(p, chunk) == floor_div(P, chunk));
  }
};

bool takes(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
           const std::optional<at::Tensor>& k_block, const std::optional<at::Tensor>& v_block) {
  auto fp32_cpu = [](const at::Tensor& t) {
    return t.device().type() == at::kCPU && t.scalar_type() == at::kFloat && t.layout() == at::kStrided;
  };
  if (!fp32_cpu(q) || !fp32_cpu(k_pool) || !fp32_cpu(v_pool) || q.dim() != 4 || k_pool.dim() != 3 ||
      v_pool.dim() != 3 || k_pool.stride(2) != 1 || v_pool.stride(2) != 1)
    return false;
  if (k_block.has_value() != v_block.has_value()) return false;
  if (k_block && (!fp32_cpu(*k_block) || !fp32_cpu(*v_block) || k_block->stride(3) != 1 || v_block->stride(3) != 1))
    return false;
  return true;
}

at::Tensor block_attention(const at::Tensor& q_in, const at::Tensor& k_pool_in, const at::Tensor& v_pool_in,
                           const at::Tensor& block_table_in, const at::Tensor& ctx_lens_in,
                           const at::Tensor& q_positions_in, const std::optional<at::Tensor>& k_block,
                           const std::optional<at::Tensor>& v_block, int64_t page_size, bool causal, int64_t window,
                           double scale, int64_t chunk) {
  TORCH_CHECK(takes(q_in, k_pool_in, v_pool_in, k_block, v_block),
              "dflash_cpu::block_attention takes fp32 CPU tensors: q [B, Hq, T, D], pools [slots, Hkv, D] and block "
              "K/V [B, Hkv, T, D], each with its last dim contiguous (other inputs: the ATen form, "
              "lowerings/cpu/block_attention.py)");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = block_table_in.to(at::kLong).contiguous();
  const at::Tensor lens = ctx_lens_in.to(at::kLong).contiguous();
  const at::Tensor qpos = q_positions_in.to(at::kLong).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k_pool_in.size(1), NB = table.size(1), slots = k_pool_in.size(0);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && k_pool_in.size(2) == D && v_pool_in.sizes() == k_pool_in.sizes(),
              "dflash_cpu::block_attention: q has ", Hq, " heads of ", D, ", the pools ", k_pool_in.sizes());
  TORCH_CHECK(table.size(0) == B && lens.size(0) == B && qpos.size(0) == B && qpos.size(1) == T && page_size > 0,
              "dflash_cpu::block_attention: inputs of other batch or block sizes than q");
  const bool with_block = k_block.has_value();
  if (with_block)
    TORCH_CHECK(k_block->size(0) == B && k_block->size(1) == Hkv && k_block->size(2) == T && k_block->size(3) == D &&
                    v_block->sizes() == k_block->sizes(),
                "dflash_cpu::block_attention: block K/V of ", k_block->sizes(), " for q of ", q.sizes());
  const int64_t G = Hq / Hkv, R = G * T, Dp = (D + kLanes - 1) / kLanes * kLanes;
  const Rule rule{causal, window, chunk};
  const bool plain = window == 0 && chunk == 0;
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool_in.data_ptr<float>();
  const float* vp = v_pool_in.data_ptr<float>();
  const int64_t ks0 = k_pool_in.stride(0), ks1 = k_pool_in.stride(1);
  const int64_t vs0 = v_pool_in.stride(0), vs1 = v_pool_in.stride(1);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* pp = qpos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t unseen = std::numeric_limits<int64_t>::min();  // the position of a padding key: no query sees it

  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores, qt;
    const std::vector<float> zeros(Dp, 0.f);  // the row a padding key points at
    std::vector<const float*> keys, values;
    std::vector<int64_t> key_pos;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t* P = pp + b * T;  // the queries' positions
      const int64_t n_ctx = std::min<int64_t>(std::max<int64_t>(lp[b], 0), NB * page_size);
      // the keys some query of this row sees, with their rows in the pool (or the block)
      keys.clear(), values.clear(), key_pos.clear();
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
      for (int64_t t = 0; t < T; ++t) lo = std::min(lo, P[t]), hi = std::max(hi, P[t]);
      auto page_of = [&](int64_t p, int64_t last) {  // the page holding positions p .. last (one page), checked
        const int64_t page = tp[b * NB + p / page_size];
        TORCH_CHECK(page >= 0 && page * page_size + last % page_size < slots, "dflash_cpu::block_attention: row ", b,
                    " reads position ", last, " (its length ", lp[b], ") from page ", page, " of its block table");
        return page;
      };
      auto add = [&](int64_t slot, int64_t p) {
        keys.push_back(kp + slot * ks0 + h * ks1), values.push_back(vp + slot * vs0 + h * vs1), key_pos.push_back(p);
      };
      if (plain) {  // no window, no chunks: the keys seen are a prefix of the context, page by page
        const int64_t end = causal ? std::min(n_ctx, hi + 1) : n_ctx;
        for (int64_t p0 = 0; p0 < end; p0 += page_size) {
          const int64_t p1 = std::min(end, p0 + page_size);
          const int64_t first = page_of(p0, p1 - 1) * page_size - p0;
          for (int64_t p = p0; p < p1; ++p) add(first + p, p);
        }
      } else {
        for (int64_t p = 0; p < n_ctx; ++p) {
          bool seen = false;
          for (int64_t t = 0; t < T && !seen; ++t) seen = rule.sees(P[t], p);
          if (seen)
            add(page_of(p, p) * page_size + p % page_size, p);
          else if (causal && p > hi)
            break;  // no later key is seen either
        }
      }
      if (with_block) {
        const at::Tensor& kb = *k_block;
        const at::Tensor& vb = *v_block;
        for (int64_t j = 0; j < T; ++j) {
          keys.push_back(kb.data_ptr<float>() + b * kb.stride(0) + h * kb.stride(1) + j * kb.stride(2));
          values.push_back(vb.data_ptr<float>() + b * vb.stride(0) + h * vb.stride(1) + j * vb.stride(2));
          key_pos.push_back(P[j]);
        }
      }
      const int64_t L = static_cast<int64_t>(keys.size());
      const int64_t Lp = std::max<int64_t>((L + kLanes - 1) / kLanes, 1) * kLanes;  // whole vectors of keys
      for (int64_t i = L; i < Lp; ++i) keys.push_back(zeros.data()), key_pos.push_back(unseen);
      // the task's queries (rows g * T + t of q[b, h * G .. h * G + G]: contiguous), each padded to Dp with zeros
      const float* qtask = qp + (b * Hq + h * G) * T * D;
      qt.assign(R * Dp, 0.f);
      for (int64_t r = 0; r < R; ++r) std::copy(qtask + r * D, qtask + r * D + D, qt.data() + r * Dp);
      // scores [R, Lp]: a query's row holds its score of every key, kLanes keys to a vector
      scores.resize(R * Lp);
      scores_of(keys.data(), Lp, qt.data(), R, Dp, D, sc, scores.data());
      // -inf where a query does not see the key (the rule reads t, not g) and for the padding keys
      for (int64_t i = 0; i < Lp; ++i) {
        if (key_pos[i] != unseen && plain && (!causal || key_pos[i] <= lo)) continue;  // every query sees it
        for (int64_t t = 0; t < T; ++t)
          if (key_pos[i] == unseen || !rule.sees(P[t], key_pos[i]))
            for (int64_t g = 0; g < G; ++g) scores[(g * T + t) * Lp + i] = neg_inf;
      }
      // softmax along each query's row: the maximum, exp and a sum per lane in key order (lane l: the keys l, l +
      // kLanes, ..), the lanes summed in lane order, then the weights. Keys a query does not see weigh exactly 0.
      for (int64_t r = 0; r < R; ++r) {
        float* s = scores.data() + r * Lp;
        vec mv = vec{} + neg_inf;
        for (int64_t i = 0; i < Lp; i += kLanes) {
          const vec x = load(s + i);
          mv = x > mv ? x : mv;
        }
        float m = neg_inf;
        for (int l = 0; l < kLanes; ++l) m = std::max(m, mv[l]);
        m = m == neg_inf ? 0.f : m;  // a query that sees no key: every exp is 0, and so is every weight
        vec sv{};
        for (int64_t i = 0; i < Lp; i += kLanes) {
          const vec e = exp_nonpositive(load(s + i) - m);
          store(s + i, e);
          sv += e;
        }
        float sum = 0.f;
        for (int l = 0; l < kLanes; ++l) sum += sv[l];
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t i = 0; i < Lp; i += kLanes) store(s + i, load(s + i) * inv);
      }
      // values: straight into the output rows of the task's queries (contiguous, like the queries)
      float* otask = op + (b * Hq + h * G) * T * D;
      int64_t r = 0;
      for (; r + 3 <= R; r += 3) value_queries<3>(scores.data() + r * Lp, Lp, values.data(), L, D, otask + r * D);
      switch (R - r) {
        case 2: value_queries<2>(scores.data() + r * Lp, Lp, values.data(), L, D, otask + r * D); break;
        case 1: value_queries<1>(scores.data() + r * Lp, Lp, values.data(), L, D, otask + r * D); break;
        default: break;
      }
    }
  });
  return out;
}

at::Tensor block_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, int64_t, bool, int64_t, double, int64_t) {
  return at::empty_symint(q.sym_sizes(), q.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash_cpu, m) {
  m.def("block_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor ctx_lens, "
        "Tensor q_positions, Tensor? k_block, Tensor? v_block, int page_size, bool causal, int window, float scale, "
        "int chunk=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) { m.impl("block_attention", block_attention); }
TORCH_LIBRARY_IMPL(dflash_cpu, Meta, m) { m.impl("block_attention", block_attention_meta); }
