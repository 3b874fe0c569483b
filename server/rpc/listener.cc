#include "server/rpc/listener.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/net.h"
#include "grpcpp/server_posix.h"

namespace cohort::server {
namespace {

constexpr absl::Duration kLogEvery = absl::Seconds(10);

uint64_t Inode(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return 0;
  return st.st_ino;
}

// An HTTP/2 frame header: 24-bit length, type, flags, stream 0.
void AppendFrameHeader(std::string& out, size_t length, uint8_t type) {
  out.push_back(static_cast<char>((length >> 16) & 0xff));
  out.push_back(static_cast<char>((length >> 8) & 0xff));
  out.push_back(static_cast<char>(length & 0xff));
  out.push_back(static_cast<char>(type));
  out.push_back(0);
  out.append(4, '\0');
}

// A GOAWAY carrying `why`, in place of the server's connection preface: the
// connection never becomes ready, so the client fails the call at once
// (rather than retrying it transparently, as it would a refused stream).
std::string GoawayBytes(absl::string_view why) {
  std::string out;
  AppendFrameHeader(out, 8 + why.size(), /*GOAWAY=*/0x7);
  out.append(4, '\0');                          // Last stream id 0.
  out.append({0, 0, 0, /*REFUSED_STREAM=*/7});  // Error code.
  out.append(why.data(), why.size());
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Listener>> Listener::Bind(
    const std::string& address, ListenerOptions options) {
  absl::StatusOr<base::ListeningSocket> socket = base::ListenExclusive(
      address,
      {.when_in_use = "another process, perhaps another cohortd, serves this "
                      "port"});
  if (!socket.ok()) return socket.status();
  return std::unique_ptr<Listener>(
      new Listener(socket->fd, socket->port, std::move(options)));
}

Listener::Listener(int fd, int port, ListenerOptions options)
    : fd_(fd),
      port_(port),
      options_(std::move(options)),
      own_budget_(
          options_.budget == nullptr
              ? std::make_unique<ConnectionBudget>(options_.max_connections)
              : nullptr),
      budget_(options_.budget != nullptr ? options_.budget : own_budget_.get()),
      log_(options_.log, kLogEvery) {
  // Kept so that, out of fds, one can be freed to accept and close a
  // connection instead of leaving it hanging in the backlog.
  spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

Listener::~Listener() {
  Stop();
  close(fd_);
  if (spare_fd_ >= 0) close(spare_fd_);
}

void Listener::Start(grpc::Server* server) {
  server_ = server;
  budget_->SetReclaimer([this] {
    absl::MutexLock lock(&mu_);
    CountOpen();
  });
  if (pipe2(wake_, O_CLOEXEC) != 0) wake_[0] = wake_[1] = -1;
  thread_ = std::thread([this] { AcceptLoop(); });
}

void Listener::Stop() {
  if (!thread_.joinable()) return;
  budget_->SetReclaimer(nullptr);
  if (wake_[1] >= 0) {
    char c = 0;
    (void)!write(wake_[1], &c, 1);
  }
  shutdown(fd_, SHUT_RDWR);
  thread_.join();
  for (int& p : wake_) {
    if (p >= 0) close(p);
    p = -1;
  }
}

void Listener::AcceptLoop() {
  for (;;) {
    struct pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(fds, wake_[0] >= 0 ? 2 : 1, -1) < 0 && errno != EINTR) return;
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & (POLLERR | POLLHUP | POLLNVAL)) != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        // Free the spare fd to take the connection off the backlog and close
        // it; poll would otherwise report it ready forever.
        if (spare_fd_ >= 0) {
          close(spare_fd_);
          int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
          if (c >= 0) close(c);
          spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
        } else {
          absl::SleepFor(absl::Milliseconds(10));
        }
        log_.Log(absl::StrCat(
            "out of file descriptors (", strerror(errno),
            "): closed a new connection unserved; accepting again as soon as "
            "descriptors are free (raise `ulimit -n`, or lower "
            "--max_connections)"));
      }
      continue;
    }
    bool taken = budget_->TryTake();
    if (!taken) {
      // The reclaimer may have run within kReclaimEvery; gRPC's closes are
      // this listener's own to count at once. (Not under mu_: TryTake may
      // call the reclaimer, which takes it.)
      {
        absl::MutexLock lock(&mu_);
        CountOpen();
      }
      taken = budget_->TryTake();
    }
    if (!taken) {
      Refuse(conn,
             absl::StrCat("cohortd: too many connections (", budget_->max(),
                          " open across its gRPC and TCPStore "
                          "listeners, --max_connections); retry later"));
      continue;
    }
    int one = 1;
    setsockopt(conn, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    base::SetTcpKeepalive(conn, options_.keepalive).IgnoreError();
    absl::ReleasableMutexLock lock(&mu_);
    open_[conn] = Inode(conn);
    lock.Release();
    grpc::AddInsecureChannelFromFd(server_, conn);
  }
}

size_t Listener::CountOpen() {
  size_t closed = 0;
  for (auto it = open_.begin(); it != open_.end();) {
    auto here = it++;
    if (Inode(here->first) != here->second) {
      open_.erase(here);
      ++closed;
    }
  }
  budget_->Give(closed);
  return open_.size();
}

size_t Listener::open_connections() {
  absl::MutexLock lock(&mu_);
  return CountOpen();
}

void Listener::Refuse(int fd, absl::string_view why) {
  const std::string bytes = GoawayBytes(why);
  (void)!write(fd, bytes.data(), bytes.size());
  shutdown(fd, SHUT_WR);
  // Reading what the client sent first lets close() end with FIN rather
  // than a reset that could overtake the GOAWAY.
  char buf[512];
  while (read(fd, buf, sizeof(buf)) > 0) {
  }
  close(fd);
  log_.Log(why);
}

}  // namespace cohort::server
