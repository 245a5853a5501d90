// fdx CPU custom op: RoPE + paged KV-cache write + causal paged attention.
//
// One call per layer replaces ~15 eager Paddle ops.  Layout contract (kept
// in sync with fdx/model/native.py and fdx/model/llama.py):
//   qkv       [T, (H + 2*KV) * D] float32   fused q/k/v projections (bias added)
//   kv_cache  [2, NB, KV, BS, D]  float32   K at [0], V at [1]; WRITTEN IN PLACE
//                                 (or bfloat16: AttnShape::bf16_cache, see BFLOAT16 CACHE;
//                                 the K half's blocks are transposed, see KEY BLOCKS)
//   rope      [P, D]              float32   cos in [:, :D/2], sin in [:, D/2:]
//   meta      [T, 2]              int32     (sequence index, position) per token
//   tables    [S, MAXB]           int32     block table per sequence
// Output      [T, H * D]          float32
// Token t of sequence s at position p attends to keys lo..p of s, which are
// read ONLY through tables[s] (block tables[s][j / BS], key j % BS in it);
// lo = 0, or with a sliding window w > 0, max(0, p - w + 1): the keys
// p - w < j <= p (transformers' sliding_window_causal_mask_function).
// Every key block stays in the cache; the window only narrows the keys read.
// K/V of every token in the call are written before any attention is read,
// so chunks of several new tokens per sequence (prefill) work.
// RoPE is NEOX "rotate_half" style (Hugging Face q/k order).
//
// KEY BLOCKS.  A block of one kv head holds BS * D values either way; V's
// are key-major (key jj's D values at jj * D), K's dim-major, so that one
// vector load reads a dim of L consecutive keys: float32 value (jj, d) at
// d * BS + jj; bfloat16 at ((d / 2) * BS + jj) * 2 + d % 2 (dims d, d + 1 of
// a key side by side: one load gives L keys' two dims, the low halves and
// the high ones).  Whole blocks move between caches and instances (copies,
// KV transfer, storage) unchanged; the runner's cache fingerprint names the
// layout.  Pure-Paddle attention (llama.py) keeps K key-major: its caches
// are its own.
//
// BATCH INVARIANCE BY CONSTRUCTION.  Query row (token t, head h) of
// sequence s at position p, with q = rope(q), runs
//   score[j] = acc * scale           for j = lo..p, where acc = 0 and, for
//              d = 0 .. D-1 in order, acc = fma(q[d], k_j[d], acc): one
//              lane a key;
//   w[j]     = softmax(score)[j]: exp(score[j] - max), their sum in the 16
//              canonical lanes of simd_math.h (lane i: j = lo + i, lo + i +
//              16, ...) and v::reduce_add's tree, then w[j] = e[j] * (1 / sum);
//   out[d]   = sum over j = lo..p, in order, of w[j] v_j[d] (fma).
// (window 0: lo = 0, the very operations of an op without a window.)
// These are the same IEEE operations in the same order whatever T is,
// whichever rows share the call, wherever the row sits in its tile (the
// score tiles of 1-4 rows x 1-8 key vectors and the weighted-sum tiles of
// 1-3 rows x 1-4 vectors run the same per-lane sequence) and whatever the
// thread count: each row is computed entirely by one thread.  They do not
// depend on the kernel set either: a lane is a key (scores) or a dim (the
// weighted sum), whatever the vector width, so AVX-512 and AVX2 give the
// same bits (tests/test_isa_bits.py; the scalar reference of
// tests/test_scalar_reference.py).  RoPE is x1 c - x2 s and x2 c + x1 s,
// each one fma and one mul.  Work is tiled only for reuse: a work item is
// (a run of <= kRun consecutive tokens of one sequence, a kv head); key
// blocks stay in L1 while every row of the item uses them, and the G query
// heads of a token share each key/value load.
//
// BFLOAT16 CACHE.  With AttnShape::bf16_cache the cache holds each K and V
// value rounded to bfloat16 (fdx::bf16_bits: nearest even, denormals to
// zero) -- half the bytes, and decode attention is bound by reading them.
// A load widens a value back to its float32 exactly (16 zero bits below), so
// everything above runs unchanged on the rounded values: the same sequence,
// the same bits on every kernel set and thread count, batch-invariant.

#include <algorithm>
#include <atomic>
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
constexpr int kRun = 32;          // tokens per work item (a prefill chunk is cut in runs)
constexpr int kRows = 3;          // query rows per register tile of the weighted sum
constexpr int kVecs = 4;          // output vectors per register tile of the weighted sum
constexpr int kGroupBlocks = 4;   // key blocks per pass of the scores (in L1 while a run's rows use them)

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
// L pairs of bfloat16 values at p (the first n pairs, zeros after them, when
// n < L) as two vectors widened exactly: the pairs' low halves (ev) and
// their high halves (od), one operation each.
inline void load_pairs(const bf16_t* p, v::vf& ev, v::vf& od, int n = L) {
#if defined(__AVX512F__)
  const __m512i x = n == L ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32(v::first_mask(n), p);
  ev = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  od = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#else
  const __m256i x = n == L ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                           : _mm256_maskload_epi32(reinterpret_cast<const int*>(p), v::first_mask(n));
  ev = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  od = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
#endif
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

// ---- scores over a transposed key block (lanes = keys) ----------------------
// A key block of the cache holds K transposed: row d (d < D) is k_j[d] of the
// block's BS keys j.  A key vector is up to L consecutive keys of one block
// (a pointer to its row 0, `cnt` keys); a score tile runs NR query rows over
// NV key vectors, every lane its own key:
//   acc = 0;  for d = 0 .. D-1 in order: acc = fma(q[d], k_j[d], acc);  score = acc * scale
// the same chain whatever the tile, kernel set (AVX2: 8 keys a vector) or thread.
struct KeyVec {
  const void* k;  // row 0 of these keys (the next row BS values further)
  int j;          // the first key's index in the row of scores
  int cnt;        // keys (1 .. L)
  bool whole;     // L values can be read at k (within the block's row): the lanes past cnt are ignored
};


// pf: up to 8 key vectors (the next tile's) asked for across the d loop,
// row d of each at step d.
struct Prefetch {
  const char* k[8];
  int n;
  int64_t voff;  // bytes from a key block to its value block; 0: keys only
};

// The d loop of score_kt: FULL (every vector's L values readable) hoisted
// out of it, and every loop over the sums unrolled, so the NR x NV sums stay
// in registers (GCC kept the array's stack copy and stored all of them at
// each d otherwise; a 512-token prefill's attention 1.07x without the
// stores, docs/PERFORMANCE.md).
template <int NR, int NV, typename C, bool FULL>
inline void score_kt_loop(const float* const* q, const KeyVec* kv, const C* const* k, int D, int BS,
                          const Prefetch* pf, v::vf (&acc)[NR][NV]) {
  const int npf = pf != nullptr ? pf->n : 0;
  const int64_t voff = npf ? pf->voff : 0;
  if constexpr (std::is_same_v<C, bf16_t>) {
    // rows d, d + 1 interleaved: one load of L pairs, the even halves then the odd ones
    const int64_t row = 2 * static_cast<int64_t>(BS) * sizeof(C);  // bytes a pair of rows
    for (int d = 0; d < D; d += 2) {
      for (int i = 0; i < npf; ++i) _mm_prefetch(pf->k[i] + (d / 2) * row, _MM_HINT_T0);
      if (voff)
        for (int i = 0; i < npf; ++i) _mm_prefetch(pf->k[i] + voff + (d / 2) * row, _MM_HINT_T1);
      v::vf ev[NV], od[NV];
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) {
        load_pairs(k[c] + (int64_t)d * BS, ev[c], od[c], FULL ? L : kv[c].cnt);
        in_register(ev[c]);
        in_register(od[c]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const v::vf q0 = v::set1(q[r][d]), q1 = v::set1(q[r][d + 1]);
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) acc[r][c] = v::fmadd(q0, ev[c], acc[r][c]);
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) acc[r][c] = v::fmadd(q1, od[c], acc[r][c]);
      }
    }
  } else {
    const int64_t row = static_cast<int64_t>(BS) * sizeof(C);
    for (int d = 0; d < D; ++d) {
      for (int i = 0; i < npf; ++i) _mm_prefetch(pf->k[i] + d * row, _MM_HINT_T0);
      if (voff)
        for (int i = 0; i < npf; ++i) _mm_prefetch(pf->k[i] + voff + d * row, _MM_HINT_T1);
      v::vf kd[NV];
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) {
        kd[c] = FULL ? v::load(k[c] + (int64_t)d * BS) : v::load_first(k[c] + (int64_t)d * BS, kv[c].cnt);
        in_register(kd[c]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const v::vf qd = v::set1(q[r][d]);
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) acc[r][c] = v::fmadd(qd, kd[c], acc[r][c]);
      }
    }
  }
}

template <int NR, int NV, typename C>
inline void score_kt(const float* const* q, const KeyVec* kv, int D, int BS, float scale, float* const* out,
                     const Prefetch* pf) {
  v::vf acc[NR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) acc[r][c] = v::zero();
  const C* k[NV];
  bool full = true;
  for (int c = 0; c < NV; ++c) {
    k[c] = static_cast<const C*>(kv[c].k);
    full = full && kv[c].whole;
  }
  if (full) score_kt_loop<NR, NV, C, true>(q, kv, k, D, BS, pf, acc);
  else score_kt_loop<NR, NV, C, false>(q, kv, k, D, BS, pf, acc);
  const v::vf sc = v::set1(scale);
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) {
      const v::vf x = v::mul(acc[r][c], sc);
      if (kv[c].cnt == L) v::store(out[r] + kv[c].j, x);
      else v::store_first(out[r] + kv[c].j, x, kv[c].cnt);
    }
}

// Rows (NR = 1..4) over key vectors kv[0..n): tiles of up to 12 / NR
// accumulators (AVX2: the same; 12 sums, a key vector and a broadcast fit
// its 16 registers), n split evenly (a tile of few vectors waits on its fma
// chains); with read_ahead each tile asks for the next one's keys.
template <int NR, typename C>
inline void score_rows_kt(const float* const* q, const KeyVec* kv, int n, int D, int BS, float scale,
                          float* const* out, bool read_ahead, int64_t voff) {
  constexpr int NV = NR == 1 ? 8 : 12 / NR;
  const int tiles = (n + NV - 1) / NV;
  if (read_ahead && voff) {  // the first tile's value blocks (the loop asks for the later tiles')
    const int64_t bytes = static_cast<int64_t>(BS) * D * sizeof(C);
    for (int j = 0; j < std::min(n, NV); ++j)
      for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(kv[j].k) + voff + o, _MM_HINT_T1);
  }
  for (int i = 0, c = 0; i < tiles; ++i) {
    const int m = (n - c) / (tiles - i);  // the rest, evenly
    Prefetch pf{{}, 0, voff};
    if (read_ahead && i + 1 < tiles) {
      const int nn = std::min(8, (n - c - m) / (tiles - i - 1));
      for (int j = 0; j < nn; ++j) pf.k[pf.n++] = static_cast<const char*>(kv[c + m + j].k);
    }
    switch (m) {
#define FDX_KT(N) \
  case N: if constexpr (N <= NV) score_kt<NR, N, C>(q, kv + c, D, BS, scale, out, pf.n ? &pf : nullptr); break;
      FDX_KT(1) FDX_KT(2) FDX_KT(3) FDX_KT(4) FDX_KT(5) FDX_KT(6) FDX_KT(7) FDX_KT(8)
#undef FDX_KT
    }
    c += m;
  }
}

// acc[r][c*L ..] += sum over keys j in [j0, j1) of p[r][j] * v_j[d0 + c*L ..]
// for NR rows and NV vectors (the last one masked to `last` lanes if TAIL);
// v_j = vc + off[j] + d0.  Values kAhead keys ahead are prefetched while
// below pf (the row's key count on an item's first pass; 0: none).
// PAIRS (a bfloat16 cache, NV even, no TAIL): two vectors a load
// (load_pairs), so acc holds each chunk of 2L dims permuted -- vector 2k
// lane i is dim 2kL + 2i, vector 2k + 1 lane i dim 2kL + 2i + 1
// (unpermute_pairs puts them back); every dim's fma chain is the same.
template <int NR, int NV, bool TAIL, typename C, bool PAIRS = false>
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
    if constexpr (PAIRS) {
      static_assert(NV % 2 == 0 && !TAIL && std::is_same_v<C, bf16_t>);
#pragma GCC unroll 2
      for (int c = 0; c < NV; c += 2) {
        v::vf ev, od;
        load_pairs(vr + c * L, ev, od);
        in_register(ev);
        in_register(od);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
          a[r][c] = v::fmadd(pb[r], ev, a[r][c]);
          a[r][c + 1] = v::fmadd(pb[r], od, a[r][c + 1]);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) {
        v::vf vv = (TAIL && c == NV - 1) ? load_kv_first(vr + c * L, last) : load_kv(vr + c * L);
        in_register(vv);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) a[r][c] = v::fmadd(pb[r], vv, a[r][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) v::store(acc[r] + c * L, a[r][c]);
}

// dst[0..D) from pv_tile's permuted sums (PAIRS; D a multiple of 2L).
inline void unpermute_pairs(const float* acc, float* dst, int D) {
  for (int k = 0; k < D / (2 * L); ++k)
    for (int i = 0; i < L; ++i) {
      dst[2 * k * L + 2 * i] = acc[2 * k * L + i];
      dst[2 * k * L + 2 * i + 1] = acc[(2 * k + 1) * L + i];
    }
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
  std::vector<float> wide;      // a bfloat16 cache's value block, widened (runs of several tokens)
  std::vector<int64_t> offw;    // offsets into wide
  std::vector<KeyVec> kv;       // the key vectors of a group of key blocks
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

thread_local Scratch attn_scratch;  // each thread's, between calls (fdx::release_attention_scratch)

struct Geometry {
  int H, KV, D, BS, G;
  int64_t MAXB;
  int kblock;  // keys per L1 block of the weighted sum
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
  // cache offset of value j (key-major blocks; the keys' blocks are the same
  // blocks of the K half, transposed: KEY BLOCKS)
  w.off.resize(nmax);
  for (int j0 = 0, b = 0; j0 < nmax; j0 += BS, ++b) {
    const int64_t base = ((int64_t)tb[b] * KV + kh) * BS * D;
    const int m = std::min(BS, nmax - j0);
    for (int jj = 0; jj < m; ++jj) w.off[j0 + jj] = base + (int64_t)jj * D;
  }
  const int64_t stride = round_up(nmax, L);  // whole key vectors
  const int64_t Dp = round_up(D, L);
  w.sc.resize(R * stride);
  w.acc.assign(R * Dp, 0.f);
  const int64_t* off = w.off.data();
  // pass(cache, offsets, kb, read_ahead) for each block kb of kblock values.
  // A run of several tokens reads each block of a bfloat16 cache many
  // times: it is widened to float32 once instead (the same values, so the
  // same bits as reading the cache itself; decode reads it directly).
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

  // scores: each token's G heads in tiles of up to 4 rows over the key
  // vectors of the blocks it attends to; a run of several tokens goes
  // through the blocks kGroupBlocks at a time (in L1 while its rows use them)
  {
    const int nblk = (nmax + BS - 1) / BS, nvk = (BS + L - 1) / L;
    const int64_t bsz = (int64_t)BS * D;  // values a key block (of one kv head)
    auto block_of = [&](int b) { return kc + ((int64_t)tb[b] * KV + kh) * bsz; };
    const int gb = nt > 1 ? kGroupBlocks : nblk;
    // decode: the next tile's value blocks are asked for (into L2) beside
    // its keys, so the weighted sum's pass finds them on its way
    const int64_t voff = nt == 1 ? (vc - kc) * static_cast<int64_t>(sizeof(C)) : 0;
    w.kv.resize((size_t)gb * nvk);
    for (int b0 = 0; b0 < nblk; b0 += gb) {
      const int b1 = std::min(nblk, b0 + gb);
      int nkv = 0;
      for (int b = b0; b < b1; ++b) {
        const int m = std::min(BS, nmax - b * BS);
        for (int c = 0; c * L < m; ++c)  // a key's 4 bytes a row (bfloat16: a pair of rows)
          w.kv[nkv++] = KeyVec{reinterpret_cast<const char*>(block_of(b)) + 4 * c * L, b * BS + c * L,
                               std::min(L, m - c * L), (c + 1) * L <= BS};
      }
      for (int64_t t = t0; t < t1; ++t) {
        const int n = mt[2 * t + 1] + 1, lo = first_key<kWindow>(ge, n - 1);
        int v0 = 0, v1 = nkv;
        while (v1 > v0 && w.kv[v1 - 1].j >= n) --v1;
        while (v0 < v1 && w.kv[v0].j + w.kv[v0].cnt <= lo) ++v0;
        if (v0 == v1) continue;
        for (int g0 = 0; g0 < G; g0 += 4) {
          const int nr = std::min(4, G - g0);
          const float* q[4];
          float* out[4];
          for (int r = 0; r < nr; ++r) {
            q[r] = qrow(t, g0 + r);
            out[r] = srow(t, g0 + r);
          }
          const KeyVec* kv = w.kv.data() + v0;
          const int nv = v1 - v0;
          const bool ahead = t == t0 && g0 == 0;  // the item's first pass over its keys
          switch (nr) {
            case 1: score_rows_kt<1, C>(q, kv, nv, D, BS, ge.scale, out, ahead, voff); break;
            case 2: score_rows_kt<2, C>(q, kv, nv, D, BS, ge.scale, out, ahead, voff); break;
            case 3: score_rows_kt<3, C>(q, kv, nv, D, BS, ge.scale, out, ahead, voff); break;
            default: score_rows_kt<4, C>(q, kv, nv, D, BS, ge.scale, out, ahead, voff); break;
          }
        }
      }
    }
  }
  // softmax weights
  for (int64_t t = t0; t < t1; ++t) {
    const int n = mt[2 * t + 1] + 1, lo = first_key<kWindow>(ge, n - 1);
    for (int g = 0; g < G; ++g) softmax(srow(t, g) + lo, n - lo);
  }
  // weighted values, key block by key block (each row's sum runs over j in order)
  const int nvec = static_cast<int>(Dp / L);
  const bool odd = D % L != 0;
  const int last = odd ? D % L : L;
  // a bfloat16 cache read directly (decode): pairs of value vectors, the sums permuted
  const bool pairs = std::is_same_v<C, bf16_t> && nt == 1 && D % (2 * L) == 0 && kVecs % 2 == 0;
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
          if constexpr (std::is_same_v<V, bf16_t>) {
            if (pairs) {  // nv is even here: nvec is, and kVecs
              switch (nr * 10 + nv / 2) {
                case 11: pv_tile<1, 2, false, V, true>(p, vcd, off, jb, kend, last, a, pf); break;
                case 12: pv_tile<1, 4, false, V, true>(p, vcd, off, jb, kend, last, a, pf); break;
                case 21: pv_tile<2, 2, false, V, true>(p, vcd, off, jb, kend, last, a, pf); break;
                case 22: pv_tile<2, 4, false, V, true>(p, vcd, off, jb, kend, last, a, pf); break;
                case 31: pv_tile<3, 2, false, V, true>(p, vcd, off, jb, kend, last, a, pf); break;
                default: pv_tile<3, 4, false, V, true>(p, vcd, off, jb, kend, last, a, pf); break;
              }
              continue;
            }
          }
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
    for (int g = 0; g < G; ++g) {
      if (pairs) unpermute_pairs(arow(t, g), qrow(t, g), D);
      else std::memcpy(qrow(t, g), arow(t, g), sizeof(float) * D);
    }
}

}  // namespace

void fdx::check_attention_meta(const AttnShape& sh, const int* mt, const int* bt) {
  fdx::require(sh.D <= 512, "head size must be <= 512");
  fdx::require(sh.D % 2 == 0, "head size must be even");  // RoPE's halves; the bfloat16 key blocks' row pairs  // the key row rounded before its bfloat16 store
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

// One K row of D floats into column `off` of its transposed key block at
// blk (see KEY BLOCKS): float32 value d at blk[d * BS + off]; bfloat16 (as
// put_row rounds) value d at blk[((d / 2) * BS + off) * 2 + d % 2].
inline void put_column(float* blk, int off, const float* src, int D, int BS) {
  for (int d = 0; d < D; ++d) blk[(int64_t)d * BS + off] = src[d];
}
inline void put_column(bf16_t* blk, int off, const float* src, int D, int BS) {
  bf16_t r[512];
  put_row(r, src, D);
  for (int d = 0; d < D; ++d) blk[((int64_t)(d / 2) * BS + off) * 2 + d % 2] = r[d];
}

template <typename C>
void attention(const fdx::AttnShape& sh, const float* x, C* kc, const float* rp, const int* mt, const int* bt,
               float* o) {
  const int64_t T = sh.T, MAXB = sh.MAXB;
  if (T <= 0) return;
  const int H = sh.H, KV = sh.KV, D = sh.D, BS = sh.BS, half = D / 2;
  const int64_t W = (int64_t)(H + 2 * KV) * D;
  C* vc = kc + (size_t)sh.NB * KV * BS * D;
  const Geometry ge{H, KV, D, BS, H / KV, MAXB, static_cast<int>(std::max<int64_t>(12, 4096 / D / 12 * 12)), sh.scale,
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
  // phase 2 hands out items in order from a counter: a thread that finishes
  // early (shorter contexts) or starts late takes the next one
  std::atomic<int64_t> next_item{0};
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
        float kr[512];  // D <= 512 (the op checks)
        rope_rotate(xt + (size_t)(H + kh) * D, kr, cs, half);
        put_column(kc + ((size_t)blk * KV + kh) * BS * D, off, kr, D, BS);
        put_row(vc + slot, xt + (size_t)(H + KV + kh) * D, D);
      }
    }
#pragma omp barrier
    // phase 2: attention, item by item
    Scratch& scratch = attn_scratch;
    for (int64_t it; (it = next_item.fetch_add(1, std::memory_order_relaxed)) < items;) {
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

int64_t fdx::release_attention_scratch() {
  Scratch& w = attn_scratch;
  const int64_t bytes = static_cast<int64_t>((w.sc.capacity() + w.acc.capacity() + w.wide.capacity()) * sizeof(float) +
                                             (w.off.capacity() + w.offw.capacity()) * sizeof(int64_t) +
                                             w.kv.capacity() * sizeof(KeyVec));
  w = Scratch{};
  return bytes;
}

void fdx::paged_attention(const AttnShape& sh, const float* x, void* kcache, const float* rp, const int* mt,
                          const int* bt, float* o) {
  if (sh.bf16_cache) attention(sh, x, static_cast<bf16_t*>(kcache), rp, mt, bt, o);
  else attention(sh, x, static_cast<float*>(kcache), rp, mt, bt, o);
}
