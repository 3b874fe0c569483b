#include "server/status/status_page.h"

#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/text.h"
#include "server/status/json_writer.h"
#include "server/status/status_assets.h"

namespace cohort::server {
namespace {

// The page runs only its own script and style, talks only to cohortd, and
// may not be framed (clickjacking).
constexpr char kPolicy[] =
    "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'";

absl::string_view ContentType(absl::string_view name) {
  if (absl::EndsWith(name, ".html")) return "text/html; charset=utf-8";
  if (absl::EndsWith(name, ".js")) return "text/javascript; charset=utf-8";
  if (absl::EndsWith(name, ".css")) return "text/css; charset=utf-8";
  return "application/octet-stream";
}

void AddCommonHeaders(HttpResponse& response) {
  response.headers.emplace_back("Cache-Control", "no-store");
  response.headers.emplace_back("X-Content-Type-Options", "nosniff");
  response.headers.emplace_back("Referrer-Policy", "no-referrer");
}

HttpResponse AssetResponse(const StatusAsset& asset) {
  HttpResponse response;
  response.content_type = std::string(ContentType(asset.name));
  response.body = std::string(asset.data);
  AddCommonHeaders(response);
  response.headers.emplace_back("Content-Security-Policy", kPolicy);
  return response;
}

// Run and group names: 1 to 512 bytes with no '/' (coordination.proto).
absl::Status CheckRunName(absl::string_view run) {
  if (run.empty() || run.size() > 512 || absl::StrContains(run, '/')) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad run '", base::Escape(run, 64),
                     "': a run id is 1 to 512 bytes with no '/'"));
  }
  return absl::OkStatus();
}

// The run asked for ("" for all), or why the query is refused.
absl::StatusOr<std::string> RunOf(absl::string_view query) {
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> params =
      ParseQuery(query);
  if (!params.ok()) return params.status();
  std::optional<std::string> run;
  for (auto& [name, value] : *params) {
    if (name != "run") {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown parameter '", base::Escape(name, 64),
                       "': /api/status takes only run=RUN"));
    }
    if (run.has_value()) {
      return absl::InvalidArgumentError("run= given twice; give one run");
    }
    if (absl::Status s = CheckRunName(value); !s.ok()) return s;
    run = std::move(value);
  }
  return run.value_or("");
}

}  // namespace

HttpResponse StatusError(int status, absl::string_view message) {
  HttpResponse response;
  response.status = status;
  response.content_type = "application/json";
  JsonWriter w;
  w.BeginObject()
      .Key("error")
      .BeginObject()
      .Field("code", status)
      .Field("message", message)
      .EndObject()
      .EndObject();
  response.body = w.text();
  AddCommonHeaders(response);
  return response;
}

StatusPage::StatusPage(StatusPageOptions options)
    : options_(std::move(options)), reader_(options_.bounds) {}

void StatusPage::Track(StatusSources sources) {
  absl::MutexLock lock(&mu_);
  sources_ = std::move(sources);
}

void StatusPage::Untrack() {
  absl::MutexLock lock(&mu_);
  sources_.reset();
}

std::vector<HttpRoute> StatusPage::Routes() {
  std::vector<HttpRoute> routes;
  for (const StatusAsset& asset : StatusAssets()) {
    const std::string path = asset.name == "index.html"
                                 ? std::string("/")
                                 : absl::StrCat("/", asset.name);
    routes.push_back(
        {path, [asset](const HttpRequest&) { return AssetResponse(asset); }});
  }
  routes.push_back(
      {"/api/status", [this](const HttpRequest& r) { return Api(r); }});
  return routes;
}

std::optional<HttpResponse> StatusPage::Authorize(const StatusSources& sources,
                                                  const HttpRequest& request,
                                                  Grant& viewer) {
  if (sources.auth == nullptr) {
    viewer = Grant{.role = v1::ADMIN, .prefix = "*", .source = "auth off"};
    return std::nullopt;
  }
  const absl::string_view header = request.Header("Authorization");
  std::multimap<grpc::string_ref, grpc::string_ref> metadata;
  if (!header.empty()) {
    metadata.emplace("authorization",
                     grpc::string_ref(header.data(), header.size()));
  }
  // Counted as a gRPC call's token is (cohort_auth_failures_total).
  absl::StatusOr<Grant> grant = sources.auth->Authenticate(metadata);
  if (grant.ok()) {
    viewer = std::move(*grant);
    return std::nullopt;
  }
  HttpResponse refused = StatusError(
      401, header.empty()
               ? "this cohortd runs with auth: send a token (an admin's, or "
                 "one for the run) as \"Authorization: Bearer TOKEN\""
               : absl::StrCat("token refused: ", grant.status().message()));
  refused.headers.emplace_back("WWW-Authenticate", "Bearer realm=\"cohortd\"");
  return refused;
}

HttpResponse StatusPage::Api(const HttpRequest& request) {
  std::optional<StatusSources> sources;
  {
    absl::MutexLock lock(&mu_);
    sources = sources_;
  }
  if (!sources.has_value() || sources->store == nullptr) {
    return StatusError(503, "cohortd is starting or stopping; try again");
  }
  Grant viewer;
  if (std::optional<HttpResponse> refused =
          Authorize(*sources, request, viewer)) {
    return *refused;
  }
  absl::StatusOr<std::string> run = RunOf(request.query);
  if (!run.ok()) return StatusError(400, run.status().message());
  if (!run->empty()) {
    if (absl::Status allowed = CheckAccess(viewer, "run", *run, Access::kRead);
        !allowed.ok()) {
      if (sources->auth != nullptr) sources->auth->Denied(viewer, allowed);
      return StatusError(403, allowed.message());
    }
  }
  absl::StatusOr<StatusView> view = reader_.Read(
      *sources, StatusQuery{.viewer = viewer, .run = *run}, options_.now());
  if (!view.ok()) {
    return StatusError(
        view.status().code() == absl::StatusCode::kNotFound ? 404 : 500,
        view.status().message());
  }
  HttpResponse response;
  response.content_type = "application/json";
  response.body = StatusJson(*view);
  AddCommonHeaders(response);
  return response;
}

}  // namespace cohort::server
