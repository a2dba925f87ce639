// Low-bit optimizer states in registers: an update kernel whose states are 8-bit block-wise codes
// decodes them, runs the optimizer's element math and encodes them again in the pass that reads
// the grad (Note [block-wise codes] and Note [dithered rounding] in
// scaledoptim/fused/lowbit/codes.py; the torch form is scaledoptim/fused/lowbit/form.py).
#pragma once
#include "multi_tensor_apply.cuh"

// Mirrored by lowbit_args_type() in scaledoptim/fused/lowbit/states.py: the float32 kernel's
// args, and the block size (elements per scale). A kernel file names each instance
// `LowBit<Args>` (`using LowBitAdamArgs = LowBitArgs<AdamArgs>;`), the name its ctypes mirror
// has.
template <typename Args>
struct LowBitArgs {
  Args update;
  long long block_size;
};

// The codes of codes.py, as minifloats: `value = 2^(e - (2^E - 1)) * (1 + m / 2^M)` for the
// magnitude index e << M | m; SignedCode's bit 7 is the sign and its magnitude 0 is zero.
template <bool kIsSigned, int kExponentBits, int kMantissaBits>
struct MinifloatCode {
  static constexpr bool kSigned = kIsSigned;
  static constexpr int kShift = 23 - kMantissaBits;  // float32 mantissa bits dropped
  static constexpr int kMaxIndex = kIsSigned ? 127 : 255;
  // float32 exponent field of magnitude index 0
  static constexpr int kExponentOffset = 127 - ((1 << kExponentBits) - 1);
  static constexpr float kMax = 2.0f - 1.0f / (1 << kMantissaBits);

  __device__ __forceinline__ static float decode(unsigned code) {
    const unsigned magnitude = kIsSigned ? code & 0x7fu : code;
    unsigned bits = (magnitude + (static_cast<unsigned>(kExponentOffset) << kMantissaBits))
                    << kShift;
    if (kIsSigned) {
      if (magnitude == 0) bits = 0;
      bits |= (code & 0x80u) << 24;
    }
    return so_float_from_bits(bits);
  }

  // `normalized`: the value over its block's scale; `dither`: the element's 32 bits of Note
  // [dithered rounding]. The same int32 arithmetic as Code.encode: no step can overflow (the
  // magnitude is below 2^31, the offset is negative and larger than the noise).
  __device__ __forceinline__ static unsigned encode(float normalized, unsigned dither) {
    const unsigned bits = so_float_bits(normalized);
    const int magnitude = static_cast<int>(bits & 0x7fffffffu);
    const int offset = (1 << (kShift - 1)) - (kExponentOffset << 23);
    int index = (static_cast<int>(dither) >> (32 - kShift)) + magnitude + offset;
    index >>= kShift;
    index = index < 0 ? 0 : (index > kMaxIndex ? kMaxIndex : index);
    unsigned code = static_cast<unsigned>(index);
    if (kIsSigned) code |= (bits >> 24) & 0x80u;
    return code;
  }
};

// Mirrors SIGNED and UNSIGNED in codes.py.
using SignedCode = MinifloatCode<true, 4, 3>;
using UnsignedCode = MinifloatCode<false, 4, 4>;

// The multipliers of Note [dithered rounding] (DITHER_INDEX, DITHER_STEP in codes.py).
constexpr unsigned kDitherIndex = 0x9E3779B9u;
constexpr unsigned kDitherStep = 0x61C88647u;

// A low-bit state of a kernel's table: its codes list, its scales list, its code.
template <int kCodesList, int kScalesList, typename C>
struct LowBitList {
  static constexpr int kCodes = kCodesList;
  static constexpr int kScales = kScalesList;
  using Code = C;
};

// torch.amax's max: a NaN in either operand propagates.
__device__ __forceinline__ float nan_propagating_fmax(float a, float b) {
  return (a < b || b != b) ? b : a;
}

// torch.clamp_min's: a NaN stays one.
__device__ __forceinline__ float nan_propagating_clamp_min(float x, float low) {
  return x < low ? low : x;
}

// One low-bit state in a thread's registers while it works through one block of the chunk.
// A list the host left null (a state an option turns off) reads as 0 and is never written.
template <typename L>
struct LowBitLane {
  unsigned char* codes;  // the chunk's codes, or null
  float* scales;         // the chunk's scales (one per block), or null
  float scale;           // the block's scale as read
  float value;           // the element's value: decoded, then updated by the math
  float absmax;          // the largest |updated value| this thread saw in the block
  float normalizer;      // 1 / the block's new scale (clamped: Note [block-wise codes])

  __device__ __forceinline__ void begin_block(long long block) {
    scale = scales ? scales[block] : 0.0f;
    absmax = 0.0f;
  }
  __device__ __forceinline__ void load(long long i) {
    value = codes ? L::Code::decode(codes[i]) * scale : 0.0f;
  }
  __device__ __forceinline__ void track() {
    absmax = nan_propagating_fmax(absmax, fabsf(value));
  }
  __device__ __forceinline__ void store(long long i, unsigned dither) const {
    if (codes) codes[i] = static_cast<unsigned char>(L::Code::encode(value * normalizer, dither));
  }
};

// The largest of `v` over the `group` consecutive threads of this thread's group (threads
// [k * group, (k + 1) * group)), NaN-propagating, in every thread of the group; a fixed tree
// (a max is exact whatever the order). Called by every thread of the block; `scratch`:
// __shared__ storage for kMaxThreadsPerBlock floats.
__device__ __forceinline__ float group_max(float v, float* scratch, unsigned group) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  const unsigned lane = threadIdx.x % group;
  for (unsigned s = 1; s < group; s <<= 1) {
    if (lane % (2 * s) == 0 && lane + s < group && threadIdx.x + s < blockDim.x) {
      scratch[threadIdx.x] = nan_propagating_fmax(scratch[threadIdx.x], scratch[threadIdx.x + s]);
    }
    __syncthreads();
  }
  const float result = scratch[threadIdx.x - lane];
  __syncthreads();  // scratch may be reused
  return result;
}

// Note [low-bit blocks in a chunk]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A chunk is whole blocks (the launcher aligns the chunk size to the block size) but for the
// tensor's last. The threads of a CUDA block work in groups of min(blockDim.x, block_size)
// consecutive threads, a group per block of the state at a time, its threads striding over the
// block's elements (coalesced). A block's new scale is the largest magnitude of its updated
// values, which no element may be encoded before: so each group makes two passes over its
// block. The first runs the update on every element in registers and keeps only the largest
// magnitude per state (the params are not written); the group then takes the max over its
// threads (group_max); the second runs the same update on the same inputs, the same bits,
// stores the params and encodes the states with the new scale and the dither. The second pass
// reads what the first just read, from cache. So any block size runs on any block of threads,
// within the registers of one element's update.

// The whole block of a low-bit update kernel (its lists: params, grads, per state its codes and
// scales, then master_params, sr_seeds, steps):
//   update_each_lowbit<P, G, LowBitList<codes, scales, Code>...>(table, args, per_chunk)
// as update_each (multi_tensor_apply.cuh): `per_chunk(step)` returns the element math, which
// gets the param, the unscaled grad and each state's value as float&.
template <typename P, typename G, typename... L, int N, typename Args, typename PerChunk>
__device__ __forceinline__ void update_each_lowbit(const TensorTable<N>& table,
                                                   const LowBitArgs<Args>& args,
                                                   const PerChunk& per_chunk) {
  static_assert(((L::kCodes > kGradList && L::kScales < N - 3) && ...),
                "state lists lie between grads and master_params (Note [update kernel lists])");
  if (step_is_skipped(args.update.found_inf)) return;  // See Note [found_inf contract]
  __shared__ float scratch[kMaxThreadsPerBlock];
  const UpdateChunk u = update_chunk(table, args.update);
  const auto math = per_chunk(u.step);
  P* p = chunk_data<P>(table, kParamList, u.chunk);
  const G* g = chunk_data<const G>(table, kGradList, u.chunk);
  const long long block_size = args.block_size;
  const long long first_block = u.chunk.start / block_size;  // a chunk starts a block
  const long long blocks = (u.chunk.size + block_size - 1) / block_size;
  const unsigned group = block_size < blockDim.x ? static_cast<unsigned>(block_size) : blockDim.x;
  const unsigned groups = blockDim.x / group;
  const unsigned lane = threadIdx.x % group;
  const bool in_group = threadIdx.x < groups * group;
  const unsigned step_dither = static_cast<unsigned>(u.step.number) * kDitherStep;
  // See Note [low-bit blocks in a chunk]
  auto element = [&](long long i, bool second_pass, LowBitLane<L>&... state) {
    const Lanes l{i, 1, i + 1, false};
    float rp[1];
    load_param(rp, p, u.rounding, l);
    const float gv = to_float(g[i]) * u.inv_scale;
    (state.load(i), ...);
    math(rp[0], gv, state.value...);
    if (!second_pass) {
      (state.track(), ...);
      return;
    }
    store_param(p, rp, u.rounding, l);
    const unsigned dither =
        static_cast<unsigned>(u.chunk.start + i) * kDitherIndex + step_dither;
    (state.store(i, dither), ...);
  };
  auto run = [&](LowBitLane<L>... state) {
    for (long long round = 0; round < blocks; round += groups) {
      const long long block = round + threadIdx.x / group;
      const bool active = in_group && block < blocks;
      const long long begin = block * block_size;
      const long long end =
          begin + block_size < u.chunk.size ? begin + block_size : u.chunk.size;
      if (active) {
        (state.begin_block(block), ...);
        for (long long i = begin + lane; i < end; i += group) element(i, false, state...);
      }
      ((state.absmax = group_max(state.absmax, scratch, group)), ...);
      ((state.normalizer = 1.0f / nan_propagating_clamp_min(state.absmax / L::Code::kMax,
                                                             1.17549435e-38f)),
       ...);
      if (!active) continue;
      for (long long i = begin + lane; i < end; i += group) element(i, true, state...);
      if (lane == 0) {
        ((state.scales ? state.scales[block] = state.absmax / L::Code::kMax : 0.0f), ...);
      }
    }
  };
  run(LowBitLane<L>{optional_chunk_data<unsigned char>(table, L::kCodes, u.chunk),
                    table.ptrs[L::kScales][u.chunk.tensor]
                        ? static_cast<float*>(table.ptrs[L::kScales][u.chunk.tensor]) + first_block
                        : nullptr,
                    0.0f, 0.0f, 0.0f, 0.0f}...);
}
