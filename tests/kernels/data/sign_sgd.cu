// The kernel of docs/kernels.md's fused optimizer: signSGD, p -= lr * sign(g).
#include "multi_tensor_apply.cuh"

struct SignSgdArgs {
  const float* found_inf;  // See Note [found_inf contract]; may be null
  const float* inv_scale;  // may be null: grads are not scaled
  float lr;
};

// See Note [update kernel lists]: no state lists.
// SignSgdList: generated from SignSGD.kernel.lists; See Note [list enums] in kernels/sources.py

__device__ __forceinline__ void sign_sgd_update(float& p, float g, const SignSgdArgs& a) {
  p -= a.lr * (float)((g > 0.0f) - (g < 0.0f));
}

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    sign_sgd_kernel(TensorTable<kSignSgdLists> table, SignSgdArgs args) {
  update_each<P, G>(table, args, [&](StepCount) {  // once per block
    return [&](float& p, float g) { sign_sgd_update(p, g, args); };  // once per element
  });
}
