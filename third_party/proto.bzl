"""cc_grpc_proto: one .proto -> cc_libraries of its messages and its gRPC stubs.

Debian's Bazel has no rules_proto, so this runs the system protoc and
grpc_cpp_plugin from a genrule. Use it from //proto: the proto path root is
that package, so code includes "cohort/v1/foo.grpc.pb.h" and protos import
"cohort/v1/foo.proto".
"""

def cc_grpc_proto(name, src, deps = [], visibility = None):
    base = src[:-len(".proto")]
    native.genrule(
        name = name + "_gen",
        srcs = [src] + [d + "_src" for d in deps],
        outs = [base + ext for ext in [".pb.h", ".pb.cc", ".grpc.pb.h", ".grpc.pb.cc"]],
        cmd = " ".join([
            "protoc",
            "--proto_path=%s" % native.package_name(),
            "--proto_path=$(GENDIR)/%s" % native.package_name(),
            "--cpp_out=$(GENDIR)/%s" % native.package_name(),
            "--grpc_out=$(GENDIR)/%s" % native.package_name(),
            "--plugin=protoc-gen-grpc=$$(which grpc_cpp_plugin)",
            "$(location %s)" % src,
        ]),
    )
    native.filegroup(name = name + "_src", srcs = [src], visibility = visibility)
    # The messages alone, for code that must not know gRPC exists
    # (server/coordination); then the stubs over them.
    native.cc_library(
        name = name + "_messages",
        srcs = [base + ".pb.cc"],
        hdrs = [base + ".pb.h"],
        includes = ["."],
        deps = [d + "_messages" for d in deps] + ["//third_party:protobuf"],
        visibility = visibility,
    )
    native.cc_library(
        name = name,
        srcs = [base + ".grpc.pb.cc"],
        hdrs = [base + ".grpc.pb.h"],
        includes = ["."],
        deps = deps + [name + "_messages", "//third_party:grpc", "//third_party:protobuf"],
        visibility = visibility,
    )
