// dflash_cpu::block_attention: dflash::block_attention (lowerings/ops.py, same contract) for fp32 CPU tensors,
// reading the context's K/V in place in the paged pool.
//
// Why: the ATen form of the op (block_attention.py) gathers every row's context K/V out of the pool into dense
// [B, Hkv, S, D] buffers, then multiplies: each layer of a batched decode step copies its whole context once more
// before reading it (SmolLM2-135M at batch 8, one thread: the gather kernels 8 ms and the score/value bmm 6 ms of a
// 65 ms step; docs/benchmarks.md). Here each (row, KV head) task walks the row's block table and reads every visible
// key and value once from its slot, for all the query heads that share it (GQA without a repeat), with no copy.
//
// Per task, as two small matrix products with the task's queries laid out across the vector lanes: the G * T queries
// transposed into a [D, R] panel (R: G * T rounded up to whole vectors), the scores S = K Q^T computed a few keys by a
// few query vectors at a time in registers ([keys, R], each key's context row broadcast one value at a time: no
// horizontal sums), the softmax down each query's lane in fp32, then out = S^T V a few queries by two value vectors
// at a time. Buffers per worker thread, reused from task to task. A key no query of the task sees (a masked position,
// a context position at or past the row's length, whose page may be unallocated, -1) is never read, so garbage or NaN
// at unallocated or stale slots cannot reach the output; a key some query sees has weight 0 (exp of -inf) for the
// queries that do not. A query that sees no key returns zeros. Each query's result is one chain of fused multiply-adds
// per score and per output, in a fixed order (the head dim for a score, the keys for an output), so it does not
// depend on the queries computed with it (block length, query heads, rows). Summation order differs from the ATen
// form's BLAS calls (equal to rounding, not bit for bit).
//
// Built with row_linear.cpp into one library (row_linear.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using dflash_simd::fmadd;
using dflash_simd::kLanes;
using dflash_simd::load;
using dflash_simd::store;
using dflash_simd::vec;

// s[i * Rp + v * kLanes + l] = scale * (keys[i] . qt[:, v * kLanes + l]) for the NK keys and the NV query vectors
// of a tile: qt is the [D, Rp] query panel, one fused chain over the head dim per score, in order.
template <int NK, int NV>
void score_tile(const float* const* keys, const float* qt, int64_t Rp, int64_t D, float scale, float* s) {
  vec acc[NK][NV];
  for (int j = 0; j < NK; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = vec{};
  for (int64_t d = 0; d < D; ++d) {
    vec qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = load(qt + d * Rp + v * kLanes);
    for (int j = 0; j < NK; ++j) {
      const float kd = keys[j][d];
      for (int v = 0; v < NV; ++v) acc[j][v] = fmadd(kd, qv[v], acc[j][v]);
    }
  }
  for (int j = 0; j < NK; ++j)
    for (int v = 0; v < NV; ++v) store(s + j * Rp + v * kLanes, acc[j][v] * scale);
}

// The scores of the L keys for query vectors v0 .. v0 + NV: tiles of 12 / NV keys (12 accumulators), then one key at
// a time.
template <int NV>
void score_vectors(const float* const* keys, int64_t L, const float* qt, int64_t Rp, int64_t D, float scale,
                   float* s) {
  constexpr int NK = NV == 1 ? 8 : 12 / NV;
  int64_t i = 0;
  for (; i + NK <= L; i += NK) score_tile<NK, NV>(keys + i, qt, Rp, D, scale, s + i * Rp);
  for (; i < L; ++i) score_tile<1, NV>(keys + i, qt, Rp, D, scale, s + i * Rp);
}

// out[q * D + d] = sum_i w[i * Rp + q] * values[i][d] for the NQ queries of a tile and the head dims d0 .. d0 +
// NC * kLanes, in key order
template <int NQ, int NC>
void value_tile(const float* w, int64_t Rp, const float* const* values, int64_t L, int64_t d0, int64_t D,
                float* out) {
  vec acc[NQ][NC];
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) acc[q][c] = vec{};
  for (int64_t i = 0; i < L; ++i) {
    vec vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load(values[i] + d0 + c * kLanes);
    const float* wi = w + i * Rp;
    for (int q = 0; q < NQ; ++q)
      for (int c = 0; c < NC; ++c) acc[q][c] = fmadd(wi[q], vv[c], acc[q][c]);
  }
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) store(out + q * D + d0 + c * kLanes, acc[q][c]);
}

template <int NQ>
void value_queries(const float* w, int64_t Rp, const float* const* values, int64_t L, int64_t D, float* out) {
  int64_t d = 0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) value_tile<NQ, 2>(w, Rp, values, L, d, D, out);
  for (; d + kLanes <= D; d += kLanes) value_tile<NQ, 1>(w, Rp, values, L, d, D, out);
  for (; d < D; ++d)  // a head dim that is no multiple of the vector: the last values one at a time
    for (int q = 0; q < NQ; ++q) {
      float a = 0.f;
      for (int64_t i = 0; i < L; ++i) a = __builtin_fmaf(w[i * Rp + q], values[i][d], a);
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
  const int64_t G = Hq / Hkv, R = G * T, RV = (R + kLanes - 1) / kLanes, Rp = RV * kLanes;
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

  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores, qt;
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
      auto add = [&](int64_t p) {
        const int64_t page = tp[b * NB + p / page_size];
        TORCH_CHECK(page >= 0 && page * page_size + p % page_size < slots, "dflash_cpu::block_attention: row ", b,
                    " reads position ", p, " (its length ", lp[b], ") from page ", page, " of its block table");
        const int64_t slot = page * page_size + p % page_size;
        keys.push_back(kp + slot * ks0 + h * ks1), values.push_back(vp + slot * vs0 + h * vs1), key_pos.push_back(p);
      };
      if (plain) {  // no window, no chunks: the keys seen are a prefix of the context
        const int64_t end = causal ? std::min(n_ctx, hi + 1) : n_ctx;
        for (int64_t p = 0; p < end; ++p) add(p);
      } else {
        for (int64_t p = 0; p < n_ctx; ++p) {
          bool seen = false;
          for (int64_t t = 0; t < T && !seen; ++t) seen = rule.sees(P[t], p);
          if (seen)
            add(p);
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
      // the task's queries (rows g * T + t of q[b, h * G .. h * G + G]: contiguous) as a [D, Rp] panel
      const float* qtask = qp + (b * Hq + h * G) * T * D;
      qt.assign(D * Rp, 0.f);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < D; ++d) qt[d * Rp + r] = qtask[r * D + d];
      scores.resize(std::max<int64_t>(L, 1) * Rp);
      for (int64_t v = 0; v < RV; v += 3) {  // three query vectors at a time, then what is left
        const float* qv = qt.data() + v * kLanes;
        float* sv = scores.data() + v * kLanes;
        if (RV - v >= 3)
          score_vectors<3>(keys.data(), L, qv, Rp, D, sc, sv);
        else if (RV - v == 2)
          score_vectors<2>(keys.data(), L, qv, Rp, D, sc, sv);
        else
          score_vectors<1>(keys.data(), L, qv, Rp, D, sc, sv);
      }
      for (int64_t i = 0; i < L; ++i) {  // -inf where a query does not see the key (the rule reads t, not g)
        if (plain && (!causal || key_pos[i] <= lo)) continue;  // every query sees it
        for (int64_t t = 0; t < T; ++t)
          if (!rule.sees(P[t], key_pos[i]))
            for (int64_t g = 0; g < G; ++g) scores[i * Rp + g * T + t] = neg_inf;
      }
      // softmax down each query's lane: the maximum, then exp and the sum in key order, then the weights
      for (int64_t u = 0; u < RV; ++u) {
        float* s = scores.data() + u * kLanes;
        vec m = vec{} + neg_inf;
        for (int64_t i = 0; i < L; ++i) {
          const vec x = load(s + i * Rp);
          m = x > m ? x : m;
        }
        m = m == neg_inf ? vec{} : m;  // a query that sees no key: every exp is 0, and so is every weight
        vec sum{};
        for (int64_t i = 0; i < L; ++i) {
          const vec e = exp_nonpositive(load(s + i * Rp) - m);
          store(s + i * Rp, e);
          sum += e;
        }
        const vec inv = sum > 0.f ? 1.f / sum : vec{};
        for (int64_t i = 0; i < L; ++i) store(s + i * Rp, load(s + i * Rp) * inv);
      }
      // values: straight into the output rows of the task's queries (contiguous, like the queries)
      float* otask = op + (b * Hq + h * G) * T * D;
      int64_t r = 0;
      for (; r + 6 <= R; r += 6) value_queries<6>(scores.data() + r, Rp, values.data(), L, D, otask + r * D);
      switch (R - r) {
        case 5: value_queries<5>(scores.data() + r, Rp, values.data(), L, D, otask + r * D); break;
        case 4: value_queries<4>(scores.data() + r, Rp, values.data(), L, D, otask + r * D); break;
        case 3: value_queries<3>(scores.data() + r, Rp, values.data(), L, D, otask + r * D); break;
        case 2: value_queries<2>(scores.data() + r, Rp, values.data(), L, D, otask + r * D); break;
        case 1: value_queries<1>(scores.data() + r, Rp, values.data(), L, D, otask + r * D); break;
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
