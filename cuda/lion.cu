// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), fused with
// unscaling, the skip on inf/nan (Note [found_inf contract]) and the param rounding options
// (Note [param rounding]).
#include "blockwise_quant.cuh"
#include "multi_tensor_apply.cuh"

// Mirrored by LionArgs in scaledoptim/optim/lion.py.
struct LionArgs {
  const float* found_inf;  // See Note [found_inf contract]; may be null
  const float* inv_scale;  // may be null: grads are not scaled
  float lr;
  float one_minus_beta1;
  float one_minus_beta2;
  float param_decay;  // decoupled decay factor 1 - lr * weight_decay
  int maximize;
};

// LionList: generated from LION_KERNEL.lists; See Note [list enums] in kernels/sources.py

// One element of Lion in fp32. `g` is already unscaled. The interpolations are torch's lerp
// (`m.lerp(g, 1 - beta)`), so the torch form is one foreach op each, with these bits.
__device__ __forceinline__ void lion_update(float& p, float g, float& m, const LionArgs& a) {
  if (a.maximize) g = -g;
  const float c = torch_lerp(m, g, a.one_minus_beta1);
  const float sign = static_cast<float>((c > 0.0f) - (c < 0.0f));  // sign(0) = 0
  p = p * a.param_decay - a.lr * sign;
  m = torch_lerp(m, g, a.one_minus_beta2);
}

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    lion_kernel(TensorTable<kLionLists> table, LionArgs args) {
  update_each<P, G, kLionExpAvgs>(table, args, [&](StepCount) {
    return [&](float& p, float g, float& m) { lion_update(p, g, m, args); };
  });
}

// Lion with an 8-bit momentum (state_bits=8; Note [low-bit blocks in a chunk] in
// blockwise_quant.cuh). LionLowbitList: generated from LION_LOWBIT_KERNEL.lists.
using LowBitLionArgs = LowBitArgs<LionArgs>;

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    lion_lowbit_kernel(TensorTable<kLionLowbitLists> table, LowBitLionArgs args) {
  update_each_lowbit<P, G, LowBitList<kLionLowbitExpAvgsCodes, kLionLowbitExpAvgsScales, SignedCode>>(
      table, args, [&](StepCount) {
        return [&](float& p, float g, float& m) { lion_update(p, g, m, args.update); };
      });
}
