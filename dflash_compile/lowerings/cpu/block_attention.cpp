// dflash_cpu::block_attention: dflash::block_attention (lowerings/ops.py, same contract) for fp32 CPU tensors,
// reading the context's K/V in place in the paged pool.
//
// Why: the ATen form of the op (block_attention.py) gathers every row's context K/V out of the pool into dense
// [B, Hkv, S, D] buffers, then multiplies: each layer of a batched decode step copies its whole context once more
// before reading it (SmolLM2-135M at batch 8, one thread: the gather kernels 8 ms and the score/value bmm 6 ms of a
// 65 ms step; docs/benchmarks.md). Here each (row, KV head) task walks the row's block table and reads every visible
// key and value once from its slot, for all the query heads that share it (GQA without a repeat), with no copy.
//
// Per task: the scores of its G * T queries (a [G * T, keys] buffer per worker thread, reused from task to task), a
// softmax per query in fp32, then the value rows weighted into the output. Keys a query does
// not see are never read for it (-inf score, weight 0), so garbage or NaN at unallocated or stale slots cannot reach
// the output; a key no query of the task sees is not read at all, nor is a context position at or past the row's
// length (its page may be unallocated, -1). A query that sees no key returns zeros. Summation order differs from
// the ATen form's BLAS calls (equal to rounding, not bit for bit).
//
// Built with row_linear.cpp into one library (row_linear.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec loadv(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(vec));
  return v;
}

inline void storev(float* p, vec v) { __builtin_memcpy(p, &v, sizeof(vec)); }

inline float hsum(vec v) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

inline float dot(const float* a, const float* b, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
  if (D >= kLanes) {
    vec acc = loadv(a) * loadv(b);
    for (d = kLanes; d + kLanes <= D; d += kLanes) acc += loadv(a + d) * loadv(b + d);
    s = hsum(acc);
  }
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// out[i] = scale * (q . keys[i]) for i < L: four keys at a time
void dots(const float* q, const float* const* keys, int64_t L, int64_t D, float scale, float* out) {
  const int64_t Dv = D - D % kLanes;
  int64_t i = 0;
  for (; i + 4 <= L; i += 4) {
    const float *k0 = keys[i], *k1 = keys[i + 1], *k2 = keys[i + 2], *k3 = keys[i + 3];
    vec a0{}, a1{}, a2{}, a3{};
    for (int64_t d = 0; d < Dv; d += kLanes) {
      const vec x = loadv(q + d);
      a0 += x * loadv(k0 + d), a1 += x * loadv(k1 + d), a2 += x * loadv(k2 + d), a3 += x * loadv(k3 + d);
    }
    float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
    for (int64_t d = Dv; d < D; ++d) s0 += q[d] * k0[d], s1 += q[d] * k1[d], s2 += q[d] * k2[d], s3 += q[d] * k3[d];
    out[i] = scale * s0, out[i + 1] = scale * s1, out[i + 2] = scale * s2, out[i + 3] = scale * s3;
  }
  for (; i < L; ++i) out[i] = scale * dot(q, keys[i], D);
}

// out[:D] = sum_i w[i] * values[i] over the i with w[i] != 0 (no other value row is read), a chunk of four vectors
// of the output at a time in registers
void weighted_sum(const float* w, const float* const* values, int64_t L, int64_t D, float* out) {
  constexpr int64_t kChunk = 4 * kLanes;
  int64_t d = 0;
  for (; d + kChunk <= D; d += kChunk) {
    vec a0{}, a1{}, a2{}, a3{};
    for (int64_t i = 0; i < L; ++i) {
      if (w[i] == 0.f) continue;
      const float* v = values[i] + d;
      const float wi = w[i];
      a0 += wi * loadv(v), a1 += wi * loadv(v + kLanes), a2 += wi * loadv(v + 2 * kLanes),
          a3 += wi * loadv(v + 3 * kLanes);
    }
    storev(out + d, a0), storev(out + d + kLanes, a1), storev(out + d + 2 * kLanes, a2),
        storev(out + d + 3 * kLanes, a3);
  }
  for (; d + kLanes <= D; d += kLanes) {
    vec a{};
    for (int64_t i = 0; i < L; ++i)
      if (w[i] != 0.f) a += w[i] * loadv(values[i] + d);
    storev(out + d, a);
  }
  for (; d < D; ++d) {
    float a = 0.f;
    for (int64_t i = 0; i < L; ++i)
      if (w[i] != 0.f) a += w[i] * values[i][d];
    out[d] = a;
  }
}

// exp(x) for a vector, x <= 0 (scores minus their maximum): 2^n * e^r with |r| <= ln2 / 2, e^r by its degree-6
// Taylor polynomial (its remainder r^7 / 7! is at most 1.2e-7 there); x below -87 (and -inf: a key the query does not
// see) gives exactly 0, so such a key's value row is never read. Against one scalar std::exp per score: 435 -> 383 us
// a layer at SmolLM2's shape, 8 rows, 200 tokens of context.
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
  const int64_t G = Hq / Hkv, R = G * T;
  const Rule rule{causal, window, chunk};
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
    std::vector<float> scores, acc;
    std::vector<const float*> keys, values;
    std::vector<int64_t> key_pos;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t* P = pp + b * T;  // the queries' positions
      const int64_t n_ctx = std::min<int64_t>(std::max<int64_t>(lp[b], 0), NB * page_size);
      // the keys some query of this row sees, with their rows in the pool (or the block)
      keys.clear(), values.clear(), key_pos.clear();
      int64_t hi = std::numeric_limits<int64_t>::min();  // the last query position
      for (int64_t t = 0; t < T; ++t) hi = std::max(hi, P[t]);
      for (int64_t p = 0; p < n_ctx; ++p) {
        bool seen = false;
        for (int64_t t = 0; t < T && !seen; ++t) seen = rule.sees(P[t], p);
        if (!seen) {
          if (causal && p > hi) break;  // no later key is seen either
          continue;
        }
        const int64_t page = tp[b * NB + p / page_size];
        TORCH_CHECK(page >= 0 && page * page_size + p % page_size < slots, "dflash_cpu::block_attention: row ", b,
                    " reads position ", p, " (its length ", lp[b], ") from page ", page, " of its block table");
        const int64_t slot = page * page_size + p % page_size;
        keys.push_back(kp + slot * ks0 + h * ks1), values.push_back(vp + slot * vs0 + h * vs1), key_pos.push_back(p);
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
      scores.assign(R * std::max<int64_t>(L, 1), 0.f);
      acc.assign(R * D, 0.f);
      // scores: for each query, four keys at a time (four independent sums in flight); the keys of a task stay in
      // the cache from one query to the next
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t r = g * T + t;
          const float* qr = qp + (((b * Hq + h * G + g) * T + t) * D);
          float* s = scores.data() + r * L;
          dots(qr, keys.data(), L, D, sc, s);
          for (int64_t i = 0; i < L; ++i)
            if (!rule.sees(P[t], key_pos[i])) s[i] = neg_inf;
        }
      for (int64_t r = 0; r < R; ++r) {  // softmax per query, in place; a query that sees nothing stays all zeros
        float* s = scores.data() + r * L;
        float m = neg_inf;
        for (int64_t i = 0; i < L; ++i) m = std::max(m, s[i]);
        if (m == neg_inf) {
          for (int64_t i = 0; i < L; ++i) s[i] = 0.f;
          continue;
        }
        float sum = 0.f;
        int64_t i = 0;
        for (; i + kLanes <= L; i += kLanes) {
          const vec e = exp_nonpositive(loadv(s + i) - m);
          storev(s + i, e);
          for (int l = 0; l < kLanes; ++l) sum += e[l];
        }
        for (; i < L; ++i) sum += (s[i] = s[i] == neg_inf ? 0.f : std::exp(s[i] - m));
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < L; ++i) s[i] *= inv;
      }
      for (int64_t r = 0; r < R; ++r)  // values: each query's weighted sum, its accumulators in registers
        weighted_sum(scores.data() + r * L, values.data(), L, D, acc.data() + r * D);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < T; ++t)
          std::copy_n(acc.data() + (g * T + t) * D, D, op + ((b * Hq + h * G + g) * T + t) * D);
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
