// The plain C++ entry points of fdx's CPU kernels, called by the Paddle ops
// (paddle_ops.cc: the only file that includes Paddle's headers, whose parsing
// costs ~6 s a file, so the kernels build in parallel in a fraction of that).
//
// Each function works on raw row-major buffers and owns no tensor; the op
// wrappers check dtypes and shapes, allocate the outputs and call these.
// Invariant kept by every implementation: each output row depends only on
// its own input row (and, for attention, its own sequence's cache), with a
// fixed reduction order, so a row's bits never depend on the other rows of
// the call nor on the thread count (see qgemm.cc's BATCH INVARIANCE note).
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace fdx {

// A kernel's precondition on its inputs: std::invalid_argument, which the
// Paddle ops turn into the op's error (a Python exception).
inline void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

// fp32 -> the bfloat16 bit pattern: round to nearest even, denormals to
// (signed) zero, NaN kept quiet -- the rounding of fdx's bf16 weights
// (fdx/model/packed_weights.py pack_bf16), activations and KV cache.
inline uint32_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0) return (u >> 16) & 0x8000u;                    // zero or denormal: +-0
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return ((u >> 16) | 0x40u) & 0xFFFFu;  // NaN
  return ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) & 0xFFFFu;
}

// The float32 of a bfloat16 bit pattern (exact).
inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Bytes of one packed block (8 output columns x 32 inputs): kind 4 (Q4_0/Q4_1),
// kind 8 (Q8_0) and kind 16 (bfloat16), as fdx/model/packed_weights.py lays them out.
constexpr int kPackedQ4Bytes = 160;
constexpr int kPackedQ8Bytes = 272;
constexpr int kPackedBf16Bytes = 512;

// The packed bytes per block of a kind (0 for an unknown kind).
constexpr int packed_block_bytes(int kind) {
  return kind == 4 ? kPackedQ4Bytes : kind == 8 ? kPackedQ8Bytes : kind == 16 ? kPackedBf16Bytes : 0;
}

// qgemm.cc: out[M, N] = x[M, K] @ W^T, W packed by fdx/model/packed_weights.py:
// kinds 4 (Q4_0/Q4_1) and 8 (Q8_0) in int8 (x quantized per row to Q8),
// kind 16 in bfloat16 (x rounded to bf16, fp32 accumulation).
void qgemm(const float* x, const uint8_t* w, int kind, float* out, int64_t M, int64_t K, int64_t N);

// The kernels keep per-thread scratch between calls, grown to the largest
// call so far and never shrunk (a 16k-token prefill leaves hundreds of MB).
// Each frees the calling thread's scratch of its file and returns the bytes
// it held; fdx_release_scratch runs them on every thread (sleep).
int64_t release_qgemm_scratch();
int64_t release_attention_scratch();
int64_t release_moe_scratch();
int64_t release_sampling_scratch();  // sampling.cc: a vocabulary row and the selections' buffers

// Which dot products this build's qgemm uses: out[0] int8 (1 = vpdpbusd, 0 =
// vpmaddubsw), out[1] bf16 (1 = vdpbf16ps, 0 = two fmas), out[2] 1 where the
// int8 tiles of 16 rows run on AMX now (FDX_NATIVE_AMX).
void qgemm_kernels(int32_t* out);

// qgemv.cc: out[M, N] = x[M, K] @ W^T straight from GGUF blocks, W's rows
// row_bytes apart; qtype 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), whose block size
// gguf_block_bytes gives (0 for another type).
int gguf_block_bytes(int qtype);
void qgemv(const float* x, const uint8_t* w, int qtype, float* out, int64_t M, int64_t K, int64_t N,
           int64_t row_bytes);

// paged_attention.cc: the geometry of one call (see the layout contract there).
struct AttnShape {
  int64_t T;     // token rows of the step
  int H, KV, D;  // query heads, kv heads, head size
  int BS;        // tokens per cache block
  int64_t NB;    // blocks in the cache
  int64_t S;     // sequences (rows of the block table)
  int64_t MAXB;  // block-table width
  int64_t P;     // rows of the RoPE table
  float scale;   // softmax scale
  int window = 0;  // sliding window: keys pos - window < j <= pos (0: every key 0..pos)
  bool bf16_cache = false;  // the cache holds bfloat16 (uint16 bit patterns), else float32
};

// Throws (require) unless every token's sequence, position and block ids are
// in range and the head size is at most 512; paged_attention itself trusts them.
void check_attention_meta(const AttnShape& s, const int* meta, const int* tables);

// RoPE q and k of qkv [T, (H + 2 KV) D], write k and v into the cache
// (kcache: [2, NB, KV, BS, D], K half first; written in place), attend;
// out [T, H D].
void paged_attention(const AttnShape& s, const float* qkv, void* kcache, const float* rope, const int* meta,
                     const int* tables, float* out);

// small_ops.cc: res_out = x + residual (residual may be null), out =
// rmsnorm(res_out) * weight, for [T, H] rows.
void add_rms_norm(const float* x, const float* residual, const float* weight, int64_t T, int64_t H, float eps,
                  float* out, float* res_out);

// out[T, F] = silu(x[:, :F]) * x[:, F:] for x [T, 2F].
void swiglu(const float* x, int64_t T, int64_t F, float* out);

// moe.cc: out[M, N] = x[M, K] @ w[K, N] in float32 (w row-major); element
// (m, n) is acc = fma(x[m][k], w[k][n], acc) over k in order from 0.
void fgemm(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N);

// moe.cc: a mixture-of-experts block (the contract at the top of moe.cc).
struct MoeDims {
  int64_t T, H, F;  // tokens, hidden width, each expert's intermediate width
  int E, k, first;  // router experts, top-k, the global id of the first held expert
  int64_t n_held;   // experts this rank holds: [first, first + n_held)
  int kind;         // 0 float32 ([K, N] weights), else the packed kind of qgemm
  bool renormalize;
};
// out [T, H] and ids [T, k] (global expert ids); gate_up[e] / down[e] are
// held expert e's weights (float* for kind 0, packed uint8_t* otherwise).
void moe(const MoeDims& d, const float* h, const float* router, const void* const* gate_up,
         const void* const* down, float* out, int32_t* ids);

}  // namespace fdx
