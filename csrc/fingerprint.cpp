// Native fingerprint of an nn.Module tree. The byte encoding is specified in the docstring of
// compile_cache/_reference.py; this file produces the same bytes, hashed with the same XXH3-128.
//
// Why it is fast: one pass over the tree with no Python objects created per tensor or per
// attribute (tensor metadata is read from the at::Tensor, dicts are walked with PyDict_Next),
// per-depth record buffers that are reused, and per-call caches of the class path per type and
// of the forward digest per function object.

#include "fingerprint.h"

#include <Python.h>

#include <c10/core/DeviceType.h>
#include <c10/core/Layout.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

namespace py = pybind11;

namespace compile_cache {
namespace {

constexpr std::size_t kDigestSize = 16;
using Digest = std::array<char, kDigestSize>;
constexpr std::string_view kMagic = "ccfp1";

// ---------------------------------------------------------------------------------------------
// Process-wide state. Deliberately leaked: these objects must outlive every call, and freeing
// Python objects from a C++ static destructor after the interpreter is gone would crash at exit.

struct Names {
  PyObject* dict = PyUnicode_InternFromString("__dict__");
  PyObject* modules = PyUnicode_InternFromString("_modules");
  PyObject* parameters = PyUnicode_InternFromString("_parameters");
  PyObject* buffers = PyUnicode_InternFromString("_buffers");
  PyObject* forward = PyUnicode_InternFromString("forward");
  PyObject* func = PyUnicode_InternFromString("__func__");
  PyObject* fingerprint_as = PyUnicode_InternFromString("__compile_cache_fingerprint_as__");
  PyObject* code = PyUnicode_InternFromString("__code__");
  PyObject* type_module = PyUnicode_InternFromString("__module__");
  PyObject* type_qualname = PyUnicode_InternFromString("__qualname__");
  PyObject* co_code = PyUnicode_InternFromString("co_code");
  PyObject* co_consts = PyUnicode_InternFromString("co_consts");
  PyObject* co_names = PyUnicode_InternFromString("co_names");
  PyObject* empty = PyUnicode_InternFromString("");
  PyObject* dot = PyUnicode_InternFromString(".");
};

const Names& names() {
  static const Names* instance = new Names();  // first use holds the GIL
  return *instance;
}

PyObject* g_internal_attributes = nullptr;  // frozenset[str], from set_internal_attributes
PyObject* g_module_type = nullptr;          // torch.nn.Module

PyObject* module_type() {
  if (g_module_type == nullptr) {
    py::object module = py::module_::import("torch.nn").attr("Module");
    g_module_type = module.release().ptr();
  }
  return g_module_type;
}

// ---------------------------------------------------------------------------------------------
// Small helpers over the C API that turn Python errors into C++ exceptions pybind11 re-raises.

py::object steal_or_throw(PyObject* result) {
  if (result == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(result);
}

// getattr(obj, name, <missing>) without building an AttributeError when the attribute is absent
// (the common case for "__func__" on plain functions). Returns a null object when missing;
// other exceptions propagate, as with Python's three-argument getattr.
py::object optional_attr(PyObject* obj, PyObject* name) {
  PyObject* result = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  const int found = PyObject_GetOptionalAttr(obj, name, &result);
#else
  const int found = _PyObject_LookupAttr(obj, name, &result);
#endif
  if (found < 0) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(result);
}

std::string type_name(PyTypeObject* type) {
  return type->tp_name;  // for error messages only
}

// ---------------------------------------------------------------------------------------------
// Byte writers: all integers little-endian, as in the reference (struct "<I" and "<q").

// A growable byte buffer whose appends inline to a bounds check and a memcpy: records are built
// from many 1-8 byte pieces, and std::string::append showed up as an out-of-line call per piece.
class Bytes {
 public:
  void clear() { size_ = 0; }
  bool empty() const { return size_ == 0; }
  std::size_t size() const { return size_; }
  const char* data() const { return data_.get(); }
  std::string_view view() const { return {data_.get(), size_}; }

  void reserve(std::size_t capacity) {
    if (capacity > capacity_) {
      std::unique_ptr<char[]> grown(new char[capacity]);
      if (size_ != 0) {
        std::memcpy(grown.get(), data_.get(), size_);
      }
      data_ = std::move(grown);
      capacity_ = capacity;
    }
  }

  void append(const char* bytes, std::size_t count) {
    if (size_ + count > capacity_) {
      reserve(std::max<std::size_t>(2 * capacity_, std::max<std::size_t>(size_ + count, 256)));
    }
    if (count != 0) {
      std::memcpy(data_.get() + size_, bytes, count);
    }
    size_ += count;
  }
  void append(std::string_view bytes) { append(bytes.data(), bytes.size()); }
  void push_back(char byte) { append(&byte, 1); }
  Bytes& operator+=(const Bytes& other) {
    append(other.data(), other.size());
    return *this;
  }

 private:
  std::unique_ptr<char[]> data_;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0;
};

void put_u8(Bytes& out, unsigned value) {
  out.push_back(static_cast<char>(value & 0xffu));
}

void put_u32(Bytes& out, std::size_t value) {
  if (value > 0xffffffffu) {
    throw py::value_error("fingerprint: a length does not fit the encoding's u32");
  }
  const char bytes[4] = {
      static_cast<char>(value & 0xff),
      static_cast<char>((value >> 8) & 0xff),
      static_cast<char>((value >> 16) & 0xff),
      static_cast<char>((value >> 24) & 0xff)};
  out.append(bytes, 4);
}

void put_i64(Bytes& out, std::int64_t signed_value) {
  const auto value = static_cast<std::uint64_t>(signed_value);
  char bytes[8];
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  }
  out.append(bytes, 8);
}

// S(x): u32 length, then the bytes.
void put_sized(Bytes& out, const char* data, std::size_t size) {
  put_u32(out, size);
  out.append(data, size);
}

// UTF-8 bytes of a str with lone surrogates passed through (Python's "surrogatepass"). The fast
// path borrows CPython's cached UTF-8 form; only strings with surrogates need a bytes object,
// which `owner` then keeps alive for as long as the view is used.
std::string_view utf8_view(PyObject* text, py::object& owner) {
  if (!PyUnicode_Check(text)) {
    throw py::type_error("fingerprint: expected a str, got " + type_name(Py_TYPE(text)));
  }
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(text, &size);
  if (data != nullptr) {
    return {data, static_cast<std::size_t>(size)};
  }
  if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
    throw py::error_already_set();
  }
  PyErr_Clear();
  owner = steal_or_throw(PyUnicode_AsEncodedString(text, "utf-8", "surrogatepass"));
  return {PyBytes_AS_STRING(owner.ptr()), static_cast<std::size_t>(PyBytes_GET_SIZE(owner.ptr()))};
}

void put_str(Bytes& out, PyObject* text) {
  py::object owner;
  const std::string_view bytes = utf8_view(text, owner);
  put_sized(out, bytes.data(), bytes.size());
}

// f"{cls.__module__}.{cls.__qualname__}" as UTF-8 bytes (the reference formats both with
// format(x, ""), which PyObject_Format with an empty spec reproduces).
std::string qualified_type_name(PyTypeObject* type) {
  auto* type_object = reinterpret_cast<PyObject*>(type);
  py::object module = steal_or_throw(PyObject_GetAttr(type_object, names().type_module));
  py::object qualname = steal_or_throw(PyObject_GetAttr(type_object, names().type_qualname));
  py::object module_text = steal_or_throw(PyObject_Format(module.ptr(), names().empty));
  py::object qualname_text = steal_or_throw(PyObject_Format(qualname.ptr(), names().empty));
  py::object owner;
  std::string result(utf8_view(module_text.ptr(), owner));
  result.push_back('.');
  result.append(utf8_view(qualname_text.ptr(), owner));
  return result;
}

// Raises RecursionError instead of overflowing the C stack on absurdly deep trees or tuples.
class RecursionGuard {
 public:
  RecursionGuard() {
    if (Py_EnterRecursiveCall(" while fingerprinting a module tree") != 0) {
      throw py::error_already_set();
    }
  }
  ~RecursionGuard() { Py_LeaveRecursiveCall(); }
  RecursionGuard(const RecursionGuard&) = delete;
  RecursionGuard& operator=(const RecursionGuard&) = delete;
};

Digest hash_record(const Bytes& record) {
  const XXH128_hash_t hash = XXH3_128bits(record.data(), record.size());
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, hash);  // big-endian, as xxhash.xxh3_128_digest
  Digest digest;
  std::memcpy(digest.data(), canonical.digest, kDigestSize);
  return digest;
}

// ---------------------------------------------------------------------------------------------
// Values: primitive attributes and code-object constants.

// str(int): small ints without creating a Python str, big ones through int.__str__ (which also
// keeps Python's limit on digits, so both backends fail alike on enormous ints).
void put_int_text(Bytes& out, PyObject* value) {
  int overflow = 0;
  const long long small = PyLong_AsLongLongAndOverflow(value, &overflow);
  if (overflow == 0) {
    if (small == -1 && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    char text[24];
    const auto end = std::to_chars(text, text + sizeof(text), small).ptr;
    put_sized(out, text, static_cast<std::size_t>(end - text));
    return;
  }
  py::object text = steal_or_throw(PyObject_Str(value));
  put_str(out, text.ptr());
}

// repr(float): CPython's float_repr is exactly this call.
void put_float_repr(Bytes& out, PyObject* value) {
  std::unique_ptr<char, decltype(&PyMem_Free)> text(
      PyOS_double_to_string(PyFloat_AS_DOUBLE(value), 'r', 0, Py_DTSF_ADD_DOT_0, nullptr),
      &PyMem_Free);
  if (!text) {
    throw py::error_already_set();
  }
  put_sized(out, text.get(), std::strlen(text.get()));
}

// _is_primitive: exact None/bool/int/float/str, or an exact tuple of those, recursively.
bool is_primitive(PyObject* value) {
  PyTypeObject* kind = Py_TYPE(value);
  if (value == Py_None || kind == &PyBool_Type || kind == &PyLong_Type ||
      kind == &PyFloat_Type || kind == &PyUnicode_Type) {
    return true;
  }
  if (kind != &PyTuple_Type) {
    return false;
  }
  RecursionGuard guard;
  const Py_ssize_t size = PyTuple_GET_SIZE(value);
  for (Py_ssize_t i = 0; i < size; ++i) {
    if (!is_primitive(PyTuple_GET_ITEM(value, i))) {
      return false;
    }
  }
  return true;
}

// _encode_value for a non-tuple primitive; returns false when `value` is not one.
bool put_scalar(Bytes& out, PyObject* value) {
  PyTypeObject* kind = Py_TYPE(value);
  if (value == Py_None) {
    out.push_back('n');
  } else if (kind == &PyBool_Type) {
    out.push_back('b');
    put_u8(out, value == Py_True ? 1 : 0);
  } else if (kind == &PyLong_Type) {
    out.push_back('i');
    put_int_text(out, value);
  } else if (kind == &PyFloat_Type) {
    out.push_back('f');
    put_float_repr(out, value);
  } else if (kind == &PyUnicode_Type) {
    out.push_back('s');
    put_str(out, value);
  } else {
    return false;
  }
  return true;
}

// _encode_value: callers check is_primitive first.
void put_value(Bytes& out, PyObject* value) {
  if (put_scalar(out, value)) {
    return;
  }
  if (Py_TYPE(value) != &PyTuple_Type) {
    throw py::type_error("fingerprint: not a primitive attribute value of type " +
                         type_name(Py_TYPE(value)));
  }
  RecursionGuard guard;
  const Py_ssize_t size = PyTuple_GET_SIZE(value);
  out.push_back('t');
  put_u32(out, static_cast<std::size_t>(size));
  for (Py_ssize_t i = 0; i < size; ++i) {
    put_value(out, PyTuple_GET_ITEM(value, i));
  }
}

void put_code(Bytes& out, PyObject* code);

// _encode_constant: what a code object's co_consts may hold.
void put_constant(Bytes& out, PyObject* value) {
  if (put_scalar(out, value)) {
    return;
  }
  RecursionGuard guard;
  PyTypeObject* kind = Py_TYPE(value);
  if (kind == &PyTuple_Type) {
    const Py_ssize_t size = PyTuple_GET_SIZE(value);
    out.push_back('t');
    put_u32(out, static_cast<std::size_t>(size));
    for (Py_ssize_t i = 0; i < size; ++i) {
      put_constant(out, PyTuple_GET_ITEM(value, i));
    }
  } else if (kind == &PyComplex_Type) {
    out.push_back('c');
    py::object text = steal_or_throw(PyObject_Repr(value));
    put_str(out, text.ptr());
  } else if (kind == &PyBytes_Type) {
    out.push_back('y');
    put_sized(out, PyBytes_AS_STRING(value), static_cast<std::size_t>(PyBytes_GET_SIZE(value)));
  } else if (kind == &PyFrozenSet_Type) {
    // A frozenset's iteration order depends on hashing (PYTHONHASHSEED for str), so the
    // encoded elements are sorted by their bytes to make the digest stable across processes.
    std::vector<Bytes> items;
    py::object iterator = steal_or_throw(PyObject_GetIter(value));
    while (PyObject* raw = PyIter_Next(iterator.ptr())) {
      py::object item = py::reinterpret_steal<py::object>(raw);
      items.emplace_back();
      put_constant(items.back(), item.ptr());
    }
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    // string_view compares bytes as unsigned, like Python's bytes.
    std::sort(items.begin(), items.end(),
              [](const Bytes& a, const Bytes& b) { return a.view() < b.view(); });
    out.push_back('z');
    put_u32(out, items.size());
    for (const Bytes& item : items) {
      out += item;
    }
  } else if (value == Py_Ellipsis) {
    out.push_back('e');
  } else if (PyCode_Check(value)) {
    out.push_back('k');
    put_code(out, value);
  } else {
    out.push_back('o');
    const std::string name = qualified_type_name(kind);
    put_sized(out, name.data(), name.size());
  }
}

// _encode_code: S(co_code) u32(n) consts u32(n) S(names).
void put_code(Bytes& out, PyObject* code) {
  const Names& n = names();
  py::object raw = steal_or_throw(PyObject_GetAttr(code, n.co_code));
  py::object consts = steal_or_throw(PyObject_GetAttr(code, n.co_consts));
  py::object co_names = steal_or_throw(PyObject_GetAttr(code, n.co_names));
  if (!PyBytes_Check(raw.ptr()) || !PyTuple_Check(consts.ptr()) || !PyTuple_Check(co_names.ptr())) {
    throw py::type_error("fingerprint: unexpected code object layout");
  }
  put_sized(out, PyBytes_AS_STRING(raw.ptr()), static_cast<std::size_t>(PyBytes_GET_SIZE(raw.ptr())));
  const Py_ssize_t const_count = PyTuple_GET_SIZE(consts.ptr());
  put_u32(out, static_cast<std::size_t>(const_count));
  for (Py_ssize_t i = 0; i < const_count; ++i) {
    put_constant(out, PyTuple_GET_ITEM(consts.ptr(), i));
  }
  const Py_ssize_t name_count = PyTuple_GET_SIZE(co_names.ptr());
  put_u32(out, static_cast<std::size_t>(name_count));
  for (Py_ssize_t i = 0; i < name_count; ++i) {
    put_str(out, PyTuple_GET_ITEM(co_names.ptr(), i));
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor metadata.

// S(str(dtype) minus "torch."): torch builds its Python dtype names from c10::getDtypeNames,
// so the primary name is the same text. Cached for the process; dtype names never change.
const Bytes& dtype_field(c10::ScalarType scalar_type) {
  constexpr auto kCount = static_cast<std::size_t>(c10::ScalarType::NumOptions);
  static std::array<Bytes, kCount> cache;
  const auto index = static_cast<std::size_t>(scalar_type);
  if (index >= kCount) {
    throw py::value_error("fingerprint: unknown tensor dtype");
  }
  Bytes& field = cache[index];
  if (field.empty()) {
    // Held by value: torch 2.11 returns std::pair<std::string, std::string>, a temporary that a
    // string_view would dangle into (names over 15 bytes, float4_e2m1fn_x2, then read freed
    // memory); torch 2.13 returns string_views into static storage. Both convert to std::string.
    const auto names = c10::getDtypeNames(scalar_type);
    const std::string name(names.first);
    put_sized(field, name.data(), name.size());
  }
  return field;
}

std::uint8_t layout_code(c10::Layout layout) {  // LAYOUT_CODES in the reference
  switch (layout) {
    case c10::Layout::Strided:
      return 0;
    case c10::Layout::Sparse:
      return 1;
    case c10::Layout::SparseCsr:
      return 2;
    case c10::Layout::SparseCsc:
      return 3;
    case c10::Layout::SparseBsr:
      return 4;
    case c10::Layout::SparseBsc:
      return 5;
    case c10::Layout::Mkldnn:
      return 6;
    case c10::Layout::Jagged:
      return 7;
    default:
      return 255;
  }
}

// A real torch.Tensor (or subclass) object. THPVariable_Check would also accept objects that
// only pass isinstance() through a metaclass hook; unpacking those would read garbage, so this
// asks for a genuine subtype before THPVariable_Unpack.
bool is_tensor(PyObject* value) {
  return THPVariableClass != nullptr &&
         PyType_IsSubtype(Py_TYPE(value), reinterpret_cast<PyTypeObject*>(THPVariableClass));
}

// ---------------------------------------------------------------------------------------------

// Open-addressing map from an object's address to an index. The walk inserts every module and
// looks up every child; std::unordered_map's allocation per node showed up in profiles of
// 1000-module trees. Keys are never removed, and the table stays at most half full.
class AddressIndex {
 public:
  AddressIndex() : slots_(1024) {}

  const std::size_t* find(const void* key) const {
    for (std::size_t i = bucket(key);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i].key == key) {
        return &slots_[i].value;
      }
      if (slots_[i].key == nullptr) {
        return nullptr;
      }
    }
  }

  void insert(const void* key, std::size_t value) {  // `key` must not be present yet
    if (2 * (size_ + 1) > slots_.size()) {
      grow();
    }
    place(key, value);
    ++size_;
  }

 private:
  struct Slot {
    const void* key = nullptr;
    std::size_t value = 0;
  };

  std::size_t bucket(const void* key) const {
    auto bits = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(key));
    bits ^= bits >> 33;  // the murmur3 finalizer: object addresses share their low bits
    bits *= 0xff51afd7ed558ccdULL;
    bits ^= bits >> 33;
    return static_cast<std::size_t>(bits) & (slots_.size() - 1);
  }

  void place(const void* key, std::size_t value) {
    std::size_t i = bucket(key);
    while (slots_[i].key != nullptr) {
      i = (i + 1) & (slots_.size() - 1);
    }
    slots_[i] = Slot{key, value};
  }

  void grow() {
    std::vector<Slot> old(2 * slots_.size());
    old.swap(slots_);
    for (const Slot& slot : old) {
      if (slot.key != nullptr) {
        place(slot.key, slot.value);
      }
    }
  }

  std::vector<Slot> slots_;  // size is a power of two
  std::size_t size_ = 0;
};

// ---------------------------------------------------------------------------------------------

// One walk over a module tree: each module encoded and hashed once, shared modules reused, and
// every object cached by pointer kept alive until the walk ends so its address cannot be reused.
class Encoder {
 public:
  explicit Encoder(bool attributes) : attributes_(attributes) {
    entries_.reserve(256);
  }

  py::list run(PyObject* root) {
    walk(root, py::reinterpret_borrow<py::object>(names().empty), 0);
    py::list result(entries_.size());
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      const Entry& entry = entries_[i];
      py::object digest = steal_or_throw(
          PyBytes_FromStringAndSize(entry.digest.data(), static_cast<Py_ssize_t>(kDigestSize)));
      PyObject* pair = PyTuple_New(2);
      if (pair == nullptr) {
        throw py::error_already_set();
      }
      PyTuple_SET_ITEM(pair, 0, entry.path.inc_ref().ptr());
      PyTuple_SET_ITEM(pair, 1, digest.release().ptr());
      // A (str, bytes) pair can never be part of a reference cycle; CPython untracks such
      // tuples itself on its first collection. Doing it now spares the young-generation
      // collections that a thousand new tuples trigger from traversing them.
      PyObject_GC_UnTrack(pair);
      PyList_SET_ITEM(result.ptr(), static_cast<Py_ssize_t>(i), pair);
    }
    return result;
  }

 private:
  struct Entry {
    py::object module;  // keeps the address in index_ valid
    py::object path;    // qualified name, "" for the root
    Digest digest{};
    std::size_t depth = 0;  // position on the walk stack while on_stack
    bool on_stack = true;
  };

  Digest walk(PyObject* module, py::object path, std::size_t depth) {
    RecursionGuard guard;
    const std::size_t index = entries_.size();
    entries_.push_back(Entry{py::reinterpret_borrow<py::object>(module), std::move(path), {}, depth});
    index_.insert(module, index);
    PyObject* path_ptr = entries_[index].path.ptr();

    py::object state = steal_or_throw(PyObject_GetAttr(module, names().dict));
    if (!PyDict_Check(state.ptr())) {
      throw py::type_error("fingerprint: the __dict__ of " + type_name(Py_TYPE(module)) +
                           " is not a dict");
    }
    // A deque keeps references to its elements valid while deeper levels append buffers.
    if (buffers_.size() <= depth) {
      buffers_.emplace_back().reserve(1024);
    }
    Bytes& out = buffers_[depth];
    out.clear();
    out.append(kMagic);
    out += class_field(Py_TYPE(module));
    const Digest forward = forward_digest(module, state.ptr());
    out.append(forward.data(), forward.size());
    put_children(out, module_state(module, state.ptr(), names().modules), path_ptr, depth);
    put_tensors(out, 'P', module_state(module, state.ptr(), names().parameters), path_ptr);
    put_tensors(out, 'B', module_state(module, state.ptr(), names().buffers), path_ptr);
    if (attributes_) {
      put_attributes(out, state.ptr());
    } else {
      out.push_back('-');
    }

    const Digest digest = hash_record(out);
    Entry& entry = entries_[index];  // re-read: entries_ may have grown during the walk
    entry.digest = digest;
    entry.on_stack = false;
    return digest;
  }

  // state["_modules"] and friends; missing means Module.__init__ never ran.
  static PyObject* module_state(PyObject* module, PyObject* state, PyObject* key) {
    PyObject* value = PyDict_GetItemWithError(state, key);
    if (value == nullptr) {
      if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
      throw py::type_error("fingerprint: " + type_name(Py_TYPE(module)) + " has no '" +
                           PyUnicode_AsUTF8(key) +
                           "' in its __dict__ (was nn.Module.__init__ called?)");
    }
    return value;  // borrowed: `state` holds it for the module's walk
  }

  // S(type.__module__ + "." + type.__qualname__), computed once per type.
  const Bytes& class_field(PyTypeObject* type) {
    auto found = class_fields_.find(type);
    if (found != class_fields_.end()) {
      return found->second;
    }
    const std::string name = qualified_type_name(type);
    Bytes field;
    put_sized(field, name.data(), name.size());
    keepalive_.push_back(py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(type)));
    return class_fields_.emplace(type, std::move(field)).first->second;
  }

  // The digest of the module's forward: the instance's own `forward` when its __dict__ has a
  // non-None one, else the class attribute; bound methods are unwrapped through __func__, and a
  // function with __compile_cache_fingerprint_as__ is hashed as that function.
  Digest forward_digest(PyObject* module, PyObject* state) {
    PyObject* own = PyDict_GetItemWithError(state, names().forward);
    if (own == nullptr && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    py::object callable;
    if (own != nullptr && own != Py_None) {
      callable = py::reinterpret_borrow<py::object>(own);
    } else {
      callable = optional_attr(reinterpret_cast<PyObject*>(Py_TYPE(module)), names().forward);
      if (!callable) {
        callable = py::none();
      }
    }
    // First cache level, by the callable as found: the class's function is the same object for
    // every instance, so most modules stop here without even looking up __func__. The answer
    // is what the reference's cache (keyed by the unwrapped function) gives for that callable.
    const auto hit = forward_by_callable_.find(callable.ptr());
    if (hit != forward_by_callable_.end()) {
      return hit->second;
    }
    py::object function = optional_attr(callable.ptr(), names().func);
    if (!function) {
      function = callable;
    }
    // A forward compile_cache put in its place (the reference's FINGERPRINT_AS) is hashed as
    // the function it stands in for: the key does not change when it is installed.
    if (py::object stands_for = optional_attr(function.ptr(), names().fingerprint_as)) {
      function = std::move(stands_for);
    }
    Digest digest;
    const auto function_hit = forward_by_function_.find(function.ptr());
    if (function_hit != forward_by_function_.end()) {
      digest = function_hit->second;
    } else {
      digest = function_digest(function.ptr());
      forward_by_function_.emplace(function.ptr(), digest);
      keepalive_.push_back(function);
    }
    forward_by_callable_.emplace(callable.ptr(), digest);
    keepalive_.push_back(std::move(callable));
    return digest;
  }

  // XXH3(b"K" code) for a Python function, XXH3(b"X" S(qualified type name)) for anything else.
  static Digest function_digest(PyObject* function) {
    Bytes record;
    py::object code = optional_attr(function, names().code);
    if (code && PyCode_Check(code.ptr())) {
      record.push_back('K');
      put_code(record, code.ptr());
    } else {
      record.push_back('X');
      const std::string name = qualified_type_name(Py_TYPE(function));
      put_sized(record, name.data(), name.size());
    }
    return hash_record(record);
  }

  // b"C" u32(n) n x [S(name) (b"D" digest | b"R" u32(distance) | b"N")]
  void put_children(Bytes& out, PyObject* children, PyObject* path, std::size_t depth) {
    out.push_back('C');
    for_each_item(out, children, [&](PyObject* name, PyObject* child) {
      put_str(out, name);
      if (child == Py_None) {
        out.push_back('N');
        return;
      }
      if (const std::size_t* found = index_.find(child)) {
        const Entry& seen = entries_[*found];
        if (seen.on_stack) {  // a cycle: refer to the ancestor by its distance up the stack
          out.push_back('R');
          put_u32(out, depth + 1 - seen.depth);
        } else {  // shared: reuse the digest, listed only under its first name
          out.push_back('D');
          out.append(seen.digest.data(), kDigestSize);
        }
        return;
      }
      if (!PyType_IsSubtype(Py_TYPE(child), reinterpret_cast<PyTypeObject*>(module_type()))) {
        throw py::type_error("fingerprint: child '" + describe(path, name) + "' is a " +
                             type_name(Py_TYPE(child)) + ", not a torch.nn.Module");
      }
      const Digest digest = walk(child, child_path(path, name), depth + 1);
      out.push_back('D');
      out.append(digest.data(), kDigestSize);
    });
  }

  static py::object child_path(PyObject* parent, PyObject* name) {
    if (PyUnicode_GET_LENGTH(parent) == 0) {
      return py::reinterpret_borrow<py::object>(name);
    }
    py::object prefix = steal_or_throw(PyUnicode_Concat(parent, names().dot));
    return steal_or_throw(PyUnicode_Concat(prefix.ptr(), name));
  }

  // tag u32(n) n x [S(name) tensor], in registration order.
  void put_tensors(Bytes& out, char tag, PyObject* tensors, PyObject* path) {
    out.push_back(tag);
    for_each_item(out, tensors, [&](PyObject* name, PyObject* value) {
      put_str(out, name);
      put_tensor(out, value, name, path);
    });
  }

  // b"N" | b"T" S(dtype) S(device type) u8(layout) u8(requires_grad) u32(ndim) sizes [strides]
  void put_tensor(Bytes& out, PyObject* value, PyObject* name, PyObject* path) {
    if (value == Py_None) {
      out.push_back('N');
      return;
    }
    if (!is_tensor(value)) {
      throw py::type_error("fingerprint: '" + describe(path, name) + "' is a " +
                           type_name(Py_TYPE(value)) + ", not a torch.Tensor");
    }
    const at::Tensor& tensor = THPVariable_Unpack(value);
    if (!tensor.defined()) {
      throw py::value_error("fingerprint: tensor '" + describe(path, name) + "' is undefined");
    }
    try {
      out.push_back('T');
      out += dtype_field(tensor.scalar_type());
      out += device_field(tensor.device().type());
      const std::uint8_t layout = layout_code(tensor.layout());
      put_u8(out, layout);
      put_u8(out, tensor.requires_grad() ? 1 : 0);
      const c10::IntArrayRef sizes = tensor.sizes();
      put_u32(out, sizes.size());
      for (const std::int64_t size : sizes) {
        put_i64(out, size);
      }
      if (layout == 0) {
        for (const std::int64_t stride : tensor.strides()) {
          put_i64(out, stride);
        }
      }
    } catch (const c10::Error& error) {  // e.g. symbolic sizes: report which tensor
      throw py::value_error("fingerprint: cannot read the metadata of tensor '" +
                            describe(path, name) + "': " + error.what_without_backtrace());
    }
  }

  // S(device type) in lower case, as torch.device.type spells it (including a renamed
  // PrivateUse1 backend); cached per call since the name is a fresh std::string each time.
  const Bytes& device_field(c10::DeviceType type) {
    const auto index = static_cast<std::size_t>(type);
    if (index >= device_fields_.size()) {
      throw py::value_error("fingerprint: unknown device type");
    }
    Bytes& field = device_fields_[index];
    if (field.empty()) {
      const std::string name = c10::DeviceTypeName(type, /*lower_case=*/true);
      put_sized(field, name.data(), name.size());
    }
    return field;
  }

  // b"A" u32(n) n x [S(name) value], primitive non-internal attributes sorted by UTF-8 name.
  void put_attributes(Bytes& out, PyObject* state) {
    attribute_owners_.clear();
    attributes_found_.clear();
    Py_ssize_t position = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    // Nothing in this loop runs Python code, so the borrowed keys and values stay valid.
    while (PyDict_Next(state, &position, &key, &value)) {
      if (!PyUnicode_CheckExact(key)) {
        continue;
      }
      // Internal names are tested first: the keys are interned strings shared by every module
      // (hot in cache, hash cached), while testing a value touches a cold per-module object.
      // Most entries are internal, so this skips most of the value reads.
      if (is_internal(key) || !is_primitive(value)) {
        continue;
      }
      py::object owner;
      const std::string_view name = utf8_view(key, owner);
      if (owner) {
        attribute_owners_.push_back(std::move(owner));
      }
      attributes_found_.emplace_back(name, value);
    }
    // UTF-8 is injective, so names never tie and the values never need comparing.
    std::sort(attributes_found_.begin(), attributes_found_.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    out.push_back('A');
    put_u32(out, attributes_found_.size());
    for (const auto& [name, attribute] : attributes_found_) {
      put_sized(out, name.data(), name.size());
      put_value(out, attribute);
    }
  }

  // Whether `key` names module bookkeeping. Memoized per key object: the same few dozen interned
  // names recur in every module's __dict__, and this is cheaper than a set lookup each time.
  bool is_internal(PyObject* key) {
    if (const std::size_t* known = internal_keys_.find(key)) {
      return *known != 0;
    }
    const int internal = PySet_Contains(g_internal_attributes, key);
    if (internal < 0) {
      throw py::error_already_set();
    }
    internal_keys_.insert(key, internal != 0 ? 1 : 0);
    keepalive_.push_back(py::reinterpret_borrow<py::object>(key));
    return internal != 0;
  }

  // Writes u32(len(mapping)), then visits its items in iteration order. Exact dicts (what nn.Module uses) are
  // walked with PyDict_Next; anything else goes through .items() like the reference. Each item
  // is held while `visit` runs, since walking a child may run Python code (attribute lookups).
  template <typename Visit>
  static void for_each_item(Bytes& out, PyObject* mapping, Visit&& visit) {
    if (PyDict_CheckExact(mapping)) {
      const Py_ssize_t size = PyDict_GET_SIZE(mapping);
      put_u32(out, static_cast<std::size_t>(size));
      Py_ssize_t position = 0;
      PyObject* key = nullptr;
      PyObject* value = nullptr;
      while (PyDict_Next(mapping, &position, &key, &value)) {
        py::object held_key = py::reinterpret_borrow<py::object>(key);
        py::object held_value = py::reinterpret_borrow<py::object>(value);
        visit(held_key.ptr(), held_value.ptr());
        if (PyDict_GET_SIZE(mapping) != size) {
          throw py::value_error("fingerprint: a module dict changed size during the walk");
        }
      }
      return;
    }
    py::object items = steal_or_throw(PyObject_CallMethod(mapping, "items", nullptr));
    py::object list = steal_or_throw(PySequence_List(items.ptr()));
    const Py_ssize_t size = PyList_GET_SIZE(list.ptr());
    put_u32(out, static_cast<std::size_t>(size));
    for (Py_ssize_t i = 0; i < size; ++i) {
      PyObject* item = PyList_GET_ITEM(list.ptr(), i);
      if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
        throw py::type_error("fingerprint: a module mapping's items() are not pairs");
      }
      visit(PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1));
    }
  }

  // "path.name" for error messages; a part that cannot be shown degrades to "?".
  static std::string describe(PyObject* path, PyObject* name) {
    std::string text = printable(path);
    if (!text.empty()) {
      text.push_back('.');
    }
    return text + printable(name);
  }

  static std::string printable(PyObject* text) {
    const char* utf8 = PyUnicode_Check(text) ? PyUnicode_AsUTF8(text) : nullptr;
    if (utf8 == nullptr) {
      PyErr_Clear();  // e.g. lone surrogates: only the message degrades
      return "?";
    }
    return utf8;
  }

  bool attributes_;
  std::vector<Entry> entries_;                       // named_modules() order
  AddressIndex index_;                               // module -> entries_ index
  AddressIndex internal_keys_;                       // attribute name -> 1 if internal
  std::deque<Bytes> buffers_;                        // one record buffer per depth
  std::unordered_map<PyTypeObject*, Bytes> class_fields_;
  std::unordered_map<PyObject*, Digest> forward_by_callable_;
  std::unordered_map<PyObject*, Digest> forward_by_function_;
  std::vector<py::object> keepalive_;  // everything the maps above key by address
  std::array<Bytes, static_cast<std::size_t>(c10::COMPILE_TIME_MAX_DEVICE_TYPES)>
      device_fields_;
  std::vector<std::pair<std::string_view, PyObject*>> attributes_found_;  // reused scratch
  std::vector<py::object> attribute_owners_;
};

}  // namespace

void set_internal_attributes(py::iterable names_iterable) {
  py::object names_set = steal_or_throw(PyFrozenSet_New(names_iterable.ptr()));
  for (py::handle name : names_set) {
    if (!PyUnicode_CheckExact(name.ptr())) {
      throw py::type_error("set_internal_attributes needs str names, got " +
                           type_name(Py_TYPE(name.ptr())));
    }
  }
  Py_XDECREF(g_internal_attributes);
  g_internal_attributes = names_set.release().ptr();
}

py::list fingerprint_tree(py::handle module, bool attributes) {
  if (!PyType_IsSubtype(Py_TYPE(module.ptr()), reinterpret_cast<PyTypeObject*>(module_type()))) {
    throw py::type_error("fingerprint needs a torch.nn.Module, got " +
                         qualified_type_name(Py_TYPE(module.ptr())));
  }
  if (attributes && g_internal_attributes == nullptr) {
    throw std::runtime_error(
        "compile_cache._C.set_internal_attributes() must be called before fingerprinting "
        "attributes (compile_cache.fingerprint does this when it first loads the backend)");
  }
  Encoder encoder(attributes);
  return encoder.run(module.ptr());
}

}  // namespace compile_cache
