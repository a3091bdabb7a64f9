// vdev: an out-of-tree PyTorch device on the PrivateUse1 dispatch key.
//
// What makes it a device and not a CPU in disguise:
//   * its own allocator: every vdev tensor's bytes come from vdev_alloc() below, are
//     counted per device (allocated / peak / limit), and are poisoned with 0xFF bytes
//     (a NaN in every float format) on allocation, as uninitialised GPU memory is
//     garbage; CPU code that forgets to initialise a buffer sees NaN, not zeros.
//   * the boundary: ATen routes every op on a vdev tensor here (PrivateUse1), never to
//     the CPU kernels directly. An op that mixes a vdev tensor with a CPU tensor of one
//     or more dimensions, or two vdev devices, is refused with the error a GPU gives.
//     Host <-> device bytes move only through copies (_copy_from), which are counted.
//   * pinned host memory: pin_memory() on a CPU tensor allocates from a separate host
//     allocator whose blocks are recognised by is_pinned().
//
// Compute runs on the host: the fallback kernel below views the operands' device memory
// as CPU tensors (no copy) and redispatches the op to the CPU kernel, then re-homes the
// results on the device. Results are therefore bit-identical to the CPU's.
//
// Python reaches the runtime through the custom ops in the `vdev` namespace (no pybind):
// zero_core_vdev/runtime.py loads this library with torch.ops.load_library.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>
#include <torch/version.h>

// ---- the one torch-version guard ------------------------------------------------------
// vdev compiles against torch 2.4 to 2.13 (zero_core/runtime/torch_support.py's range;
// built with 2.4.1, 2.8.0 and 2.13.0, the releases in between are untested). The backend
// interfaces it implements grew after 2.4: AcceleratorHooksInterface gained isBuilt /
// isAvailable / isPinnedPtr / getNewGenerator and a const getDefaultGenerator (2.4 has
// PrivateUse1HooksInterface's non-const one only), DeviceGuardImplInterface gained
// synchronizeDevice. A member the base does not declare cannot be marked `override`, so
// those members carry VDEV_OVERRIDE_SINCE_2_8: `override` on torch >= 2.8 (the compiler
// checks that they still override), nothing before (on 2.4 they are extra members torch
// never calls; where a release before 2.8 declares one, it overrides without the keyword).
// torch 2.4's getDefaultGenerator signature is added for torch < 2.8 only.
// Built is not all there is: on torch 2.4, Tensor.pin_memory() / is_pinned() without a
// device mean CUDA, and torch.accelerator (vdev's stream API in runtime.py) does not exist,
// so vdev's pinned memory and streams, and the engine on vdev, need torch >= 2.8
// (ci/torch_range.sh's oldest leg compiles vdev, then runs its subset without it).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define VDEV_OVERRIDE_SINCE_2_8 override
#define VDEV_TORCH_BEFORE_2_8 0
#else
#define VDEV_OVERRIDE_SINCE_2_8
#define VDEV_TORCH_BEFORE_2_8 1
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace vdev {

// ---------------------------------------------------------------------------------------
// devices and their counters

constexpr int kMaxDevices = 64;
constexpr size_t kAlignment = 64;  // the CPU allocator's alignment: same vector paths

struct DeviceCounters {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> num_allocs{0};
  std::atomic<int64_t> h2d_bytes{0};  // host -> this device
  std::atomic<int64_t> d2h_bytes{0};  // this device -> host
  std::atomic<int64_t> d2d_bytes{0};  // device -> device, counted on the destination
  std::atomic<int64_t> h2d_copies{0};
  std::atomic<int64_t> d2h_copies{0};
  // synchronizations (streams.h): blocking copies, host reads of device memory, waits
  std::atomic<int64_t> sync_copies{0};
  std::atomic<int64_t> sync_reads{0};
  std::atomic<int64_t> sync_waits{0};
};

std::array<DeviceCounters, kMaxDevices> g_counters;
std::atomic<int64_t> g_pinned_allocated{0};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoi(v) : fallback;
}

int64_t env_int64(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoll(v) : fallback;
}

// Read once: the number of devices of this process and the bytes each one holds.
int device_count() {
  static const int n = std::clamp(env_int("VDEV_DEVICE_COUNT", 8), 1, kMaxDevices);
  return n;
}

int64_t memory_limit() {  // 0: no limit
  static const int64_t limit = env_int64("VDEV_MEMORY_LIMIT", 0);
  return limit;
}

bool poison_enabled() {
  static const bool on = env_int("VDEV_POISON", 1) != 0;
  return on;
}

// The current device is per thread, as with CUDA: a thread that never chose one is on 0.
thread_local int t_current_device = 0;

void check_index(int index) {
  TORCH_CHECK(index >= 0 && index < device_count(), "vdev:", index,
              " does not exist: this process has ", device_count(),
              " vdev devices (vdev:0..vdev:", device_count() - 1,
              "); set VDEV_DEVICE_COUNT before the first use to have more");
}

// ---------------------------------------------------------------------------------------
// the device allocator

struct Block {
  void* ptr;
  size_t size;
  int device;
};

std::mutex g_blocks_mutex;
std::unordered_map<const void*, Block> g_blocks;  // base pointer -> block, for ptr lookups

void forget_storage(int device, const void* base);  // streams.h

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  if (block->ptr) forget_storage(block->device, block->ptr);
  {
    std::lock_guard<std::mutex> lock(g_blocks_mutex);
    g_blocks.erase(block->ptr);
  }
  g_counters[block->device].allocated -= static_cast<int64_t>(block->size);
  std::free(block->ptr);
  delete block;
}

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const int device = t_current_device;
    check_index(device);
    auto& counters = g_counters[device];
    const int64_t limit = memory_limit();
    if (limit > 0 && counters.allocated.load() + static_cast<int64_t>(nbytes) > limit) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "vdev:", device,
                       " out of memory: tried to allocate ", nbytes, " bytes with ",
                       counters.allocated.load(), " of ", limit,
                       " bytes (VDEV_MEMORY_LIMIT) already allocated");
    }
    void* ptr = nullptr;
    if (nbytes > 0) {
      const size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
      ptr = std::aligned_alloc(kAlignment, rounded);
      TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "vdev:", device,
                       " out of memory: the host refused ", nbytes, " bytes");
      if (poison_enabled()) std::memset(ptr, 0xFF, nbytes);
    }
    auto* block = new Block{ptr, nbytes, device};
    if (ptr) {
      std::lock_guard<std::mutex> lock(g_blocks_mutex);
      g_blocks.emplace(ptr, *block);
    }
    const int64_t now = (counters.allocated += static_cast<int64_t>(nbytes));
    int64_t peak = counters.peak.load();
    while (now > peak && !counters.peak.compare_exchange_weak(peak, now)) {
    }
    counters.num_allocs += 1;
    return {ptr, block, &free_block, c10::Device(c10::DeviceType::PrivateUse1, device)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

DeviceAllocator g_device_allocator;
// what at::GetAllocator(PrivateUse1) returns: torch.UntypedStorage(n, device="vdev") uses it
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_device_allocator)

// ---------------------------------------------------------------------------------------
// pinned host memory: ordinary host memory that vdev recognises as staging memory

std::mutex g_pinned_mutex;
std::unordered_map<const void*, size_t> g_pinned;  // base pointer -> size

void free_pinned(void* ptr) {
  size_t size = 0;
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    auto it = g_pinned.find(ptr);
    if (it != g_pinned.end()) {
      size = it->second;
      g_pinned.erase(it);
    }
  }
  g_pinned_allocated -= static_cast<int64_t>(size);
  std::free(ptr);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    if (nbytes > 0) {
      const size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
      ptr = std::aligned_alloc(kAlignment, rounded);
      TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "vdev: the host refused ",
                       nbytes, " bytes of pinned memory");
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.emplace(ptr, nbytes);
    }
    g_pinned_allocated += static_cast<int64_t>(nbytes);
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }

  void copy_data(void* dest, const void* src, size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

PinnedAllocator g_pinned_allocator;

bool is_pinned_ptr(const void* data) {
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  // a pinned block's interior pointers count too (views of a pinned buffer)
  for (const auto& [base, size] : g_pinned) {
    const char* b = static_cast<const char*>(base);
    if (data >= base && data < b + size) return true;
  }
  return false;
}

#include "streams.h"

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ---------------------------------------------------------------------------------------
// hooks: what ATen asks of a PrivateUse1 backend (pinned memory, generators, pointers)

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const VDEV_OVERRIDE_SINCE_2_8 { return true; }
  bool isAvailable() const VDEV_OVERRIDE_SINCE_2_8 { return true; }
  // vdev draws random numbers from the host's generator (its kernels are the CPU's),
  // so torch.manual_seed() seeds it and CPU and vdev runs draw the same numbers.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const VDEV_OVERRIDE_SINCE_2_8 {
    return at::detail::getDefaultCPUGenerator();
  }
#if VDEV_TORCH_BEFORE_2_8  // torch 2.4's (non-const) signature of the same hook
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) {
    return at::detail::getDefaultCPUGenerator();
  }
#endif
  at::Generator getNewGenerator(c10::DeviceIndex) const VDEV_OVERRIDE_SINCE_2_8 {
    return at::detail::createCPUGenerator();
  }
  at::Device getDeviceFromPtr(void* data) const override {
    std::lock_guard<std::mutex> lock(g_blocks_mutex);
    auto it = g_blocks.find(data);
    TORCH_CHECK(it != g_blocks.end(), "vdev: pointer ", data,
                " is not the start of a vdev allocation");
    return c10::Device(c10::DeviceType::PrivateUse1, it->second.device);
  }
  bool isPinnedPtr(const void* data) const VDEV_OVERRIDE_SINCE_2_8 { return is_pinned_ptr(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};

struct HooksRegisterer {
  HooksRegisterer() { at::RegisterPrivateUse1HooksInterface(new Hooks()); }
};
HooksRegisterer g_hooks_registerer;

// ---------------------------------------------------------------------------------------
// tensors: creation, views, copies

constexpr c10::DispatchKeySet kVdevKeys(c10::DispatchKey::PrivateUse1);

c10::Device resolve(std::optional<c10::Device> device) {
  c10::Device d = device.value_or(c10::Device(c10::DeviceType::PrivateUse1));
  TORCH_CHECK(d.is_privateuseone(), "vdev: cannot create a tensor on ", d, " here");
  return d.has_index() ? d : c10::Device(c10::DeviceType::PrivateUse1, t_current_device);
}

void refuse_pinned_or_sparse(std::optional<c10::Layout> layout, std::optional<bool> pinned) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "vdev supports strided tensors only, not ", c10::layout_or_default(layout));
  TORCH_CHECK(!c10::pinned_memory_or_default(pinned),
              "pin_memory=True is for host tensors; a vdev tensor cannot be pinned");
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device, std::optional<bool> pinned,
                               std::optional<c10::MemoryFormat> memory_format) {
  refuse_pinned_or_sparse(layout, pinned);
  const c10::DeviceGuard guard(resolve(device));
  return at::detail::empty_generic(size, &g_device_allocator, kVdevKeys,
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pinned) {
  refuse_pinned_or_sparse(layout, pinned);
  const c10::DeviceGuard guard(resolve(device));
  return at::detail::empty_strided_generic(size, stride, &g_device_allocator, kVdevKeys,
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  const c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, size, memory_format);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  return at::native::view(self, size);
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  return at::native::set_(self, source);
}

at::Tensor& set_source_storage_offset(at::Tensor& self, at::Storage source, int64_t offset,
                                      c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset, size, stride);
}

// The memory of a vdev tensor seen as a CPU tensor (same storage bytes, offset, sizes and
// strides), for the host kernels that compute on it. The view holds a reference to the
// device storage. Its storage is resizable: a CPU kernel that resizes an out= argument
// gets new host memory, and the fallback copies the result back (write_back_resized).
// Never handed to user code: it is how the device's own kernels touch its memory.
void release_device_storage(void* ctx) { delete static_cast<c10::Storage*>(ctx); }

at::Tensor host_view(const at::Tensor& t) {
  const c10::Storage& storage = t.storage();
  void* base = const_cast<void*>(storage.data());
  c10::DataPtr data(base, new c10::Storage(storage), &release_device_storage,
                    c10::Device(c10::kCPU));
  auto impl = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                    storage.nbytes(), std::move(data),
                                                    at::getCPUAllocator(), /*resizable=*/true);
  at::Tensor host = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(impl)), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  host.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return host;
}

void count_copy(const at::Tensor& src, const at::Tensor& dst) {
  const int64_t nbytes = static_cast<int64_t>(dst.numel()) * dst.element_size();
  if (src.is_privateuseone() && dst.is_privateuseone()) {
    g_counters[dst.device().index()].d2d_bytes += nbytes;
  } else if (dst.is_privateuseone()) {
    g_counters[dst.device().index()].h2d_bytes += nbytes;
    g_counters[dst.device().index()].h2d_copies += 1;
  } else {
    g_counters[src.device().index()].d2h_bytes += nbytes;
    g_counters[src.device().index()].d2h_copies += 1;
  }
}

// Host memory a GPU copy has not reached yet: 0xFF bytes (NaN in every float format).
void poison_host(const at::Tensor& t) {
  if (t.numel() == 0) return;
  if (t.is_contiguous()) {
    std::memset(t.data_ptr(), 0xFF, t.numel() * t.element_size());
    return;
  }
  at::Tensor garbage = at::empty(t.sizes(), t.options());
  std::memset(garbage.data_ptr(), 0xFF, garbage.numel() * garbage.element_size());
  at::native::copy_(const_cast<at::Tensor&>(t), garbage, false);
}

// The bytes of a pending copy (streams.h), moved when its stream gets to it.
void do_copy(Pending& p) {
  if (p.to_host) {
    at::native::copy_(p.dst, p.src, false);
  } else {
    at::Tensor dst_host = host_view(p.dst);
    at::native::copy_(dst_host, p.src, false);
  }
}

std::string bytes_of(const at::Tensor& t) {
  return std::to_string(static_cast<int64_t>(t.numel()) * t.element_size()) + " bytes";
}

// Copies between host and device, and between devices. What synchronizes follows CUDA: a
// copy without non_blocking waits for the stream (and is counted), a non-blocking one
// between the device and pinned host memory does not (and, in the asynchronous mode, lands
// later: streams.h); a non-blocking one into or out of pageable host memory cannot be
// asynchronous and is counted as the synchronization it is.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.defined() && dst.defined(), "vdev copy: undefined tensor");
  TORCH_CHECK((self.is_cpu() || self.is_privateuseone()) && (dst.is_cpu() || dst.is_privateuseone()),
              "vdev copies between vdev and cpu only, not from ", self.device(), " to ",
              dst.device());
  count_copy(self, dst);
  if (self.is_privateuseone() && dst.is_privateuseone()) {  // device -> device: stream work
    if (self.device() != dst.device()) {
      DeviceOp(std::string("a copy from ") + self.device().str(), self.device().index(),
               {storage_key(self)});
    }
    const DeviceOp op("a device-to-device copy", dst.device().index(),
                      {storage_key(self), storage_key(dst)});
    at::Tensor dst_host = host_view(dst);
    at::native::copy_(dst_host, host_view(self), non_blocking);
    op.wrote(storage_key(dst));
    return dst;
  }
  if (dst.is_privateuseone()) {  // host -> device
    const int device = dst.device().index();
    const bool pinned = self.numel() == 0 || is_pinned_ptr(self.storage().data());
    const DeviceOp op("a host-to-device copy", device, {storage_key(dst)});
    if (non_blocking && pinned && op.tracked) {
      defer(device, Pending{op.stream, op.pos, false, dst, self, storage_key(dst)});
      op.wrote(storage_key(dst));
      return dst;
    }
    if (!(non_blocking && pinned)) {
      note_sync(device, SyncKind::kCopy, "a blocking host-to-device copy of " + bytes_of(dst));
    }
    at::Tensor dst_host = host_view(dst);
    at::native::copy_(dst_host, self, false);
    op.wrote(storage_key(dst));
    if (!non_blocking) sync_current_stream(device);
    return dst;
  }
  // device -> host
  const int device = self.device().index();
  const bool pinned = dst.numel() == 0 || is_pinned_ptr(dst.storage().data());
  const DeviceOp op("a device-to-host copy", device, {storage_key(self)});
  if (non_blocking && pinned && op.tracked) {
    at::Tensor snapshot = at::empty(self.sizes(), self.options().device(c10::kCPU));
    at::native::copy_(snapshot, host_view(self), false);
    poison_host(dst);
    defer(device, Pending{op.stream, op.pos, true, dst, snapshot, nullptr});
    return dst;
  }
  if (!(non_blocking && pinned)) {
    note_sync(device, SyncKind::kCopy,
              std::string(non_blocking ? "a non-blocking device-to-host copy into pageable "
                                         "(not pinned) memory of "
                                       : "a blocking device-to-host copy of ") +
                  bytes_of(self));
  }
  at::Tensor dst_host = dst;
  at::native::copy_(dst_host, host_view(self), false);
  if (!(non_blocking && pinned)) sync_current_stream(device);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  const c10::DeviceGuard guard(dst.device());
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

// .item(), bool(t), float(t): the host reads device memory, after the stream gets there.
at::Scalar local_scalar_dense(const at::Tensor& self) {
  const int device = self.device().index();
  note_sync(device, SyncKind::kRead,
            "a host read of a device value (.item(), bool(), float(), int() or .tolist())");
  g_counters[device].d2h_bytes += self.element_size();
  g_counters[device].d2h_copies += 1;
  const DeviceOp op("a host read of a device value", device, {storage_key(self)});
  sync_current_stream(device);
  return at::native::_local_scalar_dense_cpu(host_view(self));
}

// ---------------------------------------------------------------------------------------
// the fallback kernel: every other op

struct Operand {
  at::Tensor device_tensor;  // the caller's vdev tensor
  at::Tensor host;           // host_view() of it, handed to the CPU kernel
  bool written;              // an in-place or out= argument: the kernel may resize it
};

[[noreturn]] void refuse_mixed(const c10::OperatorHandle& op, const c10::Device& a,
                               const c10::Device& b) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
              "devices, ", a, " and ", b, "! (in ", op.schema().operator_name(),
              "; move them with .to(device) first)");
}

c10::Device current() { return c10::Device(c10::DeviceType::PrivateUse1, t_current_device); }

// One op on its way to the CPU kernel and back.
struct Fallback {
  const c10::OperatorHandle& op;
  std::optional<c10::Device> device;  // the vdev device the op runs on
  std::vector<Operand> operands;
  std::vector<const void*> fresh;     // storages of results the op allocated

  void see_device(const c10::Device& d) {
    if (!device) {
      device = d;
    } else if (*device != d) {
      refuse_mixed(op, *device, d);
    }
  }

  // A tensor argument: a vdev tensor becomes a host view of its memory; a CPU tensor is
  // allowed only as a 0-dim scalar (as CUDA allows) or as an index (allow_cpu).
  at::Tensor to_host(const at::Tensor& t, bool allow_cpu, bool written) {
    if (!t.defined()) return t;
    if (t.is_privateuseone()) {
      see_device(t.device());
      at::Tensor host = host_view(t);
      operands.push_back({t, host, written});
      return host;
    }
    if (t.is_cpu() && (t.dim() == 0 || allow_cpu)) return t;
    refuse_mixed(op, device.value_or(current()), t.device());
  }

  c10::IValue arg_to_host(const c10::IValue& v, bool written) {
    if (v.isTensor()) return to_host(v.toTensor(), false, written);
    if (v.isDevice() && v.toDevice().is_privateuseone()) {  // factory ops' device=
      see_device(resolve(v.toDevice()));
      return c10::IValue(c10::Device(c10::kCPU));
    }
    if (v.isList()) {
      auto list = v.toList();
      const bool index_list = !v.isTensorList();  // Tensor?[] (indices) may hold CPU tensors
      c10::impl::GenericList out(list.elementType());
      out.reserve(list.size());
      bool changed = false;
      for (const c10::IValue& item : list) {
        if (item.isTensor()) {
          out.push_back(to_host(item.toTensor(), index_list, written));
          changed = true;
        } else {
          out.push_back(item);
        }
      }
      return changed ? c10::IValue(out) : v;
    }
    return v;
  }

  // The operand whose memory a host tensor returned by the CPU kernel lives in, if any.
  const Operand* owner_of(const at::Tensor& host) const {
    if (!host.defined() || !host.has_storage() || host.storage().data() == nullptr)
      return nullptr;
    const char* p = static_cast<const char*>(host.storage().data());
    for (const auto& o : operands) {
      const auto& s = o.device_tensor.storage();
      const char* base = static_cast<const char*>(s.data());
      if (base && p >= base && p < base + s.nbytes()) return &o;
    }
    return nullptr;
  }

  // A tensor returned by the CPU kernel, back on the device: the caller's own tensor for
  // in-place and out= results, a device view for views, a fresh device tensor otherwise.
  at::Tensor result_to_device(const at::Tensor& host) {
    if (!host.defined() || host.is_privateuseone()) return host;
    for (const auto& o : operands) {
      if (o.host.unsafeGetTensorImpl() == host.unsafeGetTensorImpl()) return o.device_tensor;
    }
    if (const Operand* o = owner_of(host)) {
      const c10::Storage& storage = o->device_tensor.storage();
      const int64_t offset = (static_cast<const char*>(host.data_ptr()) -
                              static_cast<const char*>(storage.data())) /
                             static_cast<int64_t>(host.element_size());
      at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage),
                                                                 kVdevKeys, host.dtype());
      view.unsafeGetTensorImpl()->set_sizes_and_strides(host.sizes(), host.strides(), offset);
      return view;
    }
    const c10::DeviceGuard guard(device.value_or(current()));
    at::Tensor out = at::detail::empty_strided_generic(host.sizes(), host.strides(),
                                                       &g_device_allocator, kVdevKeys,
                                                       host.scalar_type());
    if (host.numel() > 0) {
      at::Tensor out_host = host_view(out);
      at::native::copy_(out_host, host, false);
    }
    fresh.push_back(storage_key(out));
    return out;
  }

  c10::IValue result_to_device(const c10::IValue& v) {
    if (v.isTensor()) return result_to_device(v.toTensor());
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(result_to_device(t));
      return out;
    }
    return v;
  }

  // An out= or in-place operand that the CPU kernel resized onto new memory: give the
  // device tensor the new shape and the data.
  void write_back_resized() {
    for (auto& o : operands) {
      if (!o.written) continue;
      const bool same = o.host.data_ptr() == o.device_tensor.data_ptr() &&
                        o.host.sizes() == o.device_tensor.sizes() &&
                        o.host.strides() == o.device_tensor.strides();
      if (same) continue;
      const c10::DeviceGuard guard(o.device_tensor.device());
      at::native::resize_(o.device_tensor, o.host.sizes(), std::nullopt);
      if (o.host.numel() > 0) {
        at::Tensor dst = host_view(o.device_tensor);
        at::native::copy_(dst, o.host, false);
      }
    }
  }
};

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  Fallback f{op, std::nullopt, {}, {}};
  for (size_t i = 0; i < num_args; ++i) {
    const auto* alias = schema.arguments()[i].alias_info();
    (*stack)[first + i] = f.arg_to_host((*stack)[first + i], alias && alias->isWrite());
  }
  // its place on the current stream (asynchronous mode: ordering checks, pending copies)
  std::vector<const void*> touched;
  for (const auto& o : f.operands) touched.push_back(storage_key(o.device_tensor));
  const DeviceOp order(schema.name(), f.device ? f.device->index() : t_current_device, touched);
  {
    std::optional<c10::DeviceGuard> guard;
    if (f.device) guard.emplace(*f.device);
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }
  f.write_back_resized();
  const size_t num_returns = schema.returns().size();
  const size_t rfirst = stack->size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    (*stack)[rfirst + i] = f.result_to_device((*stack)[rfirst + i]);
  }
  for (const auto& o : f.operands) {
    if (o.written) order.wrote(storage_key(o.device_tensor));
  }
  for (const void* s : f.fresh) order.wrote(s);
}

// ---------------------------------------------------------------------------------------
// Ops with both a CPU kernel and a CompositeExplicitAutograd kernel (native_layer_norm,
// for one) would run the composite decomposition on vdev, since a composite kernel wins
// over a backend fallback: different rounding from the CPU. vdev computes with the CPU's
// kernels, so those ops are routed to the fallback explicitly, and vdev's results are
// bit-identical to the CPU's.

bool registered_explicitly(const std::string& name) {
  static const std::vector<std::string> own = {
      "aten::empty", "aten::empty_strided", "aten::as_strided", "aten::resize_",
      "aten::_reshape_alias", "aten::view", "aten::set_", "aten::_copy_from",
      "aten::_copy_from_and_resize", "aten::_local_scalar_dense",
      // copies must reach _copy_from through the composite copy_ / _to_copy
      "aten::copy_", "aten::_to_copy", "aten::to"};
  return std::find(own.begin(), own.end(), name) != own.end();
}

int64_t route_cpu_kernels_through_fallback() {
  static torch::Library* lib = nullptr;
  static int64_t routed = 0;
  if (lib) return routed;
  lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                           __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0 || registered_explicitly(name.name)) continue;
    auto handle = dispatcher.findOp(name);
    if (!handle || handle->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
    if (!handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) continue;
    if (!handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !handle->hasKernelForDispatchKey(
            c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    const std::string qualified = name.overload_name.empty()
                                      ? name.name.substr(6)
                                      : name.name.substr(6) + "." + name.overload_name;
    lib->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
    ++routed;
  }
  return routed;
}

// ---------------------------------------------------------------------------------------
// the runtime's own ops, for Python (zero_core_vdev/runtime.py)

int64_t op_device_count() { return device_count(); }
int64_t op_current_device() { return t_current_device; }
void op_set_device(int64_t index) {
  check_index(static_cast<int>(index));
  t_current_device = static_cast<int>(index);
}

// [allocated, peak, num_allocs, h2d_bytes, d2h_bytes, d2d_bytes, h2d_copies, d2h_copies,
//  limit, pinned_allocated, sync_copies, sync_reads, sync_waits, pending_copies]
std::vector<int64_t> op_memory_stats(int64_t index) {
  check_index(static_cast<int>(index));
  const auto& c = g_counters[index];
  return {c.allocated.load(), c.peak.load(), c.num_allocs.load(), c.h2d_bytes.load(),
          c.d2h_bytes.load(), c.d2d_bytes.load(), c.h2d_copies.load(),
          c.d2h_copies.load(), memory_limit(), g_pinned_allocated.load(),
          c.sync_copies.load(), c.sync_reads.load(), c.sync_waits.load(),
          pending_count(static_cast<int>(index))};
}

void op_reset_peak(int64_t index) {
  check_index(static_cast<int>(index));
  g_counters[index].peak = g_counters[index].allocated.load();
}

void op_reset_transfers(int64_t index) {
  check_index(static_cast<int>(index));
  auto& c = g_counters[index];
  c.h2d_bytes = 0;
  c.d2h_bytes = 0;
  c.d2d_bytes = 0;
  c.h2d_copies = 0;
  c.d2h_copies = 0;
  c.sync_copies = 0;
  c.sync_reads = 0;
  c.sync_waits = 0;
}

void op_synchronize(int64_t index) {
  check_index(static_cast<int>(index));
  GuardImpl().synchronizeDevice(static_cast<c10::DeviceIndex>(index));
}

void op_set_sync_debug_mode(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "vdev: sync debug mode is 0 (default), 1 (warn) or 2 "
              "(error), not ", mode);
  g_sync_debug_mode = static_cast<int>(mode);
}

int64_t op_get_sync_debug_mode() { return g_sync_debug_mode.load(); }
void op_set_async(bool on) { set_async(on); }
bool op_is_async() { return g_async.load(); }

at::Tensor op_host_view(const at::Tensor& t) {
  TORCH_CHECK(t.is_privateuseone(), "vdev.host_view takes a vdev tensor, got one on ",
              t.device());
  // a kernel of the device's own (kernel set, vdev-gloo) is about to read and write it
  const DeviceOp op("a vdev kernel (host_view)", t.device().index(), {storage_key(t)});
  op.wrote(storage_key(t));
  return host_view(t);
}

}  // namespace vdev

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(vdev::empty_memory_format));
  m.impl("empty_strided", TORCH_FN(vdev::empty_strided));
  m.impl("as_strided", TORCH_FN(vdev::as_strided));
  m.impl("resize_", TORCH_FN(vdev::resize_));
  m.impl("_reshape_alias", TORCH_FN(vdev::reshape_alias));
  m.impl("view", TORCH_FN(vdev::view));
  m.impl("set_.source_Tensor", TORCH_FN(vdev::set_source_tensor));
  m.impl("set_.source_Storage", TORCH_FN(vdev::set_source_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(vdev::set_source_storage_offset));
  m.impl("_copy_from", TORCH_FN(vdev::copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(vdev::copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(vdev::local_scalar_dense));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&vdev::fallback>());
}

TORCH_LIBRARY(vdev, m) {
  m.def("device_count() -> int", &vdev::op_device_count);
  m.def("current_device() -> int", &vdev::op_current_device);
  m.def("set_device(int index) -> ()", &vdev::op_set_device);
  m.def("memory_stats(int index) -> int[]", &vdev::op_memory_stats);
  m.def("reset_peak(int index) -> ()", &vdev::op_reset_peak);
  m.def("reset_transfers(int index) -> ()", &vdev::op_reset_transfers);
  m.def("host_view(Tensor(a) t) -> Tensor(a)");
  m.def("route_cpu_kernels() -> int", &vdev::route_cpu_kernels_through_fallback);
  m.def("synchronize(int index) -> ()", &vdev::op_synchronize);
  m.def("set_sync_debug_mode(int mode) -> ()", &vdev::op_set_sync_debug_mode);
  m.def("get_sync_debug_mode() -> int", &vdev::op_get_sync_debug_mode);
  m.def("set_async(bool on) -> ()", &vdev::op_set_async);
  m.def("is_async() -> bool", &vdev::op_is_async);
}

TORCH_LIBRARY_IMPL(vdev, PrivateUse1, m) {
  m.impl("host_view", TORCH_FN(vdev::op_host_view));
}

// host_view carries no gradient: autograd passes through. torch 2.8 has no autograd
// fallback for PrivateUse1 (later releases do), so without this the op is not found there.
TORCH_LIBRARY_IMPL(vdev, AutogradPrivateUse1, m) {
  m.impl("host_view", torch::CppFunction::makeFallthrough());
}
