// A driverless CUDA for the dry run's simulated GPUs (convit_scale/dryrun): tensors that report cuda:N are torch's
// fake tensors, but autograd, DDP's reducer and the stream guards still ask the CUDA runtime for the current device,
// its streams and events, and the primary context, which throws on a machine without a driver. This answers them
// without one: a device guard over torch's CUDA one (removed again by uninstall()), the hooks' primary-context check
// answered "none" (the autograd engine then stashes no streams) and a host-clock timer for DDP's reducer. Loaded only
// by the dry run, in a process that sees no GPU.
#include <torch/extension.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

thread_local DeviceIndex current_index = 0;
std::atomic<int> visible{1};

struct DriverlessCudaGuard final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    setDevice(d);
    return old;
  }
  Device getDevice() const override { return Device(DeviceType::CUDA, current_index); }
  void setDevice(Device d) const override {
    if (d.index() >= 0) current_index = d.index();
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0) current_index = d.index();
  }
  Stream getStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream getStreamFromGlobalPool(Device d, bool) const override { return Stream(Stream::DEFAULT, d); }
  Stream getNewStream(Device d, int) const override { return Stream(Stream::DEFAULT, d); }
  Stream exchangeStream(Stream s) const override { return Stream(Stream::DEFAULT, s.device()); }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  DeviceIndex deviceCount() const noexcept override { return static_cast<DeviceIndex>(visible.load()); }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
};

// DDP's reducer times its first iterations with CUDA events; this times them on the host clock.
struct HostTimer final : c10d::Timer {
  explicit HostTimer(Device) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    auto a = getTimestamp(start);
    auto b = getTimestamp(end);
    if (!a || !b) return std::nullopt;
    return *b - *a;
  }
};

const c10::impl::DeviceGuardImplInterface* previous = nullptr;
DriverlessCudaGuard driverless;
bool timer_registered = false;

bool no_primary_context(const void*, DeviceIndex) { return false; }

bool answer_primary_context() {
  const at::CUDAHooksInterface& hooks = at::detail::getCUDAHooks();
  auto pmf = &at::AcceleratorHooksInterface::hasPrimaryContext;
  std::uintptr_t slot = 0;
  static_assert(sizeof(pmf) >= sizeof(slot), "an Itanium pointer to member function");
  std::memcpy(&slot, &pmf, sizeof(slot));
  if ((slot & 1) == 0) return false;  // not a virtual-table offset: not the Itanium C++ ABI
  void** vtable = *reinterpret_cast<void** const*>(&hooks);
  void** entry = vtable + (slot - 1) / sizeof(void*);
  if (*entry == reinterpret_cast<void*>(&no_primary_context)) return true;
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto start = reinterpret_cast<std::uintptr_t>(entry) & ~(page - 1);
  if (mprotect(reinterpret_cast<void*>(start), 2 * page, PROT_READ | PROT_WRITE) != 0) return false;
  *entry = reinterpret_cast<void*>(&no_primary_context);
  mprotect(reinterpret_cast<void*>(start), 2 * page, PROT_READ);
  return true;
}

// Returns false where the hooks' check could not be answered (the caller says so and stops).
bool install(int64_t devices) {
  visible = static_cast<int>(devices);
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)];
  if (previous == nullptr) previous = slot.load();
  slot.store(&driverless);
  if (!timer_registered) {
    c10d::TimerRegistry()->Register(
        DeviceType::CUDA, [](Device d) -> std::unique_ptr<c10d::Timer> { return std::make_unique<HostTimer>(d); },
        c10::REGISTRY_PREFERRED);
    timer_registered = true;
  }
  return answer_primary_context();
}

void uninstall() {
  if (previous != nullptr) {
    c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)].store(previous);
  }
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "put the driverless CUDA in place for `devices` devices");
  m.def("uninstall", &uninstall, "put torch's CUDA device guard back");
}
