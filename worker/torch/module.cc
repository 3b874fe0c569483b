// cohort_torch: the Python module that makes cohort a torch.distributed
// backend. Importing it registers the backend "cohort":
//
//   import cohort_torch
//   import torch.distributed as dist
//   dist.init_process_group("cohort")   # env://, or init_method=, store=
//
// torch then calls create_process_group(prefix_store, rank, size, timeout)
// for each group, which returns a ProcessGroupCohort, a subclass of torch's
// own ProcessGroup class (process_group_cohort.h).
#include <chrono>
#include <functional>

#include "pybind11/chrono.h"
#include "pybind11/pybind11.h"
#include "torch/csrc/utils/pybind.h"
#include "worker/torch/process_group_cohort.h"

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

}  // namespace

PYBIND11_MODULE(cohort_torch, m) {
  m.doc() =
      "cohort's collectives as the torch.distributed backend \"cohort\": "
      "import this module, then dist.init_process_group(\"cohort\").";
  // Registers torch's ProcessGroup and Store classes with pybind11 before
  // a class here names them.
  py::module_ dist = py::module_::import("torch.distributed");

  cohort::ProcessGroupCohort::SetWaitHook(&WaitWithoutTheGil);
  py::class_<cohort::ProcessGroupCohort,
             c10::intrusive_ptr<cohort::ProcessGroupCohort>,
             c10d::ProcessGroup>(m, "ProcessGroupCohort",
                                 "A torch ProcessGroup over cohort's Gloo "
                                 "backend (CPU tensors).")
      .def(py::init(&CreateProcessGroup), py::arg("store"), py::arg("rank"),
           py::arg("size"), py::arg("timeout"),
           "Connects to the other ranks through a torch Store; blocks until "
           "all have arrived or `timeout` (a timedelta) passes.");

  // What torch calls for init_process_group("cohort") and
  // new_group(backend="cohort").
  m.def("create_process_group", &CreateProcessGroup, py::arg("store"),
        py::arg("rank"), py::arg("size"), py::arg("timeout"));

  py::object backend = dist.attr("Backend");
  if (!py::hasattr(backend, "COHORT")) {
    backend.attr("register_backend")("cohort", m.attr("create_process_group"));
  }
}
