// fdx_sample_rows: the random rows of a step's sampling (fdx/model/sampler.py,
// Sampler._sample_random), in O(V) a row, the rows spread over the OpenMP team.
// A plain C entry point (no Paddle types): the sampler calls it through ctypes
// on NumPy buffers.
//
// Per row -- the logits z of V tokens, the row's inverse temperature, top_k
// (0: off), top_p (1: off), min_p (0: off) and one uniform draw u in (0, 1]:
//   1. p_i = exp((z_i - max z) * inv_t), float32, simd_math.h's exp; p_i = 0
//      where that exponent is below -87 (a masked -inf token) or NaN.  The
//      most likely token has p = 1.
//   2. min_p: tokens with p < min_p drop out (p is already relative to the top).
//   3. top_k: of the survivors, the k most likely stay (ties with the k-th too).
//   4. top_p: of the survivors, the smallest set of most likely tokens whose
//      mass reaches top_p of theirs stays (ties with its last one too).
//   5. the token: the first index, in vocabulary order, where the survivors'
//      running mass reaches u times their total.
// Every step keeps the tokens with p >= one threshold, so a row is three
// vector passes over its V values (max, exp, a sum) plus the threshold search
// and the draw.  That is the distribution of the NumPy path
// (tests/test_sampler.py checks both against a float64 reference), which
// partitions and sorts instead.
//
// The thresholds.  top_p: the survivors below c weigh at most what the
// nucleus leaves out when c = (1 - top_p) * total / V, and for the largest
// power of two c whose survivors below (summed in one vector pass a probe of
// a binary search) still do; the nucleus is among the survivors >= c --
// usually a few dozen values, thousands on a flat row -- found by a
// quickselect on mass.  top_k: a histogram of the survivors by float bits (the
// bits >> 21, a quarter of a binade a bucket; p <= 1, so 509 buckets), walked
// from the top to the bucket of the k-th value, whose values alone are
// sorted.  Values below 2^-64 stay out of the histogram and are sorted only
// when the k-th value is among them.  With few survivors (top_p, or top_k up
// to kCandidates) the draw visits them alone, skipping whole vectors below
// the threshold.
//
// Determinism: every sum is in a fixed order (in double: four interleaved
// partial sums, then (s0 + s1) + (s2 + s3), blocks of 256 in order; the float
// estimates in simd_math.h's 16 canonical lanes), the selections see their
// candidates in index order, and exp is simd_math.h's lane-wise one, so a
// row's token depends only on its logits, parameters and u -- not on the
// batch, the thread count or the kernel set.

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "kernels.h"
#include "simd_math.h"

namespace {
namespace v = fdx::simd;

constexpr int kShift = 21;
constexpr int kBuckets = (0x3F800000 >> kShift) + 1;  // p in [0, 1]; 1.0f is in the last one
constexpr int64_t kBlock = 256;
constexpr float kCut = 0x1p-64f;
// top_k rows with k up to this draw by skipping the rest (few survivors).
constexpr int64_t kCandidates = 4096;

inline int bucket_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return std::min<int>(static_cast<int>(u >> kShift), kBuckets - 1);
}

struct Scratch {
  std::vector<float> p, vals;
  std::vector<double> bsum;
  std::vector<std::pair<float, int64_t>> best;  // fdx_logprobs_rows' k largest so far: (value, index), best first
  int64_t cnt[4][kBuckets];
  double mass[4][kBuckets];
};

// p = exp((z - max z) * inv_t), 0 below exp's range (a -inf logit) or for NaN;
// returns the max used (0 when the row has no finite one).
float probs(const float* z, int64_t V, float inv_t, float* p) {
  v::vf mv = v::set1(-INFINITY);
  int64_t i = 0;
  for (; i + v::kLanes <= V; i += v::kLanes) mv = v::max(mv, v::load(z + i));
  float m = v::reduce_max(mv);
  for (; i < V; ++i) m = std::max(m, z[i]);
  if (!std::isfinite(m)) m = 0.f;  // as the NumPy path: an all -inf row has no mass
  const v::vf mm = v::set1(m), tv = v::set1(inv_t);
  for (i = 0; i + v::kLanes <= V; i += v::kLanes) {
    const v::vf x = v::mul(v::sub(v::load(z + i), mm), tv);
    v::store(p + i, v::zero_below(x, -87.f, v::exp(x)));
  }
  if (i < V) {
    const int c = static_cast<int>(V - i);
    const v::vf x = v::mul(v::sub(v::load_first(z + i, c), mm), tv);
    v::store_first(p + i, v::zero_below(x, -87.f, v::exp(x)), c);
  }
  return m;
}

// The survivors' (p >= thr) sum over [a, b), in the fixed order.
double survivors_sum(const float* p, int64_t a, int64_t b, float thr) {
  double s[4] = {0, 0, 0, 0};
  int64_t i = a;
  for (; i + 4 <= b; i += 4)
    for (int j = 0; j < 4; ++j) s[j] += p[i + j] >= thr ? p[i + j] : 0.f;
  for (int j = 0; i < b; ++i, ++j) s[j] += p[i] >= thr ? p[i] : 0.f;
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// Counts and masses of the survivors at or above the cut, by bucket (in cnt[0], mass[0]).
void histogram(const float* p, int64_t V, float thr, Scratch& s) {
  std::memset(s.cnt, 0, sizeof s.cnt);
  std::memset(s.mass, 0, sizeof s.mass);
  const float lo = std::max(thr, kCut);
  for (int64_t i = 0; i < V; ++i) {
    const float x = p[i];
    if (x >= lo) {
      const int b = bucket_of(x), j = static_cast<int>(i & 3);
      s.cnt[j][b] += 1;
      s.mass[j][b] += x;
    }
  }
  for (int b = 0; b < kBuckets; ++b) {
    s.cnt[0][b] += s.cnt[1][b] + s.cnt[2][b] + s.cnt[3][b];
    s.mass[0][b] = (s.mass[0][b] + s.mass[1][b]) + (s.mass[2][b] + s.mass[3][b]);
  }
}

// Calls f(i, p[i]) for the i in [0, V) with p[i] >= t, in index order (whole
// vectors below t are skipped), until f returns true; returns that i, or -1.
template <typename F>
int64_t visit_at_least(const float* p, int64_t V, float t, F&& f) {
  const v::vf tv = v::set1(t);
  int64_t i = 0;
  for (; i + v::kLanes <= V; i += v::kLanes) {
    for (unsigned m = v::ge_mask(v::load(p + i), tv); m != 0; m &= m - 1) {
      const int64_t k = i + __builtin_ctz(m);
      if (f(k, p[k])) return k;
    }
  }
  for (; i < V; ++i)
    if (p[i] >= t && f(i, p[i])) return i;
  return -1;
}

// The survivors of bucket b (or, b < 0, every survivor below the cut), largest first.
void gather(const float* p, int64_t V, float thr, int b, std::vector<float>& out) {
  out.clear();
  const float lo = std::max(thr, kCut);
  if (b >= 0) {
    visit_at_least(p, V, lo, [&](int64_t, float x) {
      if (bucket_of(x) == b) out.push_back(x);
      return false;
    });
  } else {
    visit_at_least(p, V, thr, [&](int64_t, float x) {
      if (x < lo && x > 0.f) out.push_back(x);
      return false;
    });
  }
  std::sort(out.begin(), out.end(), std::greater<float>());
}

// The k-th largest survivor (thr if there are at most k).
float kth_value(const float* p, int64_t V, float thr, int64_t k, Scratch& s) {
  histogram(p, V, thr, s);
  int64_t above = 0;
  for (int b = kBuckets - 1; b >= 0; --b) {
    const int64_t c = s.cnt[0][b];
    if (c > 0 && above + c >= k) {
      gather(p, V, thr, b, s.vals);
      return s.vals[k - above - 1];
    }
    above += c;
  }
  gather(p, V, thr, -1, s.vals);  // the k-th is below the cut, or there are not k survivors
  return above + static_cast<int64_t>(s.vals.size()) >= k ? s.vals[k - above - 1] : thr;
}

// The survivors' (p >= thr) mass below c, in float lanes: an estimate within
// ~1e-4 of itself (so it is compared with a budget that has a 1% margin).
// Summed in simd_math.h's 16 canonical lanes (then its fixed tree and the
// tail in order): the same bits with either kernel set.
float mass_below(const float* p, int64_t V, float thr, float c) {
  v::v16 acc = v::zero16();
  int64_t i = 0;
  for (; i + 16 <= V; i += 16)
    for (int j = 0; j < v::kParts; ++j) {
      const v::vf x = v::load(p + i + j * v::kLanes), k = v::zero_below(x, thr, x);
      acc.p[j] = v::add(acc.p[j], v::sub(k, v::zero_below(k, c, k)));
    }
  float m = v::reduce_add(acc);
  for (; i < V; ++i)
    if (p[i] >= thr && p[i] < c) m += p[i];
  return m;
}

// The smallest value of the largest values of a[0, n) whose mass (largest
// first) first reaches need: a quickselect on mass, O(n) expected.  Each round
// splits the values around a pivot (median of three), keeps the upper part if
// its mass reaches need, else takes it whole and goes on in the lower part.
float mass_select(float* a, int64_t n, double need) {
  while (n > 32) {
    float x0 = a[0], x1 = a[n / 2], x2 = a[n - 1];
    const float pivot = std::max(std::min(x0, x1), std::min(std::max(x0, x1), x2));
    float* mid = std::partition(a, a + n, [pivot](float x) { return x >= pivot; });
    const int64_t up = mid - a;
    double mass = 0;
    for (int64_t i = 0; i < up; ++i) mass += a[i];
    if (mass >= need) {
      if (up == n) break;  // every value >= the pivot (ties): sort what is left
      n = up;
    } else {
      if (up == n) return a[n - 1];  // rounding: all of them
      need -= mass;
      a = mid;
      n -= up;
    }
  }
  std::sort(a, a + n, std::greater<float>());
  double cum = 0;
  for (int64_t i = 0; i < n; ++i) {
    cum += a[i];
    if (cum >= need) return a[i];
  }
  return n > 0 ? a[n - 1] : 0.f;  // rounding: all of them
}

// The smallest p of the nucleus: the most likely survivors (p >= thr) whose
// mass first reaches top_p of their total.  The survivors below
// c0 = (1 - top_p) * total / V weigh less than V * c0, the mass the nucleus
// leaves out, so the nucleus is among those >= c0; c0 then rises to the
// largest power of two whose survivors below still weigh at most that (a
// binary search, one vector pass a probe).  The candidates left, usually a
// few dozen, are selected by mass.
float nucleus_value(const float* p, int64_t V, float thr, double top_p, Scratch& s) {
  const double total = survivors_sum(p, 0, V, thr), limit = top_p * total;
  const double budget = (1.0 - top_p) * total * 0.99;  // the mass the nucleus may leave out, less a margin
  float c0 = std::max(thr, static_cast<float>(budget / static_cast<double>(V)));
  // Tighter: the largest c = 2^-j (binary search on j) whose survivors below weigh at most the budget.
  int lo = 0, hi = 64;  // 2^-64 = kCut
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (mass_below(p, V, thr, std::ldexp(1.f, -mid)) <= budget) hi = mid;
    else lo = mid + 1;
  }
  c0 = std::max(c0, std::ldexp(1.f, -lo));
  s.vals.clear();
  visit_at_least(p, V, c0, [&](int64_t, float x) {
    if (x > 0.f) s.vals.push_back(x);
    return false;
  });
  if (s.vals.empty()) return thr;
  return std::max(thr, mass_select(s.vals.data(), static_cast<int64_t>(s.vals.size()), limit));
}

// The first index, in vocabulary order, where the survivors' running mass reaches u times their total.
// few: the survivors are few (a top_k or top_p cut): two scans that skip the rest,
// summing in the same order (the second always reaches the target); else block sums.
int64_t draw(const float* p, int64_t V, float thr, double u, bool few, Scratch& s) {
  if (few) {
    double total = 0;
    visit_at_least(p, V, thr, [&](int64_t, float x) {
      total += x;
      return false;
    });
    if (!(total > 0)) return 0;
    const double target = std::max(u, 1e-12) * total;
    double cum = 0;
    int64_t last = 0;
    const int64_t i = visit_at_least(p, V, thr, [&](int64_t k, float x) {
      cum += x;
      if (x > 0.f) last = k;
      return x > 0.f && cum >= target;
    });
    return i >= 0 ? i : last;
  }
  const int64_t nb = (V + kBlock - 1) / kBlock;
  if (static_cast<int64_t>(s.bsum.size()) < nb) s.bsum.resize(nb);
  double total = 0;
  for (int64_t b = 0; b < nb; ++b) total += s.bsum[b] = survivors_sum(p, b * kBlock, std::min(V, (b + 1) * kBlock), thr);
  if (!(total > 0)) return 0;
  const double target = std::max(u, 1e-12) * total;
  double cum = 0;
  int64_t last = -1;
  for (int64_t b = 0; b < nb; ++b) {
    if (s.bsum[b] > 0 && cum + s.bsum[b] >= target) {
      for (int64_t i = b * kBlock; i < std::min(V, (b + 1) * kBlock); ++i) {
        const float x = p[i];
        if (x >= thr && x > 0.f) {
          cum += x;
          last = i;
          if (cum >= target) return i;
        }
      }
      return last;  // the block's sum reached the target, its values one by one did not
    }
    cum += s.bsum[b];
  }
  for (int64_t i = V - 1; i >= 0; --i)  // rounding at u ~ 1: the last survivor
    if (p[i] >= thr && p[i] > 0.f) return i;
  return 0;
}

thread_local Scratch sampling_scratch;  // one per thread, shared by the entry points (fdx::release_sampling_scratch)

Scratch& thread_scratch() { return sampling_scratch; }

// Calls f(r, s, p) for every row r in [0, n): the rows spread over the
// OpenMP team, each thread with its own Scratch s and s.p (V floats) as p.
// Rows are handed out one at a time through an atomic counter, not an
// `omp for schedule(dynamic)`: GCC emits GOMP_loop_nonmonotonic_dynamic_*
// for that, which Paddle's libiomp5 (the runtime the ops link) lacks, and
// libgomp's -- resolved instead -- does not know libiomp5's team, so every
// thread ran every row.
template <typename F>
void each_row(int64_t n, int64_t V, F&& f) {
  std::atomic<int64_t> next{0};
#pragma omp parallel if (n > 1)
  {
    Scratch& s = thread_scratch();  // each thread's own, looked up once
    if (static_cast<int64_t>(s.p.size()) < V) s.p.resize(V);
    for (int64_t r = next++; r < n; r = next++) f(r, s, s.p.data());
  }
}

}  // namespace

// logits: rows ld floats apart; row r of the call is logits row rows[r].
// top_k must be 0 (off) or in [1, V); top_p in [0, 1] (1: off); min_p in [0, 1]
// (0: off); u in (0, 1].  Writes out[r]; returns 0.
extern "C" int fdx_sample_rows(const float* logits, int64_t ld, const int64_t* rows, int64_t n, int64_t V,
                               const float* inv_t, const int64_t* top_k, const double* top_p, const float* min_p,
                               const double* u, int64_t* out) {
  each_row(n, V, [&](int64_t r, Scratch& s, float* p) {
    probs(logits + rows[r] * ld, V, inv_t[r], p);
    float thr = min_p[r] > 0.f ? min_p[r] : 0.f;
    bool few = false;
    if (top_k[r] > 0 && top_k[r] < V) {
      thr = std::max(thr, kth_value(p, V, thr, top_k[r], s));
      few = top_k[r] <= kCandidates;
    }
    if (top_p[r] < 1.0) {
      const float t = nucleus_value(p, V, thr, top_p[r], s);
      few = few || t > thr;  // a cut: the nucleus is among the candidates
      thr = std::max(thr, t);
    }
    out[r] = draw(p, V, thr, u[r], few, s);
  });
  return 0;
}

namespace {

constexpr int L = v::kLanes;
constexpr unsigned kAll = (1u << L) - 1u;

// One row's greedy token, as NumPy's argmax: the first index of the
// largest value, or of the first NaN when the row has one (two vector
// passes: the max of the ordered values and whether any is NaN, then the
// first index that holds it).
int64_t argmax_row(const float* z, int64_t V) {
  v::vf m = v::set1(-INFINITY);
  unsigned nan = 0;
  int64_t j = 0;
  for (; j + L <= V; j += L) {
    const v::vf x = v::load(z + j);
    m = v::max(x, m);                 // a NaN lane keeps m
    nan |= ~v::ge_mask(x, x) & kAll;  // x >= x fails only for NaN
  }
  float mx = v::reduce_max(m);
  for (int64_t k = j; k < V; ++k) {
    nan |= std::isnan(z[k]);
    if (z[k] > mx) mx = z[k];
  }
  if (nan) {
    for (int64_t k = 0; k < V; ++k)
      if (std::isnan(z[k])) return k;
  }
  const v::vf t = v::set1(mx);
  for (j = 0; j + L <= V; j += L)
    if (const unsigned hit = v::ge_mask(v::load(z + j), t)) return j + __builtin_ctz(hit);
  for (; j < V; ++j)
    if (z[j] >= mx) return j;
  return 0;  // V == 0
}

}  // namespace

// fdx_argmax_rows: the greedy token of each of n rows (ld floats apart) of
// V logits, out[r] (Sampler.sample's greedy rows).  Returns 0.
extern "C" int fdx_argmax_rows(const float* logits, int64_t ld, int64_t n, int64_t V, int64_t* out) {
  std::atomic<int64_t> next{0};
#pragma omp parallel if (n > 1)
  for (int64_t r = next++; r < n; r = next++) out[r] = argmax_row(logits + r * ld, V);
  return 0;
}

int64_t fdx::release_sampling_scratch() {
  Scratch& s = sampling_scratch;
  const int64_t bytes = static_cast<int64_t>((s.p.capacity() + s.vals.capacity()) * sizeof(float) +
                                             s.bsum.capacity() * sizeof(double) +
                                             s.best.capacity() * sizeof(std::pair<float, int64_t>));
  std::vector<float>().swap(s.p);  // (assigning {} would keep the capacity)
  std::vector<float>().swap(s.vals);
  std::vector<double>().swap(s.bsum);
  std::vector<std::pair<float, int64_t>>().swap(s.best);
  return bytes;
}

// fdx_logprobs_rows: the logprobs of a step's rows that asked for them
// (Sampler._logprobs), from the RAW logits z (before penalties and
// temperature, as vLLM and the NumPy path report them): lse = m + log(sum
// exp(z - m)) (m the row's max, 0 if not finite; exp as above, in float32;
// the sum in double in the fixed order), chosen[r] = z[token] - lse, and the
// k largest z (ties: the lower index first), largest first, as ids and
// z - lse.  top_ids / top_vals are [n, k] (k may be 0).  Returns 0.
extern "C" int fdx_logprobs_rows(const float* logits, int64_t ld, const int64_t* rows, int64_t n, int64_t V,
                                 const int64_t* tokens, int64_t k, double* chosen, int64_t* top_ids,
                                 double* top_vals) {
  each_row(n, V, [&](int64_t r, Scratch& s, float* p) {
    const float* z = logits + rows[r] * ld;
    const float m = probs(z, V, 1.f, p);  // (z - m) * 1 is z - m exactly
    const double lse = static_cast<double>(m) + std::log(survivors_sum(p, 0, V, 0.f));
    chosen[r] = static_cast<double>(z[tokens[r]]) - lse;
    if (k <= 0) return;
    // the k largest: a running list, best first; once it holds k, only a
    // value above its last enters (whole vectors below that are skipped)
    auto& best = s.best;
    best.clear();
    float floor_v = -INFINITY;
    auto offer = [&](int64_t j, float x) {
      if (static_cast<int64_t>(best.size()) == k && !(x > floor_v)) return;
      auto at = std::upper_bound(best.begin(), best.end(), x,
                                 [](float a, const std::pair<float, int64_t>& b) { return a > b.first; });
      best.insert(at, {x, j});
      if (static_cast<int64_t>(best.size()) > k) best.pop_back();
      if (static_cast<int64_t>(best.size()) == k) floor_v = best.back().first;
    };
    int64_t i = 0;
    for (; i + v::kLanes <= V; i += v::kLanes) {
      for (unsigned msk = v::ge_mask(v::load(z + i), v::set1(floor_v)); msk != 0; msk &= msk - 1) {
        const int64_t j = i + __builtin_ctz(msk);
        offer(j, z[j]);
      }
    }
    for (; i < V; ++i) offer(i, z[i]);
    for (int64_t j = 0; j < k; ++j) {
      const bool have = j < static_cast<int64_t>(best.size());
      top_ids[r * k + j] = have ? best[j].second : 0;
      top_vals[r * k + j] = have ? static_cast<double>(best[j].first) - lse : -INFINITY;
    }
  });
  return 0;
}
