// Host shim: the CUDA built-ins cuda/*.cu use, so g++ -std=c++20 compiles the same kernels for
// the CPU emulator (scaledoptim/kernels/emulator.py). A launch runs blockDim.x OS threads; each
// runs the kernel for every block in turn, in a seeded shuffled order (emulator_launch.h), with a
// barrier between blocks, so __syncthreads and per-block __shared__ storage behave as on a GPU
// and a result that depends on the order blocks run in differs between seeds.
#pragma once

#include <math.h>

#include <atomic>
#include <barrier>
#include <bit>
#include <cstddef>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// Register limits are the GPU compiler's business (Note [launch bounds] in common.cuh).
#define __launch_bounds__(...)
// Blocks of one launch run one after another and launches are serialised, so function-static
// storage is exactly one block's shared memory.
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx{0, 0, 0};
inline thread_local dim3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace so_emulator {

// The threads of the block being run, and the state block-wide barriers need.
struct Block {
  struct Completion {
    Block* block;
    // Runs once per barrier phase, after every thread arrived and before any leaves.
    void operator()() noexcept { block->or_result = block->or_accumulator.exchange(0); }
  };

  explicit Block(unsigned threads) : barrier(threads, Completion{this}) {}

  std::atomic<int> or_accumulator{0};
  int or_result = 0;
  std::barrier<Completion> barrier;
};

inline thread_local Block* current_block = nullptr;

}  // namespace so_emulator

inline void __syncthreads() { so_emulator::current_block->barrier.arrive_and_wait(); }

inline int __syncthreads_or(int predicate) {
  so_emulator::Block& block = *so_emulator::current_block;
  if (predicate) block.or_accumulator.store(1, std::memory_order_relaxed);
  block.barrier.arrive_and_wait();
  return block.or_result;
}

// Integer atomics only: a float sum across blocks must not depend on their order
// (Note [deterministic sums] in block_sums.cuh).
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  return std::atomic_ref<unsigned>(*address).fetch_add(value);
}

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
