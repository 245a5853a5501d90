// fdx tensor-parallel collectives over shared memory, for the ranks of one
// host (fdx/parallel/shm_comm.py loads this with ctypes, so the calling
// thread releases the GIL while it waits: the engine's heartbeat goes on).
//
// Segment layout (created by rank 0, mapped by every rank):
//
//   line r (r < world), 64 bytes: uint64 seq (the last round rank r entered),
//                                 int32 pid
//   line world:                   the abort line: 0, or 1 + the rank at fault, why, its pid
//   data, from offset data_offset(world): two buffers (round parity) of
//   `world` slots of `slot_elems` floats.
//
// A round: wait until every rank has entered the previous round (then every
// rank has finished reading this parity's buffer two rounds ago), copy my
// chunk into my slot, publish seq (release), wait until every rank has
// published seq (acquire), read the slots.  The all-reduce sums the slots in
// rank order 0..world-1, so every rank gets the same bits.  A gather only
// has rank 0 read.  Larger tensors go in several rounds of slot_elems.
//
// Waiting spins briefly, then yields, then sleeps in short naps; every few
// milliseconds it checks the deadline, the abort line and whether a peer's
// process has exited (/proc/<pid>/stat gone or a zombie).  A failure sets the
// abort line -- the rank at fault and why -- (every other rank then fails at
// once with the same message), writes a one-line message into `err` and
// returns non-zero; the group cannot be used again.

#include <immintrin.h>
#include <sched.h>
#include <time.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

struct alignas(64) Line {
  std::atomic<uint64_t> seq;
  std::atomic<int32_t> pid;
  // the abort line only: 0, -1 (being set), or 1 + the rank at fault; why; its pid; its timeout (ms)
  std::atomic<int32_t> abort;
  std::atomic<int32_t> reason;
  std::atomic<int32_t> culprit_pid;
  std::atomic<int64_t> waited_ms;
};

enum Reason { kExited = 1, kTimedOut = 2, kStopped = 3, kFailed = 4 };

static_assert(sizeof(Line) == 64, "one cache line per rank");

inline Line* line(void* base, int r) { return reinterpret_cast<Line*>(base) + r; }

inline int64_t data_offset(int world) { return ((int64_t(world + 1) * 64 + 4095) / 4096) * 4096; }

inline float* slot(void* base, int world, int64_t slot_elems, uint64_t seq, int r) {
  float* data = reinterpret_cast<float*>(reinterpret_cast<char*>(base) + data_offset(world));
  return data + (int64_t(seq & 1) * world + r) * slot_elems;
}

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// 'R'unning/'S'leeping/'T' stopped...; 'Z' zombie, 'X' dead or 0 (gone) mean exited
char proc_state(int pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return 0;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces
  return (p != nullptr && p[1] == ' ') ? p[2] : 0;
}

// Mark the group broken by `culprit` (the first one to call wins).
void set_abort(void* base, int world, int culprit, int reason, int pid, int64_t waited_ms) {
  Line* ab = line(base, world);
  int32_t expected = 0;
  if (!ab->abort.compare_exchange_strong(expected, -1)) return;
  ab->reason.store(reason, std::memory_order_relaxed);
  ab->culprit_pid.store(pid, std::memory_order_relaxed);
  ab->waited_ms.store(waited_ms, std::memory_order_relaxed);
  ab->abort.store(culprit + 1, std::memory_order_release);
}

// The one-line account of why the group broke (the same on every rank).
int describe(void* base, int world, char* err, int errlen) {
  Line* ab = line(base, world);
  const int r = ab->abort.load(std::memory_order_acquire) - 1;
  const int pid = ab->culprit_pid.load(std::memory_order_relaxed);
  switch (ab->reason.load(std::memory_order_relaxed)) {
    case kExited:
      std::snprintf(err, errlen, "tensor-parallel rank %d (pid %d) exited", r, pid);
      break;
    case kTimedOut:
    case kStopped:
      std::snprintf(err, errlen, "tensor-parallel rank %d (pid %d) did not reach the collective within %.1f s%s", r,
                    pid, ab->waited_ms.load() / 1000.0,
                    ab->reason.load() == kStopped ? " (the process is stopped)" : "");
      break;
    default:
      std::snprintf(err, errlen, "tensor-parallel rank %d (pid %d) failed and broke the group (its log says why)",
                    r, pid);
  }
  return 1;
}

// Wait until every rank has entered round `target`.
int wait_all(void* base, int rank, int world, uint64_t target, int64_t timeout_ms, char* err, int errlen) {
  Line* ab = line(base, world);
  for (int r = 0; r < world; ++r) {
    Line* l = line(base, r);
    if (l->seq.load(std::memory_order_acquire) >= target) continue;
    const int64_t start = now_ns();
    int64_t next_check = start + 2000000;
    for (uint64_t spins = 0;; ++spins) {
      if (l->seq.load(std::memory_order_acquire) >= target) break;
      if (spins < 4096) {
        _mm_pause();
        continue;
      }
      if (spins < 8192) {
        sched_yield();
      } else {
        timespec nap = {0, 20000};
        nanosleep(&nap, nullptr);
      }
      const int64_t t = now_ns();
      if (t < next_check) continue;
      next_check = t + 2000000;
      if (ab->abort.load(std::memory_order_acquire) > 0) return describe(base, world, err, errlen);
      const int pid = l->pid.load(std::memory_order_relaxed);
      const char st = pid > 0 ? proc_state(pid) : 'R';
      // a rank publishes before it exits: read its state first, then its seq once more
      if (l->seq.load(std::memory_order_acquire) >= target) break;
      if (st == 0 || st == 'Z' || st == 'X') {
        set_abort(base, world, r, kExited, pid, 0);
        return describe(base, world, err, errlen);
      }
      if ((t - start) / 1000000 >= timeout_ms) {
        set_abort(base, world, r, st == 'T' ? kStopped : kTimedOut, pid, timeout_ms);
        return describe(base, world, err, errlen);
      }
    }
  }
  (void)rank;
  if (ab->abort.load(std::memory_order_acquire) > 0) return describe(base, world, err, errlen);
  return 0;
}

}  // namespace

extern "C" {

int64_t fdx_tp_data_offset(int world) { return data_offset(world); }

void fdx_tp_set_pid(void* base, int rank, int pid) { line(base, rank)->pid.store(pid, std::memory_order_release); }

void fdx_tp_abort(void* base, int world, int rank) {
  set_abort(base, world, rank, kFailed, line(base, rank)->pid.load(std::memory_order_relaxed), 0);
}

// out = sum over ranks (in rank order) of every rank's x; n floats.  out may be x.
int fdx_tp_all_reduce(void* base, int rank, int world, int64_t slot_elems, const float* x, float* out, int64_t n,
                      int64_t timeout_ms, char* err, int errlen) {
  Line* me = line(base, rank);
  for (int64_t off = 0; off < n; off += slot_elems) {
    const int64_t c = n - off < slot_elems ? n - off : slot_elems;
    const uint64_t seq = me->seq.load(std::memory_order_relaxed) + 1;
    int rc = wait_all(base, rank, world, seq - 1, timeout_ms, err, errlen);
    if (rc != 0) return rc;
    std::memcpy(slot(base, world, slot_elems, seq, rank), x + off, size_t(c) * sizeof(float));
    me->seq.store(seq, std::memory_order_release);
    rc = wait_all(base, rank, world, seq, timeout_ms, err, errlen);
    if (rc != 0) return rc;
    float* o = out + off;
    const float* s0 = slot(base, world, slot_elems, seq, 0);
    std::memcpy(o, s0, size_t(c) * sizeof(float));
    for (int r = 1; r < world; ++r) {
      const float* s = slot(base, world, slot_elems, seq, r);
      for (int64_t i = 0; i < c; ++i) o[i] += s[i];
    }
  }
  return 0;
}

// Rank 0's out [rows, world * cols] = every rank's x [rows, cols] side by side
// (rank r's columns at r * cols); the other ranks only send (out unused).
int fdx_tp_gather(void* base, int rank, int world, int64_t slot_elems, const float* x, float* out, int64_t rows,
                  int64_t cols, int64_t timeout_ms, char* err, int errlen) {
  Line* me = line(base, rank);
  const int64_t n = rows * cols;
  for (int64_t off = 0; off < n; off += slot_elems) {
    const int64_t c = n - off < slot_elems ? n - off : slot_elems;
    const uint64_t seq = me->seq.load(std::memory_order_relaxed) + 1;
    int rc = wait_all(base, rank, world, seq - 1, timeout_ms, err, errlen);
    if (rc != 0) return rc;
    if (rank != 0) std::memcpy(slot(base, world, slot_elems, seq, rank), x + off, size_t(c) * sizeof(float));
    me->seq.store(seq, std::memory_order_release);
    if (rank != 0) continue;
    rc = wait_all(base, rank, world, seq, timeout_ms, err, errlen);
    if (rc != 0) return rc;
    for (int r = 0; r < world; ++r) {
      const float* s = r == 0 ? x + off : slot(base, world, slot_elems, seq, r);
      int64_t i = 0;
      while (i < c) {  // a run within one row
        const int64_t flat = off + i, row = flat / cols, col = flat % cols;
        const int64_t len = (cols - col) < (c - i) ? (cols - col) : (c - i);
        std::memcpy(out + row * world * cols + r * cols + col, s + i, size_t(len) * sizeof(float));
        i += len;
      }
    }
  }
  return 0;
}

}  // extern "C"
