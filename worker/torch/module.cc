// cohort_torch: the Python module that makes cohort a torch.distributed
// backend. Importing it registers the backend "cohort":
//
//   import cohort_torch
//   import torch.distributed as dist
//   dist.init_process_group("cohort")   # env://, or init_method=, store=
//
// torch then calls create_process_group(prefix_store, rank, size, timeout)
// for each group. Built twice (worker/torch/BUILD): for PyTorch 2.x
// (bazel-bin/worker/torch/torch2/) it returns a ProcessGroupCohort that is a
// c10d::Backend, registered for the "cpu" device, and for Debian's 1.13
// (bazel-bin/worker/torch/) one that is a ProcessGroup. The module refuses
// to load into a torch other than the one it was built against.
#include <chrono>
#include <functional>
#include <string>

#include "pybind11/chrono.h"
#include "pybind11/pybind11.h"
#include "torch/csrc/utils/pybind.h"
#include "worker/torch/gloo_group.h"
#include "worker/torch/process_group_cohort.h"
#include "worker/torch/torch_work.h"

namespace py = pybind11;

namespace {

// The group's destructor waits for its backend threads, which may need the
// GIL (process_group_cohort.h, SetWaitHook): wait without it.
void WaitWithoutTheGil(const std::function<void()>& wait) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release release;
    wait();
  } else {
    wait();
  }
}

// Creating a group blocks until every rank has arrived: without the GIL,
// so that other Python threads (and the store, if it is written in Python)
// run meanwhile. Called with the GIL; returns with it.
c10::intrusive_ptr<cohort::ProcessGroupCohort> CreateProcessGroup(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::duration<float> timeout) {
  py::gil_scoped_release release;
  return cohort::ProcessGroupCohort::Create(
      store, rank, size,
      std::chrono::duration_cast<std::chrono::milliseconds>(timeout));
}

// Before Python finalizes (atexit): lets the future callbacks of finished
// ops end, as torch_work.h asks.
void WaitForFutures() {
  py::gil_scoped_release release;
  cohort::TorchWork::WaitForFutures(std::chrono::seconds(10));
}

// Where the dynamic linker took cohort's Gloo from (gloo_group.h), for the
// tests that show torch's own Gloo does not stand in for it.
py::dict GlooBinding() {
  absl::StatusOr<cohort::GlooBinding> binding = cohort::FindGlooBinding();
  if (!binding.ok()) throw std::runtime_error(binding.status().ToString());
  py::dict result;
  result["group_library"] = binding->group_library;
  result["gloo_library"] = binding->gloo_library;
  return result;
}

}  // namespace

PYBIND11_MODULE(cohort_torch, m) {
  m.doc() =
      "cohort's collectives as the torch.distributed backend \"cohort\": "
      "import this module, then dist.init_process_group(\"cohort\").";
  // A module built for one torch crashes in another: say so instead.
  const std::string running =
      py::str(py::module_::import("torch").attr("__version__"));
  const std::string built = TORCH_VERSION;
  if (running.rfind(built, 0) != 0) {
    throw py::import_error("cohort_torch was built for torch " + built +
                           " but this Python runs torch " + running +
                           " (bazel-bin/worker/torch/torch2 holds the 2.x "
                           "build, bazel-bin/worker/torch the 1.13 one)");
  }
  // Registers torch's backend and Store classes with pybind11 before a
  // class here names them.
  py::module_ dist = py::module_::import("torch.distributed");

  cohort::ProcessGroupCohort::SetWaitHook(&WaitWithoutTheGil);
  py::class_<cohort::ProcessGroupCohort,
             c10::intrusive_ptr<cohort::ProcessGroupCohort>,
             cohort::TorchBackend>(m, "ProcessGroupCohort",
                                   "torch's backend over cohort's Gloo "
                                   "backend (CPU tensors).")
      .def(py::init(&CreateProcessGroup), py::arg("store"), py::arg("rank"),
           py::arg("size"), py::arg("timeout"),
           "Connects to the other ranks through a torch Store; blocks until "
           "all have arrived or `timeout` (a timedelta) passes.");

  // What torch calls for init_process_group("cohort") and
  // new_group(backend="cohort").
  m.def("create_process_group", &CreateProcessGroup, py::arg("store"),
        py::arg("rank"), py::arg("size"), py::arg("timeout"));
  m.def("_gloo_binding", &GlooBinding,
        "The files cohort's Gloo group code and the gloo functions it calls "
        "were loaded from: {'group_library': ..., 'gloo_library': ...}.");

  m.def("_wait_for_futures", &WaitForFutures,
        "Waits (10 s at most) for the futures of finished ops to run their "
        "callbacks; registered with atexit.");
  py::module_::import("atexit").attr("register")(m.attr("_wait_for_futures"));

  py::object backend = dist.attr("Backend");
  if (!py::hasattr(backend, "COHORT")) {
#if COHORT_TORCH_BACKEND
    // Backend.register_backend(name, func, extended_api, devices).
    py::list devices;
    devices.append("cpu");
    backend.attr("register_backend")("cohort", m.attr("create_process_group"),
                                     py::arg("extended_api") = false,
                                     py::arg("devices") = devices);
#else
    backend.attr("register_backend")("cohort", m.attr("create_process_group"));
#endif
  }
}
