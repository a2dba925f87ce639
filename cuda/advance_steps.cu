// Adds 1 to every step counter unless the step is skipped: the last launch of an optimizer
// step (Note [step counters]).
#include "multi_tensor_apply.cuh"

// Mirrored by AdvanceStepsArgs in scaledoptim/kernels/builtin.py.
struct AdvanceStepsArgs {
  const float* found_inf;  // Note [found_inf contract]
};

__global__ void advance_steps_kernel(TensorTable<1> table, AdvanceStepsArgs args) {
  if (step_is_skipped(args.found_inf)) return;  // Note [found_inf contract]
  const Chunk c = this_blocks_chunk(table);
  float* steps = chunk_data<float>(table, 0, c);
  for_each_lanes(c.size, is_aligned(steps), [&](const Lanes& l) {
    float r[kILP];
    load(r, steps, l);
#pragma unroll
    for (int k = 0; k < kILP; ++k) r[k] += 1.0f;
    store(steps, r, l);
  });
}
