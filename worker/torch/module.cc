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
#include <utility>

#include "pybind11/chrono.h"
#include "pybind11/pybind11.h"
#include "torch/csrc/utils/pybind.h"
#include "worker/torch/process_group_cohort.h"

namespace py = pybind11;

namespace {

// How Python holds a ProcessGroupCohort: a c10::intrusive_ptr (the same
// layout, so torch's C++ code that takes an intrusive_ptr<ProcessGroup>
// reads it as one), dropped with the GIL released. Dropping the last
// reference waits for the group's backend threads, and those may need the
// GIL to finish an op: freeing a tensor whose Python object torch kept
// alive, or running a Python future callback. torch holds its own backends
// the same way.
template <typename T>
class NoGilDestructorPtr {
 public:
  NoGilDestructorPtr() = default;
  // NOLINTNEXTLINE(google-explicit-constructor): returned as the holder.
  NoGilDestructorPtr(c10::intrusive_ptr<T> impl) : impl_(std::move(impl)) {}
  explicit NoGilDestructorPtr(T* impl)
      : impl_(c10::intrusive_ptr<T>::unsafe_steal_from_new(impl)) {}
  NoGilDestructorPtr(const NoGilDestructorPtr&) = default;
  NoGilDestructorPtr& operator=(const NoGilDestructorPtr&) = default;
  ~NoGilDestructorPtr() {
    if (impl_ && PyGILState_Check()) {
      py::gil_scoped_release release;
      impl_.reset();
    }
  }

  T* get() const { return impl_.get(); }

 private:
  c10::intrusive_ptr<T> impl_;
};

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, NoGilDestructorPtr<T>, true);

namespace {

using Holder = NoGilDestructorPtr<cohort::ProcessGroupCohort>;
static_assert(sizeof(Holder) ==
                  sizeof(c10::intrusive_ptr<cohort::ProcessGroupCohort>),
              "torch reads the holder as an intrusive_ptr");

Holder CreateProcessGroup(const c10::intrusive_ptr<c10d::Store>& store,
                          int rank, int size,
                          std::chrono::duration<float> timeout) {
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

  py::class_<cohort::ProcessGroupCohort, Holder, c10d::ProcessGroup>(
      m, "ProcessGroupCohort",
      "A torch ProcessGroup over cohort's Gloo "
      "backend (CPU tensors).")
      .def(py::init(&CreateProcessGroup), py::arg("store"), py::arg("rank"),
           py::arg("size"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>(),
           "Connects to the other ranks through a torch Store; blocks until "
           "all have arrived or `timeout` (a timedelta) passes.");

  // What torch calls for init_process_group("cohort") and
  // new_group(backend="cohort"). Creating a group blocks on the other
  // ranks, so the GIL is released meanwhile.
  m.def("create_process_group", &CreateProcessGroup, py::arg("store"),
        py::arg("rank"), py::arg("size"), py::arg("timeout"),
        py::call_guard<py::gil_scoped_release>());

  py::object backend = dist.attr("Backend");
  if (!py::hasattr(backend, "COHORT")) {
    backend.attr("register_backend")("cohort", m.attr("create_process_group"));
  }
}
