// The last launch of a fused step: advances every step counter unless the step is skipped
// (Note [step counters]) and, in the first block of the first launch, moves the loss scale.
#include "multi_tensor_apply.cuh"

// StepEpilogueList: generated from STEP_EPILOGUE.lists; See Note [list enums] in kernels/sources.py

// Mirrored by StepEpilogueArgs in scaledoptim/kernels/builtin.py.
struct StepEpilogueArgs {
  const float* found_inf;        // gates the counters (Note [found_inf contract]); may be null
  const float* scale_found_inf;  // drives the scale (a shared scale's round maximum); null: no update
  const float* scaled_by;        // the scale the grads were multiplied by (may alias `scale`)
  float* scale;                  // the recommended scale, written in place
  int* growth_tracker;
  int* hysteresis_tracker;
  double growth_factor;
  double backoff_factor;
  float min_scale;
  float max_scale;
  long long growth_interval;  // 64 bits: "never grow" is an interval no int32 tracker reaches
  int hysteresis;             // at most the int32 tracker's maximum (ScalingConfig clamps it)
  int force_backoff;          // closure replay: every overflow backs off
};

// The growth tracker counts clean steps in an int32 and stops at its maximum instead of wrapping
// (a wrapped count would grow the scale early); only an interval above it is ever that far.
constexpr int kMaxTrackedSteps = 2147483647;

// Note [scale update]
// ~~~~~~~~~~~~~~~~~~~
// LossScale.update_ in scaledoptim/scale/loss_scale.py holds the same rules with torch ops.
// Back off by backoff_factor (not below min_scale) once hysteresis overflows in a row were seen,
// or at once when forced; grow by growth_factor (not above max_scale, never to inf) when the
// clean steps reach growth_interval, torch's rule: a tracker already past it (loaded after a
// shortened interval) counts on without growing until an overflow resets it (Note [growth
// tracker past the interval] in loss_scale.py). Compared in 64 bits: an interval of 2**31 or
// more never comes.
// `scaled_by * factor` is computed in double and rounded once, as torch._amp_update_scale_
// does. With hysteresis 1 the hysteresis tracker is left alone.
__device__ __forceinline__ void update_scale(const StepEpilogueArgs& a) {
  const bool overflow = *a.scale_found_inf != 0.0f;
  const float scaled_by = *a.scaled_by;
  const int tolerated = *a.hysteresis_tracker - 1;
  const int hysteresis_left = overflow ? (tolerated > 0 ? tolerated : 0) : a.hysteresis;
  const bool back_off = overflow && (a.force_backoff || hysteresis_left <= 0);
  const long long clean_steps = static_cast<long long>(*a.growth_tracker) + 1;
  const bool grow = !overflow && clean_steps == a.growth_interval;
  float next = scaled_by;
  if (back_off) {
    next = static_cast<float>(static_cast<double>(scaled_by) * a.backoff_factor);
    if (next < a.min_scale) next = a.min_scale;
  } else if (grow) {
    const float grown = static_cast<float>(static_cast<double>(scaled_by) * a.growth_factor);
    if (is_finite(grown)) next = grown < a.max_scale ? grown : a.max_scale;
  }
  *a.scale = next;
  *a.growth_tracker = (overflow || grow)               ? 0
                      : clean_steps < kMaxTrackedSteps ? static_cast<int>(clean_steps)
                                                       : kMaxTrackedSteps;
  if (a.hysteresis > 1) *a.hysteresis_tracker = hysteresis_left;
}

__global__ void __launch_bounds__(kMaxThreadsPerBlock)
    step_epilogue_kernel(TensorTable<kStepEpilogueLists> table, StepEpilogueArgs args) {
  // One thread moves the scale; no other block reads it or its trackers in this launch.
  if (args.scale_found_inf != nullptr && blockIdx.x == 0 && threadIdx.x == 0) update_scale(args);
  if (step_is_skipped(args.found_inf)) return;  // See Note [found_inf contract]
  const Chunk c = this_blocks_chunk(table);
  float* steps = chunk_data<float>(table, kStepEpilogueSteps, c);
  for_each_lanes(c.size, is_aligned(steps), [&](const Lanes& l) {
    float r[kILP];
    load(r, steps, l);
#pragma unroll
    for (int k = 0; k < kILP; ++k) r[k] += 1.0f;
    store(steps, r, l);
  });
}
