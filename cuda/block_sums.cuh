// Sums over the elements of many blocks, with bits that depend on neither the order in which the
// blocks run nor which of them finishes last.
#pragma once
#include "multi_tensor_apply.cuh"

// Note [deterministic sums]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A float sum across blocks with atomicAdd adds the blocks' partials in the order they finish,
// which differs between runs on a GPU (and between CUDA-graph replays and the eager step), and
// float addition does not associate: the last bits change. So no kernel adds floats with
// atomics. A block sums its own elements in a fixed order (block_sum), stores that partial at
// the index of its chunk, and a later reader adds the partials in index order
// (fixed_order_sum), with a fixed pattern per block size. The reader is either a later launch
// (lamb_kernel reads the per-chunk partials lamb_norms_kernel stored), or, when one launch must
// finish the sum, the block that counts itself in last with an integer atomic
// (last_block_to_arrive): the count decides only *which* block adds, never the order of the
// additions. The emulator runs blocks in a seeded shuffled order (emulator_launch.h), so a sum
// that depends on block order differs between seeds there too.

// Sums `v` over the block in a fixed order (a tree over thread indices); valid in every thread.
// `scratch` is __shared__ storage for kMaxThreadsPerBlock floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = 1; s < blockDim.x; s <<= 1) {
    if (threadIdx.x % (2 * s) == 0 && threadIdx.x + s < blockDim.x) {
      scratch[threadIdx.x] += scratch[threadIdx.x + s];
    }
    __syncthreads();
  }
  const float total = scratch[0];
  __syncthreads();  // scratch may be reused
  return total;
}

// Sums partials[0, n) in a fixed order: thread t adds elements t, t + blockDim.x, ... in turn,
// then block_sum. Valid in every thread. Volatile reads: partials stored by other blocks of the
// same launch are read past the L1 cache, which is not coherent between multiprocessors.
__device__ __forceinline__ float fixed_order_sum(const volatile float* partials, long long n,
                                                 float* scratch) {
  float sum = 0.0f;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) sum += partials[i];
  return block_sum(sum, scratch);
}

// Counts this block in at `*arrivals` once its partials are stored (by thread 0), and returns in
// every thread whether it was the last of `expected` blocks (of this launch and earlier ones)
// to arrive; that block then resets the count to 0 for the next step or graph replay. Call it
// from every thread of every block that stores a partial, after the stores.
__device__ __forceinline__ bool last_block_to_arrive(unsigned* arrivals, unsigned expected) {
  if (threadIdx.x == 0) __threadfence();  // the partials are visible before the count
  const bool last =
      __syncthreads_or(threadIdx.x == 0 && atomicAdd(arrivals, 1u) == expected - 1) != 0;
  if (last) {
    __threadfence();  // and read after it
    if (threadIdx.x == 0) *arrivals = 0;
  }
  return last;
}

// The chunk number of this block's chunk within its tensor: where its partial goes in a list
// holding one element per chunk (MultiTensorKernel.per_chunk_lists).
template <int N>
__device__ __forceinline__ int this_blocks_chunk_number(const TensorTable<N>& table) {
  return table.chunk_index[blockIdx.x];
}

// How many chunks the tensor of `c` has: the length of its per-chunk lists.
template <int N>
__device__ __forceinline__ long long chunks_of_tensor(const TensorTable<N>& table, const Chunk& c) {
  return (table.sizes[c.tensor] + table.chunk_size - 1) / table.chunk_size;
}

// Ends a sum over every chunk of a step (Note [deterministic sums]): stores `total`, this block's
// sum (valid in thread 0), as its chunk's partial in the per-chunk list `list`, whose tensors'
// partials lie in order in one buffer, `partials`, of `n_chunks` elements (over all launches of
// the sum); the last block to arrive adds them in order into `*out`. Call it from every thread.
template <int N>
__device__ __forceinline__ void finish_chunked_sum(const TensorTable<N>& table, int list,
                                                   const Chunk& c, float total,
                                                   const float* partials, unsigned* arrivals,
                                                   unsigned n_chunks, float* out,
                                                   float* scratch) {
  if (threadIdx.x == 0) tensor_scalar<float>(table, list, c)[this_blocks_chunk_number(table)] = total;
  if (last_block_to_arrive(arrivals, n_chunks)) {
    const float sum = fixed_order_sum(partials, n_chunks, scratch);
    if (threadIdx.x == 0) *out = sum;
  }
}
