// Adam and AdamW (torch.optim.Adam / AdamW, foreach=False semantics), fused with unscaling and
// the skip on inf/nan (Note [found_inf contract]) and the param rounding options
// (Note [param rounding]).
#include "blockwise_quant.cuh"
#include "multi_tensor_apply.cuh"

// Mirrored by AdamArgs in scaledoptim/optim/adam.py. The host precomputes every scalar
// that does not depend on the (device-side) step.
struct AdamArgs {
  const float* found_inf;  // See Note [found_inf contract]; may be null
  const float* inv_scale;  // may be null: grads are not scaled
  float lr;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float log_beta1;     // log(beta1), -inf for beta1 == 0
  float log_beta2;
  float eps;
  float weight_decay;  // Adam's L2 term added to the gradient; 0 for AdamW
  float param_decay;   // AdamW's decoupled decay factor 1 - lr * weight_decay; 1 for Adam
  int amsgrad;
  int maximize;
};

// AdamList: generated from ADAM_KERNEL.lists; See Note [list enums] in kernels/sources.py

struct AdamStepScalars {
  float step_size;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
};

__device__ __forceinline__ AdamStepScalars adam_step_scalars(const AdamArgs& a, float step) {
  // 1 - beta^step as -expm1(step * log(beta)): accurate in fp32 where 1 - powf(beta, step)
  // would cancel for beta close to 1.
  AdamStepScalars s;
  s.step_size = a.lr / -expm1f(step * a.log_beta1);
  s.bias_correction2_sqrt = sqrtf(-expm1f(step * a.log_beta2));
  return s;
}

// torch.maximum: NaN in either operand propagates.
__device__ __forceinline__ float nan_propagating_max(float a, float b) {
  return (a < b || b != b) ? b : a;
}

// One element of Adam/AdamW in fp32. `g` is already unscaled.
__device__ __forceinline__ void adam_update(float& p, float g, float& m, float& v, float& v_max,
                                            const AdamArgs& a, const AdamStepScalars& s) {
  if (a.maximize) g = -g;
  if (a.weight_decay != 0.0f) g += a.weight_decay * p;
  p *= a.param_decay;
  m = torch_lerp(m, g, a.one_minus_beta1);
  v = v * a.beta2 + a.one_minus_beta2 * g * g;
  float second_moment = v;
  if (a.amsgrad) {
    v_max = nan_propagating_max(v_max, v);
    second_moment = v_max;
  }
  const float denom = sqrtf(second_moment) / s.bias_correction2_sqrt + a.eps;
  p += -s.step_size * (m / denom);
}

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    adam_kernel(TensorTable<kAdamLists> table, AdamArgs args) {
  update_each<P, G, kAdamExpAvgs, kAdamExpAvgSqs, kAdamMaxExpAvgSqs>(
      table, args, [&](StepCount step) {
        const AdamStepScalars s = adam_step_scalars(args, step.number);
        return [&, s](float& p, float g, float& m, float& v, float& v_max) {
          adam_update(p, g, m, v, v_max, args, s);
        };
      });
}

// Adam and AdamW with 8-bit states (state_bits=8): the same element math over the decoded
// moments (Note [low-bit blocks in a chunk] in blockwise_quant.cuh). AdamLowbitList: generated
// from ADAM_LOWBIT_KERNEL.lists.
using LowBitAdamArgs = LowBitArgs<AdamArgs>;

template <typename P, typename G>
__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    adam_lowbit_kernel(TensorTable<kAdamLowbitLists> table, LowBitAdamArgs args) {
  update_each_lowbit<P, G,
                     LowBitList<kAdamLowbitExpAvgsCodes, kAdamLowbitExpAvgsScales, SignedCode>,
                     LowBitList<kAdamLowbitExpAvgSqsCodes, kAdamLowbitExpAvgSqsScales, UnsignedCode>,
                     LowBitList<kAdamLowbitMaxExpAvgSqsCodes, kAdamLowbitMaxExpAvgSqsScales,
                                UnsignedCode>>(table, args, [&](StepCount step) {
    const AdamStepScalars s = adam_step_scalars(args.update, step.number);
    return [&, s](float& p, float g, float& m, float& v, float& v_max) {
      adam_update(p, g, m, v, v_max, args.update, s);
    };
  });
}
