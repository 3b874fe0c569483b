#include "worker/collective/gloo/gloo_process_group.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/prefix_store.h"
#include "gloo/allgather.h"
#include "gloo/allgatherv.h"
#include "gloo/alltoall.h"
#include "gloo/alltoallv.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/gather.h"
#include "gloo/reduce.h"
#include "gloo/rendezvous/context.h"
#include "gloo/scatter.h"
#include "gloo/transport/tcp/device.h"
#include "worker/collective/gloo/gloo_ring.h"
#include "worker/collective/gloo/gloo_store.h"
#include "worker/collective/op_checks.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

std::chrono::milliseconds ToMillis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// Up to this many bytes sent per rank, all-reduce and all-gather send every
// rank's buffer straight to every other (gloo_ring.h's Direct*): one
// message latency instead of a ring's 2 (size - 1) or size - 1 dependent
// steps, each a notification round trip and a few thread wake-ups (70-90
// us each on the 2-core VM). Past it, the ring's smaller share of bytes on
// the wire wins.
constexpr size_t kDirectMaxWireBytes = 256 << 10;

bool IsHalf(Dtype dtype) {
  return dtype == Dtype::kF16 || dtype == Dtype::kBF16;
}

// Calls f with a value of the unsigned integer type of `bytes` bytes: gloo's
// typed setters need a C++ type of the element's size, and moving or
// reducing by our own kernels never looks at the type's arithmetic.
template <typename F>
void WithElementOfSize(size_t bytes, F&& f) {
  switch (bytes) {
    case 1:
      return f(uint8_t{});
    case 2:
      return f(uint16_t{});
    case 4:
      return f(uint32_t{});
    default:
      return f(uint64_t{});
  }
}

// A copy of a buffer in the dtype reductions compute in: f32 for f16 and
// bf16 (so they accumulate in f32 and round once, in CopyTo), else the
// buffer's own. Reductions that must not write the caller's input, or that
// widen, run on it.
class ReductionCopy {
 public:
  explicit ReductionCopy(const BufferView& source)
      : dtype_(IsHalf(source.dtype) ? Dtype::kF32 : source.dtype),
        bytes_(source.count * DtypeSize(dtype_)) {
    if (IsHalf(source.dtype)) {
      WidenToF32(source.dtype, source.data, reinterpret_cast<float*>(data()),
                 source.count);
    } else {
      std::memcpy(data(), source.data, source.bytes());
    }
  }

  Dtype dtype() const { return dtype_; }
  char* data() { return bytes_.data(); }
  char* element(size_t i) { return data() + i * DtypeSize(dtype_); }

  // Writes target.count elements from element `first` to `target`,
  // rounding to target.dtype.
  void CopyTo(size_t first, const BufferView& target) {
    if (IsHalf(target.dtype)) {
      NarrowFromF32(target.dtype, reinterpret_cast<float*>(element(first)),
                    target.data, target.count);
    } else {
      std::memcpy(target.data, element(first), target.bytes());
    }
  }

 private:
  const Dtype dtype_;
  std::vector<char> bytes_;  // operator new's alignment suits every dtype.
};

// Element counts as gloo's byte-level vectors want them.
template <typename Int>
std::vector<Int> ToBytes(absl::Span<const size_t> counts, Dtype dtype) {
  std::vector<Int> bytes;
  bytes.reserve(counts.size());
  for (size_t count : counts) {
    bytes.push_back(static_cast<Int>(count * DtypeSize(dtype)));
  }
  return bytes;
}

}  // namespace

namespace {

// Gloo's TCP pairs write to peers with writev, which raises SIGPIPE once a
// peer has died, and SIGPIPE's default action kills the process: a rank
// would die with its peer instead of failing the op with UNAVAILABLE.
// Python ignores SIGPIPE in every torch job; a C++ worker gets the same,
// unless it installed a handler of its own.
void IgnoreSigpipeUnlessHandled() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current = {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 &&
        current.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooProcessGroup>> GlooProcessGroup::Create(
    std::shared_ptr<Store> store, int rank, int size,
    const GlooOptions& options) {
  IgnoreSigpipeUnlessHandled();
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gloo process group: rank ", rank, " is not in [0, ", size, ")"));
  }
  if (options.group.timeout <= absl::ZeroDuration() ||
      options.group.threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gloo process group: timeout (",
        absl::FormatDuration(options.group.timeout), ") and threads (",
        options.group.threads, ") must be positive"));
  }
  if (store == nullptr) {
    return absl::InvalidArgumentError("gloo process group: no store");
  }
  GlooStore gloo_store(
      std::make_shared<PrefixStore>(options.store_prefix, store),
      options.group.timeout);
  gloo::transport::tcp::attr attr;
  if (!options.interface.empty()) {
    attr.iface = options.interface;
  } else {
    attr.hostname = options.bind_address;
  }
  std::shared_ptr<gloo::rendezvous::Context> context;
  try {
    std::shared_ptr<gloo::transport::Device> device =
        gloo::transport::tcp::CreateDevice(attr);
    context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(ToMillis(options.group.timeout));
    context->connectFullMesh(gloo_store, device);
  } catch (const std::exception& e) {
    // Prefer the store's own status: it has the precise code and names the
    // missing keys, where gloo's exception only repeats it as text.
    absl::Status error = gloo_store.TakeError();
    const std::string where = absl::StrCat(
        "gloo process group '", options.store_prefix, "': rank ", rank, " of ",
        size, " could not connect to its peers (whose keys are their ranks): ");
    if (!error.ok()) {
      return absl::Status(error.code(), absl::StrCat(where, error.message()));
    }
    return absl::UnavailableError(absl::StrCat(where, e.what()));
  }
  return std::unique_ptr<GlooProcessGroup>(new GlooProcessGroup(
      std::move(store), rank, size, options, std::move(context)));
}

GlooProcessGroup::GlooProcessGroup(std::shared_ptr<Store> store, int rank,
                                   int size, const GlooOptions& options,
                                   std::shared_ptr<gloo::Context> context)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      options_(options),
      context_(std::move(context)) {
  for (int i = 0; i < options_.group.threads; ++i) {
    op_threads_.emplace_back([this] { RunOps(); });
  }
  transfer_thread_ = std::thread([this] { RunTransfers(); });
}

GlooProcessGroup::~GlooProcessGroup() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : op_threads_) t.join();
  transfer_thread_.join();
}

absl::StatusOr<std::unique_ptr<GlooProcessGroup>> GlooProcessGroup::CreateChild(
    absl::string_view suffix, int rank, int size) {
  GlooOptions options = options_;
  options.store_prefix = absl::StrCat(options_.store_prefix, "/", suffix);
  return Create(store_, rank, size, options);
}

absl::StatusOr<std::unique_ptr<GlooProcessGroup>> GlooProcessGroup::NewGroup(
    absl::Span<const int> ranks) {
  std::vector<int> sorted(ranks.begin(), ranks.end());
  std::sort(sorted.begin(), sorted.end());
  const bool distinct =
      std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
  if (sorted.empty() || !distinct || sorted.front() < 0 ||
      sorted.back() >= size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("NewGroup: ranks {", absl::StrJoin(ranks, ", "),
                     "} must be distinct ranks of a group of ", size_));
  }
  auto me = std::find(sorted.begin(), sorted.end(), rank_);
  if (me == sorted.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NewGroup: rank ", rank_, " is not one of {",
        absl::StrJoin(sorted, ", "), "}; only members create a group"));
  }
  int incarnation;
  {
    absl::MutexLock lock(&mu_);
    incarnation = new_groups_[sorted]++;
  }
  return CreateChild(
      absl::StrCat("group_", absl::StrJoin(sorted, "_"), "/", incarnation),
      static_cast<int>(me - sorted.begin()), static_cast<int>(sorted.size()));
}

absl::StatusOr<std::unique_ptr<GlooProcessGroup>> GlooProcessGroup::Split(
    int color, int key) {
  int split;
  {
    absl::MutexLock lock(&mu_);
    split = splits_++;
  }
  // Every rank learns every (color, key) through this group itself.
  std::vector<int64_t> mine = {color, key};
  std::vector<int64_t> all(2 * static_cast<size_t>(size_));
  absl::Status gathered = AllGather(BufferView::Of(mine.data(), 2),
                                    BufferView::Of(all.data(), all.size()))
                              ->Wait();
  if (!gathered.ok()) return gathered;
  if (color < 0) return std::unique_ptr<GlooProcessGroup>();
  std::vector<std::pair<int64_t, int>> members;  // (key, rank)
  for (int r = 0; r < size_; ++r) {
    const size_t at = 2 * static_cast<size_t>(r);
    if (all[at] == color) members.emplace_back(all[at + 1], r);
  }
  std::sort(members.begin(), members.end());
  const int new_rank =
      static_cast<int>(std::find(members.begin(), members.end(),
                                 std::pair<int64_t, int>(key, rank_)) -
                       members.begin());
  return CreateChild(absl::StrCat("split_", split, "/color_", color), new_rank,
                     static_cast<int>(members.size()));
}

std::shared_ptr<Work> GlooProcessGroup::Enqueue(std::string name, Body body) {
  auto work = std::make_shared<Work>();
  absl::MutexLock lock(&mu_);
  // Each op takes two tags: one for CheckSameOpEverywhere, one for itself.
  ops_.push_back(QueuedOp{std::move(name), next_tag_, std::move(body), work});
  next_tag_ += 2;
  return work;
}

absl::Status GlooProcessGroup::CheckSameOpEverywhere(const QueuedOp& op) {
  // Op names hold what every rank must agree on (op, dtype, counts, root)
  // and nothing rank-specific, so comparing them is the check, and the
  // names make the error message.
  constexpr size_t kNameBytes = 128;
  std::vector<char> mine(kNameBytes, '\0');
  op.name.copy(mine.data(), kNameBytes - 1);
  std::vector<char> all(kNameBytes * size_);
  // One exchange with every peer rather than gloo's ring of size - 1
  // steps: this runs before every collective, so its latency is every
  // collective's.
  absl::Status exchanged = Run(op.name, [&] {
    DirectAllGather(*context_, mine.data(), kNameBytes, all.data(), op.tag + 1,
                    ToMillis(options_.group.timeout));
  });
  if (!exchanged.ok()) return exchanged;
  std::vector<std::string> differences;
  for (int r = 0; r < size_; ++r) {
    const std::string theirs(all.data() + r * kNameBytes);
    if (theirs != mine.data()) {
      differences.push_back(absl::StrCat("rank ", r, " issued '", theirs, "'"));
    }
  }
  if (differences.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      op.name, " on rank ", rank_, " of ", size_,
      ": the ranks issued different ops: ", absl::StrJoin(differences, ", ")));
}

void GlooProcessGroup::RunOps() {
  while (true) {
    QueuedOp op;
    absl::Status broken;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !ops_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (ops_.empty()) return;  // Stopping, and nothing left to run.
      op = std::move(ops_.front());
      ops_.pop_front();
      broken = BrokenStatus();
    }
    if (!broken.ok()) {
      op.work->Complete(broken);
      continue;
    }
    if (options_.group.verify_ops && size_ > 1) {
      absl::Status same = CheckSameOpEverywhere(op);
      if (!same.ok()) {
        Finish(op.work, std::move(same));
        continue;
      }
    }
    const uint32_t tag = op.tag;
    Finish(op.work, Run(op.name, [&] { op.body(tag); }));
  }
}

void GlooProcessGroup::RunTransfers() {
  while (true) {
    PostedTransfer transfer;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !transfers_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (transfers_.empty()) return;
      transfer = std::move(transfers_.front());
      transfers_.pop_front();
    }
    // Waiting in post order only delays reporting: every transfer is
    // already posted, so none waits on this thread to make progress.
    absl::Status status = Run(transfer.name, [&] {
      const std::chrono::milliseconds timeout =
          ToMillis(options_.group.timeout);
      const bool done = transfer.is_send ? transfer.buffer->waitSend(timeout)
                                         : transfer.buffer->waitRecv(timeout);
      if (!done) throw gloo::IoException("aborted");
    });
    // Unregister the caller's memory before telling the caller it may
    // reuse it: a late message must find no buffer to write into.
    transfer.buffer.reset();
    Finish(transfer.work, std::move(status));
  }
}

absl::Status GlooProcessGroup::Run(absl::string_view name,
                                   const std::function<void()>& fn) {
  const std::string where =
      absl::StrCat(name, " on rank ", rank_, " of ", size_, ": ");
  try {
    fn();
    return absl::OkStatus();
  } catch (const gloo::IoException& e) {
    // Gloo says "Timed out" when a peer did not take part in time, and
    // names the peer's address; anything else is a broken connection.
    if (absl::StrContains(e.what(), "imed out")) {
      return absl::DeadlineExceededError(absl::StrCat(
          where, "peers did not complete it within ",
          absl::FormatDuration(options_.group.timeout), ": ", e.what()));
    }
    return absl::UnavailableError(
        absl::StrCat(where, "connection to a peer failed: ", e.what()));
  } catch (const gloo::EnforceNotMet& e) {
    return absl::InternalError(absl::StrCat(where, e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(where, e.what()));
  }
}

void GlooProcessGroup::Finish(const std::shared_ptr<Work>& work,
                              absl::Status status) {
  if (!status.ok() && status.code() != absl::StatusCode::kInvalidArgument) {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) broken_ = status;
  }
  work->Complete(std::move(status));
}

absl::Status GlooProcessGroup::BrokenStatus() const {
  if (broken_.ok()) return broken_;
  return absl::FailedPreconditionError(
      absl::StrCat("gloo process group is unusable after an earlier failure: ",
                   broken_.ToString()));
}

std::shared_ptr<Work> GlooProcessGroup::Broadcast(BufferView buffer, int root) {
  constexpr absl::string_view kOp = "Broadcast";
  absl::Status valid = CheckBroadcast(shape(), buffer, root);
  if (!valid.ok()) return Work::Done(valid);
  return Enqueue(absl::StrCat(kOp, " of ", buffer.count, " ",
                              DtypeName(buffer.dtype), " from root ", root),
                 [=](uint32_t tag) {
                   if (size_ == 1 || buffer.count == 0) return;
                   gloo::BroadcastOptions opts(context_);
                   opts.setOutput(static_cast<uint8_t*>(buffer.data),
                                  buffer.bytes());
                   opts.setRoot(root);
                   SetTagAndTimeout(opts, tag);
                   gloo::broadcast(opts);
                 });
}

std::shared_ptr<Work> GlooProcessGroup::AllReduce(BufferView buffer,
                                                  ReduceOp op) {
  absl::Status valid = CheckAllReduce(shape(), buffer);
  if (!valid.ok()) return Work::Done(valid);
  return Enqueue(absl::StrCat("AllReduce ", ReduceOpName(op), " of ",
                              buffer.count, " ", DtypeName(buffer.dtype)),
                 [=](uint32_t tag) { DoAllReduce(buffer, op, tag); });
}

void GlooProcessGroup::DoAllReduce(BufferView buffer, ReduceOp op,
                                   uint32_t tag) {
  if (size_ == 1 || buffer.count == 0) return;  // AVG of one rank: itself.
  if (IsHalf(buffer.dtype)) {
    ReductionCopy wide(buffer);
    DoAllReduce(BufferView{wide.data(), buffer.count, wide.dtype()}, op, tag);
    wide.CopyTo(0, buffer);
    return;
  }
  const Dtype dtype = buffer.dtype;
  if (buffer.bytes() * (size_ - 1) <= kDirectMaxWireBytes) {
    DirectAllReduce(*context_, buffer.data, buffer.count, dtype, op, tag,
                    ToMillis(options_.group.timeout));
  } else {
    RingAllReduce(*context_, buffer.data, buffer.count, dtype, op, tag,
                  ToMillis(options_.group.timeout));
  }
  if (op == ReduceOp::kAvg) {
    DivideInPlace(dtype, buffer.data, buffer.count, size_);
  }
}

std::shared_ptr<Work> GlooProcessGroup::AllGather(BufferView input,
                                                  BufferView output) {
  constexpr absl::string_view kOp = "AllGather";
  absl::Status valid = CheckAllGather(shape(), input, output);
  if (!valid.ok()) return Work::Done(valid);
  return Enqueue(
      absl::StrCat(kOp, " of ", input.count, " ", DtypeName(input.dtype)),
      [=](uint32_t tag) {
        if (input.count == 0) return;
        if (size_ == 1) {
          std::memmove(output.data, input.data, input.bytes());
          return;
        }
        if (input.bytes() * (size_ - 1) <= kDirectMaxWireBytes) {
          DirectAllGather(*context_, input.data, input.bytes(), output.data,
                          tag, ToMillis(options_.group.timeout));
          return;
        }
        gloo::AllgatherOptions opts(context_);
        opts.setInput(static_cast<uint8_t*>(input.data), input.bytes());
        opts.setOutput(static_cast<uint8_t*>(output.data), output.bytes());
        SetTagAndTimeout(opts, tag);
        gloo::allgather(opts);
      });
}

std::shared_ptr<Work> GlooProcessGroup::Reduce(BufferView buffer, int root,
                                               ReduceOp op) {
  constexpr absl::string_view kOp = "Reduce";
  absl::Status valid = CheckReduce(shape(), buffer, root);
  if (!valid.ok()) return Work::Done(valid);
  return Enqueue(absl::StrCat(kOp, " ", ReduceOpName(op), " of ", buffer.count,
                              " ", DtypeName(buffer.dtype), " to root ", root),
                 [=](uint32_t tag) { DoReduce(buffer, root, op, tag); });
}

void GlooProcessGroup::DoReduce(BufferView buffer, int root, ReduceOp op,
                                uint32_t tag) {
  if (size_ == 1 || buffer.count == 0) return;
  // gloo's reduce uses the buffer as scratch on every rank; a copy keeps
  // the non-root ranks' buffers as they were (and widens half types).
  ReductionCopy scratch(buffer);
  const Dtype work_dtype = scratch.dtype();
  gloo::ReduceOptions opts(context_);
  WithElementOfSize(DtypeSize(work_dtype), [&](auto element) {
    using T = decltype(element);
    opts.setOutput(reinterpret_cast<T*>(scratch.data()), buffer.count);
  });
  opts.setRoot(root);
  opts.setReduceFunction(
      [work_dtype, op](void* out, const void* a, const void* b, size_t n) {
        Combine(work_dtype, op, out, a, b, n);
      });
  SetTagAndTimeout(opts, tag);
  gloo::reduce(opts);
  if (rank_ != root) return;
  if (op == ReduceOp::kAvg) {
    DivideInPlace(work_dtype, scratch.data(), buffer.count, size_);
  }
  scratch.CopyTo(0, buffer);
}

std::shared_ptr<Work> GlooProcessGroup::AllGatherV(
    BufferView input, BufferView output, absl::Span<const size_t> counts) {
  constexpr absl::string_view kOp = "AllGatherV";
  absl::Status valid = CheckAllGatherV(shape(), input, output, counts);
  if (!valid.ok()) return Work::Done(valid);
  return Enqueue(
      absl::StrCat(kOp, " of ", output.count, " ", DtypeName(output.dtype)),
      [=, bytes = ToBytes<size_t>(counts, input.dtype)](uint32_t tag) {
        if (size_ == 1) {
          // An empty buffer's data may be null, which memmove must not get.
          if (input.bytes() > 0) {
            std::memmove(output.data, input.data, input.bytes());
          }
          return;
        }
        gloo::AllgathervOptions opts(context_);
        opts.setInput(static_cast<uint8_t*>(input.data), input.bytes());
        opts.setOutput(static_cast<uint8_t*>(output.data), bytes);
        SetTagAndTimeout(opts, tag);
        gloo::allgatherv(opts);
      });
}

std::shared_ptr<Work> GlooProcessGroup::Gather(BufferView input,
                                               BufferView output, int root) {
  constexpr absl::string_view kOp = "Gather";
  absl::Status valid = CheckGather(shape(), input, output, root);
  if (!valid.ok()) return Work::Done(valid);
  return Enqueue(
      absl::StrCat(kOp, " of ", input.count, " ", DtypeName(input.dtype),
                   " to root ", root),
      [=](uint32_t tag) {
        if (input.count == 0) return;
        if (size_ == 1) {
          std::memmove(output.data, input.data, input.bytes());
          return;
        }
        gloo::GatherOptions opts(context_);
        opts.setInput(static_cast<uint8_t*>(input.data), input.bytes());
        if (rank_ == root) {
          opts.setOutput(static_cast<uint8_t*>(output.data), output.bytes());
        }
        opts.setRoot(root);
        SetTagAndTimeout(opts, tag);
        gloo::gather(opts);
      });
}

std::shared_ptr<Work> GlooProcessGroup::Scatter(BufferView input,
                                                BufferView output, int root) {
  constexpr absl::string_view kOp = "Scatter";
  absl::Status valid = CheckScatter(shape(), input, output, root);
  if (!valid.ok()) return Work::Done(valid);
  return Enqueue(
      absl::StrCat(kOp, " of ", output.count, " ", DtypeName(output.dtype),
                   " from root ", root),
      [=](uint32_t tag) {
        if (output.count == 0) return;
        if (size_ == 1) {
          std::memmove(output.data, input.data, output.bytes());
          return;
        }
        gloo::ScatterOptions opts(context_);
        if (rank_ == root) {
          std::vector<uint8_t*> blocks(size_);
          for (int r = 0; r < size_; ++r) {
            blocks[r] = static_cast<uint8_t*>(input.data) + r * output.bytes();
          }
          opts.setInputs(blocks, output.bytes());
        }
        opts.setOutput(static_cast<uint8_t*>(output.data), output.bytes());
        opts.setRoot(root);
        SetTagAndTimeout(opts, tag);
        gloo::scatter(opts);
      });
}

std::shared_ptr<Work> GlooProcessGroup::AllToAll(BufferView input,
                                                 BufferView output) {
  constexpr absl::string_view kOp = "AllToAll";
  absl::Status valid = CheckAllToAll(shape(), input, output);
  if (!valid.ok()) return Work::Done(valid);
  return Enqueue(
      absl::StrCat(kOp, " of ", input.count, " ", DtypeName(input.dtype)),
      [=](uint32_t tag) {
        if (input.count == 0) return;
        if (size_ == 1) {
          std::memmove(output.data, input.data, input.bytes());
          return;
        }
        gloo::AlltoallOptions opts(context_);
        opts.setInput(static_cast<uint8_t*>(input.data), input.bytes());
        opts.setOutput(static_cast<uint8_t*>(output.data), output.bytes());
        SetTagAndTimeout(opts, tag);
        gloo::alltoall(opts);
      });
}

std::shared_ptr<Work> GlooProcessGroup::AllToAllV(
    BufferView input, absl::Span<const size_t> send_counts, BufferView output,
    absl::Span<const size_t> recv_counts) {
  constexpr absl::string_view kOp = "AllToAllV";
  absl::Status valid =
      CheckAllToAllV(shape(), input, send_counts, output, recv_counts);
  if (!valid.ok()) return Work::Done(valid);
  // The counts differ from rank to rank, so the name (which ranks compare,
  // see CheckSameOpEverywhere) leaves them out.
  return Enqueue(
      absl::StrCat(kOp, " of ", DtypeName(input.dtype)),
      [=, send_bytes = ToBytes<int64_t>(send_counts, input.dtype),
       recv_bytes = ToBytes<int64_t>(recv_counts, input.dtype)](uint32_t tag) {
        if (size_ == 1) {
          if (input.bytes() > 0) {
            std::memmove(output.data, input.data, input.bytes());
          }
          return;
        }
        gloo::AlltoallvOptions opts(context_);
        opts.setInput(static_cast<uint8_t*>(input.data), send_bytes);
        opts.setOutput(static_cast<uint8_t*>(output.data), recv_bytes);
        SetTagAndTimeout(opts, tag);
        gloo::alltoallv(opts);
      });
}

std::shared_ptr<Work> GlooProcessGroup::ReduceScatter(BufferView input,
                                                      BufferView output,
                                                      ReduceOp op) {
  constexpr absl::string_view kOp = "ReduceScatter";
  absl::Status valid = CheckReduceScatter(shape(), input, output);
  if (!valid.ok()) return Work::Done(valid);
  return Enqueue(
      absl::StrCat(kOp, " ", ReduceOpName(op), " of ", input.count, " ",
                   DtypeName(input.dtype)),
      [=](uint32_t tag) { DoReduceScatter(input, output, op, tag); });
}

void GlooProcessGroup::DoReduceScatter(BufferView input, BufferView output,
                                       ReduceOp op, uint32_t tag) {
  if (output.count == 0) return;
  const std::chrono::milliseconds timeout = ToMillis(options_.group.timeout);
  if (IsHalf(input.dtype)) {
    // Accumulate in f32 and round once.
    ReductionCopy wide(input);
    std::vector<float> sums(output.count);
    RingReduceScatter(*context_, wide.data(), sums.data(), output.count,
                      Dtype::kF32, op, tag, timeout);
    if (op == ReduceOp::kAvg) {
      DivideInPlace(Dtype::kF32, sums.data(), output.count, size_);
    }
    NarrowFromF32(output.dtype, sums.data(), output.data, output.count);
    return;
  }
  // The ring only reads the caller's input.
  RingReduceScatter(*context_, input.data, output.data, output.count,
                    input.dtype, op, tag, timeout);
  if (op == ReduceOp::kAvg) {
    DivideInPlace(output.dtype, output.data, output.count, size_);
  }
}

std::shared_ptr<Work> GlooProcessGroup::Barrier() {
  return Enqueue("Barrier", [this](uint32_t tag) {
    if (size_ == 1) return;
    gloo::BarrierOptions opts(context_);
    SetTagAndTimeout(opts, tag);
    gloo::barrier(opts);
  });
}

std::shared_ptr<Work> GlooProcessGroup::Send(BufferView buffer, int dst_rank,
                                             uint32_t tag) {
  return Post(absl::StrCat("Send to rank ", dst_rank, " with tag ", tag),
              buffer, dst_rank, tag, /*is_send=*/true);
}

std::shared_ptr<Work> GlooProcessGroup::Recv(BufferView buffer, int src_rank,
                                             uint32_t tag) {
  return Post(absl::StrCat("Recv from rank ", src_rank, " with tag ", tag),
              buffer, src_rank, tag, /*is_send=*/false);
}

std::shared_ptr<Work> GlooProcessGroup::Post(std::string name,
                                             BufferView buffer, int peer,
                                             uint32_t tag, bool is_send) {
  absl::Status valid = CheckPointToPoint(shape(), name, buffer, peer);
  if (!valid.ok()) return Work::Done(valid);
  auto work = std::make_shared<Work>();
  {
    absl::MutexLock lock(&mu_);
    absl::Status broken = BrokenStatus();
    if (!broken.ok()) return Work::Done(broken);
  }
  std::unique_ptr<gloo::transport::UnboundBuffer> unbound;
  absl::Status posted = Run(name, [&] {
    unbound = context_->createUnboundBuffer(buffer.data, buffer.bytes());
    const uint64_t slot = MakeSlot(kPointToPointSlotPrefix, tag, 0);
    if (is_send) {
      unbound->send(peer, slot);
    } else {
      unbound->recv(peer, slot);
    }
  });
  if (!posted.ok()) {
    unbound.reset();  // As in RunTransfers: unregister before completing.
    Finish(work, std::move(posted));
    return work;
  }
  absl::MutexLock lock(&mu_);
  transfers_.push_back(
      PostedTransfer{std::move(name), is_send, std::move(unbound), work});
  return work;
}

}  // namespace cohort
