// kvgc._kvgc: the nanobind module under the Python package. It binds kvgc.h and nothing
// below it (as tools/ does), and only converts and checks: arrays arrive by DLPack or the
// buffer protocol with no copy, their dtype, shape, contiguity and device are checked
// against the heap before any C call, and a failed status becomes the exception class the
// Python layer registered for it, carrying kvgc_errmsg(). Option parsing, enums and
// output allocation live in the pure-Python layer (python/kvgc/__init__.py).
#include <kvgc.h>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// A failed call: its status, message and (batch plans) the index of the sequence at fault.
struct KvgcError {
  int status;
  std::string message;
  long failed_index = -1;
};

// Exception classes by status, set once by the Python layer (kvgc._errors). A plain
// handle, deliberately never released: a static nb::object would be decref'd after the
// interpreter finalises.
nb::handle g_error_types;

[[noreturn]] void raise(int status, std::string message, long failed_index = -1) {
  throw KvgcError{status, std::move(message), failed_index};
}

[[noreturn]] void invalid(const std::string& message) { raise(KVGC_EINVAL, message); }

void check_status(kvgc_status status, const kvgc_heap* heap, const char* call,
                  long failed_index = -1) {
  if (status == KVGC_OK) return;
  // kvgc's message names the call and the argument already.
  const char* msg = kvgc_errmsg(heap);
  raise(status, msg && *msg ? std::string(msg) : std::string(call) + ": " + kvgc_status_str(status),
        failed_index);
}

using Array = nb::ndarray<nb::ro>;    // any input array: numpy, anything DLPack
using OutArray = nb::ndarray<>;       // a writable output array

// The DLPack C exchange API (dlpack.h 1.2+, `type(t).__dlpack_c_exchange_api__`): torch
// fills a DLTensor straight from the tensor object, without __dlpack__()'s capsule and
// Python call (about 11 us a tensor on this binding's first measurement). Declared here to
// the ABI that dlpack.h fixes; no dlpack header is needed at build time.
struct DLDeviceC { int32_t device_type; int32_t device_id; };
struct DLDataTypeC { uint8_t code; uint8_t bits; uint16_t lanes; };
struct DLTensorC {
  void* data;
  DLDeviceC device;
  int32_t ndim;
  DLDataTypeC dtype;
  int64_t* shape;
  int64_t* strides;  // NULL: compact row-major
  uint64_t byte_offset;
};
struct ExchangeHeader { uint32_t major, minor; ExchangeHeader* prev_api; };
struct ExchangeAPI {
  ExchangeHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensorC* out);
  void* current_work_stream;
};

// The exchange API of obj's type, or nullptr; looked up once per type (under the GIL).
const ExchangeAPI* exchange_api(nb::handle obj) {
  struct Entry { PyTypeObject* type; const ExchangeAPI* api; };
  static Entry cache[8];
  static unsigned used = 0;
  PyTypeObject* type = Py_TYPE(obj.ptr());
  for (unsigned i = 0; i < used; ++i) {
    if (cache[i].type == type) return cache[i].api;
  }
  const ExchangeAPI* api = nullptr;
  PyObject* cap = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type),
                                         "__dlpack_c_exchange_api__");
  if (cap && PyCapsule_IsValid(cap, "dlpack_exchange_api")) {
    api = static_cast<const ExchangeAPI*>(PyCapsule_GetPointer(cap, "dlpack_exchange_api"));
    if (api && (api->header.major != 1 || !api->dltensor_from_py_object_no_sync)) api = nullptr;
  }
  Py_XDECREF(cap);
  PyErr_Clear();
  if (used < 8) cache[used++] = {type, api};  // types live as long as the process here
  return api;
}

// An array argument seen without a copy: through the exchange API when its type has one,
// else nanobind's ndarray (the buffer protocol for numpy, __dlpack__ for the rest). Valid
// while the caller holds the object, which it does for the whole call.
class View {
 public:
  View(nb::handle obj, const char* name, bool writable) {
    if (const ExchangeAPI* api = exchange_api(obj)) {
      DLTensorC t{};
      if (api->dltensor_from_py_object_no_sync(obj.ptr(), &t) == 0 && t.ndim <= kMaxDims) {
        data_ = static_cast<char*>(t.data) + t.byte_offset;
        dtype_ = {t.dtype.code, t.dtype.bits, t.dtype.lanes};
        ndim_ = size_t(t.ndim);
        device_type_ = t.device.device_type;
        device_id_ = t.device.device_id;
        int64_t compact = 1;
        for (size_t i = ndim_; i-- > 0;) {
          shape_[i] = t.shape[i];
          stride_[i] = t.strides ? t.strides[i] : compact;
          compact *= t.shape[i];
        }
        return;
      }
      PyErr_Clear();  // fall back to nanobind's path, which reports its own errors
    }
    bool ok = false;
    if (writable) {
      ok = nb::try_cast(obj, out_, false);
      if (ok) take(out_);
    } else {
      ok = nb::try_cast(obj, in_, false);
      if (ok) take(in_);
    }
    if (!ok || ndim_ > kMaxDims) {
      throw nb::type_error((std::string(name) + " must be a " + (writable ? "writable " : "") +
                            "array (numpy, torch or any DLPack tensor), not " +
                            nb::inst_name(obj).c_str()).c_str());
    }
  }
  nb::dlpack::dtype dtype() const { return dtype_; }
  size_t ndim() const { return ndim_; }
  size_t shape(size_t i) const { return size_t(shape_[i]); }
  int64_t stride(size_t i) const { return stride_[i]; }
  int device_type() const { return device_type_; }
  int device_id() const { return device_id_; }
  const void* data() const { return data_; }

 private:
  static constexpr size_t kMaxDims = 8;
  template <typename A>
  void take(const A& a) {
    data_ = a.data();
    dtype_ = a.dtype();
    ndim_ = a.ndim();
    device_type_ = a.device_type();
    device_id_ = a.device_id();
    for (size_t i = 0; i < ndim_ && i < kMaxDims; ++i) {
      shape_[i] = int64_t(a.shape(i));
      stride_[i] = a.stride(i);
    }
  }
  const void* data_ = nullptr;
  nb::dlpack::dtype dtype_{};
  size_t ndim_ = 0;
  int64_t shape_[kMaxDims] = {};
  int64_t stride_[kMaxDims] = {};
  int device_type_ = 0, device_id_ = 0;
  Array in_;
  OutArray out_;
};

const char* dtype_name(nb::dlpack::dtype t) {
  using nb::dlpack::dtype_code;
  if (t.lanes != 1) return "a vector dtype";
  switch (dtype_code(t.code)) {
    case dtype_code::Float:
      return t.bits == 16 ? "float16" : t.bits == 32 ? "float32" : t.bits == 64 ? "float64" : "float";
    case dtype_code::Bfloat: return t.bits == 16 ? "bfloat16" : "bfloat";
    case dtype_code::Int:
      return t.bits == 8 ? "int8" : t.bits == 16 ? "int16" : t.bits == 32 ? "int32" : "int64";
    case dtype_code::UInt:
      return t.bits == 8 ? "uint8" : t.bits == 16 ? "uint16" : t.bits == 32 ? "uint32" : "uint64";
    case dtype_code::Bool: return "bool";
    default: return "an unknown dtype";
  }
}

nb::dlpack::dtype dtype_of(kvgc_dtype d) {
  switch (d) {
    case KVGC_DTYPE_F16: return {uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
    case KVGC_DTYPE_BF16: return {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
    default: return {uint8_t(nb::dlpack::dtype_code::Float), 32, 1};
  }
}

constexpr nb::dlpack::dtype kF32{uint8_t(nb::dlpack::dtype_code::Float), 32, 1};
constexpr nb::dlpack::dtype kI32{uint8_t(nb::dlpack::dtype_code::Int), 32, 1};
constexpr nb::dlpack::dtype kU8{uint8_t(nb::dlpack::dtype_code::UInt), 8, 1};

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += shape[i] < 0 ? std::string("n") : std::to_string(shape[i]);
  }
  return s + (shape.size() == 1 ? ",)" : ")");
}

// What the heap needs of every array it is handed.
struct Where {
  int device_type;  // nb::device::cpu::value or cuda::value
  int device_id;
};

// Checks `a` (named `name`) against the expected dtype, shape (-1: any, returned through
// *n), C-contiguity and device; returns its data pointer. Nothing is copied.
template <typename A>
void* checked(const A& a, const char* name, nb::dlpack::dtype dt, std::vector<int64_t> shape,
              const Where& where, uint64_t* n = nullptr) {
  if (a.dtype() != dt) {
    invalid(std::string(name) + " has dtype " + dtype_name(a.dtype()) + "; the heap needs " +
            dtype_name(dt));
  }
  bool ok = a.ndim() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) {
    if (shape[i] >= 0 && int64_t(a.shape(i)) != shape[i]) ok = false;
  }
  if (!ok) {
    std::string got = "(";
    for (size_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
    got += a.ndim() == 1 ? ",)" : ")";
    invalid(std::string(name) + " has shape " + got + "; expected " + shape_str(shape));
  }
  // C-contiguous: strides (in elements) as a dense row-major array's; size-1 dims are free.
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) {
      invalid(std::string(name) + " is not C-contiguous (call .contiguous() or "
              "numpy.ascontiguousarray first): kvgc reads it in place, without a copy");
    }
    expect *= int64_t(a.shape(i));
  }
  if (a.device_type() != where.device_type ||
      (where.device_type == nb::device::cuda::value && a.device_id() != where.device_id)) {
    const auto dev = [](int type, int id) {
      return type == nb::device::cpu::value ? std::string("cpu")
             : type == nb::device::cuda::value ? "cuda:" + std::to_string(id)
                                               : "device type " + std::to_string(type);
    };
    invalid(std::string(name) + " is on " + dev(a.device_type(), a.device_id()) +
            "; the heap is on " + dev(where.device_type, where.device_id));
  }
  if (n && a.ndim() > 0) *n = a.shape(0);
  return const_cast<void*>(static_cast<const void*>(a.data()));
}

uint32_t to_u32(uint64_t v, const char* name) {
  if (v > UINT32_MAX) invalid(std::string(name) + " = " + std::to_string(v) + " is above 2^32-1");
  return uint32_t(v);
}

// Token ids (the prefix cache): a 1-D int32 array on the host (numpy, a CPU torch tensor,
// any DLPack or buffer-protocol array; C-contiguous; read in place, held while the object
// lives), or a Python sequence of ints (each an int32; copied into storage_). data() is
// never NULL, so that kvgc, not the binding, judges an empty list (n_tokens 0).
class TokenIds {
 public:
  TokenIds(nb::handle obj, const char* name) {
    PyObject* o = obj.ptr();
    const bool array = !PyList_Check(o) && !PyTuple_Check(o) &&
                       (PyObject_CheckBuffer(o) || PyObject_HasAttrString(o, "__dlpack__"));
    if (array) {
      const View& a = view_.emplace(obj, name, false);  // held: the ids are read in place
      if (a.device_type() != nb::device::cpu::value) {
        invalid(std::string(name) + " is on " +
                (a.device_type() == nb::device::cuda::value
                     ? "cuda:" + std::to_string(a.device_id())
                     : "device type " + std::to_string(a.device_type())) +
                "; token ids are read on the host: pass a CPU array or a sequence of ints");
      }
      data_ = static_cast<const int32_t*>(
          checked(a, name, kI32, {-1}, Where{nb::device::cpu::value, 0}, &n_));
      if (!data_) data_ = &empty_;
      return;
    }
    if (!PySequence_Check(o) || PyUnicode_Check(o) || PyDict_Check(o)) {
      throw nb::type_error((std::string(name) + " must be a 1-D int32 array or a sequence of "
                            "ints, not " + nb::inst_name(obj).c_str()).c_str());
    }
    nb::object seq = nb::steal(PySequence_Fast(o, name));
    if (!seq.is_valid()) throw nb::python_error();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
    storage_.resize(size_t(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      const std::string at = std::string(name) + "[" + std::to_string(i) + "]";
      nb::object index = nb::steal(PyNumber_Index(items[i]));
      if (!index.is_valid()) {
        PyErr_Clear();
        throw nb::type_error(
            (at + " must be an int, not " + nb::inst_name(items[i]).c_str()).c_str());
      }
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
      if (overflow || v < INT32_MIN || v > INT32_MAX) {
        invalid(at + " = " + nb::repr(index).c_str() + " is not an int32 token id");
      }
      storage_[size_t(i)] = int32_t(v);
    }
    n_ = uint64_t(n);
    data_ = storage_.empty() ? &empty_ : storage_.data();
  }
  const int32_t* data() const { return data_; }
  uint64_t size() const { return n_; }

 private:
  std::optional<View> view_;
  std::vector<int32_t> storage_;
  const int32_t* data_ = nullptr;
  uint64_t n_ = 0;
  int32_t empty_ = 0;
};

// Runs one kvgc call with the GIL released (the heap has its own lock), so other Python
// threads run while kvgc works.
template <class F>
kvgc_status without_gil(F&& call) {
  nb::gil_scoped_release release;
  return call();
}

class Batch;

class Heap {
 public:
  Heap(uint32_t n_layers, uint32_t n_q_heads, uint32_t n_kv_heads, uint32_t head_dim, int dtype,
       const nb::dict& options) {
    kvgc_model_desc_init(&model_);
    model_.n_layers = n_layers;
    model_.n_q_heads = n_q_heads;
    model_.n_kv_heads = n_kv_heads;
    model_.head_dim = head_dim;
    model_.dtype = kvgc_dtype(dtype);
    kvgc_heap_options opts;
    kvgc_heap_options_init(&opts);
    std::vector<float> weights;
    fill_options(options, &opts, &weights);
    kvgc_status st = without_gil([&] { return kvgc_heap_create(&model_, &opts, &heap_); });
    check_status(st, nullptr, "kvgc_heap_create");
    kvgc_heap_options eff;
    kvgc_heap_options_init(&eff);
    kvgc_heap_get_options(heap_, &eff);
    where_.device_type = eff.device == KVGC_DEVICE_CUDA ? nb::device::cuda::value
                                                        : nb::device::cpu::value;
    where_.device_id = eff.cuda_device;
  }
  ~Heap() { close(); }
  Heap(const Heap&) = delete;
  Heap& operator=(const Heap&) = delete;

  void close();
  bool closed() const { return heap_ == nullptr; }

  kvgc_heap* get() const {
    if (!heap_) invalid("the heap is closed (Heap.close() was called)");
    return heap_;
  }
  const kvgc_model_desc& model() const { return model_; }
  const Where& where() const { return where_; }
  void forget(Batch* b) { batches_.erase(std::remove(batches_.begin(), batches_.end(), b), batches_.end()); }
  void remember(Batch* b) { batches_.push_back(b); }

  uint64_t new_sequence(uint32_t tenant) {
    kvgc_seq s = 0;
    check_status(kvgc_seq_create(get(), tenant, &s), heap_, "kvgc_seq_create");
    return s;
  }
  void free_sequence(uint64_t seq) {
    kvgc_heap* h = get();
    kvgc_status st = without_gil([&] { return kvgc_seq_destroy(h, seq); });
    check_status(st, h, "kvgc_seq_destroy");
  }
  uint64_t fork(uint64_t seq, uint32_t tenant, uintptr_t stream) {
    kvgc_heap* h = get();
    kvgc_seq out = 0;
    kvgc_status st = without_gil([&] { return kvgc_seq_fork(h, seq, tenant, &out, reinterpret_cast<void*>(stream)); });
    check_status(st, h, "kvgc_seq_fork");
    return out;
  }
  // The prefix cache (0.7).
  uint64_t prefix_keep(uint64_t seq, nb::handle ids_obj, uint64_t salt, uint32_t flags,
                       uintptr_t stream) {
    const TokenIds ids(ids_obj, "token_ids");
    kvgc_heap* h = get();
    kvgc_prefix out = 0;
    kvgc_status st = without_gil([&] {
      return kvgc_prefix_keep(h, seq, ids.data(), ids.size(), salt, flags, &out,
                              reinterpret_cast<void*>(stream));
    });
    check_status(st, h, "kvgc_prefix_keep");
    return out;
  }
  uint64_t prefix_attach(uint64_t seq, nb::handle ids_obj, uint64_t salt, uintptr_t stream) {
    const TokenIds ids(ids_obj, "token_ids");
    kvgc_heap* h = get();
    uint64_t n = 0;
    kvgc_status st = without_gil([&] {
      return kvgc_prefix_attach(h, seq, ids.data(), ids.size(), salt, &n,
                                reinterpret_cast<void*>(stream));
    });
    check_status(st, h, "kvgc_prefix_attach");
    return n;
  }
  void prefix_pin(uint64_t prefix, bool pinned) {
    check_status(kvgc_prefix_pin(get(), prefix, pinned ? 1 : 0), heap_, "kvgc_prefix_pin");
  }
  void prefix_drop(uint64_t prefix) {
    kvgc_heap* h = get();
    kvgc_status st = without_gil([&] { return kvgc_prefix_drop(h, prefix); });
    check_status(st, h, "kvgc_prefix_drop");
  }
  std::tuple<uint64_t, uint64_t> tokens(uint64_t seq, uint32_t layer) {
    uint64_t live = 0, length = 0;
    check_status(kvgc_seq_tokens(get(), seq, layer, &live, &length), heap_, "kvgc_seq_tokens");
    return {live, length};
  }

  void append(uint64_t seq, uint32_t layer, nb::handle k_obj, nb::handle v_obj, uintptr_t stream) {
    const View k(k_obj, "k", false), v(v_obj, "v", false);
    kvgc_heap* h = get();
    uint64_t n = 0;
    const nb::dlpack::dtype dt = dtype_of(model_.dtype);
    const int64_t kvh = model_.n_kv_heads, hd = model_.head_dim;
    void* kp = checked(k, "k", dt, {-1, kvh, hd}, where_, &n);
    void* vp = checked(v, "v", dt, {int64_t(n), kvh, hd}, where_);
    const uint32_t n32 = to_u32(n, "k.shape[0]");
    kvgc_status st = without_gil([&] { return kvgc_append(h, seq, layer, kp, vp, n32, reinterpret_cast<void*>(stream)); });
    check_status(st, h, "kvgc_append");
  }

  void attend(uint64_t seq, uint32_t layer, nb::handle q_obj, nb::handle out_obj, float scale,
              uint32_t flags, uintptr_t stream) {
    const View q(q_obj, "q", false), out(out_obj, "out", true);
    kvgc_heap* h = get();
    uint64_t n = 0;
    const nb::dlpack::dtype dt = dtype_of(model_.dtype);
    const int64_t qh = model_.n_q_heads, hd = model_.head_dim;
    void* qp = checked(q, "q", dt, {-1, qh, hd}, where_, &n);
    void* op = checked(out, "out", dt, {int64_t(n), qh, hd}, where_);
    const uint32_t n32 = to_u32(n, "q.shape[0]");
    kvgc_attend_params params;
    kvgc_attend_params_init(&params);
    params.scale = scale;
    params.flags = flags;
    kvgc_status st = without_gil([&] { return kvgc_attend(h, seq, layer, qp, n32, op, &params, reinterpret_cast<void*>(stream)); });
    check_status(st, h, "kvgc_attend");
  }

  void observe(uint64_t seq, uint32_t layer, nb::handle mass_obj, uintptr_t stream) {
    const View mass(mass_obj, "mass", false);
    kvgc_heap* h = get();
    uint64_t n = 0;
    void* mp = checked(mass, "mass", kF32, {-1}, where_, &n);
    kvgc_status st = without_gil([&] { return kvgc_observe(h, seq, layer, static_cast<const float*>(mp), n,
                        reinterpret_cast<void*>(stream)); });
    check_status(st, h, "kvgc_observe");
  }

  // KVGC_OK or KVGC_EBUDGET (advisory); any other failure raises.
  int step(uint64_t seq, uintptr_t stream) {
    kvgc_heap* h = get();
    kvgc_status st = without_gil([&] { return kvgc_step(h, seq, reinterpret_cast<void*>(stream)); });
    if (st != KVGC_EBUDGET) check_status(st, h, "kvgc_step");
    return st;
  }

  // Outputs may be None; returns the live count (capacity: the outputs' first dimension).
  uint64_t read(uint64_t seq, uint32_t layer, nb::object k_out, nb::object v_out,
                nb::object pos_out, uintptr_t stream) {
    kvgc_heap* h = get();
    const nb::dlpack::dtype dt = dtype_of(model_.dtype);
    const int64_t kvh = model_.n_kv_heads, hd = model_.head_dim;
    uint64_t cap = UINT64_MAX;
    void *kp = nullptr, *vp = nullptr;
    int32_t* pp = nullptr;
    const auto take = [&](nb::object o, const char* name, nb::dlpack::dtype t,
                          std::vector<int64_t> shape) -> void* {
      if (o.is_none()) return nullptr;
      const View a(o, name, true);
      uint64_t n = 0;
      void* p = checked(a, name, t, std::move(shape), where_, &n);
      cap = std::min(cap, n);
      return p;
    };
    kp = take(k_out, "k_out", dt, {-1, kvh, hd});
    vp = take(v_out, "v_out", dt, {-1, kvh, hd});
    pp = static_cast<int32_t*>(take(pos_out, "pos_out", kI32, {-1}));
    if (cap == UINT64_MAX) cap = 0;
    uint64_t n = 0;
    kvgc_status st = without_gil([&] { return kvgc_read(h, seq, layer, kp, vp, pp, cap, &n, reinterpret_cast<void*>(stream)); });
    if (st == KVGC_EINVAL && n > cap && (kp || vp || pp)) {
      invalid("the outputs hold " + std::to_string(cap) + " rows; the segment has " +
              std::to_string(n) + " live tokens");
    }
    if (!(kp || vp || pp) && st == KVGC_EINVAL && n > 0) st = KVGC_OK;  // a count query
    check_status(st, h, "kvgc_read");
    return n;
  }

  uint64_t read_scores(uint64_t seq, uint32_t layer, nb::object scores, nb::object gens,
                       uintptr_t stream) {
    kvgc_heap* h = get();
    uint64_t cap = UINT64_MAX;
    float* sp = nullptr;
    uint8_t* gp = nullptr;
    uint64_t n = 0;
    if (!scores.is_none()) {
      sp = static_cast<float*>(checked(View(scores, "scores_out", true), "scores_out", kF32, {-1}, where_, &n));
      cap = std::min(cap, n);
    }
    if (!gens.is_none()) {
      gp = static_cast<uint8_t*>(checked(View(gens, "gen_out", true), "gen_out", kU8, {-1}, where_, &n));
      cap = std::min(cap, n);
    }
    if (cap == UINT64_MAX) cap = 0;
    kvgc_status st = without_gil([&] { return kvgc_read_scores(h, seq, layer, sp, gp, cap, &n, reinterpret_cast<void*>(stream)); });
    if (st == KVGC_EINVAL && n > cap && (sp || gp)) {
      invalid("the outputs hold " + std::to_string(cap) + " rows; the segment has " +
              std::to_string(n) + " live tokens");
    }
    if (!(sp || gp) && st == KVGC_EINVAL && n > 0) st = KVGC_OK;
    check_status(st, h, "kvgc_read_scores");
    return n;
  }

  uint64_t read_classes(uint64_t seq, uint32_t layer, nb::object cls, uintptr_t stream) {
    kvgc_heap* h = get();
    uint64_t cap = 0, n = 0;
    uint8_t* cp = nullptr;
    if (!cls.is_none()) {
      cp = static_cast<uint8_t*>(checked(View(cls, "cls_out", true), "cls_out", kU8, {-1}, where_, &cap));
    }
    kvgc_status st = without_gil([&] { return kvgc_read_classes(h, seq, layer, cp, cap, &n, reinterpret_cast<void*>(stream)); });
    if (st == KVGC_EINVAL && n > cap && cp) {
      invalid("cls_out holds " + std::to_string(cap) + " rows; the segment has " +
              std::to_string(n) + " live tokens");
    }
    if (!cp && st == KVGC_EINVAL && n > 0) st = KVGC_OK;
    check_status(st, h, "kvgc_read_classes");
    return n;
  }

  void check() {
    kvgc_heap* h = get();
    kvgc_status st = without_gil([&] { return kvgc_heap_check(h); });
    check_status(st, h, "kvgc_heap_check");
  }

  void tenant_limit(uint32_t tenant, uint64_t max_bytes) {
    check_status(kvgc_tenant_set_limit(get(), tenant, max_bytes), heap_, "kvgc_tenant_set_limit");
  }
  std::tuple<uint64_t, uint64_t> tenant_usage(uint32_t tenant) {
    uint64_t bytes = 0, limit = 0;
    check_status(kvgc_tenant_usage(get(), tenant, &bytes, &limit), heap_, "kvgc_tenant_usage");
    return {bytes, limit};
  }

  // kvgc_attend `reps` times in a C++ loop: the C call alone, for the binding benchmark.
  double time_attend(uint64_t seq, uint32_t layer, nb::handle q_obj, nb::handle out_obj,
                     uint32_t reps) {
    const View q(q_obj, "q", false), out(out_obj, "out", true);
    kvgc_heap* h = get();
    uint64_t n = 0;
    const nb::dlpack::dtype dt = dtype_of(model_.dtype);
    void* qp = checked(q, "q", dt, {-1, int64_t(model_.n_q_heads), int64_t(model_.head_dim)}, where_, &n);
    void* op = checked(out, "out", dt, {int64_t(n), int64_t(model_.n_q_heads), int64_t(model_.head_dim)}, where_);
    kvgc_attend_params params;
    kvgc_attend_params_init(&params);
    nb::gil_scoped_release release;
    const auto t0 = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < reps; ++i) {
      if (kvgc_attend(h, seq, layer, qp, uint32_t(n), op, &params, nullptr) != KVGC_OK) break;
    }
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / (reps ? reps : 1);
  }

  nb::dict stats();
  nb::dict options();
  nb::dict page_layout(int cls);

 private:
  static void fill_options(const nb::dict& d, kvgc_heap_options* o, std::vector<float>* weights);

  kvgc_model_desc model_{};
  kvgc_heap* heap_ = nullptr;
  Where where_{nb::device::cpu::value, 0};
  std::vector<Batch*> batches_;
};

class Batch {
 public:
  explicit Batch(Heap& heap) : heap_(&heap) {
    kvgc_heap* h = heap.get();
    check_status(kvgc_batch_create(h, &batch_), h, "kvgc_batch_create");
    heap.remember(this);
  }
  ~Batch() {
    close();
  }
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;

  void close() {
    if (batch_) {
      kvgc_batch_destroy(batch_);
      batch_ = nullptr;
    }
    if (heap_) {
      heap_->forget(this);
      heap_ = nullptr;
    }
  }
  bool closed() const { return batch_ == nullptr; }

  // scored_rows / seq_flags: empty for none (kvgc_batch_plan_ex's NULL).
  void plan(const std::vector<uint64_t>& seqs, const std::vector<uint32_t>& n_new,
            const std::vector<uint32_t>& scored_rows, const std::vector<uint32_t>& seq_flags,
            uintptr_t stream) {
    kvgc_heap* h = heap();
    if (seqs.size() != n_new.size()) {
      invalid("seqs has " + std::to_string(seqs.size()) + " entries and n_new " +
              std::to_string(n_new.size()) + "; they must match");
    }
    if (!scored_rows.empty() && scored_rows.size() != seqs.size()) {
      invalid("scored_rows has " + std::to_string(scored_rows.size()) + " entries and seqs " +
              std::to_string(seqs.size()) + "; they must match");
    }
    if (!seq_flags.empty() && seq_flags.size() != seqs.size()) {
      invalid("seq_flags has " + std::to_string(seq_flags.size()) + " entries and seqs " +
              std::to_string(seqs.size()) + "; they must match");
    }
    kvgc_batch_plan_options opts;
    kvgc_batch_plan_options_init(&opts);
    opts.scored_rows = scored_rows.empty() ? nullptr : scored_rows.data();
    opts.seq_flags = seq_flags.empty() ? nullptr : seq_flags.data();
    const uint32_t n = to_u32(seqs.size(), "len(seqs)");
    uint64_t rows = 0;
    for (uint32_t x : n_new) rows += x;
    uint32_t failed = UINT32_MAX;
    kvgc_status st = without_gil([&] { return kvgc_batch_plan_ex(batch_, seqs.data(), n_new.data(), n, &opts, &failed,
                              reinterpret_cast<void*>(stream)); });
    if (st == KVGC_OK) {
      rows_ = rows;
    } else {
      rows_ = 0;
      check_status(st, h, "kvgc_batch_plan", failed == UINT32_MAX ? -1 : long(failed));
    }
  }

  void append(uint32_t layer, nb::handle k_obj, nb::handle v_obj, uintptr_t stream) {
    const View k(k_obj, "k", false), v(v_obj, "v", false);
    kvgc_heap* h = heap();
    const kvgc_model_desc& m = heap_->model();
    const nb::dlpack::dtype dt = dtype_of(m.dtype);
    const int64_t rows = int64_t(rows_), kvh = m.n_kv_heads, hd = m.head_dim;
    void* kp = checked(k, "k", dt, {rows, kvh, hd}, heap_->where());
    void* vp = checked(v, "v", dt, {rows, kvh, hd}, heap_->where());
    kvgc_status st = without_gil([&] { return kvgc_batch_append(batch_, layer, kp, vp, reinterpret_cast<void*>(stream)); });
    check_status(st, h, "kvgc_batch_append");
  }

  void attend(uint32_t layer, nb::handle q_obj, nb::handle out_obj, float scale, uint32_t flags,
              nb::handle mass_obj, uintptr_t stream) {
    const View q(q_obj, "q", false), out(out_obj, "out", true);
    kvgc_heap* h = heap();
    const kvgc_model_desc& m = heap_->model();
    const nb::dlpack::dtype dt = dtype_of(m.dtype);
    const int64_t rows = int64_t(rows_), qh = m.n_q_heads, hd = m.head_dim;
    void* qp = checked(q, "q", dt, {rows, qh, hd}, heap_->where());
    void* op = checked(out, "out", dt, {rows, qh, hd}, heap_->where());
    kvgc_attend_params params;
    kvgc_attend_params_init(&params);
    params.scale = scale;
    params.flags = flags;
    std::optional<View> mass;
    if (!mass_obj.is_none()) {  // [n_pages, page_tokens] of this layer's view
      kvgc_batch_view view;
      std::memset(&view, 0, sizeof view);
      view.struct_size = sizeof view;
      check_status(kvgc_batch_export(batch_, layer, &view), h, "kvgc_batch_attend");
      mass.emplace(mass_obj, "mass", true);
      params.mass_out = static_cast<float*>(
          checked(*mass, "mass", kF32, {int64_t(view.n_pages), int64_t(view.page_tokens)}, heap_->where()));
    }
    kvgc_status st = without_gil([&] { return kvgc_batch_attend(batch_, layer, qp, op, &params, reinterpret_cast<void*>(stream)); });
    check_status(st, h, "kvgc_batch_attend");
  }

  void observe(uint32_t layer, nb::handle mass_obj, uintptr_t stream) {
    const View mass(mass_obj, "mass", false);
    kvgc_heap* h = heap();
    kvgc_batch_view view;
    std::memset(&view, 0, sizeof view);
    view.struct_size = sizeof view;
    check_status(kvgc_batch_export(batch_, layer, &view), h, "kvgc_batch_observe");
    void* mp = checked(mass, "mass", kF32, {int64_t(view.n_pages), int64_t(view.page_tokens)},
                       heap_->where());
    kvgc_status st = without_gil([&] { return kvgc_batch_observe(batch_, layer, static_cast<const float*>(mp),
                              reinterpret_cast<void*>(stream)); });
    check_status(st, h, "kvgc_batch_observe");
  }

  // The pages of `layer`'s view (kvgc_batch_export's n_pages), without its arrays.
  uint32_t pages(uint32_t layer) {
    kvgc_heap* h = heap();
    kvgc_batch_view view;
    std::memset(&view, 0, sizeof view);
    view.struct_size = sizeof view;
    check_status(kvgc_batch_export(batch_, layer, &view), h, "kvgc_batch_export");
    return view.n_pages;
  }

  int step(uintptr_t stream) {
    kvgc_heap* h = heap();
    kvgc_status st = without_gil([&] { return kvgc_batch_step(batch_, reinterpret_cast<void*>(stream)); });
    rows_ = 0;
    if (st != KVGC_EBUDGET) check_status(st, h, "kvgc_batch_step");
    return st;
  }

  nb::dict export_view(uint32_t layer);

 private:
  kvgc_heap* heap() const {
    if (!batch_ || !heap_) invalid("the batch is closed (Batch.close() or Heap.close() was called)");
    return heap_->get();
  }

  Heap* heap_;
  kvgc_batch* batch_ = nullptr;
  uint64_t rows_ = 0;
};

void Heap::close() {
  // The heap must outlive its batches (kvgc.h): close them first.
  while (!batches_.empty()) batches_.back()->close();
  if (heap_) {
    kvgc_heap_destroy(heap_);
    heap_ = nullptr;
  }
}

template <typename T>
nb::object numpy_copy(const T* data, size_t n, nb::handle numpy_empty, const char* dtype) {
  nb::object arr = numpy_empty(n, "dtype"_a = dtype);
  if (n) {
    OutArray a = nb::cast<OutArray>(arr);
    std::memcpy(a.data(), data, n * sizeof(T));
  }
  return arr;
}

nb::dict Batch::export_view(uint32_t layer) {
  kvgc_heap* h = heap();
  kvgc_batch_view v;
  std::memset(&v, 0, sizeof v);
  v.struct_size = sizeof v;
  check_status(kvgc_batch_export(batch_, layer, &v), h, "kvgc_batch_export");
  nb::dict d;
  d["n_seqs"] = v.n_seqs;
  d["n_pages"] = v.n_pages;
  d["n_rows"] = v.n_rows;
  d["page_tokens"] = v.page_tokens;
  d["arena_base"] = reinterpret_cast<uintptr_t>(v.arena_base);
  if (heap_->where().device_type == nb::device::cpu::value) {
    // Host arrays: copied out, so they stay valid after the plan is spent.
    nb::object empty = nb::module_::import_("numpy").attr("empty");
    d["page_indptr"] = numpy_copy(v.page_indptr, v.n_seqs + 1, empty, "uint32");
    d["page_offset"] = numpy_copy(v.page_offset, v.n_pages, empty, "uint64");
    d["page_class"] = numpy_copy(v.page_class, v.n_pages, empty, "uint8");
    d["q_indptr"] = numpy_copy(v.q_indptr, v.n_seqs + 1, empty, "uint32");
    d["q_pos0"] = numpy_copy(v.q_pos0, v.n_seqs, empty, "int32");
    d["kv_offset"] = numpy_copy(v.kv_offset, v.n_pages, empty, "uint64");
  } else {
    // Device arrays: their addresses, valid until the plan is spent or stale.
    d["page_indptr"] = reinterpret_cast<uintptr_t>(v.page_indptr);
    d["page_offset"] = reinterpret_cast<uintptr_t>(v.page_offset);
    d["page_class"] = reinterpret_cast<uintptr_t>(v.page_class);
    d["q_indptr"] = reinterpret_cast<uintptr_t>(v.q_indptr);
    d["q_pos0"] = reinterpret_cast<uintptr_t>(v.q_pos0);
    d["kv_offset"] = reinterpret_cast<uintptr_t>(v.kv_offset);
  }
  return d;
}

// ---- options ------------------------------------------------------------------------
// Every kvgc_heap_options field the binding exchanges with Python, listed once: keys are
// the fields' names; values arrive normalised by the Python layer (enums as ints), so
// reading them only range-checks what C's types cannot hold.
#define KVGC_PY_OPTIONS(X)                                                                 \
  X(flags, uint32_t) X(device, kvgc_device) X(cuda_device, int) X(budget_bytes, uint64_t)  \
  X(budget_fraction, double) X(policy, kvgc_policy) X(token_budget, uint64_t)              \
  X(token_budget_fraction, double) X(sinks, uint32_t) X(window, uint32_t)                  \
  X(page_tokens, uint32_t) X(compact_threshold, double) X(demote, kvgc_demote)             \
  X(layer_budget, kvgc_layer_budget) X(score_noise, double) X(seed, uint64_t)              \
  X(slab_bytes, uint32_t) X(verbose, int) X(harvest, kvgc_harvest) X(cpu_threads, uint32_t) \
  X(byte_budget, uint64_t) X(byte_budget_fraction, double) X(recent_decay, double)         \
  X(first_layer, uint32_t) X(total_layers, uint32_t) X(prefix_charge, kvgc_prefix_charge)  \
  X(window_min, uint32_t) X(min_length, uint32_t)

template <typename T>
T option_from(nb::handle value, const char* name) {
  if constexpr (std::is_enum_v<T> || std::is_same_v<T, uint32_t>) {
    return T(to_u32(nb::cast<uint64_t>(value), name));
  } else {
    return nb::cast<T>(value);
  }
}

template <typename T>
nb::object option_to(T value) {
  if constexpr (std::is_enum_v<T>) {
    return nb::int_(int(value));
  } else {
    return nb::cast(value);
  }
}

void Heap::fill_options(const nb::dict& d, kvgc_heap_options* o, std::vector<float>* weights) {
  for (auto [key_h, value] : d) {
    const std::string key = nb::cast<std::string>(key_h);
    if (value.is_none()) continue;
#define KVGC_PY_READ(f, T) \
    if (key == #f) {       \
      o->f = option_from<T>(value, #f); continue; }
    KVGC_PY_OPTIONS(KVGC_PY_READ)
#undef KVGC_PY_READ
    if (key == "layer_weights") {
      *weights = nb::cast<std::vector<float>>(value);
      o->layer_weights = weights->data();
      o->n_layer_weights = to_u32(weights->size(), "len(layer_weights)");
      continue;
    }
    invalid("unknown heap option '" + key + "'");
  }
}

nb::dict Heap::options() {
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  check_status(kvgc_heap_get_options(get(), &o), heap_, "kvgc_heap_get_options");
  nb::dict d;
#define KVGC_PY_WRITE(f, T) d[#f] = option_to<T>(o.f);
  KVGC_PY_OPTIONS(KVGC_PY_WRITE)
#undef KVGC_PY_WRITE
  return d;
}

nb::dict class_stats(const kvgc_class_stats& c) {
  nb::dict d;
  d["page_bytes"] = c.page_bytes;
  d["slabs"] = c.slabs;
  d["reserved_bytes"] = c.reserved_bytes;
  d["used_bytes"] = c.used_bytes;
  d["free_bytes"] = c.free_bytes;
  d["pages_used"] = c.pages_used;
  d["pages_free"] = c.pages_free;
  return d;
}

nb::dict Heap::stats() {
  kvgc_stats s;
  kvgc_stats_init(&s);
  check_status(kvgc_get_stats(get(), &s), heap_, "kvgc_get_stats");
  nb::dict d;
#define KVGC_STAT(f) d[#f] = s.f
  KVGC_STAT(version);
  d["device"] = int(s.device);
  KVGC_STAT(arena_bytes); KVGC_STAT(slab_bytes); KVGC_STAT(slabs_total); KVGC_STAT(slabs_free);
  KVGC_STAT(free_bytes); KVGC_STAT(sequences); KVGC_STAT(segments); KVGC_STAT(live_tokens);
  KVGC_STAT(slots_held); KVGC_STAT(dead_slots); KVGC_STAT(fragmentation); KVGC_STAT(appends);
  KVGC_STAT(tokens_appended); KVGC_STAT(pages_allocated); KVGC_STAT(pages_freed);
  KVGC_STAT(slabs_acquired); KVGC_STAT(slabs_released); KVGC_STAT(enomem); KVGC_STAT(steps);
  KVGC_STAT(observes); KVGC_STAT(gcs); KVGC_STAT(minor_gcs); KVGC_STAT(major_gcs);
  KVGC_STAT(tokens_ranked); KVGC_STAT(tokens_evicted); KVGC_STAT(tokens_demoted);
  KVGC_STAT(tokens_promoted); KVGC_STAT(tokens_tenured); KVGC_STAT(compactions);
  KVGC_STAT(slots_moved); KVGC_STAT(bytes_moved); KVGC_STAT(ebudget); KVGC_STAT(attends);
  KVGC_STAT(scratch_bytes);
#undef KVGC_STAT
  d["tier_tokens"] = nb::make_tuple(s.tier_tokens[0], s.tier_tokens[1], s.tier_tokens[2],
                                    s.tier_tokens[3]);
  d["tokens_demoted_to"] = nb::make_tuple(s.tokens_demoted_to[0], s.tokens_demoted_to[1],
                                          s.tokens_demoted_to[2], s.tokens_demoted_to_int2);
  nb::dict cls;
  cls["fp16"] = class_stats(s.cls[KVGC_CLASS_FP16]);
  cls["int4"] = class_stats(s.cls[KVGC_CLASS_INT4]);
  cls["int8"] = class_stats(s.cls_int8);
  cls["int2"] = class_stats(s.cls_int2);
  d["classes"] = cls;
  d["cls_header"] = class_stats(s.cls_header);
  // Pages in use, header pages included: arena_bytes - scratch_bytes - free_bytes.
  d["used_bytes"] = s.cls[KVGC_CLASS_FP16].used_bytes + s.cls[KVGC_CLASS_INT4].used_bytes +
                    s.cls_int8.used_bytes + s.cls_int2.used_bytes + s.cls_header.used_bytes;
#define KVGC_STAT(f) d[#f] = s.f
  KVGC_STAT(shared_pages); KVGC_STAT(shared_bytes); KVGC_STAT(shared_refs); KVGC_STAT(prefixes);
  KVGC_STAT(prefixes_pinned); KVGC_STAT(prefix_lookups); KVGC_STAT(prefix_hits);
  KVGC_STAT(prefix_tokens_attached); KVGC_STAT(prefix_evictions); KVGC_STAT(pages_shared);
  KVGC_STAT(cow_copies);
  KVGC_STAT(cached_only_bytes); KVGC_STAT(pages_migrated); KVGC_STAT(slabs_evacuated);
  KVGC_STAT(pages_shrunk); KVGC_STAT(bytes_shrunk);
  KVGC_STAT(gcs_short_of_pages); KVGC_STAT(demote_slots_short);
  KVGC_STAT(pages_unshared);
#undef KVGC_STAT
  return d;
}

nb::dict Heap::page_layout(int cls) {
  kvgc_page_layout l;
  std::memset(&l, 0, sizeof l);
  l.struct_size = sizeof l;
  check_status(kvgc_page_layout_get(get(), kvgc_storage_class(cls), &l), heap_,
               "kvgc_page_layout_get");
  nb::dict d;
#define KVGC_FIELD(f) d[#f] = l.f
  KVGC_FIELD(version);
  d["cls"] = int(l.cls);
  d["dtype"] = int(l.dtype);
  KVGC_FIELD(page_tokens); KVGC_FIELD(n_kv_heads); KVGC_FIELD(head_dim); KVGC_FIELD(group);
  KVGC_FIELD(qwords); KVGC_FIELD(page_bytes); KVGC_FIELD(live_offset); KVGC_FIELD(pos_offset);
  KVGC_FIELD(score_offset); KVGC_FIELD(recent_offset); KVGC_FIELD(gen_offset);
  KVGC_FIELD(k_offset); KVGC_FIELD(v_offset); KVGC_FIELD(kq_offset); KVGC_FIELD(vq_offset);
  KVGC_FIELD(head_stride); KVGC_FIELD(slot_stride);
#undef KVGC_FIELD
  return d;
}

uint64_t kv_bytes(uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim, int dtype,
                  uint64_t tokens, int cls, uint32_t page_tokens) {
  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  m.n_layers = n_layers;
  m.n_q_heads = n_kv_heads;
  m.n_kv_heads = n_kv_heads;
  m.head_dim = head_dim;
  m.dtype = kvgc_dtype(dtype);
  uint64_t bytes = 0;
  check_status(kvgc_kv_bytes(&m, tokens, kvgc_storage_class(cls), page_tokens, &bytes), nullptr,
               "kvgc_kv_bytes");
  return bytes;
}

}  // namespace

NB_MODULE(_kvgc, m) {
  m.doc() = "kvgc's C API (kvgc.h), bound with nanobind. Use the `kvgc` package, not this.";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const KvgcError& e) {
      nb::object cls = g_error_types.is_valid() ? g_error_types.attr("get")(e.status, nb::none())
                                                : nb::none();
      if (cls.is_none()) {
        PyErr_SetString(PyExc_RuntimeError, e.message.c_str());
        return;
      }
      nb::object exc = cls(e.message, e.status, e.failed_index);
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });

  m.def("_set_error_types", [](nb::dict types) { g_error_types = types.release(); },
        "Registers the exception class for each status (called once by kvgc._errors).");
  m.def("version", [] { return std::string(kvgc_version()); },
        "The library's version string (kvgc_version()).");
  m.def("version_number", [] { return kvgc_version_number(); });
  m.attr("HEADER_VERSION") = KVGC_VERSION_STRING;
  m.attr("PAGE_LAYOUT_VERSION") = KVGC_PAGE_LAYOUT_VERSION;
  m.attr("STATS_VERSION") = KVGC_STATS_VERSION;
  m.attr("BATCH_SEQ_DEFER_STEP") = KVGC_BATCH_SEQ_DEFER_STEP;
  m.attr("PREFIX_PIN") = KVGC_PREFIX_PIN;
  m.def("status_str", [](int s) { return std::string(kvgc_status_str(s)); });
  m.def("errmsg", [] { return std::string(kvgc_errmsg(nullptr)); },
        "The calling thread's last kvgc error message.");
  m.def("data_pointer", [](nb::handle a) { return reinterpret_cast<uintptr_t>(View(a, "array", false).data()); },
        "The address kvgc would read `a` at (a diagnostic: equal to tensor.data_ptr() or "
        "array.ctypes.data, since arrays cross without a copy).");
  m.def("kv_bytes", &kv_bytes, "n_layers"_a, "n_kv_heads"_a, "head_dim"_a, "dtype"_a,
        "tokens"_a, "cls"_a, "page_tokens"_a);

  nb::class_<Heap>(m, "Heap")
      .def(nb::init<uint32_t, uint32_t, uint32_t, uint32_t, int, const nb::dict&>(),
           "n_layers"_a, "n_q_heads"_a, "n_kv_heads"_a, "head_dim"_a, "dtype"_a, "options"_a)
      .def("close", &Heap::close,
           "Frees every sequence, batch and the arena. Idempotent; the heap is unusable after.")
      .def_prop_ro("closed", &Heap::closed, "True once close() was called.")
      .def("new_sequence", &Heap::new_sequence, "tenant"_a = 0,
           "A new empty sequence of `tenant`; returns its id (an int, never 0, never reused).")
      .def("free_sequence", &Heap::free_sequence, "seq"_a,
           "Frees the sequence's pages at once (NotFound for an unknown id).")
      .def("_fork", &Heap::fork, "seq"_a, "tenant"_a, "stream"_a)
      .def("_prefix_keep", &Heap::prefix_keep, "seq"_a, "token_ids"_a, "salt"_a, "flags"_a,
           "stream"_a)
      .def("_prefix_attach", &Heap::prefix_attach, "seq"_a, "token_ids"_a, "salt"_a, "stream"_a)
      .def("_prefix_pin", &Heap::prefix_pin, "prefix"_a, "pinned"_a)
      .def("_prefix_drop", &Heap::prefix_drop, "prefix"_a)
      .def("tokens", &Heap::tokens, "seq"_a, "layer"_a,
           "(live, length) of segment (seq, layer): live tokens, and tokens ever appended\n"
           "(the logical length positions continue from).")
      .def("_append", &Heap::append, "seq"_a, "layer"_a, "k"_a, "v"_a, "stream"_a)
      .def("_attend", &Heap::attend, "seq"_a, "layer"_a, "q"_a, "out"_a, "scale"_a, "flags"_a,
           "stream"_a)
      .def("_observe", &Heap::observe, "seq"_a, "layer"_a, "mass"_a, "stream"_a)
      .def("_step", &Heap::step, "seq"_a, "stream"_a)
      .def("_read", &Heap::read, "seq"_a, "layer"_a, "k_out"_a.none(), "v_out"_a.none(),
           "pos_out"_a.none(), "stream"_a)
      .def("_read_scores", &Heap::read_scores, "seq"_a, "layer"_a, "scores_out"_a.none(),
           "gen_out"_a.none(), "stream"_a)
      .def("_read_classes", &Heap::read_classes, "seq"_a, "layer"_a, "cls_out"_a.none(),
           "stream"_a)
      .def("check", &Heap::check,
           "Walks every invariant of the heap (kvgc_heap_check); InternalError on a violation.")
      .def("tenant_limit", &Heap::tenant_limit, "tenant"_a, "max_bytes"_a,
           "Caps the bytes of pages `tenant`'s sequences hold (0 removes the cap); growth past\n"
           "it raises BudgetExceeded.")
      .def("tenant_usage", &Heap::tenant_usage, "tenant"_a,
           "(bytes held, limit) of `tenant` (limit 0: none).")
      .def("_stats", &Heap::stats)
      .def("_options", &Heap::options)
      .def("_page_layout", &Heap::page_layout, "cls"_a)
      .def("_time_attend", &Heap::time_attend, "seq"_a, "layer"_a, "q"_a, "out"_a, "reps"_a,
           "ns per kvgc_attend call, looped in C++ (bench/python_binding.py).");

  nb::class_<Batch>(m, "Batch")
      .def(nb::init<Heap&>(), "heap"_a, nb::keep_alive<1, 2>())
      .def("close", &Batch::close, "Frees the batch and the pages its plan still reserves.")
      .def_prop_ro("closed", &Batch::closed, "True once closed (or its heap was).")
      .def("_plan", &Batch::plan, "seqs"_a, "n_new"_a, "scored_rows"_a, "seq_flags"_a, "stream"_a)
      .def("_append", &Batch::append, "layer"_a, "k"_a, "v"_a, "stream"_a)
      .def("_attend", &Batch::attend, "layer"_a, "q"_a, "out"_a, "scale"_a, "flags"_a, "mass"_a.none(),
           "stream"_a)
      .def("_pages", &Batch::pages, "layer"_a)
      .def("_observe", &Batch::observe, "layer"_a, "mass"_a, "stream"_a)
      .def("_step", &Batch::step, "stream"_a)
      .def("_export", &Batch::export_view, "layer"_a);
}
