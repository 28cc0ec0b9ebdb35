// The vector type and the fused multiply-add the CPU kernels (row_linear.cpp, block_attention.cpp) are written with:
// GCC's vector extension at the host's widest float vector (built with -march=native: 16 lanes with AVX-512, 8 with
// AVX2 or what GCC makes of it elsewhere).

#pragma once

#include <cstdint>

namespace dflash_simd {

#ifdef __AVX512F__
constexpr int kLanes = 16;  // one zmm register
#else
constexpr int kLanes = 8;  // one ymm register (AVX2)
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(vec));
  return v;
}

inline void store(float* p, vec v) { __builtin_memcpy(p, &v, sizeof(vec)); }

// acc + a * w, rounded once, by the same instruction in every instantiation. Left to the compiler
// (-ffp-contract=fast), GCC fused the product into the sum for some row counts and not for others (its tuning for some
// CPUs splits a chain of multiply-adds on one accumulator), so a row computed alone differed in the last bit from the
// same row computed with others; a row's result must not depend on how many rows are computed with it (plain decoding
// at batch 1 and a verified block read the same values). The intrinsics' types made GCC keep the accumulators in
// memory; an asm statement keeps them in registers.
inline vec fmadd(vec a, vec w, vec acc) {  // lane by lane: acc + a * w, rounded once
#if defined(__x86_64__) && (defined(__AVX512F__) || defined(__FMA__))
  asm("vfmadd231ps %[w], %[a], %[acc]" : [acc] "+v"(acc) : [a] "v"(a), [w] "v"(w));
  return acc;
#elif defined(__ARM_FEATURE_FMA)
  vec r;
  for (int j = 0; j < kLanes; ++j) r[j] = __builtin_fmaf(a[j], w[j], acc[j]);  // one fused instruction per lane
  return r;
#else
  return acc + a * w;  // no fused multiply-add in this CPU: nothing for the compiler to fuse either
#endif
}

// The same with a in every lane (a - 0 is a, signed zeros included).
inline vec fmadd(float a, vec w, vec acc) { return fmadd(a - vec{}, w, acc); }

}  // namespace dflash_simd
