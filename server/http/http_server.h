// HttpServer: the plain HTTP/1.1 listener behind --metrics_listen, over
// civetweb (Debian's libcivetweb). It only moves bytes: each request is
// handed whole to a route's handler, a function from an HttpRequest to an
// HttpResponse with no I/O of its own, so what a route answers is
// unit-tested without a socket. Requests are read and answered on a small
// pool of civetweb's threads; every connection closes after its response
// (no keep-alive), so an idle browser tab holds no thread.
#ifndef COHORT_SERVER_HTTP_HTTP_SERVER_H_
#define COHORT_SERVER_HTTP_HTTP_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

struct mg_context;
struct mg_connection;

namespace cohort::server {

struct HttpRequest {
  std::string method;  // "GET", "HEAD", ...
  // The path, percent-decoded and cleaned of "." and ".." segments
  // ("/api/status").
  std::string path;
  std::string query;  // After '?', still percent-encoded; "" when none.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string remote;  // The peer's address, for log lines.

  // The first header named `name` (case-insensitive), or "".
  absl::string_view Header(absl::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  // Sent as they are, after Content-Type and before Content-Length.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

// A path served by a handler; the path matches exactly (no prefixes).
struct HttpRoute {
  std::string path;
  HttpHandler handler;
};

// The answer to a request no route serves: 404 naming the paths that are.
// Also what HttpServer sends for GET and HEAD of an unknown path.
HttpResponse NotFound(const HttpRequest& request,
                      const std::vector<std::string>& paths);

// `value`'s percent-encoding decoded, '+' as a space (a query's form
// encoding); INVALID_ARGUMENT for a '%' not followed by two hex digits.
absl::StatusOr<std::string> DecodeQueryComponent(absl::string_view value);

// The query's NAME=VALUE pairs, decoded, in order; INVALID_ARGUMENT naming
// a malformed one.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseQuery(
    absl::string_view query);

struct HttpServerOptions {
  // Civetweb's worker threads: requests answered at once. Each takes a
  // connection from accept to close.
  int threads = 4;
  std::vector<HttpRoute> routes;
  // The flag the address came from, for errors ("--metrics_listen").
  std::string flag = "--metrics_listen";
};

class HttpServer {
 public:
  // Serves `options.routes` on `address`: "HOST:PORT" with HOST an IPv4
  // address, "[IPv6]:PORT", "localhost:PORT", or ":PORT" for every IPv4
  // interface; port 0 picks a free one (see port()). INVALID_ARGUMENT
  // naming the address and the flag if it does not parse; UNAVAILABLE
  // naming it if it cannot be bound (in use, not local).
  //
  // Methods: GET and HEAD (HEAD answers GET's headers without the body);
  // others get 405 with Allow. An unknown path gets NotFound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const std::string& address, HttpServerOptions options);

  // Stops (Stop).
  ~HttpServer();

  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }

  // Stops accepting and waits for the requests in progress; civetweb's
  // accept loop wakes every 2 s, so this takes up to that long.
  // Idempotent.
  void Stop();

  // What the server answers `request` (routing, methods, HEAD), with no
  // socket: what each connection's thread calls.
  HttpResponse Answer(const HttpRequest& request) const;

 private:
  explicit HttpServer(HttpServerOptions options)
      : options_(std::move(options)) {}
  static int OnRequest(mg_connection* conn);

  const HttpServerOptions options_;
  mg_context* context_ = nullptr;
  int port_ = 0;
};

// "HOST:PORT" in the form civetweb takes ("IPv4:PORT" or "[IPv6]:PORT"),
// or INVALID_ARGUMENT naming `address` and `flag`. civetweb would read
// other forms (a bare port, several comma-separated, an "s" suffix for
// TLS) as more than one address means.
absl::StatusOr<std::string> CivetAddress(const std::string& address,
                                         absl::string_view flag);

}  // namespace cohort::server

#endif  // COHORT_SERVER_HTTP_HTTP_SERVER_H_
