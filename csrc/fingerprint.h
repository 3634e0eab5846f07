// Native fingerprint of an nn.Module tree: the C++ twin of compile_cache/_reference.py.
//
// The encoding is specified in that module's docstring; both backends must produce the same bytes
// (and so the same XXH3-128 digests) for every tree. tests/test_fingerprint.py checks this on
// generated trees, so any change here has to be made in _reference.py too.
#pragma once

#include <pybind11/pybind11.h>

namespace compile_cache {

// Sets the instance attribute names every nn.Module has for its own bookkeeping (training,
// _parameters, ...): they are never part of a digest. Python passes
// sorted(_reference.MODULE_INTERNAL_ATTRIBUTES) once at import, so the list lives in one place.
void set_internal_attributes(pybind11::iterable names);

// Digests of every submodule in named_modules() order, as a list of (qualified name, 16 bytes),
// exactly like _reference.fingerprint_tree. Raises TypeError for a root that is not an nn.Module.
pybind11::list fingerprint_tree(pybind11::handle module, bool attributes);

}  // namespace compile_cache
