// fdx CPU custom op: y = x @ W^T in int8, one kernel for every row count.
//
// x is quantized per row in blocks of 32 to int8 (Q8: d = max|x| / 127,
// q = round(x / d), as llama.cpp's Q8_0/Q8_1); W stays in its GGUF blocks,
// repacked at load (fdx/model/llama.py pack_weight) so that one 32-byte
// vector holds 4 consecutive k of 8 output columns.  Integer dot products
// (AVX2 vpmaddubsw, or AVX-512-VNNI / AVX-VNNI vpdpbusd where the build
// targets it: the same exact integers) give each column's block sum in its
// own lane, so no horizontal reduction is ever needed.
//
// BATCH INVARIANCE BY CONSTRUCTION.  Output element (m, n) is
//   acc = 0;  for b in 0..K/32:  acc = fma(isum[m,n,b], dw[n,b] * dx[m,b], acc)
//                                 acc = fma(mw[n,b], sx[m,b], acc)     (Q4 only)
// -- the same IEEE operations in the same order whatever M is, whichever
// rows share the call and wherever row m sits in its tile (the row tiles
// of 1-4 rows run the same per-lane sequence); isum is exact integer
// arithmetic; each element is computed by one thread (threads split the
// columns).  A request's logits are therefore bit-identical alone, in any
// batch, in a prefill chunk or a decode step.
//
// SPEED (AVX2, 2 cores).  Q4: register tiles of 4 rows x 2 column groups,
// so each x broadcast feeds two groups and each nibble unpack four rows; an
// integer pass leaves KC blocks' int32 sums in a small scratch and a float
// pass then runs the fma chains above (the lanes of a tile only share the
// loop, never a sum); row blocks keep their activations in L2 while cache
// tiles of groups keep the weights in L1.  Q8 (sums widened per chunk
// anyway) keeps one-pass tiles of 4 rows x 1 group, measured faster there,
// and so does M = 1 (memory bound: the weights stream one group at a time).  The
// quantized activations live in a per-thread scratch that only grows.
//
//   x      [M, K]               float32
//   w      [ceil(N/8), K/32, B] uint8   packed (kind 4: B = 160, kind 8: B = 272)
//   out    [M, N]               float32
// kind 4 (Q4_0/Q4_1): per (8 columns, block) 128 bytes of nibbles -- chunk c
//   (0..3), byte 4*j + i: low nibble q[j][8c + i], high nibble q[j][8c + 4 + i]
//   -- then d[8] and m[8] as fp16 (w = d*q + m; Q4_0 has m = -8d).
// kind 8 (Q8_0): 8 chunks of 32 signed bytes, chunk c byte 4*j + i = q[j][4c + i],
//   then d[8] fp16 (w = d*q).
// kind 16 (bfloat16, B = 512): 16 pairs of inputs; pair p is one 32-byte
//   vector whose dword j holds w[j][2p] (low half) and w[j][2p + 1] (high).
//
// BFLOAT16 (kind 16).  x is rounded per element to bf16 (round to nearest
// even; denormals read as zero, as the weights were packed), and element
// (m, n) is, over the input pairs p in order,
//   acc = fma(w[n][2p+1], x[m][2p+1], acc);  acc = fma(w[n][2p], x[m][2p], acc)
// with fp32 accumulation -- the sequence AVX512-BF16's vdpbf16ps is
// specified to compute (Intel SDM: odd element first, RNE, DAZ/FTZ; each
// bf16 product is exact in fp32).  A build for a CPU with AVX512-BF16 uses
// vdpbf16ps (compiled, not run on the machines fdx was measured on); every
// other build runs the two fmas, with MXCSR's FTZ/DAZ set for the call.
// Each element has one fixed chain whatever M is: batch-invariant like the
// int8 kinds, and bit-identical across thread counts.

#include <omp.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels.h"
#include "simd_math.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define FDX_QGEMM_BF16DP 1
constexpr const char* kBf16Dot = "vdpbf16ps";
#else
constexpr const char* kBf16Dot = "fma";
#endif

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define FDX_QGEMM_VNNI 1
constexpr const char* kDot = "vnni";
#else
constexpr const char* kDot = "maddubs";
#endif

constexpr int kQ4Bytes = fdx::kPackedQ4Bytes;
constexpr int kQ8Bytes = fdx::kPackedQ8Bytes;
constexpr int kBf16Bytes = fdx::kPackedBf16Bytes;
constexpr int MR = 4;   // rows per register tile
constexpr int NG = 2;   // column groups (of 8) per register tile: the x broadcasts serve both
constexpr int KC = 16;  // blocks per integer pass (the int32 block sums wait in a 4 KB scratch)
constexpr int64_t kRowBytes = 192 << 10;  // activations of a row block (stay in L2 while the weights stream)
constexpr int kGroupTile = 8;            // Q8: column groups per cache tile
constexpr int64_t kTileBytes = 12 << 10;  // packed weights per cache tile (stay in L1 across the row tiles)
// Software prefetch distance of the streamed weights.  Each thread reads its
// column groups' packed blocks front to back once per call; the L2 streamer
// restarts at every 4 KiB page, and the few-row tiles (decode) have too
// little work per byte to hide that.  Prefetching the block kPrefetchBytes
// ahead keeps enough lines in flight (M = 1 on the AMX Xeon: the Q4 layer
// GEMVs 1.6x, the Q8_0 LM head 1.3x).  A hint only: no bit changes.
constexpr int64_t kPrefetchBytes = 4096;

// The cache lines of the block at p + kPrefetchBytes (bytes long), into L1.
template <int64_t bytes>
inline void prefetch_ahead(const uint8_t* p) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + o, _MM_HINT_T0);
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The first ncols (1..8) lanes of v to o.
inline void store_cols(float* o, __m256 v, int ncols) {
  if (ncols == 8) {
    _mm256_storeu_ps(o, v);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(o, tmp, sizeof(float) * ncols);
  }
}

inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Keeps v in a register here: stops the compiler from re-associating an
// accumulation chain into a tree of spilled partial sums (the integers are
// exact either way; this is only about register pressure).
#define FDX_PIN(v) asm volatile("" : "+x"(v))

#ifdef FDX_QGEMM_VNNI
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

// Integer pass: the exact block sums of blocks [b0, b0 + nbk) for R rows x
// G groups, isum[b][r][g] = 8 int32 lanes (one per column).
//   xq[r]: row r's int8 activations, blk[g]: group g's packed blocks.
template <int KIND, int R, int G>
inline void block_sums(const int8_t* const* xq, const uint8_t* const* blk, int64_t b0, int nbk, __m256i* isum) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  (void)low4;
  (void)ones16;
  for (int bb = 0; bb < nbk; ++bb) {
    const int64_t b = b0 + bb;
    constexpr int64_t BB = KIND == 4 ? kQ4Bytes : kQ8Bytes;
    for (int g = 0; g < G; ++g) prefetch_ahead<BB>(blk[g] + b * BB);
    __m256i s[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) s[r][g] = _mm256_setzero_si256();
    if constexpr (KIND == 4) {
      for (int c = 0; c < 4; ++c) {
        __m256i lo[G], hi[G];
        for (int g = 0; g < G; ++g) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g] + b * kQ4Bytes + 32 * c));
          lo[g] = _mm256_and_si256(raw, low4);
          hi[g] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = xq[r] + b * 32 + 8 * c;
          const __m256i xl = bcast4(xb), xh = bcast4(xb + 4);
          for (int g = 0; g < G; ++g) {
#ifdef FDX_QGEMM_VNNI
            s[r][g] = dot_u8s8(dot_u8s8(s[r][g], lo[g], xl), hi[g], xh);
#else
            // |pair| <= 15*127*2 = 3810; a block's eight pair sums (any
            // subset, any order) stay within 8*3810 = 30480: no int16 overflow
            s[r][g] = _mm256_add_epi16(s[r][g], _mm256_maddubs_epi16(lo[g], xl));
            s[r][g] = _mm256_add_epi16(s[r][g], _mm256_maddubs_epi16(hi[g], xh));
#endif
            FDX_PIN(s[r][g]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) {
#ifdef FDX_QGEMM_VNNI
          isum[(bb * R + r) * G + g] = s[r][g];
#else
          isum[(bb * R + r) * G + g] = _mm256_madd_epi16(s[r][g], ones16);
#endif
        }
    } else {
      for (int c = 0; c < 8; ++c) {
        __m256i w[G], aw[G];
        for (int g = 0; g < G; ++g) {
          w[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g] + b * kQ8Bytes + 32 * c));
          aw[g] = _mm256_sign_epi8(w[g], w[g]);  // |w| as unsigned (-128 -> 128)
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xb = bcast4(xq[r] + b * 32 + 4 * c);
          for (int g = 0; g < G; ++g) {
            const __m256i sx8 = _mm256_sign_epi8(xb, w[g]);
#ifdef FDX_QGEMM_VNNI
            s[r][g] = dot_u8s8(s[r][g], aw[g], sx8);
#else
            // |pair| <= 128*127*2 = 32512: fits int16, widened per chunk
            s[r][g] = _mm256_add_epi32(s[r][g], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[g], sx8), ones16));
#endif
            FDX_PIN(s[r][g]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) isum[(bb * R + r) * G + g] = s[r][g];
    }
  }
}

// R (1..MR) rows x G (1..NG) groups of 8 columns: out[r][8g + j].
//   xq [R][K] int8, dx/sx [R][nb], blk[g]: group g's packed blocks.
// Each element's float sequence is the one of the BATCH INVARIANCE note,
// whatever R and G are: (r, g) only pick which lanes share the loop.
template <int KIND, int R, int G>
void tile(const int8_t* const* xq, const float* const* dx, const float* const* sx, const uint8_t* const* blk,
          int64_t nb, float* const* out, const int* ncols) {
  constexpr int64_t BB = KIND == 4 ? kQ4Bytes : kQ8Bytes;
  // few lanes: one block at a time, its sums never leave the registers
  constexpr int kc = R * G == 1 ? 1 : KC;
  alignas(32) __m256i isum[kc * R * G];
  __m256 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += kc) {
    const int nbk = static_cast<int>(std::min<int64_t>(kc, nb - b0));
    block_sums<KIND, R, G>(xq, blk, b0, nbk, isum);
    for (int bb = 0; bb < nbk; ++bb) {
      const int64_t b = b0 + bb;
      __m256 dw[G], mw[G];
      for (int g = 0; g < G; ++g) {
        dw[g] = half8(blk[g] + b * BB + (KIND == 4 ? 128 : 256));
        if constexpr (KIND == 4) mw[g] = half8(blk[g] + b * BB + 144);
      }
      (void)mw;
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_broadcast_ss(dx[r] + b);
        for (int g = 0; g < G; ++g) {
          const __m256 f = _mm256_cvtepi32_ps(isum[(bb * R + r) * G + g]);
          acc[r][g] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw[g], d), acc[r][g]);
        }
        if constexpr (KIND == 4) {
          const __m256 s = _mm256_broadcast_ss(sx[r] + b);
          for (int g = 0; g < G; ++g) acc[r][g] = _mm256_fmadd_ps(mw[g], s, acc[r][g]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) store_cols(out[r] + 8 * g, acc[r][g], ncols[g]);
}

// Q8_0 (and M = 1): one group of 8 columns against R (1..MR) rows, one pass (its sums
// are widened per chunk anyway, and this measured faster for Q8 than the
// two-group tiles above).  The same per-lane float sequence.
//   xq [R][K] int8, dx/sx [R][nb], blk: the group's packed blocks.
template <int KIND, int R>
inline void tile_g1(const int8_t* const* xq, const float* const* dx, const float* const* sx, const uint8_t* blk,
                 int64_t nb, float* const* out, int ncols) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  (void)low4;
  (void)ones16;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i isum[R];
    if constexpr (KIND == 4) {
      const uint8_t* qs = blk + b * kQ4Bytes;
      prefetch_ahead<kQ4Bytes>(qs);
#ifdef FDX_QGEMM_VNNI
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#endif
      for (int c = 0; c < 4; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        const __m256i lo = _mm256_and_si256(raw, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = xq[r] + b * 32 + 8 * c;
#ifdef FDX_QGEMM_VNNI
          isum[r] = dot_u8s8(dot_u8s8(isum[r], lo, bcast4(xb)), hi, bcast4(xb + 4));
#else
          // |pair| <= 15*127*2 = 3810, eight chunks-halves sum to <= 30480: no int16 overflow
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xb)), _mm256_maddubs_epi16(hi, bcast4(xb + 4)));
          isum[r] = c == 0 ? p : _mm256_add_epi16(isum[r], p);
#endif
        }
      }
      const __m256 dw = half8(qs + 128), mw = half8(qs + 144);
      for (int r = 0; r < R; ++r) {
#ifdef FDX_QGEMM_VNNI
        const __m256 f = _mm256_cvtepi32_ps(isum[r]);
#else
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[r], ones16));
#endif
        acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_broadcast_ss(dx[r] + b)), acc[r]);
        acc[r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(sx[r] + b), acc[r]);
      }
    } else {
      const uint8_t* qs = blk + b * kQ8Bytes;
      prefetch_ahead<kQ8Bytes>(qs);
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        const __m256i aw = _mm256_sign_epi8(w, w);  // |w| as unsigned (-128 -> 128)
        for (int r = 0; r < R; ++r) {
          const __m256i sx8 = _mm256_sign_epi8(bcast4(xq[r] + b * 32 + 4 * c), w);
#ifdef FDX_QGEMM_VNNI
          isum[r] = dot_u8s8(isum[r], aw, sx8);
#else
          // |pair| <= 128*127*2 = 32512: fits int16, widened per chunk
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx8), ones16));
#endif
        }
      }
      const __m256 dw = half8(qs + 256);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dw, _mm256_broadcast_ss(dx[r] + b)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_cols(out[r], acc[r], ncols);
}

// Row m of x -> xq (int8), dx (block scales), sx (scale * sum of the block's q).
// Per element the same operations on every path (|x| max, d = max / 127,
// q = round-to-nearest-even(x * (127 / max)), the exact integer sum), so
// the AVX-512 version below gives the AVX2 one's bits with half the vectors.
#if defined(__AVX512F__) && defined(__AVX512BW__)
void quantize_row(const float* x, int64_t K, int8_t* xq, float* dx, float* sx) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = mx / 127.f;
    const float id = mx > 0.f ? 127.f / mx : 0.f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * 32), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * 32 + 16), _mm512_cvtsepi32_epi8(q1));
    dx[b] = d;
    sx[b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}
#else
void quantize_row(const float* x, int64_t K, int8_t* xq, float* dx, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm256_loadu_ps(xb + 8 * c);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = _mm_cvtss_f32(m4);
    const float d = mx / 127.f;
    const float id = mx > 0.f ? 127.f / mx : 0.f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int c = 0; c < 4; ++c) q[c] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[c], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
    const __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), perm);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * 32), p);
    dx[b] = d;
    sx[b] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}
#endif

#if defined(__AVX512F__)
// Two column groups side by side in one zmm: 32 bytes of each at lo and hi
// (hi null: zeros), and 8 fp16 scales of each as 16 floats (exact).
inline __m512i pair_bytes32(const uint8_t* lo, const uint8_t* hi) {
  const __m256i h = hi != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)) : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))), h, 1);
}
inline __m512 pair_scales16(const uint8_t* lo, const uint8_t* hi) {
  const __m128i h = hi != nullptr ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)) : _mm_setzero_si128();
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))), h, 1));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define FDX_QGEMM_ZMM 1
// R (1..MR) rows x a full pair of column groups (16 columns) in zmm
// registers, one template for both int8 kinds.  The pair's two groups are
// adjacent columns, so group 0 has all 8 (the caller gives a pair only
// then).  One pass: R <= 4 rows' sums and accumulators fit the 32 registers.
//
// Q4 (KIND 4): tile<4, R, 2>'s integers (the pair's 32-byte chunks side by
// side, one vpdpbusd serves both groups) and its per-lane float sequence
// (acc = fma(isum, dw*dx, acc), then fma(mw, sx, acc), block by block), so
// the same bits with half the instructions.
//
// Q8_0 (KIND 8), for the LM head at 2-15 rows (a decode step of a few
// sequences, and the rows past the AMX tiles): tile_g1<8>'s integers and
// float sequence (acc = fma(isum, dw*dx, acc), block by block), a quarter
// of its vector instructions.  vpdpbusd multiplies unsigned by signed
// bytes; the activations go in as x + 128 (x ^ 0x80) against the signed
// weights, and 128 times the block's column sums (one vpdpbusd of ones a
// chunk, shared by the rows) come off: the exact isum, so the same bits.
// (tile_g1 makes the weights unsigned instead, |w| and sign(x, w): two sign
// ops a row and chunk, on 8 columns.)  |sum of (x + 128) w| <= 32 * 255 *
// 128 < 2^31.
template <int KIND, int R>
void tile_pair_zmm(const int8_t* const* xq, const float* const* dx, const float* const* sx, const uint8_t* const* blk,
                   int64_t nb, float* const* out, const int* ncols) {
  constexpr int64_t BB = KIND == 4 ? kQ4Bytes : kQ8Bytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i ones = _mm512_set1_epi8(1);
  (void)low4;
  (void)ones;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q0 = blk[0] + b * BB;
    const uint8_t* q1 = blk[1] + b * BB;
    prefetch_ahead<BB>(q0);
    prefetch_ahead<BB>(q1);
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    if constexpr (KIND == 4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i raw = pair_bytes32(q0 + 32 * c, q1 + 32 * c);
        const __m512i lo = _mm512_and_si512(raw, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = xq[r] + b * 32 + 8 * c;
          int32_t xl, xh;
          std::memcpy(&xl, xb, 4);
          std::memcpy(&xh, xb + 4, 4);
          s[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(xl)), hi, _mm512_set1_epi32(xh));
        }
      }
      const __m512 dw = pair_scales16(q0 + 128, q1 + 128), mw = pair_scales16(q0 + 144, q1 + 144);
      for (int r = 0; r < R; ++r) {
        const __m512 f = _mm512_cvtepi32_ps(s[r]);
        acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(dx[r][b])), acc[r]);
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r][b]), acc[r]);
      }
    } else {
      __m512i cs = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i wv = pair_bytes32(q0 + 32 * c, q1 + 32 * c);
        cs = _mm512_dpbusd_epi32(cs, ones, wv);
        for (int r = 0; r < R; ++r) {
          uint32_t xk;
          std::memcpy(&xk, xq[r] + b * 32 + 4 * c, 4);
          s[r] = _mm512_dpbusd_epi32(s[r], _mm512_set1_epi32(static_cast<int>(xk ^ 0x80808080u)), wv);
        }
      }
      const __m512i off = _mm512_slli_epi32(cs, 7);
      const __m512 dw = pair_scales16(q0 + 256, q1 + 256);
      for (int r = 0; r < R; ++r) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[r], off));
        acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(dx[r][b])), acc[r]);
      }
    }
  }
  const __mmask16 mask = static_cast<__mmask16>(0xFFu | (((1u << ncols[1]) - 1u) << 8));
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out[r], mask, acc[r]);
}

// tile_pair_zmm for R (1..MR) rows.
template <int KIND>
void tile_pair_rows(int R, const int8_t* const* xr, const float* const* dr, const float* const* sr,
                    const uint8_t* const* blk, int64_t nb, float* const* orow, const int* ncols) {
  switch (R) {
    case 1: tile_pair_zmm<KIND, 1>(xr, dr, sr, blk, nb, orow, ncols); break;
    case 2: tile_pair_zmm<KIND, 2>(xr, dr, sr, blk, nb, orow, ncols); break;
    case 3: tile_pair_zmm<KIND, 3>(xr, dr, sr, blk, nb, orow, ncols); break;
    default: tile_pair_zmm<KIND, 4>(xr, dr, sr, blk, nb, orow, ncols); break;
  }
}
#endif

template <int KIND, int G>
void tile_rows(int R, const int8_t* const* xr, const float* const* dr, const float* const* sr, const uint8_t* const* blk,
               int64_t nb, float* const* orow, const int* ncols) {
#ifdef FDX_QGEMM_ZMM
  if constexpr (KIND == 4 && G == 2) {  // a full pair of Q4 groups: the zmm tile (the same bits)
    tile_pair_rows<4>(R, xr, dr, sr, blk, nb, orow, ncols);
    return;
  }
#endif
  switch (R) {
    case 1: tile<KIND, 1, G>(xr, dr, sr, blk, nb, orow, ncols); break;
    case 2: tile<KIND, 2, G>(xr, dr, sr, blk, nb, orow, ncols); break;
    case 3: tile<KIND, 3, G>(xr, dr, sr, blk, nb, orow, ncols); break;
    default: tile<KIND, 4, G>(xr, dr, sr, blk, nb, orow, ncols); break;
  }
}

// The R rows from m0: their quantized activations, block scales and scaled sums.
inline void row_ptrs(int64_t m0, int R, const int8_t* xq, const float* dx, const float* sx, int64_t K, int64_t nb,
                     const int8_t** xr, const float** dr, const float** sr) {
  for (int r = 0; r < R; ++r) {
    xr[r] = xq + (m0 + r) * K;
    dr[r] = dx + (m0 + r) * nb;
    sr[r] = sx + (m0 + r) * nb;
  }
}

// The ng groups from g: their packed blocks (BB bytes a block) and output columns.
inline void group_ptrs(const uint8_t* w, int64_t g, int ng, int64_t nb, int64_t BB, int64_t N, const uint8_t** blk,
                       int* ncols) {
  for (int j = 0; j < ng; ++j) {
    blk[j] = w + (g + j) * nb * BB;
    ncols[j] = static_cast<int>(std::min<int64_t>(8, N - 8 * (g + j)));
  }
}

// Groups [g0, g1) of every row: row blocks of kRowBlock (their activations
// stay in L2), within one cache tiles of groups (their weights stay in L1),
// within one register tiles of MR rows x NG groups.
template <int KIND>
void gemm_range(const int8_t* xq, const float* dx, const float* sx, const uint8_t* w, float* out, int64_t M,
                int64_t K, int64_t N, int64_t g0, int64_t g1) {
  const int64_t nb = K / 32;
  const int64_t BB = KIND == 4 ? kQ4Bytes : kQ8Bytes;
  const int64_t gtile = std::max<int64_t>(NG, kTileBytes / (nb * BB) / NG * NG);
  const int64_t rows = std::max<int64_t>(MR, kRowBytes / K / MR * MR);
  for (int64_t mb = 0; mb < M; mb += rows) {
    const int64_t mb1 = std::min<int64_t>(M, mb + rows);
    for (int64_t gt = g0; gt < g1; gt += gtile) {
      const int64_t gt1 = std::min<int64_t>(g1, gt + gtile);
      for (int64_t m0 = mb; m0 < mb1; m0 += MR) {
        const int R = static_cast<int>(std::min<int64_t>(MR, mb1 - m0));
        const int8_t* xr[MR];
        const float* dr[MR];
        const float* sr[MR];
        float* orow[MR];
        row_ptrs(m0, R, xq, dx, sx, K, nb, xr, dr, sr);
        for (int64_t g = gt; g < gt1; g += NG) {
          const int ng = static_cast<int>(std::min<int64_t>(NG, gt1 - g));
          const uint8_t* blk[NG];
          int ncols[NG];
          group_ptrs(w, g, ng, nb, BB, N, blk, ncols);
          for (int r = 0; r < R; ++r) orow[r] = out + (m0 + r) * N + 8 * g;
          if (ng == NG) {
            tile_rows<KIND, NG>(R, xr, dr, sr, blk, nb, orow, ncols);
          } else {
            tile_rows<KIND, 1>(R, xr, dr, sr, blk, nb, orow, ncols);
          }
        }
      }
    }
  }
}

// Q8_0 and M = 1: groups [g0, g1) of every row, in cache tiles of kGroupTile groups x
// every row, register tiles of MR rows x 1 group.
template <int KIND>
void gemm_range_g1(const int8_t* xq, const float* dx, const float* sx, const uint8_t* w, float* out, int64_t M,
                   int64_t K, int64_t N, int64_t g0, int64_t g1) {
  const int64_t nb = K / 32;
  const int64_t BB = KIND == 4 ? kQ4Bytes : kQ8Bytes;
  for (int64_t gt = g0; gt < g1; gt += kGroupTile) {
    const int64_t gt1 = std::min<int64_t>(g1, gt + kGroupTile);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int R = static_cast<int>(std::min<int64_t>(MR, M - m0));
      const int8_t* xr[MR];
      const float* dr[MR];
      const float* sr[MR];
      float* orow[MR];
      row_ptrs(m0, R, xq, dx, sx, K, nb, xr, dr, sr);
      for (int64_t g = gt; g < gt1; ++g) {
        for (int r = 0; r < R; ++r) orow[r] = out + (m0 + r) * N + 8 * g;
#ifdef FDX_QGEMM_ZMM
        // a full pair of Q8_0 groups, 2+ rows: the zmm tile (the same bits; one row keeps tile_g1, memory-bound)
        if (KIND == 8 && M > 1 && g + 1 < gt1) {
          const uint8_t* bp[2];
          int nc[2];
          group_ptrs(w, g, 2, nb, BB, N, bp, nc);
          tile_pair_rows<8>(R, xr, dr, sr, bp, nb, orow, nc);
          ++g;
          continue;
        }
#endif
        const int ncols = static_cast<int>(std::min<int64_t>(8, N - 8 * g));
        const uint8_t* blk = w + g * nb * BB;
        switch (R) {
          case 1: tile_g1<KIND, 1>(xr, dr, sr, blk, nb, orow, ncols); break;
          case 2: tile_g1<KIND, 2>(xr, dr, sr, blk, nb, orow, ncols); break;
          case 3: tile_g1<KIND, 3>(xr, dr, sr, blk, nb, orow, ncols); break;
          default: tile_g1<KIND, 4>(xr, dr, sr, blk, nb, orow, ncols); break;
        }
      }
    }
  }
}


// ---------------------------------------------------------------- AMX-INT8
//
// Where the build targets AMX (an AVX-512 build with -march=native on a CPU
// with AMX-TILE/AMX-INT8: Sapphire Rapids and later) and the CPU and Linux
// allow it at run time, rows in tiles of 16 run the block sums on the tile
// unit: for each block b, one tdpbssd of the 16 rows' 32 int8 activations
// (A: 16 x 32 bytes) by 16 columns' 32 quants (B: 8 rows of 4 k x 16
// columns, the same 4-byte k groups as vpdpbusd reads) gives the EXACT int32
// block sums isum[m][n][b] -- the integers every other path computes -- and
// the float epilogue is the BATCH INVARIANCE sequence above, per element in
// block order (16 columns a zmm instead of 8 a ymm: the same IEEE ops per
// lane).  So the bits equal the VNNI, AVX2 and numpy references'.  B is made
// per pair of column groups from the packed blocks (Q8: two groups' 32-byte
// chunks side by side; Q4: the nibbles unpacked to bytes), once for all row
// tiles.  Rows past the last full tile of 16 run the vector tiles.
// FDX_NATIVE_AMX=0 turns the path off (read per call: tests compare both).
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define FDX_QGEMM_AMX 1

// The CPU has AMX-TILE and AMX-INT8 (CPUID.7.0:EDX bits 24, 25) and Linux
// granted this process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA): asked once per process.
bool amx_permitted() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 25) & 1u)) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
}

bool amx_enabled() {
  const char* e = std::getenv("FDX_NATIVE_AMX");
  return !(e && std::strcmp(e, "0") == 0) && amx_permitted();
}

constexpr int kAmxRows = 16;

// Palette 1: tiles 0-3 C (16 x 16 int32), 4-5 A (16 x 32 bytes), 6-7 B
// (8 x 64 bytes).  Loaded by every thread on each call (another library may
// have loaded its own configuration on this thread since).
void amx_config() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 4; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  for (int t = 4; t < 6; ++t) cfg.colsb[t] = 32, cfg.rows[t] = 16;
  for (int t = 6; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 8;
  _tile_loadconfig(&cfg);
}

// Groups g, g + 1 (the second only if two) -> B tiles wb[nb][8][64] (row r:
// k 4r..4r+3 of each of the 16 columns) and their scales as float32
// (dw, mw [nb][16]; _mm256_cvtph_ps is exact).  A missing group is zeros.
template <int KIND>
void amx_pack_pair(const uint8_t* const* blk, int ng, int64_t nb, int8_t* wb, float* dw, float* mw) {
  constexpr int64_t BB = KIND == 4 ? kQ4Bytes : kQ8Bytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // the two groups side by side (the second zeros if one group)
  auto pair32 = [&](int64_t off) { return pair_bytes32(blk[0] + off, ng == 2 ? blk[1] + off : nullptr); };
  auto scales16 = [&](int64_t off) { return pair_scales16(blk[0] + off, ng == 2 ? blk[1] + off : nullptr); };
  for (int64_t b = 0; b < nb; ++b) {
    int8_t* t = wb + b * 512;
    for (int j = 0; j < ng; ++j) prefetch_ahead<BB>(blk[j] + b * BB);
    if constexpr (KIND == 4) {
      for (int c = 0; c < 4; ++c) {  // chunk c: low nibbles k 8c..8c+3, high nibbles k 8c+4..8c+7
        const __m512i raw = pair32(b * BB + 32 * c);
        _mm512_storeu_si512(t + 64 * (2 * c), _mm512_and_si512(raw, low4));
        _mm512_storeu_si512(t + 64 * (2 * c + 1), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
      }
      _mm512_storeu_ps(dw + 16 * b, scales16(b * BB + 128));
      _mm512_storeu_ps(mw + 16 * b, scales16(b * BB + 144));
    } else {
      for (int c = 0; c < 8; ++c) _mm512_storeu_si512(t + 64 * c, pair32(b * BB + 32 * c));
      _mm512_storeu_ps(dw + 16 * b, scales16(b * BB + 256));
      _mm512_storeu_ps(mw + 16 * b, _mm512_setzero_ps());
    }
  }
}

// One block's epilogue for 16 rows x 16 columns: the int32 sums c[16][16],
// the rows' scales dxb[16] and scaled sums sxb[16] of this block.
template <int KIND>
inline void amx_epilogue(const int32_t* c, const float* dxb, const float* sxb, __m512 dwv, __m512 mwv, __m512* acc) {
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r));
    acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(dwv, _mm512_set1_ps(dxb[r])), acc[r]);
    if constexpr (KIND == 4) acc[r] = _mm512_fmadd_ps(mwv, _mm512_set1_ps(sxb[r]), acc[r]);
  }
}

// Tile instructions on a tile number given as a template argument (GCC's
// _tile_* macros paste the argument's spelling into the mnemonic).
// amx_stored names the 1 KiB it writes: GCC's _tile_stored clobbers all
// memory, which forces the 16 accumulators of amx_tile out to the stack and
// back around every store.
template <int T>
inline void amx_zero() {
  __asm__ volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int T>
inline void amx_load(const void* base, int64_t stride) {
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T));
}
template <int C, int A, int B>
inline void amx_dpbssd() {
  __asm__ volatile("tdpbssd %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
}
template <int T>
inline void amx_stored(int32_t* c) {
  __asm__ volatile("tilestored %%tmm%c2, (%1,%3,1)"
                   : "=m"(*reinterpret_cast<int32_t(*)[256]>(c))
                   : "r"(c), "i"(T), "r"(64L));
}

// Block b of 16 rows into C tile T (A tile 4 or 5, B tile 6 or 7 by the
// block's parity).
template <int T>
inline void amx_issue(const int8_t* xq, int64_t K, const int8_t* wb, int64_t b) {
  amx_zero<T>();
  if (b & 1) {
    amx_load<5>(xq + b * 32, K);
    amx_load<7>(wb + b * 512, 64);
    amx_dpbssd<T, 5, 7>();
  } else {
    amx_load<4>(xq + b * 32, K);
    amx_load<6>(wb + b * 512, 64);
    amx_dpbssd<T, 4, 6>();
  }
}

// Block b into C tile b % 4; block b's sums (C tile b % 4) -> c.
inline void amx_issue_any(const int8_t* xq, int64_t K, const int8_t* wb, int64_t b) {
  switch (b & 3) {
    case 0: amx_issue<0>(xq, K, wb, b); break;
    case 1: amx_issue<1>(xq, K, wb, b); break;
    case 2: amx_issue<2>(xq, K, wb, b); break;
    default: amx_issue<3>(xq, K, wb, b); break;
  }
}
inline void amx_store_any(int64_t b, int32_t* c) {
  switch (b & 3) {
    case 0: amx_stored<0>(c); break;
    case 1: amx_stored<1>(c); break;
    case 2: amx_stored<2>(c); break;
    default: amx_stored<3>(c); break;
  }
}

// Cache lines to ask for while a tile runs: lines [0, n) from p, spread
// over its blocks (a hint only: no bit depends on it).
struct PrefetchLines {
  const char* p = nullptr;
  int64_t n = 0;
};

// 16 rows x the pair's 16 columns (ncols of them stored), every block.
//   xq: the rows' int8 activations (K apart), dx/sx [nb][16]: their block scales and scaled sums;
//   pf: the lines of weights the next chunk packs (gemm_range_amx), asked into L2 a few a block.
// Software pipelined over the four C tiles: while the vector units run block
// b's epilogue, block b + 1's sums are being stored (they are read one
// epilogue later: a tile store does not forward to loads) and blocks b + 2,
// b + 3 are on the tile unit.  The epilogues run in block order.
template <int KIND>
void amx_tile(const int8_t* xq, const float* dx, const float* sx, int64_t K, int64_t nb, const int8_t* wb,
              const float* dw, const float* mw, float* out, int64_t N, int ncols, PrefetchLines pf) {
  __asm__ volatile("" ::: "memory");  // the packed B tiles are written before the tile loads read them
  alignas(64) int32_t c[2][256];      // block b's stored sums in c[b % 2]
  __m512 acc[kAmxRows];               // 16 zmm, in registers throughout
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < std::min<int64_t>(3, nb); ++b) amx_issue_any(xq, K, wb, b);
  amx_stored<0>(c[0]);
  const int64_t pf_step = (pf.n + nb - 1) / nb;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t l = b * pf_step; l < std::min(pf.n, (b + 1) * pf_step); ++l) _mm_prefetch(pf.p + 64 * l, _MM_HINT_T1);
    if (b + 3 < nb) amx_issue_any(xq, K, wb, b + 3);
    if (b + 1 < nb) amx_store_any(b + 1, c[(b + 1) & 1]);
    amx_epilogue<KIND>(c[b & 1], dx + 16 * b, sx + 16 * b, _mm512_loadu_ps(dw + 16 * b), _mm512_loadu_ps(mw + 16 * b),
                       acc);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << ncols) - 1u);
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) _mm512_mask_storeu_ps(out + r * N, mask, acc[r]);
}

// Rows [0, M16) (a multiple of 16) x groups [g0, g1) on the tile unit.
//
// Two loop orders, the same tiles and the same bits:
//  - pair outer (few rows, or a small output): a pair's B tiles (nb x 512
//    bytes) are made once and serve every row tile from L1;
//  - rows outer within chunks of pairs (many rows and an output past L2,
//    e.g. a prefill's gate/up: 512 x 3072 floats): a chunk's B tiles
//    (kAmxChunkBytes) are made once and stay in L2 while each row tile sweeps
//    the chunk, so the output is written row by row, contiguous, instead of
//    16 rows 12 KiB apart per pair (bench/bench_qgemm.py on the AMX VM:
//    1.15x at 512 x 3072, 1.2-1.5x at 128-512 x 49152; docs/PERFORMANCE.md).
// Either way a chunk's tile calls ask for the next chunk's weights, spread
// evenly over them: the pack reads them from L2 instead of waiting on memory
// (a decode step of 32 sequences: the LM head 1.17x, the step 1.03x;
// docs/PERFORMANCE.md).
constexpr int64_t kAmxChunkBytes = 512 * 1024;

// A thread's B tiles (64-byte aligned: full-line stores and tile loads),
// their scales, the rows' scales by tile, the chunk's column counts.
struct AmxScratch {
  std::vector<__m512i> wbv;
  std::vector<float> sc, rs;
  std::vector<int> ncol;
};
thread_local AmxScratch amx_scratch;

template <int KIND>
void gemm_range_amx(const int8_t* xq, const float* dx, const float* sx, const uint8_t* w, float* out, int64_t M16,
                    int64_t K, int64_t N, int64_t g0, int64_t g1) {
  const int64_t nb = K / 32;
  const int64_t BB = KIND == 4 ? kQ4Bytes : kQ8Bytes;
  const bool rows_outer = M16 >= 128 && M16 * N >= (int64_t{3} << 17);
  const int64_t chunk = rows_outer ? std::max<int64_t>(1, kAmxChunkBytes / (nb * 512)) : 1;  // pairs
  auto& [wbv, sc, rs, ncol] = amx_scratch;
  if (static_cast<int64_t>(wbv.size()) < chunk * nb * 8) wbv.resize(chunk * nb * 8);
  if (static_cast<int64_t>(sc.size()) < chunk * nb * 32) sc.resize(chunk * nb * 32);
  if (static_cast<int64_t>(ncol.size()) < chunk) ncol.resize(chunk);
  if (static_cast<int64_t>(rs.size()) < 2 * M16 * nb) rs.resize(2 * M16 * nb);
  // pair p of a chunk: B tiles wb(p), scales dw(p), mw(p) ([nb][16] each)
  auto wb = [&](int64_t p) { return reinterpret_cast<int8_t*>(wbv.data()) + p * nb * 512; };
  auto dw = [&](int64_t p) { return sc.data() + p * nb * 32; };
  auto mw = [&](int64_t p) { return sc.data() + p * nb * 32 + nb * 16; };
  // the rows' scales by tile of 16 rows, block, row: one pointer serves a block's 16 rows
  float* dt = rs.data();
  float* st = rs.data() + M16 * nb;
  for (int64_t t = 0; t < M16 / kAmxRows; ++t)
    for (int64_t b = 0; b < nb; ++b)
      for (int r = 0; r < kAmxRows; ++r) {
        dt[(t * nb + b) * kAmxRows + r] = dx[(t * kAmxRows + r) * nb + b];
        st[(t * nb + b) * kAmxRows + r] = sx[(t * kAmxRows + r) * nb + b];
      }
  amx_config();
  // pair p's B tiles from groups g, g + 1 (the second only if below c1); its column count
  auto pack = [&](int64_t p, int64_t g, int64_t c1) {
    const int ng = static_cast<int>(std::min<int64_t>(2, c1 - g));
    const uint8_t* blk[2];
    int nc[2];
    group_ptrs(w, g, ng, nb, BB, N, blk, nc);
    amx_pack_pair<KIND>(blk, ng, nb, wb(p), dw(p), mw(p));
    return nc[0] + (ng == 2 ? nc[1] : 0);
  };
  // (a chunk of one pair is the pair-outer order)
  for (int64_t c0 = g0; c0 < g1; c0 += 2 * chunk) {
    const int64_t c1 = std::min<int64_t>(g1, c0 + 2 * chunk);
    const int64_t np = (c1 - c0 + 1) / 2;
    for (int64_t p = 0; p < np; ++p) ncol[p] = pack(p, c0 + 2 * p, c1);
    // the next chunk's groups [c1, min(g1, c1 + 2 chunk)) are contiguous packed blocks
    const char* next = reinterpret_cast<const char*>(w + c1 * nb * BB);
    const int64_t lines = ((std::min<int64_t>(g1, c1 + 2 * chunk) - c1) * nb * BB + 63) / 64;
    const int64_t calls = M16 / kAmxRows * np;
    int64_t call = 0;
    for (int64_t m0 = 0; m0 < M16; m0 += kAmxRows)
      for (int64_t p = 0; p < np; ++p, ++call) {
        const int64_t l0 = lines * call / calls, l1 = lines * (call + 1) / calls;
        amx_tile<KIND>(xq + m0 * K, dt + m0 * nb, st + m0 * nb, K, nb, wb(p), dw(p), mw(p),
                       out + m0 * N + 8 * (c0 + 2 * p), N, ncol[p], PrefetchLines{next + 64 * l0, l1 - l0});
      }
  }
  _tile_release();
}
#else
bool amx_enabled() { return false; }
#endif

// ---------------------------------------------------------------- bfloat16

using fdx::bf16_bits;  // kernels.h: the rounding the packer uses too

// Row m of x rounded to bf16.  AVX2: as float32 values (the kernel
// broadcasts them); vdpbf16ps: as K/2 dwords of bf16 pairs (low = even k).
inline void round_row_bf16(const float* x, int64_t K, float* xr) {
#ifdef FDX_QGEMM_BF16DP
  uint32_t* xp = reinterpret_cast<uint32_t*>(xr);
  for (int64_t k = 0; k < K; k += 2) xp[k / 2] = bf16_bits(x[k]) | (bf16_bits(x[k + 1]) << 16);
#else
  for (int64_t k = 0; k < K; ++k) {
    const uint32_t u = bf16_bits(x[k]) << 16;
    std::memcpy(xr + k, &u, 4);
  }
#endif
}

constexpr int kBfRows = 6;  // bf16: rows per register tile (12 fp32 sums hide the fma latency)

// R rows x G groups of 8 columns over every input pair: out[r][8g + j].
// xr[r]: row r as round_row_bf16 left it; blk[g]: group g's packed pairs.
template <int R, int G>
void tile_bf16(const float* const* xr, const uint8_t* const* blk, int64_t npairs, float* const* out, const int* ncols) {
  __m256 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
#ifndef FDX_QGEMM_BF16DP
  const __m256i hi16 = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
#endif
  for (int64_t p = 0; p < npairs; ++p) {
    if ((p & 1) == 0)  // one line a group every two pairs: every line of the stream, whatever its alignment
      for (int g = 0; g < G; ++g) prefetch_ahead<64>(blk[g] + 32 * p);
#ifdef FDX_QGEMM_BF16DP
    __m256i wv[G];
    for (int g = 0; g < G; ++g) wv[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g] + 32 * p));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xr[r] + p, 4);
      const __m256bh xv = (__m256bh)_mm256_set1_epi32(pair);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm256_dpbf16_ps(acc[r][g], (__m256bh)wv[g], xv);
    }
#else
    // every lane's odd input, then every lane's even one: the per-lane
    // order above, with few live registers (the sums, a weight vector a
    // group, one broadcast)
    __m256 wf[G];
    for (int g = 0; g < G; ++g)
      wf[g] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g] + 32 * p)), hi16));
    for (int r = 0; r < R; ++r) {
      const __m256 xh = _mm256_broadcast_ss(xr[r] + 2 * p + 1);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm256_fmadd_ps(wf[g], xh, acc[r][g]);
    }
    for (int g = 0; g < G; ++g)
      wf[g] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g] + 32 * p)), 16));
    for (int r = 0; r < R; ++r) {
      const __m256 xl = _mm256_broadcast_ss(xr[r] + 2 * p);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm256_fmadd_ps(wf[g], xl, acc[r][g]);
    }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) store_cols(out[r] + 8 * g, acc[r][g], ncols[g]);
}

template <int G>
void tile_bf16_rows(int R, const float* const* xr, const uint8_t* const* blk, int64_t npairs, float* const* out,
                    const int* ncols) {
  switch (R) {
    case 1: tile_bf16<1, G>(xr, blk, npairs, out, ncols); break;
    case 2: tile_bf16<2, G>(xr, blk, npairs, out, ncols); break;
    case 3: tile_bf16<3, G>(xr, blk, npairs, out, ncols); break;
    case 4: tile_bf16<4, G>(xr, blk, npairs, out, ncols); break;
    case 5: tile_bf16<5, G>(xr, blk, npairs, out, ncols); break;
    default: tile_bf16<kBfRows, G>(xr, blk, npairs, out, ncols); break;
  }
}

// bf16: groups [g0, g1) of every row, in row blocks (activations in L2),
// cache tiles of groups (weights in L1) and register tiles of kBfRows x NG.
//   xr: the rounded rows, xs floats apart.
void gemm_range_bf16(const float* xr, int64_t xs, const uint8_t* w, float* out, int64_t M, int64_t K, int64_t N,
                     int64_t g0, int64_t g1) {
  const int64_t nb = K / 32, npairs = K / 2;
  const int64_t gtile = std::max<int64_t>(NG, 2 * kTileBytes / (nb * kBf16Bytes) / NG * NG);
  const int64_t rows = std::max<int64_t>(kBfRows, kRowBytes / (4 * xs) / kBfRows * kBfRows);
  for (int64_t mb = 0; mb < M; mb += rows) {
    const int64_t mb1 = std::min<int64_t>(M, mb + rows);
    for (int64_t gt = g0; gt < g1; gt += gtile) {
      const int64_t gt1 = std::min<int64_t>(g1, gt + gtile);
      for (int64_t m0 = mb; m0 < mb1; m0 += kBfRows) {
        const int R = static_cast<int>(std::min<int64_t>(kBfRows, mb1 - m0));
        const float* rr[kBfRows];
        float* orow[kBfRows];
        for (int r = 0; r < R; ++r) rr[r] = xr + (m0 + r) * xs;
        for (int64_t g = gt; g < gt1; g += NG) {
          const int ng = static_cast<int>(std::min<int64_t>(NG, gt1 - g));
          const uint8_t* blk[NG];
          int ncols[NG];
          group_ptrs(w, g, ng, nb, kBf16Bytes, N, blk, ncols);
          for (int r = 0; r < R; ++r) orow[r] = out + (m0 + r) * N + 8 * g;
          if (ng == NG) tile_bf16_rows<NG>(R, rr, blk, npairs, orow, ncols);
          else tile_bf16_rows<1>(R, rr, blk, npairs, orow, ncols);
        }
      }
    }
  }
}

// MXCSR's flush-to-zero and denormals-are-zero for the scope (vdpbf16ps
// behaves so whatever MXCSR says; the fma emulation needs them set).
struct FtzDaz {
  unsigned saved;
  FtzDaz() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~FtzDaz() { _mm_setcsr(saved); }
};

// Grown, never shrunk: the prepared activations of a call -- int8: the
// quantized rows, their scales and scaled sums (never zeroed); bf16: the
// rounded rows (K floats each, or K/2 dwords: K floats' room).
struct Scratch {
  std::unique_ptr<int8_t[]> xq;
  std::unique_ptr<float[]> dx, sx;
  std::vector<float> xr;
  int64_t nq = 0, ns = 0;
  void reserve(int64_t q, int64_t s) {
    if (q > nq) xq.reset(new int8_t[nq = q]);
    if (s > ns) {
      dx.reset(new float[s]);
      sx.reset(new float[s]);
      ns = s;
    }
  }
};

thread_local Scratch run_scratch;  // the calling thread's, whatever the kind (calls never overlap on a thread)

template <int KIND>
void run(const float* x, const uint8_t* w, float* out, int64_t M, int64_t K, int64_t N) {
  const int64_t nb = K / 32;
  const int64_t G = (N + 7) / 8;
  Scratch& scratch = run_scratch;
  if constexpr (KIND == 16) {
    if (static_cast<int64_t>(scratch.xr.size()) < M * K) scratch.xr.resize(M * K);
  } else {
    scratch.reserve(M * K, M * nb);
  }
  int8_t* xq = scratch.xq.get();
  float* dx = scratch.dx.get();
  float* sx = scratch.sx.get();
  float* xr = scratch.xr.data();
  // Every row is prepared alone (quantized, or rounded to bf16: the same
  // code whatever M is, by whichever thread): few rows here, before the
  // threads start; many in the same parallel region as the GEMM (one fork
  // instead of two).  Then threads own contiguous column-group ranges
  // (pairs of groups, so the register tiles stay full).
  auto prepare = [&](int64_t m) {
    if constexpr (KIND == 16) round_row_bf16(x + m * K, K, xr + m * K);
    else quantize_row(x + m * K, K, xq + m * K, dx + m * nb, sx + m * nb);
  };
  const bool par_prep = M * K >= (1 << 15);
  const bool use_amx = KIND != 16 && M >= 16 && amx_enabled();
  (void)use_amx;
  if (!par_prep)
    for (int64_t m = 0; m < M; ++m) prepare(m);
#pragma omp parallel if (G >= 16)
  {
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
    if (par_prep) {
      // contiguous rows, as the ops before split theirs (omp static): a
      // thread mostly reads rows it wrote itself, not the other core's
      for (int64_t m = M * tid / nth; m < M * (tid + 1) / nth; ++m) prepare(m);
      if (nth > 1) {
#pragma omp barrier
      }
    }
    const int64_t pairs = (G + NG - 1) / NG;
    const int64_t per = (pairs + nth - 1) / nth;
    const int64_t g0 = std::min<int64_t>(G, tid * per * NG), g1 = std::min<int64_t>(G, g0 + per * NG);
    if (g0 < g1) {
      if constexpr (KIND == 16) {
        FtzDaz ftz;
        gemm_range_bf16(xr, K, w, out, M, K, N, g0, g1);
      } else {
        // AMX: the full tiles of 16 rows; the vector tiles take the rest
        const int64_t m16 = use_amx ? M / 16 * 16 : 0;
#ifdef FDX_QGEMM_AMX
        if (m16 > 0) gemm_range_amx<KIND>(xq, dx, sx, w, out, m16, K, N, g0, g1);
#endif
        const int64_t mt = M - m16;
        const int8_t* xt = xq + m16 * K;
        const float *dt = dx + m16 * nb, *st = sx + m16 * nb;
        float* ot = out + m16 * N;
        if (mt > 0 && KIND == 4 && mt > 1) gemm_range<KIND>(xt, dt, st, w, ot, mt, K, N, g0, g1);
        else if (mt > 0) gemm_range_g1<KIND>(xt, dt, st, w, ot, mt, K, N, g0, g1);  // Q8_0, and 1 row (memory bound)
      }
    }
  }
}

}  // namespace

void fdx::qgemm(const float* x, const uint8_t* w, int kind, float* out, int64_t M, int64_t K, int64_t N) {
  if (M == 0) return;
  if (kind == 4) run<4>(x, w, out, M, K, N);
  else if (kind == 16) run<16>(x, w, out, M, K, N);
  else run<8>(x, w, out, M, K, N);
}

int64_t fdx::release_qgemm_scratch() {
  Scratch& r = run_scratch;
  int64_t bytes = r.nq + 2 * r.ns * static_cast<int64_t>(sizeof(float)) +
                  static_cast<int64_t>(r.xr.capacity() * sizeof(float));
  r = Scratch{};
#ifdef FDX_QGEMM_AMX
  AmxScratch& a = amx_scratch;
  bytes += static_cast<int64_t>(a.wbv.capacity() * sizeof(__m512i) + (a.sc.capacity() + a.rs.capacity()) * sizeof(float) +
                                a.ncol.capacity() * sizeof(int));
  a = AmxScratch{};
#endif
  return bytes;
}

void fdx::qgemm_kernels(int32_t* out) {
  out[0] = std::strcmp(kDot, "vnni") == 0 ? 1 : 0;
  out[1] = std::strcmp(kBf16Dot, "vdpbf16ps") == 0 ? 1 : 0;
  out[2] = amx_enabled() ? 1 : 0;
}
