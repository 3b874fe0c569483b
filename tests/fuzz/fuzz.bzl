"""cohort_fuzz_test: one fuzz target, and a test replaying its seed corpus."""

load("@rules_cc//cc:defs.bzl", "cc_test")

def cohort_fuzz_test(name, srcs, deps = [], size = "small"):
    """A cc_test of LLVMFuzzerTestOneInput over corpus/<name>/*.

    Built with --config=fuzz it links libFuzzer's main (tools/fuzz.sh runs
    it as a fuzzer); otherwise replay_main.cc's, which runs each corpus file
    once. Either way `bazel test` replays the corpus.
    """
    corpus = native.glob(["corpus/%s/*" % name])
    cc_test(
        name = name,
        size = size,
        srcs = srcs,
        args = ["$(location %s)" % f for f in corpus],
        data = corpus,
        linkopts = select({
            ":libfuzzer": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        deps = deps + select({
            ":libfuzzer": [],
            "//conditions:default": [":replay_main"],
        }),
    )
