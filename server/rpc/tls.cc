#include "server/rpc/tls.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace cohort::server {
namespace {

std::string OpenSslError() {
  unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "no PEM data found";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<FILE, FileCloser>;

absl::StatusOr<File> OpenFile(const std::string& path, const char* flag) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot read ", flag, " ", path, ": ", std::strerror(errno)));
  }
  return File(f);
}

absl::Time AsTime(const ASN1_TIME* t) {
  struct tm tm = {};
  if (ASN1_TIME_to_tm(t, &tm) != 1) return absl::InfinitePast();
  return absl::FromTM(tm, absl::UTCTimeZone());
}

std::string Format(absl::Time t) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", t, absl::UTCTimeZone());
}

}  // namespace

absl::StatusOr<TlsFilesInfo> CheckTlsFiles(const TlsOptions& options) {
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key go together: give both or neither");
  }
  if (!options.enabled() && !options.client_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca needs --tls_cert and --tls_key: client "
        "certificates are checked in a TLS handshake");
  }
  TlsFilesInfo info;
  absl::StatusOr<File> cert_file = OpenFile(options.cert_file, "--tls_cert");
  if (!cert_file.ok()) return cert_file.status();
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_X509(cert_file->get(), nullptr, nullptr, nullptr), X509_free);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert ", options.cert_file,
                     " holds no PEM certificate: ", OpenSslError()));
  }
  absl::StatusOr<File> key_file = OpenFile(options.key_file, "--tls_key");
  if (!key_file.ok()) return key_file.status();
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_PrivateKey(key_file->get(), nullptr, nullptr, nullptr),
      EVP_PKEY_free);
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key ", options.key_file,
        " holds no unencrypted PEM private key: ", OpenSslError()));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key ", options.key_file,
                     " is not the key of the certificate in --tls_cert ",
                     options.cert_file));
  }
  const absl::Time now = absl::Now();
  const absl::Time not_before = AsTime(X509_get0_notBefore(cert.get()));
  info.not_after = AsTime(X509_get0_notAfter(cert.get()));
  if (now < not_before) {
    return absl::FailedPreconditionError(
        absl::StrCat("the certificate in --tls_cert ", options.cert_file,
                     " is not valid before ", Format(not_before)));
  }
  if (now > info.not_after) {
    return absl::FailedPreconditionError(
        absl::StrCat("the certificate in --tls_cert ", options.cert_file,
                     " expired at ", Format(info.not_after)));
  }
  char subject[256];
  X509_NAME_oneline(X509_get_subject_name(cert.get()), subject,
                    sizeof(subject));
  info.subject = subject;
  if (!options.client_ca_file.empty()) {
    absl::StatusOr<File> ca_file =
        OpenFile(options.client_ca_file, "--tls_client_ca");
    if (!ca_file.ok()) return ca_file.status();
    for (;;) {
      X509* ca = PEM_read_X509(ca_file->get(), nullptr, nullptr, nullptr);
      if (ca == nullptr) break;
      ++info.client_cas;
      X509_free(ca);
    }
    ERR_clear_error();
    if (info.client_cas == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls_client_ca ", options.client_ca_file,
                       " holds no PEM certificate"));
    }
  }
  return info;
}

std::shared_ptr<grpc::ServerCredentials> TlsServerCredentials(
    const TlsOptions& options) {
  const unsigned int interval = static_cast<unsigned int>(
      std::max<int64_t>(1, absl::ToInt64Seconds(options.reload_interval)));
  auto provider =
      std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
          options.key_file, options.cert_file, options.client_ca_file,
          interval);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (!options.client_ca_file.empty()) {
    tls.watch_root_certs();
    tls.set_cert_request_type(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(tls);
}

}  // namespace cohort::server
