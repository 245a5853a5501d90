// fdx CPU custom op: every decoder layer of an int8 step in one call.
//
// The per-layer eager path (fdx/model/llama.py) dispatches 8 Paddle ops a
// layer -- 240 for a 30-layer model -- and each costs ~10-20 us of Python
// and Paddle dispatch, about a fifth of a single-sequence decode step.
// This op runs the same kernels in the same order from C++:
//
//   for each layer:  h, r = add_rms_norm(x, r, attn_norm)
//                    qkv  = qgemm(h, w_qkv) (+ b_qkv)
//                    x    = qgemm(paged_attention(qkv, cache), w_o)
//                    h, r = add_rms_norm(x, r, ffn_norm)
//                    x    = qgemm(swiglu(qgemm(h, w_gate_up)), w_down)
//
// so its outputs are bit-identical to the per-layer path (tests/
// test_native_ops.py checks it), and it keeps their batch invariance.
//
//   x          [T, E]       float32   the embedded tokens
//   rope, meta, tables                 as fdx_paged_attention
//   attn_norm, ffn_norm  L x [E]      float32
//   w_qkv, w_o, w_gate_up, w_down  L x packed uint8 (fdx/model/packed_weights.py)
//   b_qkv      L x [(H + 2 KV) D] float32, or [0] for no bias
//   caches     L x [2, NB, KV, BS, D]  float32, WRITTEN IN PLACE
//   kinds      4 L ints: the packed kind of w_qkv, w_o, w_gate_up, w_down per layer
//   windows    L ints: each layer's sliding window (0: every key), as fdx_paged_attention's
//   tp_comm    0, or (tensor parallelism) the address of an fdx::TPComm
//              (fdx/parallel/shm_comm.py): the layers hold one rank's shard and
//              the partial sums after w_o and w_down are all-reduced in place
//              through it (fdx/csrc/tp_comm.cc), as llama.py's per-layer path does
// Outputs: x_out [T, E] (the last layer's output) and residual [T, E] (the
// residual stream before it), which the final norm adds.

#include <cstdint>
#include <vector>

#include "kernels.h"
#include "paddle/extension.h"

namespace fdx {
// What fdx/parallel/shm_comm.py's TPCommHandle lays out (ctypes): the
// tp_comm.cc all-reduce and its arguments.
struct TPComm {
  int (*all_reduce)(void*, int, int, int64_t, const float*, float*, int64_t, int64_t, char*, int);
  void* base;
  int32_t rank, world;
  int64_t slot_elems, timeout_ms;
  char err[256];
};
}  // namespace fdx

namespace {

using Tensors = std::vector<paddle::Tensor>;

void all_reduce(fdx::TPComm* c, float* x, int64_t n) {
  if (c == nullptr) return;
  const int rc = c->all_reduce(c->base, c->rank, c->world, c->slot_elems, x, x, n, c->timeout_ms, c->err,
                               static_cast<int>(sizeof c->err));
  PD_CHECK(rc == 0, c->err);
}

void check_packed(const paddle::Tensor& w, int kind, int64_t K, int64_t N, const char* what) {
  PD_CHECK(w.dtype() == paddle::DataType::UINT8 && w.shape().size() == 3, what, " must be a packed uint8 weight");
  PD_CHECK(fdx::packed_block_bytes(kind) > 0, what, ": kind must be 4, 8 or 16");
  PD_CHECK(w.shape()[0] == (N + 7) / 8 && w.shape()[1] == K / 32 && w.shape()[2] == fdx::packed_block_bytes(kind),
           what, " does not match its layer's widths");
}

}  // namespace

std::vector<paddle::Tensor> DecoderLayers(const paddle::Tensor& x, const paddle::Tensor& rope, const paddle::Tensor& meta,
                                          const paddle::Tensor& tables, const Tensors& attn_norm, const Tensors& w_qkv,
                                          const Tensors& b_qkv, const Tensors& w_o, const Tensors& ffn_norm,
                                          const Tensors& w_gate_up, const Tensors& w_down, const Tensors& caches,
                                          const std::vector<int>& kinds, int num_heads, float eps, float scale,
                                          int64_t tp_comm, const std::vector<int>& windows) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && x.shape().size() == 2, "x must be float32 [T, E]");
  PD_CHECK(meta.dtype() == paddle::DataType::INT32 && tables.dtype() == paddle::DataType::INT32,
           "meta/tables must be int32");
  const size_t L = caches.size();
  PD_CHECK(L > 0 && attn_norm.size() == L && w_qkv.size() == L && b_qkv.size() == L && w_o.size() == L &&
               ffn_norm.size() == L && w_gate_up.size() == L && w_down.size() == L && kinds.size() == 4 * L &&
               windows.size() == L,
           "every per-layer list must have one entry per layer");
  const int64_t T = x.shape()[0], E = x.shape()[1];
  const auto& c0 = caches[0].shape();
  PD_CHECK(c0.size() == 5 && c0[0] == 2, "caches must be [2, NB, KV, BS, D]");
  fdx::AttnShape sh{T, num_heads, static_cast<int>(c0[2]), static_cast<int>(c0[4]), static_cast<int>(c0[3]),
                    c0[1], tables.shape()[0], tables.shape()[1], rope.shape()[0], scale};
  PD_CHECK(sh.H % sh.KV == 0, "num_heads must be a multiple of the kv heads");
  PD_CHECK(rope.shape()[1] == sh.D, "rope width mismatch");
  const int64_t Q = (int64_t)sh.H * sh.D, W = (int64_t)(sh.H + 2 * sh.KV) * sh.D;
  const int64_t F2 = w_gate_up[0].shape()[0] * 8, F = F2 / 2;
  PD_CHECK(E % 32 == 0 && Q % 32 == 0 && F % 32 == 0, "layer widths must be multiples of 32");
  for (size_t l = 0; l < L; ++l) {
    PD_CHECK(caches[l].dtype() == paddle::DataType::FLOAT32 && caches[l].shape() == c0, "caches differ in shape");
    PD_CHECK(attn_norm[l].numel() == E && ffn_norm[l].numel() == E, "norm weight width mismatch");
    PD_CHECK(b_qkv[l].numel() == 0 || b_qkv[l].numel() == W, "qkv bias width mismatch");
    check_packed(w_qkv[l], kinds[4 * l], E, W, "w_qkv");
    check_packed(w_o[l], kinds[4 * l + 1], Q, E, "w_o");
    check_packed(w_gate_up[l], kinds[4 * l + 2], E, F2, "w_gate_up");
    check_packed(w_down[l], kinds[4 * l + 3], F, E, "w_down");
    PD_CHECK(windows[l] >= 0, "windows must be >= 0 (0: no sliding window)");
  }
  // the step's metadata is the same for every layer: validated once
  fdx::check_attention_meta(sh, meta.data<int>(), tables.data<int>());

  auto x_out = paddle::empty({T, E}, paddle::DataType::FLOAT32, x.place());
  auto res = paddle::empty({T, E}, paddle::DataType::FLOAT32, x.place());
  if (T == 0) return {x_out, res};
  float* xb = x_out.data<float>();
  float* rb = res.data<float>();
  std::vector<float> h(T * E), qkv(T * W), att(T * Q), gu(T * F2), act(T * F);
  const float* cur = x.data<float>();  // the layer input: x, then x_out
  auto* comm = reinterpret_cast<fdx::TPComm*>(tp_comm);
  for (size_t l = 0; l < L; ++l) {
    fdx::add_rms_norm(cur, l == 0 ? nullptr : rb, attn_norm[l].data<float>(), T, E, eps, h.data(), rb);
    fdx::qgemm(h.data(), w_qkv[l].data<uint8_t>(), kinds[4 * l], qkv.data(), T, E, W);
    if (b_qkv[l].numel() > 0) {
      const float* b = b_qkv[l].data<float>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < W; ++i) qkv[t * W + i] += b[i];
    }
    sh.window = windows[l];
    fdx::paged_attention(sh, qkv.data(), const_cast<float*>(caches[l].data<float>()), rope.data<float>(),
                         meta.data<int>(), tables.data<int>(), att.data());
    fdx::qgemm(att.data(), w_o[l].data<uint8_t>(), kinds[4 * l + 1], xb, T, Q, E);
    all_reduce(comm, xb, T * E);  // row-parallel o: the ranks' partial sums
    fdx::add_rms_norm(xb, rb, ffn_norm[l].data<float>(), T, E, eps, h.data(), rb);
    fdx::qgemm(h.data(), w_gate_up[l].data<uint8_t>(), kinds[4 * l + 2], gu.data(), T, E, F2);
    fdx::swiglu(gu.data(), T, F, act.data());
    fdx::qgemm(act.data(), w_down[l].data<uint8_t>(), kinds[4 * l + 3], xb, T, F, E);
    all_reduce(comm, xb, T * E);  // row-parallel down
    cur = xb;
  }
  return {x_out, res};
}

std::vector<std::vector<int64_t>> DecoderLayersShape(
    const std::vector<int64_t>& x, const std::vector<int64_t>& rope, const std::vector<int64_t>& meta,
    const std::vector<int64_t>& tables, const std::vector<std::vector<int64_t>>& attn_norm,
    const std::vector<std::vector<int64_t>>& w_qkv, const std::vector<std::vector<int64_t>>& b_qkv,
    const std::vector<std::vector<int64_t>>& w_o, const std::vector<std::vector<int64_t>>& ffn_norm,
    const std::vector<std::vector<int64_t>>& w_gate_up, const std::vector<std::vector<int64_t>>& w_down,
    const std::vector<std::vector<int64_t>>& caches, const std::vector<int>& kinds, int num_heads, float eps,
    float scale, int64_t tp_comm, const std::vector<int>& windows) {
  return {x, x};
}

std::vector<paddle::DataType> DecoderLayersDtype(
    const paddle::DataType& x, const paddle::DataType& rope, const paddle::DataType& meta,
    const paddle::DataType& tables, const std::vector<paddle::DataType>& attn_norm,
    const std::vector<paddle::DataType>& w_qkv, const std::vector<paddle::DataType>& b_qkv,
    const std::vector<paddle::DataType>& w_o, const std::vector<paddle::DataType>& ffn_norm,
    const std::vector<paddle::DataType>& w_gate_up, const std::vector<paddle::DataType>& w_down,
    const std::vector<paddle::DataType>& caches) {
  return {x, x};
}

PD_BUILD_OP(fdx_decoder_layers)
    .Inputs({"x", "rope", "meta", "tables", paddle::Vec("attn_norm"), paddle::Vec("w_qkv"), paddle::Vec("b_qkv"),
             paddle::Vec("w_o"), paddle::Vec("ffn_norm"), paddle::Vec("w_gate_up"), paddle::Vec("w_down"),
             paddle::Vec("caches")})
    .Outputs({"x_out", "residual"})
    .Attrs({"kinds: std::vector<int>", "num_heads: int", "eps: float", "scale: float", "tp_comm: int64_t",
             "windows: std::vector<int>"})
    .SetKernelFn(PD_KERNEL(DecoderLayers))
    .SetInferShapeFn(PD_INFER_SHAPE(DecoderLayersShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DecoderLayersDtype));
