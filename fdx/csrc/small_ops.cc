// fdx CPU custom ops for the small per-layer element-wise work of a step.
//
// Paddle's CPU kernels parallelise even a [1, 576] RMSNorm over the OpenMP
// team, so on 2 busy cores each call pays a barrier (measured 12-70 us per
// call in a decode step).  These run on the calling thread for small inputs
// and only fan out (libiomp5, like MKL) for prefill-sized ones.
//
//   fdx_add_rms_norm(x [T, H], residual [T, H] or [0], weight [H], eps)
//       -> out = rmsnorm(x + residual) * weight,  residual_out = x + residual
//   fdx_swiglu(x [T, 2F]) -> silu(x[:, :F]) * x[:, F:]

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "simd_math.h"

namespace {
constexpr int64_t kParallelElems = 1 << 16;
}

// The sum of squares runs in the 16 canonical lanes of simd_math.h (lane i:
// fma over i, i + 16, ... in order; then v::reduce_add's tree), so a row's
// bits are the same with both kernel sets.
void fdx::add_rms_norm(const float* xp, const float* rp, const float* wp, int64_t T, int64_t H, float eps, float* op,
                       float* ro) {
  namespace v = fdx::simd;
  constexpr int L = v::kLanes;
#pragma omp parallel for schedule(static) if (T * H >= kParallelElems)
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = xp + t * H;
    const float* rin = rp != nullptr ? rp + t * H : nullptr;
    float* rr = ro + t * H;
    v::v16 ss = v::zero16();
    for (int64_t i = 0; i < H; i += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, H - i));
      for (int p = 0; p < v::kParts; ++p) {
        const int c = std::min(L, n - p * L);
        if (c <= 0) break;
        const int64_t k = i + p * L;
        v::vf x = c == L ? v::load(xr + k) : v::load_first(xr + k, c);
        if (rin != nullptr) x = v::add(x, c == L ? v::load(rin + k) : v::load_first(rin + k, c));
        if (c == L) v::store(rr + k, x);
        else v::store_first(rr + k, x, c);
        ss.p[p] = v::fmadd(x, x, ss.p[p]);
      }
    }
    const v::vf inv = v::set1(1.f / std::sqrt(v::reduce_add(ss) / static_cast<float>(H) + eps));
    float* orow = op + t * H;
    int64_t i = 0;
    for (; i + L <= H; i += L) v::store(orow + i, v::mul(v::mul(v::load(rr + i), inv), v::load(wp + i)));
    if (i < H) {
      const int c = static_cast<int>(H - i);
      v::store_first(orow + i, v::mul(v::mul(v::load_first(rr + i, c), inv), v::load_first(wp + i, c)), c);
    }
  }
}

void fdx::swiglu(const float* xp, int64_t T, int64_t F, float* op) {
  const int64_t F2 = 2 * F;
#pragma omp parallel for schedule(static) if (T * F >= kParallelElems)
  for (int64_t t = 0; t < T; ++t) {
    const float* g = xp + t * F2;
    const float* u = g + F;
    float* o = op + t * F;
    int64_t i = 0;
    namespace v = fdx::simd;
    const v::vf one = v::set1(1.f);
    for (; i + v::kLanes <= F; i += v::kLanes) {
      const v::vf gv = v::load(g + i);
      const v::vf e = v::exp(v::sub(v::zero(), gv));
      v::store(o + i, v::mul(v::div(gv, v::add(one, e)), v::load(u + i)));
    }
    if (i < F) {  // the same lane-wise maths (never std::exp: its bits are not v::exp's)
      const int c = static_cast<int>(F - i);
      const v::vf gv = v::load_first(g + i, c);
      const v::vf e = v::exp(v::sub(v::zero(), gv));
      v::store_first(o + i, v::mul(v::div(gv, v::add(one, e)), v::load_first(u + i, c)), c);
    }
  }
}
