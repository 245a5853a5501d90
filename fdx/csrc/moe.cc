// fdx CPU custom op: a mixture-of-experts MLP block (Qwen3-MoE, Mixtral) in one call.
//
//   fdx_moe(h [T, H], router, gate_up[n], down[n], kind, num_experts, top_k, renormalize, first)
//       -> out [T, H] float32, ids [T, top_k] int32 (every token's picked experts, global ids)
//
// One call does what fdx/model/moe.py's Python path does with ~10 ops and a
// loop over the experts:
//   logits = h @ router                        [T, E]   (the router GEMM, float32 in every mode)
//   p = softmax(logits) per row; the top_k (highest first, the lower id on a tie)
//   renormalize: w_j = p_j / (p_0 + p_1 + ...), summed in slot order; else w_j = p_j
//   the (token, slot) pairs grouped by expert (a stable counting sort: token order
//   within an expert), and for each expert this rank holds, over all its rows at once:
//       y = swiglu(x @ gate_up_e) @ down_e     (two GEMMs, no per-token loop)
//   out[t] = w_0 y_0 + w_1 y_1 + ...  in slot order; a pair whose expert another
//       rank holds (expert parallelism) adds 0 -- out is then this rank's partial
//       sum, which the layer's all-reduce completes, as in the Python path.
//
// kind: the experts' weights' kind.  8 (Q8_0) or 4 (Q4_0/Q4_1): int8, 16:
// bfloat16 -- packed by fdx/model/packed_weights.py, every expert GEMM is
// fdx::qgemm (qgemm.cc: its activation quantization / bf16 rounding and its
// dot products, called, not re-implemented here), so the experts' rows are
// the existing int8 / bf16 path's bits.  0: float32 weights, [K, N]
// row-major (gate_up [H, 2F], down [F, H]), and the GEMM is fgemm below.
// The router is float32 [H, E] in every mode, its GEMM fgemm (as vLLM and
// FastDeploy keep the gate unquantized): a quantized router's error flips
// near-tied expert choices, and a flipped expert changes the token's whole
// MLP output (on the random Qwen3-MoE an int8 router moved logits by up to
// 1.9).  It is E columns, a small share of the block's work.  The experts' widths come from the weights (a Megatron slice
// of every expert under tensor parallelism works as is); ``first`` is the
// global id of gate_up[0] (expert parallelism: this rank holds experts
// [first, first + n)).
//
// BATCH INVARIANCE.  A token's output depends on its own row only: the
// routing is per row; qgemm's and fgemm's output rows each depend on their
// own input row only, with a fixed per-element sequence whatever the row
// count (qgemm.cc's BATCH INVARIANCE note; fgemm: one fma chain over k in
// order per element); swiglu and the weighted sum are element-wise.  So the
// bits of a token are the same alone, in any batch, and with any thread
// count -- float32 included (Paddle's MKL matmul is not: its result for a
// row changes with the row count).
//
// SAME BITS ON EVERY KERNEL SET.  The routing is scalar code (exp_scalar:
// simd_math.h's exp, one lane; sums in index order; IEEE divisions, never a
// reciprocal multiply), fgemm's lanes are independent chains (the lane count
// only picks which columns share a loop), and qgemm / swiglu already give
// the same bits with both sets: the avx2 and avx512 builds give identical
// outputs (tests/test_isa_bits.py), equal to the numpy reference of
// tests/test_moe_op.py and to the scalar C++ of tests/csrc/scalar_reference.cc.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd_math.h"

namespace {

namespace v = fdx::simd;

// a / b, one IEEE division: the opaque divisor keeps -freciprocal-math from
// turning several divisions by one value into multiplies by its reciprocal.
inline float div_ieee(float a, float b) {
  asm volatile("" : "+x"(b));
  return a / b;
}

// simd_math.h's exp for one lane: the same operations (fnmadd(n, c, x) is
// fma(-n, c, x); 2^n is exact for the clamped range, n in [-126, 127]).
inline float exp_scalar(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-n, 0.693145751953125f, x);
  r = std::fma(-n, 1.428606765330187045e-06f, r);
  float p = 1.f / 5040.f;
  p = std::fma(p, r, 1.f / 720.f);
  p = std::fma(p, r, 1.f / 120.f);
  p = std::fma(p, r, 1.f / 24.f);
  p = std::fma(p, r, 1.f / 6.f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.f);
  p = std::fma(p, r, 1.f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// One token's routing: logits z [E] -> ids[k] (highest probability first,
// the lower id on a tie) and their weights w[k].  e: scratch of E floats.
void route(const float* z, int E, int k, bool renormalize, float* e, int32_t* ids, float* w) {
  float m = z[0];
  for (int i = 1; i < E; ++i) m = std::max(m, z[i]);
  float s = 0.f;
  for (int i = 0; i < E; ++i) {
    e[i] = exp_scalar(z[i] - m);
    s = s + e[i];
  }
  for (int i = 0; i < E; ++i) e[i] = div_ieee(e[i], s);  // the softmax
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int i = 0; i < E; ++i) {
      bool taken = false;
      for (int q = 0; q < j; ++q) taken = taken || ids[q] == i;
      if (!taken && (best < 0 || e[i] > e[best])) best = i;
    }
    ids[j] = best;
    w[j] = e[best];
  }
  if (renormalize) {
    float total = w[0];
    for (int j = 1; j < k; ++j) total = total + w[j];
    for (int j = 0; j < k; ++j) w[j] = div_ieee(w[j], total);
  }
}

// ---------------------------------------------------------------- float32 GEMM

constexpr int kFR = 6;  // rows per register tile (12 sums + 2 weight vectors + a broadcast: AVX2's 16 registers)
constexpr int kFG = 2;  // column vectors per register tile
constexpr int kStripRows = 4;      // at most this many rows: the strip kernel (few rows: memory bound)
constexpr int64_t kStrip = 512;    // columns of a strip (its sums stay in L1, its weights stream by rows)

// R rows x G column vectors from column n0: out[r][n] = fma chain over k in
// order (acc = fma(x[r][k], w[k][n], acc) from 0); the last vector holds
// `last` (1..kLanes) columns.
template <int R, int G>
void ftile(const float* const* xr, const float* w, int64_t K, int64_t N, int64_t n0, int last, float* const* orow) {
  constexpr int L = v::kLanes;
  v::vf acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = v::zero();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * N + n0;
    v::vf wv[G];
    for (int g = 0; g < G; ++g) wv[g] = g == G - 1 && last < L ? v::load_first(wk + g * L, last) : v::load(wk + g * L);
    for (int r = 0; r < R; ++r) {
      const v::vf xb = v::set1(xr[r][k]);
      for (int g = 0; g < G; ++g) acc[r][g] = v::fmadd(xb, wv[g], acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      if (g == G - 1 && last < L) v::store_first(orow[r] + n0 + g * L, acc[r][g], last);
      else v::store(orow[r] + n0 + g * L, acc[r][g]);
    }
}

// Few rows: the sums of R rows x `cols` columns from n0 live in the output
// rows (L1) while the weights stream one contiguous row segment per k; each
// element the same chain, acc = fma(x[r][k], w[k][n], acc) from 0.
void fstrip(int R, const float* const* xr, const float* w, int64_t K, int64_t N, int64_t n0, int64_t cols,
            float* const* orow) {
  constexpr int L = v::kLanes;
  for (int r = 0; r < R; ++r) std::fill(orow[r] + n0, orow[r] + n0 + cols, 0.f);
  const int64_t full = cols / L * L;
  const int tail = static_cast<int>(cols - full);
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * N + n0;
    v::vf xb[kStripRows];
    for (int r = 0; r < R; ++r) xb[r] = v::set1(xr[r][k]);
    for (int64_t c = 0; c < full; c += L) {
      const v::vf wv = v::load(wk + c);
      for (int r = 0; r < R; ++r) {
        float* o = orow[r] + n0 + c;
        v::store(o, v::fmadd(xb[r], wv, v::load(o)));
      }
    }
    if (tail) {
      const v::vf wv = v::load_first(wk + full, tail);
      for (int r = 0; r < R; ++r) {
        float* o = orow[r] + n0 + full;
        v::store_first(o, v::fmadd(xb[r], wv, v::load_first(o, tail)), tail);
      }
    }
  }
}

template <int G>
void ftile_rows(int R, const float* const* xr, const float* w, int64_t K, int64_t N, int64_t n0, int last,
                float* const* orow) {
  switch (R) {
    case 1: ftile<1, G>(xr, w, K, N, n0, last, orow); break;
    case 2: ftile<2, G>(xr, w, K, N, n0, last, orow); break;
    case 3: ftile<3, G>(xr, w, K, N, n0, last, orow); break;
    case 4: ftile<4, G>(xr, w, K, N, n0, last, orow); break;
    case 5: ftile<5, G>(xr, w, K, N, n0, last, orow); break;
    default: ftile<kFR, G>(xr, w, K, N, n0, last, orow); break;
  }
}

}  // namespace

// out[M, N] = x[M, K] @ w[K, N], float32; element (m, n) is the fma chain over
// k in order, whatever M, the thread count or the kernel set (threads split
// the columns).
void fdx::fgemm(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N) {
  constexpr int L = v::kLanes;
  if (M <= kStripRows) {
    const int64_t strips = (N + kStrip - 1) / kStrip;
    const float* xr[kStripRows];
    float* orow[kStripRows];
    for (int r = 0; r < M; ++r) {
      xr[r] = x + r * K;
      orow[r] = out + r * N;
    }
#pragma omp parallel for schedule(static) if (K * N >= (1 << 20) && strips >= 2)
    for (int64_t t = 0; t < strips; ++t)
      fstrip(static_cast<int>(M), xr, w, K, N, t * kStrip, std::min<int64_t>(kStrip, N - t * kStrip), orow);
    return;
  }
  const int64_t nvec = (N + L - 1) / L, tiles = (nvec + kFG - 1) / kFG;
#pragma omp parallel for schedule(static) if (M * K * N >= (1 << 21) && tiles >= 2)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * kFG * L;
    const int64_t cols = std::min<int64_t>(kFG * L, N - n0);
    const int G = static_cast<int>((cols + L - 1) / L);
    const int last = static_cast<int>(cols - (G - 1) * L);
    for (int64_t m0 = 0; m0 < M; m0 += kFR) {
      const int R = static_cast<int>(std::min<int64_t>(kFR, M - m0));
      const float* xr[kFR];
      float* orow[kFR];
      for (int r = 0; r < R; ++r) {
        xr[r] = x + (m0 + r) * K;
        orow[r] = out + (m0 + r) * N;
      }
      if (G == kFG) ftile_rows<kFG>(R, xr, w, K, N, n0, last, orow);
      else ftile_rows<1>(R, xr, w, K, N, n0, last, orow);
    }
  }
}

namespace {

// x [M, K] @ w -> [M, N]: fgemm for float32 ([K, N]), qgemm for the packed kinds
inline void gemm(int kind, const float* x, const void* w, float* out, int64_t M, int64_t K, int64_t N) {
  if (M == 0) return;
  if (kind == 0) fdx::fgemm(x, static_cast<const float*>(w), out, M, K, N);
  else fdx::qgemm(x, static_cast<const uint8_t*>(w), kind, out, M, K, N);
}

// Grown, never shrunk (a step's buffers, reused by the next).
struct MoeScratch {
  std::vector<float> logits, probs, wts, xs, gu, act, ye, y;
  std::vector<int64_t> offs, order;
};

thread_local MoeScratch moe_scratch;  // the calling thread's, between calls (fdx::release_moe_scratch)

template <typename V>
inline auto* grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

}  // namespace

int64_t fdx::release_moe_scratch() {
  MoeScratch& s = moe_scratch;
  int64_t bytes = 0;
  for (auto* v : {&s.logits, &s.probs, &s.wts, &s.xs, &s.gu, &s.act, &s.ye, &s.y})
    bytes += static_cast<int64_t>(v->capacity() * sizeof(float));
  bytes += static_cast<int64_t>((s.offs.capacity() + s.order.capacity()) * sizeof(int64_t));
  s = MoeScratch{};
  return bytes;
}

void fdx::moe(const MoeDims& sh, const float* hp, const float* router, const void* const* gate_up,
              const void* const* down, float* op, int32_t* ids) {
  const int64_t T = sh.T, H = sh.H, F = sh.F, F2 = 2 * sh.F, n_held = sh.n_held;
  const int E = sh.E, k = sh.k, first = sh.first, kind = sh.kind;
  if (T == 0) return;
  MoeScratch& s = moe_scratch;
  const int64_t P = T * k;  // (token, slot) pairs: pair t * k + j

  float* logits = grow(s.logits, T * E);
  gemm(0, hp, router, logits, T, H, E);
  float* probs = grow(s.probs, E);
  float* wts = grow(s.wts, P);
  for (int64_t t = 0; t < T; ++t) route(logits + t * E, E, k, sh.renormalize, probs, ids + t * k, wts + t * k);

  // group the pairs by held expert: a stable counting sort (token order within an expert)
  int64_t* offs = grow(s.offs, n_held + 1);
  std::fill(offs, offs + n_held + 1, 0);
  int64_t* order = grow(s.order, P);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t le = ids[p] - first;
    if (le >= 0 && le < n_held) ++offs[le + 1];
  }
  int64_t maxn = 0;
  for (int64_t e = 0; e < n_held; ++e) {
    maxn = std::max(maxn, offs[e + 1]);
    offs[e + 1] += offs[e];
  }
  {
    std::vector<int64_t> fill(offs, offs + n_held);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t le = ids[p] - first;
      if (le >= 0 && le < n_held) order[fill[le]++] = p;
    }
  }
  float* xs = grow(s.xs, maxn * H);
  float* gu = grow(s.gu, maxn * F2);
  float* act = grow(s.act, maxn * F);
  float* ye = grow(s.ye, maxn * H);
  float* y = grow(s.y, P * H);  // each held pair's expert output, in pair order
  for (int64_t e = 0; e < n_held; ++e) {
    const int64_t n = offs[e + 1] - offs[e];
    if (n == 0) continue;
    const int64_t* rows = order + offs[e];
    for (int64_t i = 0; i < n; ++i) std::memcpy(xs + i * H, hp + (rows[i] / k) * H, sizeof(float) * H);
    gemm(kind, xs, gate_up[e], gu, n, H, F2);
    fdx::swiglu(gu, n, F, act);
    gemm(kind, act, down[e], ye, n, F, H);
    for (int64_t i = 0; i < n; ++i) std::memcpy(y + rows[i] * H, ye + i * H, sizeof(float) * H);
  }
  // out[t] = term_0 + term_1 + ... in slot order; term_j = w_j * y_j, or 0 for another rank's expert
  for (int64_t t = 0; t < T; ++t) {
    float* o = op + t * H;
    for (int j = 0; j < k; ++j) {
      const int64_t p = t * k + j, le = ids[p] - first;
      const bool held = le >= 0 && le < n_held;
      const float wj = wts[p];
      const float* yp = y + p * H;
      if (j == 0) {
        if (held) for (int64_t i = 0; i < H; ++i) o[i] = yp[i] * wj;
        else std::fill(o, o + H, 0.f);
      } else if (held) {
        for (int64_t i = 0; i < H; ++i) o[i] = o[i] + yp[i] * wj;
      }
    }
  }
}
