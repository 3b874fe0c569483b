#include "server/listener.h"

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

int MaxBacklog() {
  int backlog = 0;
  if (FILE* f = std::fopen("/proc/sys/net/core/somaxconn", "r")) {
    if (std::fscanf(f, "%d", &backlog) != 1) backlog = 0;
    std::fclose(f);
  }
  return std::max(backlog, 128);
}

absl::StatusOr<int> ListenExclusive(const std::string& address, int* port_out) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address '", address, "' is not HOST:PORT (port 0-65535)"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  struct addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  struct addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(),
                           service.c_str(), &hints, &found);
      rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot resolve listen address '", address, "': ", gai_strerror(rc)));
  }
  // IPv4 first: "localhost" then binds 127.0.0.1, which every client
  // reaches (one over ::1 falls back to it).
  std::vector<struct addrinfo*> candidates;
  for (struct addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    candidates.push_back(ai);
  }
  std::stable_partition(
      candidates.begin(), candidates.end(),
      [](struct addrinfo* ai) { return ai->ai_family == AF_INET; });
  std::string errors;
  int fd = -1;
  for (struct addrinfo* ai : candidates) {
    if (fd >= 0) break;
    int s = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0);
    if (s < 0) continue;
    // SO_REUSEADDR lets a restarted cohortd bind over its predecessor's
    // TIME_WAIT connections; on Linux it never lets two sockets listen on
    // one port. SO_REUSEPORT, which would, stays off.
    int one = 1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(s, ai->ai_addr, ai->ai_addrlen) == 0 &&
        listen(s, MaxBacklog()) == 0) {
      fd = s;
    } else {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", strerror(errno));
      close(s);
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", address, ": ", errors,
        errors.find("in use") != std::string::npos
            ? " (another process, perhaps another cohortd, serves this port)"
            : ""));
  }
  struct sockaddr_storage bound = {};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<struct sockaddr*>(&bound), &len);
  const int bound_port =
      bound.ss_family == AF_INET6
          ? ntohs(reinterpret_cast<struct sockaddr_in6*>(&bound)->sin6_port)
          : ntohs(reinterpret_cast<struct sockaddr_in*>(&bound)->sin_port);
  *port_out = bound_port;
  return fd;
}

absl::StatusOr<std::unique_ptr<Listener>> Listener::Bind(
    const std::string& address, ListenerOptions options) {
  int port = 0;
  absl::StatusOr<int> fd = ListenExclusive(address, &port);
  if (!fd.ok()) return fd.status();
  return std::unique_ptr<Listener>(new Listener(*fd, port, std::move(options)));
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

bool ConnectionBudget::TakeIfFree() {
  size_t used = used_.load(std::memory_order_relaxed);
  while (used < max_) {
    if (used_.compare_exchange_weak(used, used + 1,
                                    std::memory_order_relaxed)) {
      return true;
    }
  }
  return false;
}

bool ConnectionBudget::TryTake() {
  if (TakeIfFree()) return true;
  {
    absl::MutexLock lock(&reclaim_mu_);
    const absl::Time now = absl::Now();
    if (reclaim_ == nullptr || now - last_reclaim_ < kReclaimEvery) {
      return false;
    }
    last_reclaim_ = now;
    reclaim_();
  }
  return TakeIfFree();
}

void ConnectionBudget::SetReclaimer(std::function<void()> reclaim) {
  absl::MutexLock lock(&reclaim_mu_);
  reclaim_ = std::move(reclaim);
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
