// loopback_rtt: this machine's TCP round trip over 127.0.0.1, the floor
// under every store call that waits for a reply (TcpStoreClient's, torch's
// TCPStore client's, gRPC's). One side writes 1 byte, the other echoes it,
// both with TCP_NODELAY and blocking reads; every round trip is timed.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

ABSL_FLAG(int, rounds, 100000, "timed round trips");
ABSL_FLAG(int, warmup, 2000, "untimed round trips first");
ABSL_FLAG(bool, processes, false,
          "echo from a forked process instead of a thread");

namespace {

bool ReadByte(int fd, char* c) { return read(fd, c, 1) == 1; }
bool WriteByte(int fd, char c) { return write(fd, &c, 1) == 1; }

void NoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Echoes every byte until the peer closes.
void Echo(int fd) {
  char c;
  while (ReadByte(fd, &c) && WriteByte(fd, c)) {
  }
  close(fd);
}

int Run() {
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  if (rounds < 1 || warmup < 0) {
    std::fprintf(stderr, "loopback_rtt: --rounds must be >= 1\n");
    return 1;
  }
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("loopback_rtt: listen on 127.0.0.1");
    return 1;
  }
  int client = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    std::perror("loopback_rtt: connect");
    return 1;
  }
  int server = accept(listener, nullptr, nullptr);
  close(listener);
  NoDelay(client);
  NoDelay(server);

  std::thread echo_thread;
  pid_t echo_pid = -1;
  if (absl::GetFlag(FLAGS_processes)) {
    echo_pid = fork();
    if (echo_pid == 0) {
      close(client);
      Echo(server);
      _exit(0);
    }
    close(server);
  } else {
    echo_thread = std::thread(Echo, server);
  }

  std::vector<absl::Duration> samples;
  samples.reserve(rounds);
  char c = 'x';
  for (int i = 0; i < warmup + rounds; ++i) {
    const absl::Time t0 = absl::Now();
    if (!WriteByte(client, c) || !ReadByte(client, &c)) {
      std::perror("loopback_rtt: ping-pong");
      return 1;
    }
    if (i >= warmup) samples.push_back(absl::Now() - t0);
  }
  close(client);
  if (echo_thread.joinable()) echo_thread.join();
  if (echo_pid > 0) waitpid(echo_pid, nullptr, 0);

  absl::Duration total;
  for (absl::Duration d : samples) total += d;
  std::sort(samples.begin(), samples.end());
  auto at = [&](double q) {
    const size_t i =
        std::min(samples.size() - 1, static_cast<size_t>(q * samples.size()));
    return absl::ToDoubleMicroseconds(samples[i]);
  };
  absl::PrintF(
      "loopback_rtt echo=%s rounds=%d median_us=%.1f p99_us=%.1f "
      "min_us=%.1f round_trips_per_s=%.0f\n",
      echo_pid > 0 ? "process" : "thread", rounds, at(0.5), at(0.99), at(0),
      rounds / absl::ToDoubleSeconds(total));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "loopback_rtt [--rounds=100000] [--processes]\n"
      "Times 1-byte TCP ping-pongs over 127.0.0.1 (TCP_NODELAY, blocking).");
  absl::ParseCommandLine(argc, argv);
  return Run();
}
