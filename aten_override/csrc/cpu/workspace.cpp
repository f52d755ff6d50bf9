// Blocks kept between the kernels' calls (workspace.h).
#include "workspace.h"

#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <map>
#include <mutex>

namespace aten_override {
namespace workspace {
namespace {

struct Cache {
  std::mutex mutex;
  std::multimap<int64_t, void*> kept;  // size -> block, smallest first
  int64_t kept_bytes = 0, in_use_bytes = 0, limit = int64_t{256} << 20, hits = 0, misses = 0;

  // A block starting or ending its service of a tensor is an allocation or a free for the profiler
  // (torch.profiler's profile_memory, the benchmarks' peak memory), as c10's CPU allocator reports its
  // own: a kept block is memory the call holds. Under the lock.
  void report(void* block, int64_t delta) {
    in_use_bytes += delta;
    if (c10::memoryProfilingEnabled()) {
      c10::reportMemoryUsageToProfiler(block, delta, static_cast<size_t>(in_use_bytes),
                                       static_cast<size_t>(in_use_bytes + kept_bytes), c10::Device(c10::DeviceType::CPU));
    }
  }

  // The smallest kept block of at least `bytes` and at most twice that, else a new block of `bytes`;
  // its size into `size`. One lock for a kept block; a new one is allocated outside it.
  void* serve(int64_t bytes, int64_t& size) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      const auto it = kept.lower_bound(bytes);
      if (it != kept.end() && it->first <= 2 * bytes) {
        ++hits;
        size = it->first;
        void* block = it->second;
        kept_bytes -= size;
        kept.erase(it);
        report(block, size);
        return block;
      }
      ++misses;
    }
    size = bytes;
    void* block = c10::alloc_cpu(static_cast<size_t>(size));
    std::lock_guard<std::mutex> lock(mutex);
    report(block, size);
    return block;
  }

  void give_back(void* block, int64_t size) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      report(block, -size);
      if (kept_bytes + size <= limit) {
        kept.emplace(size, block);
        kept_bytes += size;
        return;
      }
    }
    c10::free_cpu(block);
  }

  int64_t drain(int64_t keep) {
    std::multimap<int64_t, void*> freed;
    int64_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mutex);
      // the largest blocks first, until at most `keep` bytes stay
      while (kept_bytes > keep) {
        auto last = std::prev(kept.end());
        kept_bytes -= last->first;
        bytes += last->first;
        freed.insert(*last);
        kept.erase(last);
      }
    }
    for (auto& [size, block] : freed) c10::free_cpu(block);
    return bytes;
  }
};

// Never destroyed: a tensor dying during static destruction still finds it.
Cache& cache() {
  static Cache* c = new Cache();
  return *c;
}

}  // namespace

at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const int64_t bytes = c10::multiply_integers(sizes) * int64_t(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  if (bytes < kMinBytes || options.device().type() != c10::DeviceType::CPU) return at::empty(sizes, options);
  int64_t size = 0;
  void* block = cache().serve(bytes, size);
  return at::from_blob(
      block, sizes, [size](void* data) { cache().give_back(data, size); }, options);
}

at::Tensor zeros(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return empty(sizes, options).zero_();
}

Stats stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return Stats{c.kept_bytes, c.limit, c.hits, c.misses};
}

void set_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "workspace limit must be >= 0 bytes, got ", bytes);
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    c.limit = bytes;
  }
  cache().drain(bytes);
}

int64_t release() {
  return cache().drain(0);
}

}  // namespace workspace
}  // namespace aten_override
