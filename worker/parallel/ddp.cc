#include "worker/parallel/ddp.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "worker/parallel/group_memory.h"

namespace cohort {
namespace {

// What the Reducer needs to know about its own hooks beyond CommHook: how
// many bytes they put on the wire per element and where their scratch lives.
// Other hooks report their bytes (CommHook::bytes_sent) or are assumed to
// send the f32 bucket.
class BuiltinHook : public CommHook {
 public:
  virtual size_t wire_bytes_per_element() const = 0;
  // Sizes the per-bucket scratch for a (new) layout, in the memory of the
  // Reducer's buckets, so that grad_bytes() reports the steady-state
  // footprint from Create() on.
  virtual absl::Status PrepareScratch(
      GroupMemory& memory, absl::Span<const size_t> bucket_elements) {
    return absl::OkStatus();
  }
  // Frees the scratch when the Reducer goes: the caller may keep the hook
  // longer than the group whose device memory the scratch is in.
  virtual void ReleaseScratch() {}
};

class AllReduceHookImpl : public BuiltinHook {
 public:
  std::string name() const override { return "allreduce"; }
  std::shared_ptr<Work> Launch(ProcessGroup& group, int bucket,
                               BufferView grads) override {
    return group.AllReduce(grads, ReduceOp::kAvg);
  }
  size_t wire_bytes_per_element() const override { return sizeof(float); }
};

// Narrows each bucket (pre-divided by the world size so the sum cannot
// overflow where the average would not) into a 16-bit copy that is reduced
// with SUM, then widens the result back into the bucket: on a device group
// both casts are kernels on the group's device. The scratch is kept across
// iterations, in the buckets' memory: reallocating a bucket-sized buffer
// every step would cost as much as the cast. One instance serves one
// Reducer at a time, because the scratch is indexed by bucket.
class CompressHook : public BuiltinHook {
 public:
  explicit CompressHook(Dtype dtype) : dtype_(dtype) {}

  std::string name() const override {
    return dtype_ == Dtype::kF16 ? "fp16_compress" : "bf16_compress";
  }

  std::shared_ptr<Work> Launch(ProcessGroup& group, int bucket,
                               BufferView grads) override {
    if (grads.dtype != Dtype::kF32 || (grads.data == nullptr && grads.count)) {
      return Work::Done(absl::InvalidArgumentError(
          absl::StrCat(name(), " hook: bucket ", bucket,
                       " must be a non-null f32 buffer, "
                       "got ",
                       DtypeName(grads.dtype))));
    }
    if (bucket < 0) {
      return Work::Done(absl::InvalidArgumentError(
          absl::StrCat(name(), " hook: negative bucket index ", bucket)));
    }
    if (memory_ == nullptr || memory_->device() != group.device_memory()) {
      // A hook used outside a Reducer, or moved to another group.
      memory_ = std::make_unique<GroupMemory>(group.device_memory());
    }
    if (scratch_.size() <= static_cast<size_t>(bucket)) {
      scratch_.resize(bucket + 1);
    }
    GroupBuffer& scratch = scratch_[bucket];
    if (scratch.bytes() != grads.count * sizeof(uint16_t)) {
      absl::StatusOr<GroupBuffer> fresh =
          memory_->Allocate(grads.count * sizeof(uint16_t));
      if (!fresh.ok()) return Work::Done(fresh.status());
      scratch = std::move(*fresh);
    }
    const BufferView narrow{scratch.data(), grads.count, dtype_};
    // Scaled into the scratch, so that the bucket still holds this rank's
    // gradients if the collective fails.
    absl::Status cast = memory_->Convert(
        narrow, grads, 1.0f / static_cast<float>(group.size()));
    if (!cast.ok()) return Work::Done(cast);
    return group.AllReduce(narrow, ReduceOp::kSum);
  }

  absl::Status Finalize(int bucket, BufferView grads) override {
    if (bucket < 0 || static_cast<size_t>(bucket) >= scratch_.size() ||
        scratch_[bucket].bytes() != grads.count * sizeof(uint16_t) ||
        memory_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          name(), " hook: Finalize for bucket ", bucket,
          " without a matching Launch of ", grads.count, " elements"));
    }
    return memory_->Convert(
        grads, BufferView{scratch_[bucket].data(), grads.count, dtype_}, 1.0f);
  }

  size_t wire_bytes_per_element() const override { return sizeof(uint16_t); }

  absl::Status PrepareScratch(
      GroupMemory& memory, absl::Span<const size_t> bucket_elements) override {
    memory_ = std::make_unique<GroupMemory>(memory.device());
    // Freed first, so that a rebuild holds one layout's scratch at a time.
    scratch_.clear();
    std::vector<GroupBuffer> scratch(bucket_elements.size());
    for (size_t b = 0; b < bucket_elements.size(); ++b) {
      absl::StatusOr<GroupBuffer> buffer =
          memory_->Allocate(bucket_elements[b] * sizeof(uint16_t));
      if (!buffer.ok()) return buffer.status();
      scratch[b] = std::move(*buffer);
    }
    scratch_.swap(scratch);
    return absl::OkStatus();
  }

  size_t scratch_bytes() const override {
    size_t bytes = 0;
    for (const GroupBuffer& s : scratch_) bytes += s.bytes();
    return bytes;
  }

  void ReleaseScratch() override {
    scratch_.clear();
    memory_.reset();
  }

 private:
  const Dtype dtype_;
  std::unique_ptr<GroupMemory> memory_;  // The buckets' memory.
  std::vector<GroupBuffer> scratch_;
};

// "3, 5" or "3, 5, 7, ... (12 in all)": names enough parameters to act on
// without flooding the message for a model with thousands of them.
std::string ListParams(const std::vector<int>& params) {
  constexpr size_t kMaxNamed = 16;
  if (params.size() <= kMaxNamed) return absl::StrJoin(params, ", ");
  std::vector<int> head(params.begin(), params.begin() + kMaxNamed);
  return absl::StrCat(absl::StrJoin(head, ", "), ", ... (", params.size(),
                      " in all)");
}

}  // namespace

std::shared_ptr<CommHook> AllReduceHook() {
  return std::make_shared<AllReduceHookImpl>();
}

std::shared_ptr<CommHook> Fp16CompressHook() {
  return std::make_shared<CompressHook>(Dtype::kF16);
}

std::shared_ptr<CommHook> Bf16CompressHook() {
  return std::make_shared<CompressHook>(Dtype::kBF16);
}

// Thread-compatible: every member is touched only by the thread calling the
// Reducer. The backend threads touch only bucket storage (through the
// BufferViews handed to the hook) and the Works, which are thread-safe.
struct Reducer::State {
  std::shared_ptr<ProcessGroup> group;
  std::vector<size_t> param_sizes;
  ReducerOptions options;
  std::shared_ptr<CommHook> hook;
  BuiltinHook* builtin = nullptr;  // `hook` when it is one of ours.

  // Where the buckets live: host memory, or the group's device memory.
  std::unique_ptr<GroupMemory> memory;

  // Layout.
  std::vector<Bucket> buckets;
  std::vector<GroupBuffer> storage;  // One per bucket, f32.
  std::vector<int> bucket_of;        // Per parameter.
  std::vector<size_t> offset_of;     // Per parameter, in its bucket.

  // The iteration in progress.
  bool started = false;  // Some MarkReady since the last Finish.
  bool iteration_no_sync = false;
  std::vector<bool> marked;
  std::vector<int> ready_order;
  std::vector<size_t> unready;  // Per bucket: parameters not yet marked.
  int next_to_launch = 0;
  std::vector<std::shared_ptr<Work>> works;  // Per bucket; null: not started.

  bool no_sync = false;
  bool finished_once = false;
  bool rebuilt = false;
  absl::Status failure;             // The first failed reduction; sticky.
  uint64_t bytes_communicated = 0;  // Less the hook's own count, if any.
  uint64_t hook_bytes_at_create = 0;

  // Packs `order` into buckets, closing each as soon as it holds at least
  // its limit (first bucket, then the cap; torch's rule, which never splits
  // a parameter), and allocates zeroed storage.
  absl::Status BuildLayout(const std::vector<int>& order) {
    buckets.clear();
    Bucket current;
    size_t current_bytes = 0;
    size_t limit = options.first_bucket_bytes;
    for (int p : order) {
      current.params.push_back(p);
      current.offsets.push_back(current.elements);
      current.elements += param_sizes[p];
      current_bytes += param_sizes[p] * sizeof(float);
      if (current_bytes >= limit) {
        buckets.push_back(std::move(current));
        current = Bucket();
        current_bytes = 0;
        limit = options.bucket_cap_bytes;
      }
    }
    if (!current.params.empty()) buckets.push_back(std::move(current));

    storage.clear();
    storage.resize(buckets.size());
    bucket_of.assign(param_sizes.size(), -1);
    offset_of.assign(param_sizes.size(), 0);
    std::vector<size_t> elements;
    for (size_t b = 0; b < buckets.size(); ++b) {
      absl::StatusOr<GroupBuffer> buffer =
          memory->AllocateFloats(buckets[b].elements);
      if (!buffer.ok()) {
        return absl::Status(
            buffer.status().code(),
            absl::StrCat("allocating gradient bucket ", b, " (",
                         buckets[b].elements * sizeof(float),
                         " bytes): ", buffer.status().message()));
      }
      storage[b] = std::move(*buffer);
      elements.push_back(buckets[b].elements);
      for (size_t k = 0; k < buckets[b].params.size(); ++k) {
        bucket_of[buckets[b].params[k]] = static_cast<int>(b);
        offset_of[buckets[b].params[k]] = buckets[b].offsets[k];
      }
    }
    if (builtin != nullptr) {
      if (absl::Status s = builtin->PrepareScratch(*memory, elements);
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = hook->OnLayout(buckets); !s.ok()) return s;
    ResetIteration();
    return absl::OkStatus();
  }

  void ResetIteration() {
    started = false;
    marked.assign(param_sizes.size(), false);
    ready_order.clear();
    unready.assign(buckets.size(), 0);
    for (size_t b = 0; b < buckets.size(); ++b) {
      unready[b] = buckets[b].params.size();
    }
    next_to_launch = 0;
    works.assign(buckets.size(), nullptr);
  }

  BufferView View(int b) { return storage[b].view(); }

  absl::Status Fail(absl::Status status) {
    if (failure.ok()) failure = status;
    return status;
  }

  absl::Status FailedGroupError() const {
    return absl::FailedPreconditionError(absl::StrCat(
        "the reducer is unusable: an earlier gradient reduction failed (",
        failure.ToString(),
        "); the ranks may disagree on their gradients, so restart the job or "
        "rebuild the process group and the Reducer"));
  }

  absl::Status Launch(int b) {
    std::shared_ptr<Work> work = hook->Launch(*group, b, View(b));
    if (work == nullptr) {
      return Fail(absl::InternalError(absl::StrCat(
          "comm hook '", hook->name(), "' returned no Work for bucket ", b)));
    }
    works[b] = std::move(work);
    if (!hook->bytes_sent().has_value()) {
      const size_t per_element = builtin != nullptr
                                     ? builtin->wire_bytes_per_element()
                                     : sizeof(float);
      bytes_communicated +=
          WireBytes(Traffic::kAllReduce, buckets[b].elements * per_element,
                    group->size());
    }
    // An op rejected before it was queued is reported now rather than at
    // Finish(), so the caller stops doing backward work that cannot be used.
    if (works[b]->IsCompleted() && !works[b]->status().ok()) {
      return Fail(works[b]->status());
    }
    return absl::OkStatus();
  }

  // Starts every bucket that is ready and whose predecessors have started:
  // ranks may finish gradients in different orders, but must issue the
  // collectives in the same one.
  absl::Status LaunchReady() {
    while (next_to_launch < static_cast<int>(buckets.size()) &&
           unready[next_to_launch] == 0) {
      absl::Status status = Launch(next_to_launch++);
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  }

  // Waits for every started reduction; returns the first error. Waits
  // without a deadline: the buffers stay in use until the op ends, and the
  // group's timeout guarantees that it ends.
  absl::Status WaitAll() {
    absl::Status first;
    for (std::shared_ptr<Work>& work : works) {
      if (work == nullptr) continue;
      absl::Status status = work->Wait(absl::InfiniteDuration());
      if (first.ok()) first = status;
      work = nullptr;
    }
    return first;
  }

  // Rank 0's ready order, made a full permutation: a no_sync iteration may
  // leave parameters unmarked, and those go last in reverse index order.
  std::vector<int32_t> CompleteReadyOrder() const {
    std::vector<int32_t> order(ready_order.begin(), ready_order.end());
    for (int p = static_cast<int>(param_sizes.size()) - 1; p >= 0; --p) {
      if (!marked[p]) order.push_back(p);
    }
    return order;
  }

  // Rank 0's `order` on every rank: broadcast in place, or on a device
  // group through a device buffer (the order is metadata, a few bytes per
  // parameter, once).
  absl::Status BroadcastOrder(std::vector<int32_t>& order) {
    const size_t bytes = order.size() * sizeof(int32_t);
    bytes_communicated += WireBytes(Traffic::kBroadcast, bytes, group->size());
    if (!memory->on_device()) {
      return group->Broadcast(BufferView::Of(order.data(), order.size()), 0)
          ->Wait(absl::InfiniteDuration());
    }
    absl::StatusOr<GroupBuffer> staged = memory->Allocate(bytes);
    if (!staged.ok()) return staged.status();
    if (absl::Status s = memory->FromHost(staged->data(), order.data(), bytes);
        !s.ok()) {
      return s;
    }
    absl::Status status =
        group
            ->Broadcast(BufferView{staged->data(), order.size(), Dtype::kI32},
                        0)
            ->Wait(absl::InfiniteDuration());
    if (!status.ok()) return status;
    return memory->ToHost(order.data(), staged->data(), bytes);
  }

  absl::Status Rebuild(std::vector<int32_t> order) {
    const int n = static_cast<int>(param_sizes.size());
    absl::Status status = BroadcastOrder(order);
    if (!status.ok()) return Fail(status);
    std::vector<bool> seen(n, false);
    for (size_t k = 0; k < order.size(); ++k) {
      const int32_t p = order[k];
      if (p < 0 || p >= n || seen[p]) {
        return Fail(absl::InternalError(absl::StrCat(
            "rank 0's gradient ready order is not a permutation of 0..", n - 1,
            " (entry ", k, " is ", p,
            "); do all ranks create the Reducer with the same parameters?")));
      }
      seen[p] = true;
    }

    std::vector<GroupBuffer> old_storage = std::move(storage);
    const std::vector<int> old_bucket_of = bucket_of;
    const std::vector<size_t> old_offset_of = offset_of;
    status = BuildLayout(std::vector<int>(order.begin(), order.end()));
    if (!status.ok()) return Fail(status);
    for (int p = 0; p < n; ++p) {
      const float* src =
          old_storage[old_bucket_of[p]].floats() + old_offset_of[p];
      status = memory->Copy(storage[bucket_of[p]].floats() + offset_of[p], src,
                            param_sizes[p] * sizeof(float));
      if (!status.ok()) return Fail(status);
    }
    rebuilt = true;
    return absl::OkStatus();
  }
};

absl::StatusOr<std::unique_ptr<Reducer>> Reducer::Create(
    std::shared_ptr<ProcessGroup> group, std::vector<size_t> param_sizes,
    const ReducerOptions& options) {
  if (group == nullptr) {
    return absl::InvalidArgumentError("Reducer::Create: the group is null");
  }
  if (param_sizes.empty()) {
    return absl::InvalidArgumentError(
        "Reducer::Create: no parameters; pass the element count of every "
        "parameter that has a gradient");
  }
  if (param_sizes.size() >
      static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("Reducer::Create: ", param_sizes.size(),
                     " parameters; at most 2^31-1 are supported"));
  }
  for (size_t i = 0; i < param_sizes.size(); ++i) {
    if (param_sizes[i] == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Reducer::Create: parameter ", i,
          " has 0 elements; leave parameters without gradients out"));
    }
    // Conservative, so that no bucket's byte count can overflow size_t.
    if (param_sizes[i] > std::numeric_limits<size_t>::max() / sizeof(float) /
                             param_sizes.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Reducer::Create: parameter ", i, " has ", param_sizes[i],
          " elements, too many to address in bytes"));
    }
  }
  if (options.first_bucket_bytes == 0 || options.bucket_cap_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Reducer::Create: bucket sizes must be positive (first_bucket_bytes=",
        options.first_bucket_bytes,
        ", bucket_cap_bytes=", options.bucket_cap_bytes, ")"));
  }

  auto state = std::make_unique<State>();
  state->group = std::move(group);
  state->param_sizes = std::move(param_sizes);
  state->options = options;
  state->hook = options.hook != nullptr ? options.hook : AllReduceHook();
  state->builtin = dynamic_cast<BuiltinHook*>(state->hook.get());
  state->memory = std::make_unique<GroupMemory>(state->group->device_memory());
  state->hook_bytes_at_create = state->hook->bytes_sent().value_or(0);
  std::vector<int> order(state->param_sizes.size());
  for (size_t k = 0; k < order.size(); ++k) {
    order[k] = static_cast<int>(order.size() - 1 - k);
  }
  if (absl::Status same =
          VerifySameSizes(*state->group, state->param_sizes, "Reducer::Create");
      !same.ok()) {
    return same;
  }
  if (absl::Status built = state->BuildLayout(order); !built.ok()) {
    return absl::Status(built.code(),
                        absl::StrCat("Reducer::Create: ", built.message()));
  }
  return std::unique_ptr<Reducer>(new Reducer(std::move(state)));
}

Reducer::Reducer(std::unique_ptr<State> state) : state_(std::move(state)) {}

Reducer::~Reducer() {
  // The backend may still be writing into the buckets.
  state_->WaitAll().IgnoreError();
  if (state_->builtin != nullptr) state_->builtin->ReleaseScratch();
}

int Reducer::num_params() const {
  return static_cast<int>(state_->param_sizes.size());
}

ProcessGroup& Reducer::group() const { return *state_->group; }

absl::Span<float> Reducer::grad(int param) {
  if (param < 0 || param >= num_params()) {
    // A bug in the caller (ddp.h): no status to return, and any span would
    // be misused.
    std::fprintf(stderr,
                 "ddp: bug in the caller: Reducer::grad(%d): parameter out of "
                 "range [0, %d)\n",
                 param, num_params());
    std::abort();
  }
  return absl::Span<float>(state_->storage[state_->bucket_of[param]].floats() +
                               state_->offset_of[param],
                           state_->param_sizes[param]);
}

bool Reducer::on_device() const { return state_->memory->on_device(); }

void Reducer::ZeroGrad() {
  for (GroupBuffer& bucket : state_->storage) {
    absl::Status zeroed = state_->memory->Zero(bucket.data(), bucket.bytes());
    if (!zeroed.ok()) {
      // No status to return: the next MarkReady or Finish reports it.
      state_->Fail(zeroed).IgnoreError();
      return;
    }
  }
}

absl::Status Reducer::MarkReady(int param) {
  State& s = *state_;
  if (!s.failure.ok()) return s.FailedGroupError();
  if (param < 0 || param >= num_params()) {
    return absl::InvalidArgumentError(
        absl::StrCat("MarkReady(", param, "): parameter out of range [0, ",
                     num_params(), ")"));
  }
  if (s.marked[param]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MarkReady(", param,
        "): parameter already marked ready in this iteration; mark each "
        "parameter once per backward and call Finish() between iterations"));
  }
  if (!s.started) {
    // The scope is sampled once per iteration so that an iteration is
    // either fully reduced or fully local.
    s.started = true;
    s.iteration_no_sync = s.no_sync;
  }
  s.marked[param] = true;
  s.ready_order.push_back(param);
  --s.unready[s.bucket_of[param]];
  if (s.iteration_no_sync || !s.options.overlap) return absl::OkStatus();
  return s.LaunchReady();
}

absl::Status Reducer::Finish() {
  State& s = *state_;
  if (!s.failure.ok()) {
    s.WaitAll().IgnoreError();
    s.ResetIteration();
    return s.FailedGroupError();
  }
  if (!s.started) s.iteration_no_sync = s.no_sync;

  if (!s.iteration_no_sync) {
    std::vector<int> unmarked;
    for (int p = 0; p < num_params(); ++p) {
      if (!s.marked[p]) unmarked.push_back(p);
    }
    if (!unmarked.empty()) {
      // Buckets already started must end before the iteration is dropped:
      // the backend is still using their storage.
      absl::Status status = s.WaitAll();
      if (!status.ok()) s.Fail(status).IgnoreError();
      s.ResetIteration();
      return absl::FailedPreconditionError(absl::StrCat(
          unmarked.size() == 1 ? "parameter " : "parameters ",
          ListParams(unmarked), unmarked.size() == 1 ? " was" : " were",
          " not marked ready in this iteration; every rank must mark every "
          "parameter once per backward"));
    }
    absl::Status status = s.LaunchReady();
    absl::Status waited = s.WaitAll();
    if (status.ok()) status = waited;
    if (!status.ok()) {
      s.ResetIteration();
      return s.Fail(status);
    }
    for (size_t b = 0; b < s.buckets.size(); ++b) {
      status = s.hook->Finalize(static_cast<int>(b), s.View(b));
      if (!status.ok()) {
        s.ResetIteration();
        return s.Fail(status);
      }
    }
  }

  std::vector<int32_t> order;
  const bool rebuild = !s.finished_once && s.options.rebuild_buckets;
  if (rebuild && s.group->rank() == 0) order = s.CompleteReadyOrder();
  order.resize(s.param_sizes.size());
  s.finished_once = true;
  s.ResetIteration();
  if (rebuild) return s.Rebuild(std::move(order));
  return absl::OkStatus();
}

Reducer::NoSyncScope::NoSyncScope(Reducer& reducer)
    : reducer_(reducer), previous_(reducer.state_->no_sync) {
  reducer_.state_->no_sync = true;
}

Reducer::NoSyncScope::~NoSyncScope() { reducer_.state_->no_sync = previous_; }

const std::vector<Reducer::Bucket>& Reducer::buckets() const {
  return state_->buckets;
}

bool Reducer::rebuilt() const { return state_->rebuilt; }

uint64_t Reducer::bytes_communicated() const {
  const std::optional<uint64_t> hook_bytes = state_->hook->bytes_sent();
  return state_->bytes_communicated +
         (hook_bytes.has_value() ? *hook_bytes - state_->hook_bytes_at_create
                                 : 0);
}

size_t Reducer::grad_bytes() const {
  size_t bytes = 0;
  for (const GroupBuffer& bucket : state_->storage) bytes += bucket.bytes();
  bytes += state_->hook->scratch_bytes();
  return bytes;
}

absl::Status BroadcastFromRank0(ProcessGroup& group,
                                absl::Span<const BufferView> tensors,
                                size_t chunk_bytes) {
  if (chunk_bytes == 0) {
    return absl::InvalidArgumentError(
        "BroadcastFromRank0: chunk_bytes must be positive");
  }
  // Checked before the first op so every rank fails alike, with nothing
  // half-sent.
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].data == nullptr && tensors[i].count != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("BroadcastFromRank0: tensor ", i, " has ",
                       tensors[i].count, " elements but no data"));
    }
  }
  // The tensors are in the group's memory (the device's, for NCCL), and so
  // is the buffer they are packed into: the packing copies stay there.
  GroupMemory memory(group.device_memory());
  const bool root = group.rank() == 0;
  GroupBuffer packed;
  size_t packed_bytes = 0;
  std::vector<size_t> members;  // Indices of the tensors in `packed`.

  auto flush = [&]() -> absl::Status {
    if (members.empty()) return absl::OkStatus();
    if (packed.bytes() < packed_bytes) {
      // Sized once for the largest chunk (at most chunk_bytes).
      packed = GroupBuffer();
      absl::StatusOr<GroupBuffer> fresh = memory.Allocate(
          std::min(chunk_bytes, std::max<size_t>(packed_bytes, 1 << 20)));
      if (!fresh.ok()) return fresh.status();
      packed = std::move(*fresh);
    }
    char* base = static_cast<char*>(packed.data());
    absl::Status status;
    if (root) {
      size_t at = 0;
      for (size_t i : members) {
        status = memory.Copy(base + at, tensors[i].data, tensors[i].bytes());
        if (!status.ok()) return status;
        at += tensors[i].bytes();
      }
    }
    status =
        group.Broadcast(BufferView{base, packed_bytes, Dtype::kU8}, 0)->Wait();
    if (status.ok() && !root) {
      size_t at = 0;
      for (size_t i : members) {
        status = memory.Copy(tensors[i].data, base + at, tensors[i].bytes());
        if (!status.ok()) return status;
        at += tensors[i].bytes();
      }
    }
    members.clear();
    packed_bytes = 0;
    return status;
  };

  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t bytes = tensors[i].bytes();
    if (bytes == 0) continue;
    if (bytes > chunk_bytes) {
      // Too big to coalesce: broadcast it in place, saving the copies.
      absl::Status status = flush();
      if (!status.ok()) return status;
      status = group.Broadcast(tensors[i], 0)->Wait();
      if (!status.ok()) return status;
      continue;
    }
    if (packed_bytes + bytes > chunk_bytes) {
      absl::Status status = flush();
      if (!status.ok()) return status;
    }
    members.push_back(i);
    packed_bytes += bytes;
  }
  return flush();
}

}  // namespace cohort
