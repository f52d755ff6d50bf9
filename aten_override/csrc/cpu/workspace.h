// Temporaries of the compiled backend's kernels (channels-last copies, transformed tiles, partial
// sums), from blocks kept between calls, as oneDNN keeps its scratchpad.
//
// Why: a temporary over glibc's mmap threshold (up to 32 MiB) is mapped anew on every call, and each
// fresh page costs a fault and its clearing: 128 MiB of fresh float32 took 30 ms to first write against
// 3.5 ms to rewrite (one Zen 4 core, 4 KiB pages), and kn2row-lanes' grad_input of wav2vec2's
// conv_layers.1 faulted 32,000 times per call (~78 MiB of its temporaries, ~6% of its time). A kept
// block is written without faults. Tensors returned to the caller never come from here.
//
// A request of at least kMinBytes takes the smallest kept block that holds it and is at most twice its
// size, or a new block (c10::alloc_cpu: 64-byte aligned, on huge pages where c10's
// THP_MEM_ALLOC_ENABLE asks for them); smaller requests are at::empty's. When its tensor dies, the block
// is kept unless that would take the kept bytes over the limit (then it is freed). release() frees the
// kept blocks; the registration does so when the first enable("compiled") block leaves the dispatcher,
// and from the second such block on only aten_override.release() and interpreter exit do
// (aten_override/_registration.py). Thread-safe: a block serves one tensor at a time.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace aten_override {
namespace workspace {

// Requests below this are plain at::empty (glibc's heap reuses them without faults).
constexpr int64_t kMinBytes = int64_t{1} << 20;

// An uninitialized contiguous tensor (like at::empty) whose memory is a kept block where one fits.
at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options);
// The same, filled with zeros.
at::Tensor zeros(at::IntArrayRef sizes, const at::TensorOptions& options);

struct Stats {
  int64_t kept_bytes = 0;     // bytes of the blocks kept now (not serving a tensor)
  int64_t limit_bytes = 0;    // the most bytes kept (set_limit)
  int64_t hits = 0;           // requests a kept block served
  int64_t misses = 0;         // requests of kMinBytes or more that allocated a block
};
Stats stats();
// Sets the most bytes kept between calls (default 256 MiB: wav2vec2's largest layer at batch 8 keeps
// 130 MiB, R(2+1)D's winograd layers ~150 MiB; 0 keeps nothing: every request allocates afresh) and
// frees the kept blocks over it, largest first.
void set_limit(int64_t bytes);
// Frees every kept block; returns their bytes. Blocks serving tensors are freed when those die.
int64_t release();

}  // namespace workspace
}  // namespace aten_override
