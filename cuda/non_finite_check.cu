// Read-only inf/nan check: sets *found_inf = 1 if any element of any tensor, times *inv_scale,
// is not finite.
#include "multi_tensor_apply.cuh"

// Mirrored by NonFiniteCheckArgs in scaledoptim/kernels/builtin.py.
struct NonFiniteCheckArgs {
  float* found_inf;        // Note [found_inf contract]: only ever set to 1
  const float* inv_scale;  // may be null: the values are checked as they are
};

template <typename T>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    non_finite_check_kernel(TensorTable<1> table, NonFiniteCheckArgs args) {
  const Chunk c = this_blocks_chunk(table);
  const T* x = chunk_data<const T>(table, 0, c);
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
