// HttpExchange: bytes to a local HTTP server and every byte of its answer,
// for tests of what cohortd's metrics port sends (no client library in
// between to tidy either side).
#ifndef COHORT_TESTS_TESTING_HTTP_EXCHANGE_H_
#define COHORT_TESTS_TESTING_HTTP_EXCHANGE_H_

#include <string>

namespace cohort::testing {

// Sends `request` as it is to 127.0.0.1:`port` and reads until the server
// closes the connection (or is silent for 10 s); the bytes read, "" if it
// could not connect.
std::string HttpExchange(int port, const std::string& request);

// GET `path` over HTTP/1.0 with `headers` (each ending in CRLF); the whole
// response.
std::string HttpGet(int port, const std::string& path,
                    const std::string& headers = "");

}  // namespace cohort::testing

#endif  // COHORT_TESTS_TESTING_HTTP_EXCHANGE_H_
