#include "worker/collective/shm/shm_group.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <random>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "worker/collective/op_checks.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

constexpr uint64_t kMagic = 0x636f686f72747368;  // "cohortsh"
constexpr size_t kPage = 4096;
constexpr size_t kCheckBytes = 128;
constexpr absl::Duration kSlice = absl::Milliseconds(20);
constexpr absl::Duration kStaleAge = absl::Minutes(1);
constexpr char kNamePrefix[] = "cohort.";
constexpr char kSetupFailure[] = "cohort.dev/shm-setup-failure";

absl::Status SetupFailure(std::string why) {
  absl::Status status = absl::UnavailableError(std::move(why));
  status.SetPayload(kSetupFailure, absl::Cord("1"));
  return status;
}

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  } while (false)

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
               absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(timeout);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected,
          &ts, nullptr, 0);
}

void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX,
          nullptr, nullptr, 0);
}

// Whether `pid` has exited: it no longer exists, or it is a zombie waiting
// for its parent.
bool ProcessGone(pid_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return false;
  const char state = line[paren + 2];
  return state == 'Z' || state == 'X';
}

// The CPUs this process may run on.
int UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

// options.spin if set; else $COHORT_SHM_SPIN_US if set; else 50 us when
// the group's ranks fit on this process's CPUs, and none otherwise.
absl::Duration DefaultSpin(absl::Duration configured, int size) {
  if (configured >= absl::ZeroDuration()) return configured;
  int64_t micros = 0;
  if (const char* env = std::getenv("COHORT_SHM_SPIN_US");
      env != nullptr && absl::SimpleAtoi(env, &micros) && micros >= 0) {
    return absl::Microseconds(micros);
  }
  return size <= UsableCpus() ? absl::Microseconds(50) : absl::ZeroDuration();
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// [begin, end) of the elements of a round of `count` that local rank `q` of
// `size` reduces: boundaries on 64-byte multiples so that two reducing
// ranks never write the same cache line.
std::pair<size_t, size_t> Portion(size_t count, size_t element, int q,
                                  int size) {
  const size_t align = std::max<size_t>(1, 64 / element);
  auto boundary = [&](int i) -> size_t {
    if (i >= size) return count;
    return count * i / size / align * align;
  };
  return {boundary(q), boundary(q + 1)};
}

// memcpy that accepts an empty range with null pointers (an empty vector's
// data()), which memcpy itself does not.
inline void CopyBytes(void* to, const void* from, size_t n) {
  if (n > 0) std::memcpy(to, from, n);
}

}  // namespace

struct ShmGroup::Header {
  uint64_t magic;
  uint32_t size;
  uint32_t slot_bytes;
  std::atomic<uint32_t> attached;
  // 0: healthy; 1: a rank is writing `failure`; 2: failed, `failure` says
  // why.
  std::atomic<uint32_t> failed;
  int32_t failure_code;  // The absl::StatusCode of the first failure.
  char failure[512];
};

struct alignas(64) ShmGroup::Control {
  std::atomic<uint32_t> arrived;   // Barriers arrived at; the futex word.
  std::atomic<uint32_t> sleepers;  // Peers in FUTEX_WAIT on `arrived`.
  std::atomic<int32_t> pid;
  // Per op, alternating: what the op publishes before its first barrier.
  uint64_t aux[2];
  int32_t status_code[2];
  char note[2][kCheckBytes];
  char check[2][kCheckBytes];
};

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "futex words must be plain lock-free 32-bit atomics");

ShmGroup::ShmGroup(int rank, int size, const ShmGroupOptions& options,
                   void* base, size_t bytes)
    : rank_(rank),
      size_(size),
      options_(options),
      base_(base),
      bytes_(bytes),
      spin_(DefaultSpin(options.spin, size)) {}

ShmGroup::~ShmGroup() { munmap(base_, bytes_); }

ShmGroup::Header& ShmGroup::header() const {
  return *static_cast<Header*>(base_);
}

ShmGroup::Control& ShmGroup::control(int rank) const {
  return reinterpret_cast<Control*>(static_cast<char*>(base_) + kPage)[rank];
}

char* ShmGroup::slot(int rank, uint32_t round) const {
  const size_t data = RoundUp(kPage + size_ * sizeof(Control), kPage);
  return static_cast<char*>(base_) + data +
         (2 * static_cast<size_t>(rank) + (round & 1)) * options_.slot_bytes;
}

void ShmGroup::NotePeers() {
  pid_visible_.assign(size_, false);
  for (int q = 0; q < size_; ++q) {
    const pid_t pid = control(q).pid.load();
    pid_visible_[q] = pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
  }
}

int ShmGroup::GroupRank(int local) const {
  return options_.group_ranks.empty() ? local : options_.group_ranks[local];
}

absl::StatusOr<std::unique_ptr<ShmGroup>> ShmGroup::Create(
    Store& store, absl::string_view key, int rank, int size,
    const ShmGroupOptions& options) {
  static_assert(sizeof(Header) <= kPage);
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory group: rank ", rank, " is not in [0, ", size, ")"));
  }
  if (options.slot_bytes < kPage || options.slot_bytes % kPage != 0 ||
      options.slot_bytes < 64 * static_cast<size_t>(size) ||
      options.timeout <= absl::ZeroDuration() ||
      (!options.group_ranks.empty() &&
       options.group_ranks.size() != static_cast<size_t>(size))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory group: slot_bytes (", options.slot_bytes,
        ") must be a multiple of 4096 and at least 64 bytes per rank, the "
        "timeout positive, and group_ranks empty or one per local rank"));
  }
  const absl::Time deadline = absl::Now() + options.timeout;
  const size_t data = RoundUp(kPage + size * sizeof(Control), kPage);
  const size_t total = data + 2 * static_cast<size_t>(size) * options.slot_bytes;

  std::string name;
  int fd = -1;
  if (rank == 0) {
    RemoveStaleSegments();
    std::random_device random;
    name = absl::StrFormat("/%s%d.%08x%08x", kNamePrefix, getpid(), random(),
                           random());
    // Every failure to set the segment up reaches the other local ranks
    // through the key, so that they fail with the reason, not a timeout.
    auto fail = [&](std::string why) -> absl::Status {
      if (fd >= 0) {
        shm_unlink(name.c_str());
        close(fd);
      }
      why = absl::StrCat("local rank 0 could not set up the shared-memory "
                         "segment for ",
                         size, " ranks: ", why);
      store.Set(key, absl::StrCat("!", why)).IgnoreError();
      return SetupFailure(why);
    };
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return fail(absl::StrCat("shm_open(", name, "): ", strerror(errno)));
    const int reserved = posix_fallocate(fd, 0, static_cast<off_t>(total));
    if (reserved != 0) {
      return fail(absl::StrCat("reserving ", total, " bytes in /dev/shm: ",
                               strerror(reserved)));
    }
    void* base =
        mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) return fail(absl::StrCat("mmap: ", strerror(errno)));
    Header* h = new (base) Header();
    h->magic = kMagic;
    h->size = size;
    h->slot_bytes = options.slot_bytes;
    for (int r = 0; r < size; ++r) {
      new (static_cast<char*>(base) + kPage + r * sizeof(Control)) Control();
    }
    absl::Status published = store.Set(key, name);
    if (!published.ok()) {
      munmap(base, total);
      return fail(absl::StrCat("publishing its name: ", published.ToString()));
    }
    close(fd);
    fd = -1;
    auto group = std::unique_ptr<ShmGroup>(
        new ShmGroup(rank, size, options, base, total));
    absl::Status all = [&]() -> absl::Status {
      group->control(0).pid.store(getpid());
      group->header().attached.fetch_add(1);
      const std::string failed_key = absl::StrCat(key, "/failed");
      while (true) {
        const uint32_t seen = group->header().attached.load();
        if (seen >= static_cast<uint32_t>(size)) return absl::OkStatus();
        const absl::Duration left = deadline - absl::Now();
        if (left <= absl::ZeroDuration()) break;
        FutexWait(&group->header().attached, seen, std::min(left, kSlice));
        if (group->header().attached.load() >= static_cast<uint32_t>(size)) {
          continue;
        }
        // Slower than a slice: has a rank said it cannot map it?
        absl::StatusOr<bool> failed = store.Check({failed_key});
        if (failed.ok() && *failed) {
          absl::StatusOr<std::string> why = store.Get(failed_key, kSlice);
          return absl::UnavailableError(absl::StrCat(
              "shared-memory segment ", name, ": a rank could not map it: ",
              why.ok() ? *why : why.status().ToString()));
        }
      }
      std::vector<int> missing;
      for (int r = 0; r < size; ++r) {
        if (group->control(r).pid.load() == 0) {
          missing.push_back(group->GroupRank(r));
        }
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "shared-memory segment ", name, ": rank(s) ",
          absl::StrJoin(missing, ", "), " did not map it within ",
          absl::FormatDuration(options.timeout)));
    }();
    // Mapped by all (or given up on): the name goes, the memory stays while
    // mapped.
    shm_unlink(name.c_str());
    if (!all.ok()) {
      group->Fail(all);
      return all;
    }
    group->NotePeers();
    return group;
  }

  absl::StatusOr<std::string> value = store.Get(key, options.timeout);
  if (!value.ok()) {
    return absl::Status(
        value.status().code(),
        absl::StrCat("waiting for local rank 0 to publish the shared-memory "
                     "segment: ",
                     value.status().message()));
  }
  if (absl::StartsWith(*value, "!")) return SetupFailure(value->substr(1));
  name = *value;
  // A rank that cannot map the segment says why under `key`/failed, so that
  // local rank 0 stops waiting for it at once, and names it.
  auto mapped = [&]() -> absl::StatusOr<std::unique_ptr<ShmGroup>> {
    fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      return absl::UnavailableError(absl::StrCat(
          "cannot open local rank 0's shared-memory segment ", name, ": ",
          strerror(errno),
          " (local rank 0 gave up waiting, or this rank sees another "
          "/dev/shm, as a separate container would?)"));
    }
    struct stat st = {};
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != total) {
      close(fd);
      return absl::FailedPreconditionError(absl::StrCat(
          "shared-memory segment ", name, " has ", st.st_size,
          " bytes, expected ", total,
          ": the local ranks disagree on the group's size or slot size"));
    }
    void* base =
        mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) {
      return absl::UnavailableError(
          absl::StrCat("mmap of ", name, ": ", strerror(errno)));
    }
    auto group = std::unique_ptr<ShmGroup>(
        new ShmGroup(rank, size, options, base, total));
    const Header& h = group->header();
    if (h.magic != kMagic || h.size != static_cast<uint32_t>(size) ||
        h.slot_bytes != options.slot_bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shared-memory segment ", name, " is not this group's (", h.size,
          " ranks, slots of ", h.slot_bytes, " bytes)"));
    }
    return group;
  }();
  if (!mapped.ok()) {
    store
        .Set(absl::StrCat(key, "/failed"),
             absl::StrCat("rank ",
                          options.group_ranks.empty() ? rank
                                                      : options.group_ranks[rank],
                          ": ", mapped.status().ToString()))
        .IgnoreError();
    return mapped.status();
  }
  auto group = std::move(*mapped);
  Header& h = group->header();
  group->control(rank).pid.store(getpid());
  h.attached.fetch_add(1);
  FutexWake(&h.attached);
  while (true) {
    const uint32_t seen = h.attached.load();
    if (seen >= static_cast<uint32_t>(size)) {
      group->NotePeers();
      return group;
    }
    if (h.failed.load() != 0) {
      return absl::UnavailableError(absl::StrCat(
          "local rank 0 gave up on the shared-memory segment: ",
          h.failed.load() == 2 ? h.failure : "(no reason yet)"));
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "not every local rank mapped the shared-memory segment within ",
          absl::FormatDuration(options.timeout)));
    }
    FutexWait(&h.attached, seen, std::min(left, kSlice));
  }
}

bool ShmGroup::IsSetupFailure(const absl::Status& status) {
  return status.GetPayload(kSetupFailure).has_value();
}

int ShmGroup::RemoveStaleSegments() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  const absl::Time now = absl::Now();
  while (dirent* entry = readdir(dir)) {
    absl::string_view name = entry->d_name;
    if (!absl::ConsumePrefix(&name, kNamePrefix)) continue;
    const size_t dot = name.find('.');
    int pid = 0;
    if (dot == absl::string_view::npos ||
        !absl::SimpleAtoi(name.substr(0, dot), &pid) || !ProcessGone(pid)) {
      continue;
    }
    struct stat st = {};
    const std::string path = absl::StrCat("/dev/shm/", entry->d_name);
    if (stat(path.c_str(), &st) != 0 ||
        now - absl::FromTimeT(st.st_mtime) < kStaleAge) {
      continue;
    }
    if (shm_unlink(absl::StrCat("/", entry->d_name).c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

void ShmGroup::Fail(const absl::Status& status) {
  Header& h = header();
  uint32_t healthy = 0;
  if (h.failed.compare_exchange_strong(healthy, 1)) {
    const std::string why =
        absl::StrCat("rank ", GroupRank(rank_), ": ", status.ToString());
    const size_t n = std::min(why.size(), sizeof(h.failure) - 1);
    std::memcpy(h.failure, why.data(), n);
    h.failure[n] = '\0';
    h.failure_code = static_cast<int32_t>(status.code());
    h.failed.store(2);
  }
  for (int r = 0; r < size_; ++r) FutexWake(&control(r).arrived);
}

absl::Status ShmGroup::FailedStatus(absl::string_view when) const {
  const Header& h = header();
  if (h.failed.load() != 2) {
    return absl::UnavailableError(absl::StrCat(
        "the shared-memory group failed", when, " (a rank is reporting why)"));
  }
  // The first failure's code: a peer that timed out makes everyone's op
  // DEADLINE_EXCEEDED, a dead one UNAVAILABLE.
  return absl::Status(static_cast<absl::StatusCode>(h.failure_code),
                      absl::StrCat("the shared-memory group failed", when,
                                   ": ", h.failure));
}

void ShmGroup::BeginOp(absl::string_view check, uint64_t aux) {
  deadline_ = absl::Now() + options_.timeout;
  const uint32_t parity = ops_++ & 1;
  Control& me = control(rank_);
  const size_t n = std::min(check.size(), kCheckBytes - 1);
  CopyBytes(me.check[parity], check.data(), n);
  me.check[parity][n] = '\0';
  me.aux[parity] = aux;
  check_pending_ = !check.empty();
}

absl::Status ShmGroup::Barrier() {
  const uint32_t generation = ++generation_;
  Control& me = control(rank_);
  me.arrived.store(generation);
  if (me.sleepers.load() > 0) FutexWake(&me.arrived);
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) RETURN_IF_ERROR(AwaitPeer(q, generation));
  }
  if (check_pending_) {
    check_pending_ = false;
    return CompareChecks();
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::AwaitPeer(int peer, uint32_t generation) {
  std::atomic<uint32_t>& word = control(peer).arrived;
  auto reached = [generation](uint32_t value) {
    return static_cast<int32_t>(value - generation) >= 0;
  };
  if (reached(word.load(std::memory_order_acquire))) return absl::OkStatus();
  if (spin_ > absl::ZeroDuration()) {
    const absl::Time until = absl::Now() + spin_;
    for (int i = 1;; ++i) {
      CpuRelax();
      if (reached(word.load(std::memory_order_acquire))) {
        return absl::OkStatus();
      }
      if (i % 64 == 0 && absl::Now() > until) break;
    }
  } else {
    sched_yield();
  }
  while (true) {
    control(peer).sleepers.fetch_add(1);
    const uint32_t seen = word.load();
    if (!reached(seen)) {
      const absl::Duration left = deadline_ - absl::Now();
      if (left > absl::ZeroDuration()) {
        FutexWait(&word, seen, std::min(left, kSlice));
      }
    }
    control(peer).sleepers.fetch_sub(1);
    if (reached(word.load(std::memory_order_acquire))) return absl::OkStatus();
    Header& h = header();
    if (h.failed.load() != 0) return FailedStatus("");
    const pid_t pid = control(peer).pid.load();
    if (pid_visible_[peer] && ProcessGone(pid)) {
      return absl::UnavailableError(
          absl::StrCat("rank ", GroupRank(peer), " (pid ", pid,
                       ", on this host) exited during the op"));
    }
    if (absl::Now() >= deadline_) {
      std::vector<int> late;
      for (int q = 0; q < size_; ++q) {
        if (q != rank_ && !reached(control(q).arrived.load())) {
          late.push_back(GroupRank(q));
        }
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "rank(s) ", absl::StrJoin(late, ", "),
          " did not reach the op's step ", generation, " within ",
          absl::FormatDuration(options_.timeout), " (shared memory)"));
    }
  }
}

absl::Status ShmGroup::CompareChecks() {
  const uint32_t parity = (ops_ - 1) & 1;
  auto name = [&](int q) {
    const char* check = control(q).check[parity];
    return std::string(check, strnlen(check, kCheckBytes));
  };
  std::vector<RankOp> ranks;
  for (int q = 0; q < size_; ++q) ranks.push_back({GroupRank(q), name(q)});
  return CheckSameOp(name(rank_), ranks);
}

uint64_t ShmGroup::MaxAux() const {
  const uint32_t parity = (ops_ - 1) & 1;
  uint64_t most = 0;
  for (int q = 0; q < size_; ++q) most = std::max(most, control(q).aux[parity]);
  return most;
}

absl::Status ShmGroup::Run(const CollectiveOp& op, absl::string_view check) {
  Header& h = header();
  if (h.failed.load() != 0) return FailedStatus(" earlier");
  uint64_t aux = 0;
  if (op.kind == OpKind::kAllToAllV) {
    // The rounds this rank needs; every rank runs the most any needs.
    const size_t piece = std::max<size_t>(1, options_.slot_bytes / size_);
    const size_t element = DtypeSize(op.input.dtype);
    size_t largest = 0;
    for (size_t c : op.counts) largest = std::max(largest, c * element);
    for (size_t c : op.recv_counts) largest = std::max(largest, c * element);
    aux = (largest + piece - 1) / piece;
  }
  BeginOp(check, aux);
  absl::Status status;
  switch (op.kind) {
    case OpKind::kBroadcast:
      status = Broadcast(op.output, op.root);
      break;
    case OpKind::kAllReduce:
      status = AllReduceOrReduce(op.output, op.reduce, -1);
      break;
    case OpKind::kReduce:
      status = AllReduceOrReduce(op.output, op.reduce, op.root);
      break;
    case OpKind::kAllGather:
      status = AllGather(op, /*to_root_only=*/false);
      break;
    case OpKind::kGather:
      status = AllGather(op, /*to_root_only=*/true);
      break;
    case OpKind::kAllGatherV:
      status = AllGatherV(op);
      break;
    case OpKind::kScatter:
      status = Scatter(op);
      break;
    case OpKind::kAllToAll:
      status = AllToAll(op);
      break;
    case OpKind::kAllToAllV:
      status = AllToAllV(op);
      break;
    case OpKind::kReduceScatter:
      status = ReduceScatter(op);
      break;
    case OpKind::kBarrier:
      // Every op takes one round before its first barrier, so that ops
      // that stop there (a failed check) leave every rank's rounds alike.
      NextRound();
      status = Barrier();
      break;
  }
  if (!status.ok() && status.code() != absl::StatusCode::kInvalidArgument) {
    Fail(status);
  }
  return status;
}

absl::Status ShmGroup::ReduceToLeader(const BufferView& data, ReduceOp op,
                                      absl::string_view check) {
  BeginOp(check, 0);
  absl::Status status = AllReduceOrReduce(data, op, 0);
  if (!status.ok() && status.code() != absl::StatusCode::kInvalidArgument) {
    Fail(status);
  }
  return status;
}

absl::Status ShmGroup::BroadcastFromLeader(const BufferView& data,
                                           const absl::Status& leader_status) {
  BeginOp("", 0);
  const uint32_t parity = (ops_ - 1) & 1;
  if (rank_ == 0) {
    Control& me = control(0);
    me.status_code[parity] = static_cast<int32_t>(leader_status.code());
    const std::string note(leader_status.message().substr(0, kCheckBytes - 1));
    std::memcpy(me.note[parity], note.c_str(), note.size() + 1);
    if (!leader_status.ok()) {
      // The others learn it at the first round's barrier; nothing is copied.
      NextRound();
      absl::Status arrived = Barrier();
      return arrived.ok() ? leader_status : arrived;
    }
    return Broadcast(data, 0);
  }
  // The first round's barrier publishes the leader's status.
  const size_t bytes = data.bytes();
  char* out = static_cast<char*>(data.data);
  for (size_t off = 0; off == 0 || off < bytes; off += options_.slot_bytes) {
    const uint32_t round = NextRound();
    absl::Status arrived = Barrier();
    if (!arrived.ok()) {
      Fail(arrived);
      return arrived;
    }
    if (off == 0 && control(0).status_code[parity] != 0) {
      return absl::Status(
          static_cast<absl::StatusCode>(control(0).status_code[parity]),
          absl::StrCat("rank ", GroupRank(0),
                       ", this host's leader, failed: ", control(0).note[parity]));
    }
    const size_t n = std::min(options_.slot_bytes, bytes - off);
    CopyBytes(out + off, slot(0, round), n);
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::AllReduceOrReduce(const BufferView& data, ReduceOp op,
                                         int root) {
  const size_t element = DtypeSize(data.dtype);
  const size_t chunk = options_.slot_bytes / element;
  char* bytes = static_cast<char*>(data.data);
  for (size_t off = 0; off == 0 || off < data.count; off += chunk) {
    const size_t m = std::min(chunk, data.count - off);
    const uint32_t round = NextRound();
    CopyBytes(slot(rank_, round), bytes + off * element, m * element);
    RETURN_IF_ERROR(Barrier());
    // This rank's portion of the round, reduced into its own slot: its own
    // value first, then the others' in rank order.
    const auto [begin, end] = Portion(m, element, rank_, size_);
    if (end > begin) {
      char* mine = slot(rank_, round) + begin * element;
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        Combine(data.dtype, op, mine, mine, slot(q, round) + begin * element,
                end - begin);
      }
    }
    RETURN_IF_ERROR(Barrier());
    if (root >= 0 && root != rank_) continue;
    for (int q = 0; q < size_; ++q) {
      const auto [b, e] = Portion(m, element, q, size_);
      CopyBytes(bytes + (off + b) * element, slot(q, round) + b * element,
                (e - b) * element);
    }
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::Broadcast(const BufferView& data, int root) {
  const size_t bytes = data.bytes();
  char* buffer = static_cast<char*>(data.data);
  for (size_t off = 0; off == 0 || off < bytes; off += options_.slot_bytes) {
    const size_t n = std::min(options_.slot_bytes, bytes - off);
    const uint32_t round = NextRound();
    if (rank_ == root) CopyBytes(slot(root, round), buffer + off, n);
    RETURN_IF_ERROR(Barrier());
    if (rank_ != root) CopyBytes(buffer + off, slot(root, round), n);
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::AllGather(const CollectiveOp& op, bool to_root_only) {
  const size_t bytes = op.input.bytes();
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  const bool reads = !to_root_only || rank_ == op.root;
  for (size_t off = 0; off == 0 || off < bytes; off += options_.slot_bytes) {
    const size_t n = std::min(options_.slot_bytes, bytes - off);
    const uint32_t round = NextRound();
    CopyBytes(slot(rank_, round), in + off, n);
    RETURN_IF_ERROR(Barrier());
    if (!reads) continue;
    for (int q = 0; q < size_; ++q) {
      CopyBytes(out + q * bytes + off, slot(q, round), n);
    }
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::AllGatherV(const CollectiveOp& op) {
  const size_t element = DtypeSize(op.input.dtype);
  std::vector<size_t> at(size_ + 1, 0);  // Byte offsets in the output.
  size_t largest = 0;
  for (int q = 0; q < size_; ++q) {
    at[q + 1] = at[q] + op.counts[q] * element;
    largest = std::max(largest, op.counts[q] * element);
  }
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  const size_t s = options_.slot_bytes;
  for (size_t lo = 0; lo == 0 || lo < largest; lo += s) {
    const uint32_t round = NextRound();
    auto part = [&](int q) {
      const size_t total = at[q + 1] - at[q];
      return total > lo ? std::min(s, total - lo) : size_t{0};
    };
    // Offsets only where bytes move: a rank may give nothing (a null input).
    if (const size_t n = part(rank_); n > 0) {
      std::memcpy(slot(rank_, round), in + lo, n);
    }
    RETURN_IF_ERROR(Barrier());
    for (int q = 0; q < size_; ++q) {
      if (const size_t n = part(q); n > 0) {
        std::memcpy(out + at[q] + lo, slot(q, round), n);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::Scatter(const CollectiveOp& op) {
  const size_t block = op.output.bytes();
  const size_t piece = std::max<size_t>(64, options_.slot_bytes / size_ / 64 * 64);
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  for (size_t off = 0; off == 0 || off < block; off += piece) {
    const size_t n = std::min(piece, block - off);
    const uint32_t round = NextRound();
    if (rank_ == op.root) {
      for (int q = 0; q < size_; ++q) {
        CopyBytes(slot(rank_, round) + q * piece, in + q * block + off, n);
      }
    }
    RETURN_IF_ERROR(Barrier());
    CopyBytes(out + off, slot(op.root, round) + rank_ * piece, n);
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::AllToAll(const CollectiveOp& op) {
  const size_t block = op.output.bytes() / size_;
  const size_t piece = std::max<size_t>(64, options_.slot_bytes / size_ / 64 * 64);
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  for (size_t off = 0; off == 0 || off < block; off += piece) {
    const size_t n = std::min(piece, block - off);
    const uint32_t round = NextRound();
    for (int q = 0; q < size_; ++q) {
      CopyBytes(slot(rank_, round) + q * piece, in + q * block + off, n);
    }
    RETURN_IF_ERROR(Barrier());
    for (int q = 0; q < size_; ++q) {
      CopyBytes(out + q * block + off, slot(q, round) + rank_ * piece, n);
    }
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::AllToAllV(const CollectiveOp& op) {
  const size_t element = DtypeSize(op.input.dtype);
  const size_t piece = std::max<size_t>(1, options_.slot_bytes / size_);
  std::vector<size_t> send_at(size_ + 1, 0), recv_at(size_ + 1, 0);
  for (int q = 0; q < size_; ++q) {
    send_at[q + 1] = send_at[q] + op.counts[q] * element;
    recv_at[q + 1] = recv_at[q] + op.recv_counts[q] * element;
  }
  auto part = [piece](size_t total, size_t lo) {
    return total > lo ? std::min(piece, total - lo) : size_t{0};
  };
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  uint64_t rounds = 1;
  for (uint64_t k = 0; k < rounds; ++k) {
    const size_t lo = k * piece;
    const uint32_t round = NextRound();
    for (int q = 0; q < size_; ++q) {
      if (const size_t n = part(send_at[q + 1] - send_at[q], lo); n > 0) {
        std::memcpy(slot(rank_, round) + q * piece, in + send_at[q] + lo, n);
      }
    }
    RETURN_IF_ERROR(Barrier());
    if (k == 0) rounds = std::max<uint64_t>(1, MaxAux());
    for (int q = 0; q < size_; ++q) {
      if (const size_t n = part(recv_at[q + 1] - recv_at[q], lo); n > 0) {
        std::memcpy(out + recv_at[q] + lo, slot(q, round) + rank_ * piece, n);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::ReduceScatter(const CollectiveOp& op) {
  const size_t element = DtypeSize(op.output.dtype);
  const size_t count = op.output.count;
  const size_t piece_bytes =
      std::max<size_t>(64, options_.slot_bytes / size_ / 64 * 64);
  const size_t piece = piece_bytes / element;
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  for (size_t off = 0; off == 0 || off < count; off += piece) {
    const size_t m = std::min(piece, count - off);
    const uint32_t round = NextRound();
    for (int q = 0; q < size_; ++q) {
      CopyBytes(slot(rank_, round) + q * piece_bytes,
                in + (q * count + off) * element, m * element);
    }
    RETURN_IF_ERROR(Barrier());
    // Rank order, straight from the slots into the caller's output.
    char* dst = out + off * element;
    const size_t mine = rank_ * piece_bytes;
    Combine(op.output.dtype, op.reduce, dst, slot(0, round) + mine,
            slot(1, round) + mine, m);
    for (int q = 2; q < size_; ++q) {
      Combine(op.output.dtype, op.reduce, dst, dst, slot(q, round) + mine, m);
    }
  }
  return absl::OkStatus();
}

}  // namespace cohort
