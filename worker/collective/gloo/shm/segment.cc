#include "worker/collective/gloo/shm/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
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

namespace cohort {
namespace {

constexpr uint64_t kMagic = 0x636f686f72747368;  // "cohortsh"
constexpr size_t kPage = ShmSegment::kPage;
constexpr absl::Duration kStaleAge = absl::Minutes(1);
constexpr char kNamePrefix[] = "cohort.";
constexpr char kSetupFailure[] = "cohort.dev/shm-setup-failure";

absl::Status SetupFailure(std::string why) {
  absl::Status status = absl::UnavailableError(std::move(why));
  status.SetPayload(kSetupFailure, absl::Cord("1"));
  return status;
}

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Where the data slots begin: after the header's page and the control
// blocks, on a page boundary.
size_t DataOffset(int size) {
  return RoundUp(kPage + size * sizeof(ShmSegment::Control), kPage);
}

size_t TotalBytes(int size, size_t slot_bytes) {
  return DataOffset(size) + 2 * static_cast<size_t>(size) * slot_bytes;
}

}  // namespace

struct ShmSegment::Header {
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

ShmSegment::ShmSegment(int rank, int size, const ShmSegmentOptions& options,
                       void* base, size_t bytes)
    : rank_(rank),
      size_(size),
      options_(options),
      base_(base),
      bytes_(bytes),
      data_offset_(DataOffset(size)) {}

ShmSegment::~ShmSegment() { munmap(base_, bytes_); }

ShmSegment::Header& ShmSegment::header() const {
  return *static_cast<Header*>(base_);
}

int ShmSegment::GroupRank(int local) const {
  return options_.group_ranks.empty() ? local : options_.group_ranks[local];
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Create(
    Store& store, absl::string_view key, int rank, int size,
    const ShmSegmentOptions& options) {
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
  if (rank == 0) return CreateAsLeader(store, key, size, options, deadline);
  return OpenAsPeer(store, key, rank, size, options, deadline);
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::CreateAsLeader(
    Store& store, absl::string_view key, int size,
    const ShmSegmentOptions& options, absl::Time deadline) {
  const size_t total = TotalBytes(size, options.slot_bytes);
  RemoveStaleSegments();
  std::random_device random;
  const std::string name = absl::StrFormat("/%s%d.%08x%08x", kNamePrefix,
                                           getpid(), random(), random());
  int fd = -1;
  // Every failure to set the segment up reaches the other local ranks
  // through the key, so that they fail with the reason, not a timeout.
  auto fail = [&](std::string why) -> absl::Status {
    if (fd >= 0) {
      shm_unlink(name.c_str());
      close(fd);
    }
    why = absl::StrCat(
        "local rank 0 could not set up the shared-memory segment for ", size,
        " ranks: ", why);
    store.Set(key, absl::StrCat("!", why)).IgnoreError();
    return SetupFailure(why);
  };
  fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return fail(absl::StrCat("shm_open(", name, "): ", strerror(errno)));
  }
  const int reserved = posix_fallocate(fd, 0, static_cast<off_t>(total));
  if (reserved != 0) {
    return fail(absl::StrCat("reserving ", total,
                             " bytes in /dev/shm: ", strerror(reserved)));
  }
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
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
  auto segment = std::unique_ptr<ShmSegment>(
      new ShmSegment(0, size, options, base, total));
  absl::Status all = segment->AwaitPeersAttached(store, key, name, deadline);
  // Mapped by all (or given up on): the name goes, the memory stays while
  // mapped.
  shm_unlink(name.c_str());
  if (!all.ok()) {
    segment->Fail(all);
    return all;
  }
  return segment;
}

absl::Status ShmSegment::AwaitPeersAttached(Store& store, absl::string_view key,
                                            const std::string& name,
                                            absl::Time deadline) {
  Header& h = header();
  control(0).barrier.pid.store(getpid());
  h.attached.fetch_add(1);
  const std::string failed_key = absl::StrCat(key, "/failed");
  while (true) {
    const uint32_t seen = h.attached.load();
    if (seen >= static_cast<uint32_t>(size_)) return absl::OkStatus();
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    FutexWait(&h.attached, seen, std::min(left, kFutexSlice));
    if (h.attached.load() >= static_cast<uint32_t>(size_)) continue;
    // Slower than a slice: has a rank said it cannot map it?
    absl::StatusOr<bool> failed = store.Check({failed_key});
    if (failed.ok() && *failed) {
      absl::StatusOr<std::string> why = store.Get(failed_key, kFutexSlice);
      return absl::UnavailableError(absl::StrCat(
          "shared-memory segment ", name, ": a rank could not map it: ",
          why.ok() ? *why : why.status().ToString()));
    }
  }
  std::vector<int> missing;
  for (int r = 0; r < size_; ++r) {
    if (control(r).barrier.pid.load() == 0) missing.push_back(GroupRank(r));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("shared-memory segment ", name, ": rank(s) ",
                   absl::StrJoin(missing, ", "), " did not map it within ",
                   absl::FormatDuration(options_.timeout)));
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::OpenAsPeer(
    Store& store, absl::string_view key, int rank, int size,
    const ShmSegmentOptions& options, absl::Time deadline) {
  absl::StatusOr<std::string> value = store.Get(key, options.timeout);
  if (!value.ok()) {
    return absl::Status(
        value.status().code(),
        absl::StrCat("waiting for local rank 0 to publish the shared-memory "
                     "segment: ",
                     value.status().message()));
  }
  if (absl::StartsWith(*value, "!")) return SetupFailure(value->substr(1));
  // A rank that cannot map the segment says why under `key`/failed, so that
  // local rank 0 stops waiting for it at once, and names it.
  absl::StatusOr<std::unique_ptr<ShmSegment>> mapped =
      Map(*value, rank, size, options);
  if (!mapped.ok()) {
    const int group_rank =
        options.group_ranks.empty() ? rank : options.group_ranks[rank];
    store
        .Set(
            absl::StrCat(key, "/failed"),
            absl::StrCat("rank ", group_rank, ": ", mapped.status().ToString()))
        .IgnoreError();
    return mapped.status();
  }
  absl::Status all = (*mapped)->AttachAndAwaitPeers(deadline);
  if (!all.ok()) return all;
  return mapped;
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Map(
    const std::string& name, int rank, int size,
    const ShmSegmentOptions& options) {
  const size_t total = TotalBytes(size, options.slot_bytes);
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
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
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    return absl::UnavailableError(
        absl::StrCat("mmap of ", name, ": ", strerror(errno)));
  }
  auto segment = std::unique_ptr<ShmSegment>(
      new ShmSegment(rank, size, options, base, total));
  const Header& h = segment->header();
  if (h.magic != kMagic || h.size != static_cast<uint32_t>(size) ||
      h.slot_bytes != options.slot_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("shared-memory segment ", name, " is not this group's (",
                     h.size, " ranks, slots of ", h.slot_bytes, " bytes)"));
  }
  return segment;
}

absl::Status ShmSegment::AttachAndAwaitPeers(absl::Time deadline) {
  Header& h = header();
  control(rank_).barrier.pid.store(getpid());
  h.attached.fetch_add(1);
  FutexWake(&h.attached);
  while (true) {
    const uint32_t seen = h.attached.load();
    if (seen >= static_cast<uint32_t>(size_)) return absl::OkStatus();
    if (h.failed.load() != 0) {
      return absl::UnavailableError(
          absl::StrCat("local rank 0 gave up on the shared-memory segment: ",
                       h.failed.load() == 2 ? h.failure : "(no reason yet)"));
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "not every local rank mapped the shared-memory segment within ",
          absl::FormatDuration(options_.timeout)));
    }
    FutexWait(&h.attached, seen, std::min(left, kFutexSlice));
  }
}

bool ShmSegment::IsSetupFailure(const absl::Status& status) {
  return status.GetPayload(kSetupFailure).has_value();
}

int ShmSegment::RemoveStaleSegments() {
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

void ShmSegment::Fail(const absl::Status& status) {
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
  for (int r = 0; r < size_; ++r) FutexWake(&control(r).barrier.arrived);
}

absl::Status ShmSegment::FailedStatus(absl::string_view when) const {
  const Header& h = header();
  const uint32_t failed = h.failed.load();
  if (failed == 0) return absl::OkStatus();
  if (failed != 2) {
    return absl::UnavailableError(absl::StrCat(
        "the shared-memory group failed", when, " (a rank is reporting why)"));
  }
  // The first failure's code: a peer that timed out makes everyone's op
  // DEADLINE_EXCEEDED, a dead one UNAVAILABLE.
  return absl::Status(
      static_cast<absl::StatusCode>(h.failure_code),
      absl::StrCat("the shared-memory group failed", when, ": ", h.failure));
}

}  // namespace cohort
