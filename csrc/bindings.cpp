// compile_cache._C: the private native extension. Python reaches it only through
// compile_cache/fingerprint.py, which picks it as the fingerprint backend when it loads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/version.h>

#include <string>

#include "fingerprint.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "compile_cache native backend: fingerprints of nn.Module trees (see _reference.py).";

  // The torch this extension was compiled against: `doctor` compares it with the running one.
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." +
                            std::to_string(TORCH_VERSION_MINOR) + "." +
                            std::to_string(TORCH_VERSION_PATCH);

  m.def("set_internal_attributes", &compile_cache::set_internal_attributes, py::arg("names"),
        "Sets the nn.Module bookkeeping attribute names that are never part of a digest.");

  m.def("fingerprint_tree", &compile_cache::fingerprint_tree, py::arg("module"),
        py::arg("attributes"),
        "Digests of every submodule in named_modules() order as (qualified name, 16 bytes), "
        "byte for byte the same as compile_cache._reference.fingerprint_tree.");
}
