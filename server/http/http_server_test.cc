// HttpServer: routing, methods and HEAD without a socket (Answer), then the
// same over real connections; query decoding; busy and bad addresses.
#include "server/http/http_server.h"

#include <string>

#include "gtest/gtest.h"
#include "tests/testing/http_exchange.h"

namespace cohort::server {
namespace {

using ::cohort::testing::HttpExchange;

HttpServerOptions EchoRoutes() {
  HttpServerOptions options;
  options.routes.push_back({"/echo", [](const HttpRequest& r) {
                              HttpResponse response;
                              response.headers.emplace_back("X-Query", r.query);
                              response.body = std::string(r.Header("x-who"));
                              return response;
                            }});
  options.routes.push_back({"/teapot", [](const HttpRequest&) {
                              HttpResponse response;
                              response.status = 418;
                              response.content_type = "application/json";
                              response.body = "{}";
                              return response;
                            }});
  return options;
}

TEST(HttpServerTest, AnswersRoutesMethodsAndUnknownPaths) {
  auto server = HttpServer::Start("127.0.0.1:0", EchoRoutes());
  ASSERT_TRUE(server.ok()) << server.status();
  HttpRequest get{.method = "GET", .path = "/echo", .query = "a=1"};
  get.headers.emplace_back("X-Who", "me");
  HttpResponse r = (*server)->Answer(get);
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "me");
  HttpRequest post = get;
  post.method = "POST";
  r = (*server)->Answer(post);
  EXPECT_EQ(r.status, 405);
  ASSERT_EQ(r.headers.size(), 2u);
  EXPECT_EQ(r.headers[0],
            std::make_pair(std::string("Allow"), std::string("GET, HEAD")));
  HttpRequest missing{.method = "GET", .path = "/nope\n"};
  r = (*server)->Answer(missing);
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(r.body,
            "no such path '/nope\\n' on this server; it serves /echo, "
            "/teapot\n");
}

TEST(HttpServerTest, ServesOverSockets) {
  auto server = HttpServer::Start("127.0.0.1:0", EchoRoutes());
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  std::string response = HttpExchange(
      port, "GET /echo?x=%41 HTTP/1.1\r\nHost: h\r\nX-Who: you\r\n\r\n");
  EXPECT_EQ(response,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; "
            "charset=utf-8\r\nX-Query: x=%41\r\nContent-Length: 3\r\n\r\nyou");
  response = HttpExchange(port, "HEAD /teapot HTTP/1.1\r\nHost: h\r\n\r\n");
  EXPECT_EQ(response,
            "HTTP/1.1 418 I am a teapot\r\nContent-Type: "
            "application/json\r\nContent-Length: 2\r\n\r\n");
  // Percent-decoded and cleaned before routing.
  response = HttpExchange(port, "GET /x/../%65cho HTTP/1.0\r\n\r\n");
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response;
  response = HttpExchange(port, "DELETE /echo HTTP/1.1\r\nHost: h\r\n\r\n");
  EXPECT_NE(response.find("405"), std::string::npos) << response;
  EXPECT_NE(response.find("Allow: GET, HEAD"), std::string::npos);
  // Garbage gets an error, and the server goes on serving.
  HttpExchange(port, "\x01\x02 nonsense\r\n\r\n");
  response = HttpExchange(port, "GET /nope HTTP/1.0\r\n\r\n");
  EXPECT_NE(response.find("404 Not Found"), std::string::npos) << response;
  (*server)->Stop();
  (*server)->Stop();
}

TEST(HttpServerTest, ParsesQueries) {
  auto q = ParseQuery("run=a%2Fb&x=1+2&&flag&e=");
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_EQ(q->size(), 4u);
  EXPECT_EQ((*q)[0], std::make_pair(std::string("run"), std::string("a/b")));
  EXPECT_EQ((*q)[1], std::make_pair(std::string("x"), std::string("1 2")));
  EXPECT_EQ((*q)[2], std::make_pair(std::string("flag"), std::string()));
  EXPECT_EQ((*q)[3], std::make_pair(std::string("e"), std::string()));
  for (const char* bad : {"run=%", "run=%4", "run=%zz", "%g1=x"}) {
    auto s = ParseQuery(bad);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(HttpServerTest, BusyOrBadAddressFailsNamingIt) {
  auto first = HttpServer::Start("127.0.0.1:0", {});
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string taken = "127.0.0.1:" + std::to_string((*first)->port());
  auto busy = HttpServer::Start(taken, {});
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(busy.status().message().find(taken), absl::string_view::npos)
      << busy.status();
  for (const std::string bad :
       {"nonsense", "127.0.0.1:99999", "example.com:9464", "1.2.3.4:80,81"}) {
    auto s = HttpServer::Start(bad, {});
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.status().message().find(bad), absl::string_view::npos);
    EXPECT_NE(s.status().message().find("--metrics_listen"),
              absl::string_view::npos);
  }
}

}  // namespace
}  // namespace cohort::server
