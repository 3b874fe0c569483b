// Default options of the sanitizer runtimes, read at start-up. A variable
// set by hand (ASAN_OPTIONS=..., TSAN_OPTIONS=...) overrides these.

extern "C" {

const char* __asan_default_options() {
  // Leaks are checked at exit (LSan); suppressions in lsan.supp.
  return "detect_leaks=1:check_initialization_order=1:strict_init_order=1";
}

const char* __ubsan_default_options() {
  return "print_stacktrace=1:halt_on_error=1";
}

const char* __tsan_default_options() {
  // Exit code 66 (TSan's default) fails the test after the first report
  // has been printed in full.
  return "halt_on_error=1:second_deadlock_stack=1:history_size=7";
}

}  // extern "C"
