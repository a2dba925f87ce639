// Read-only inf/nan check: sets *found_inf = 1 if any element of any tensor, times *inv_scale,
// is not finite; non_finite_check_norm_kernel also sums the squares of those products (the
// global grad norm of clipping: Note [clipping in the step] in scaledoptim/protocol/clipping.py).
#include "block_sums.cuh"

// NonFiniteCheckList, NonFiniteCheckNormList: generated from NON_FINITE_CHECK.lists and
// NON_FINITE_CHECK_NORM.lists; See Note [list enums] in kernels/sources.py

// Mirrored by NonFiniteCheckArgs in scaledoptim/kernels/builtin.py.
struct NonFiniteCheckArgs {
  float* found_inf;        // See Note [found_inf contract]: only ever set to 1
  const float* inv_scale;  // may be null: the values are checked as they are
};

template <typename T>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    non_finite_check_kernel(TensorTable<kNonFiniteCheckLists> table, NonFiniteCheckArgs args) {
  const Chunk c = this_blocks_chunk(table);
  const T* x = chunk_data<const T>(table, kNonFiniteCheckTensors, c);
  // The product the update kernels compute in registers (rg[k] * u.inv_scale): at a scale below
  // 1 a finite scaled grad can unscale to inf, and that is what the update would read.
  const float inv_scale = read_inv_scale(args.inv_scale);
  int seen = 0;
  for_each_lanes(c.size, is_aligned(x), [&](const Lanes& l) {
    float r[kILP];
    load(r, x, l);
#pragma unroll
    for (int k = 0; k < kILP; ++k) seen |= !is_finite(r[k] * inv_scale);
  });
  // One store per block rather than one per bad element.
  if (__syncthreads_or(seen) && threadIdx.x == 0) *args.found_inf = 1.0f;
}

// Mirrored by NonFiniteCheckNormArgs in scaledoptim/kernels/builtin.py.
struct NonFiniteCheckNormArgs {
  float* found_inf;        // See Note [found_inf contract]: only ever set to 1
  const float* inv_scale;  // may be null: the values are checked as they are
  float* norm_sq;          // the sum of squares, stored by the last block to arrive
  const float* partials;   // every chunk's partial sum: the per-chunk list, as one buffer
  unsigned* arrivals;      // See Note [deterministic sums]: 0 between launches
  unsigned n_chunks;       // chunks of every tensor, over all launches
};

// The check and, in the same read, the fp32 sum of squares of the unscaled values. It runs
// whatever found_inf says (a non-finite value makes the sum non-finite too).
template <typename T>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    non_finite_check_norm_kernel(TensorTable<kNonFiniteCheckNormLists> table,
                                 NonFiniteCheckNormArgs args) {
  __shared__ float scratch[kMaxThreadsPerBlock];
  const Chunk c = this_blocks_chunk(table);
  const T* x = chunk_data<const T>(table, kNonFiniteCheckNormTensors, c);
  const float inv_scale = read_inv_scale(args.inv_scale);
  int seen = 0;
  float sum = 0.0f;
  for_each_lanes(c.size, is_aligned(x), [&](const Lanes& l) {
    float r[kILP];
    load(r, x, l);  // lanes past the end load 0
#pragma unroll
    for (int k = 0; k < kILP; ++k) {
      const float u = r[k] * inv_scale;
      seen |= !is_finite(u);
      sum += u * u;
    }
  });
  if (__syncthreads_or(seen) && threadIdx.x == 0) *args.found_inf = 1.0f;
  finish_chunked_sum(table, kNonFiniteCheckNormSqPartials, c, block_sum(sum, scratch),
                     args.partials, args.arrivals, args.n_chunks, args.norm_sq, scratch);
}
