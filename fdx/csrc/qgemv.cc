// fdx CPU custom op: y = x @ W^T with W kept in GGUF block-quantized form.
//
// For the few-row matmuls of decode (M small) the step is memory-bound:
// reading Q4_1 weights (0.625 B/weight) instead of fp32 (4 B/weight) makes a
// single-stream decode step ~5x lighter.  The maths is exactly the
// dequantized fp32 matmul (w = d*q + m, fp32 activations and accumulation);
// only the summation order differs from MKL's.
//
//   x   [M, K]          float32
//   w   [N, K/32 * B]   uint8    one GGUF row per output feature
//   out [M, N]          float32
// qtype: 2 = Q4_0 (B=18), 3 = Q4_1 (B=20), 8 = Q8_0 (B=34) (ggml type ids).

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
constexpr int kVecs = 32 / v::kLanes;  // vectors per 32-weight block


// MR rows of x against output rows [n0, n1).  Each output is summed in the
// 16 canonical lanes of simd_math.h (the same bits with both kernel sets):
// per block, lane i holds w[i] x[i] + w[i + 16] x[i + 16] (a mul, then an
// fma), scaled into the row's accumulator by one fma; then v::reduce_add,
// plus the Q4 offsets' term m * sum(x) (summed in order, block by block).
template <int QT, int MR>
void kernel(const float* x, const float* xsum, const uint8_t* w, float* out, int64_t K, int64_t N, int64_t n0,
            int64_t n1, int64_t row_bytes) {
  const int64_t nb = K / 32;
  constexpr int BB = QT == 2 ? 18 : (QT == 3 ? 20 : 34);
  constexpr int P = v::kParts;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    v::v16 acc[MR];
    float macc[MR];
    for (int r = 0; r < MR; ++r) {
      acc[r] = v::zero16();
      macc[r] = 0.f;
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * BB;
      const float d = v::half_to_float(blk);
      v::vf f[kVecs];  // weights c * kLanes ..
      float m = 0.f;
      if constexpr (QT == 8) {
        for (int c = 0; c < kVecs; ++c) f[c] = v::from_i8(reinterpret_cast<const int8_t*>(blk + 2) + c * v::kLanes);
      } else {
        v::from_nibbles(blk + (QT == 3 ? 4 : 2), f);
        m = QT == 3 ? v::half_to_float(blk + 2) : -8.f * d;
      }
      const v::vf vd = v::set1(d);
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * K + b * 32;
        for (int i = 0; i < P; ++i) {
          v::vf s = v::mul(f[i], v::load(xr + i * v::kLanes));
          s = v::fmadd(f[P + i], v::load(xr + 16 + i * v::kLanes), s);
          acc[r].p[i] = v::fmadd(s, vd, acc[r].p[i]);
        }
        if constexpr (QT != 8) macc[r] = std::fma(m, xsum[r * nb + b], macc[r]);
      }
    }
    for (int r = 0; r < MR; ++r) out[r * N + n] = v::reduce_add(acc[r]) + macc[r];
  }
}

template <int QT>
void run(const float* x, const uint8_t* w, float* out, int64_t M, int64_t K, int64_t N, int64_t row_bytes) {
  const int64_t nb = K / 32;
  std::vector<float> xsum(M * nb);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * 32;  // lanes i + i + 16, then the fixed tree
      xsum[r * nb + b] = v::reduce_add(v::add(v::load16(xb), v::load16(xb + 16)));
    }
  const int64_t chunk = 32;
  const int64_t nchunks = (N + chunk - 1) / chunk;
#pragma omp parallel if (nchunks >= 4)
  {
  const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
  const int64_t per = (nchunks + nth - 1) / nth;
  for (int64_t c = tid * per; c < std::min(nchunks, (tid + 1) * per); ++c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const int64_t mr = std::min<int64_t>(4, M - r0);
      const float* xr = x + r0 * K;
      const float* sr = xsum.data() + r0 * nb;
      float* orow = out + r0 * N;
      switch (mr) {
        case 1: kernel<QT, 1>(xr, sr, w, orow, K, N, n0, n1, row_bytes); break;
        case 2: kernel<QT, 2>(xr, sr, w, orow, K, N, n0, n1, row_bytes); break;
        case 3: kernel<QT, 3>(xr, sr, w, orow, K, N, n0, n1, row_bytes); break;
        default: kernel<QT, 4>(xr, sr, w, orow, K, N, n0, n1, row_bytes); break;
      }
    }
  }
  }
}

}  // namespace

int fdx::gguf_block_bytes(int qtype) {
  switch (qtype) {
    case 2: return 18;
    case 3: return 20;
    case 8: return 34;
    default: return 0;
  }
}

void fdx::qgemv(const float* x, const uint8_t* w, int qtype, float* out, int64_t M, int64_t K, int64_t N,
                int64_t row_bytes) {
  if (qtype == 2) run<2>(x, w, out, M, K, N, row_bytes);
  else if (qtype == 3) run<3>(x, w, out, M, K, N, row_bytes);
  else run<8>(x, w, out, M, K, N, row_bytes);
}
