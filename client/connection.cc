#include "client/connection.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "proto/rpc/grpc_status.h"
#include "client/peer_probe.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace cohort {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path,
                                     absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in || text.str().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot read ", what, " ", path,
        in ? ": it is empty" : absl::StrCat(": ", std::strerror(errno))));
  }
  return text.str();
}

// How long a probe waits for the peer's first bytes: long enough for a
// loaded cohortd to answer, a small part of what the caller waits in all.
absl::Duration ProbeWait(absl::Duration connect_timeout) {
  return std::clamp(connect_timeout / 4, absl::Milliseconds(250),
                    absl::Seconds(2));
}

// Why a channel to cohortd does not become ready, as an error that says
// what to do: `final` when waiting cannot help (the two sides speak
// different protocols, or something else answers), and the error is
// returned at once; otherwise it is what the caller hears once its connect
// timeout has passed, the part after "cannot connect to cohortd at X
// within T: ".
struct Diagnosis {
  absl::Status status;
  bool final = false;
};

Diagnosis Final(std::string message) {
  return {absl::UnavailableError(std::move(message)), true};
}
Diagnosis Transient(std::string message) {
  return {absl::UnavailableError(std::move(message)), false};
}

// Peer-controlled text for a message: escaped, and cut.
std::string Shown(absl::string_view text) {
  constexpr size_t kMax = 200;
  return absl::StrCat("\"", absl::CHexEscape(text.substr(0, kMax)),
                      text.size() > kMax ? "..." : "", "\"");
}

Diagnosis Explain(const std::string& address, const PeerAnswer& peer, bool tls,
                  const std::string& tls_ca_file) {
  switch (peer.kind) {
    case PeerKind::kTls:
      if (!tls) {
        return Final(absl::StrCat(
            "cohortd at ", address,
            " accepts connections but answers in TLS, and this client speaks "
            "plaintext: set COHORT_TLS_CA (--tls_ca) to the CA that signed "
            "cohortd's certificate"));
      }
      return Final(absl::StrCat(
          "the TLS handshake with cohortd at ", address, " fails: check that ",
          tls_ca_file,
          " (COHORT_TLS_CA) is the CA that signed cohortd's certificate, that "
          "the certificate is valid now and names the host you connect to "
          "(else set COHORT_TLS_SERVER_NAME), and, if cohortd requires client "
          "certificates (--tls_client_ca), that COHORT_TLS_CERT and "
          "COHORT_TLS_KEY hold one signed by that CA"));
    case PeerKind::kHttp2:
      if (tls) {
        return Final(absl::StrCat(
            "cohortd at ", address,
            " serves plaintext, and this client asks for TLS (COHORT_TLS_CA "
            "or --tls_ca is set): start cohortd with --tls_cert and "
            "--tls_key, or unset COHORT_TLS_CA"));
      }
      return Transient(
          "it answers HTTP/2 in plaintext, as cohortd does, but too slowly "
          "for a connection to become ready: it is likely overloaded; retry, "
          "or allow a longer connect timeout (cohortctl --connect_timeout)");
    case PeerKind::kGoaway:
      return Transient(absl::StrCat(
          "it turns new connections away with an HTTP/2 GOAWAY",
          peer.detail.empty() ? " that gives no reason"
                              : absl::StrCat(" saying ", Shown(peer.detail)),
          ": retry later; cohortd does this at its connection limit "
          "(--max_connections), so close idle clients or raise "
          "--max_connections (within its `ulimit -n`)"));
    case PeerKind::kSilent:
      return Transient(
          "it accepts TCP connections but never answers on them. Usually "
          "cohortd is out of file descriptors or connections and has "
          "stopped accepting (look in its log for 'Too many open files' or "
          "'too many connections'; then raise its `ulimit -n`, lower "
          "--max_connections, or close idle clients), or it is overloaded, "
          "or this is not cohortd's gRPC port (--listen; its "
          "--tcpstore_listen port speaks another protocol)");
    case PeerKind::kClosed:
      return Transient(
          "it accepts TCP connections and closes them at once, without a "
          "byte: cohortd does this when it is out of file descriptors (its "
          "log says 'out of file descriptors (Too many open files)'), so "
          "raise its `ulimit -n`, lower --max_connections, or close idle "
          "clients; otherwise this is not cohortd's gRPC port (set --addr "
          "or COHORT_ADDR to its --listen address)");
    case PeerKind::kOther:
      return Final(absl::StrCat(
          "something other than cohortd answers at ", address,
          ": its first bytes, ", Shown(peer.detail),
          ", are neither HTTP/2 nor TLS: set --addr or COHORT_ADDR to "
          "cohortd's --listen address"));
    case PeerKind::kConnectTimedOut:
      return Transient(
          "TCP connections to it get no answer: the host is down, a firewall "
          "drops them, or a process listens there but has stopped accepting "
          "and its backlog is full (cohortd out of file descriptors: look in "
          "its log for 'Too many open files')");
    case PeerKind::kUnreachable:
      break;
  }
  return Transient(
      absl::StrCat(peer.detail.empty() ? "" : absl::StrCat(peer.detail, ": "),
                   "is it running there? (set --addr or COHORT_ADDR)"));
}

// What answers at each address the channel may use (replicas: several);
// the first that accepts TCP connections speaks for all.
Diagnosis Diagnose(const ConnectionOptions& options) {
  const bool tls =
      !options.tls_ca_file.empty() || !options.tls_cert_file.empty();
  const std::vector<std::string> addresses =
      absl::StrSplit(options.address, ',', absl::SkipWhitespace());
  std::optional<Diagnosis> first;
  for (const std::string& address : addresses) {
    const PeerAnswer peer =
        ProbePeer(address, ProbeWait(options.connect_timeout));
    Diagnosis diagnosis = Explain(address, peer, tls, options.tls_ca_file);
    if (!diagnosis.final && addresses.size() > 1) {
      diagnosis.status = absl::UnavailableError(
          absl::StrCat(address, ": ", diagnosis.status.message()));
    }
    if (peer.kind != PeerKind::kUnreachable &&
        peer.kind != PeerKind::kConnectTimedOut) {
      return diagnosis;
    }
    if (!first.has_value()) first = std::move(diagnosis);
  }
  if (!first.has_value()) return Transient("no address to connect to");
  return *std::move(first);
}

}  // namespace

absl::StatusOr<std::string> ReadTokenFile(const std::string& path,
                                          absl::string_view what) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  absl::string_view token = absl::StripAsciiWhitespace(line);
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read a token from the first line of ", what, " ",
                     path, in ? "" : absl::StrCat(": ", std::strerror(errno))));
  }
  return std::string(token);
}

absl::StatusOr<ConnectionOptions> WithEnvironmentCredentials(
    ConnectionOptions options) {
  auto fill = [](std::string& field, const char* variable) {
    if (!field.empty()) return;
    if (const char* value = std::getenv(variable)) field = value;
  };
  fill(options.token, "COHORT_TOKEN");
  if (options.token.empty()) {
    if (const char* file = std::getenv("COHORT_TOKEN_FILE");
        file != nullptr && *file != '\0') {
      absl::StatusOr<std::string> token =
          ReadTokenFile(file, "$COHORT_TOKEN_FILE");
      if (!token.ok()) return token.status();
      options.token = *std::move(token);
    }
  }
  fill(options.tls_ca_file, "COHORT_TLS_CA");
  fill(options.tls_cert_file, "COHORT_TLS_CERT");
  fill(options.tls_key_file, "COHORT_TLS_KEY");
  fill(options.tls_server_name, "COHORT_TLS_SERVER_NAME");
  return options;
}

absl::StatusOr<std::shared_ptr<Connection>> Connection::Open(
    const ConnectionOptions& options) {
  if (options.address.empty() ||
      options.address.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cohortd address must be HOST:PORT, got '", options.address, "'"));
  }
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError("max_attempts must be >= 1");
  }
  ConnectionOptions resolved = options;
  if (options.credentials_from_env) {
    absl::StatusOr<ConnectionOptions> filled =
        WithEnvironmentCredentials(options);
    if (!filled.ok()) return filled.status();
    resolved = std::move(*filled);
  }
  if (resolved.tls_cert_file.empty() != resolved.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "a client certificate and its key go together: set both "
        "COHORT_TLS_CERT and COHORT_TLS_KEY (--tls_cert, --tls_key) or "
        "neither");
  }
  for (char c : resolved.token) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(
          "the token (COHORT_TOKEN) holds blanks or non-printable "
          "characters: tokens are printable ASCII");
    }
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  if (!resolved.tls_ca_file.empty() || !resolved.tls_cert_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    if (!resolved.tls_ca_file.empty()) {
      absl::StatusOr<std::string> ca =
          ReadFile(resolved.tls_ca_file, "the TLS CA (COHORT_TLS_CA)");
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = std::move(*ca);
    }
    if (!resolved.tls_cert_file.empty()) {
      absl::StatusOr<std::string> cert = ReadFile(
          resolved.tls_cert_file, "the client certificate (COHORT_TLS_CERT)");
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadFile(
          resolved.tls_key_file, "the client key (COHORT_TLS_KEY)");
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = std::move(*cert);
      ssl.pem_private_key = std::move(*key);
    }
    credentials = grpc::SslCredentials(ssl);
  }
  return std::shared_ptr<Connection>(
      new Connection(resolved, std::move(credentials)));
}

Connection::Connection(const ConnectionOptions& options,
                       std::shared_ptr<grpc::ChannelCredentials> credentials)
    : options_(options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // Each connection is a TCP connection of its own rather than one shared
  // with every other channel to the same address in the process.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Reconnect quickly after a cohortd restart.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // After a failed connection gRPC re-resolves the address, by default at
  // most every 30 s; a restarted cohortd must not wait on that.
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 500);
  base::UseTcpKeepalive(options.keepalive, &args);
  if (!options.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  // Several replicas, "HOST:PORT,HOST:PORT,...": one channel over all of
  // them, which moves to the next when the one it uses goes away (gRPC's
  // pick_first over a static list). A DNS name with several records does
  // the same through the resolver.
  std::string target = options.address;
  if (target.find(',') != std::string::npos) {
    target = absl::StrCat("ipv4:", target);
  }
  channel_ = grpc::CreateCustomChannel(target, credentials, args);
}

void Connection::Prepare(grpc::ClientContext* context) const {
  if (!options_.token.empty()) {
    context->AddMetadata("authorization",
                         absl::StrCat("Bearer ", options_.token));
  }
}

absl::Status Connection::WaitConnected() {
  if (channel_->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) {
    return absl::OkStatus();
  }
  // A handshake that fails fails the same way every time: once the channel
  // has been failing for a while, look at what answers the port, and say
  // so rather than wait out connect_timeout. What waiting can mend (cohortd
  // full, or out of descriptors) is looked at less and less often, since
  // each look costs that cohortd two more connections.
  constexpr absl::Duration kFirstDiagnosis = absl::Milliseconds(500);
  constexpr absl::Duration kMaxDiagnoseEvery = absl::Seconds(8);
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  absl::Duration diagnose_every = kFirstDiagnosis;
  absl::Time next_diagnosis = absl::Now() + diagnose_every;
  while (absl::Now() < deadline) {
    if (channel_->WaitForConnected(
            absl::ToChronoTime(std::min(deadline, next_diagnosis)))) {
      return absl::OkStatus();
    }
    if (absl::Now() < next_diagnosis) continue;
    if (channel_->GetState(false) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
      Diagnosis why = Diagnose(options_);
      if (why.final) return why.status;
      diagnose_every = std::min(diagnose_every * 2, kMaxDiagnoseEvery);
    }
    next_diagnosis = absl::Now() + diagnose_every;
  }
  // Out of time: say what answers there now (a channel still connecting
  // may be talking to a peer that never answers).
  Diagnosis why = Diagnose(options_);
  if (why.final) return why.status;
  return absl::UnavailableError(
      absl::StrCat("cannot connect to cohortd at ", options_.address,
                   " within ", absl::FormatDuration(options_.connect_timeout),
                   ": ", why.status.message()));
}

absl::Status Connection::Explain(absl::string_view what,
                                 const grpc::Status& status,
                                 int attempts) const {
  std::string message = status.error_message();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    message = absl::StrCat("cohortd at ", options_.address, " is unavailable (",
                           attempts, attempts == 1 ? " attempt" : " attempts",
                           "): ", message);
  } else if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
             message == "Deadline Exceeded") {
    message = absl::StrCat("no answer from cohortd at ", options_.address,
                           " before the call's deadline");
  }
  return base::FromGrpcStatus(
      grpc::Status(status.error_code(), std::move(message)), what);
}

absl::Duration Connection::Backoff(absl::Duration backoff) const {
  thread_local std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<double> jitter(0.5, 1.0);
  absl::SleepFor(backoff * jitter(rng));
  return std::min(backoff * 2, options_.max_backoff);
}

}  // namespace cohort
