// fdx's Paddle custom ops: for each, the dtype and shape checks, the output
// tensors, and a call into the plain C++ kernels of kernels.h (the other .cc
// files, which never include Paddle's headers: this is the one file whose
// build parses them).  The ops and what they compute are documented at
// their kernels: fdx_add_rms_norm, fdx_swiglu (small_ops.cc),
// fdx_paged_attention (paged_attention.cc), fdx_qgemv (qgemv.cc), fdx_qgemm,
// fdx_qgemm_dot (qgemm.cc), fdx_moe, fdx_fgemm (moe.cc); fdx_decoder_layers,
// fdx_decoder_stack, fdx_stack_profile (the loop's own clocks) and
// fdx_release_scratch (the kernels' kept buffers) are here, as the loop is
// only a sequence of those kernels.
//
// fdx_decoder_layers: every decoder layer of an int8 step in one call.
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

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
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

// A KV cache the attention reads: float32, or bfloat16 (paged_attention.cc's BFLOAT16 CACHE).
bool kv_cache_dtype_ok(const paddle::Tensor& c) {
  return c.dtype() == paddle::DataType::FLOAT32 || c.dtype() == paddle::DataType::BFLOAT16;
}

// Runs a kernel's checks (fdx::require): a failing one is the op's error, as a PD_CHECK's.
template <typename F>
void checked(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    PD_THROW(e.what());
  }
}

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

// w is kind's weight for x [*, K] @ W -> [*, N]: float32 [K, N], or packed for N outputs (check_packed).
void check_weight(const paddle::Tensor& w, int kind, int64_t K, int64_t N, const char* what) {
  if (kind != 0) return check_packed(w, kind, K, N, what);
  PD_CHECK(w.dtype() == paddle::DataType::FLOAT32 && w.shape().size() == 2 && w.shape()[0] == K && w.shape()[1] == N,
           what, ": a float32 weight must be [K, N] and match the block's widths");
}

}  // namespace

// The layer loop's own clocks (fdx_stack_profile, for
// bench/bench_step_overhead.py --by-kernel): wall time of each kernel of the
// loop, summed over layers and calls, while switched on.  One steady_clock
// read a kernel when on, one relaxed load a call when off.  The loop runs on
// the model's one Python thread, so the sums need no atomics.
namespace stack_profile {
enum Part { kAttnNorm, kQkv, kAttention, kOProj, kFfnNorm, kGateUp, kSwiglu, kDown, kParts };
std::atomic<bool> on{false};
double ns[kParts + 1] = {};  // the parts, then whole calls
double calls = 0, rows = 0;
}  // namespace stack_profile

// The layers' intermediates (h, qkv, att, gate_up, act), the calling
// thread's: grown, never shrunk but by fdx_release_scratch, never zeroed
// (each is written whole before it is read) -- a prefill step's are ~12 MB,
// which fresh zeroed vectors paged in and cleared on every call.
namespace {
struct LayerScratch {
  std::unique_ptr<float[]> bufs[5];
  int64_t sizes[5] = {};
  float* get(int i, int64_t n) {
    if (n > sizes[i]) bufs[i].reset(new float[sizes[i] = n]);
    return bufs[i].get();
  }
  int64_t release() {
    int64_t bytes = 0;
    for (int i = 0; i < 5; ++i) {
      bytes += sizes[i] * static_cast<int64_t>(sizeof(float));
      bufs[i].reset();
      sizes[i] = 0;
    }
    return bytes;
  }
};
thread_local LayerScratch layer_scratch;
}  // namespace

// The layer loop of fdx_decoder_layers and fdx_decoder_stack, over raw
// pointers (the callers have checked every shape): layer l's weights are
// ptrs[7 l .. 7 l + 6] (attn_norm, w_qkv, b_qkv or 0, w_o, ffn_norm,
// w_gate_up, w_down).
std::vector<paddle::Tensor> run_layers(const paddle::Tensor& x, const paddle::Tensor& rope, const paddle::Tensor& meta,
                                       const paddle::Tensor& tables, const std::vector<int64_t>& ptrs,
                                       const std::vector<void*>& caches, const std::vector<int>& kinds,
                                       const std::vector<int>& windows, fdx::AttnShape sh, int64_t W, int64_t Q,
                                       int64_t F2, float eps, int64_t tp_comm) {
  const int64_t T = x.shape()[0], E = x.shape()[1], F = F2 / 2;
  const size_t L = caches.size();
  auto x_out = paddle::empty({T, E}, paddle::DataType::FLOAT32, x.place());
  auto res = paddle::empty({T, E}, paddle::DataType::FLOAT32, x.place());
  if (T == 0) return {x_out, res};
  float* xb = x_out.data<float>();
  float* rb = res.data<float>();
  auto scratch = [](int i, int64_t n) { return layer_scratch.get(i, n); };
  float* h = scratch(0, T * E);
  float* qkv = scratch(1, T * W);
  float* att = scratch(2, T * Q);
  float* gu = scratch(3, T * F2);
  float* act = scratch(4, T * F);
  const float* cur = x.data<float>();  // the layer input: x, then x_out
  auto* comm = reinterpret_cast<fdx::TPComm*>(tp_comm);
  auto f32 = [](int64_t p) { return reinterpret_cast<const float*>(p); };
  auto u8 = [](int64_t p) { return reinterpret_cast<const uint8_t*>(p); };
  namespace sp = stack_profile;
  using Clock = std::chrono::steady_clock;
  const bool prof = sp::on.load(std::memory_order_relaxed);
  const Clock::time_point t_call = prof ? Clock::now() : Clock::time_point{};
  Clock::time_point t_last = t_call;
  auto lap = [&](sp::Part part) {
    if (!prof) return;
    const Clock::time_point now = Clock::now();
    sp::ns[part] += std::chrono::duration<double, std::nano>(now - t_last).count();
    t_last = now;
  };
  for (size_t l = 0; l < L; ++l) {
    const int64_t* pl = ptrs.data() + 7 * l;
    fdx::add_rms_norm(cur, l == 0 ? nullptr : rb, f32(pl[0]), T, E, eps, h, rb);
    lap(sp::kAttnNorm);
    fdx::qgemm(h, u8(pl[1]), kinds[4 * l], qkv, T, E, W);
    if (pl[2] != 0) {
      const float* b = f32(pl[2]);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < W; ++i) qkv[t * W + i] += b[i];
    }
    lap(sp::kQkv);
    sh.window = windows[l];
    fdx::paged_attention(sh, qkv, caches[l], rope.data<float>(), meta.data<int>(), tables.data<int>(), att);
    lap(sp::kAttention);
    fdx::qgemm(att, u8(pl[3]), kinds[4 * l + 1], xb, T, Q, E);
    all_reduce(comm, xb, T * E);  // row-parallel o: the ranks' partial sums
    lap(sp::kOProj);
    fdx::add_rms_norm(xb, rb, f32(pl[4]), T, E, eps, h, rb);
    lap(sp::kFfnNorm);
    fdx::qgemm(h, u8(pl[5]), kinds[4 * l + 2], gu, T, E, F2);
    lap(sp::kGateUp);
    fdx::swiglu(gu, T, F, act);
    lap(sp::kSwiglu);
    fdx::qgemm(act, u8(pl[6]), kinds[4 * l + 3], xb, T, F, E);
    all_reduce(comm, xb, T * E);  // row-parallel down
    lap(sp::kDown);
    cur = xb;
  }
  if (prof) {
    sp::ns[sp::kParts] += std::chrono::duration<double, std::nano>(Clock::now() - t_call).count();
    sp::calls += 1;
    sp::rows += static_cast<double>(T);
  }
  return {x_out, res};
}

// The checks both ops make on the step's own inputs (x, meta, tables, the
// caches); the geometry they imply.
fdx::AttnShape check_step(const paddle::Tensor& x, const paddle::Tensor& rope, const paddle::Tensor& meta,
                          const paddle::Tensor& tables, const Tensors& caches, int num_heads, float scale) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && x.shape().size() == 2, "x must be float32 [T, E]");
  PD_CHECK(meta.dtype() == paddle::DataType::INT32 && tables.dtype() == paddle::DataType::INT32,
           "meta/tables must be int32");
  PD_CHECK(!caches.empty(), "caches must have one entry per layer");
  const int64_t T = x.shape()[0];
  const auto& c0 = caches[0].shape();
  PD_CHECK(c0.size() == 5 && c0[0] == 2, "caches must be [2, NB, KV, BS, D]");
  PD_CHECK(kv_cache_dtype_ok(caches[0]), "caches must be float32 or bfloat16");
  fdx::AttnShape sh{T, num_heads, static_cast<int>(c0[2]), static_cast<int>(c0[4]), static_cast<int>(c0[3]),
                    c0[1], tables.shape()[0], tables.shape()[1], rope.shape()[0], scale, 0,
                    caches[0].dtype() == paddle::DataType::BFLOAT16};
  PD_CHECK(sh.H % sh.KV == 0, "num_heads must be a multiple of the kv heads");
  PD_CHECK(rope.shape()[1] == sh.D, "rope width mismatch");
  for (const auto& c : caches)
    PD_CHECK(c.dtype() == caches[0].dtype() && c.shape() == c0, "caches differ in shape or dtype");
  // the step's metadata is the same for every layer: validated once
  checked([&] { fdx::check_attention_meta(sh, meta.data<int>(), tables.data<int>()); });
  return sh;
}

std::vector<void*> cache_ptrs(const Tensors& caches) {
  std::vector<void*> p(caches.size());
  for (size_t l = 0; l < caches.size(); ++l) p[l] = const_cast<void*>(caches[l].data());
  return p;
}

std::vector<paddle::Tensor> DecoderLayers(const paddle::Tensor& x, const paddle::Tensor& rope, const paddle::Tensor& meta,
                                          const paddle::Tensor& tables, const Tensors& attn_norm, const Tensors& w_qkv,
                                          const Tensors& b_qkv, const Tensors& w_o, const Tensors& ffn_norm,
                                          const Tensors& w_gate_up, const Tensors& w_down, const Tensors& caches,
                                          const std::vector<int>& kinds, int num_heads, float eps, float scale,
                                          int64_t tp_comm, const std::vector<int>& windows) {
  const size_t L = caches.size();
  PD_CHECK(L > 0 && attn_norm.size() == L && w_qkv.size() == L && b_qkv.size() == L && w_o.size() == L &&
               ffn_norm.size() == L && w_gate_up.size() == L && w_down.size() == L && kinds.size() == 4 * L &&
               windows.size() == L,
           "every per-layer list must have one entry per layer");
  const fdx::AttnShape sh = check_step(x, rope, meta, tables, caches, num_heads, scale);
  const int64_t E = x.shape()[1];
  const int64_t Q = (int64_t)sh.H * sh.D, W = (int64_t)(sh.H + 2 * sh.KV) * sh.D;
  const int64_t F2 = w_gate_up[0].shape()[0] * 8, F = F2 / 2;
  PD_CHECK(E % 32 == 0 && Q % 32 == 0 && F % 32 == 0, "layer widths must be multiples of 32");
  std::vector<int64_t> ptrs(7 * L);
  auto addr = [](const paddle::Tensor& t) { return reinterpret_cast<int64_t>(t.data()); };
  for (size_t l = 0; l < L; ++l) {
    PD_CHECK(attn_norm[l].numel() == E && ffn_norm[l].numel() == E, "norm weight width mismatch");
    PD_CHECK(b_qkv[l].numel() == 0 || b_qkv[l].numel() == W, "qkv bias width mismatch");
    check_packed(w_qkv[l], kinds[4 * l], E, W, "w_qkv");
    check_packed(w_o[l], kinds[4 * l + 1], Q, E, "w_o");
    check_packed(w_gate_up[l], kinds[4 * l + 2], E, F2, "w_gate_up");
    check_packed(w_down[l], kinds[4 * l + 3], F, E, "w_down");
    PD_CHECK(windows[l] >= 0, "windows must be >= 0 (0: no sliding window)");
    const int64_t p[7] = {addr(attn_norm[l]), addr(w_qkv[l]), b_qkv[l].numel() > 0 ? addr(b_qkv[l]) : 0, addr(w_o[l]),
                          addr(ffn_norm[l]), addr(w_gate_up[l]), addr(w_down[l])};
    std::copy(p, p + 7, ptrs.begin() + 7 * l);
  }
  return run_layers(x, rope, meta, tables, ptrs, cache_ptrs(caches), kinds, windows, sh, W, Q, F2, eps, tp_comm);
}

// fdx_decoder_stack: fdx_decoder_layers with the layers' weights given as
// addresses (the attribute ptrs, 7 a layer as run_layers reads them) and
// their widths (dims: E, W, Q, 2F), so a step does not pass 7 x L tensors
// through Paddle's argument conversion -- 230 us a step for 30 layers with
// cold caches, ~4% of a single-stream step (docs/PERFORMANCE.md).  The
// addresses and kinds are fdx/model/llama.py's, made once from the tensors
// it keeps alive, after one fdx_decoder_layers call checked every weight;
// this op checks the step's own inputs.
std::vector<paddle::Tensor> DecoderStack(const paddle::Tensor& x, const paddle::Tensor& rope, const paddle::Tensor& meta,
                                         const paddle::Tensor& tables, const Tensors& caches,
                                         const std::vector<int64_t>& ptrs, const std::vector<int64_t>& dims,
                                         const std::vector<int>& kinds, int num_heads, float eps, float scale,
                                         int64_t tp_comm, const std::vector<int>& windows) {
  const size_t L = caches.size();
  PD_CHECK(L > 0 && ptrs.size() == 7 * L && kinds.size() == 4 * L && windows.size() == L && dims.size() == 4,
           "ptrs, kinds and windows must have 7, 4 and 1 entries a layer, dims 4");
  for (size_t i = 0; i < ptrs.size(); ++i) PD_CHECK(ptrs[i] != 0 || i % 7 == 2, "a layer weight's address is 0");
  for (int w : windows) PD_CHECK(w >= 0, "windows must be >= 0 (0: no sliding window)");
  const fdx::AttnShape sh = check_step(x, rope, meta, tables, caches, num_heads, scale);
  PD_CHECK(dims[0] == x.shape()[1] && dims[1] == (int64_t)(sh.H + 2 * sh.KV) * sh.D && dims[2] == (int64_t)sh.H * sh.D &&
               dims[3] % 64 == 0 && dims[3] > 0,
           "dims do not match x's width and the caches' heads");
  return run_layers(x, rope, meta, tables, ptrs, cache_ptrs(caches), kinds, windows, sh, dims[1], dims[2], dims[3],
                    eps, tp_comm);
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

std::vector<std::vector<int64_t>> DecoderStackShape(const std::vector<int64_t>& x, const std::vector<int64_t>& rope,
                                                    const std::vector<int64_t>& meta, const std::vector<int64_t>& tables,
                                                    const std::vector<std::vector<int64_t>>& caches,
                                                    const std::vector<int64_t>& ptrs, const std::vector<int64_t>& dims,
                                                    const std::vector<int>& kinds, int num_heads, float eps, float scale,
                                                    int64_t tp_comm, const std::vector<int>& windows) {
  return {x, x};
}

std::vector<paddle::DataType> DecoderStackDtype(const paddle::DataType& x, const paddle::DataType& rope,
                                                const paddle::DataType& meta, const paddle::DataType& tables,
                                                const std::vector<paddle::DataType>& caches) {
  return {x, x};
}

PD_BUILD_OP(fdx_decoder_stack)
    .Inputs({"x", "rope", "meta", "tables", paddle::Vec("caches")})
    .Outputs({"x_out", "residual"})
    .Attrs({"ptrs: std::vector<int64_t>", "dims: std::vector<int64_t>", "kinds: std::vector<int>", "num_heads: int",
            "eps: float", "scale: float", "tp_comm: int64_t", "windows: std::vector<int>"})
    .SetKernelFn(PD_KERNEL(DecoderStack))
    .SetInferShapeFn(PD_INFER_SHAPE(DecoderStackShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DecoderStackDtype));

// ---------------------------------------------------------------- fdx_stack_profile
// fdx_stack_profile(x, start): the layer loop's clocks so far, float64 [11]:
// ns in attn_norm, qkv (+ bias), attention, o (+ its all-reduce), ffn_norm,
// gate_up, swiglu, down (+ its all-reduce), whole calls; then the calls and
// the rows (tokens) they ran.  start 1 zeroes them and switches them on, 0
// switches them off (the figures stay readable).  x only names the place.
std::vector<paddle::Tensor> StackProfile(const paddle::Tensor& x, int start) {
  namespace sp = stack_profile;
  auto out = paddle::empty({sp::kParts + 3}, paddle::DataType::FLOAT64, x.place());
  double* o = out.data<double>();
  for (int i = 0; i <= sp::kParts; ++i) o[i] = sp::ns[i];
  o[sp::kParts + 1] = sp::calls;
  o[sp::kParts + 2] = sp::rows;
  if (start == 1) {
    for (double& v : sp::ns) v = 0;
    sp::calls = sp::rows = 0;
  }
  sp::on.store(start == 1, std::memory_order_relaxed);
  return {out};
}

std::vector<std::vector<int64_t>> StackProfileShape(const std::vector<int64_t>& x, int start) {
  return {{stack_profile::kParts + 3}};
}

std::vector<paddle::DataType> StackProfileDtype(const paddle::DataType& x) { return {paddle::DataType::FLOAT64}; }

PD_BUILD_OP(fdx_stack_profile)
    .Inputs({"x"})
    .Outputs({"out"})
    .Attrs({"start: int"})
    .SetKernelFn(PD_KERNEL(StackProfile))
    .SetInferShapeFn(PD_INFER_SHAPE(StackProfileShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(StackProfileDtype));

// ---------------------------------------------------------------- fdx_release_scratch
// fdx_release_scratch(x): frees the scratch the kernels keep between calls
// (the layer loop's intermediates on this thread; the GEMM's, the
// attention's, the MoE's and the sampler's on every thread of an OpenMP
// region, each thread its own) and returns the bytes freed, int64 [1].  The runner
// calls it on sleep.  x only names the place.
std::vector<paddle::Tensor> ReleaseScratch(const paddle::Tensor& x) {
  std::atomic<int64_t> freed{layer_scratch.release()};
#pragma omp parallel
  {
    freed += fdx::release_qgemm_scratch() + fdx::release_attention_scratch() + fdx::release_moe_scratch() +
             fdx::release_sampling_scratch();
  }
  auto out = paddle::empty({1}, paddle::DataType::INT64, x.place());
  out.data<int64_t>()[0] = freed.load();
  return {out};
}

std::vector<std::vector<int64_t>> ReleaseScratchShape(const std::vector<int64_t>& x) { return {{1}}; }

std::vector<paddle::DataType> ReleaseScratchDtype(const paddle::DataType& x) { return {paddle::DataType::INT64}; }

PD_BUILD_OP(fdx_release_scratch)
    .Inputs({"x"})
    .Outputs({"freed"})
    .SetKernelFn(PD_KERNEL(ReleaseScratch))
    .SetInferShapeFn(PD_INFER_SHAPE(ReleaseScratchShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ReleaseScratchDtype));

// ---------------------------------------------------------------- fdx_add_rms_norm (small_ops.cc)
std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& x, const paddle::Tensor& residual,
                                       const paddle::Tensor& weight, float eps) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  const int64_t T = x.shape()[0], H = x.shape()[1];
  const bool has_res = residual.numel() > 0;
  PD_CHECK(!has_res || residual.numel() == T * H, "residual shape mismatch");
  PD_CHECK(weight.numel() == H, "weight shape mismatch");
  auto out = paddle::empty({T, H}, paddle::DataType::FLOAT32, x.place());
  auto res_out = paddle::empty({T, H}, paddle::DataType::FLOAT32, x.place());
  fdx::add_rms_norm(x.data<float>(), has_res ? residual.data<float>() : nullptr, weight.data<float>(), T, H, eps,
                    out.data<float>(), res_out.data<float>());
  return {out, res_out};
}

std::vector<std::vector<int64_t>> AddRmsNormShape(const std::vector<int64_t>& x, const std::vector<int64_t>& r,
                                                  const std::vector<int64_t>& w, float eps) {
  return {x, x};
}

std::vector<paddle::DataType> AddRmsNormDtype(const paddle::DataType& x, const paddle::DataType& r,
                                              const paddle::DataType& w) {
  return {x, x};
}

PD_BUILD_OP(fdx_add_rms_norm)
    .Inputs({"x", "residual", "weight"})
    .Outputs({"out", "residual_out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(AddRmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(AddRmsNormShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AddRmsNormDtype));

// ---------------------------------------------------------------- fdx_swiglu (small_ops.cc)
std::vector<paddle::Tensor> Swiglu(const paddle::Tensor& x) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  const int64_t T = x.shape()[0], F2 = x.shape()[1], F = F2 / 2;
  auto out = paddle::empty({T, F}, paddle::DataType::FLOAT32, x.place());
  fdx::swiglu(x.data<float>(), T, F, out.data<float>());
  return {out};
}

std::vector<std::vector<int64_t>> SwigluShape(const std::vector<int64_t>& x) { return {{x[0], x[1] / 2}}; }

std::vector<paddle::DataType> SwigluDtype(const paddle::DataType& x) { return {x}; }

PD_BUILD_OP(fdx_swiglu)
    .Inputs({"x"})
    .Outputs({"out"})
    .SetKernelFn(PD_KERNEL(Swiglu))
    .SetInferShapeFn(PD_INFER_SHAPE(SwigluShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SwigluDtype));

// ---------------------------------------------------------------- fdx_paged_attention (paged_attention.cc)
std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& qkv, const paddle::Tensor& kv_cache,
                                           const paddle::Tensor& rope, const paddle::Tensor& meta,
                                           const paddle::Tensor& tables, int num_heads, int num_kv_heads,
                                           int block_size, float scale, int window) {
  PD_CHECK(qkv.dtype() == paddle::DataType::FLOAT32, "qkv must be float32");
  PD_CHECK(kv_cache_dtype_ok(kv_cache), "kv_cache must be float32 or bfloat16");
  PD_CHECK(meta.dtype() == paddle::DataType::INT32 && tables.dtype() == paddle::DataType::INT32,
           "meta/tables must be int32");
  PD_CHECK(kv_cache.shape().size() == 5, "kv_cache must be [2, NB, KV, BS, D]");
  fdx::AttnShape sh{qkv.shape()[0], num_heads, num_kv_heads, static_cast<int>(kv_cache.shape()[4]), block_size,
                    kv_cache.shape()[1], tables.shape()[0], tables.shape()[1], rope.shape()[0], scale, window,
                    kv_cache.dtype() == paddle::DataType::BFLOAT16};
  PD_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  PD_CHECK(kv_cache.shape()[2] == sh.KV && kv_cache.shape()[3] == sh.BS, "kv_cache geometry mismatch");
  PD_CHECK(qkv.shape()[1] == (int64_t)(sh.H + 2 * sh.KV) * sh.D, "qkv width mismatch");
  PD_CHECK(sh.H % sh.KV == 0, "num_heads must be a multiple of num_kv_heads");
  PD_CHECK(rope.shape()[1] == sh.D, "rope width mismatch");
  // validate metadata once (never touch memory outside the cache)
  checked([&] { fdx::check_attention_meta(sh, meta.data<int>(), tables.data<int>()); });
  auto out = paddle::empty({sh.T, (int64_t)sh.H * sh.D}, paddle::DataType::FLOAT32, qkv.place());
  fdx::paged_attention(sh, qkv.data<float>(), const_cast<void*>(kv_cache.data()), rope.data<float>(),
                       meta.data<int>(), tables.data<int>(), out.data<float>());
  return {out};
}

std::vector<std::vector<int64_t>> PagedAttentionInferShape(const std::vector<int64_t>& qkv,
                                                           const std::vector<int64_t>& kv_cache,
                                                           const std::vector<int64_t>& rope,
                                                           const std::vector<int64_t>& meta,
                                                           const std::vector<int64_t>& tables, int num_heads,
                                                           int num_kv_heads, int block_size, float scale, int window) {
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
    .Attrs({"num_heads: int", "num_kv_heads: int", "block_size: int", "scale: float", "window: int"})
    .SetKernelFn(PD_KERNEL(PagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PagedAttentionInferDtype));

// ---------------------------------------------------------------- fdx_qgemv (qgemv.cc)
std::vector<paddle::Tensor> QGemv(const paddle::Tensor& x, const paddle::Tensor& w, int qtype) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  PD_CHECK(w.dtype() == paddle::DataType::UINT8, "w must be uint8");
  PD_CHECK(x.shape().size() == 2 && w.shape().size() == 2, "x and w must be 2-D");
  const int64_t M = x.shape()[0], K = x.shape()[1], N = w.shape()[0];
  const int bb = fdx::gguf_block_bytes(qtype);
  PD_CHECK(bb > 0, "unsupported quant type");
  PD_CHECK(K % 32 == 0 && w.shape()[1] == K / 32 * bb, "w row size does not match K");
  auto out = paddle::empty({M, N}, paddle::DataType::FLOAT32, x.place());
  const float* xp = x.data<float>();
  const uint8_t* wp = w.data<uint8_t>();
  float* op = out.data<float>();
  const int64_t rb = w.shape()[1];
  fdx::qgemv(xp, wp, qtype, op, M, K, N, rb);
  return {out};
}

std::vector<std::vector<int64_t>> QGemvInferShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                  int qtype) {
  return {{x[0], w[0]}};
}

std::vector<paddle::DataType> QGemvInferDtype(const paddle::DataType& x, const paddle::DataType& w) { return {x}; }

PD_BUILD_OP(fdx_qgemv)
    .Inputs({"x", "w"})
    .Outputs({"out"})
    .Attrs({"qtype: int"})
    .SetKernelFn(PD_KERNEL(QGemv))
    .SetInferShapeFn(PD_INFER_SHAPE(QGemvInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(QGemvInferDtype));

// ---------------------------------------------------------------- fdx_qgemm, fdx_qgemm_dot (qgemm.cc)
std::vector<paddle::Tensor> QGemm(const paddle::Tensor& x, const paddle::Tensor& w, int kind, int64_t n_out) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  PD_CHECK(w.dtype() == paddle::DataType::UINT8, "w must be uint8");
  PD_CHECK(x.shape().size() == 2 && w.shape().size() == 3, "x must be 2-D and w 3-D (packed)");
  PD_CHECK(fdx::packed_block_bytes(kind) > 0, "kind must be 4 (Q4_0/Q4_1), 8 (Q8_0) or 16 (bfloat16)");
  const int64_t M = x.shape()[0], K = x.shape()[1];
  PD_CHECK(K % 32 == 0, "K must be a multiple of 32");
  PD_CHECK(w.shape()[0] == (n_out + 7) / 8 && w.shape()[1] == K / 32 && w.shape()[2] == fdx::packed_block_bytes(kind),
           "packed w does not match K and n_out");
  auto out = paddle::empty({M, n_out}, paddle::DataType::FLOAT32, x.place());
  fdx::qgemm(x.data<float>(), w.data<uint8_t>(), kind, out.data<float>(), M, K, n_out);
  return {out};
}

std::vector<std::vector<int64_t>> QGemmInferShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w, int kind,
                                                  int64_t n_out) {
  return {{x[0], n_out}};
}

std::vector<paddle::DataType> QGemmInferDtype(const paddle::DataType& x, const paddle::DataType& w) { return {x}; }

PD_BUILD_OP(fdx_qgemm)
    .Inputs({"x", "w"})
    .Outputs({"out"})
    .Attrs({"kind: int", "n_out: int64_t"})
    .SetKernelFn(PD_KERNEL(QGemm))
    .SetInferShapeFn(PD_INFER_SHAPE(QGemmInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(QGemmInferDtype));

// Which dot products the build uses, as a 3-element int32 tensor: [0] int8
// (1 = vpdpbusd, 0 = vpmaddubsw), [1] bf16 (1 = vdpbf16ps, 0 = two fmas),
// [2] 1 where the int8 tiles of 16 rows run on AMX now (FDX_NATIVE_AMX);
// native.py logs them once.
std::vector<paddle::Tensor> QGemmDot(const paddle::Tensor& x) {
  auto out = paddle::empty({3}, paddle::DataType::INT32, x.place());
  fdx::qgemm_kernels(out.data<int32_t>());
  return {out};
}

std::vector<std::vector<int64_t>> QGemmDotShape(const std::vector<int64_t>& x) { return {{3}}; }

std::vector<paddle::DataType> QGemmDotDtype(const paddle::DataType& x) { return {paddle::DataType::INT32}; }

PD_BUILD_OP(fdx_qgemm_dot)
    .Inputs({"x"})
    .Outputs({"out"})
    .SetKernelFn(PD_KERNEL(QGemmDot))
    .SetInferShapeFn(PD_INFER_SHAPE(QGemmDotShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(QGemmDotDtype));

// ---------------------------------------------------------------- fdx_fgemm (moe.cc)
// fdx_fgemm(x [M, K], w [K, N]) -> x @ w in float32 through fdx::fgemm: the
// row-invariant float32 GEMM, for the rest of a float32 mixture-of-experts
// model's matmuls (fdx/model/llama.py), so its tokens keep their bits in
// any batch as the experts' do.
std::vector<paddle::Tensor> FGemm(const paddle::Tensor& x, const paddle::Tensor& w) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && w.dtype() == paddle::DataType::FLOAT32, "x and w must be float32");
  PD_CHECK(x.shape().size() == 2 && w.shape().size() == 2 && x.shape()[1] == w.shape()[0], "x [M, K] and w [K, N]");
  const int64_t M = x.shape()[0], K = x.shape()[1], N = w.shape()[1];
  auto out = paddle::empty({M, N}, paddle::DataType::FLOAT32, x.place());
  if (M > 0) fdx::fgemm(x.data<float>(), w.data<float>(), out.data<float>(), M, K, N);
  return {out};
}

std::vector<std::vector<int64_t>> FGemmShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w) {
  return {{x[0], w[1]}};
}

std::vector<paddle::DataType> FGemmDtype(const paddle::DataType& x, const paddle::DataType& w) { return {x}; }

PD_BUILD_OP(fdx_fgemm)
    .Inputs({"x", "w"})
    .Outputs({"out"})
    .SetKernelFn(PD_KERNEL(FGemm))
    .SetInferShapeFn(PD_INFER_SHAPE(FGemmShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(FGemmDtype));

// ---------------------------------------------------------------- fdx_moe (moe.cc)
std::vector<paddle::Tensor> Moe(const paddle::Tensor& h, const paddle::Tensor& router, const Tensors& gate_up,
                                const Tensors& down, int kind, int num_experts, int top_k, bool renormalize,
                                int first) {
  PD_CHECK(h.dtype() == paddle::DataType::FLOAT32 && h.shape().size() == 2, "h must be float32 [T, H]");
  PD_CHECK(kind == 0 || fdx::packed_block_bytes(kind) > 0, "kind must be 0 (float32), 4, 8 (int8) or 16 (bfloat16)");
  const int64_t T = h.shape()[0], H = h.shape()[1];
  const int E = num_experts, k = top_k;
  const int64_t n_held = static_cast<int64_t>(gate_up.size());
  PD_CHECK(E > 0 && k > 0 && k <= E, "top_k must be in 1..num_experts");
  PD_CHECK(n_held > 0 && static_cast<int64_t>(down.size()) == n_held, "gate_up and down must list the same experts");
  PD_CHECK(first >= 0 && first + n_held <= E, "the held experts [first, first + n) must be router experts");
  const int64_t F2 = kind == 0 ? (gate_up[0].shape().size() == 2 ? gate_up[0].shape()[1] : 0)
                               : gate_up[0].shape()[0] * 8;
  const int64_t F = F2 / 2;
  PD_CHECK(F > 0 && F2 % 2 == 0 && (kind == 0 || (H % 32 == 0 && F % 32 == 0)),
           "the widths must be multiples of 32 (packed kinds)");
  check_weight(router, 0, H, E, "router");
  for (int64_t e = 0; e < n_held; ++e) {
    check_weight(gate_up[e], kind, H, F2, "gate_up");
    check_weight(down[e], kind, F, H, "down");
  }
  auto out = paddle::empty({T, H}, paddle::DataType::FLOAT32, h.place());
  auto ids_t = paddle::empty({T, static_cast<int64_t>(k)}, paddle::DataType::INT32, h.place());
  std::vector<const void*> gu(n_held), dn(n_held);
  for (int64_t e = 0; e < n_held; ++e) {
    gu[e] = kind == 0 ? static_cast<const void*>(gate_up[e].data<float>()) : gate_up[e].data<uint8_t>();
    dn[e] = kind == 0 ? static_cast<const void*>(down[e].data<float>()) : down[e].data<uint8_t>();
  }
  fdx::moe({T, H, F, E, k, first, n_held, kind, renormalize}, h.data<float>(), router.data<float>(), gu.data(),
           dn.data(), out.data<float>(), ids_t.data<int32_t>());
  return {out, ids_t};
}

std::vector<std::vector<int64_t>> MoeShape(const std::vector<int64_t>& h, const std::vector<int64_t>& router,
                                           const std::vector<std::vector<int64_t>>& gate_up,
                                           const std::vector<std::vector<int64_t>>& down, int kind, int num_experts,
                                           int top_k, bool renormalize, int first) {
  return {h, {h[0], static_cast<int64_t>(top_k)}};
}

std::vector<paddle::DataType> MoeDtype(const paddle::DataType& h, const paddle::DataType& router,
                                       const std::vector<paddle::DataType>& gate_up,
                                       const std::vector<paddle::DataType>& down) {
  return {h, paddle::DataType::INT32};
}

PD_BUILD_OP(fdx_moe)
    .Inputs({"h", "router", paddle::Vec("gate_up"), paddle::Vec("down")})
    .Outputs({"out", "ids"})
    .Attrs({"kind: int", "num_experts: int", "top_k: int", "renormalize: bool", "first: int"})
    .SetKernelFn(PD_KERNEL(Moe))
    .SetInferShapeFn(PD_INFER_SHAPE(MoeShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(MoeDtype));
