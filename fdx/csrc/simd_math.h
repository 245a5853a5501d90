// fdx's SIMD layer for its CPU ops: one vector type and the few operations
// the kernels need, implemented for AVX-512F and for AVX2 + FMA + F16C.
//
// The set is chosen at build time by the compiler's target macros
// (fdx/model/native.py builds with -march=native, or -mno-avx512f when it is
// told to build the AVX2 set): __AVX512F__ -> 16 float lanes (__m512),
// otherwise __AVX2__ + __FMA__ + __F16C__ -> 8 float lanes (__m256).  Each
// kernel is written once against fdx::simd and loops in steps of kLanes.
// native.py passes -DFDX_EXPECT_AVX512 or -DFDX_EXPECT_AVX2; a mismatch
// between that and what the compiler targets is a build error, so the
// kernel set native.py logs is the one that was compiled.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(FDX_EXPECT_AVX512) && !defined(__AVX512F__)
#error "fdx: asked for the AVX-512 kernel set but the compiler does not target AVX-512F"
#endif
#if defined(FDX_EXPECT_AVX2) && (defined(__AVX512F__) || !defined(__AVX2__))
#error "fdx: asked for the AVX2 kernel set but the compiler targets another ISA"
#endif

namespace fdx {
namespace simd {

#if defined(__AVX512F__)

constexpr int kLanes = 16;
constexpr const char* kIsa = "avx512";
using vf = __m512;

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float a) { return _mm512_set1_ps(a); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   // a*b + c
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } // c - a*b
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
inline vf round_nearest(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// v * 2^n for integral n in [-126, 127]
inline vf scale_pow2(vf v, vf n) { return _mm512_scalef_ps(v, n); }

// The first n (0 <= n < kLanes) lanes of p, the others 0; and the inverse.
inline __mmask16 first_mask(int n) { return (__mmask16)((1u << n) - 1u); }
inline vf load_first(const float* p, int n) { return _mm512_maskz_loadu_ps(first_mask(n), p); }
inline void store_first(float* p, vf v, int n) { _mm512_mask_storeu_ps(p, first_mask(n), v); }
inline vf keep_first(vf v, int n) { return _mm512_maskz_mov_ps(first_mask(n), v); }
// v where x >= lo, else 0 (also where x is NaN)
inline vf zero_below(vf x, float lo, vf v) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(lo), _CMP_GE_OQ), v); }
// bit i set where lane i of x >= t
inline unsigned ge_mask(vf x, vf t) { return _mm512_cmp_ps_mask(x, t, _CMP_GE_OQ); }

// lane i + lane i + 8 of v (the first step of every fixed sum tree, see v16)
inline __m256 fold8(vf v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// kLanes signed bytes -> floats
inline vf from_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 packed bytes of a GGUF Q4 block -> its 32 weights (0..15) as floats:
// byte i holds weight i in its low nibble and weight i + 16 in its high one.
inline void from_nibbles(const uint8_t* p, vf* f) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  f[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
  f[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr int kLanes = 8;
constexpr const char* kIsa = "avx2";
using vf = __m256;

inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float a) { return _mm256_set1_ps(a); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline float reduce_max(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf round_nearest(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale_pow2(vf v, vf n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(v, _mm256_castsi256_ps(e));
}

inline __m256i first_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf load_first(const float* p, int n) { return _mm256_maskload_ps(p, first_mask(n)); }
inline void store_first(float* p, vf v, int n) { _mm256_maskstore_ps(p, first_mask(n), v); }
inline vf keep_first(vf v, int n) { return _mm256_and_ps(v, _mm256_castsi256_ps(first_mask(n))); }
inline vf zero_below(vf x, float lo, vf v) { return _mm256_and_ps(v, _mm256_cmp_ps(x, set1(lo), _CMP_GE_OQ)); }
inline unsigned ge_mask(vf x, vf t) { return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x, t, _CMP_GE_OQ))); }

inline vf from_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void from_nibbles(const uint8_t* p, vf* f) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
  f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

#else
#error "fdx CPU ops need AVX-512F, or AVX2 + FMA + F16C (build with -march=native on such a CPU)"
#endif

// IEEE half (2 bytes, any alignment) -> float (F16C, present with both sets).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// ---- the canonical order of every floating-point reduction ---------------
//
// A sum over many floats (a dot product, a softmax denominator, a norm's sum
// of squares) is accumulated in 16 lanes, whatever the kernel set: lane i
// adds the terms i, i + 16, i + 32, ... in order, and the 16 lanes are then
// added by one fixed tree (reduce_add below).  AVX-512 holds the 16 lanes in
// one register, AVX2 in two (v16 is kParts vectors), and a reduction's bits
// are the same with both sets -- so are the int8 and bf16 modes' tokens and
// logprobs (tests/test_isa_bits.py).  Element-wise work keeps the
// native width (its bits never depend on it).
constexpr int kParts = 16 / kLanes;
struct v16 {
  vf p[kParts];
};
inline v16 zero16() {
  v16 r;
  for (int i = 0; i < kParts; ++i) r.p[i] = zero();
  return r;
}
inline v16 load16(const float* x) {
  v16 r;
  for (int i = 0; i < kParts; ++i) r.p[i] = load(x + i * kLanes);
  return r;
}
// the first n (0 <= n <= 16) floats of x, the other lanes 0
inline v16 load16_first(const float* x, int n) {
  v16 r;
  for (int i = 0; i < kParts; ++i) {
    const int m = n - i * kLanes;
    r.p[i] = m >= kLanes ? load(x + i * kLanes) : m > 0 ? load_first(x + i * kLanes, m) : zero();
  }
  return r;
}
inline v16 add(v16 a, v16 b) {
  for (int i = 0; i < kParts; ++i) a.p[i] = add(a.p[i], b.p[i]);
  return a;
}
inline v16 mul(v16 a, v16 b) {
  for (int i = 0; i < kParts; ++i) a.p[i] = mul(a.p[i], b.p[i]);
  return a;
}
inline v16 fmadd(v16 a, v16 b, v16 c) {
  for (int i = 0; i < kParts; ++i) c.p[i] = fmadd(a.p[i], b.p[i], c.p[i]);
  return c;
}
// [x0 + x8, x1 + x9, ..., x7 + x15]: the tree's first level
inline __m256 fold8(v16 a) {
#if defined(__AVX512F__)
  return fold8(a.p[0]);
#else
  return _mm256_add_ps(a.p[0], a.p[1]);
#endif
}
// The fixed tree over 8 folded lanes f: ((f0 + f4) + (f2 + f6)) + ((f1 + f5) + (f3 + f7)).
inline float reduce_add8(__m256 f) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_add(v16 a) { return reduce_add8(fold8(a)); }

// exp(x) per lane: range reduction x = n*ln2 + r (|r| <= ln2/2, Cody-Waite
// split of ln2), degree-7 Taylor polynomial for e^r, then scale by 2^n.
// Relative error ~1e-7 (float rounding level); x < -87 gives ~e^-87, x > 88
// gives ~e^88 (never inf or a denormal).
inline vf exp(vf x) {
  x = min(max(x, set1(-87.0f)), set1(88.0f));
  const vf n = round_nearest(mul(x, set1(1.44269504088896341f)));
  vf r = fnmadd(n, set1(0.693145751953125f), x);
  r = fnmadd(n, set1(1.428606765330187045e-06f), r);
  vf p = set1(1.f / 5040.f);
  p = fmadd(p, r, set1(1.f / 720.f));
  p = fmadd(p, r, set1(1.f / 120.f));
  p = fmadd(p, r, set1(1.f / 24.f));
  p = fmadd(p, r, set1(1.f / 6.f));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.f));
  p = fmadd(p, r, set1(1.f));
  return scale_pow2(p, n);
}

}  // namespace simd
}  // namespace fdx
