// The C++ the tch adapter needs and tch does not bind: libtorch's accelerator
// allocator statistics (torch/mod.rs, LibtorchMemory). It does not throw.
#include <ATen/DeviceAccelerator.h>
// libtorch's headers use C++20 bit-field initializers; this file is built as C++17.
#pragma GCC diagnostic ignored "-Wc++20-extensions"
#include <ATen/core/Tensor.h>
#include <cstdint>

// Returns 0 and fills `out` (allocated, reserved, peak allocated bytes) on success,
// -1 when there is no accelerator or the allocator cannot answer.
extern "C" int rankscope_device_stats(int device_index, int64_t *out) {
  try {
    auto accel = at::accelerator::getAccelerator(false);
    if (!accel.has_value() || at::accelerator::deviceCount() <= device_index) {
      return -1;
    }
    auto stats = at::accelerator::getDeviceStats(
        static_cast<c10::DeviceIndex>(device_index));
    const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[agg].current;
    out[1] = stats.reserved_bytes[agg].current;
    out[2] = stats.allocated_bytes[agg].peak;
    return 0;
  } catch (...) {
    return -1;
  }
}
