// multihost_worker: a cohortrun worker for tests/integration/
// multihost_netns_test.sh, whose hosts are network namespaces. It joins the
// gloo group from the environment (env://, host id from $COHORT_HOST_ID),
// listening on --bind, and checks every collective's result exactly: each
// rank's buffers hold small integers that depend on rank and index, so every
// sum, product, min and max is exact in float32 whatever the order of
// combination. Prints "rank R host H: N ops correct" and exits 0, or the
// first wrong element or failed op and exits 1.
//
// With --hold_on_attempt=A, on cohortrun's attempt A ($COHORT_RESTART_COUNT)
// it then prints "rank R: holding" and runs hierarchical all-reduces and
// all-gathers until one fails (the test cuts a host's link meanwhile),
// prints "rank R: op failed: STATUS" and exits 1.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "worker/collective/init/init.h"

ABSL_FLAG(std::string, bind, "",
          "the address this rank listens on (its host's address)");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10),
          "the group's op timeout (ProcessGroupOptions::timeout)");
ABSL_FLAG(int, hold_on_attempt, -1,
          "on this attempt ($COHORT_RESTART_COUNT), run ops after the checks "
          "until one fails; -1: never");

namespace cohort {
namespace {

// Rank r's element i: an integer below 64, so that sums of 4 ranks and
// products of 4 ranks' values ((i % 5) + 1 <= 5, 5^4) stay exact in f32.
float Value(int rank, size_t i) {
  return static_cast<float>((rank * 7 + i * 3) % 61);
}
float Factor(int rank, size_t i) {
  return static_cast<float>((rank + i) % 5 + 1);
}

class Checker {
 public:
  Checker(ProcessGroup& pg) : pg_(pg), rank_(pg.rank()), size_(pg.size()) {}

  int passed() const { return passed_; }

  // Runs `op` (a collective returning its Work's status), then compares
  // `got` with `want` element by element.
  absl::Status Check(const std::string& name,
                     const std::function<absl::Status()>& op,
                     const std::vector<float>& got,
                     const std::vector<float>& want) {
    absl::Status done = op();
    if (!done.ok()) {
      return absl::Status(done.code(),
                          absl::StrCat(name, ": ", done.message()));
    }
    for (size_t i = 0; i < want.size(); ++i) {
      if (got[i] != want[i]) {
        return absl::InternalError(
            absl::StrFormat("%s: element %d of %d is %g, expected %g", name, i,
                            want.size(), got[i], want[i]));
      }
    }
    ++passed_;
    return absl::OkStatus();
  }

  std::vector<float> Mine(size_t count) const {
    std::vector<float> v(count);
    for (size_t i = 0; i < count; ++i) v[i] = Value(rank_, i);
    return v;
  }

  // AllReduce of every rank's Value (or Factor, for PROD) with `op`.
  absl::Status AllReduce(size_t count, ReduceOp op, const char* op_name) {
    std::vector<float> buffer(count), want(count);
    for (size_t i = 0; i < count; ++i) {
      buffer[i] = op == ReduceOp::kProd ? Factor(rank_, i) : Value(rank_, i);
      float acc = op == ReduceOp::kProd ? Factor(0, i) : Value(0, i);
      for (int r = 1; r < size_; ++r) {
        const float v = op == ReduceOp::kProd ? Factor(r, i) : Value(r, i);
        if (op == ReduceOp::kSum) acc += v;
        if (op == ReduceOp::kProd) acc *= v;
        if (op == ReduceOp::kMax) acc = std::max(acc, v);
        if (op == ReduceOp::kMin) acc = std::min(acc, v);
      }
      want[i] = acc;
    }
    return Check(
        absl::StrCat("all_reduce ", op_name, " of ", count * 4, " bytes"),
        [&] {
          return pg_.AllReduce(BufferView::Of(buffer.data(), count), op)
              ->Wait();
        },
        buffer, want);
  }

  // The sum over ranks of Value(r, offset + i), for i < count.
  std::vector<float> Sum(size_t count, size_t offset = 0) const {
    std::vector<float> want(count, 0.0f);
    for (int r = 0; r < size_; ++r) {
      for (size_t i = 0; i < count; ++i) want[i] += Value(r, offset + i);
    }
    return want;
  }

  // Every rank's Value(r, i) for i < count, rank after rank.
  std::vector<float> Gathered(size_t count) const {
    std::vector<float> all;
    for (int r = 0; r < size_; ++r) {
      for (size_t i = 0; i < count; ++i) all.push_back(Value(r, i));
    }
    return all;
  }

  absl::Status RunAll() {
    const int n = size_;
    // Small all-reduces go direct, large ones by a ring; across hosts both
    // are hierarchical (shared memory within a host, TCP between leaders).
    for (size_t count : {size_t{1000}, size_t{1} << 18}) {
      if (auto s = AllReduce(count, ReduceOp::kSum, "sum"); !s.ok()) return s;
    }
    if (auto s = AllReduce(4096, ReduceOp::kMax, "max"); !s.ok()) return s;
    if (auto s = AllReduce(4096, ReduceOp::kMin, "min"); !s.ok()) return s;
    if (auto s = AllReduce(4096, ReduceOp::kProd, "prod"); !s.ok()) return s;

    for (size_t count : {size_t{1000}, size_t{1} << 18}) {
      for (int root : {0, n - 1}) {
        std::vector<float> buffer =
            rank_ == root ? Mine(count) : std::vector<float>(count);
        std::vector<float> want(count);
        for (size_t i = 0; i < count; ++i) want[i] = Value(root, i);
        auto s = Check(
            absl::StrCat("broadcast of ", count * 4, " bytes from rank ", root),
            [&] {
              return pg_.Broadcast(BufferView::Of(buffer.data(), count), root)
                  ->Wait();
            },
            buffer, want);
        if (!s.ok()) return s;
      }
    }

    {
      const size_t count = 10000;
      const int root = n / 2;
      std::vector<float> buffer = Mine(count);
      // Only the root's buffer is defined after a Reduce.
      const std::vector<float> want =
          rank_ == root ? Sum(count) : std::vector<float>();
      auto s = Check(
          absl::StrCat("reduce sum to rank ", root),
          [&] {
            return pg_
                .Reduce(BufferView::Of(buffer.data(), count), root,
                        ReduceOp::kSum)
                ->Wait();
          },
          buffer, want);
      if (!s.ok()) return s;
    }

    for (size_t count : {size_t{1000}, size_t{1} << 17}) {
      std::vector<float> in = Mine(count), out(count * n);
      auto s = Check(
          absl::StrCat("all_gather of ", count * 4, " bytes a rank"),
          [&] {
            return pg_
                .AllGather(BufferView::Of(in.data(), count),
                           BufferView::Of(out.data(), out.size()))
                ->Wait();
          },
          out, Gathered(count));
      if (!s.ok()) return s;
    }

    {
      // Rank r contributes r + 1 elements.
      std::vector<size_t> counts;
      std::vector<float> want;
      for (int r = 0; r < n; ++r) {
        counts.push_back(r + 1);
        for (int i = 0; i <= r; ++i) want.push_back(Value(r, i));
      }
      std::vector<float> in = Mine(rank_ + 1), out(want.size());
      auto s = Check(
          "all_gather_v",
          [&] {
            return pg_
                .AllGatherV(BufferView::Of(in.data(), in.size()),
                            BufferView::Of(out.data(), out.size()), counts)
                ->Wait();
          },
          out, want);
      if (!s.ok()) return s;
    }

    {
      const size_t count = 5000;
      const int root = n - 1;
      std::vector<float> in = Mine(count), out(count * n);
      const std::vector<float> want =
          rank_ == root ? Gathered(count) : std::vector<float>(count * n);
      auto s = Check(
          absl::StrCat("gather to rank ", root),
          [&] {
            return pg_
                .Gather(BufferView::Of(in.data(), count),
                        BufferView::Of(out.data(), out.size()), root)
                ->Wait();
          },
          out, want);
      if (!s.ok()) return s;
    }

    {
      const size_t count = 5000;
      const int root = 1;
      // The root's input is block r for rank r: Value(r, i).
      std::vector<float> in = Gathered(count), out(count);
      std::vector<float> want(count);
      for (size_t i = 0; i < count; ++i) want[i] = Value(rank_, i);
      auto s = Check(
          absl::StrCat("scatter from rank ", root),
          [&] {
            return pg_
                .Scatter(BufferView::Of(in.data(), in.size()),
                         BufferView::Of(out.data(), count), root)
                ->Wait();
          },
          out, want);
      if (!s.ok()) return s;
    }

    {
      // Rank r sends block b (Value(r, b * count + i)) to rank b, so rank q
      // receives Value(r, q * count + i) from every r, in rank order.
      const size_t count = 3000;
      std::vector<float> in = Mine(count * n), out(count * n), want;
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < count; ++i) {
          want.push_back(Value(r, rank_ * count + i));
        }
      }
      auto s = Check(
          "all_to_all",
          [&] {
            return pg_
                .AllToAll(BufferView::Of(in.data(), in.size()),
                          BufferView::Of(out.data(), out.size()))
                ->Wait();
          },
          out, want);
      if (!s.ok()) return s;
    }

    for (size_t count : {size_t{1000}, size_t{1} << 17}) {
      std::vector<float> in = Mine(count * n), out(count);
      auto s = Check(
          absl::StrCat("reduce_scatter of ", count * n * 4, " bytes"),
          [&] {
            return pg_
                .ReduceScatter(BufferView::Of(in.data(), in.size()),
                               BufferView::Of(out.data(), count),
                               ReduceOp::kSum)
                ->Wait();
          },
          out, Sum(count, rank_ * count));
      if (!s.ok()) return s;
    }

    {
      std::vector<float> none;
      auto s =
          Check("barrier", [&] { return pg_.Barrier()->Wait(); }, none, none);
      if (!s.ok()) return s;
    }

    {
      // A ring of Send/Recv: rank r sends to r + 1, crossing hosts twice.
      const size_t count = 100000;
      const int from = (rank_ + n - 1) % n;
      std::vector<float> out = Mine(count), in(count);
      std::vector<float> want(count);
      for (size_t i = 0; i < count; ++i) want[i] = Value(from, i);
      auto s = Check(
          "send/recv ring",
          [&] {
            auto recv =
                pg_.Recv(BufferView::Of(in.data(), count), from, /*tag=*/7);
            auto send = pg_.Send(BufferView::Of(out.data(), count),
                                 (rank_ + 1) % n, /*tag=*/7);
            absl::Status sent = send->Wait();
            absl::Status received = recv->Wait();
            return sent.ok() ? received : sent;
          },
          in, want);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Runs all-reduces (hierarchical) and all-gathers until one fails.
  absl::Status Hold() {
    std::vector<float> buffer = Mine(1 << 18), gathered((1 << 12) * size_);
    while (true) {
      absl::Status s =
          pg_.AllReduce(BufferView::Of(buffer.data(), buffer.size()),
                        ReduceOp::kMax)
              ->Wait();
      if (!s.ok()) return s;
      s = pg_.AllGather(BufferView::Of(buffer.data(), 1 << 12),
                        BufferView::Of(gathered.data(), gathered.size()))
              ->Wait();
      if (!s.ok()) return s;
    }
  }

 private:
  ProcessGroup& pg_;
  const int rank_;
  const int size_;
  int passed_ = 0;
};

int Main() {
  InitOptions options;
  options.group.timeout = absl::GetFlag(FLAGS_timeout);
  options.gloo.bind_address = absl::GetFlag(FLAGS_bind);
  const char* host_env = std::getenv("COHORT_HOST_ID");
  const std::string host = host_env != nullptr ? host_env : "?";
  absl::StatusOr<std::unique_ptr<ProcessGroup>> pg =
      InitProcessGroup("gloo", "env://", -1, -1, options);
  if (!pg.ok()) {
    std::printf("host %s: creating the group failed: %s\n", host.c_str(),
                pg.status().ToString().c_str());
    return 1;
  }
  const int rank = (*pg)->rank();
  Checker checker(**pg);
  if (absl::Status s = checker.RunAll(); !s.ok()) {
    std::printf("rank %d host %s: FAILED: %s\n", rank, host.c_str(),
                s.ToString().c_str());
    std::fflush(stdout);
    return 1;
  }
  std::printf("rank %d host %s: %d ops correct\n", rank, host.c_str(),
              checker.passed());
  std::fflush(stdout);
  int attempt = 0;
  if (const char* a = std::getenv("COHORT_RESTART_COUNT")) {
    (void)absl::SimpleAtoi(a, &attempt);
  }
  if (attempt != absl::GetFlag(FLAGS_hold_on_attempt)) return 0;
  std::printf("rank %d: holding\n", rank);
  std::fflush(stdout);
  absl::Status held = checker.Hold();
  std::printf("rank %d: op failed: %s\n", rank, held.ToString().c_str());
  std::fflush(stdout);  // Before the group's teardown.
  return 1;
}

}  // namespace
}  // namespace cohort

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return cohort::Main();
}
