#include "server/http/http_server.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/net.h"
#include "base/text.h"
#include "civetweb.h"

namespace cohort::server {
namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  c = absl::ascii_tolower(c);
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

void Write(mg_connection* conn, const HttpRequest& request,
           const HttpResponse& response) {
  std::string head =
      absl::StrCat("HTTP/1.1 ", response.status, " ",
                   mg_get_response_code_text(conn, response.status),
                   "\r\nContent-Type: ", response.content_type, "\r\n");
  for (const auto& [name, value] : response.headers) {
    absl::StrAppend(&head, name, ": ", value, "\r\n");
  }
  absl::StrAppend(&head, "Content-Length: ", response.body.size(), "\r\n\r\n");
  mg_write(conn, head.data(), head.size());
  if (request.method != "HEAD" && !response.body.empty()) {
    mg_write(conn, response.body.data(), response.body.size());
  }
}

}  // namespace

absl::string_view HttpRequest::Header(absl::string_view name) const {
  for (const auto& [n, value] : headers) {
    if (absl::EqualsIgnoreCase(n, name)) return value;
  }
  return "";
}

HttpResponse NotFound(const HttpRequest& request,
                      const std::vector<std::string>& paths) {
  HttpResponse response;
  response.status = 404;
  response.headers.emplace_back("X-Content-Type-Options", "nosniff");
  response.body = absl::StrCat(
      "no such path '", base::Escape(request.path, 256),
      "' on this server; it serves ", absl::StrJoin(paths, ", "), "\n");
  return response;
}

absl::StatusOr<std::string> DecodeQueryComponent(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (size_t i = 0; i < value.size(); ++i) {
    const char c = value[i];
    if (c == '+') {
      out.push_back(' ');
    } else if (c != '%') {
      out.push_back(c);
    } else {
      const int hi = i + 1 < value.size() ? HexDigit(value[i + 1]) : -1;
      const int lo = i + 2 < value.size() ? HexDigit(value[i + 2]) : -1;
      if (hi < 0 || lo < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "bad percent-encoding at byte ", i, " of '",
            base::Escape(value, 128), "' (want %XX, two hex digits)"));
      }
      out.push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    }
  }
  return out;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseQuery(
    absl::string_view query) {
  std::vector<std::pair<std::string, std::string>> out;
  for (absl::string_view part : absl::StrSplit(query, '&', absl::SkipEmpty())) {
    const size_t eq = part.find('=');
    absl::StatusOr<std::string> name = DecodeQueryComponent(part.substr(0, eq));
    if (!name.ok()) return name.status();
    absl::StatusOr<std::string> value = DecodeQueryComponent(
        eq == absl::string_view::npos ? absl::string_view()
                                      : part.substr(eq + 1));
    if (!value.ok()) return value.status();
    out.emplace_back(std::move(*name), std::move(*value));
  }
  return out;
}

absl::StatusOr<std::string> CivetAddress(const std::string& address,
                                         absl::string_view flag) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad ", flag, " address '", address, "': ", why,
                     " (want HOST:PORT, [IPv6]:PORT or :PORT)"));
  };
  const base::HostPortRules rules = {.allow_empty_host = true,
                                     .allow_port_zero = true,
                                     .allow_bare_ipv6 = false};
  absl::StatusOr<base::HostPort> where = base::SplitHostPort(address, rules);
  if (!where.ok()) return bad(base::HostPortProblem(address, rules));
  std::string host = where->host;
  if (host.empty()) host = "0.0.0.0";
  if (host == "localhost") host = "127.0.0.1";
  unsigned char buf[16];
  if (absl::StrContains(host, ':')) {
    if (inet_pton(AF_INET6, host.c_str(), buf) != 1) {
      return bad("not an IPv6 address");
    }
  } else if (inet_pton(AF_INET, host.c_str(), buf) != 1) {
    return bad("the host must be an IP address or localhost");
  }
  return base::JoinHostPort(host, where->port);
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const std::string& address, HttpServerOptions options) {
  absl::StatusOr<std::string> civet = CivetAddress(address, options.flag);
  if (!civet.ok()) return civet.status();
  const std::string threads = std::to_string(std::max(1, options.threads));
  std::unique_ptr<HttpServer> server(new HttpServer(std::move(options)));
  // A client that sends nothing for 10 s gives its thread back: a stalled
  // or hostile one cannot hold the few threads for long.
  // clang-format off
  const char* config[] = {"listening_ports", civet->c_str(),
                          "num_threads", threads.c_str(),
                          "request_timeout_ms", "10000",
                          nullptr};
  // clang-format on
  mg_callbacks callbacks = {};
  callbacks.begin_request = &HttpServer::OnRequest;
  mg_init_data init = {};
  init.callbacks = &callbacks;
  init.user_data = server.get();
  init.configuration_options = config;
  unsigned code = 0;
  char text[256] = {};
  mg_error_data error = {};
  error.code = &code;
  error.text = text;
  error.text_buffer_size = sizeof(text);
  server->context_ = mg_start2(&init, &error);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve HTTP on ", address, " (", server->options_.flag,
        "): ", text[0] != 0 ? text : "civetweb did not start",
        " (is the port in use, or the address not this "
        "machine's?)"));
  }
  mg_server_port ports[4] = {};
  if (mg_get_server_ports(server->context_, 4, ports) > 0) {
    server->port_ = ports[0].port;
  }
  return server;
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
  if (context_ == nullptr) return;
  mg_stop(context_);
  context_ = nullptr;
}

HttpResponse HttpServer::Answer(const HttpRequest& request) const {
  if (request.method != "GET" && request.method != "HEAD") {
    HttpResponse response;
    response.status = 405;
    response.headers.emplace_back("Allow", "GET, HEAD");
    response.headers.emplace_back("X-Content-Type-Options", "nosniff");
    response.body = absl::StrCat("method '", base::Escape(request.method, 32),
                                 "' is not served here; use GET (or HEAD)\n");
    return response;
  }
  for (const HttpRoute& route : options_.routes) {
    if (route.path == request.path) return route.handler(request);
  }
  std::vector<std::string> paths;
  for (const HttpRoute& route : options_.routes) paths.push_back(route.path);
  return NotFound(request, paths);
}

int HttpServer::OnRequest(mg_connection* conn) {
  const mg_request_info* info = mg_get_request_info(conn);
  const auto* self = static_cast<const HttpServer*>(info->user_data);
  HttpRequest request;
  request.method = info->request_method != nullptr ? info->request_method : "";
  request.query = info->query_string != nullptr ? info->query_string : "";
  request.remote = info->remote_addr;
  for (int i = 0; i < info->num_headers; ++i) {
    request.headers.emplace_back(info->http_headers[i].name,
                                 info->http_headers[i].value);
  }
  HttpResponse response;
  if (info->local_uri == nullptr) {
    response.status = 400;
    response.body =
        "the request's target is not a path on this server (send "
        "GET /path)\n";
  } else {
    request.path = info->local_uri;
    response = self->Answer(request);
  }
  Write(conn, request, response);
  return response.status;
}

}  // namespace cohort::server
