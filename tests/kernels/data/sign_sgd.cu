// The kernel of docs/kernels.md's fused optimizer: signSGD, p -= lr * sign(g).
#include "multi_tensor_apply.cuh"

struct SignSgdArgs {
  const float* found_inf;  // Note [found_inf contract]; may be null
  const float* inv_scale;  // may be null: grads are not scaled
  float lr;
};

__device__ __forceinline__ float sign_sgd_update(float p, float g, const SignSgdArgs& a) {
  return p - a.lr * (float)((g > 0.0f) - (g < 0.0f));
}

template <typename P, typename G>
__global__ void sign_sgd_kernel(TensorTable<3> table, SignSgdArgs args) {
  if (step_is_skipped(args.found_inf)) return;  // Note [found_inf contract]
  const Chunk c = this_blocks_chunk(table);
  P* p = chunk_data<P>(table, 0, c);
  const G* g = chunk_data<const G>(table, 1, c);
  const float inv_scale = args.inv_scale ? *args.inv_scale : 1.0f;
  for_each_lanes(c.size, all_aligned(p, g), [&](const Lanes& l) {
    float rp[kILP], rg[kILP];
    load(rp, p, l);
    load(rg, g, l);
    for (int k = 0; k < kILP; ++k) rp[k] = sign_sgd_update(rp[k], rg[k] * inv_scale, args);
    store(p, rp, l);
  });
}
