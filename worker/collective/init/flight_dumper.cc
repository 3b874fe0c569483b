#include "worker/collective/init/flight_dumper.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/connection.h"
#include "client/remote_store.h"
#include "worker/collective/dtype.h"

namespace cohort {
namespace {

constexpr char kWakeSignal = 's';
constexpr char kWakeOther = 'w';

// The write end of the dumper's pipe that SIGUSR1 writes to (-1: none).
std::atomic<int> sigusr1_fd{-1};

void OnSigusr1(int) {
  const int saved = errno;
  const int fd = sigusr1_fd.load(std::memory_order_relaxed);
  if (fd >= 0) {
    // Async-signal-safe; a full pipe already holds a wake-up.
    ssize_t ignored = write(fd, &kWakeSignal, 1);
    (void)ignored;
  }
  errno = saved;
}

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

v1::FlightOp ToProto(const FlightRecord& r) {
  v1::FlightOp op;
  op.set_seq(r.seq);
  op.set_op(std::string(r.op));
  op.set_dtype(std::string(DtypeName(r.dtype)));
  if (r.is_reduction) op.set_reduce(std::string(ReduceOpName(r.reduce)));
  op.set_count(r.count);
  op.set_root(r.root);
  op.set_enqueued_us(r.enqueued_us);
  op.set_started_us(r.started_us);
  op.set_ended_us(r.ended_us);
  op.set_state(std::string(FlightStateName(r.state)));
  op.set_error(r.error);
  return op;
}

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FlightDumper>> FlightDumper::Start(
    std::shared_ptr<Store> store, FlightDumperOptions options) {
  if (options.run.empty()) {
    return absl::InvalidArgumentError("a flight dumper needs a run id");
  }
  int fds[2];
  if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(
        absl::StrCat("flight dumper: pipe2 failed, errno ", errno));
  }
  std::unique_ptr<FlightDumper> dumper(
      new FlightDumper(std::move(store), std::move(options), fds[0], fds[1]));
  // Requests made before this process started are not for it.
  absl::StatusOr<int64_t> current = dumper->catalog_.CurrentRequest();
  if (!current.ok()) return current.status();
  {
    absl::MutexLock lock(&dumper->mu_);
    dumper->request_ = *current;
  }
  FlightDumper* self = dumper.get();
  absl::StatusOr<std::unique_ptr<WatchHandle>> watch =
      dumper->catalog_.WatchRequests([self](int64_t number) {
        {
          absl::MutexLock lock(&self->mu_);
          if (number <= self->request_) return;
          self->request_ = number;
          self->pending_reason_ = "request";
        }
        self->Wake();
      });
  if (!watch.ok()) return watch.status();
  dumper->watch_ = *std::move(watch);
  dumper->thread_ = std::thread([self] { self->Run(); });
  return dumper;
}

FlightDumper* FlightDumper::FromEnv() {
  static FlightDumper* const dumper = []() -> FlightDumper* {
    const std::string address = Env("COHORT_ADDR");
    const std::string run = Env("COHORT_RUN_ID");
    if (address.empty() || run.empty()) return nullptr;
    FlightDumperOptions options;
    options.run = run;
    options.node = Env("COHORT_MEMBER_NAME");
    if (!absl::SimpleAtoi(Env("COHORT_ROUND"), &options.round)) {
      options.round = 0;
    }
    ConnectionOptions connection;  // Token and TLS from the environment.
    connection.address = address;
    connection.connect_timeout = absl::Seconds(10);
    // A failure's dump runs on the failed op's thread: bounded, so that an
    // unreachable cohortd delays the op's error by seconds at most.
    connection.rpc_timeout = absl::Seconds(5);
    connection.max_attempts = 2;
    absl::StatusOr<std::unique_ptr<RemoteStore>> store =
        RemoteStore::Connect(connection);
    absl::StatusOr<std::unique_ptr<FlightDumper>> started =
        store.ok()
            ? Start(std::shared_ptr<Store>(*std::move(store)), options)
            : absl::StatusOr<std::unique_ptr<FlightDumper>>(store.status());
    if (!started.ok()) {
      std::fprintf(stderr,
                   "cohort: no flight dumps for run %s: cannot watch cohortd "
                   "at %s: %s\n",
                   run.c_str(), address.c_str(),
                   started.status().ToString().c_str());
      return nullptr;
    }
    FlightDumper* d = started->release();  // Lives as long as the process.
    if (absl::Status s = d->HandleSigusr1(); !s.ok()) {
      std::fprintf(stderr, "cohort: %s\n", s.ToString().c_str());
    }
    return d;
  }();
  return dumper;
}

FlightDumper::FlightDumper(std::shared_ptr<Store> store,
                           FlightDumperOptions options, int wake_read,
                           int wake_write)
    : store_(std::move(store)),
      catalog_(store_.get(), options.run),
      options_(std::move(options)),
      host_(HostName()),
      wake_read_(wake_read),
      wake_write_(wake_write) {}

FlightDumper::~FlightDumper() {
  if (watch_ != nullptr) watch_->Cancel();
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  Wake();
  if (thread_.joinable()) thread_.join();
  int expected = wake_write_;
  sigusr1_fd.compare_exchange_strong(expected, -1);
  close(wake_read_);
  close(wake_write_);
}

std::string FlightDumper::Add(std::shared_ptr<const FlightRecorder> recorder,
                              FlightGroupInfo info) {
  Group group{recorder, std::move(info)};
  int64_t request;
  {
    absl::MutexLock lock(&mu_);
    const int ordinal = next_group_++;
    if (group.info.name.empty()) group.info.name = absl::StrCat(ordinal);
    groups_.push_back(group);
    request = request_;
  }
  // Where this rank runs, published before anything can go wrong.
  if (absl::Status s = Publish(group, FlightCatalog::kStartReason, request);
      !s.ok()) {
    std::fprintf(stderr, "cohort: flight dump (start) of run %s failed: %s\n",
                 options_.run.c_str(), s.ToString().c_str());
  }
  return group.info.name;
}

void FlightDumper::OnOpFailure(const absl::Status& status) {
  const std::string reason =
      status.code() == absl::StatusCode::kDeadlineExceeded ? "timeout"
                                                           : "failed";
  int64_t request;
  bool coalesced = false;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - last_failure_dump_ < options_.failure_interval) {
      coalesced = true;
      if (!failure_pending_) {
        failure_pending_ = true;
        failure_reason_ = reason;
      }
    } else {
      last_failure_dump_ = now;
    }
    request = request_;
  }
  if (coalesced) {
    Wake();
    return;
  }
  if (absl::Status dumped = DumpAll(reason, request); !dumped.ok()) {
    std::fprintf(stderr, "cohort: flight dump (%s) of run %s failed: %s\n",
                 reason.c_str(), options_.run.c_str(),
                 dumped.ToString().c_str());
  }
}

void FlightDumper::Trigger(std::string reason) {
  {
    absl::MutexLock lock(&mu_);
    pending_reason_ = std::move(reason);
  }
  Wake();
}

absl::Status FlightDumper::HandleSigusr1() {
  int expected = -1;
  if (!sigusr1_fd.compare_exchange_strong(expected, wake_write_)) {
    return absl::FailedPreconditionError(
        "SIGUSR1 already dumps another flight dumper's groups");
  }
  struct sigaction action = {};
  action.sa_handler = OnSigusr1;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  if (sigaction(SIGUSR1, &action, nullptr) != 0) {
    sigusr1_fd.store(-1);
    return absl::InternalError(
        absl::StrCat("sigaction(SIGUSR1) failed, errno ", errno));
  }
  return absl::OkStatus();
}

void FlightDumper::Wake() {
  ssize_t ignored = write(wake_write_, &kWakeOther, 1);
  (void)ignored;
}

int64_t FlightDumper::dumps_published() const {
  absl::MutexLock lock(&mu_);
  return published_;
}

absl::Status FlightDumper::DumpAll(const std::string& reason, int64_t request) {
  std::vector<Group> groups;
  {
    absl::MutexLock lock(&mu_);
    groups = groups_;
  }
  absl::Status first_error;
  for (const Group& g : groups) {
    absl::Status published = Publish(g, reason, request);
    if (!published.ok() && first_error.ok()) first_error = published;
  }
  return first_error;
}

absl::Status FlightDumper::Publish(const Group& g, const std::string& reason,
                                   int64_t request) {
  std::shared_ptr<const FlightRecorder> recorder = g.recorder.lock();
  if (recorder == nullptr) return absl::OkStatus();  // The group is gone.
  {
    v1::FlightDump dump;
    dump.set_run(options_.run);
    dump.set_round(options_.round);
    dump.set_node(options_.node);
    dump.set_request(request);
    dump.set_rank(g.info.rank);
    dump.set_world_size(g.info.world_size);
    dump.set_group(g.info.name);
    dump.set_backend(g.info.backend);
    dump.set_host(host_);
    dump.set_pid(getpid());
    dump.set_reason(reason);
    dump.set_recorded(recorder->recorded());
    for (const FlightRecord& r : recorder->Snapshot()) {
      *dump.add_ops() = ToProto(r);
    }
    dump.set_dumped_us(absl::ToUnixMicros(absl::Now()));
    absl::Status published = catalog_.Publish(dump);
    if (!published.ok()) return published;
  }
  absl::MutexLock lock(&mu_);
  ++published_;
  return absl::OkStatus();
}

void FlightDumper::Run() {
  while (true) {
    pollfd p = {wake_read_, POLLIN, 0};
    if (poll(&p, 1, -1) < 0 && errno != EINTR) return;
    bool signalled = false;
    char bytes[64];
    ssize_t n;
    while ((n = read(wake_read_, bytes, sizeof(bytes))) > 0) {
      for (ssize_t i = 0; i < n; ++i) signalled |= bytes[i] == kWakeSignal;
    }
    bool failure;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      failure = failure_pending_;
    }
    // The rest of a burst of failures lands in one dump.
    if (failure) absl::SleepFor(options_.failure_interval);
    std::string reason;
    int64_t request;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      reason = std::move(pending_reason_);
      pending_reason_.clear();
      if (reason.empty() && failure_pending_) reason = failure_reason_;
      if (reason.empty() && signalled) reason = "signal";
      failure_pending_ = false;
      request = request_;
    }
    if (reason.empty()) continue;
    absl::Status dumped = DumpAll(reason, request);
    if (!dumped.ok()) {
      std::fprintf(stderr, "cohort: flight dump (%s) of run %s failed: %s\n",
                   reason.c_str(), options_.run.c_str(),
                   dumped.ToString().c_str());
    }
  }
}

}  // namespace cohort
