// ShmSegment: forked local ranks that map one segment, rendezvousing
// through a FileStore in the test's temporary directory.
#include "worker/collective/gloo/shm/segment.h"

#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/file_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/collective/gloo/shm/local_ranks.h"

namespace cohort {
namespace {

using testing::ExpectAllOk;
using testing::Fork;
using testing::Local;
using testing::NamesOf;
using testing::TempDir;

absl::StatusOr<std::unique_ptr<ShmSegment>> Join(
    const Local& l, absl::Duration timeout = absl::Seconds(30),
    size_t slot_bytes = 4096) {
  ShmSegmentOptions options;
  options.timeout = timeout;
  options.slot_bytes = slot_bytes;
  return ShmSegment::Create(*l.store, "shm", l.rank, l.size, options);
}

TEST(ShmSegment, EveryRankMapsOneSegmentAndItsNameIsGone) {
  ExpectAllOk(Fork(3, [](const Local& l) -> absl::Status {
    absl::StatusOr<std::unique_ptr<ShmSegment>> s = Join(l);
    if (!s.ok()) return s.status();
    // Local rank 0 removed the name once every rank had mapped it.
    if (l.rank == 0 && !NamesOf(getpid()).empty()) {
      return absl::InternalError("the segment's name outlived the attach");
    }
    for (int q = 0; q < l.size; ++q) {
      if ((*s)->control(q).barrier.pid.load() <= 0) {
        return absl::InternalError(absl::StrCat("rank ", q, " has no pid"));
      }
    }
    // Each rank's two slots are its own: what one writes, the others read.
    const std::string mine = absl::StrCat("rank ", l.rank);
    std::memcpy((*s)->slot(l.rank, 1), mine.c_str(), mine.size() + 1);
    RETURN_IF_ERROR(l.store->Set(absl::StrCat("wrote/", l.rank), "1"));
    RETURN_IF_ERROR(
        l.store->Wait({"wrote/0", "wrote/1", "wrote/2"}, absl::Seconds(30)));
    for (int q = 0; q < l.size; ++q) {
      if ((*s)->slot(q, 1) != absl::StrCat("rank ", q)) {
        return absl::InternalError(
            absl::StrCat("slot of rank ", q, " is '", (*s)->slot(q, 1), "'"));
      }
    }
    return absl::OkStatus();
  }));
}

TEST(ShmSegment, FailureReachesEveryRankWithItsCode) {
  ExpectAllOk(Fork(2, [](const Local& l) -> absl::Status {
    absl::StatusOr<std::unique_ptr<ShmSegment>> s = Join(l);
    if (!s.ok()) return s.status();
    // Healthy at first, on both ranks, before rank 1 fails the group.
    RETURN_IF_ERROR((*s)->FailedStatus(""));
    RETURN_IF_ERROR(l.store->Set(absl::StrCat("healthy/", l.rank), "1"));
    if (l.rank == 1) {
      RETURN_IF_ERROR(l.store->Wait({"healthy/0"}, absl::Seconds(30)));
      (*s)->Fail(absl::DeadlineExceededError("peer too slow"));
      RETURN_IF_ERROR(l.store->Set("failed", "1"));
    }
    RETURN_IF_ERROR(l.store->Wait({"failed"}, absl::Seconds(30)));
    const absl::Status failed = (*s)->FailedStatus(" earlier");
    if (failed.code() != absl::StatusCode::kDeadlineExceeded ||
        !absl::StrContains(failed.message(),
                           "the shared-memory group failed earlier: rank 1: "
                           "DEADLINE_EXCEEDED: peer too slow")) {
      return absl::InternalError(
          absl::StrCat("unexpected: ", failed.ToString()));
    }
    return absl::OkStatus();
  }));
}

TEST(ShmSegmentFaults, CreationNamesTheRankThatNeverCameAndLeavesNoName) {
  std::vector<int> statuses = Fork(
      2,
      [](const Local& l) -> absl::Status {
        absl::StatusOr<std::unique_ptr<ShmSegment>> s =
            Join(l, absl::Milliseconds(500));
        if (s.status().code() != absl::StatusCode::kDeadlineExceeded ||
            !absl::StrContains(s.status().message(), "rank(s) 1 did not map")) {
          return absl::InternalError(
              absl::StrCat("unexpected: ", s.status().ToString()));
        }
        if (!NamesOf(getpid()).empty()) {
          return absl::InternalError("the name was left in /dev/shm");
        }
        return absl::OkStatus();
      },
      /*run=*/{0});
  ExpectAllOk(statuses);
}

TEST(ShmSegmentFaults, ARankThatCannotMapTheSegmentIsNamedAtOnce) {
  ExpectAllOk(Fork(2, [](const Local& l) -> absl::Status {
    // Rank 1 expects slots of another size: the segment is not what it
    // computes, so it cannot map it. Local rank 0 does not wait out its
    // timeout (which outlasts the test) for rank 1: it is told.
    absl::StatusOr<std::unique_ptr<ShmSegment>> s =
        Join(l, absl::Minutes(10), l.rank == 0 ? 4096 : 8192);
    const std::string want = l.rank == 0 ? "a rank could not map it: rank 1"
                                         : "disagree on the group's size";
    if (s.ok() || !absl::StrContains(s.status().message(), want)) {
      return absl::InternalError(
          absl::StrCat("want an error with '", want, "', got ",
                       s.ok() ? "OK" : s.status().ToString()));
    }
    if (l.rank == 0 && !NamesOf(getpid()).empty()) {
      return absl::InternalError("the name was left in /dev/shm");
    }
    return absl::OkStatus();
  }));
}

TEST(ShmSegmentFaults, StaleNamesOfDeadCreatorsAreRemoved) {
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  waitpid(dead, nullptr, 0);
  const std::string stale = absl::StrCat("/dev/shm/cohort.", dead, ".test");
  const std::string fresh = absl::StrCat("/dev/shm/cohort.", dead, ".fresh");
  const std::string live = absl::StrCat("/dev/shm/cohort.", getpid(), ".live");
  for (const std::string& path : {stale, fresh, live}) {
    std::ofstream(path) << "x";
  }
  const timeval old[2] = {{time(nullptr) - 120, 0}, {time(nullptr) - 120, 0}};
  ASSERT_EQ(utimes(stale.c_str(), old), 0);
  ASSERT_EQ(utimes(live.c_str(), old), 0);
  EXPECT_GE(ShmSegment::RemoveStaleSegments(), 1);
  EXPECT_NE(access(stale.c_str(), F_OK), 0)
      << "a dead creator's old name stayed";
  EXPECT_EQ(access(fresh.c_str(), F_OK), 0) << "a young name may be mid-attach";
  EXPECT_EQ(access(live.c_str(), F_OK), 0) << "a live creator's name went";
  unlink(fresh.c_str());
  unlink(live.c_str());
}

TEST(ShmSegmentOptionsTest, RejectsBadOptions) {
  absl::StatusOr<std::unique_ptr<FileStore>> store =
      FileStore::Open(absl::StrCat(TempDir(), "/options_store"));
  ASSERT_TRUE(store.ok());
  ShmSegmentOptions options;
  options.slot_bytes = 1000;
  EXPECT_EQ(ShmSegment::Create(**store, "k", 0, 2, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.slot_bytes = 4096;
  EXPECT_EQ(ShmSegment::Create(**store, "k", 2, 2, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cohort
