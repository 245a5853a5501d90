// fdx CPU custom op: RoPE + paged KV-cache write + causal paged attention.
//
// One call per layer replaces ~15 eager Paddle ops.  Layout contract (kept
// in sync with fdx/model/native.py and fdx/model/llama.py):
//   qkv       [T, (H + 2*KV) * D] float32   fused q/k/v projections (bias added)
//   kv_cache  [2, NB, KV, BS, D]  float32   K at [0], V at [1]; WRITTEN IN PLACE
//                                 (or bfloat16: AttnShape::bf16_cache, see BFLOAT16 CACHE)
//   rope      [P, D]              float32   cos in [:, :D/2], sin in [:, D/2:]
//   meta      [T, 2]              int32     (sequence index, position) per token
//   tables    [S, MAXB]           int32     block table per sequence
// Output      [T, H * D]          float32
// Token t of sequence s at position p attends to keys lo..p of s, which are
// read ONLY through tables[s] (slot = tables[s][j / BS] * BS + j % BS);
// lo = 0, or with a sliding window w > 0, max(0, p - w + 1): the keys
// p - w < j <= p (transformers' sliding_window_causal_mask_function).
// Every key block stays in the cache; the window only narrows the keys read.
// K/V of every token in the call are written before any attention is read,
// so chunks of several new tokens per sequence (prefill) work.
// RoPE is NEOX "rotate_half" style (Hugging Face q/k order).

//
// BATCH INVARIANCE BY CONSTRUCTION.  Query row (token t, head h) of
// sequence s at position p, with q = rope(q), runs
//   score[j] = dot(q, k_j) * scale   for j = lo..p: lane i of the 16
//              canonical lanes (simd_math.h) adds the products q[d] k_j[d]
//              (each rounded: mul, then add) for d = i, i + 16, ... in
//              order; then the lanes are added by one fixed tree
//              (reduce8/reduce4 below, v::reduce_add's tree);
//   w[j]     = softmax(score)[j]: exp(score[j] - max), their sum in the 16
//              lanes (lane i: j = lo + i, lo + i + 16, ...) and the same
//              tree, then w[j] = e[j] * (1 / sum);
//   out[d]   = sum over j = lo..p, in order, of w[j] v_j[d] (fma).
// (window 0: lo = 0, the very operations of an op without a window.)
// These are the same IEEE operations in the same order whatever T is,
// whichever rows share the call, wherever the row sits in its tile (the
// score tiles of 1-2 rows and the weighted-sum tiles of 1-3 rows x 1-4
// vectors run the same per-lane sequence; every dot goes through the same
// tree) and whatever the thread count: each row is computed entirely by one
// thread.  They do not depend on the kernel set either: AVX-512 holds the
// 16 lanes of a dot in one register, AVX2 in two (its score tiles take half
// as many keys), so both give the same bits (tests/test_isa_bits.py; the
// scalar reference of tests/test_scalar_reference.py).  RoPE is
// x1 c - x2 s and x2 c + x1 s, each one fma and one mul.  Work is tiled only for reuse: a
// work item is (a run of <= kRun consecutive tokens of one sequence, a kv
// head); key blocks stay in L1 while every row of the item uses them, and
// the G query heads of a token share each key/value load.
//
// BFLOAT16 CACHE.  With AttnShape::bf16_cache the cache holds each K and V
// value rounded to bfloat16 (fdx::bf16_bits: nearest even, denormals to
// zero) -- half the bytes, and decode attention is bound by reading them.
// A load widens a value back to its float32 exactly (16 zero bits below), so
// everything above runs unchanged on the rounded values: the same sequence,
// the same bits on every kernel set and thread count, batch-invariant.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "kernels.h"
#include "simd_math.h"

namespace {

namespace v = fdx::simd;
constexpr int L = v::kLanes;
constexpr int kRun = 8;           // tokens per work item (a prefill chunk is cut in runs)
constexpr int kRows = 3;          // query rows per register tile of the weighted sum
constexpr int kVecs = 4;          // output vectors per register tile of the weighted sum

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// ---- reading the cache: float32, or bfloat16 widened exactly ----------------
using bf16_t = uint16_t;
inline v::vf load_kv(const float* p) { return v::load(p); }
inline v::vf load_kv(const bf16_t* p) {
#if defined(__AVX512F__)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#endif
}
// Asks for the cache lines of n values from p (keys and values are read in
// key order, but consecutive key blocks sit anywhere in the cache: the
// hardware prefetcher loses the stream at every block edge).
template <typename C>
inline void prefetch_kv(const C* p, int n) {
  const char* b = reinterpret_cast<const char*>(p);
  for (int i = 0; i < n * static_cast<int>(sizeof(C)); i += 64) _mm_prefetch(b + i, _MM_HINT_T0);
}
constexpr int kAhead = 32;  // keys read ahead (16 and 64 measured no better: bench_attention --layers 30)

// the first n (< L) values, zeros after them
inline v::vf load_kv_first(const float* p, int n) { return v::load_first(p, n); }
inline v::vf load_kv_first(const bf16_t* p, int n) {
  alignas(64) bf16_t t[L] = {};
  std::memcpy(t, p, sizeof(bf16_t) * n);
  return load_kv(t);
}
// the first n (< 16) values as the 16 canonical lanes, zeros after them
inline v::v16 load16_kv_first(const float* p, int n) { return v::load16_first(p, n); }
inline v::v16 load16_kv_first(const bf16_t* p, int n) {
  alignas(64) float t[16] = {};
  for (int i = 0; i < n; ++i) t[i] = fdx::bf16_to_float(p[i]);
  return v::load16_first(t, n);
}

inline v::vf fmsub(v::vf a, v::vf b, v::vf c) {  // a*b - c
#if defined(__AVX512F__)
  return _mm512_fmsub_ps(a, b, c);
#else
  return _mm256_fmsub_ps(a, b, c);
#endif
}

// Keeps a vector in a register: stops the compiler from folding a load into
// each of the rows' operations (3-4 loads instead of 1: the tiles are
// load-bound then) and from fusing a product into the add that follows it.
// No instruction is emitted.
inline void in_register(v::vf& x) { asm("" : "+v"(x)); }

// y = rope(x): NEOX rotate_half over D = 2 * half floats.
inline void rope_rotate(const float* x, float* y, const float* cs, int half) {
  const float* c = cs;
  const float* s = cs + half;
  int i = 0;
  for (; i + L <= half; i += L) {
    const v::vf x1 = v::load(x + i), x2 = v::load(x + half + i), ci = v::load(c + i), si = v::load(s + i);
    v::vf a = v::mul(x2, si), b = v::mul(x1, si);
    in_register(a);
    in_register(b);
    v::store(y + i, fmsub(x1, ci, a));
    v::store(y + half + i, v::fmadd(x2, ci, b));
  }
  if (i < half) {
    const int n = half - i;
    const v::vf x1 = v::load_first(x + i, n), x2 = v::load_first(x + half + i, n);
    const v::vf ci = v::load_first(c + i, n), si = v::load_first(s + i, n);
    v::vf a = v::mul(x2, si), b = v::mul(x1, si);
    in_register(a);
    in_register(b);
    v::store_first(y + i, fmsub(x1, ci, a), n);
    v::store_first(y + half + i, v::fmadd(x2, ci, b), n);
  }
}

// ---- the fixed lane-sum tree of a dot product -----------------------------
// A dot accumulates in the 16 canonical lanes of simd_math.h's v16 (one
// AVX-512 register, two AVX2 ones); v::fold8 adds lane i + lane i + 8, and
// the 8 folded lanes x0..x7 of each dot are added as
// ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)) -- v::reduce_add's tree,
// here for 8 or 4 dots at once.
// [a0+a4, a1+a5, a2+a6, a3+a7 | b0+b4, ..., b3+b7]
inline __m256 fold4(__m256 a, __m256 b) {
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
// from fold4(a, b), fold4(c, d): [a.u0, a.u1, c.u0, c.u1 | b.u0, b.u1, d.u0, d.u1],
// u0 = f0 + f2, u1 = f1 + f3 of the folded lanes f
inline __m256 fold2(__m256 ab, __m256 cd) {
  return _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
}
// The dots of 8 folded accumulators, in the order [x0, x2, x4, x6, x1, x3, x5, x7].
__attribute__((always_inline)) inline __m256 reduce8(const __m256* x) {
  const __m256 abcd = fold2(fold4(x[0], x[1]), fold4(x[2], x[3]));
  const __m256 efgh = fold2(fold4(x[4], x[5]), fold4(x[6], x[7]));
  return _mm256_add_ps(_mm256_shuffle_ps(abcd, efgh, 0x88), _mm256_shuffle_ps(abcd, efgh, 0xDD));
}
// The same tree for 4 folded accumulators, in the order [x0, x2, x1, x3].
__attribute__((always_inline)) inline __m128 reduce4(const __m256* x) {
  const __m256 abcd = fold2(fold4(x[0], x[1]), fold4(x[2], x[3]));
  const __m128 lo = _mm256_castps256_ps128(abcd), hi = _mm256_extractf128_ps(abcd, 1);
  return _mm_add_ps(_mm_shuffle_ps(lo, hi, 0x88), _mm_shuffle_ps(lo, hi, 0xDD));
}

// Keys per score tile of NR rows: 12 accumulators in registers (12 / NR
// keys on AVX-512; AVX2 holds a v16 in two registers: 6 / NR keys), plus the
// rows' q, a key and a product -- 15 of AVX2's 16 registers.
template <int NR>
constexpr int kTileKeys = 12 / NR / v::kParts;
constexpr int kKeyAlign = 12;  // every tile width divides it

// out[r][0..KT) = dot(q[r], k[0..KT)) * scale over D floats for NR (1, 2) rows.
template <int NR, int DT, typename C>
inline void score_tile(const float* const* q, const C* const* k, int Drt, float scale, float* const* out) {
  constexpr int KT = kTileKeys<NR>;
  constexpr int ND = NR * KT;  // 12 or 6 dots
  const int D = DT ? DT : Drt;  // DT: the head size when known at compile time (same operations)
  v::v16 acc[NR][KT];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < KT; ++j) acc[r][j] = v::zero16();
  int d = 0;
  for (; d + 16 <= D; d += 16) {
    for (int i = 0; i < v::kParts; ++i) {
      // AVX2 with 2 rows: 12 sums + a key + a product leave no register for
      // the rows' q, which the multiplies then read from L1
      constexpr bool kQInRegs = NR == 1 || v::kParts == 1;
      v::vf qv[NR];
      if constexpr (kQInRegs)
        for (int r = 0; r < NR; ++r) qv[r] = v::load(q[r] + d + i * L);
      for (int j = 0; j < KT; ++j) {
        v::vf kv = load_kv(k[j] + d + i * L);
        if (NR > 1) in_register(kv);
        for (int r = 0; r < NR; ++r) {
          v::vf pr = v::mul(kQInRegs ? qv[r] : v::load(q[r] + d + i * L), kv);
          in_register(pr);
          acc[r][j].p[i] = v::add(acc[r][j].p[i], pr);
        }
      }
    }
  }
  if (d < D) {
    const int n = D - d;
    v::v16 qv[NR];
    for (int r = 0; r < NR; ++r) qv[r] = v::load16_first(q[r] + d, n);
    for (int j = 0; j < KT; ++j) {
      const v::v16 kv = load16_kv_first(k[j] + d, n);
      for (int r = 0; r < NR; ++r) {
        for (int i = 0; i < v::kParts; ++i) {
          v::vf pr = v::mul(qv[r].p[i], kv.p[i]);
          in_register(pr);
          acc[r][j].p[i] = v::add(acc[r][j].p[i], pr);
        }
      }
    }
  }
  // dot e = r * KT + j; reduce8 takes dots e, e + 4 in slots 2m, 2m + 1 and
  // reduce4 dots e, e + 2 in slots m, m + 1 (their outputs then run in e order)
  auto dot = [&](int e) { return v::fold8(acc[e / KT][e % KT]); };
  alignas(32) float tmp[12];
  float* res = NR == 1 ? out[0] : tmp;  // one row: its keys' scores are contiguous
  __m256 x[8];
  int e = 0;
  if constexpr (ND >= 8) {
    for (int m = 0; m < 4; ++m) {
      x[2 * m] = dot(m);
      x[2 * m + 1] = dot(m + 4);
    }
    _mm256_storeu_ps(res, _mm256_mul_ps(reduce8(x), _mm256_set1_ps(scale)));
    e = 8;
  }
  for (; e < ND; e += 4) {  // 4 dots (the last 2 repeated when only 2 are left)
    const int e1 = e + 1, e2 = std::min(e + 2, ND - 2), e3 = e2 + 1;
    x[0] = dot(e);
    x[1] = dot(e2);
    x[2] = dot(e1);
    x[3] = dot(e3);
    const __m128 t = _mm_mul_ps(reduce4(x), _mm_set1_ps(scale));
    if (e + 4 <= ND) {
      _mm_storeu_ps(res + e, t);
    } else {
      _mm_storel_pi(reinterpret_cast<__m64*>(res + e), t);
    }
  }
  if constexpr (NR > 1)
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < KT; ++j) out[r][j] = tmp[r * KT + j];
}

// s_r[j] = dot(q_r, k_j) * scale for keys j in [j0, j1) (j0 a multiple of
// kKeyAlign; s_r[j1 .. j1 rounded up to kKeyAlign) are written with scratch),
// k_j = kc + off[j].  Keys kAhead ahead are prefetched while below pf (the
// row's key count on an item's first pass, so the stream runs on across
// the pass's end; 0: none).
template <int NR, int DT, typename C>
inline void score_keys(const float* const* q, const C* kc, const int64_t* off, int j0, int j1, int D,
                       float scale, float* const* s, int pf) {
  constexpr int KT = kTileKeys<NR>;
  float* out[NR];
  for (int j = j0; j < j1; j += KT) {
    const C* k[KT];
    for (int i = 0; i < KT; ++i) k[i] = kc + off[std::min(j + i, j1 - 1)];
    for (int i = j + kAhead; i < std::min(j + kAhead + KT, pf); ++i) prefetch_kv(kc + off[i], D);
    for (int r = 0; r < NR; ++r) out[r] = s[r] + j;
    score_tile<NR, DT, C>(q, k, D, scale, out);
  }
}

// acc[r][c*L ..] += sum over keys j in [j0, j1) of p[r][j] * v_j[d0 + c*L ..]
// for NR rows and NV vectors (the last one masked to `last` lanes if TAIL);
// v_j = vc + off[j] + d0.  pf: as score_keys'.
template <int NR, int NV, bool TAIL, typename C>
inline void pv_tile(const float* const* p, const C* vc, const int64_t* off, int j0, int j1, int last,
                    float* const* acc, int pf) {
  // (the loops over r and c unrolled from the start, so the 12 sums become
  // registers: GCC kept the array's stack copy and stored every sum to it
  // at each key otherwise)
  v::vf a[NR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) a[r][c] = v::load(acc[r] + c * L);
  for (int j = j0; j < j1; ++j) {
    const C* vr = vc + off[j];
    if (j + kAhead < pf) prefetch_kv(vc + off[j + kAhead], NV * L);
    v::vf pb[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) pb[r] = v::set1(p[r][j]);
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
      v::vf vv = (TAIL && c == NV - 1) ? load_kv_first(vr + c * L, last) : load_kv(vr + c * L);
      in_register(vv);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) a[r][c] = v::fmadd(pb[r], vv, a[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) v::store(acc[r] + c * L, a[r][c]);
}

template <int NR, typename C>
inline void pv_rows(const float* const* p, const C* vc, const int64_t* off, int j0, int j1, int nv, bool tail,
                    int last, float* const* acc, int pf) {
#define FDX_PV(NV)                                                    \
  case NV:                                                            \
    if (tail)                                                         \
      pv_tile<NR, NV, true, C>(p, vc, off, j0, j1, last, acc, pf);    \
    else                                                              \
      pv_tile<NR, NV, false, C>(p, vc, off, j0, j1, last, acc, pf);   \
    break;
  switch (nv) {
    FDX_PV(1)
    FDX_PV(2)
    FDX_PV(3)
    FDX_PV(4)
  }
#undef FDX_PV
}

// In-place softmax of r[0..n): e[j] = exp(r[j] - max), their sum in the 16
// canonical lanes (lane i: j = i, i + 16, ... in order) and v::reduce_add's
// tree, then e[j] * (1 / sum).  One out-of-line copy, so every row runs the
// very same code.
__attribute__((noinline)) void softmax(float* r, int n) {
  v::vf vmx = v::set1(-INFINITY);
  int j = 0;
  for (; j + L <= n; j += L) vmx = v::max(vmx, v::load(r + j));
  float mx = v::reduce_max(vmx);
  for (int k = j; k < n; ++k) mx = std::max(mx, r[k]);
  const v::vf m = v::set1(mx);
  v::v16 vs = v::zero16();
  for (j = 0; j + 16 <= n; j += 16) {
    for (int i = 0; i < v::kParts; ++i) {
      const v::vf e = v::exp(v::sub(v::load(r + j + i * L), m));
      v::store(r + j + i * L, e);
      vs.p[i] = v::add(vs.p[i], e);
    }
  }
  for (int i = 0; i < v::kParts && j + i * L < n; ++i) {  // the last 1..15
    const int c = std::min(L, n - j - i * L);
    const v::vf e = v::keep_first(v::exp(v::sub(v::load_first(r + j + i * L, c), m)), c);
    v::store_first(r + j + i * L, e, c);
    vs.p[i] = v::add(vs.p[i], e);
  }
  const float inv = 1.f / v::reduce_add(vs);
  const v::vf vinv = v::set1(inv);
  for (j = 0; j + L <= n; j += L) v::store(r + j, v::mul(v::load(r + j), vinv));
  for (; j < n; ++j) r[j] *= inv;
}

// Per-thread scratch, kept between calls (grown, never shrunk).
struct Scratch {
  std::vector<float> sc, acc;
  std::vector<int64_t> off;
  std::vector<float> wide;      // a bfloat16 cache's key or value block, widened (runs of several tokens)
  std::vector<int64_t> offw;    // offsets into wide
};

// Rows j in [j0, j1) of the cache (at c + off[j], D values each) as float32,
// row j at dst + (j - j0) * D: exact (bfloat16 -> float32).
inline void widen_rows(const bf16_t* c, const int64_t* off, int j0, int j1, int D, float* dst) {
  for (int j = j0; j < j1; ++j) {
    const bf16_t* src = c + off[j];
    float* d = dst + (int64_t)(j - j0) * D;
    int i = 0;
    for (; i + L <= D; i += L) v::store(d + i, load_kv(src + i));
    for (; i < D; ++i) d[i] = fdx::bf16_to_float(src[i]);
  }
}

struct Geometry {
  int H, KV, D, BS, G;
  int64_t MAXB;
  int kblock;  // keys per L1 block (a multiple of 12)
  float scale;
  int window;  // 0, or the sliding window (keys p - window < j <= p)
};

// The first key a query at position p attends to (kWindow false: 0, a
// constant, so the code without a window is the code of before it).
template <bool kWindow = true>
inline int first_key(const Geometry& ge, int p) {
  return kWindow && ge.window > 0 ? std::max(0, p + 1 - ge.window) : 0;
}

// Attention of the rows (t, kh*G + g) for tokens t in [t0, t1) (all of one
// sequence) and g < G; q' is read from o and the result written over it.
template <bool kWindow, typename C>
void attend_item(const Geometry& ge, const C* kc, const C* vc, const int* mt, const int* tb, int64_t t0,
                 int64_t t1, int kh, float* o, Scratch& w) {
  const int H = ge.H, KV = ge.KV, D = ge.D, BS = ge.BS, G = ge.G;
  const int nt = static_cast<int>(t1 - t0), R = nt * G;
  int nmax = 0;
  for (int64_t t = t0; t < t1; ++t) nmax = std::max(nmax, mt[2 * t + 1] + 1);
  // cache offset of key j (K half; the V half is the same offset into vc)
  w.off.resize(nmax);
  for (int j0 = 0, b = 0; j0 < nmax; j0 += BS, ++b) {
    const int64_t base = ((int64_t)tb[b] * KV + kh) * BS * D;
    const int m = std::min(BS, nmax - j0);
    for (int jj = 0; jj < m; ++jj) w.off[j0 + jj] = base + (int64_t)jj * D;
  }
  const int64_t stride = round_up(nmax, kKeyAlign);
  const int64_t Dp = round_up(D, L);
  w.sc.resize(R * stride);
  w.acc.assign(R * Dp, 0.f);
  const int64_t* off = w.off.data();
  // pass(cache, offsets, kb, read_ahead) for each key block kb of `cache`
  // (the keys, then the values).  A run of several tokens reads each block
  // of a bfloat16 cache many times: it is widened to float32 once instead
  // (the same values, so the same bits as reading the cache itself; decode
  // reads it directly).
  auto by_block = [&](const C* cache, auto&& pass) {
    if constexpr (std::is_same_v<C, bf16_t>) {
      if (nt > 1) {
        w.wide.resize((size_t)ge.kblock * D);
        w.offw.resize(nmax);
        for (int j = 0; j < nmax; ++j) w.offw[j] = (int64_t)(j % ge.kblock) * D;  // kb steps by kblock from 0
        for (int kb = 0; kb < nmax; kb += ge.kblock) {
          widen_rows(cache, off, kb, std::min(kb + ge.kblock, nmax), D, w.wide.data());
          pass(static_cast<const float*>(w.wide.data()), w.offw.data(), kb, false);
        }
        return;
      }
    }
    for (int kb = 0; kb < nmax; kb += ge.kblock) pass(cache, off, kb, true);
  };
  auto qrow = [&](int64_t t, int g) { return o + ((size_t)t * H + (size_t)kh * G + g) * D; };
  auto srow = [&](int64_t t, int g) { return w.sc.data() + ((t - t0) * G + g) * stride; };
  auto arow = [&](int64_t t, int g) { return w.acc.data() + ((t - t0) * G + g) * Dp; };

  // scores: the G heads of a token in tiles of 2 rows (and 1), 12 / rows keys at a time
  auto scores = [&](const auto* kc, const int64_t* off, int kb, bool read_ahead) {
    using K = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
    for (int64_t t = t0; t < t1; ++t) {
      const int n = mt[2 * t + 1] + 1, lo = first_key<kWindow>(ge, n - 1);
      if (n <= kb || kb + ge.kblock <= lo) continue;
      const int kbeg = std::max(kb, lo / kKeyAlign * kKeyAlign);  // score tiles start on kKeyAlign
      const int kend = std::min(kb + ge.kblock, n);
      for (int g0 = 0; g0 < G; g0 += 2) {
        const int pf = read_ahead && t == t0 && g0 == 0 ? n : 0;  // the item's first pass over these keys
        const int nr = std::min(2, G - g0);
        const float* q[2];
        float* out[2];
        for (int r = 0; r < nr; ++r) {
          q[r] = qrow(t, g0 + r);
          out[r] = srow(t, g0 + r);
        }
        switch (nr * 1000 + (D == 64 || D == 128 ? D : 0)) {
          case 1000: score_keys<1, 0, K>(q, kc, off, kbeg, kend, D, ge.scale, out, pf); break;
          case 1064: score_keys<1, 64, K>(q, kc, off, kbeg, kend, D, ge.scale, out, pf); break;
          case 1128: score_keys<1, 128, K>(q, kc, off, kbeg, kend, D, ge.scale, out, pf); break;
          case 2064: score_keys<2, 64, K>(q, kc, off, kbeg, kend, D, ge.scale, out, pf); break;
          case 2128: score_keys<2, 128, K>(q, kc, off, kbeg, kend, D, ge.scale, out, pf); break;
          default: score_keys<2, 0, K>(q, kc, off, kbeg, kend, D, ge.scale, out, pf); break;
        }
      }
    }
  };
  by_block(kc, scores);
  // softmax weights
  for (int64_t t = t0; t < t1; ++t) {
    const int n = mt[2 * t + 1] + 1, lo = first_key<kWindow>(ge, n - 1);
    for (int g = 0; g < G; ++g) softmax(srow(t, g) + lo, n - lo);
  }
  // weighted values, key block by key block (each row's sum runs over j in order)
  const int nvec = static_cast<int>(Dp / L);
  const bool odd = D % L != 0;
  const int last = odd ? D % L : L;
  auto values = [&](const auto* vc, const int64_t* off, int kb, bool read_ahead) {
    using V = std::remove_const_t<std::remove_pointer_t<decltype(vc)>>;
    for (int64_t t = t0; t < t1; ++t) {
      const int n = mt[2 * t + 1] + 1, jb = std::max(kb, first_key<kWindow>(ge, n - 1));
      const int kend = std::min(kb + ge.kblock, n);
      if (jb >= kend) continue;
      for (int g0 = 0; g0 < G; g0 += kRows) {
        const int pf = read_ahead && t == t0 && g0 == 0 ? n : 0;
        const int nr = std::min(kRows, G - g0);
        const float* p[kRows];
        float* a[kRows];
        for (int r = 0; r < nr; ++r) p[r] = srow(t, g0 + r);
        for (int c0 = 0; c0 < nvec; c0 += kVecs) {
          const int nv = std::min(kVecs, nvec - c0);
          const bool tail = odd && c0 + nv == nvec;
          for (int r = 0; r < nr; ++r) a[r] = arow(t, g0 + r) + c0 * L;
          const V* vcd = vc + c0 * L;
          switch (nr) {
            case 1: pv_rows<1, V>(p, vcd, off, jb, kend, nv, tail, last, a, pf); break;
            case 2: pv_rows<2, V>(p, vcd, off, jb, kend, nv, tail, last, a, pf); break;
            default: pv_rows<3, V>(p, vcd, off, jb, kend, nv, tail, last, a, pf); break;
          }
        }
      }
    }
  };
  by_block(vc, values);
  // into the output rows (over q, which nothing reads any more)
  for (int64_t t = t0; t < t1; ++t)
    for (int g = 0; g < G; ++g) std::memcpy(qrow(t, g), arow(t, g), sizeof(float) * D);
}

}  // namespace

void fdx::check_attention_meta(const AttnShape& sh, const int* mt, const int* bt) {
  fdx::require(sh.D <= 512, "head size must be <= 512");  // the key row rounded before its bfloat16 store
  for (int64_t t = 0; t < sh.T; ++t) {
    const int s = mt[2 * t], p = mt[2 * t + 1];
    fdx::require(s >= 0 && s < sh.S, "token sequence index out of range");
    fdx::require(p >= 0 && p < sh.P, "position out of range of the RoPE table");
    fdx::require(p / sh.BS < sh.MAXB, "position beyond the block table");
    for (int64_t j = 0; j <= p / sh.BS; ++j) {
      const int b = bt[s * sh.MAXB + j];
      fdx::require(b >= 0 && b < sh.NB, "block id out of range");
    }
  }
}

namespace {

// One K or V row of D floats into its cache slot: as is, or rounded to bfloat16.
inline void put_row(float* dst, const float* src, int D) { std::memcpy(dst, src, sizeof(float) * D); }
inline void put_row(bf16_t* dst, const float* src, int D) {
  int i = 0;
#if defined(__AVX512F__)
  // fdx::bf16_bits, 16 at a time: nearest even; zero/denormal -> signed zero; NaN -> quiet
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
  for (; i + 16 <= D; i += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    const __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(hi, one)), 16);
    const __mmask16 den = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7F800000));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    r = _mm512_mask_mov_epi32(r, den, _mm512_and_si512(hi, _mm512_set1_epi32(0x8000)));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
#endif
  for (; i < D; ++i) dst[i] = static_cast<bf16_t>(fdx::bf16_bits(src[i]));
}

template <typename C>
void attention(const fdx::AttnShape& sh, const float* x, C* kc, const float* rp, const int* mt, const int* bt,
               float* o) {
  const int64_t T = sh.T, MAXB = sh.MAXB;
  if (T <= 0) return;
  const int H = sh.H, KV = sh.KV, D = sh.D, BS = sh.BS, half = D / 2;
  const int64_t W = (int64_t)(H + 2 * KV) * D;
  C* vc = kc + (size_t)sh.NB * KV * BS * D;
  const Geometry ge{H, KV, D, BS, H / KV, MAXB, static_cast<int>(std::max<int64_t>(kKeyAlign, 4096 / D / kKeyAlign * kKeyAlign)), sh.scale,
                      sh.window};

  // work items: runs of <= kRun consecutive tokens of one sequence, times kv heads
  std::vector<int64_t> runs;  // start of each run, then T
  int64_t work = 0;           // (row, key) pairs, to decide on threads
  for (int64_t t = 0; t < T; ++t) {
    if (t == 0 || mt[2 * t] != mt[2 * (t - 1)] || t - runs.back() >= kRun) runs.push_back(t);
    work += mt[2 * t + 1] + 1 - first_key(ge, mt[2 * t + 1]);
  }
  runs.push_back(T);
  const int64_t nruns = (int64_t)runs.size() - 1, items = nruns * KV;
  work *= H;

  // Work is split by hand (no "omp for"): only GOMP_parallel, GOMP_barrier
  // and omp_get_thread_num/num_threads are used, which Paddle's libiomp5
  // (the runtime this op links against, shared with MKL) implements.
  // Which thread computes a row never changes its bits (see above).
#pragma omp parallel if (items >= 2 && work >= 2048)
  {
    const int nth = omp_get_num_threads();
    const int tid = omp_get_thread_num();
    // phase 1: rope(q) into the output rows (scratch until
    // overwritten by the result), rotated k and v into their cache slots
    for (int64_t t = T * tid / nth; t < T * (tid + 1) / nth; ++t) {
      const int s = mt[2 * t], p = mt[2 * t + 1];
      const float* cs = rp + (size_t)p * D;
      const float* xt = x + t * W;
      for (int h = 0; h < H; ++h) rope_rotate(xt + h * D, o + ((size_t)t * H + h) * D, cs, half);
      const int blk = bt[s * MAXB + p / BS];
      const int off = p % BS;
      for (int kh = 0; kh < KV; ++kh) {
        const size_t slot = (((size_t)blk * KV + kh) * BS + off) * D;
        if constexpr (std::is_same_v<C, float>) {
          rope_rotate(xt + (size_t)(H + kh) * D, kc + slot, cs, half);
        } else {
          float kr[512];  // D <= 512 (the op checks)
          rope_rotate(xt + (size_t)(H + kh) * D, kr, cs, half);
          put_row(kc + slot, kr, D);
        }
        put_row(vc + slot, xt + (size_t)(H + KV + kh) * D, D);
      }
    }
#pragma omp barrier
    // phase 2: attention, item by item
    static thread_local Scratch scratch;
    for (int64_t it = tid; it < items; it += nth) {
      const int64_t r = it / KV;
      const int kh = static_cast<int>(it % KV);
      const int64_t t0 = runs[r];
      const int* tb = bt + (int64_t)mt[2 * t0] * MAXB;
      if (ge.window > 0)
        attend_item<true>(ge, kc, vc, mt, tb, t0, runs[r + 1], kh, o, scratch);
      else
        attend_item<false>(ge, kc, vc, mt, tb, t0, runs[r + 1], kh, o, scratch);
    }
  }
}

}  // namespace

void fdx::paged_attention(const AttnShape& sh, const float* x, void* kcache, const float* rp, const int* mt,
                          const int* bt, float* o) {
  if (sh.bf16_cache) attention(sh, x, static_cast<bf16_t*>(kcache), rp, mt, bt, o);
  else attention(sh, x, static_cast<float*>(kcache), rp, mt, bt, o);
}
