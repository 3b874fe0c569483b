#include "client/connection.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "base/grpc_status.h"
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

// What answers at HOST:PORT, told from its first bytes after an HTTP/2
// client preface: a plaintext gRPC server answers with an HTTP/2 frame, a
// TLS server with an alert record or by closing.
enum class Peer { kUnreachable, kPlaintext, kTls, kUnknown };

Peer ProbePeer(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[') {
    host = host.substr(1, host.size() - 2);
  }
  const std::string port = address.substr(colon + 1);
  addrinfo hints = {};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0) {
    return Peer::kUnreachable;
  }
  Peer peer = Peer::kUnreachable;
  for (addrinfo* a = found; a != nullptr && peer == Peer::kUnreachable;
       a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    timeval timeout = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      static constexpr char kPreface[] =
          "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
      unsigned char reply[9];
      ssize_t got = -1;
      if (send(fd, kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL) > 0) {
        got = recv(fd, reply, sizeof(reply), MSG_WAITALL);
      }
      if (got >= 4 && (reply[3] == 0x04 || reply[3] == 0x07)) {
        peer = Peer::kPlaintext;  // SETTINGS or GOAWAY.
      } else if ((got >= 1 && (reply[0] == 0x15 || reply[0] == 0x16)) ||
                 got == 0 || (got < 0 && errno == ECONNRESET)) {
        peer = Peer::kTls;
      } else {
        peer = Peer::kUnknown;
      }
    }
    close(fd);
  }
  freeaddrinfo(found);
  return peer;
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

absl::Status Connection::DiagnoseHandshake() const {
  const bool tls =
      !options_.tls_ca_file.empty() || !options_.tls_cert_file.empty();
  const Peer peer = ProbePeer(options_.address);
  if (!tls && peer == Peer::kTls) {
    return absl::UnavailableError(absl::StrCat(
        "cohortd at ", options_.address,
        " accepts connections but answers in TLS, and this client speaks "
        "plaintext: set COHORT_TLS_CA (--tls_ca) to the CA that signed "
        "cohortd's certificate"));
  }
  if (tls && peer == Peer::kPlaintext) {
    return absl::UnavailableError(absl::StrCat(
        "cohortd at ", options_.address,
        " serves plaintext, and this client asks for TLS (COHORT_TLS_CA or "
        "--tls_ca is set): start cohortd with --tls_cert and --tls_key, or "
        "unset COHORT_TLS_CA"));
  }
  if (tls && peer == Peer::kTls) {
    return absl::UnavailableError(absl::StrCat(
        "the TLS handshake with cohortd at ", options_.address,
        " fails: check that ", options_.tls_ca_file,
        " (COHORT_TLS_CA) is the CA that signed cohortd's certificate, that "
        "the certificate is valid now and names the host you connect to "
        "(else set COHORT_TLS_SERVER_NAME), and, if cohortd requires client "
        "certificates (--tls_client_ca), that COHORT_TLS_CERT and "
        "COHORT_TLS_KEY hold one signed by that CA"));
  }
  return absl::OkStatus();
}

absl::Status Connection::WaitConnected() {
  if (channel_->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY) {
    return absl::OkStatus();
  }
  // A handshake that fails fails the same way every time: once the channel
  // has been failing for a while, look at what answers the port, and say
  // so rather than wait out connect_timeout.
  constexpr absl::Duration kDiagnoseEvery = absl::Milliseconds(500);
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  absl::Time next_diagnosis = absl::Now() + kDiagnoseEvery;
  while (absl::Now() < deadline) {
    if (channel_->WaitForConnected(
            absl::ToChronoTime(std::min(deadline, next_diagnosis)))) {
      return absl::OkStatus();
    }
    if (absl::Now() >= next_diagnosis) {
      next_diagnosis = absl::Now() + kDiagnoseEvery;
      if (channel_->GetState(false) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
        if (absl::Status why = DiagnoseHandshake(); !why.ok()) return why;
      }
    }
  }
  return absl::UnavailableError(
      absl::StrCat("cannot connect to cohortd at ", options_.address,
                   " within ", absl::FormatDuration(options_.connect_timeout),
                   ": is it running there? (set --addr or COHORT_ADDR)"));
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
