#include "server/rpc/info_service.h"

#include <unistd.h>

#include <utility>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/net.h"
#include "server/rpc/reactors.h"

namespace cohort::server {
namespace {

bool Bracketed(absl::string_view host) {
  return host.size() >= 2 && host.front() == '[' && host.back() == ']';
}

// A host name, IPv4 address or bracketed IPv6 address (with a zone), by
// its characters alone: nothing that could break a HOST:PORT or a log line.
bool PlausibleHost(absl::string_view host) {
  if (host.empty() || host.size() > 255) return false;
  const bool v6 = Bracketed(host);
  if (v6) host = host.substr(1, host.size() - 2);
  if (host.empty()) return false;
  for (char c : host) {
    const bool ok = absl::ascii_isalnum(c) || c == '.' || c == '-' ||
                    c == '_' || (v6 && (c == ':' || c == '%'));
    if (!ok) return false;
  }
  return true;
}

// The host of a gRPC authority ("host:29500", "[::1]:29500", a bare host,
// or several HOST:PORT joined by commas, of which the first counts), kept
// in brackets for IPv6; empty when it names no host a client could dial.
std::string AuthorityHost(absl::string_view authority) {
  authority = authority.substr(0, authority.find(','));
  std::string host;
  if (absl::StartsWith(authority, "[")) {
    const size_t close = authority.find(']');
    if (close == absl::string_view::npos) return "";
    host = std::string(authority.substr(0, close + 1));
  } else if (const size_t colon = authority.find(':');
             colon != absl::string_view::npos &&
             authority.find(':', colon + 1) != absl::string_view::npos) {
    host = absl::StrCat("[", authority, "]");  // IPv6, no port.
  } else {
    host = std::string(authority.substr(0, colon));
  }
  if (!PlausibleHost(host) || base::IsWildcardHost(host)) return "";
  return host;
}

std::string Hostname() {
  char name[256] = "";
  gethostname(name, sizeof(name) - 1);
  return name[0] != '\0' ? name : "localhost";
}

}  // namespace

absl::Status CheckDialAddress(absl::string_view flag,
                              absl::string_view address) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", absl::CHexEscape(address),
                     "\" is not a HOST:PORT clients can dial: ", why));
  };
  if (absl::string_view why =
          base::HostPortProblem(address, {.allow_bare_ipv6 = false});
      !why.empty()) {
    return bad(why);
  }
  // As written: an IPv6 host keeps its brackets.
  const absl::string_view host = address.substr(0, address.rfind(':'));
  if (!PlausibleHost(host)) {
    return bad("the host holds a character no host has");
  }
  if (base::IsWildcardHost(host)) {
    return bad(absl::StrCat(host,
                            " means every interface, which no client can "
                            "dial: give the name or address clients reach "
                            "the listener at"));
  }
  return absl::OkStatus();
}

TcpStoreDialAddress DialTcpStoreAt(absl::string_view bound,
                                   absl::string_view advertise,
                                   absl::string_view authority,
                                   absl::string_view hostname) {
  if (!advertise.empty()) {
    return {std::string(advertise), v1::TcpStoreListener::ADVERTISED};
  }
  absl::StatusOr<base::HostPort> split = base::SplitHostPort(
      bound, {.allow_empty_host = true, .allow_port_zero = true});
  if (!split.ok() || !base::IsWildcardHost(split->host)) {
    return {std::string(bound), v1::TcpStoreListener::BOUND};
  }
  const int port = split->port;
  if (std::string caller = AuthorityHost(authority); !caller.empty()) {
    return {absl::StrCat(caller, ":", port), v1::TcpStoreListener::CALLER_HOST};
  }
  return {base::JoinHostPort(hostname, port), v1::TcpStoreListener::HOSTNAME};
}

std::string NewServerId() {
  absl::BitGen random;
  return absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(random),
                         absl::Uniform<uint64_t>(random));
}

InfoService::InfoService(InfoServiceOptions options)
    : options_([&] {
        if (options.server_id.empty()) options.server_id = NewServerId();
        if (options.hostname.empty()) options.hostname = Hostname();
        return std::move(options);
      }()) {}

void InfoService::SetTcpStoreBound(std::string bound) {
  absl::MutexLock lock(&mu_);
  tcpstore_bound_ = std::move(bound);
}

v1::ServerInfo InfoService::Describe(absl::string_view authority) const {
  v1::ServerInfo info;
  info.set_version(kCohortVersion);
  info.set_engine(options_.engine);
  info.set_server_id(options_.server_id);
  std::string bound;
  {
    absl::MutexLock lock(&mu_);
    bound = tcpstore_bound_;
  }
  if (bound.empty()) return info;
  v1::TcpStoreListener* tcpstore = info.mutable_tcpstore();
  TcpStoreDialAddress dial = DialTcpStoreAt(bound, options_.tcpstore_advertise,
                                            authority, options_.hostname);
  tcpstore->set_address(std::move(dial.address));
  tcpstore->set_source(dial.source);
  tcpstore->set_bound(std::move(bound));
  tcpstore->set_prefix(options_.tcpstore_prefix);
  tcpstore->set_token_required(options_.tcpstore_token_required);
  return info;
}

grpc::ServerUnaryReactor* InfoService::GetServerInfo(
    grpc::CallbackServerContext* ctx, const v1::GetServerInfoRequest*,
    v1::ServerInfo* resp) {
  if (options_.auth != nullptr) {
    absl::StatusOr<Grant> grant =
        options_.auth->Authenticate(ctx->client_metadata());
    if (!grant.ok()) return FinishNow(ctx, grant.status());
  }
  const grpc::string_ref authority = ctx->ExperimentalGetAuthority();
  *resp = Describe(absl::string_view(authority.data(), authority.size()));
  return FinishNow(ctx, absl::OkStatus());
}

}  // namespace cohort::server
