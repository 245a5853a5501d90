// Plain scalar C++ of the canonical order of fdx's fp32 CPU kernels
// (fdx/csrc/simd_math.h "the canonical order of every floating-point
// reduction"): one float at a time, no SIMD, no kernel set.  Built by
// tests/test_scalar_reference.py with the very flags of the ops
// (fdx/model/native.py: -ffp-contract=off and -fno-associative-math, so
// every operation below is one IEEE operation, and std::fma is one fma),
// and compared bit for bit with the loaded kernel set.  On a CPU with only
// the AVX2 set this is what stands for the AVX-512 set: both must equal it.
//
//   fdx_ref_add_rms_norm(x, residual or [0], weight, eps) -> out, residual_out
//   fdx_ref_swiglu(x [T, 2F]) -> out [T, F]
//   fdx_ref_paged_attention(qkv, kv_cache, rope, meta, tables, H, KV, BS, scale, window) -> out
//       (kv_cache written in place, as fdx_paged_attention)
//   fdx_ref_qgemv(x, w, qtype) -> out
//   fdx_ref_fgemm(x [M, K], w [K, N]) -> out (fdx_fgemm: one fma chain over k per element)
//   fdx_ref_moe(h, router, gate_up, down, num_experts, top_k, renormalize, first) -> out, ids
//       (fdx_moe in float32, every (token, slot) pair's expert computed alone)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/extension.h"

namespace {

// The 16 lanes' fixed tree: f_i = l_i + l_{i+8}, then
// ((f0 + f4) + (f2 + f6)) + ((f1 + f5) + (f3 + f7)).
float tree16(const float* l) {
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = l[i] + l[i + 8];
  return ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7]));
}

// simd_math.h's exp, one lane.
float exp_lane(float x) {
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
  return std::ldexp(p, static_cast<int>(n));
}

float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (h >> 15) & 1u, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  float v;
  if (e == 0) v = std::ldexp(static_cast<float>(m), -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp(static_cast<float>(m | 0x400u), static_cast<int>(e) - 25);
  return sign ? -v : v;
}

}  // namespace

std::vector<paddle::Tensor> RefAddRmsNorm(const paddle::Tensor& x, const paddle::Tensor& residual,
                                          const paddle::Tensor& weight, float eps) {
  const int64_t T = x.shape()[0], H = x.shape()[1];
  const bool has_res = residual.numel() > 0;
  auto out = paddle::empty({T, H}, paddle::DataType::FLOAT32, x.place());
  auto res_out = paddle::empty({T, H}, paddle::DataType::FLOAT32, x.place());
  const float* xp = x.data<float>();
  const float* rp = has_res ? residual.data<float>() : nullptr;
  const float* wp = weight.data<float>();
  float* op = out.data<float>();
  float* ro = res_out.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    float lane[16] = {};
    for (int64_t i = 0; i < H; ++i) {
      const float v = rp ? xp[t * H + i] + rp[t * H + i] : xp[t * H + i];
      ro[t * H + i] = v;
      lane[i % 16] = std::fma(v, v, lane[i % 16]);
    }
    const float inv = 1.f / std::sqrt(tree16(lane) / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) op[t * H + i] = (ro[t * H + i] * inv) * wp[i];
  }
  return {out, res_out};
}

std::vector<paddle::Tensor> RefSwiglu(const paddle::Tensor& x) {
  const int64_t T = x.shape()[0], F = x.shape()[1] / 2;
  auto out = paddle::empty({T, F}, paddle::DataType::FLOAT32, x.place());
  const float* xp = x.data<float>();
  float* op = out.data<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < F; ++i) {
      const float g = xp[t * 2 * F + i], u = xp[t * 2 * F + F + i];
      op[t * F + i] = (g / (1.f + exp_lane(0.f - g))) * u;
    }
  return {out};
}

std::vector<paddle::Tensor> RefPagedAttention(const paddle::Tensor& qkv, const paddle::Tensor& kv_cache,
                                              const paddle::Tensor& rope, const paddle::Tensor& meta,
                                              const paddle::Tensor& tables, int H, int KV, int BS, float scale,
                                              int window) {
  const int64_t T = qkv.shape()[0], NB = kv_cache.shape()[1], MAXB = tables.shape()[1];
  const int D = static_cast<int>(kv_cache.shape()[4]), half = D / 2, G = H / KV;
  const int64_t W = (int64_t)(H + 2 * KV) * D;
  const float* x = qkv.data<float>();
  float* kc = const_cast<float*>(kv_cache.data<float>());
  float* vc = kc + NB * KV * BS * D;
  const float* rp = rope.data<float>();
  const int* mt = meta.data<int>();
  const int* tb = tables.data<int>();
  auto out = paddle::empty({T, (int64_t)H * D}, paddle::DataType::FLOAT32, qkv.place());
  float* o = out.data<float>();
  // RoPE: y1 = x1 c - x2 s (an fma of a rounded product), y2 = x2 c + x1 s
  auto rotate = [&](const float* src, float* dst, const float* cs) {
    for (int i = 0; i < half; ++i) {
      const float x1 = src[i], x2 = src[half + i], c = cs[i], s = cs[half + i];
      const float a = x2 * s, b = x1 * s;
      dst[i] = std::fma(x1, c, -a);
      dst[half + i] = std::fma(x2, c, b);
    }
  };
  auto slot = [&](int s, int p, int kh) {
    return (((int64_t)tb[s * MAXB + p / BS] * KV + kh) * BS + p % BS) * D;
  };
  // key j's dim d: K blocks are dim-major (paged_attention.cc, KEY BLOCKS), V blocks key-major
  auto key = [&](int s, int j, int kh, int d) -> float& {
    return kc[((int64_t)tb[s * MAXB + j / BS] * KV + kh) * BS * D + (int64_t)d * BS + j % BS];
  };
  std::vector<float> kr(D);
  for (int64_t t = 0; t < T; ++t) {  // every token's k and v first
    const int s = mt[2 * t], p = mt[2 * t + 1];
    for (int kh = 0; kh < KV; ++kh) {
      rotate(x + t * W + (int64_t)(H + kh) * D, kr.data(), rp + (int64_t)p * D);
      for (int d = 0; d < D; ++d) key(s, p, kh, d) = kr[d];
      std::memcpy(vc + slot(s, p, kh), x + t * W + (int64_t)(H + KV + kh) * D, sizeof(float) * D);
    }
  }
  std::vector<float> q(D), w, acc(D);
  for (int64_t t = 0; t < T; ++t) {
    const int s = mt[2 * t], p = mt[2 * t + 1];
    const int lo = window > 0 ? std::max(0, p + 1 - window) : 0;  // keys p - window < j <= p
    w.resize(p + 1);
    for (int h = 0; h < H; ++h) {
      const int kh = h / G;
      rotate(x + t * W + (int64_t)h * D, q.data(), rp + (int64_t)p * D);
      float mx = -INFINITY;
      for (int j = lo; j <= p; ++j) {  // one fma chain over d a key
        float dot = 0.f;
        for (int d = 0; d < D; ++d) dot = std::fma(q[d], key(s, j, kh, d), dot);
        w[j] = dot * scale;
        mx = std::max(mx, w[j]);
      }
      float lane[16] = {};
      for (int j = lo; j <= p; ++j) {
        w[j] = exp_lane(w[j] - mx);
        lane[(j - lo) % 16] = lane[(j - lo) % 16] + w[j];
      }
      const float inv = 1.f / tree16(lane);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int j = lo; j <= p; ++j) {
        const float wj = w[j] * inv;
        const float* v = vc + slot(s, j, kh);
        for (int d = 0; d < D; ++d) acc[d] = std::fma(wj, v[d], acc[d]);
      }
      std::memcpy(o + (t * H + h) * D, acc.data(), sizeof(float) * D);
    }
  }
  return {out};
}

std::vector<paddle::Tensor> RefQGemv(const paddle::Tensor& x, const paddle::Tensor& w, int qtype) {
  const int64_t M = x.shape()[0], K = x.shape()[1], N = w.shape()[0], nb = K / 32, rb = w.shape()[1];
  const int BB = qtype == 2 ? 18 : qtype == 3 ? 20 : 34;
  auto out = paddle::empty({M, N}, paddle::DataType::FLOAT32, x.place());
  const float* xp = x.data<float>();
  const uint8_t* wp = w.data<uint8_t>();
  float* op = out.data<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = 0; n < N; ++n) {
      float acc[16] = {}, macc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wp + n * rb + b * BB;
        const float* xb = xp + r * K + b * 32;
        const float d = half_to_float(blk);
        float q[32], m = 0.f;
        if (qtype == 8) {
          for (int i = 0; i < 32; ++i) q[i] = static_cast<float>(reinterpret_cast<const int8_t*>(blk + 2)[i]);
        } else {
          const uint8_t* nib = blk + (qtype == 3 ? 4 : 2);
          for (int i = 0; i < 16; ++i) {
            q[i] = static_cast<float>(nib[i] & 0x0F);
            q[i + 16] = static_cast<float>(nib[i] >> 4);
          }
          m = qtype == 3 ? half_to_float(blk + 2) : -8.f * d;
        }
        float xs[16];
        for (int i = 0; i < 16; ++i) {
          const float s = std::fma(q[i + 16], xb[i + 16], q[i] * xb[i]);
          acc[i] = std::fma(s, d, acc[i]);
          xs[i] = xb[i] + xb[i + 16];
        }
        if (qtype != 8) macc = std::fma(m, tree16(xs), macc);
      }
      op[r * N + n] = tree16(acc) + macc;
    }
  return {out};
}

namespace {

// a / b, one IEEE division (-freciprocal-math may not share a reciprocal)
float div_ieee(float a, float b) {
  asm volatile("" : "+x"(b));
  return a / b;
}

// row x [K] @ w [K, N] -> o [N]: acc = fma(x[k], w[k][n], acc) over k in order
void fgemm_row(const float* x, const float* w, int64_t K, int64_t N, float* o) {
  for (int64_t n = 0; n < N; ++n) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc = std::fma(x[k], w[k * N + n], acc);
    o[n] = acc;
  }
}

}  // namespace

std::vector<paddle::Tensor> RefFGemm(const paddle::Tensor& x, const paddle::Tensor& w) {
  const int64_t M = x.shape()[0], K = x.shape()[1], N = w.shape()[1];
  auto out = paddle::empty({M, N}, paddle::DataType::FLOAT32, x.place());
  for (int64_t m = 0; m < M; ++m) fgemm_row(x.data<float>() + m * K, w.data<float>(), K, N, out.data<float>() + m * N);
  return {out};
}

std::vector<paddle::Tensor> RefMoe(const paddle::Tensor& h, const paddle::Tensor& router,
                                   const std::vector<paddle::Tensor>& gate_up, const std::vector<paddle::Tensor>& down,
                                   int num_experts, int top_k, bool renormalize, int first) {
  const int64_t T = h.shape()[0], H = h.shape()[1], F2 = gate_up[0].shape()[1], F = F2 / 2;
  const int E = num_experts, k = top_k, n_held = static_cast<int>(gate_up.size());
  auto out = paddle::empty({T, H}, paddle::DataType::FLOAT32, h.place());
  auto ids_t = paddle::empty({T, static_cast<int64_t>(k)}, paddle::DataType::INT32, h.place());
  std::vector<float> z(E), p(E), w(k), gu(F2), act(F), y(H);
  for (int64_t t = 0; t < T; ++t) {
    const float* x = h.data<float>() + t * H;
    int32_t* ids = ids_t.data<int32_t>() + t * k;
    fgemm_row(x, router.data<float>(), H, E, z.data());
    float m = z[0], s = 0.f;
    for (int i = 1; i < E; ++i) m = std::max(m, z[i]);
    for (int i = 0; i < E; ++i) s = s + (p[i] = exp_lane(z[i] - m));
    for (int i = 0; i < E; ++i) p[i] = div_ieee(p[i], s);
    std::vector<bool> taken(E, false);
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int i = 0; i < E; ++i)
        if (!taken[i] && (best < 0 || p[i] > p[best])) best = i;
      taken[best] = true;
      ids[j] = best;
      w[j] = p[best];
    }
    if (renormalize) {
      float total = w[0];
      for (int j = 1; j < k; ++j) total = total + w[j];
      for (int j = 0; j < k; ++j) w[j] = div_ieee(w[j], total);
    }
    float* o = out.data<float>() + t * H;
    for (int j = 0; j < k; ++j) {
      const int le = ids[j] - first;
      const bool held = le >= 0 && le < n_held;
      if (held) {
        fgemm_row(x, gate_up[le].data<float>(), H, F2, gu.data());
        for (int64_t i = 0; i < F; ++i) act[i] = (gu[i] / (1.f + exp_lane(0.f - gu[i]))) * gu[F + i];
        fgemm_row(act.data(), down[le].data<float>(), F, H, y.data());
      }
      for (int64_t i = 0; i < H; ++i) {
        const float term = held ? y[i] * w[j] : 0.f;
        o[i] = j == 0 ? term : o[i] + term;
      }
    }
  }
  return {out, ids_t};
}

PD_BUILD_OP(fdx_ref_fgemm).Inputs({"x", "w"}).Outputs({"out"}).SetKernelFn(PD_KERNEL(RefFGemm));

PD_BUILD_OP(fdx_ref_moe)
    .Inputs({"h", "router", paddle::Vec("gate_up"), paddle::Vec("down")})
    .Outputs({"out", "ids"})
    .Attrs({"num_experts: int", "top_k: int", "renormalize: bool", "first: int"})
    .SetKernelFn(PD_KERNEL(RefMoe));

PD_BUILD_OP(fdx_ref_add_rms_norm)
    .Inputs({"x", "residual", "weight"})
    .Outputs({"out", "residual_out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RefAddRmsNorm));

PD_BUILD_OP(fdx_ref_swiglu).Inputs({"x"}).Outputs({"out"}).SetKernelFn(PD_KERNEL(RefSwiglu));

PD_BUILD_OP(fdx_ref_paged_attention)
    .Inputs({"qkv", "kv_cache", "rope", "meta", "tables"})
    .Outputs({"out"})
    .Attrs({"num_heads: int", "num_kv_heads: int", "block_size: int", "scale: float", "window: int"})
    .SetKernelFn(PD_KERNEL(RefPagedAttention));

PD_BUILD_OP(fdx_ref_qgemv).Inputs({"x", "w"}).Outputs({"out"}).Attrs({"qtype: int"}).SetKernelFn(PD_KERNEL(RefQGemv));
