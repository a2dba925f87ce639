// In-place unscale with inf/nan check: x *= inv_scale, *found_inf = 1 if any x was not finite
// (the same semantics as torch._amp_foreach_non_finite_check_and_unscale_).
#include "multi_tensor_apply.cuh"

// Mirrored by UnscaleArgs in scaledoptim/kernels/builtin.py.
struct UnscaleArgs {
  float* found_inf;        // Note [found_inf contract]: only ever set to 1
  const float* inv_scale;  // device scalar, never read by the host
};

template <typename T>
__global__ void unscale_kernel(TensorTable<1> table, UnscaleArgs args) {
  const Chunk c = this_blocks_chunk(table);
  T* x = chunk_data<T>(table, 0, c);
  const float inv_scale = *args.inv_scale;
  int seen = 0;
  for_each_lanes(c.size, is_aligned(x), [&](const Lanes& l) {
    float r[kILP];
    load(r, x, l);
#pragma unroll
    for (int k = 0; k < kILP; ++k) {
      seen |= !is_finite(r[k]);
      r[k] *= inv_scale;
    }
    store(x, r, l);
  });
  if (__syncthreads_or(seen) && threadIdx.x == 0) *args.found_inf = 1.0f;
}
