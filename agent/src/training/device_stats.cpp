// The C++ the training side needs and tch does not bind: libtorch's accelerator
// allocator statistics (memory.rs), and whether a tensor is referenced only once
// (sample_buffers.rs). Neither throws.
#include <ATen/DeviceAccelerator.h>
// libtorch's headers use C++20 bit-field initializers; this file is built as C++17.
#pragma GCC diagnostic ignored "-Wc++20-extensions"
#include <ATen/core/Tensor.h>
#include <atomic>
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

// 1 when `t` is the only reference to its tensor and to its storage (a buffer the
// metrics thread has let go of), else 0. libtorch drops a reference with a release
// decrement, so the acquire fence after a count of 1 orders every read the other
// holder made of the buffer before the caller's next write to it.
extern "C" int rankscope_tensor_unshared(const at::Tensor *t) {
  if (t == nullptr || !t->defined() || t->use_count() != 1) {
    return 0;
  }
  if (t->has_storage() && t->storage().use_count() != 1) {
    return 0;
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  return 1;
}
