// symkv.torch's op kernels in C++: torch.ops.symkv.all_reduce / all_reduce_ without torch's
// dispatch into a Python kernel (about 5 us a call on an H100 host). Built once per torch
// version by symkv/torch.py with torch.utils.cpp_extension (SKV_TORCH_CPP=0: not built, the
// Python kernels serve). The kernels take the common case only: an open group, a contiguous
// tensor of a supported dtype on the group's device, an op and algo spelled as the Python
// tables spell them. Anything else goes to the Python kernel, which does the same call or
// raises the symkv error the Python API raises; a failed C call raises through Python too, so
// the caller sees one error type (symkv.InvalidArgument, ...) whichever kernel ran.
#include <torch/extension.h>
#include <torch/library.h>

#ifdef SYMKV_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <atomic>
#include <string>
#include <utility>
#include <vector>

namespace {

using allreduce_fn = int (*)(void *comm, const void *in, void *out, size_t count, int dtype, int op,
                             int algo, int channel, void *stream);

// A group as the kernels see it; written by set_group (under the GIL), read by the kernels.
struct group {
  void *comm;
  allreduce_fn fn;
  int device; // CUDA device index, -1: the host backend
};

constexpr int64_t max_groups = 4096; // ids past this are served by the Python kernel
std::atomic<group *> groups[max_groups];

int dtypes[3] = {-1, -1, -1}; // float32, float16, bfloat16
std::vector<std::pair<std::string, int>> ops, algos;

// Never destroyed: the interpreter may be gone when static destructors run.
py::object *fallback_out;     // _all_reduce(x, group, op, algo, channel) -> Tensor
py::object *fallback_inplace; // _all_reduce_(x, group, op, algo, channel) -> None
py::object *raise_rc;         // _raise(rc): raises the symkv error of rc and skv_last_error()

int code_of(const std::vector<std::pair<std::string, int>> &table, c10::string_view s) {
  for (const auto &e : table)
    if (s.size() == e.first.size() && s.compare(e.first) == 0) return e.second;
  return -1;
}

int dtype_of(at::ScalarType t) {
  switch (t) {
  case at::kFloat:
    return dtypes[0];
  case at::kHalf:
    return dtypes[1];
  case at::kBFloat16:
    return dtypes[2];
  default:
    return -1;
  }
}

// The call's arguments, when the fast path takes it.
struct call {
  group *g;
  int dtype, op, algo;
};

bool fast(const at::Tensor &x, int64_t gid, c10::string_view op, c10::string_view algo,
          int64_t channel, call *c) {
  if (gid <= 0 || gid >= max_groups || channel < 0 || channel > INT32_MAX) return false;
  c->g = groups[gid].load(std::memory_order_acquire);
  if (c->g == nullptr || !x.is_contiguous()) return false;
  c->dtype = dtype_of(x.scalar_type());
  c->op = code_of(ops, op);
  c->algo = code_of(algos, algo);
  if (c->dtype < 0 || c->op < 0 || c->algo < 0) return false;
  if (c->g->device < 0) return x.device().is_cpu();
  return x.device().is_cuda() && x.get_device() == c->g->device;
}

void run(const call &c, const at::Tensor &in, const at::Tensor &out, int64_t channel) {
  void *stream = nullptr;
#ifdef SYMKV_TORCH_CUDA
  if (c.g->device >= 0)
    stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(c.g->device)).stream();
#endif
  int rc = c.g->fn(c.g->comm, in.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel()),
                   c.dtype, c.op, c.algo, static_cast<int>(channel), stream);
  if (rc < 0) {
    py::gil_scoped_acquire gil;
    (*raise_rc)(rc); // raises: error_already_set goes back through the dispatcher
  }
}

at::Tensor all_reduce(const at::Tensor &x, int64_t gid, c10::string_view op, c10::string_view algo,
                      int64_t channel) {
  call c;
  if (!fast(x, gid, op, algo, channel, &c)) {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(fallback_out != nullptr, "symkv: set_tables was not called");
    return (*fallback_out)(x, gid, std::string(op), std::string(algo), channel).cast<at::Tensor>();
  }
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() > 0) run(c, x, out, channel);
  return out;
}

void all_reduce_(const at::Tensor &x, int64_t gid, c10::string_view op, c10::string_view algo,
                 int64_t channel) {
  call c;
  if (!fast(x, gid, op, algo, channel, &c)) {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(fallback_inplace != nullptr, "symkv: set_tables was not called");
    (*fallback_inplace)(x, gid, std::string(op), std::string(algo), channel);
    return;
  }
  if (x.numel() > 0) run(c, x, x, channel);
}

void set_group(int64_t gid, uintptr_t comm, uintptr_t fn, int device) {
  TORCH_CHECK_VALUE(gid > 0, "symkv: group id ", gid, " is not positive");
  if (gid >= max_groups) return; // the Python kernel serves it
  group *g = nullptr;
  if (comm != 0)
    g = new group{reinterpret_cast<void *>(comm), reinterpret_cast<allreduce_fn>(fn), device};
  // An old entry is leaked, not freed: a kernel on another thread may still read it (a few
  // bytes per group ever made).
  groups[gid].store(g, std::memory_order_release);
}

void set_tables(std::vector<int> dt, std::vector<std::pair<std::string, int>> o,
                std::vector<std::pair<std::string, int>> a, py::object out, py::object inplace,
                py::object raiser) {
  TORCH_CHECK_VALUE(dt.size() == 3, "symkv: 3 dtype codes expected");
  for (int i = 0; i < 3; i++) dtypes[i] = dt[i];
  ops = std::move(o);
  algos = std::move(a);
  fallback_out = new py::object(std::move(out));
  fallback_inplace = new py::object(std::move(inplace));
  raise_rc = new py::object(std::move(raiser));
}

bool has_cuda() {
#ifdef SYMKV_TORCH_CUDA
  return true;
#else
  return false;
#endif
}

} // namespace

// The schema is defined by symkv/torch.py (torch.library.Library("symkv", "DEF")) before this
// library loads; set_tables runs before any kernel can be called.
TORCH_LIBRARY_IMPL(symkv, CPU, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("all_reduce_", &all_reduce_);
}

#ifdef SYMKV_TORCH_CUDA
TORCH_LIBRARY_IMPL(symkv, CUDA, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("all_reduce_", &all_reduce_);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_group", &set_group, "register (comm != 0) or forget (0) group id");
  m.def("set_tables", &set_tables, "dtype, op and algo codes; the Python kernels");
  m.def("has_cuda", &has_cuda, "whether the CUDA key's kernels are compiled in");
}
