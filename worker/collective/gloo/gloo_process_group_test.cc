// Runs real ranks as forked processes over loopback, rendezvousing through
// a real cohortd (a subprocess: gRPC does not survive fork, so the parent
// never touches gRPC and each rank opens its own RemoteStore).
#include "worker/collective/gloo/gloo_process_group.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/remote_store.h"
#include "gtest/gtest.h"
#include "tests/testing/cohortd_process.h"
#include "tests/testing/in_process_store.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

constexpr Dtype kDtypes[] = {Dtype::kF32,  Dtype::kF64, Dtype::kF16,
                             Dtype::kBF16, Dtype::kI8,  Dtype::kU8,
                             Dtype::kI32,  Dtype::kI64};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin,
                             ReduceOp::kMax, ReduceOp::kAvg};
constexpr absl::Duration kWait = absl::Seconds(30);

// cohortd (bazel's //server:cohortd, a data dependency) on a free port,
// shared by the tests of a suite.
class Cohortd {
 public:
  static void Start() {
    auto server = testing::CohortdProcess::Start({"--engine=memory"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = new testing::CohortdProcess(std::move(*server));
  }
  static void Stop() {
    delete server_;
    server_ = nullptr;
  }
  static std::string address() { return server_->address(); }

 private:
  static inline testing::CohortdProcess* server_ = nullptr;
};

// How the ranks of a test reach each other.
enum class Transport {
  kTcp,       // Loopback TCP only (shm.enabled off).
  kShm,       // One host: every collective over shared memory.
  kTwoHosts,  // Even and odd ranks on two simulated hosts: AllReduce
              // hierarchical (shared memory, then TCP among the leaders).
};

std::string TransportName(Transport t) {
  switch (t) {
    case Transport::kTcp:
      return "Tcp";
    case Transport::kShm:
      return "Shm";
    case Transport::kTwoHosts:
      return "TwoHosts";
  }
  return "?";
}

// What a rank's main function gets.
struct Rank {
  int rank;
  int world;
  std::string prefix;  // Unique to this RunRanks call.
  std::shared_ptr<Store> store;
  Transport transport = Transport::kShm;

  absl::StatusOr<std::unique_ptr<GlooProcessGroup>> NewGroup(
      absl::Duration timeout = absl::Seconds(20), int threads = 2,
      bool verify_ops = true) const {
    GlooOptions options;
    options.group.timeout = timeout;
    options.group.threads = threads;
    options.group.verify_ops = verify_ops;
    options.store_prefix = prefix;
    options.bind_address = "127.0.0.1";
    options.shm.enabled = transport != Transport::kTcp;
    // Small slots, so that the tests' buffers take many rounds.
    options.shm.slot_bytes = 8192;
    options.shm.host_id = transport == Transport::kTwoHosts
                              ? absl::StrCat("host", rank % 2)
                              : "one host";
    return GlooProcessGroup::Create(store, rank, world, options);
  }
};

using RankMain = std::function<absl::Status(const Rank&)>;

// Forks `processes` ranks of a group of `world` and expects every one to
// return OK within 60 s. A failing rank prints why on stderr.
void RunRanks(int world, int processes, const RankMain& main,
              Transport transport = Transport::kShm) {
  static int groups = 0;
  const std::string prefix = absl::StrCat(
      ::testing::UnitTest::GetInstance()->current_test_info()->name(), "/",
      groups++);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < processes; ++rank) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      absl::Status status = [&]() -> absl::Status {
        absl::StatusOr<std::unique_ptr<RemoteStore>> remote =
            RemoteStore::Connect({.address = Cohortd::address()});
        if (!remote.ok()) return remote.status();
        return main(Rank{rank, world, prefix, std::move(*remote), transport});
      }();
      if (!status.ok()) {
        std::fprintf(stderr, "rank %d of %d failed: %s\n", rank, world,
                     status.ToString().c_str());
      }
      std::fflush(stderr);
      _exit(status.ok() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  for (int rank = 0; rank < processes; ++rank) {
    int status = 0;
    while (waitpid(pids[rank], &status, WNOHANG) == 0) {
      if (absl::Now() > give_up) {
        for (pid_t pid : pids) kill(pid, SIGKILL);
        waitpid(pids[rank], &status, 0);
        ADD_FAILURE() << "rank " << rank << " still running after 60 s";
        break;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << rank << " of " << world << " failed (wait status "
        << status << ")";
  }
}

// The value rank `rank` contributes at element `i`: small integers (so
// every sum and product of up to 4 ranks is exact in every dtype), negative
// for half of the elements of signed dtypes.
double Value(Dtype dtype, int rank, size_t i) {
  const int magnitude = 1 + static_cast<int>((rank + i) % 3);
  const bool negative = dtype != Dtype::kU8 && (rank + i) % 2 == 1;
  return negative ? -magnitude : magnitude;
}

double Reference(Dtype dtype, ReduceOp op, int world, size_t i) {
  double result = Value(dtype, 0, i);
  for (int r = 1; r < world; ++r) {
    const double v = Value(dtype, r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        result += v;
        break;
      case ReduceOp::kProd:
        result *= v;
        break;
      case ReduceOp::kMin:
        result = std::min(result, v);
        break;
      case ReduceOp::kMax:
        result = std::max(result, v);
        break;
    }
  }
  if (op == ReduceOp::kAvg) {
    result /= world;
    if (dtype != Dtype::kF32 && dtype != Dtype::kF64 && dtype != Dtype::kF16 &&
        dtype != Dtype::kBF16) {
      result = std::trunc(result);
    }
  }
  return result;
}

// `values` as the bytes of a buffer of `dtype`.
std::vector<char> Encode(Dtype dtype, const std::vector<double>& values) {
  std::vector<char> bytes(values.size() * DtypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    char* at = bytes.data() + i * DtypeSize(dtype);
    const double v = values[i];
    auto put = [at](auto x) { std::memcpy(at, &x, sizeof(x)); };
    switch (dtype) {
      case Dtype::kF32:
        put(static_cast<float>(v));
        break;
      case Dtype::kF64:
        put(v);
        break;
      case Dtype::kF16:
        put(FloatToHalf(static_cast<float>(v)));
        break;
      case Dtype::kBF16:
        put(FloatToBFloat16(static_cast<float>(v)));
        break;
      case Dtype::kI8:
        put(static_cast<int8_t>(v));
        break;
      case Dtype::kU8:
        put(static_cast<uint8_t>(v));
        break;
      case Dtype::kI32:
        put(static_cast<int32_t>(v));
        break;
      case Dtype::kI64:
        put(static_cast<int64_t>(v));
        break;
    }
  }
  return bytes;
}

BufferView View(std::vector<char>& bytes, Dtype dtype) {
  return BufferView{bytes.data(), bytes.size() / DtypeSize(dtype), dtype};
}

absl::Status ExpectEqual(absl::string_view what,
                         const std::vector<char>& actual,
                         const std::vector<char>& expected) {
  if (actual == expected) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": result differs"));
}

absl::Status WaitOk(const std::shared_ptr<Work>& work, absl::string_view what) {
  absl::Status status = work->Wait(kWait);
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(what, ": ", status.message()));
  }
  return absl::OkStatus();
}

#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  } while (false)

// A value unique to (rank, i) for the ops that move data without reducing
// it, so that a misplaced element shows; exact in every dtype for the small
// worlds and counts here.
double Distinct(int rank, size_t i) {
  return rank * 16 + static_cast<double>(i);
}

std::vector<double> DistinctRange(int rank, size_t from, size_t count) {
  std::vector<double> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = Distinct(rank, from + i);
  return v;
}

void Append(std::vector<char>& to, const std::vector<char>& bytes) {
  to.insert(to.end(), bytes.begin(), bytes.end());
}

// Reduce, Gather, Scatter, AllToAll, AllGatherV and AllToAllV for `dtype`.
absl::Status CheckRootedAndVariableOps(const Rank& r, ProcessGroup& pg,
                                       Dtype dtype) {
  const std::string name(DtypeName(dtype));
  const size_t element = DtypeSize(dtype);
  constexpr size_t kCount = 4;
  for (ReduceOp op : kOps) {
    const std::string what =
        absl::StrCat("Reduce ", name, " ", ReduceOpName(op));
    const int root = r.world / 2;
    std::vector<double> mine(kCount);
    std::vector<double> expected(kCount);
    for (size_t i = 0; i < kCount; ++i) {
      mine[i] = Value(dtype, r.rank, i);
      expected[i] = Reference(dtype, op, r.world, i);
    }
    std::vector<char> buffer = Encode(dtype, mine);
    RETURN_IF_ERROR(WaitOk(pg.Reduce(View(buffer, dtype), root, op), what));
    RETURN_IF_ERROR(ExpectEqual(
        what, buffer, Encode(dtype, r.rank == root ? expected : mine)));
  }

  // Gather to the last rank; Scatter from the first.
  std::vector<char> input = Encode(dtype, DistinctRange(r.rank, 0, kCount));
  std::vector<char> gathered(r.rank == r.world - 1 ? kCount * r.world * element
                                                   : 0);
  RETURN_IF_ERROR(
      WaitOk(pg.Gather(View(input, dtype), View(gathered, dtype), r.world - 1),
             "Gather " + name));
  if (r.rank == r.world - 1) {
    std::vector<char> expected;
    for (int rank = 0; rank < r.world; ++rank) {
      Append(expected, Encode(dtype, DistinctRange(rank, 0, kCount)));
    }
    RETURN_IF_ERROR(ExpectEqual("Gather " + name, gathered, expected));
  }
  std::vector<char> to_scatter =
      r.rank == 0 ? Encode(dtype, DistinctRange(0, 0, kCount * r.world))
                  : std::vector<char>();
  std::vector<char> scattered(kCount * element);
  RETURN_IF_ERROR(
      WaitOk(pg.Scatter(View(to_scatter, dtype), View(scattered, dtype), 0),
             "Scatter " + name));
  RETURN_IF_ERROR(
      ExpectEqual("Scatter " + name, scattered,
                  Encode(dtype, DistinctRange(0, r.rank * kCount, kCount))));

  // AllToAll: block j of rank i (2 elements) lands in block i of rank j.
  constexpr size_t kBlock = 2;
  std::vector<char> all_in =
      Encode(dtype, DistinctRange(r.rank, 0, kBlock * r.world));
  std::vector<char> all_out(all_in.size());
  RETURN_IF_ERROR(WaitOk(pg.AllToAll(View(all_in, dtype), View(all_out, dtype)),
                         "AllToAll " + name));
  std::vector<char> all_expected;
  for (int rank = 0; rank < r.world; ++rank) {
    Append(all_expected,
           Encode(dtype, DistinctRange(rank, r.rank * kBlock, kBlock)));
  }
  RETURN_IF_ERROR(ExpectEqual("AllToAll " + name, all_out, all_expected));

  // AllGatherV: rank 1 contributes nothing, the others rank + 1 elements.
  std::vector<size_t> counts(r.world);
  for (int rank = 0; rank < r.world; ++rank)
    counts[rank] = rank == 1 ? 0 : rank + 1;
  std::vector<char> v_in =
      Encode(dtype, DistinctRange(r.rank, 0, counts[r.rank]));
  std::vector<char> v_expected;
  for (int rank = 0; rank < r.world; ++rank) {
    Append(v_expected, Encode(dtype, DistinctRange(rank, 0, counts[rank])));
  }
  std::vector<char> v_out(v_expected.size());
  RETURN_IF_ERROR(
      WaitOk(pg.AllGatherV(View(v_in, dtype), View(v_out, dtype), counts),
             "AllGatherV " + name));
  RETURN_IF_ERROR(ExpectEqual("AllGatherV " + name, v_out, v_expected));

  // AllToAllV: rank i sends (i + j) % 3 elements to rank j, numbered from
  // where that block starts in its input.
  auto count = [](int from, int to) -> size_t { return (from + to) % 3; };
  std::vector<size_t> send_counts(r.world);
  std::vector<size_t> recv_counts(r.world);
  for (int rank = 0; rank < r.world; ++rank) {
    send_counts[rank] = count(r.rank, rank);
    recv_counts[rank] = count(rank, r.rank);
  }
  std::vector<char> send, recv_expected;
  size_t at = 0;
  for (int rank = 0; rank < r.world; ++rank) {
    Append(send, Encode(dtype, DistinctRange(r.rank, at, send_counts[rank])));
    at += send_counts[rank];
    size_t offset = 0;  // Where rank's block for us starts in its input.
    for (int to = 0; to < r.rank; ++to) offset += count(rank, to);
    Append(recv_expected,
           Encode(dtype, DistinctRange(rank, offset, recv_counts[rank])));
  }
  std::vector<char> recv(recv_expected.size());
  RETURN_IF_ERROR(WaitOk(pg.AllToAllV(View(send, dtype), send_counts,
                                      View(recv, dtype), recv_counts),
                         "AllToAllV " + name));
  return ExpectEqual("AllToAllV " + name, recv, recv_expected);
}

// Every collective, every dtype and every reduce op, checked exactly. An
// AllReduce and a ReduceScatter are in flight together each time.
absl::Status CheckCollectives(const Rank& r, bool verify_ops) {
  absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group =
      r.NewGroup(absl::Seconds(20), /*threads=*/2, verify_ops);
  if (!group.ok()) return group.status();
  ProcessGroup& pg = **group;
  constexpr size_t kCount = 5;
  constexpr size_t kBlock = 3;
  for (Dtype dtype : kDtypes) {
    const std::string name(DtypeName(dtype));
    auto values = [&](int rank, size_t n) {
      std::vector<double> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = Value(dtype, rank, i);
      return v;
    };
    for (ReduceOp op : kOps) {
      const std::string what = absl::StrCat(name, " ", ReduceOpName(op));
      std::vector<char> reduced = Encode(dtype, values(r.rank, kCount));
      std::vector<char> scatter_in =
          Encode(dtype, values(r.rank, kBlock * r.world));
      std::vector<char> scatter_out(kBlock * DtypeSize(dtype));
      std::shared_ptr<Work> all_reduce = pg.AllReduce(View(reduced, dtype), op);
      std::shared_ptr<Work> reduce_scatter = pg.ReduceScatter(
          View(scatter_in, dtype), View(scatter_out, dtype), op);
      RETURN_IF_ERROR(WaitOk(all_reduce, "AllReduce " + what));
      RETURN_IF_ERROR(WaitOk(reduce_scatter, "ReduceScatter " + what));

      std::vector<double> expected(kCount);
      for (size_t i = 0; i < kCount; ++i) {
        expected[i] = Reference(dtype, op, r.world, i);
      }
      RETURN_IF_ERROR(
          ExpectEqual("AllReduce " + what, reduced, Encode(dtype, expected)));
      std::vector<double> block(kBlock);
      for (size_t i = 0; i < kBlock; ++i) {
        block[i] = Reference(dtype, op, r.world, r.rank * kBlock + i);
      }
      RETURN_IF_ERROR(ExpectEqual("ReduceScatter " + what, scatter_out,
                                  Encode(dtype, block)));
    }

    const int root = r.world - 1;
    std::vector<char> broadcast =
        r.rank == root ? Encode(dtype, values(root, kCount))
                       : std::vector<char>(kCount * DtypeSize(dtype));
    RETURN_IF_ERROR(WaitOk(pg.Broadcast(View(broadcast, dtype), root),
                           "Broadcast " + name));
    RETURN_IF_ERROR(ExpectEqual("Broadcast " + name, broadcast,
                                Encode(dtype, values(root, kCount))));

    std::vector<char> mine = Encode(dtype, values(r.rank, kCount));
    std::vector<char> gathered(kCount * r.world * DtypeSize(dtype));
    RETURN_IF_ERROR(
        WaitOk(pg.AllGather(View(mine, dtype), View(gathered, dtype)),
               "AllGather " + name));
    std::vector<char> expected;
    for (int rank = 0; rank < r.world; ++rank) {
      std::vector<char> part = Encode(dtype, values(rank, kCount));
      expected.insert(expected.end(), part.begin(), part.end());
    }
    RETURN_IF_ERROR(ExpectEqual("AllGather " + name, gathered, expected));
    RETURN_IF_ERROR(CheckRootedAndVariableOps(r, pg, dtype));
  }
  return WaitOk(pg.Barrier(), "Barrier");
}

class CohortdTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { Cohortd::Start(); }
  static void TearDownTestSuite() { Cohortd::Stop(); }
};

// Parameters: the world size, whether the ranks verify each op, and the
// transport.
class CollectivesTest
    : public CohortdTest,
      public ::testing::WithParamInterface<std::tuple<int, bool, Transport>> {};

TEST_P(CollectivesTest, MatchTheReferenceForEveryDtypeAndOp) {
  const auto [world, verify_ops, transport] = GetParam();
  RunRanks(
      world, world,
      [verify = verify_ops](const Rank& r) {
        return CheckCollectives(r, verify);
      },
      transport);
}

INSTANTIATE_TEST_SUITE_P(
    World, CollectivesTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Bool(),
                       ::testing::Values(Transport::kTcp, Transport::kShm,
                                         Transport::kTwoHosts)),
    [](const auto& info) {
      return absl::StrCat(std::get<0>(info.param), "ranks_",
                          std::get<1>(info.param) ? "verified_" : "unverified_",
                          TransportName(std::get<2>(info.param)));
    });

// The tests below run on every transport.
class TransportTest : public CohortdTest,
                      public ::testing::WithParamInterface<Transport> {};

INSTANTIATE_TEST_SUITE_P(Transports, TransportTest,
                         ::testing::Values(Transport::kTcp, Transport::kShm,
                                           Transport::kTwoHosts),
                         [](const auto& info) {
                           return TransportName(info.param);
                         });

// Buffers past gloo's 1 MiB segment and many ops in flight at once.
TEST_P(TransportTest, LargeBuffersWithManyOpsInFlight) {
  RunRanks(
      3, 3,
      [](const Rank& r) -> absl::Status {
        absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group = r.NewGroup();
        if (!group.ok()) return group.status();
        constexpr size_t kCount = (1 << 20) + 3;
        constexpr size_t kBlock = 100003;
        std::vector<float> f32(kCount);
        std::vector<BFloat16> bf16(kCount);
        std::vector<int64_t> i64(kBlock * r.world);
        std::vector<int64_t> block(kBlock);
        for (size_t i = 0; i < kCount; ++i) {
          f32[i] = static_cast<float>(i % 7 + r.rank);
          bf16[i] = FloatToBFloat16(static_cast<float>(i % 5 + r.rank));
        }
        for (size_t i = 0; i < i64.size(); ++i) i64[i] = i * (r.rank + 1);
        std::vector<std::shared_ptr<Work>> works = {
            (*group)->AllReduce(BufferView::Of(f32.data(), kCount),
                                ReduceOp::kSum),
            (*group)->AllReduce(BufferView::Of(bf16.data(), kCount),
                                ReduceOp::kMax),
            (*group)->ReduceScatter(BufferView::Of(i64.data(), i64.size()),
                                    BufferView::Of(block.data(), kBlock),
                                    ReduceOp::kSum),
            (*group)->Barrier(),
        };
        for (const std::shared_ptr<Work>& work : works) {
          RETURN_IF_ERROR(WaitOk(work, "large op"));
        }
        for (size_t i = 0; i < kCount; ++i) {
          // Ranks 0, 1 and 2 add 0 + 1 + 2 to three times i % 7.
          if (f32[i] != static_cast<float>(3 * (i % 7) + 3)) {
            return absl::InternalError(
                absl::StrCat("f32 element ", i, " is ", f32[i]));
          }
          if (BFloat16ToFloat(bf16[i]) != static_cast<float>(i % 5 + 2)) {
            return absl::InternalError(absl::StrCat("bf16 element ", i));
          }
        }
        for (size_t i = 0; i < kBlock; ++i) {
          // Rank k contributed (k + 1) * index: 1 + 2 + 3 = 6 times the index.
          const int64_t index = r.rank * kBlock + i;
          if (block[i] != 6 * index) {
            return absl::InternalError(
                absl::StrCat("i64 element ", i, " is ", block[i]));
          }
        }
        return absl::OkStatus();
      },
      GetParam());
}

TEST_F(CohortdTest, SendRecvRingMatchesByTag) {
  RunRanks(3, 3, [](const Rank& r) -> absl::Status {
    absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group = r.NewGroup();
    if (!group.ok()) return group.status();
    const int next = (r.rank + 1) % r.world;
    const int prev = (r.rank + r.world - 1) % r.world;
    int64_t out7[2] = {r.rank, 7};
    int64_t out8[2] = {r.rank, 8};
    int64_t in7[2] = {-1, -1};
    int64_t in8[2] = {-1, -1};
    // Tag 8 is received before tag 7 is sent: matching goes by tag, and a
    // Recv does not hold up the Sends issued after it.
    std::shared_ptr<Work> recv8 =
        (*group)->Recv(BufferView::Of(in8, 2), prev, 8);
    std::shared_ptr<Work> send7 =
        (*group)->Send(BufferView::Of(out7, 2), next, 7);
    std::shared_ptr<Work> recv7 =
        (*group)->Recv(BufferView::Of(in7, 2), prev, 7);
    std::shared_ptr<Work> send8 =
        (*group)->Send(BufferView::Of(out8, 2), next, 8);
    for (auto& work : {recv8, send7, recv7, send8}) {
      RETURN_IF_ERROR(WaitOk(work, "send/recv"));
    }
    if (in7[0] != prev || in7[1] != 7 || in8[0] != prev || in8[1] != 8) {
      return absl::InternalError(absl::StrCat("received ", in7[0], ",", in7[1],
                                              " and ", in8[0], ",", in8[1]));
    }
    return absl::OkStatus();
  });
}

TEST_F(CohortdTest, MissingRankTimesOutAtCreation) {
  RunRanks(/*world=*/3, /*processes=*/2, [](const Rank& r) -> absl::Status {
    absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group =
        r.NewGroup(absl::Seconds(1));
    if (group.status().code() != absl::StatusCode::kDeadlineExceeded) {
      return absl::InternalError(absl::StrCat("want DEADLINE_EXCEEDED, got ",
                                              group.status().ToString()));
    }
    std::fprintf(stderr, "rank %d as expected: %s\n", r.rank,
                 group.status().ToString().c_str());
    return absl::OkStatus();
  });
}

TEST_P(TransportTest, PeerThatSkipsAnOpTimesOutAndBreaksTheGroup) {
  RunRanks(
      2, 2,
      [](const Rank& r) -> absl::Status {
        absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group =
            r.NewGroup(absl::Seconds(1));
        if (!group.ok()) return group.status();
        if (r.rank == 1) {
          // Stays connected but never joins the AllReduce.
          return r.store->Get(r.prefix + "/rank0_done", absl::Seconds(20))
              .status();
        }
        float value = 1;
        absl::Status status =
            (*group)
                ->AllReduce(BufferView::Of(&value, 1), ReduceOp::kSum)
                ->Wait(kWait);
        absl::Status after = (*group)->Barrier()->Wait(kWait);
        RETURN_IF_ERROR(r.store->Set(r.prefix + "/rank0_done", "1"));
        if (status.code() != absl::StatusCode::kDeadlineExceeded ||
            !absl::StrContains(status.message(), "AllReduce")) {
          return absl::InternalError(
              absl::StrCat("want DEADLINE_EXCEEDED naming AllReduce, got ",
                           status.ToString()));
        }
        if (after.code() != absl::StatusCode::kFailedPrecondition) {
          return absl::InternalError(
              absl::StrCat("want FAILED_PRECONDITION after the timeout, got ",
                           after.ToString()));
        }
        std::fprintf(stderr, "as expected: %s\n", status.ToString().c_str());
        return absl::OkStatus();
      },
      GetParam());
}

// Across hosts, a peer that does not answer is named with its host: here
// rank 3 (of host1) stays connected but never joins the all-gather, and
// every other rank, on either host, times out naming it.
TEST_F(CohortdTest, PeerThatDoesNotAnswerIsNamedWithItsHost) {
  RunRanks(
      4, 4,
      [](const Rank& r) -> absl::Status {
        absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group =
            r.NewGroup(absl::Seconds(1));
        if (!group.ok()) return group.status();
        if (r.rank == 3) {
          for (int q = 0; q < 3; ++q) {
            RETURN_IF_ERROR(
                r.store
                    ->Get(absl::StrCat(r.prefix, "/done", q), absl::Seconds(30))
                    .status());
          }
          return absl::OkStatus();
        }
        float mine = r.rank;
        std::vector<float> all(4);
        absl::Status status =
            (*group)
                ->AllGather(BufferView::Of(&mine, 1),
                            BufferView::Of(all.data(), all.size()))
                ->Wait(kWait);
        RETURN_IF_ERROR(
            r.store->Set(absl::StrCat(r.prefix, "/done", r.rank), "1"));
        if (status.code() != absl::StatusCode::kDeadlineExceeded ||
            !absl::StrContains(status.message(),
                               "from host 'host1' (rank 3)")) {
          return absl::InternalError(absl::StrCat(
              "want DEADLINE_EXCEEDED naming host 'host1' (rank 3), got ",
              status.ToString()));
        }
        std::fprintf(stderr, "as expected: %s\n", status.ToString().c_str());
        return absl::OkStatus();
      },
      Transport::kTwoHosts);
}

absl::Status ExpectSum(ProcessGroup& pg, int32_t value, int32_t want,
                       absl::string_view what) {
  RETURN_IF_ERROR(
      WaitOk(pg.AllReduce(BufferView::Of(&value, 1), ReduceOp::kSum), what));
  if (value != want) {
    return absl::InternalError(
        absl::StrCat(what, ": sum is ", value, ", want ", want));
  }
  return absl::OkStatus();
}

// A host whose /dev/shm cannot hold the segment (here: slots of 1 TiB)
// keeps the group working over loopback TCP, on every rank alike.
TEST_F(CohortdTest, NoRoomInDevShmFallsBackToTcp) {
  RunRanks(2, 2, [](const Rank& r) -> absl::Status {
    GlooOptions options;
    options.group.timeout = absl::Seconds(20);
    options.store_prefix = r.prefix;
    options.bind_address = "127.0.0.1";
    options.shm.slot_bytes = size_t{1} << 40;
    absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group =
        GlooProcessGroup::Create(r.store, r.rank, r.world, options);
    if (!group.ok()) return group.status();
    return ExpectSum(**group, 1, 2, "over the fallback");
  });
}

TEST_F(CohortdTest, SubgroupsHaveTheirOwnRanks) {
  RunRanks(4, 4, [](const Rank& r) -> absl::Status {
    absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group =
        r.NewGroup(absl::Seconds(20), /*threads=*/1);
    if (!group.ok()) return group.status();
    if (r.rank == 1 || r.rank == 3) {
      absl::StatusOr<std::unique_ptr<GlooProcessGroup>> pair =
          (*group)->NewGroup({3, 1});
      if (!pair.ok()) return pair.status();
      if ((*pair)->size() != 2 || (*pair)->rank() != r.rank / 2) {
        return absl::InternalError(absl::StrCat("pair rank ", (*pair)->rank()));
      }
      RETURN_IF_ERROR(ExpectSum(**pair, r.rank, 4, "pair"));
    }
    // Even and odd ranks, numbered from the highest rank down.
    absl::StatusOr<std::unique_ptr<GlooProcessGroup>> parity =
        (*group)->Split(r.rank % 2, -r.rank);
    if (!parity.ok()) return parity.status();
    if ((*parity)->size() != 2 || (*parity)->rank() != (r.rank < 2 ? 1 : 0)) {
      return absl::InternalError(
          absl::StrCat("parity rank ", (*parity)->rank()));
    }
    RETURN_IF_ERROR(
        ExpectSum(**parity, r.rank, r.rank % 2 == 0 ? 2 : 4, "parity"));
    // Rank 3 sits out; the others form a group of 3.
    absl::StatusOr<std::unique_ptr<GlooProcessGroup>> three =
        (*group)->Split(r.rank == 3 ? -1 : 0, 0);
    if (!three.ok()) return three.status();
    if (r.rank == 3) {
      if (*three != nullptr) return absl::InternalError("rank 3 got a group");
    } else {
      RETURN_IF_ERROR(ExpectSum(**three, r.rank, 3, "three"));
    }
    return WaitOk((*group)->Barrier(), "Barrier");
  });
}

TEST_P(TransportTest, DeadPeerFailsTheOpInsteadOfHanging) {
  RunRanks(
      2, 2,
      [](const Rank& r) -> absl::Status {
        absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group =
            r.NewGroup(absl::Seconds(3));
        if (!group.ok()) return group.status();
        // Both ranks are fully connected before one dies: Create returning on
        // one rank does not mean its peer has finished connecting.
        if (absl::Status s = (*group)->Barrier()->Wait(kWait); !s.ok())
          return s;
        if (r.rank == 1) {
          _exit(0);  // Dies with its connections open, without a goodbye.
        }
        absl::SleepFor(absl::Milliseconds(100));
        float value = 1;
        absl::Status status =
            (*group)
                ->AllReduce(BufferView::Of(&value, 1), ReduceOp::kSum)
                ->Wait(kWait);
        if (status.code() != absl::StatusCode::kUnavailable &&
            status.code() != absl::StatusCode::kDeadlineExceeded) {
          return absl::InternalError(
              absl::StrCat("want UNAVAILABLE or DEADLINE_EXCEEDED, got ",
                           status.ToString()));
        }
        std::fprintf(stderr, "as expected: %s\n", status.ToString().c_str());
        return absl::OkStatus();
      },
      GetParam());
}

// Over TCP a small AllReduce carries its check beside its data, while a
// Barrier's is exchanged by the engine before it: the two still meet.
TEST_P(TransportTest, AnOpCheckedInsideMeetsOneCheckedBefore) {
  RunRanks(
      3, 3,
      [](const Rank& r) -> absl::Status {
        absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group = r.NewGroup();
        if (!group.ok()) return group.status();
        std::vector<float> values(4, 1.0f);
        absl::Status status =
            r.rank == 2
                ? (*group)->Barrier()->Wait(kWait)
                : (*group)
                      ->AllReduce(BufferView::Of(values.data(), values.size()),
                                  ReduceOp::kSum)
                      ->Wait(kWait);
        const std::string named = r.rank == 2
                                      ? "rank 0 issued 'AllReduce SUM of 4 f32'"
                                      : "rank 2 issued 'Barrier'";
        if (status.code() != absl::StatusCode::kInvalidArgument ||
            !absl::StrContains(status.message(), named)) {
          return absl::InternalError(
              absl::StrCat("want INVALID_ARGUMENT naming ", named, ", got ",
                           status.ToString()));
        }
        if (values != std::vector<float>(4, 1.0f)) {
          return absl::InternalError("the AllReduce wrote its buffer");
        }
        return ExpectSum(**group, 1, 3, "after the mismatch");
      },
      GetParam());
}

TEST_P(TransportTest, RanksThatDisagreeGetInvalidArgument) {
  RunRanks(
      3, 3,
      [](const Rank& r) -> absl::Status {
        absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group = r.NewGroup();
        if (!group.ok()) return group.status();
        std::vector<float> values(r.rank == 2 ? 3 : 4, 1.0f);
        absl::Status status =
            (*group)
                ->AllReduce(BufferView::Of(values.data(), values.size()),
                            ReduceOp::kSum)
                ->Wait(kWait);
        if (status.code() != absl::StatusCode::kInvalidArgument ||
            !absl::StrContains(
                status.message(),
                r.rank == 2 ? "rank 0 issued 'AllReduce SUM of 4 f32'"
                            : "rank 2 issued 'AllReduce SUM of 3 f32'")) {
          return absl::InternalError(
              absl::StrCat("want INVALID_ARGUMENT naming the other count, got ",
                           status.ToString()));
        }
        if (r.rank == 0) {
          std::fprintf(stderr, "as expected: %s\n", status.ToString().c_str());
        }
        // The group stays usable: the disagreement was found before any data
        // moved, on every rank at once.
        return ExpectSum(**group, 1, 3, "after the mismatch");
      },
      GetParam());
}

// Argument checks need no peers: a group of one, in process.
class GroupOfOneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GlooOptions options;
    options.bind_address = "127.0.0.1";
    options.group.timeout = absl::Seconds(5);
    absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group =
        GlooProcessGroup::Create(std::make_shared<InProcessStore>(), 0, 1,
                                 options);
    ASSERT_TRUE(group.ok()) << group.status();
    group_ = std::move(*group);
  }

  static void ExpectInvalid(const std::shared_ptr<Work>& work,
                            absl::string_view words) {
    ASSERT_TRUE(work->IsCompleted());
    EXPECT_EQ(work->status().code(), absl::StatusCode::kInvalidArgument)
        << work->status();
    EXPECT_TRUE(absl::StrContains(work->status().message(), words))
        << work->status();
  }

  std::unique_ptr<GlooProcessGroup> group_;
};

TEST_F(GroupOfOneTest, RejectsBadArgumentsBeforeRunning) {
  float f[4] = {};
  double d[4] = {};
  ExpectInvalid(group_->Broadcast(BufferView::Of(f, 4), 1), "root 1");
  ExpectInvalid(group_->Broadcast(BufferView::Of(f, 4), -1), "root -1");
  ExpectInvalid(group_->AllGather(BufferView::Of(f, 2), BufferView::Of(f, 3)),
                "each need 2");
  ExpectInvalid(group_->AllGather(BufferView::Of(f, 2), BufferView::Of(d, 2)),
                "input is f32 but output is f64");
  ExpectInvalid(group_->ReduceScatter(BufferView::Of(f, 4),
                                      BufferView::Of(f, 2), ReduceOp::kSum),
                "each need 2");
  ExpectInvalid(
      group_->AllReduce(BufferView{nullptr, 3, Dtype::kF32}, ReduceOp::kMax),
      "no data");
  ExpectInvalid(group_->Send(BufferView::Of(f, 4), 0, 1), "another rank");
  ExpectInvalid(group_->Recv(BufferView::Of(f, 4), 5, 1), "another rank");
  // Argument errors do not break the group.
  EXPECT_TRUE(group_->Barrier()->Wait(kWait).ok());
}

TEST_F(GroupOfOneTest, CollectivesOfOneCopyOrKeep) {
  int32_t values[3] = {4, -5, 7};
  EXPECT_TRUE(group_->AllReduce(BufferView::Of(values, 3), ReduceOp::kAvg)
                  ->Wait(kWait)
                  .ok());
  EXPECT_EQ(values[1], -5);
  int32_t gathered[3] = {};
  EXPECT_TRUE(
      group_->AllGather(BufferView::Of(values, 3), BufferView::Of(gathered, 3))
          ->Wait(kWait)
          .ok());
  EXPECT_EQ(gathered[2], 7);
}

TEST(GlooProcessGroupCreateTest, RejectsBadRankAndOptions) {
  auto store = std::make_shared<InProcessStore>();
  EXPECT_EQ(GlooProcessGroup::Create(store, 2, 2, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  GlooOptions no_threads;
  no_threads.group.threads = 0;
  EXPECT_EQ(GlooProcessGroup::Create(store, 0, 1, no_threads).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cohort
