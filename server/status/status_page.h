// StatusPage: cohortd's live status page, served beside /metrics on the
// --metrics_listen port (docs/operating.md, "The status page"):
//   GET /                 the page (HTML; its script and style below)
//   GET /status.js, /status.css
//   GET /api/status[?run=RUN]   the state as JSON (status_view.h), read at
//                         request time; the page polls it every second
//
// The page's files are built into cohortd (status_assets.h) and carry no
// state, so they are served to anyone. /api/status is open with auth off,
// as /metrics is; with auth on it needs "Authorization: Bearer TOKEN": an
// admin token sees everything, any other token only the runs and groups
// its prefix covers (a run's token: its run). Tokens travel only in that
// header, never in a URL, so no access log or proxy records them.
//
// Errors are JSON {"error": {"code", "message"}} with the HTTP status:
// 400 (a bad query or run name), 401 (no token, or one cohortd does not
// accept), 403 (the token does not cover the run asked for), 404 (no such
// run or group), 503 (cohortd starting or stopping).
#ifndef COHORT_SERVER_STATUS_STATUS_PAGE_H_
#define COHORT_SERVER_STATUS_STATUS_PAGE_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "server/auth/auth.h"
#include "server/http/http_server.h"
#include "server/status/status_gather.h"

namespace cohort::server {

struct StatusPageOptions {
  StatusBounds bounds;
  // The clock the view is read at (tests pass their own).
  std::function<absl::Time()> now = absl::Now;
};

class StatusPage {
 public:
  explicit StatusPage(StatusPageOptions options = {});

  StatusPage(const StatusPage&) = delete;
  StatusPage& operator=(const StatusPage&) = delete;

  // Reads `sources` at every request from now on (replacing earlier
  // ones); until then /api/status answers 503. Each must outlive the
  // next Track or Untrack, or the HTTP server (the rendezvous and
  // membership are held by a request that reads them).
  void Track(StatusSources sources);
  void Untrack();

  // The routes to serve (HttpServerOptions::routes). This object must
  // outlive the server.
  std::vector<HttpRoute> Routes();

  // GET /api/status.
  HttpResponse Api(const HttpRequest& request);

 private:
  // The viewer's grant (an admin's with auth off), or the response that
  // refuses it.
  std::optional<HttpResponse> Authorize(const StatusSources& sources,
                                        const HttpRequest& request,
                                        Grant& viewer);

  const StatusPageOptions options_;
  StatusReader reader_;
  absl::Mutex mu_;
  std::optional<StatusSources> sources_ ABSL_GUARDED_BY(mu_);
};

// An error as the API answers it: {"error": {"code", "message"}}.
HttpResponse StatusError(int status, absl::string_view message);

}  // namespace cohort::server

#endif  // COHORT_SERVER_STATUS_STATUS_PAGE_H_
