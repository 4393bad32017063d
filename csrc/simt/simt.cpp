// The SIMT emulator's runtime: fibers, the block scheduler, barriers, warp
// collectives, launches and the errors they raise. See simt.h.
#include "simt/simt.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csetjmp>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define FUSEDLLM_SIMT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUSEDLLM_SIMT_ASAN 1
#endif
#endif
#if defined(FUSEDLLM_SIMT_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace fusedllm::simt {

// ---------------------------------------------------------------------------
// Fibers: a saved stack pointer and a small context switch (x86-64 System V
// callee-saved registers; no kernel changes the floating-point control
// registers, so they are not switched); ucontext elsewhere.
// ---------------------------------------------------------------------------

#if defined(__x86_64__)
extern "C" void fusedllm_simt_switch(void** save_sp, void* new_sp);
extern "C" void fusedllm_simt_trampoline();
asm(R"(
  .text
  .p2align 4
  .globl fusedllm_simt_switch
  .hidden fusedllm_simt_switch
  .type fusedllm_simt_switch,@function
fusedllm_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fusedllm_simt_switch, .-fusedllm_simt_switch

  .p2align 4
  .globl fusedllm_simt_trampoline
  .hidden fusedllm_simt_trampoline
  .type fusedllm_simt_trampoline,@function
fusedllm_simt_trampoline:
  movq %r13, %rdi
  callq *%r12
  ud2
  .size fusedllm_simt_trampoline, .-fusedllm_simt_trampoline
)");

struct Context {
  void* sp = nullptr;
};

// A fresh context that calls fn(arg) on the stack below `top` when first
// switched to. fn must never return.
void context_init(Context& c, char* top, void (*fn)(void*), void* arg) {
  auto* slot = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15)) - 8);
  // The return slot holds the trampoline: at `ret` the stack is 16-byte aligned.
  slot[0] = reinterpret_cast<uint64_t>(&fusedllm_simt_trampoline);
  slot[-1] = 0;                                    // rbp
  slot[-2] = 0;                                    // rbx
  slot[-3] = reinterpret_cast<uint64_t>(fn);       // r12
  slot[-4] = reinterpret_cast<uint64_t>(arg);      // r13
  slot[-5] = 0;                                    // r14
  slot[-6] = 0;                                    // r15
  c.sp = &slot[-6];
}

inline void context_switch(Context& from, Context& to) { fusedllm_simt_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};

void context_init(Context& c, char* top, size_t size, void (*fn)(void*), void* arg);

inline void context_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

namespace {

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::atoi(v);
}

// A memory region with an inaccessible guard page below (stacks, which grow
// down) or above (shared memory, read upward) its usable bytes.
struct GuardedRegion {
  char* map = nullptr;
  size_t map_size = 0;
  char* guard = nullptr;  // first byte of the guard page
  char* usable = nullptr;
  size_t usable_size = 0;

  GuardedRegion() = default;
  GuardedRegion(const GuardedRegion&) = delete;
  GuardedRegion& operator=(const GuardedRegion&) = delete;
  ~GuardedRegion() { release(); }

  void release() {
#if defined(FUSEDLLM_SIMT_ASAN)
    // Frames that never unwound leave poisoned shadow; whatever maps these
    // addresses next must not inherit it.
    if (map != nullptr) ASAN_UNPOISON_MEMORY_REGION(map, map_size);
#endif
    if (map != nullptr) munmap(map, map_size);
    map = guard = usable = nullptr;
    map_size = usable_size = 0;
  }

  void allocate(size_t bytes, bool guard_below) {
    release();
    const size_t ps = page_size();
    map_size = round_up(std::max<size_t>(bytes, 1), ps) + ps;
    void* p = mmap(nullptr, map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(p != MAP_FAILED, "fusedllm simt: could not map ", map_size, " bytes");
    map = static_cast<char*>(p);
    guard = guard_below ? map : map + map_size - ps;
    TORCH_CHECK(mprotect(guard, ps, PROT_NONE) == 0, "fusedllm simt: mprotect failed");
    usable_size = map_size - ps;
    usable = guard_below ? map + ps : map;
  }

  bool in_guard(const void* addr) const {
    const char* a = static_cast<const char*>(addr);
    return map != nullptr && a >= guard && a < guard + page_size();
  }
};

// ---------------------------------------------------------------------------
// Settings and counters
// ---------------------------------------------------------------------------

std::atomic<int> g_schedule{-1};
std::atomic<int> g_workers{0};
std::atomic<uint64_t> g_seed{0};
std::atomic<int64_t> g_launches{0}, g_blocks{0}, g_threads{0}, g_barriers{0}, g_collectives{0};
// Per SharedAccess kind: warp instructions and their bank conflicts.
std::atomic<int64_t> g_shared_accesses[2]{}, g_shared_conflicts[2]{};
std::mutex g_kernel_launches_mutex;
std::map<std::string, int64_t> g_kernel_launches;

std::mutex g_attr_mutex;
std::unordered_map<const void*, size_t> g_max_dynamic_smem;

size_t stack_bytes() {
#if defined(FUSEDLLM_SIMT_ASAN)
  constexpr int kDefaultKb = 1024;
#else
  constexpr int kDefaultKb = 256;
#endif
  static const size_t bytes = static_cast<size_t>(std::max(env_int("FUSEDLLM_SIMT_STACK_KB", kDefaultKb), 16)) * 1024;
  return bytes;
}

}  // namespace

// ---------------------------------------------------------------------------
// Blocks, warps, threads
// ---------------------------------------------------------------------------

enum class RunState : uint8_t { kReady, kRunning, kBarrier, kCollective, kExited };

struct BlockState;

// One emulated thread: its indices, where it waits, its fiber.
struct ThreadState {
  uint3 idx{};
  int lane = 0, warp = 0;
  RunState state = RunState::kReady;
  const char* file = nullptr;  // where it waits
  int line = 0;
  uint64_t result = 0;  // of its last warp collective
  Context ctx;
  GuardedRegion* stack = nullptr;
  BlockState* block = nullptr;
  // Shared-memory offsets of its ldmatrix / cp.async rows since the last barrier.
  std::vector<int64_t> shared_accesses[2];
};

struct PendingCollective {
  detail::Collective kind;
  unsigned mask = 0, arrived = 0;
  int width = 0;
  const char* file = nullptr;
  int line = 0;
  uint64_t value[kWarpSize];
  int arg[kWarpSize];
};

// Ready threads in the order they will run, with room for every thread.
struct ReadyQueue {
  std::vector<int> buf;
  int head = 0, size = 0;

  void reset(int capacity) {
    buf.assign(std::max(capacity, 1), 0);
    head = size = 0;
  }
  bool empty() const { return size == 0; }
  void push(int t) {
    int i = head + size;
    if (i >= static_cast<int>(buf.size())) i -= static_cast<int>(buf.size());
    buf[i] = t;
    ++size;
  }
  int pop_front() {
    const int t = buf[head];
    if (++head == static_cast<int>(buf.size())) head = 0;
    --size;
    return t;
  }
  // The i-th from the front (the front takes its place).
  int take(int i) {
    int pos = head + i;
    if (pos >= static_cast<int>(buf.size())) pos -= static_cast<int>(buf.size());
    std::swap(buf[pos], buf[head]);
    return pop_front();
  }
};

struct WarpState {
  int first = 0;
  unsigned existing = 0, exited = 0;
  unsigned active = 0;  // bit i: slots[i] holds a collective some lanes wait in
  PendingCollective slots[kWarpSize];
  ReadyQueue ready;
};

struct BlockState {
  const char* kernel = nullptr;
  const std::function<void()>* body = nullptr;
  Schedule schedule = Schedule::kLockstep;
  uint3 idx{};
  dim3 block_dim, grid_dim;
  int n = 0;
  std::vector<ThreadState> threads;
  std::vector<WarpState> warps;
  ReadyQueue ready;  // non-warp schedules
  int current_warp = -1;
  std::mt19937_64 rng;
  unsigned char* smem = nullptr;
  Context scheduler;
  std::string error;
  sigjmp_buf fault_jump;
  const void* scheduler_stack = nullptr;  // for AddressSanitizer's fiber switches
  size_t scheduler_stack_size = 0;
  int64_t barriers = 0, collectives = 0;
  int64_t shared_accesses[2] = {0, 0}, shared_conflicts[2] = {0, 0};
};

namespace {

thread_local BlockState* tl_block = nullptr;
thread_local ThreadState* tl_thread = nullptr;

// Per OS thread: fiber stacks, dynamic shared memory, the signal stack.
struct WorkerResources {
  std::vector<std::unique_ptr<GuardedRegion>> stacks;
  GuardedRegion smem;
  size_t smem_bytes = SIZE_MAX;
  std::vector<char> signal_stack;

  ~WorkerResources() {
    if (!signal_stack.empty()) {
      stack_t ss{};
      ss.ss_flags = SS_DISABLE;
      sigaltstack(&ss, nullptr);
    }
  }

  GuardedRegion* stack(int i) {
    while (static_cast<int>(stacks.size()) <= i) {
      stacks.push_back(std::make_unique<GuardedRegion>());
      stacks.back()->allocate(stack_bytes(), /*guard_below=*/true);
    }
    return stacks[i].get();
  }

  // `bytes` of dynamic shared memory ending at a guard page, filled with 0xFF
  // (NaN in every float format) so that a read before a write shows.
  unsigned char* shared(size_t bytes) {
    if (bytes != smem_bytes) {
      smem.allocate(bytes, /*guard_below=*/false);
      smem_bytes = bytes;
    }
    unsigned char* base = reinterpret_cast<unsigned char*>(smem.guard) - round_up(bytes, 16);
    std::memset(base, 0xFF, bytes);
    return base;
  }
};

thread_local std::unique_ptr<WorkerResources> tl_resources;

std::string describe_dim(const uint3& d) {
  std::ostringstream s;
  s << "(" << d.x << "," << d.y << "," << d.z << ")";
  return s.str();
}

const char* collective_name(detail::Collective k) {
  switch (k) {
    case detail::Collective::kShfl: return "__shfl_sync";
    case detail::Collective::kShflUp: return "__shfl_up_sync";
    case detail::Collective::kShflDown: return "__shfl_down_sync";
    case detail::Collective::kShflXor: return "__shfl_xor_sync";
    case detail::Collective::kBallot: return "__ballot_sync";
    case detail::Collective::kAny: return "__any_sync";
    case detail::Collective::kAll: return "__all_sync";
    case detail::Collective::kSyncWarp: return "__syncwarp";
  }
  return "?";
}

std::string where(const char* file, int line) {
  std::string f = file ? file : "?";
  const auto slash = f.find("csrc/");
  if (slash != std::string::npos) f = f.substr(slash);
  return f + ":" + std::to_string(line);
}

std::string hex_mask(unsigned m) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", m);
  return buf;
}

std::string block_prefix(const BlockState& b) {
  return std::string("fusedllm simt: kernel ") + b.kernel + ", block " + describe_dim(b.idx);
}

void set_error(BlockState& b, const std::string& msg) {
  if (b.error.empty()) b.error = msg;
}

int pick(BlockState& b);
bool resolve_stall(BlockState& b);

// Hands the OS thread from `t` (which has just blocked, exited or yielded) to
// the next thread the schedule picks, directly, or back to the block's
// scheduler when none can run (the block is done or failed). Returns when `t`
// runs again.
void switch_away(ThreadState& t) {
  BlockState& b = *t.block;
  ThreadState* next = nullptr;
  if (b.error.empty()) {
    int i = pick(b);
    while (i < 0 && resolve_stall(b)) i = pick(b);
    if (i >= 0) next = &b.threads[i];
  }
  if (next == &t) {
    t.state = RunState::kRunning;
    return;
  }
  if (next != nullptr) next->state = RunState::kRunning;
  tl_thread = next;
#if defined(FUSEDLLM_SIMT_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(t.state == RunState::kExited ? nullptr : &fake,
                                 next ? next->stack->usable : b.scheduler_stack,
                                 next ? next->stack->usable_size : b.scheduler_stack_size);
  context_switch(t.ctx, next ? next->ctx : b.scheduler);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  context_switch(t.ctx, next ? next->ctx : b.scheduler);
#endif
}

// Ends the calling thread's part in the block with an error; never returns.
FUSEDLLM_SIMT_NORETURN void fail(ThreadState& t, const std::string& msg) {
  BlockState& b = *t.block;
  set_error(b, block_prefix(b) + ", thread " + describe_dim(t.idx) + ": " + msg);
  t.state = RunState::kExited;
  switch_away(t);
  std::abort();  // an aborted block is never resumed
}

bool warp_schedule(Schedule s) {
  return s == Schedule::kWarp || s == Schedule::kWarpReverse || s == Schedule::kWarpRandom;
}
bool reverse_schedule(Schedule s) { return s == Schedule::kReverse || s == Schedule::kWarpReverse; }

void make_ready(BlockState& b, int t) {
  b.threads[t].state = RunState::kReady;
  if (warp_schedule(b.schedule)) {
    b.warps[b.threads[t].warp].ready.push(t);
  } else {
    b.ready.push(t);
  }
}

int take(ReadyQueue& q, bool random, std::mt19937_64& rng) {
  return random ? q.take(static_cast<int>(rng() % static_cast<uint64_t>(q.size))) : q.pop_front();
}

// The next thread to run under the block's schedule, or -1 if none is ready.
int pick(BlockState& b) {
  if (!warp_schedule(b.schedule)) {
    if (b.ready.empty()) return -1;
    return take(b.ready, b.schedule == Schedule::kRandom, b.rng);
  }
  const bool random = b.schedule == Schedule::kWarpRandom;
  // Warp at a time: the current warp runs until none of its lanes can.
  if (b.current_warp < 0 || b.warps[b.current_warp].ready.empty()) {
    int count = 0, first = -1, last = -1;
    for (int w = 0; w < static_cast<int>(b.warps.size()); ++w) {
      if (b.warps[w].ready.empty()) continue;
      if (first < 0) first = w;
      last = w;
      ++count;
    }
    if (count == 0) return -1;
    if (random) {
      int k = static_cast<int>(b.rng() % static_cast<uint64_t>(count));
      for (int w = first;; ++w) {
        if (!b.warps[w].ready.empty() && k-- == 0) {
          b.current_warp = w;
          break;
        }
      }
    } else {
      b.current_warp = b.schedule == Schedule::kWarpReverse ? last : first;
    }
  }
  return take(b.warps[b.current_warp].ready, random, b.rng);
}

// Threads ids[0..n) (in thread order) made ready, in the order the schedule wants.
void release(BlockState& b, const int* ids, int n) {
  if (reverse_schedule(b.schedule)) {
    for (int i = n - 1; i >= 0; --i) make_ready(b, ids[i]);
  } else {
    for (int i = 0; i < n; ++i) make_ready(b, ids[i]);
  }
}

// Scores the recorded ldmatrix / cp.async rows of every warp (see
// detail::record_shared_access) and forgets them.
void score_shared_accesses(BlockState& b) {
  constexpr int kPhaseLanes = 8, kBanks = 32;
  for (int kind = 0; kind < 2; ++kind) {
    for (const WarpState& w : b.warps) {
      size_t n = 0;
      for (int lane = 0; lane < kWarpSize && w.first + lane < b.n; ++lane) {
        n = std::max(n, b.threads[w.first + lane].shared_accesses[kind].size());
      }
      for (size_t i = 0; i < n; ++i) {
        ++b.shared_accesses[kind];
        for (int phase = 0; phase < kWarpSize / kPhaseLanes; ++phase) {
          int64_t words[kBanks][kPhaseLanes];  // distinct words seen per bank
          int count[kBanks] = {};
          int wavefronts = 1;
          for (int l = phase * kPhaseLanes; l < (phase + 1) * kPhaseLanes; ++l) {
            if (w.first + l >= b.n) break;
            const std::vector<int64_t>& rows = b.threads[w.first + l].shared_accesses[kind];
            if (i >= rows.size()) continue;
            for (int64_t word = rows[i] / 4; word < (rows[i] + 16) / 4; ++word) {
              const int bank = static_cast<int>(((word % kBanks) + kBanks) % kBanks);
              bool seen = false;
              for (int k = 0; k < count[bank]; ++k) seen = seen || words[bank][k] == word;
              if (!seen) {
                words[bank][count[bank]++] = word;
                wavefronts = std::max(wavefronts, count[bank]);
              }
            }
          }
          b.shared_conflicts[kind] += wavefronts - 1;
        }
      }
    }
    for (ThreadState& t : b.threads) t.shared_accesses[kind].clear();
  }
}

void release_all(BlockState& b) {
  if (reverse_schedule(b.schedule)) {
    for (int i = b.n - 1; i >= 0; --i) make_ready(b, i);
  } else {
    for (int i = 0; i < b.n; ++i) make_ready(b, i);
  }
}

void fiber_entry(void* arg) {
  ThreadState& t = *static_cast<ThreadState*>(arg);
#if defined(FUSEDLLM_SIMT_ASAN)
  // The first thread a block runs is entered from the scheduler: learn its stack.
  if (t.block->scheduler_stack == nullptr) {
    __sanitizer_finish_switch_fiber(nullptr, &t.block->scheduler_stack,
                                    &t.block->scheduler_stack_size);
  } else {
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
  }
#endif
  // Leave the handler before leaving the fiber: the C++ runtime keeps caught
  // exceptions per OS thread.
  std::string thrown;
  try {
    (*t.block->body)();
  } catch (const c10::Error& e) {
    thrown = e.what_without_backtrace();
  } catch (const std::exception& e) {
    thrown = e.what();
  }
  if (!thrown.empty()) fail(t, "threw: " + thrown);
  BlockState& b = *t.block;
  WarpState& w = b.warps[t.warp];
  const unsigned bit = 1u << t.lane;
  w.exited |= bit;
  for (unsigned a = w.active; a != 0; a &= a - 1) {
    const PendingCollective& p = w.slots[__builtin_ctz(a)];
    if (p.mask & bit) {
      fail(t, "exited while lanes " + hex_mask(p.arrived) + " of warp " + std::to_string(t.warp) +
                  " wait for it in " + collective_name(p.kind) + " at " + where(p.file, p.line) +
                  " (mask " + hex_mask(p.mask) + ")");
    }
  }
  t.state = RunState::kExited;
  switch_away(t);
  std::abort();
}

// Called when no thread is ready: releases a barrier everyone reached, or
// records why the block cannot go on. Returns false when the block is done.
bool resolve_stall(BlockState& b) {
  int exited = 0, at_barrier = 0;
  const ThreadState* first_barrier = nullptr;
  for (const ThreadState& t : b.threads) {
    if (t.state == RunState::kExited) ++exited;
    if (t.state == RunState::kBarrier) {
      ++at_barrier;
      if (first_barrier == nullptr) first_barrier = &t;
    }
  }
  if (exited == b.n) return false;
  if (at_barrier + exited == b.n) {
    for (const ThreadState& t : b.threads) {
      if (t.state == RunState::kBarrier && (t.file != first_barrier->file || t.line != first_barrier->line)) {
        set_error(b, block_prefix(b) + ": threads wait at different barriers: thread " +
                         describe_dim(first_barrier->idx) + " at __syncthreads " +
                         where(first_barrier->file, first_barrier->line) + ", thread " +
                         describe_dim(t.idx) + " at __syncthreads " + where(t.file, t.line));
        return false;
      }
    }
    if (exited > 0) {
      set_error(b, block_prefix(b) + ": divergent __syncthreads at " +
                       where(first_barrier->file, first_barrier->line) + ": " +
                       std::to_string(at_barrier) + " threads wait there but " +
                       std::to_string(exited) + " threads of the block have exited");
      return false;
    }
    ++b.barriers;
    score_shared_accesses(b);
    release_all(b);
    return true;
  }
  // Deadlock: describe each group of threads waiting at the same place.
  std::ostringstream msg;
  msg << block_prefix(b) << ": deadlock, no thread can go on:";
  std::string last;
  int count = 0, first = 0;
  auto flush = [&] {
    if (count == 0) return;
    msg << " " << count << " thread" << (count > 1 ? "s" : "") << " (from "
        << describe_dim(b.threads[first].idx) << ") " << last << ";";
  };
  for (int i = 0; i < b.n; ++i) {
    const ThreadState& t = b.threads[i];
    std::string what = "exited";
    if (t.state == RunState::kBarrier) {
      what = "at __syncthreads " + where(t.file, t.line);
    } else if (t.state != RunState::kExited) {
      what = "in a warp collective at " + where(t.file, t.line);
    }
    if (count > 0 && what == last) {
      ++count;
      continue;
    }
    flush();
    last = what;
    first = i;
    count = 1;
  }
  flush();
  set_error(b, msg.str());
  return false;
}

void fault_handler(int sig, siginfo_t* info, void* ctx);

struct sigaction g_previous_segv, g_previous_bus;

void install_fault_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa{};
    sa.sa_sigaction = fault_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
    sigaction(SIGBUS, &sa, &g_previous_bus);
  });
  // The handler must run off the faulting stack (a stack overflow); use the
  // alternate stack this OS thread has (Python's faulthandler, a sanitizer),
  // or install one.
  stack_t current{};
  if (tl_resources->signal_stack.empty() && sigaltstack(nullptr, &current) == 0 &&
      (current.ss_flags & SS_DISABLE)) {
    tl_resources->signal_stack.resize(64 * 1024);
    stack_t ss{};
    ss.ss_sp = tl_resources->signal_stack.data();
    ss.ss_size = tl_resources->signal_stack.size();
    sigaltstack(&ss, nullptr);
  }
}

// A fault inside an emulated thread's stack guard or past the end of the
// block's dynamic shared memory becomes the block's error; any other fault
// goes to the handler that was there before.
void fault_handler(int sig, siginfo_t* info, void* ctx) {
  BlockState* b = tl_block;
  ThreadState* t = tl_thread;
  if (b != nullptr && t != nullptr && tl_resources != nullptr) {
    const char* what = nullptr;
    if (tl_resources->smem.in_guard(info->si_addr)) {
      what = "access past the end of dynamic shared memory";
    } else if (t->stack != nullptr && t->stack->in_guard(info->si_addr)) {
      what = "stack overflow (FUSEDLLM_SIMT_STACK_KB sets the emulated threads' stack size)";
    }
    if (what != nullptr) {
      set_error(*b, block_prefix(*b) + ", thread " + describe_dim(t->idx) + ": " + what);
      siglongjmp(b->fault_jump, 1);
    }
  }
  const struct sigaction& prev = sig == SIGBUS ? g_previous_bus : g_previous_segv;
  if (prev.sa_flags & SA_SIGINFO) {
    prev.sa_sigaction(sig, info, ctx);
  } else if (prev.sa_handler != SIG_IGN && prev.sa_handler != SIG_DFL) {
    prev.sa_handler(sig);
  } else {
    signal(sig, SIG_DFL);  // the faulting access repeats and ends the process
  }
}

void run_block(BlockState& b) {
  b.error.clear();
  b.ready.reset(b.n);
  b.current_warp = -1;
  for (WarpState& w : b.warps) {
    w.exited = 0;
    w.active = 0;
    w.ready.reset(kWarpSize);
  }
  tl_block = &b;
  if (sigsetjmp(b.fault_jump, 1) == 0) {
    for (int i = 0; i < b.n; ++i) {
      ThreadState& t = b.threads[i];
      t.state = RunState::kReady;
      t.stack = tl_resources->stack(i);
#if defined(FUSEDLLM_SIMT_ASAN)
      // A new fiber has no frames yet: whatever an earlier block's threads left
      // in this stack's shadow (the frames of exited fibers never unwind) is stale.
      ASAN_UNPOISON_MEMORY_REGION(t.stack->usable, t.stack->usable_size);
#endif
#if defined(__x86_64__)
      context_init(t.ctx, t.stack->usable + t.stack->usable_size, fiber_entry, &t);
#else
      context_init(t.ctx, t.stack->usable, t.stack->usable_size, fiber_entry, &t);
#endif
    }
    release_all(b);
    // The threads hand the OS thread to each other (switch_away); it comes
    // back here when the block has finished or failed.
    ThreadState& t = b.threads[pick(b)];
    t.state = RunState::kRunning;
    tl_thread = &t;
#if defined(FUSEDLLM_SIMT_ASAN)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, t.stack->usable, t.stack->usable_size);
    context_switch(b.scheduler, t.ctx);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    context_switch(b.scheduler, t.ctx);
#endif
  }
#if defined(FUSEDLLM_SIMT_ASAN)
  else {
    // Back from a fault on a thread's stack by siglongjmp, past the fiber
    // switch annotations: tell AddressSanitizer which stack this is again.
    __sanitizer_start_switch_fiber(nullptr, b.scheduler_stack, b.scheduler_stack_size);
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
  }
  // A failed block's threads never unwound: clear what their frames left in
  // the shadow memory before their stacks serve the next block.
  if (!b.error.empty()) {
    for (ThreadState& t : b.threads) {
      ASAN_UNPOISON_MEMORY_REGION(t.stack->usable, t.stack->usable_size);
    }
  }
#endif
  tl_thread = nullptr;
  tl_block = nullptr;
}

}  // namespace

#if !defined(__x86_64__)
namespace {
void ucontext_entry(int hi, int lo) {
  auto* arg = reinterpret_cast<void*>((static_cast<uintptr_t>(static_cast<unsigned>(hi)) << 32) |
                                      static_cast<unsigned>(lo));
  fiber_entry(arg);
}
}  // namespace
void context_init(Context& c, char* bottom, size_t size, void (*fn)(void*), void* arg) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = bottom;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  const auto a = reinterpret_cast<uintptr_t>(arg);
  (void)fn;
  makecontext(&c.uc, reinterpret_cast<void (*)()>(ucontext_entry), 2, static_cast<int>(a >> 32),
              static_cast<int>(a & 0xffffffffu));
}
#endif

// ---------------------------------------------------------------------------
// What kernel code calls
// ---------------------------------------------------------------------------

namespace detail {

const uint3& thread_idx() { return tl_thread->idx; }
const uint3& block_idx() { return tl_block->idx; }
const dim3& block_dim() { return tl_block->block_dim; }
const dim3& grid_dim() { return tl_block->grid_dim; }
unsigned char* dynamic_shared_base() { return tl_block->smem; }

void record_shared_access(SharedAccess kind, const void* address) {
  // Banks are counted from the dynamic shared memory's base (a GPU aligns it
  // to at least 128 bytes; the emulator's copy only to 16).
  const auto* p = static_cast<const unsigned char*>(address);
  const int64_t offset = tl_block->smem != nullptr ? p - tl_block->smem : reinterpret_cast<intptr_t>(p);
  tl_thread->shared_accesses[static_cast<int>(kind)].push_back(offset);
}

void syncthreads(const char* file, int line) {
  ThreadState& t = *tl_thread;
  t.state = RunState::kBarrier;
  t.file = file;
  t.line = line;
  switch_away(t);
}

void kernel_assert_failed(const char* cond, const char* file, int line) {
  fail(*tl_thread, std::string("CUDA_KERNEL_ASSERT(") + cond + ") failed at " + where(file, line) +
                       " (on a GPU: a device-side assert)");
}

uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width,
                         const char* file, int line) {
  ThreadState& t = *tl_thread;
  BlockState& b = *t.block;
  WarpState& w = b.warps[t.warp];
  const unsigned bit = 1u << t.lane;
  auto name = [&] { return std::string(collective_name(kind)) + " at " + where(file, line); };
  if (width < 1 || width > kWarpSize || (width & (width - 1)) != 0) {
    fail(t, name() + ": width " + std::to_string(width) + " is not a power of two <= 32");
  }
  if (!(mask & bit)) {
    fail(t, name() + ": the mask " + hex_mask(mask) + " does not include the calling lane " +
                std::to_string(t.lane));
  }
  if (mask & ~w.existing) {
    fail(t, name() + ": the mask " + hex_mask(mask) + " names lanes past the end of the block (warp " +
                std::to_string(t.warp) + " has lanes " + hex_mask(w.existing) + ")");
  }
  if (mask & w.exited) {
    fail(t, name() + ": the mask " + hex_mask(mask) + " waits for lanes that have exited (" +
                hex_mask(mask & w.exited) + ")");
  }
  PendingCollective* p = nullptr;
  for (unsigned a = w.active; a != 0; a &= a - 1) {
    PendingCollective& q = w.slots[__builtin_ctz(a)];
    if (q.mask & mask) {
      if (q.mask != mask) {
        fail(t, name() + " with mask " + hex_mask(mask) + " overlaps lanes waiting in " +
                    collective_name(q.kind) + " at " + where(q.file, q.line) + " with mask " +
                    hex_mask(q.mask));
      }
      p = &q;
    }
  }
  if (p == nullptr) {
    const int slot = __builtin_ctz(~w.active);  // lanes in disjoint masks: at most 32 slots
    w.active |= 1u << slot;
    p = &w.slots[slot];
    p->kind = kind;
    p->mask = mask;
    p->arrived = 0;
    p->width = width;
    p->file = file;
    p->line = line;
  } else if (p->kind != kind || p->width != width) {
    fail(t, name() + " meets lanes waiting in " + collective_name(p->kind) + " at " +
                where(p->file, p->line) + " (width " + std::to_string(p->width) + ")");
  }
  p->value[t.lane] = value;
  p->arg[t.lane] = arg;
  p->arrived |= bit;
  t.file = file;
  t.line = line;
  if (p->arrived != mask) {
    t.state = RunState::kCollective;
    switch_away(t);
    return t.result;
  }

  // Everyone is here: compute each lane's result.
  const PendingCollective& done = *p;
  w.active &= ~(1u << (p - w.slots));
  uint64_t votes = 0;
  for (int l = 0; l < kWarpSize; ++l) {
    if ((done.mask >> l & 1u) && done.value[l] != 0) votes |= 1ull << l;
  }
  int ids[kWarpSize];
  int n_ids = 0;
  for (int l = 0; l < kWarpSize; ++l) {
    if (!(done.mask >> l & 1u)) continue;
    ThreadState& lt = b.threads[w.first + l];  // waiting in this collective
    const int a = done.arg[l];
    const int seg = l & ~(done.width - 1);
    int src = l;
    switch (kind) {
      case Collective::kShfl: src = seg + (a & (done.width - 1)); break;
      case Collective::kShflUp: src = (l - seg) >= a ? l - a : l; break;
      case Collective::kShflDown: src = (l - seg) + a < done.width ? l + a : l; break;
      case Collective::kShflXor: src = ((l ^ a) & ~(done.width - 1)) == seg ? (l ^ a) : l; break;
      default: break;
    }
    switch (kind) {
      case Collective::kShfl:
      case Collective::kShflUp:
      case Collective::kShflDown:
      case Collective::kShflXor:
        if (src < 0 || src >= kWarpSize || !(done.mask >> src & 1u)) {
          fail(t, name() + ": lane " + std::to_string(l) + " reads lane " + std::to_string(src) +
                   ", which is not in the mask " + hex_mask(done.mask));
        }
        lt.result = done.value[src];
        break;
      case Collective::kBallot: lt.result = votes; break;
      case Collective::kAny: lt.result = votes != 0; break;
      case Collective::kAll: lt.result = votes == (static_cast<uint64_t>(done.mask) & 0xffffffffull); break;
      case Collective::kSyncWarp: lt.result = 0; break;
    }
    ids[n_ids++] = w.first + l;
  }
  ++b.collectives;
  release(b, ids, n_ids);
  switch_away(t);  // in lockstep with the others
  return t.result;
}

}  // namespace detail

// ---------------------------------------------------------------------------
// Device, settings, launch
// ---------------------------------------------------------------------------

const DeviceProperties& device_properties() {
  static const DeviceProperties props = [] {
    DeviceProperties p{};
    std::snprintf(p.name, sizeof(p.name), "fusedllm SIMT emulator (sm_80 limits)");
    p.multiProcessorCount = std::max(env_int("FUSEDLLM_SIMT_SMS", 4), 1);
    p.sharedMemPerBlock = 48 * 1024;
    p.sharedMemPerBlockOptin = static_cast<size_t>(env_int("FUSEDLLM_SIMT_SMEM_OPTIN", 163 * 1024));
    p.maxThreadsPerBlock = 1024;
    p.warpSize = kWarpSize;
    p.major = 8;
    p.minor = 0;
    return p;
  }();
  return props;
}

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::kLockstep: return "lockstep";
    case Schedule::kReverse: return "reverse";
    case Schedule::kRandom: return "random";
    case Schedule::kWarp: return "warp";
    case Schedule::kWarpReverse: return "warp-reverse";
    case Schedule::kWarpRandom: return "warp-random";
  }
  return "?";
}

bool parse_schedule(const std::string& name, Schedule& out) {
  for (int i = 0; i <= static_cast<int>(Schedule::kWarpRandom); ++i) {
    if (name == schedule_name(static_cast<Schedule>(i))) {
      out = static_cast<Schedule>(i);
      return true;
    }
  }
  return false;
}

void set_schedule(Schedule s) { g_schedule = static_cast<int>(s); }

Schedule schedule() {
  int s = g_schedule.load();
  if (s < 0) {
    Schedule parsed = Schedule::kLockstep;
    const char* env = std::getenv("FUSEDLLM_SIMT_SCHEDULE");
    if (env != nullptr && *env != '\0') {
      TORCH_CHECK_VALUE(parse_schedule(env, parsed), "FUSEDLLM_SIMT_SCHEDULE must be one of lockstep, "
                        "reverse, random, warp, warp-reverse, warp-random; got '", env, "'");
    }
    s = static_cast<int>(parsed);
    g_schedule = s;
  }
  return static_cast<Schedule>(s);
}

void set_workers(int w) {
  TORCH_CHECK_VALUE(w >= 1, "fusedllm simt: workers must be at least 1, got ", w);
  g_workers = w;
}

int workers() {
  int w = g_workers.load();
  if (w <= 0) {
    w = std::max(env_int("FUSEDLLM_SIMT_WORKERS", 1), 1);
    g_workers = w;
  }
  return w;
}

void set_random_seed(uint64_t seed) { g_seed = seed; }

Stats stats() {
  Stats s;
  s.launches = g_launches;
  s.blocks = g_blocks;
  s.threads = g_threads;
  s.barriers = g_barriers;
  s.collectives = g_collectives;
  s.ldmatrix = g_shared_accesses[0];
  s.ldmatrix_conflicts = g_shared_conflicts[0];
  s.cp_async = g_shared_accesses[1];
  s.cp_async_conflicts = g_shared_conflicts[1];
  std::lock_guard<std::mutex> lock(g_kernel_launches_mutex);
  s.kernel_launches = g_kernel_launches;
  return s;
}

void reset_stats() {
  g_launches = g_blocks = g_threads = g_barriers = g_collectives = 0;
  for (int kind = 0; kind < 2; ++kind) g_shared_accesses[kind] = g_shared_conflicts[kind] = 0;
  std::lock_guard<std::mutex> lock(g_kernel_launches_mutex);
  g_kernel_launches.clear();
}

void set_max_dynamic_shared_memory(const void* kernel, size_t bytes) {
  const DeviceProperties& p = device_properties();
  TORCH_CHECK(bytes <= p.sharedMemPerBlockOptin, "fusedllm simt: cudaFuncSetAttribute("
              "cudaFuncAttributeMaxDynamicSharedMemorySize, ", bytes, ") is over the device's opt-in "
              "limit of ", p.sharedMemPerBlockOptin, " bytes (cudaErrorInvalidValue on a GPU)");
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  g_max_dynamic_smem[kernel] = bytes;
}

void launch(const char* name, const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem,
            const std::function<void()>& body) {
  const DeviceProperties& props = device_properties();
  const std::string what = std::string("fusedllm simt: launch of ") + name + " with grid (" +
                           std::to_string(grid.x) + "," + std::to_string(grid.y) + "," +
                           std::to_string(grid.z) + ") and block (" + std::to_string(block.x) +
                           "," + std::to_string(block.y) + "," + std::to_string(block.z) + ")";
  const uint64_t n_threads = uint64_t(block.x) * block.y * block.z;
  TORCH_CHECK(n_threads >= 1 && n_threads <= static_cast<uint64_t>(props.maxThreadsPerBlock) &&
                  block.x <= 1024 && block.y <= 1024 && block.z <= 64,
              what, ": a block has 1 to 1024 threads (x, y <= 1024, z <= 64); on a GPU: invalid "
              "configuration argument");
  TORCH_CHECK(grid.x >= 1 && grid.x <= 0x7fffffffu && grid.y >= 1 && grid.y <= 65535 && grid.z >= 1 &&
                  grid.z <= 65535,
              what, ": grid dimensions must be 1..2^31-1 (x) and 1..65535 (y, z); on a GPU: invalid "
              "configuration argument");
  size_t limit = props.sharedMemPerBlock;
  {
    std::lock_guard<std::mutex> lock(g_attr_mutex);
    auto it = g_max_dynamic_smem.find(kernel);
    if (it != g_max_dynamic_smem.end()) limit = std::max(limit, it->second);
  }
  TORCH_CHECK(dynamic_smem <= limit, what, ": ", dynamic_smem, " bytes of dynamic shared memory "
              "exceed the ", limit, " bytes allowed",
              dynamic_smem <= props.sharedMemPerBlockOptin
                  ? " (above 48 KiB a kernel must opt in with cudaFuncSetAttribute)"
                  : " (the device's opt-in limit)");

  const int n = static_cast<int>(n_threads);
  const int64_t n_blocks = int64_t(grid.x) * grid.y * grid.z;
  const Schedule sched = schedule();
  const uint64_t seed = g_seed.load();
  const int n_workers = static_cast<int>(std::min<int64_t>(workers(), n_blocks));
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::string first_error;
  std::atomic<int64_t> barriers{0}, collectives{0};

  auto work = [&] {
    if (!tl_resources) tl_resources = std::make_unique<WorkerResources>();
    install_fault_handler();
    auto b = std::make_unique<BlockState>();
    b->kernel = name;
    b->body = &body;
    b->schedule = sched;
    b->block_dim = block;
    b->grid_dim = grid;
    b->n = n;
    b->threads.resize(n);
    b->warps.resize((n + kWarpSize - 1) / kWarpSize);
    for (int i = 0; i < n; ++i) {
      ThreadState& t = b->threads[i];
      t.idx = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
      t.lane = i % kWarpSize;
      t.warp = i / kWarpSize;
      t.block = b.get();
      b->warps[t.warp].existing |= 1u << t.lane;
    }
    for (int w = 0; w < static_cast<int>(b->warps.size()); ++w) b->warps[w].first = w * kWarpSize;
    for (int64_t i; !failed && (i = next++) < n_blocks;) {
      b->idx = uint3{static_cast<unsigned>(i % grid.x), static_cast<unsigned>((i / grid.x) % grid.y),
                     static_cast<unsigned>(i / (int64_t(grid.x) * grid.y))};
      b->rng.seed(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i));
      b->smem = dynamic_smem > 0 ? tl_resources->shared(dynamic_smem) : nullptr;
      run_block(*b);
      score_shared_accesses(*b);
      if (!b->error.empty()) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (first_error.empty()) first_error = b->error;
        failed = true;
      }
    }
    barriers += b->barriers;
    collectives += b->collectives;
    for (int kind = 0; kind < 2; ++kind) {
      g_shared_accesses[kind] += b->shared_accesses[kind];
      g_shared_conflicts[kind] += b->shared_conflicts[kind];
    }
  };

  if (n_workers <= 1) {
    work();
  } else {
    std::vector<std::thread> pool;
    for (int w = 1; w < n_workers; ++w) pool.emplace_back(work);
    work();
    for (auto& th : pool) th.join();
  }
  ++g_launches;
  {
    std::lock_guard<std::mutex> lock(g_kernel_launches_mutex);
    ++g_kernel_launches[name];
  }
  g_blocks += n_blocks;
  g_threads += n_blocks * n;
  g_barriers += barriers;
  g_collectives += collectives;
  TORCH_CHECK(first_error.empty(), first_error);
}

}  // namespace fusedllm::simt
