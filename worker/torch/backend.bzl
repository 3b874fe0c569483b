"""The backend's libraries and their unit tests, once per torch it is built
against (worker/torch/BUILD): the same sources, other headers and
libraries."""

def torch_backend_libraries(
        torch,
        gloo_group,
        target_compatible_with,
        suffix = "",
        test_prefix = "",
        pg_test_data = [],
        pg_test_linkstatic = False):
    """torch_store, torch_work and process_group_cohort (each name + suffix)
    over the cc_library `torch`, with CreateGlooGroup from `gloo_group`, and
    their tests (test_prefix + torch_store_test, ...)."""
    native.cc_library(
        name = "torch_store" + suffix,
        srcs = ["torch_store.cc"],
        hdrs = ["torch_store.h"],
        target_compatible_with = target_compatible_with,
        deps = [
            "//client:store",
            "//third_party:absl",
            torch,
        ],
    )
    native.cc_test(
        name = test_prefix + "torch_store_test",
        size = "small",
        srcs = ["torch_store_test.cc"],
        target_compatible_with = target_compatible_with,
        deps = [
            ":torch_store" + suffix,
            "//third_party:gtest_main",
        ],
    )
    native.cc_library(
        name = "torch_work" + suffix,
        srcs = ["torch_work.cc"],
        hdrs = ["torch_work.h"],
        target_compatible_with = target_compatible_with,
        deps = [
            "//third_party:absl",
            "//worker/collective:process_group",
            torch,
        ],
    )
    native.cc_test(
        name = test_prefix + "torch_work_test",
        size = "small",
        srcs = ["torch_work_test.cc"],
        target_compatible_with = target_compatible_with,
        deps = [
            ":torch_work" + suffix,
            "//third_party:gtest_main",
        ],
    )
    native.cc_library(
        name = "process_group_cohort" + suffix,
        srcs = ["process_group_cohort.cc"],
        hdrs = ["process_group_cohort.h"],
        target_compatible_with = target_compatible_with,
        deps = [
            gloo_group,
            ":torch_store" + suffix,
            ":torch_work" + suffix,
            "//third_party:absl",
            "//worker/collective:process_group",
            "//worker/collective/trace:timeline",
            torch,
        ],
    )

    # Ranks as threads of one process over torch's HashStore; no Python.
    native.cc_test(
        name = test_prefix + "process_group_cohort_test",
        size = "small",
        srcs = ["process_group_cohort_test.cc"],
        data = pg_test_data,
        linkstatic = pg_test_linkstatic,
        target_compatible_with = target_compatible_with,
        deps = [
            ":process_group_cohort" + suffix,
            "//third_party:gtest_main",
        ],
        # gloo's TCP transport listens on this machine's address.
        tags = ["requires-network"],
    )
