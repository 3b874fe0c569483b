#include "tests/testing/http_exchange.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace cohort::testing {

std::string HttpExchange(int port, const std::string& request) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof(addr)) ==
      0) {
    (void)!write(fd, request.data(), request.size());
    char buf[65536];
    for (;;) {
      struct pollfd p = {fd, POLLIN, 0};
      if (poll(&p, 1, 10000) <= 0) break;
      ssize_t n = read(fd, buf, sizeof(buf));
      if (n <= 0) break;
      out.append(buf, n);
    }
  }
  close(fd);
  return out;
}

std::string HttpGet(int port, const std::string& path,
                    const std::string& headers) {
  return HttpExchange(port, "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n" +
                                headers + "\r\n");
}

}  // namespace cohort::testing
