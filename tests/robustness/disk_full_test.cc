// cohortd on a disk that fills up: a tmpfs the test mounts in a mount
// namespace of its own (skipped where the sandbox forbids that; the
// injected-Env test in store/rocksdb_engine_test.cc covers the engine then).
//
// Writers hammer the store until the disk is full. cohortd must never abort,
// must answer RESOURCE_EXHAUSTED naming the data dir, turn health
// NOT_SERVING (from the start, with a warning, on a disk that cannot hold
// the reserve), still let keys be deleted (even once RocksDB itself ran out
// of space), come back by itself once space is freed, stop cleanly on
// SIGTERM, refuse to start on a full disk with a clear message, and lose
// nothing it acknowledged.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cohort/v1/store.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/testing/cohortd_process.h"

namespace cohort {
namespace {

using testing::CohortdProcess;
using ::testing::HasSubstr;

// A fresh tmpfs of `mib` MiB at a new folder, visible to this process and
// its children only.
absl::StatusOr<std::string> MountTmpfs(const std::string& name, int mib) {
  static const bool unshared = [] {
    return unshare(CLONE_NEWNS) == 0 &&
           mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0;
  }();
  if (!unshared) {
    return absl::UnavailableError(absl::StrCat(
        "cannot make a private mount namespace: ", strerror(errno)));
  }
  const std::string dir =
      (std::filesystem::path(::testing::TempDir()) / name).string();
  std::filesystem::create_directories(dir);
  const std::string options = absl::StrCat("size=", mib, "m");
  if (mount("tmpfs", dir.c_str(), "tmpfs", 0, options.c_str()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot mount a tmpfs: ", strerror(errno)));
  }
  return dir;
}

// Writes zeros to `path` until the disk is full (or `bytes` are written).
void FillFile(const std::string& path, size_t bytes = ~size_t{0}) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  ASSERT_GE(fd, 0);
  std::string block(1 << 16, '\0');
  size_t written = 0;
  while (written < bytes) {
    ssize_t n =
        write(fd, block.data(), std::min(block.size(), bytes - written));
    if (n <= 0) break;
    written += n;
  }
  close(fd);
}

std::string ValueFor(const std::string& key, size_t size) {
  std::string v = key;
  v.resize(size, static_cast<char>('a' + key.size() % 26));
  return v;
}

class DiskFullTest : public ::testing::Test {
 protected:
  // The size of the tmpfs each test gets, in MiB.
  virtual int DiskMib() const { return 128; }

  void SetUp() override {
    auto mounted = MountTmpfs(
        ::testing::UnitTest::GetInstance()->current_test_info()->name(),
        DiskMib());
    if (!mounted.ok()) GTEST_SKIP() << mounted.status();
    mnt_ = *mounted;
    data_dir_ = mnt_ + "/data";
  }
  void TearDown() override {
    if (!mnt_.empty()) umount2(mnt_.c_str(), MNT_DETACH);
  }

  std::unique_ptr<v1::Store::Stub> Stub(const CohortdProcess& server) {
    return v1::Store::NewStub(grpc::CreateChannel(
        server.address(), grpc::InsecureChannelCredentials()));
  }

  grpc::health::v1::HealthCheckResponse::ServingStatus Health(
      const CohortdProcess& server,
      const std::string& service = "cohort.v1.Store") {
    auto health = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
        server.address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    EXPECT_TRUE(health->Check(&ctx, req, &resp).ok());
    return resp.status();
  }

  bool AwaitHealth(const CohortdProcess& server,
                   grpc::health::v1::HealthCheckResponse::ServingStatus want) {
    for (int i = 0; i < 100; ++i) {
      if (Health(server) == want) return true;
      absl::SleepFor(absl::Milliseconds(100));
    }
    return false;
  }

  // Four writers set fresh keys as fast as they can until each has been
  // refused for 3 s straight, and at least 10 times in a row however slow
  // each call is (a refusal while RocksDB flushes can pass once the flush
  // frees its log). Records every acknowledged key; every refusal must be
  // RESOURCE_EXHAUSTED naming the data dir.
  void WriteUntilFull(const CohortdProcess& server, const std::string& tag,
                      size_t value_bytes) {
    std::vector<std::thread> writers;
    for (int w = 0; w < 4; ++w) {
      writers.emplace_back([&, w] {
        auto stub = Stub(server);
        int refused_in_a_row = 0;
        absl::Time refused_since = absl::InfiniteFuture();
        for (int i = 0; i < 100000; ++i) {
          if (refused_in_a_row >= 10 &&
              absl::Now() - refused_since > absl::Seconds(3)) {
            break;
          }
          const std::string key = absl::StrCat(tag, "/", w, "/", i);
          v1::SetRequest req;
          req.set_key(key);
          req.set_value(ValueFor(key, value_bytes));
          v1::SetResponse resp;
          grpc::ClientContext ctx;
          grpc::Status s = stub->Set(&ctx, req, &resp);
          if (s.ok()) {
            refused_in_a_row = 0;
            refused_since = absl::InfiniteFuture();
            absl::MutexLock lock(&mu_);
            acked_[key] = value_bytes;
            continue;
          }
          if (refused_in_a_row++ == 0) refused_since = absl::Now();
          absl::SleepFor(absl::Milliseconds(20));
          absl::MutexLock lock(&mu_);
          ++refusals_;
          last_refusal_ = s.error_message();
          if (s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED ||
              s.error_message().find(data_dir_) == std::string::npos) {
            bad_refusals_.push_back(
                absl::StrCat(s.error_code(), ": ", s.error_message()));
          }
        }
      });
    }
    for (auto& t : writers) t.join();
  }

  // Every acknowledged key, minus the deleted ones, has its value.
  void ExpectAllAcked(const CohortdProcess& server) {
    auto stub = Stub(server);
    absl::MutexLock lock(&mu_);
    size_t lost = 0;
    for (const auto& [key, size] : acked_) {
      v1::GetRequest req;
      req.set_key(key);
      req.set_timeout_ms(1);
      v1::GetResponse resp;
      grpc::ClientContext ctx;
      grpc::Status s = stub->Get(&ctx, req, &resp);
      if (!s.ok() || resp.value() != ValueFor(key, size)) {
        ++lost;
        ADD_FAILURE() << "lost " << key << ": " << s.error_message() << " "
                      << resp.value().size() << " bytes";
      }
    }
    EXPECT_EQ(lost, 0u) << "of " << acked_.size() << " acknowledged keys";
  }

  // Deletes `keys` one call each; returns the errors, "key: message".
  std::vector<std::string> DeleteEach(const CohortdProcess& server,
                                      const std::vector<std::string>& keys) {
    auto stub = Stub(server);
    std::vector<std::string> failed;
    for (const std::string& key : keys) {
      v1::DeleteRequest del;
      del.set_key(key);
      v1::DeleteResponse deleted;
      grpc::ClientContext ctx;
      grpc::Status s = stub->Delete(&ctx, del, &deleted);
      if (!s.ok()) {
        failed.push_back(absl::StrCat(key, ": ", s.error_message()));
      } else if (!deleted.deleted()) {
        failed.push_back(absl::StrCat(key, ": not there to delete"));
      }
    }
    return failed;
  }

  // The keys under `prefix`, up to 10000.
  std::vector<std::string> List(const CohortdProcess& server,
                                const std::string& prefix) {
    v1::ListKeysRequest req;
    req.set_prefix(prefix);
    v1::ListKeysResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = Stub(server)->ListKeys(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return {resp.keys().begin(), resp.keys().end()};
  }

  std::string mnt_, data_dir_;
  absl::Mutex mu_;
  std::map<std::string, size_t> acked_ ABSL_GUARDED_BY(mu_);
  int refusals_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_refusal_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> bad_refusals_ ABSL_GUARDED_BY(mu_);
};

// The reserve keeps RocksDB itself from ever running out of space.
TEST_F(DiskFullTest, ReserveRefusesWritesAndDeletesStillWork) {
  const std::string ballast = mnt_ + "/ballast";
  FillFile(ballast, 40 << 20);
  auto server = CohortdProcess::Start(
      {"--data_dir=" + data_dir_, "--min_free_bytes=8388608"});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(Health(*server), grpc::health::v1::HealthCheckResponse::SERVING);

  WriteUntilFull(*server, "a", 256 << 10);
  {
    absl::MutexLock lock(&mu_);
    EXPECT_GT(acked_.size(), 10u);
    EXPECT_GE(refusals_, 40);
    EXPECT_THAT(bad_refusals_, ::testing::IsEmpty());
  }
  EXPECT_TRUE(
      AwaitHealth(*server, grpc::health::v1::HealthCheckResponse::NOT_SERVING))
      << "last refusal: " << last_refusal_;
  EXPECT_THAT(server->Log(), HasSubstr("health: NOT_SERVING"));
  // What a liveness probe asks stays SERVING: a full disk must not get
  // cohortd restarted.
  EXPECT_EQ(Health(*server, "liveness"),
            grpc::health::v1::HealthCheckResponse::SERVING);

  // Deleting works on the full disk.
  auto stub = Stub(*server);
  std::string victim;
  {
    absl::MutexLock lock(&mu_);
    victim = acked_.begin()->first;
  }
  v1::DeleteRequest del;
  del.set_key(victim);
  v1::DeleteResponse deleted;
  grpc::ClientContext ctx;
  grpc::Status del_status = stub->Delete(&ctx, del, &deleted);
  ASSERT_TRUE(del_status.ok()) << del_status.error_message();
  EXPECT_TRUE(deleted.deleted());
  {
    absl::MutexLock lock(&mu_);
    acked_.erase(victim);
  }

  // Space comes back: so do health and writes, by themselves.
  std::filesystem::remove(ballast);
  EXPECT_TRUE(
      AwaitHealth(*server, grpc::health::v1::HealthCheckResponse::SERVING));
  EXPECT_THAT(server->Log(), HasSubstr("health: SERVING again"));
  v1::SetRequest set;
  set.set_key("after");
  set.set_value("space");
  v1::SetResponse set_resp;
  grpc::ClientContext set_ctx;
  EXPECT_TRUE(stub->Set(&set_ctx, set, &set_resp).ok());

  const int status = server->Stop(SIGTERM);
  ASSERT_TRUE(WIFEXITED(status)) << server->Log();
  EXPECT_EQ(WEXITSTATUS(status), 0);
  auto restarted = CohortdProcess::Start({"--data_dir=" + data_dir_});
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  ExpectAllAcked(*restarted);
}

// No reserve: RocksDB's own writes hit ENOSPC, the hardest case.
TEST_F(DiskFullTest, OutOfSpaceInRocksDbNeverAbortsAndLosesNothing) {
  auto server =
      CohortdProcess::Start({"--data_dir=" + data_dir_, "--min_free_bytes=0"});
  ASSERT_TRUE(server.ok()) << server.status();
  // Eat the space from outside, as another tenant of the disk would, then
  // let the writers take the last of it.
  const std::string ballast = mnt_ + "/ballast";
  FillFile(ballast, 100 << 20);
  WriteUntilFull(*server, "b", 64 << 10);
  {
    absl::MutexLock lock(&mu_);
    EXPECT_GT(acked_.size(), 0u);
    EXPECT_THAT(bad_refusals_, ::testing::IsEmpty());
  }
  ASSERT_EQ(kill(server->pid(), 0), 0) << "cohortd died:\n" << server->Log();
  EXPECT_TRUE(
      AwaitHealth(*server, grpc::health::v1::HealthCheckResponse::NOT_SERVING));

  // Freed space: writes resume without a restart.
  std::filesystem::remove(ballast);
  EXPECT_TRUE(
      AwaitHealth(*server, grpc::health::v1::HealthCheckResponse::SERVING))
      << server->Log();
  auto stub = Stub(*server);
  v1::SetRequest set;
  set.set_key("after");
  set.set_value(ValueFor("after", 10));
  v1::SetResponse set_resp;
  grpc::ClientContext set_ctx;
  EXPECT_TRUE(stub->Set(&set_ctx, set, &set_resp).ok());
  {
    absl::MutexLock lock(&mu_);
    acked_["after"] = 10;
  }

  // Full again, then SIGTERM: a clean exit that says where the data is.
  FillFile(ballast);
  WriteUntilFull(*server, "c", 64 << 10);
  int status = server->Stop(SIGTERM);
  ASSERT_TRUE(WIFEXITED(status)) << server->Log();
  EXPECT_EQ(WEXITSTATUS(status), 0) << server->Log();
  EXPECT_THAT(server->Log(), HasSubstr("stopped"));

  // Starting on the full disk: refused with a message, not an abort.
  FillFile(ballast);
  auto on_full = CohortdProcess::Start({"--data_dir=" + data_dir_});
  if (on_full.ok()) {
    // RocksDB found enough room to open: then it must serve what it has.
    ExpectAllAcked(*on_full);
    on_full->Stop(SIGTERM);
  } else {
    EXPECT_THAT(on_full.status().message(), HasSubstr("bytes free"));
    EXPECT_THAT(on_full.status().message(),
                ::testing::Not(HasSubstr("Assertion")));
  }

  std::filesystem::remove(ballast);
  auto restarted = CohortdProcess::Start({"--data_dir=" + data_dir_});
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  ExpectAllAcked(*restarted);
}

// Issue 24: with a small reserve on a disk another program filled, RocksDB
// itself ran out of space logging a delete, and then every delete failed
// with its error ("7 of 8 deletes failed"). The reserve's ballast file is
// given back so that they go through.
TEST_F(DiskFullTest, DeletesWorkOnceRocksDbItselfRanOutOfSpace) {
  auto server = CohortdProcess::Start(
      {"--data_dir=" + data_dir_, "--min_free_bytes=1048576"});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(std::filesystem::exists(data_dir_ + "/cohort-reserve"));
  auto stub = Stub(*server);
  std::vector<std::string> doomed;
  for (int i = 0; i < 300; ++i) {
    const std::string key = absl::StrCat("d/", i);
    v1::SetRequest set;
    set.set_key(key);
    set.set_value(ValueFor(key, 16 << 10));
    v1::SetResponse set_resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Set(&ctx, set, &set_resp).ok());
    absl::MutexLock lock(&mu_);
    acked_[key] = 16 << 10;
    if (i % 3 != 0) doomed.push_back(key);
  }

  // Another tenant takes every free byte. The deletes' log records need
  // more than the last page of the WAL holds, so RocksDB hits ENOSPC.
  const std::string ballast = mnt_ + "/ballast";
  FillFile(ballast);
  EXPECT_THAT(DeleteEach(*server, doomed), ::testing::IsEmpty())
      << "of " << doomed.size() << " deletes";
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& key : doomed) acked_.erase(key);
  }
  EXPECT_EQ(List(*server, "d/").size(), 100u);
  EXPECT_THAT(server->Log(), HasSubstr("gave back the reserve's 1048576-byte "
                                       "ballast file to let deletes through"));
  EXPECT_TRUE(
      AwaitHealth(*server, grpc::health::v1::HealthCheckResponse::NOT_SERVING));
  // The ballast let deletes through, not puts.
  v1::SetRequest set;
  set.set_key("refused");
  set.set_value("x");
  v1::SetResponse set_resp;
  grpc::ClientContext set_ctx;
  EXPECT_EQ(stub->Set(&set_ctx, set, &set_resp).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);

  // Space is back: writes and the ballast come back by themselves.
  std::filesystem::remove(ballast);
  EXPECT_TRUE(
      AwaitHealth(*server, grpc::health::v1::HealthCheckResponse::SERVING))
      << server->Log();
  EXPECT_TRUE(std::filesystem::exists(data_dir_ + "/cohort-reserve"));
  grpc::ClientContext after_ctx;
  set.set_key("after");
  set.set_value(ValueFor("after", 10));
  EXPECT_TRUE(stub->Set(&after_ctx, set, &set_resp).ok());
  {
    absl::MutexLock lock(&mu_);
    acked_["after"] = 10;
  }

  const int status = server->Stop(SIGTERM);
  ASSERT_TRUE(WIFEXITED(status)) << server->Log();
  EXPECT_EQ(WEXITSTATUS(status), 0) << server->Log();
  auto restarted = CohortdProcess::Start({"--data_dir=" + data_dir_});
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  EXPECT_EQ(List(*restarted, "d/").size(), 100u);
  ExpectAllAcked(*restarted);
}

class SmallDiskTest : public DiskFullTest {
 protected:
  int DiskMib() const override { return 16; }
};

// Issue 24: on a disk smaller than the reserve every write is refused, yet
// cohortd started without a word and health said SERVING until the first
// refused write.
TEST_F(SmallDiskTest, ReserveLargerThanTheDiskIsNotServingFromTheStart) {
  auto server = CohortdProcess::Start({"--data_dir=" + data_dir_});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(Health(*server),
            grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Health(*server, "liveness"),
            grpc::health::v1::HealthCheckResponse::SERVING);
  const std::string log = server->Log();
  EXPECT_THAT(log,
              HasSubstr(absl::StrCat("warning: the data dir ", data_dir_,
                                     " is on a disk of ", 16 << 20, " bytes")));
  EXPECT_THAT(log, HasSubstr(absl::StrCat(
                       "less than the ", 64 << 20,
                       " bytes it keeps in reserve (--min_free_bytes)")));
  EXPECT_THAT(log, HasSubstr("--min_free_bytes is lowered below the disk's"));
  EXPECT_LT(log.find("warning: "), log.find("serving cohort.v1.Store on "));

  // The refusal it announced; reads and deletes work.
  auto stub = Stub(*server);
  v1::SetRequest set;
  set.set_key("k");
  set.set_value("v");
  v1::SetResponse set_resp;
  grpc::ClientContext ctx;
  EXPECT_EQ(stub->Set(&ctx, set, &set_resp).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(DeleteEach(*server, {"k"}),
              ::testing::ElementsAre("k: not there to delete"));
}

// The same from a disk whose free space, not its size, is short of the
// reserve at start; health turns SERVING once the space is there.
TEST_F(DiskFullTest, ReserveTheFreeSpaceCannotHoldIsNotServingUntilItCan) {
  const std::string ballast = mnt_ + "/ballast";
  FillFile(ballast, 120 << 20);
  auto server = CohortdProcess::Start(
      {"--data_dir=" + data_dir_, "--min_free_bytes=16777216"});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(Health(*server),
            grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_THAT(server->Log(), HasSubstr(absl::StrCat(
                                 "warning: the data dir ", data_dir_,
                                 " is on a disk of ", 128 << 20, " bytes")));
  EXPECT_THAT(server->Log(), HasSubstr("until space is freed on that disk"));

  std::filesystem::remove(ballast);
  EXPECT_TRUE(
      AwaitHealth(*server, grpc::health::v1::HealthCheckResponse::SERVING));
  EXPECT_THAT(server->Log(), HasSubstr("health: SERVING again"));
  v1::SetRequest set;
  set.set_key("k");
  set.set_value("v");
  v1::SetResponse set_resp;
  grpc::ClientContext ctx;
  EXPECT_TRUE(Stub(*server)->Set(&ctx, set, &set_resp).ok());
}

}  // namespace
}  // namespace cohort
