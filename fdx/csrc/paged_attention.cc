// fdx CPU custom op: RoPE + paged KV-cache write + causal paged attention.
//
// One call per layer replaces ~15 eager Paddle ops.  Layout contract (kept
// in sync with fdx/model/native.py and fdx/model/llama.py):
//   qkv       [T, (H + 2*KV) * D] float32   fused q/k/v projections (bias added)
//   kv_cache  [2, NB, KV, BS, D]  float32   K at [0], V at [1]; WRITTEN IN PLACE
//   rope      [P, D]              float32   cos in [:, :D/2], sin in [:, D/2:]
//   meta      [T, 2]              int32     (sequence index, position) per token
//   tables    [S, MAXB]           int32     block table per sequence
// Output      [T, H * D]          float32
// Token t of sequence s at position p attends to keys 0..p of s, which are
// read ONLY through tables[s] (slot = tables[s][j / BS] * BS + j % BS).
// K/V of every token in the call are written before any attention is read,
// so chunks of several new tokens per sequence (prefill) work.
// RoPE is NEOX "rotate_half" style (Hugging Face q/k order).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <omp.h>

#include "kernels.h"
#include "paddle/extension.h"
#include "simd_math.h"

namespace {

inline void rope_rotate(const float* x, float* y, const float* cs, int half) {
  const float* c = cs;
  const float* s = cs + half;
#pragma omp simd
  for (int i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    y[i] = x1 * c[i] - x2 * s[i];
    y[i + half] = x2 * c[i] + x1 * s[i];
  }
}

// In-place softmax of r[0..n).
inline void softmax(float* r, int n) {
  namespace v = fdx::simd;
  constexpr int L = v::kLanes;
  v::vf vmx = v::set1(-INFINITY);
  int j = 0;
  for (; j + L <= n; j += L) vmx = v::max(vmx, v::load(r + j));
  float mx = v::reduce_max(vmx);
  for (int k = j; k < n; ++k) mx = std::max(mx, r[k]);
  const v::vf m = v::set1(mx);
  v::vf vs = v::zero();
  for (j = 0; j + L <= n; j += L) {
    const v::vf e = v::exp(v::sub(v::load(r + j), m));
    v::store(r + j, e);
    vs = v::add(vs, e);
  }
  if (j < n) {
    const v::vf e = v::keep_first(v::exp(v::sub(v::load_first(r + j, n - j), m)), n - j);
    v::store_first(r + j, e, n - j);
    vs = v::add(vs, e);
  }
  const float inv = 1.f / v::reduce_add(vs);
  const v::vf vinv = v::set1(inv);
  for (j = 0; j + L <= n; j += L) v::store(r + j, v::mul(v::load(r + j), vinv));
  for (; j < n; ++j) r[j] *= inv;
}

inline float dot(const float* a, const float* b, int n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace

void fdx::check_attention_meta(const AttnShape& sh, const int* mt, const int* bt) {
  for (int64_t t = 0; t < sh.T; ++t) {
    const int s = mt[2 * t], p = mt[2 * t + 1];
    PD_CHECK(s >= 0 && s < sh.S, "token sequence index out of range");
    PD_CHECK(p >= 0 && p < sh.P, "position out of range of the RoPE table");
    PD_CHECK(p / sh.BS < sh.MAXB, "position beyond the block table");
    for (int64_t j = 0; j <= p / sh.BS; ++j) {
      const int b = bt[s * sh.MAXB + j];
      PD_CHECK(b >= 0 && b < sh.NB, "block id out of range");
    }
  }
}

void fdx::paged_attention(const AttnShape& sh, const float* x, float* kc, const float* rp, const int* mt,
                          const int* bt, float* o) {
  const int64_t T = sh.T, MAXB = sh.MAXB;
  const int H = sh.H, KV = sh.KV, D = sh.D, BS = sh.BS, G = H / KV, half = D / 2;
  const float scale = sh.scale;
  const int64_t W = (int64_t)(H + 2 * KV) * D;
  float* vc = kc + (size_t)sh.NB * KV * BS * D;
  // phase 1: rotate q into the output buffer (reused as scratch), rotate k,
  // write k and v into their cache slots.
  std::vector<float> q((size_t)T * H * D);
  for (int64_t t = 0; t < T; ++t) {
    const int s = mt[2 * t], p = mt[2 * t + 1];
    const float* cs = rp + (size_t)p * D;
    const float* xt = x + t * W;
    for (int h = 0; h < H; ++h) rope_rotate(xt + h * D, q.data() + ((size_t)t * H + h) * D, cs, half);
    const int blk = bt[s * MAXB + p / BS];
    const int off = p % BS;
    for (int kh = 0; kh < KV; ++kh) {
      const size_t slot = (((size_t)blk * KV + kh) * BS + off) * D;
      rope_rotate(xt + (size_t)(H + kh) * D, kc + slot, cs, half);
      std::memcpy(vc + slot, xt + (size_t)(H + KV + kh) * D, sizeof(float) * D);
    }
  }

  // phase 2: attention per (token, kv head); the G query heads of a group
  // share each key/value load.
  // Work is split by hand (no "omp for"): only GOMP_parallel and
  // omp_get_thread_num/num_threads are used, which Paddle's libiomp5 (the
  // runtime this op links against, shared with MKL) implements.
  const int64_t items = T * KV;
#pragma omp parallel if (items >= 8)
  {
    std::vector<float> sc;
    const int nth = omp_get_num_threads();
    const int tid = omp_get_thread_num();
    for (int64_t it = tid; it < items; it += nth) {
      const int64_t t = it / KV;
      const int kh = static_cast<int>(it % KV);
      const int s = mt[2 * t], p = mt[2 * t + 1];
      const int n = p + 1;
      sc.resize((size_t)G * n);
      const float* qg = q.data() + ((size_t)t * H + (size_t)kh * G) * D;
      const int* tb = bt + s * MAXB;
      // scores
      for (int j0 = 0; j0 < n; j0 += BS) {
        const float* kb = kc + (((size_t)tb[j0 / BS] * KV + kh) * BS) * D;
        const int m = std::min(BS, n - j0);
        for (int jj = 0; jj < m; ++jj) {
          const float* kp = kb + (size_t)jj * D;
          for (int g = 0; g < G; ++g) sc[(size_t)g * n + j0 + jj] = dot(qg + (size_t)g * D, kp, D) * scale;
        }
      }
      // softmax per head
      for (int g = 0; g < G; ++g) softmax(sc.data() + (size_t)g * n, n);
      // weighted values
      float* og = o + ((size_t)t * H + (size_t)kh * G) * D;
      std::memset(og, 0, sizeof(float) * G * D);
      for (int j0 = 0; j0 < n; j0 += BS) {
        const float* vb = vc + (((size_t)tb[j0 / BS] * KV + kh) * BS) * D;
        const int m = std::min(BS, n - j0);
        for (int jj = 0; jj < m; ++jj) {
          const float* vp = vb + (size_t)jj * D;
          for (int g = 0; g < G; ++g) axpy(sc[(size_t)g * n + j0 + jj], vp, og + (size_t)g * D, D);
        }
      }
    }
  }
}

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& qkv, const paddle::Tensor& kv_cache,
                                           const paddle::Tensor& rope, const paddle::Tensor& meta,
                                           const paddle::Tensor& tables, int num_heads, int num_kv_heads,
                                           int block_size, float scale) {
  PD_CHECK(qkv.dtype() == paddle::DataType::FLOAT32, "qkv must be float32");
  PD_CHECK(kv_cache.dtype() == paddle::DataType::FLOAT32, "kv_cache must be float32");
  PD_CHECK(meta.dtype() == paddle::DataType::INT32 && tables.dtype() == paddle::DataType::INT32,
           "meta/tables must be int32");
  PD_CHECK(kv_cache.shape().size() == 5, "kv_cache must be [2, NB, KV, BS, D]");
  fdx::AttnShape sh{qkv.shape()[0], num_heads, num_kv_heads, static_cast<int>(kv_cache.shape()[4]), block_size,
                    kv_cache.shape()[1], tables.shape()[0], tables.shape()[1], rope.shape()[0], scale};
  PD_CHECK(kv_cache.shape()[2] == sh.KV && kv_cache.shape()[3] == sh.BS, "kv_cache geometry mismatch");
  PD_CHECK(qkv.shape()[1] == (int64_t)(sh.H + 2 * sh.KV) * sh.D, "qkv width mismatch");
  PD_CHECK(sh.H % sh.KV == 0, "num_heads must be a multiple of num_kv_heads");
  PD_CHECK(rope.shape()[1] == sh.D, "rope width mismatch");
  // validate metadata once (never touch memory outside the cache)
  fdx::check_attention_meta(sh, meta.data<int>(), tables.data<int>());
  auto out = paddle::empty({sh.T, (int64_t)sh.H * sh.D}, paddle::DataType::FLOAT32, qkv.place());
  fdx::paged_attention(sh, qkv.data<float>(), const_cast<float*>(kv_cache.data<float>()), rope.data<float>(),
                       meta.data<int>(), tables.data<int>(), out.data<float>());
  return {out};
}

std::vector<std::vector<int64_t>> PagedAttentionInferShape(const std::vector<int64_t>& qkv,
                                                           const std::vector<int64_t>& kv_cache,
                                                           const std::vector<int64_t>& rope,
                                                           const std::vector<int64_t>& meta,
                                                           const std::vector<int64_t>& tables, int num_heads,
                                                           int num_kv_heads, int block_size, float scale) {
  return {{qkv[0], (int64_t)num_heads * kv_cache[4]}};
}

std::vector<paddle::DataType> PagedAttentionInferDtype(const paddle::DataType& qkv, const paddle::DataType& kv_cache,
                                                       const paddle::DataType& rope, const paddle::DataType& meta,
                                                       const paddle::DataType& tables) {
  return {qkv};
}

PD_BUILD_OP(fdx_paged_attention)
    .Inputs({"qkv", "kv_cache", "rope", "meta", "tables"})
    .Outputs({"out"})
    .Attrs({"num_heads: int", "num_kv_heads: int", "block_size: int", "scale: float"})
    .SetKernelFn(PD_KERNEL(PagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionInferDtype));
