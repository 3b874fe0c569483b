#include "worker/collective/nccl/fake_nccl_api.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/collective/elementwise.h"
#include "worker/collective/reduce.h"

namespace cohort {

// A call enqueued on a fake stream: done once it has run.
struct FakeItem {
  bool done = false;
};

struct FakeClique;

// One rank's communicator, as the world sees it.
struct FakeCommState {
  FakeNcclApi* api = nullptr;
  std::shared_ptr<FakeClique> clique;  // Null until a split is matched.
  int rank = 0;
  bool ready = false;
  bool aborted = false;
  int64_t next_collective = 0;
  int64_t next_split = 0;
  std::vector<std::shared_ptr<FakeItem>> stream;
};

struct FakeCall {
  std::string kind;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  Dtype dtype = Dtype::kF32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  std::shared_ptr<FakeItem> item;
};

struct FakeP2p {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t bytes = 0;
  std::shared_ptr<FakeItem> item;
  FakeNcclApi* api = nullptr;
};

struct FakeSplitArrival {
  int color = 0;
  int key = 0;
  std::shared_ptr<FakeCommState> child;
};

struct FakeClique {
  explicit FakeClique(int n) : nranks(n), members(n) {}
  const int nranks;
  int joined = 0;
  std::vector<std::shared_ptr<FakeCommState>> members;
  std::map<int64_t, std::vector<std::optional<FakeCall>>> collectives;
  std::map<std::pair<int, int>, std::deque<FakeP2p>> sends, recvs;
  std::map<int64_t, std::map<int, FakeSplitArrival>> splits;
};

class FakeNcclWorld {
 public:
  // A clique and its members point at each other: the world, which every
  // communicator's test outlives, breaks those cycles at the end.
  ~FakeNcclWorld() {
    absl::MutexLock lock(&mu);
    for (const std::weak_ptr<FakeClique>& weak : all) {
      if (std::shared_ptr<FakeClique> clique = weak.lock()) {
        clique->members.clear();
        clique->splits.clear();
      }
    }
  }

  absl::Mutex mu;
  int next_id ABSL_GUARDED_BY(mu) = 0;
  std::map<std::string, std::shared_ptr<FakeClique>> cliques
      ABSL_GUARDED_BY(mu);
  // Every clique made, split ones included.
  std::vector<std::weak_ptr<FakeClique>> all ABSL_GUARDED_BY(mu);
};

std::shared_ptr<FakeNcclWorld> NewFakeNcclWorld() {
  return std::make_shared<FakeNcclWorld>();
}

namespace {

bool Hangs(FakeNcclApi* api);

// Runs a matched collective on the host.
void RunCollective(std::vector<std::optional<FakeCall>>& calls) {
  const FakeCall& first = *calls[0];
  const int n = static_cast<int>(calls.size());
  const size_t element = DtypeSize(first.dtype);
  const size_t bytes = first.count * element;
  if (first.kind == "AllReduce" || first.kind == "Reduce" ||
      first.kind == "ReduceScatter") {
    const size_t total = first.kind == "ReduceScatter" ? bytes * n : bytes;
    std::vector<char> acc(static_cast<const char*>(first.send),
                          static_cast<const char*>(first.send) + total);
    for (int r = 1; r < n; ++r) {
      Combine(first.dtype, first.op, acc.data(), acc.data(), calls[r]->send,
              total / element);
    }
    if (first.op == ReduceOp::kAvg) {
      DivideInPlace(first.dtype, acc.data(), total / element, n);
    }
    for (int r = 0; r < n; ++r) {
      if (first.kind == "AllReduce") {
        std::memcpy(calls[r]->recv, acc.data(), bytes);
      } else if (first.kind == "Reduce" && r == first.root) {
        std::memcpy(calls[r]->recv, acc.data(), bytes);
      } else if (first.kind == "ReduceScatter") {
        std::memcpy(calls[r]->recv, acc.data() + r * bytes, bytes);
      }
    }
  } else if (first.kind == "Broadcast") {
    std::vector<char> data(
        static_cast<const char*>(calls[first.root]->send),
        static_cast<const char*>(calls[first.root]->send) + bytes);
    for (int r = 0; r < n; ++r) std::memcpy(calls[r]->recv, data.data(), bytes);
  } else if (first.kind == "AllGather") {
    std::vector<char> data(bytes * n);
    for (int r = 0; r < n; ++r) {
      std::memcpy(data.data() + r * bytes, calls[r]->send, bytes);
    }
    for (int r = 0; r < n; ++r) {
      std::memcpy(calls[r]->recv, data.data(), data.size());
    }
  }
}

class FakeEvent final : public NcclEvent {
 public:
  FakeEvent(FakeNcclWorld* world, std::shared_ptr<FakeCommState> comm,
            std::vector<std::shared_ptr<FakeItem>> before)
      : world_(world), comm_(std::move(comm)), before_(std::move(before)) {}

  absl::StatusOr<bool> Query() override {
    absl::MutexLock lock(&world_->mu);
    if (comm_->aborted) return true;
    for (const auto& item : before_) {
      if (!item->done) return false;
    }
    return true;
  }

  absl::Status MakeStreamWait(void*) override { return absl::OkStatus(); }

 private:
  FakeNcclWorld* const world_;
  const std::shared_ptr<FakeCommState> comm_;
  const std::vector<std::shared_ptr<FakeItem>> before_;
};

}  // namespace

class FakeCommunicator final : public NcclCommunicator {
 public:
  FakeCommunicator(FakeNcclApi* api, FakeNcclWorld* world,
                   std::shared_ptr<FakeCommState> state)
      : api_(api), world_(world), state_(std::move(state)) {}

  absl::StatusOr<bool> Ready() override {
    {
      absl::MutexLock lock(&api_->mu_);
      if (!api_->async_error_.ok()) return api_->async_error_;
    }
    absl::MutexLock lock(&world_->mu);
    if (state_->aborted) {
      return absl::InternalError("fake NCCL: communicator aborted");
    }
    return state_->ready;
  }

  void Abort() override {
    api_->Log("Abort");
    {
      absl::MutexLock lock(&api_->mu_);
      ++api_->aborts_;
      auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(api_->mu_) {
        return !api_->hold_aborts_;
      };
      api_->mu_.Await(absl::Condition(&released));
    }
    absl::MutexLock lock(&world_->mu);
    state_->aborted = true;
  }

  absl::Status GroupStart() override {
    api_->Log("GroupStart");
    return absl::OkStatus();
  }
  absl::Status GroupEnd() override {
    api_->Log("GroupEnd");
    return absl::OkStatus();
  }

  absl::Status AllReduce(const void* send, void* recv, size_t count,
                         Dtype dtype, ReduceOp op) override {
    return Collective({"AllReduce", send, recv, count, dtype, op, 0});
  }
  absl::Status Broadcast(const void* send, void* recv, size_t count,
                         Dtype dtype, int root) override {
    return Collective(
        {"Broadcast", send, recv, count, dtype, ReduceOp::kSum, root});
  }
  absl::Status Reduce(const void* send, void* recv, size_t count, Dtype dtype,
                      ReduceOp op, int root) override {
    return Collective({"Reduce", send, recv, count, dtype, op, root});
  }
  absl::Status AllGather(const void* send, void* recv, size_t count,
                         Dtype dtype) override {
    return Collective(
        {"AllGather", send, recv, count, dtype, ReduceOp::kSum, 0});
  }
  absl::Status ReduceScatter(const void* send, void* recv, size_t count,
                             Dtype dtype, ReduceOp op) override {
    return Collective({"ReduceScatter", send, recv, count, dtype, op, 0});
  }

  absl::Status Send(const void* send, size_t count, Dtype dtype,
                    int peer) override {
    api_->Log(absl::StrCat("Send(count=", count, ", ", DtypeName(dtype),
                           ", peer=", peer, ")"));
    if (absl::Status s =
            api_->CheckDevice("Send", send, count * DtypeSize(dtype));
        !s.ok()) {
      return s;
    }
    return PointToPoint(true, const_cast<void*>(send), count * DtypeSize(dtype),
                        peer);
  }
  absl::Status Recv(void* recv, size_t count, Dtype dtype, int peer) override {
    api_->Log(absl::StrCat("Recv(count=", count, ", ", DtypeName(dtype),
                           ", peer=", peer, ")"));
    if (absl::Status s =
            api_->CheckDevice("Recv", recv, count * DtypeSize(dtype));
        !s.ok()) {
      return s;
    }
    return PointToPoint(false, recv, count * DtypeSize(dtype), peer);
  }

  absl::StatusOr<std::unique_ptr<NcclCommunicator>> Split(int color,
                                                          int key) override {
    api_->Log(absl::StrCat("Split(color=", color, ", key=", key, ")"));
    auto child = std::make_shared<FakeCommState>();
    child->api = api_;
    absl::MutexLock lock(&world_->mu);
    FakeClique& clique = *state_->clique;
    auto& round = clique.splits[state_->next_split++];
    round[state_->rank] = FakeSplitArrival{color, key, child};
    if (static_cast<int>(round.size()) == clique.nranks) {
      std::map<int, std::vector<std::tuple<int, int, FakeCommState*>>> colors;
      for (auto& [rank, arrival] : round) {
        if (arrival.color < 0) continue;
        colors[arrival.color].emplace_back(arrival.key, rank,
                                           arrival.child.get());
      }
      for (auto& [c, members] : colors) {
        std::sort(members.begin(), members.end());
        auto made = std::make_shared<FakeClique>(members.size());
        world_->all.push_back(made);
        made->joined = static_cast<int>(members.size());
        for (size_t i = 0; i < members.size(); ++i) {
          FakeCommState* member = std::get<2>(members[i]);
          member->clique = made;
          member->rank = static_cast<int>(i);
          member->ready = true;
        }
        for (auto& [rank, arrival] : round) {
          if (arrival.color == c) {
            made->members[arrival.child->rank] = arrival.child;
          }
        }
      }
    }
    if (color < 0) return std::unique_ptr<NcclCommunicator>();
    return std::unique_ptr<NcclCommunicator>(
        new FakeCommunicator(api_, world_, child));
  }

  absl::StatusOr<std::unique_ptr<NcclEvent>> RecordEvent() override {
    absl::MutexLock lock(&world_->mu);
    auto& stream = state_->stream;
    stream.erase(std::remove_if(stream.begin(), stream.end(),
                                [](const auto& item) { return item->done; }),
                 stream.end());
    return std::unique_ptr<NcclEvent>(new FakeEvent(world_, state_, stream));
  }

  absl::Status WaitForStream(void*) override {
    api_->Log("WaitForStream");
    return absl::OkStatus();
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes,
                    CopyKind kind) override {
    return api_->FakeCopy(dst, src, bytes, kind);
  }

  absl::Status Memset(void* dst, int value, size_t bytes) override {
    return api_->FakeMemset(dst, value, bytes);
  }

 private:
  absl::Status Collective(FakeCall call) {
    api_->Log(absl::StrCat(call.kind, "(count=", call.count, ", ",
                           DtypeName(call.dtype), ", ", ReduceOpName(call.op),
                           ", root=", call.root, ")"));
    const size_t bytes = call.count * DtypeSize(call.dtype);
    const size_t ranks = static_cast<size_t>(state_->clique->nranks);
    const size_t send_bytes =
        call.kind == "ReduceScatter" ? bytes * ranks : bytes;
    const size_t recv_bytes = call.kind == "AllGather" ? bytes * ranks : bytes;
    if (absl::Status s = api_->CheckDevice(call.kind, call.send, send_bytes);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = api_->CheckDevice(call.kind, call.recv, recv_bytes);
        !s.ok()) {
      return s;
    }
    call.item = std::make_shared<FakeItem>();
    absl::MutexLock lock(&world_->mu);
    state_->stream.push_back(call.item);
    FakeClique& clique = *state_->clique;
    auto& calls = clique.collectives[state_->next_collective++];
    calls.resize(clique.nranks);
    calls[state_->rank] = std::move(call);
    for (const auto& c : calls) {
      if (!c.has_value()) return absl::OkStatus();
    }
    // Every rank has made its call: it runs, unless a rank's GPU hangs.
    for (const auto& member : clique.members) {
      if (member == nullptr || Hangs(member->api)) return absl::OkStatus();
    }
    RunCollective(calls);
    for (auto& c : calls) c->item->done = true;
    return absl::OkStatus();
  }

  absl::Status PointToPoint(bool is_send, void* data, size_t bytes, int peer) {
    auto item = std::make_shared<FakeItem>();
    absl::MutexLock lock(&world_->mu);
    state_->stream.push_back(item);
    FakeClique& clique = *state_->clique;
    const auto pair = is_send ? std::make_pair(state_->rank, peer)
                              : std::make_pair(peer, state_->rank);
    auto& mine = is_send ? clique.sends[pair] : clique.recvs[pair];
    auto& theirs = is_send ? clique.recvs[pair] : clique.sends[pair];
    FakeP2p p2p{data, data, bytes, item, api_};
    if (theirs.empty()) {
      mine.push_back(std::move(p2p));
      return absl::OkStatus();
    }
    FakeP2p other = std::move(theirs.front());
    theirs.pop_front();
    if (Hangs(api_) || Hangs(other.api)) return absl::OkStatus();
    const FakeP2p& send = is_send ? p2p : other;
    const FakeP2p& recv = is_send ? other : p2p;
    std::memcpy(recv.recv, send.send, std::min(send.bytes, recv.bytes));
    item->done = true;
    other.item->done = true;
    return absl::OkStatus();
  }

  FakeNcclApi* const api_;
  FakeNcclWorld* const world_;
  const std::shared_ptr<FakeCommState> state_;
};

namespace {

bool Hangs(FakeNcclApi* api) { return api->hanging(); }

}  // namespace

// A DeviceStream on the host: every call runs at once (nothing it does
// waits for the communicators' collectives, as on a stream of its own), is
// logged like a communicator's, and checks its pointers under
// RequireDeviceMemory().
class FakeDeviceStream final : public DeviceStream {
 public:
  explicit FakeDeviceStream(FakeNcclApi* api) : api_(api) {}

  absl::Status Copy(void* dst, const void* src, size_t bytes,
                    CopyKind kind) override {
    return api_->FakeCopy(dst, src, bytes, kind);
  }

  absl::Status Memset(void* dst, int value, size_t bytes) override {
    return api_->FakeMemset(dst, value, bytes);
  }

  absl::Status AddF32(float* dst, const float* src, size_t count) override {
    api_->Log(absl::StrCat("AddF32(count=", count, ")"));
    for (const void* p :
         {static_cast<const void*>(dst), static_cast<const void*>(src)}) {
      if (absl::Status s = api_->CheckDevice("AddF32", p, count * 4); !s.ok()) {
        return s;
      }
    }
    for (size_t i = 0; i < count; ++i) dst[i] += src[i];
    return absl::OkStatus();
  }

  absl::Status Convert(void* dst, Dtype dst_dtype, const void* src,
                       Dtype src_dtype, size_t count, float scale) override {
    api_->Log(absl::StrCat("Convert(count=", count, ", ", DtypeName(src_dtype),
                           " to ", DtypeName(dst_dtype), ")"));
    if (absl::Status s =
            api_->CheckDevice("Convert", dst, count * DtypeSize(dst_dtype));
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            api_->CheckDevice("Convert", src, count * DtypeSize(src_dtype));
        !s.ok()) {
      return s;
    }
    // As the kernel: widen, scale in f32, narrow once.
    ConvertFloats(dst_dtype, dst, src_dtype, src, count, scale);
    return absl::OkStatus();
  }

  absl::Status Update(const ElementwiseUpdate& update) override {
    api_->Log(absl::StrCat("Update(count=", update.count,
                           ", rule=", static_cast<int>(update.rule), ")"));
    const size_t bytes = update.count * sizeof(float);
    for (const void* p : {static_cast<const void*>(update.params),
                          static_cast<const void*>(update.grads),
                          static_cast<const void*>(update.state0),
                          static_cast<const void*>(update.state1)}) {
      if (p == nullptr) continue;
      if (absl::Status s = api_->CheckDevice("Update", p, bytes); !s.ok()) {
        return s;
      }
    }
    ApplyUpdateOnHost(update);
    return absl::OkStatus();
  }

  absl::Status Synchronize() override { return absl::OkStatus(); }

 private:
  FakeNcclApi* const api_;
};

FakeNcclApi::FakeNcclApi(std::shared_ptr<FakeNcclWorld> world, int devices)
    : world_(std::move(world)), devices_(devices) {}

FakeNcclApi::~FakeNcclApi() {
  absl::MutexLock lock(&mu_);
  for (auto& [memory, bytes] : allocations_) std::free(memory);
}

absl::StatusOr<int> FakeNcclApi::DeviceCount() {
  if (devices_ == 0) {
    return absl::FailedPreconditionError(
        "no CUDA device visible: cudaGetDeviceCount: cudaErrorNoDevice (no "
        "CUDA-capable device is detected)");
  }
  return devices_;
}

absl::StatusOr<NcclUniqueId> FakeNcclApi::GetUniqueId() {
  NcclUniqueId id;
  int n;
  {
    absl::MutexLock lock(&world_->mu);
    n = world_->next_id++;
  }
  const std::string text = absl::StrCat("fake-nccl-id-", n);
  std::copy(text.begin(), text.end(), id.bytes.begin());
  absl::MutexLock lock(&mu_);
  ++unique_ids_;
  return id;
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> FakeNcclApi::InitRank(
    int device, int nranks, int rank, absl::Span<const NcclUniqueId> ids) {
  Log(absl::StrCat("InitRank(nranks=", nranks, ", rank=", rank,
                   ", ids=", ids.size(), ", device=", device, ")"));
  std::string key;
  for (const NcclUniqueId& id : ids)
    key.append(id.bytes.data(), id.bytes.size());
  auto state = std::make_shared<FakeCommState>();
  state->api = this;
  state->rank = rank;
  absl::MutexLock lock(&world_->mu);
  std::shared_ptr<FakeClique>& clique = world_->cliques[key];
  if (clique == nullptr) {
    clique = std::make_shared<FakeClique>(nranks);
    world_->all.push_back(clique);
  }
  if (clique->nranks != nranks || clique->members[rank] != nullptr) {
    return absl::InternalError(absl::StrCat(
        "fake NCCL: rank ", rank, " of ", nranks,
        " does not fit the communicator of ", clique->nranks, " ranks"));
  }
  state->clique = clique;
  clique->members[rank] = state;
  if (++clique->joined == nranks) {
    for (auto& member : clique->members) member->ready = true;
  }
  return std::unique_ptr<NcclCommunicator>(
      new FakeCommunicator(this, world_.get(), state));
}

absl::Status FakeNcclApi::FakeCopy(void* dst, const void* src, size_t bytes,
                                   CopyKind kind) {
  Log(absl::StrCat("Copy(", bytes, " bytes, ",
                   kind == CopyKind::kHostToDevice   ? "host to device"
                   : kind == CopyKind::kDeviceToHost ? "device to host"
                                                     : "on device",
                   ")"));
  if (kind != CopyKind::kDeviceToHost) {
    if (absl::Status s = CheckDevice("Copy", dst, bytes); !s.ok()) {
      return s;
    }
  }
  if (kind != CopyKind::kHostToDevice) {
    if (absl::Status s = CheckDevice("Copy", src, bytes); !s.ok()) {
      return s;
    }
  }
  std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status FakeNcclApi::FakeMemset(void* dst, int value, size_t bytes) {
  Log(absl::StrCat("Memset(", bytes, " bytes)"));
  if (absl::Status s = CheckDevice("Memset", dst, bytes); !s.ok()) {
    return s;
  }
  std::memset(dst, value, bytes);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceStream>> FakeNcclApi::NewStream(int) {
  Log("NewStream");
  return std::unique_ptr<DeviceStream>(new FakeDeviceStream(this));
}

absl::StatusOr<void*> FakeNcclApi::Alloc(int, size_t bytes) {
  void* memory = std::calloc(std::max<size_t>(bytes, 1), 1);
  absl::MutexLock lock(&mu_);
  allocations_[memory] = bytes;
  ++allocations_made_;
  return memory;
}

void FakeNcclApi::Free(void* device_memory) {
  absl::MutexLock lock(&mu_);
  if (allocations_.erase(device_memory) > 0) std::free(device_memory);
}

void FakeNcclApi::RequireDeviceMemory() {
  absl::MutexLock lock(&mu_);
  require_device_memory_ = true;
}

absl::Status FakeNcclApi::CheckDevice(absl::string_view call, const void* p,
                                      size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (!require_device_memory_ || bytes == 0) return absl::OkStatus();
  const char* at = static_cast<const char*>(p);
  auto it = allocations_.upper_bound(const_cast<void*>(p));
  if (it != allocations_.begin()) {
    --it;
    const char* base = static_cast<const char*>(it->first);
    if (at >= base && at + bytes <= base + it->second) return absl::OkStatus();
  }
  ++host_pointer_calls_;
  return absl::InvalidArgumentError(absl::StrCat(
      "fake NCCL: ", call, " was passed ", bytes,
      " bytes at a pointer outside device memory (a real GPU would fault)"));
}

int FakeNcclApi::host_pointer_calls() const {
  absl::MutexLock lock(&mu_);
  return host_pointer_calls_;
}

void FakeNcclApi::InjectAsyncError(absl::Status error) {
  absl::MutexLock lock(&mu_);
  async_error_ = std::move(error);
}

void FakeNcclApi::Hang() {
  absl::MutexLock lock(&mu_);
  hang_ = true;
}

bool FakeNcclApi::hanging() const {
  absl::MutexLock lock(&mu_);
  return hang_;
}

std::vector<std::string> FakeNcclApi::calls() const {
  absl::MutexLock lock(&mu_);
  return calls_;
}

void FakeNcclApi::HoldAborts() {
  absl::MutexLock lock(&mu_);
  hold_aborts_ = true;
}

void FakeNcclApi::ReleaseAborts() {
  absl::MutexLock lock(&mu_);
  hold_aborts_ = false;
}

int FakeNcclApi::AwaitAborts(int n, absl::Duration limit) {
  absl::MutexLock lock(&mu_);
  auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return aborts_ >= n;
  };
  mu_.AwaitWithTimeout(absl::Condition(&enough), limit);
  return aborts_;
}

int FakeNcclApi::aborts() const {
  absl::MutexLock lock(&mu_);
  return aborts_;
}

int FakeNcclApi::unique_ids() const {
  absl::MutexLock lock(&mu_);
  return unique_ids_;
}

int FakeNcclApi::allocations_made() const {
  absl::MutexLock lock(&mu_);
  return allocations_made_;
}

size_t FakeNcclApi::allocated_bytes() const {
  absl::MutexLock lock(&mu_);
  size_t total = 0;
  for (const auto& [memory, bytes] : allocations_) total += bytes;
  return total;
}

void FakeNcclApi::Log(std::string call) {
  absl::MutexLock lock(&mu_);
  calls_.push_back(std::move(call));
}

}  // namespace cohort
