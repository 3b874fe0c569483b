#include "worker/collective/nccl/nccl_process_group.h"

#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/prefix_store.h"
#include "worker/collective/nccl/nccl_bootstrap.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

char* At(const BufferView& view, size_t elements) {
  return static_cast<char*>(view.data) + elements * DtypeSize(view.dtype);
}

absl::Status Prefixed(absl::string_view head, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(head, status.message()));
}

// The device of a rank that did not name one: its rank on this node.
int DefaultDevice(int rank, int devices) {
  int local = rank;
  if (const char* env = std::getenv("LOCAL_RANK"); env != nullptr) {
    int parsed;
    if (absl::SimpleAtoi(env, &parsed) && parsed >= 0) local = parsed;
  }
  return local % devices;
}

// Grouped sends and receives of one op: `sends[j]` / `recvs[j]` elements
// to and from rank j at the given element offsets; the rank's own block is
// copied on the device first. Zero-element transfers are left out (both
// sides agree on them).
struct Exchange {
  std::vector<size_t> send_counts, send_offsets, recv_counts, recv_offsets;
  explicit Exchange(int size)
      : send_counts(size, 0),
        send_offsets(size, 0),
        recv_counts(size, 0),
        recv_offsets(size, 0) {}
};

absl::Status RunExchange(NcclCommunicator& comm, int rank,
                         const BufferView& input, const BufferView& output,
                         const Exchange& x) {
  const size_t element = DtypeSize(input.dtype);
  if (x.send_counts[rank] > 0) {
    absl::Status copied = comm.Copy(
        At(output, x.recv_offsets[rank]), At(input, x.send_offsets[rank]),
        x.send_counts[rank] * element, CopyKind::kDeviceToDevice);
    if (!copied.ok()) return copied;
  }
  absl::Status status = comm.GroupStart();
  if (!status.ok()) return status;
  const int size = static_cast<int>(x.send_counts.size());
  for (int peer = 0; peer < size && status.ok(); ++peer) {
    if (peer == rank) continue;
    if (x.send_counts[peer] > 0) {
      status = comm.Send(At(input, x.send_offsets[peer]), x.send_counts[peer],
                         input.dtype, peer);
    }
    if (status.ok() && x.recv_counts[peer] > 0) {
      status = comm.Recv(At(output, x.recv_offsets[peer]), x.recv_counts[peer],
                         output.dtype, peer);
    }
  }
  // End the group even after a failed call, so that NCCL's group state is
  // not left open; the first error wins.
  absl::Status ended = comm.GroupEnd();
  return status.ok() ? ended : status;
}

}  // namespace

class NcclProcessGroup::Transfer final : public OpEngine::Transfer {
 public:
  Transfer(std::unique_ptr<WatchedComm::Watch> watch, WatchedComm& comm,
           std::unique_ptr<NcclEvent> event)
      : watch_(std::move(watch)), comm_(comm), event_(std::move(event)) {}

  // The watchdog bounds the wait by the op's deadline (the engine's
  // `timeout` is the same group timeout).
  absl::Status Wait(absl::Duration) override { return comm_.Await(*event_); }

 private:
  const std::unique_ptr<WatchedComm::Watch> watch_;
  WatchedComm& comm_;
  const std::unique_ptr<NcclEvent> event_;
};

class NcclProcessGroup::Transport final : public OpEngine::Transport {
 public:
  explicit Transport(NcclProcessGroup& group) : group_(group) {}

  // Through a device buffer: the host's bytes up, NCCL's all-gather, the
  // result down once it has run (a copy to pageable host memory waits for
  // the stream, which must not happen under the communicator's lock while
  // the all-gather waits for peers).
  absl::Status AllGatherBytes(const void* mine, size_t bytes, void* all,
                              uint32_t) override {
    const size_t size = static_cast<size_t>(group_.size_);
    absl::StatusOr<void*> scratch = group_.Scratch(bytes * (size + 1));
    if (!scratch.ok()) return scratch.status();
    char* const send = static_cast<char*>(*scratch);
    char* const recv = send + bytes;
    absl::Status gathered = group_.RunOnStream(
        "verify_ops exchange",
        [&](NcclCommunicator& comm) {
          absl::Status up =
              comm.Copy(send, mine, bytes, CopyKind::kHostToDevice);
          if (!up.ok()) return up;
          return comm.AllGather(send, recv, bytes, Dtype::kU8);
        },
        nullptr);
    if (!gathered.ok()) return gathered;
    return group_.RunOnStream(
        "verify_ops exchange",
        [&](NcclCommunicator& comm) {
          return comm.Copy(all, recv, bytes * size, CopyKind::kDeviceToHost);
        },
        nullptr);
  }

  absl::StatusOr<std::unique_ptr<OpEngine::Transfer>> Post(
      const PointToPointOp& op) override {
    WatchedComm& comm = *group_.comm_;
    const absl::Duration timeout = group_.options_.group.timeout;
    auto watch = std::make_unique<WatchedComm::Watch>(comm, op.Name(), timeout,
                                                      absl::Now() + timeout);
    absl::Status posted = comm.Call([&](NcclCommunicator& c) {
      return op.is_send ? c.Send(op.buffer.data, op.buffer.count,
                                 op.buffer.dtype, op.peer)
                        : c.Recv(op.buffer.data, op.buffer.count,
                                 op.buffer.dtype, op.peer);
    });
    if (!posted.ok()) return posted;
    std::unique_ptr<NcclEvent> event;
    absl::Status recorded = comm.Call([&](NcclCommunicator& c) {
      absl::StatusOr<std::unique_ptr<NcclEvent>> e = c.RecordEvent();
      if (!e.ok()) return e.status();
      event = std::move(*e);
      return absl::OkStatus();
    });
    if (!recorded.ok()) return recorded;
    return std::unique_ptr<OpEngine::Transfer>(
        new Transfer(std::move(watch), comm, std::move(event)));
  }

 private:
  NcclProcessGroup& group_;
};

std::string NcclProcessGroup::Where(const NcclOptions& options,
                                    absl::string_view comm_name, int rank,
                                    int size) {
  return absl::StrCat("nccl process group '", options.store_prefix,
                      "' (communicator ", comm_name, "), rank ", rank, " of ",
                      size);
}

WatchdogOptions NcclProcessGroup::Watchdog(const NcclOptions& options) {
  WatchdogOptions watchdog;
  watchdog.interval = options.watchdog_interval;
  watchdog.on_abort = options.error_reporter;
  return watchdog;
}

absl::StatusOr<std::unique_ptr<NcclProcessGroup>> NcclProcessGroup::Create(
    std::shared_ptr<Store> store, int rank, int size,
    const NcclOptions& options) {
  const absl::Time deadline = absl::Now() + options.group.timeout;
  const std::string head =
      absl::StrCat("nccl process group '", options.store_prefix, "': rank ",
                   rank, " of ", size, ": ");
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat(head, "the rank is not in [0, ", size, ")"));
  }
  if (options.group.timeout <= absl::ZeroDuration() ||
      options.ranks_per_root < 1 ||
      options.watchdog_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        head, "timeout (", absl::FormatDuration(options.group.timeout),
        "), ranks_per_root (", options.ranks_per_root,
        ") and watchdog_interval (",
        absl::FormatDuration(options.watchdog_interval), ") must be positive"));
  }
  if (store == nullptr || options.api == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        head, store == nullptr ? "no store"
                               : "no NcclApi (CreateNcclProcessGroup in "
                                 "nccl_backend.h supplies CUDA's)"));
  }
  NcclApi& api = *options.api;
  absl::StatusOr<int> devices = api.DeviceCount();
  if (!devices.ok()) return Prefixed(head, devices.status());
  int device = options.device;
  if (device < 0) {
    device = DefaultDevice(rank, *devices);
  } else if (device >= *devices) {
    return absl::InvalidArgumentError(absl::StrCat(
        head, "device ", device, " is not one of the ", *devices, " visible"));
  }

  auto group_store = std::make_shared<PrefixStore>(options.store_prefix, store);
  const std::string comm_name = "comm/0";
  absl::StatusOr<std::vector<NcclUniqueId>> ids =
      ExchangeNcclUniqueIds(api, *group_store, comm_name, rank, size,
                            options.ranks_per_root, deadline);
  if (!ids.ok()) return Prefixed(head, ids.status());
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
      api.InitRank(device, size, rank, *ids);
  if (!comm.ok()) {
    absl::Status failed = Prefixed(head, comm.status());
    if (options.error_reporter) options.error_reporter(failed);
    return failed;
  }
  auto watched = std::make_unique<WatchedComm>(
      std::move(*comm), Where(options, comm_name, rank, size),
      Watchdog(options));
  absl::Status ready;
  {
    const std::string init = absl::StrCat(
        "NCCL init of communicator ", comm_name, " (", ids->size(),
        ids->size() == 1 ? " root" : " roots",
        "; the unique id exchange counts against the same deadline)");
    WatchedComm::Watch watch(*watched, init, options.group.timeout, deadline);
    ready = watched->Call([](NcclCommunicator&) { return absl::OkStatus(); });
  }
  if (!ready.ok()) {
    if (ready.code() == absl::StatusCode::kDeadlineExceeded) {
      const std::vector<int> missing =
          NcclMissingRanks(*group_store, comm_name, size);
      return absl::DeadlineExceededError(absl::StrCat(
          ready.message(),
          missing.empty()
              ? "; every rank reached the init (a rank's NCCL is stuck: "
                "NCCL_DEBUG=INFO says where)"
              : absl::StrCat("; ranks that never reached the init: ",
                             absl::StrJoin(missing, ", "))));
    }
    return ready;
  }
  return std::unique_ptr<NcclProcessGroup>(
      new NcclProcessGroup(std::move(store), rank, size, device, options,
                           comm_name, std::move(watched)));
}

NcclProcessGroup::NcclProcessGroup(std::shared_ptr<Store> store, int rank,
                                   int size, int device,
                                   const NcclOptions& options,
                                   std::string comm_name,
                                   std::unique_ptr<WatchedComm> comm)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      device_(device),
      options_(options),
      comm_name_(std::move(comm_name)),
      comm_(std::move(comm)),
      transport_(new Transport(*this)),
      engine_(
          rank, size,
          [&] {
            OpEngineOptions engine;
            engine.group = options.group;
            engine.group.threads = 1;
            engine.name =
                absl::StrCat("nccl process group '", options.store_prefix, "'");
            engine.host_memory = false;
            return engine;
          }(),
          transport_.get()) {
  scratch_.api = options_.api.get();
}

NcclProcessGroup::~NcclProcessGroup() = default;

absl::StatusOr<void*> NcclProcessGroup::Scratch(size_t bytes) {
  if (scratch_.bytes >= bytes) return scratch_.data;
  absl::StatusOr<void*> memory = options_.api->Alloc(device_, bytes);
  if (!memory.ok()) return memory.status();
  if (scratch_.data != nullptr) options_.api->Free(scratch_.data);
  scratch_.data = *memory;
  scratch_.bytes = bytes;
  return scratch_.data;
}

absl::Status NcclProcessGroup::RunOnStream(
    absl::string_view name,
    absl::FunctionRef<absl::Status(NcclCommunicator&)> enqueue,
    OpEvent* published) {
  const absl::Duration timeout = options_.group.timeout;
  WatchedComm::Watch watch(*comm_, std::string(name), timeout,
                           absl::Now() + timeout);
  absl::Status enqueued = comm_->Call(enqueue);
  if (!enqueued.ok()) return enqueued;
  // Recorded once NCCL has finished enqueueing (a nonblocking call may
  // leave that in progress until Call's polling ends).
  std::shared_ptr<NcclEvent> event;
  absl::Status recorded = comm_->Call([&](NcclCommunicator& comm) {
    absl::StatusOr<std::unique_ptr<NcclEvent>> e = comm.RecordEvent();
    if (!e.ok()) return e.status();
    event = std::move(*e);
    return absl::OkStatus();
  });
  if (!recorded.ok()) return recorded;
  if (published != nullptr) {
    absl::MutexLock lock(&published->mu);
    published->event = event;
  }
  return comm_->Await(*event);
}

std::shared_ptr<Work> NcclProcessGroup::Submit(CollectiveOp op,
                                               Enqueue enqueue) {
  auto published = std::make_shared<OpEvent>();
  std::shared_ptr<Work> work = engine_.Submit(
      std::move(op), [this, published, enqueue = std::move(enqueue)](
                         const CollectiveOp& op, const OpEngine::OpRun&) {
        if (op.empty()) return absl::OkStatus();
        return RunOnStream(
            op.Name(),
            [&](NcclCommunicator& comm) { return enqueue(comm, op); },
            published.get());
      });
  if (work->IsCompleted()) return work;
  {
    absl::MutexLock lock(&mu_);
    events_[work.get()] = published;
  }
  work->OnComplete([this, published, key = work.get()](const absl::Status&) {
    {
      absl::MutexLock lock(&published->mu);
      published->finished = true;
    }
    absl::MutexLock lock(&mu_);
    events_.erase(key);
  });
  return work;
}

std::shared_ptr<Work> NcclProcessGroup::Broadcast(BufferView buffer, int root) {
  return Submit(CollectiveOp::Broadcast(buffer, root),
                [](NcclCommunicator& comm, const CollectiveOp& op) {
                  return comm.Broadcast(op.input.data, op.input.data,
                                        op.input.count, op.input.dtype,
                                        op.root);
                });
}

std::shared_ptr<Work> NcclProcessGroup::AllReduce(BufferView buffer,
                                                  ReduceOp reduce) {
  return Submit(CollectiveOp::AllReduce(buffer, reduce),
                [](NcclCommunicator& comm, const CollectiveOp& op) {
                  return comm.AllReduce(op.input.data, op.input.data,
                                        op.input.count, op.input.dtype,
                                        op.reduce);
                });
}

std::shared_ptr<Work> NcclProcessGroup::Reduce(BufferView buffer, int root,
                                               ReduceOp reduce) {
  return Submit(CollectiveOp::Reduce(buffer, root, reduce),
                [](NcclCommunicator& comm, const CollectiveOp& op) {
                  return comm.Reduce(op.input.data, op.input.data,
                                     op.input.count, op.input.dtype, op.reduce,
                                     op.root);
                });
}

std::shared_ptr<Work> NcclProcessGroup::AllGather(BufferView input,
                                                  BufferView output) {
  return Submit(CollectiveOp::AllGather(input, output),
                [](NcclCommunicator& comm, const CollectiveOp& op) {
                  return comm.AllGather(op.input.data, op.output.data,
                                        op.input.count, op.input.dtype);
                });
}

std::shared_ptr<Work> NcclProcessGroup::AllGatherV(
    BufferView input, BufferView output, absl::Span<const size_t> counts) {
  return Submit(CollectiveOp::AllGatherV(input, output, counts),
                [this](NcclCommunicator& comm, const CollectiveOp& op) {
                  Exchange x(size_);
                  size_t offset = 0;
                  for (int r = 0; r < size_; ++r) {
                    x.send_counts[r] = op.input.count;
                    x.recv_counts[r] = op.counts[r];
                    x.recv_offsets[r] = offset;
                    offset += op.counts[r];
                  }
                  return RunExchange(comm, rank_, op.input, op.output, x);
                });
}

std::shared_ptr<Work> NcclProcessGroup::Gather(BufferView input,
                                               BufferView output, int root) {
  return Submit(CollectiveOp::Gather(input, output, root),
                [this](NcclCommunicator& comm, const CollectiveOp& op) {
                  Exchange x(size_);
                  const size_t n = op.input.count;
                  x.send_counts[op.root] = n;
                  if (rank_ == op.root) {
                    for (int r = 0; r < size_; ++r) {
                      x.recv_counts[r] = n;
                      x.recv_offsets[r] = r * n;
                    }
                  }
                  return RunExchange(comm, rank_, op.input, op.output, x);
                });
}

std::shared_ptr<Work> NcclProcessGroup::Scatter(BufferView input,
                                                BufferView output, int root) {
  return Submit(CollectiveOp::Scatter(input, output, root),
                [this](NcclCommunicator& comm, const CollectiveOp& op) {
                  Exchange x(size_);
                  const size_t n = op.output.count;
                  x.recv_counts[op.root] = n;
                  if (rank_ == op.root) {
                    for (int r = 0; r < size_; ++r) {
                      x.send_counts[r] = n;
                      x.send_offsets[r] = r * n;
                    }
                  }
                  return RunExchange(comm, rank_, op.input, op.output, x);
                });
}

std::shared_ptr<Work> NcclProcessGroup::AllToAll(BufferView input,
                                                 BufferView output) {
  return Submit(CollectiveOp::AllToAll(input, output),
                [this](NcclCommunicator& comm, const CollectiveOp& op) {
                  Exchange x(size_);
                  const size_t n = op.input.count / size_;
                  for (int r = 0; r < size_; ++r) {
                    x.send_counts[r] = x.recv_counts[r] = n;
                    x.send_offsets[r] = x.recv_offsets[r] = r * n;
                  }
                  return RunExchange(comm, rank_, op.input, op.output, x);
                });
}

std::shared_ptr<Work> NcclProcessGroup::AllToAllV(
    BufferView input, absl::Span<const size_t> send_counts, BufferView output,
    absl::Span<const size_t> recv_counts) {
  return Submit(
      CollectiveOp::AllToAllV(input, send_counts, output, recv_counts),
      [this](NcclCommunicator& comm, const CollectiveOp& op) {
        Exchange x(size_);
        size_t send_offset = 0, recv_offset = 0;
        for (int r = 0; r < size_; ++r) {
          x.send_counts[r] = op.counts[r];
          x.send_offsets[r] = send_offset;
          send_offset += op.counts[r];
          x.recv_counts[r] = op.recv_counts[r];
          x.recv_offsets[r] = recv_offset;
          recv_offset += op.recv_counts[r];
        }
        return RunExchange(comm, rank_, op.input, op.output, x);
      });
}

std::shared_ptr<Work> NcclProcessGroup::ReduceScatter(BufferView input,
                                                      BufferView output,
                                                      ReduceOp reduce) {
  return Submit(CollectiveOp::ReduceScatter(input, output, reduce),
                [](NcclCommunicator& comm, const CollectiveOp& op) {
                  return comm.ReduceScatter(op.input.data, op.output.data,
                                            op.output.count, op.input.dtype,
                                            op.reduce);
                });
}

std::shared_ptr<Work> NcclProcessGroup::Barrier() {
  return Submit(CollectiveOp::Barrier(), [this](NcclCommunicator& comm,
                                                const CollectiveOp&) {
    // Scratch is the engine thread's, and so is this body.
    absl::StatusOr<void*> scratch = Scratch(sizeof(float));
    if (!scratch.ok()) return scratch.status();
    return comm.AllReduce(*scratch, *scratch, 1, Dtype::kF32, ReduceOp::kSum);
  });
}

std::shared_ptr<Work> NcclProcessGroup::Send(BufferView buffer, int dst_rank,
                                             uint32_t tag) {
  return engine_.Post(PointToPointOp{/*is_send=*/true, buffer, dst_rank, tag});
}

std::shared_ptr<Work> NcclProcessGroup::Recv(BufferView buffer, int src_rank,
                                             uint32_t tag) {
  return engine_.Post(PointToPointOp{/*is_send=*/false, buffer, src_rank, tag});
}

absl::Status NcclProcessGroup::MakeStreamWait(const std::shared_ptr<Work>& work,
                                              void* stream) {
  if (work == nullptr) return absl::InvalidArgumentError("no Work");
  std::shared_ptr<OpEvent> op;
  {
    absl::MutexLock lock(&mu_);
    auto it = events_.find(work.get());
    if (it != events_.end()) op = it->second;
  }
  if (op == nullptr) {
    if (work->IsCompleted()) return work->status();
    return absl::InvalidArgumentError(
        "MakeStreamWait: the Work is not a pending collective of this group");
  }
  std::shared_ptr<NcclEvent> event;
  {
    absl::MutexLock lock(&op->mu);
    auto enqueued = [&op]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(op->mu) {
      return op->event != nullptr || op->finished;
    };
    if (!op->mu.AwaitWithTimeout(absl::Condition(&enqueued),
                                 options_.group.timeout)) {
      return absl::DeadlineExceededError(
          absl::StrCat("MakeStreamWait: the op was not enqueued within ",
                       absl::FormatDuration(options_.group.timeout),
                       " (the ops issued before it did not complete)"));
    }
    event = op->event;
  }
  if (event == nullptr) return work->Wait();
  return event->MakeStreamWait(stream);
}

absl::Status NcclProcessGroup::WaitForStream(void* stream) {
  return comm_->Call(
      [stream](NcclCommunicator& comm) { return comm.WaitForStream(stream); });
}

absl::Status NcclProcessGroup::Copy(void* dst, const void* src, size_t bytes,
                                    CopyKind kind) {
  if (bytes == 0) return absl::OkStatus();
  return RunOnStream(
      absl::StrCat("Copy of ", bytes, " bytes"),
      [&](NcclCommunicator& comm) { return comm.Copy(dst, src, bytes, kind); },
      nullptr);
}

absl::Status NcclProcessGroup::Memset(void* dst, int value, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return RunOnStream(
      absl::StrCat("Memset of ", bytes, " bytes"),
      [&](NcclCommunicator& comm) { return comm.Memset(dst, value, bytes); },
      nullptr);
}

absl::Status NcclProcessGroup::Memory::Run(
    absl::string_view what,
    absl::FunctionRef<absl::Status(DeviceStream&)> enqueue) {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (stream_ == nullptr) {
      absl::StatusOr<std::unique_ptr<DeviceStream>> created =
          group_.api().NewStream(group_.device_);
      if (created.ok()) {
        stream_ = std::move(*created);
      } else {
        status = created.status();
      }
    }
    if (status.ok()) status = enqueue(*stream_);
    if (status.ok()) status = stream_->Synchronize();
  }
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(what, " on ",
                                   Where(group_.options_, group_.comm_name_,
                                         group_.rank_, group_.size_),
                                   ": ", status.message()));
}

absl::Status NcclProcessGroup::Memory::Copy(void* dst, const void* src,
                                            size_t bytes, CopyKind kind) {
  if (bytes == 0) return absl::OkStatus();
  return Run(absl::StrCat("Copy of ", bytes, " bytes"),
             [&](DeviceStream& s) { return s.Copy(dst, src, bytes, kind); });
}

absl::Status NcclProcessGroup::Memory::Zero(void* data, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return Run(absl::StrCat("Zeroing ", bytes, " bytes"),
             [&](DeviceStream& s) { return s.Memset(data, 0, bytes); });
}

absl::Status NcclProcessGroup::Memory::AddF32(float* dst, const float* src,
                                              size_t count) {
  if (count == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("AddF32 of ", count, " elements with a null buffer"));
  }
  return Run(absl::StrCat("AddF32 of ", count, " elements"),
             [&](DeviceStream& s) { return s.AddF32(dst, src, count); });
}

absl::Status NcclProcessGroup::Memory::Convert(BufferView dst, BufferView src,
                                               float scale) {
  if (absl::Status s =
          CheckFloatConversion(dst.dtype, dst.count, src.dtype, src.count);
      !s.ok()) {
    return s;
  }
  if (dst.count == 0) return absl::OkStatus();
  if (dst.data == nullptr || src.data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("Convert of ", dst.count, " elements with a null buffer"));
  }
  return Run(absl::StrCat("Convert of ", dst.count, " ", DtypeName(src.dtype),
                          " to ", DtypeName(dst.dtype)),
             [&](DeviceStream& s) {
               return s.Convert(dst.data, dst.dtype, src.data, src.dtype,
                                dst.count, scale);
             });
}

absl::Status NcclProcessGroup::Memory::Update(const ElementwiseUpdate& update) {
  if (update.count == 0) return absl::OkStatus();
  const bool stateful = update.rule != ElementwiseUpdate::Rule::kSgd;
  if (update.params == nullptr || update.grads == nullptr ||
      (stateful && update.state0 == nullptr) ||
      (update.rule == ElementwiseUpdate::Rule::kAdam &&
       update.state1 == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Update of ", update.count, " elements with a null buffer"));
  }
  return Run(absl::StrCat("optimizer Update of ", update.count, " elements"),
             [&](DeviceStream& s) { return s.Update(update); });
}

absl::StatusOr<std::unique_ptr<NcclProcessGroup>> NcclProcessGroup::Split(
    int color, int key) {
  std::string child_name;
  {
    absl::MutexLock lock(&mu_);
    child_name = absl::StrCat(comm_name_, "/split/", splits_++);
  }
  int child_rank = -1, child_size = 0;
  std::unique_ptr<WatchedComm> child;
  NcclOptions child_options = options_;
  // The Split runs as a body of the engine, so that it takes its place in
  // the order of this group's ops on every rank.
  std::shared_ptr<Work> work = engine_.Submit(
      CollectiveOp::Barrier(),
      [&](const CollectiveOp&, const OpEngine::OpRun& run) -> absl::Status {
        // Every rank's (color, key), to number the new group's ranks as
        // NCCL does: by key, then by rank here.
        int32_t mine[2] = {color, key};
        std::vector<int32_t> all(2 * size_);
        absl::Status exchanged =
            transport_->AllGatherBytes(mine, sizeof(mine), all.data(), run.tag);
        if (!exchanged.ok()) return exchanged;
        if (color >= 0) {
          child_rank = 0;
          for (int r = 0; r < size_; ++r) {
            if (all[2 * r] != color) continue;
            ++child_size;
            if (all[2 * r + 1] < key || (all[2 * r + 1] == key && r < rank_)) {
              ++child_rank;
            }
          }
        }
        const absl::Duration timeout = options_.group.timeout;
        WatchedComm::Watch watch(*comm_, "ncclCommSplit", timeout,
                                 absl::Now() + timeout);
        std::unique_ptr<NcclCommunicator> split;
        absl::Status started = comm_->Call([&](NcclCommunicator& comm) {
          absl::StatusOr<std::unique_ptr<NcclCommunicator>> made =
              comm.Split(color, key);
          if (!made.ok()) return made.status();
          split = std::move(*made);
          return absl::OkStatus();
        });
        if (!started.ok() || split == nullptr) return started;
        child_options.store_prefix =
            absl::StrCat(options_.store_prefix, "/", child_name);
        child = std::make_unique<WatchedComm>(
            std::move(split),
            Where(child_options, child_name, child_rank, child_size),
            Watchdog(child_options));
        WatchedComm::Watch child_watch(*child,
                                       "NCCL init of the split "
                                       "communicator",
                                       timeout, absl::Now() + timeout);
        return child->Call([](NcclCommunicator&) { return absl::OkStatus(); });
      });
  absl::Status split = work->Wait();
  if (!split.ok()) return split;
  if (child == nullptr) return std::unique_ptr<NcclProcessGroup>();
  return std::unique_ptr<NcclProcessGroup>(
      new NcclProcessGroup(store_, child_rank, child_size, device_,
                           child_options, child_name, std::move(child)));
}

}  // namespace cohort
