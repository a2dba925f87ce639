// Multi-tensor apply: one launch updates many tensors. The launcher
// (scaledoptim/kernels/table.py) splits every tensor into chunks of `chunk_size` elements and
// fills a TensorTable per launch; block b of the launch processes chunk b of the table.
#pragma once
#include "common.cuh"
#include "dtypes.cuh"

// Elements per thread per iteration, unless a kernel asks for more: 4 fp32 = one 16-byte vector
// load. See Note [vector lanes].
constexpr int kILP = 4;
// The widest load or store one thread issues (LDG.128 / STG.128).
constexpr int kVectorBytes = 16;
// Chunks per launch, as in apex/torch.
constexpr int kMaxChunks = 320;
// The table travels by value in the kernel parameters, which CUDA caps at 4 KB; keep room for
// the kernel's scalar-argument struct.
constexpr int kKernelParamBytes = 4096;
constexpr int kArgsReserveBytes = 256;

// Note [multi-tensor table layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Mirrored field for field by scaledoptim/kernels/table.py (the emulator checks sizeof at
// load time). `ptrs[list][slot]` is the data pointer of tensor `slot` in tensor list `list`
// (null for a list the kernel does not read, e.g. max_exp_avg_sq without amsgrad); `sizes[slot]`
// is the element count of the tensors of list 0. A tensor whose chunks do not fit in one table
// continues in the next launch, in slot 0.
template <int N_LISTS>
struct TensorTable {
  static constexpr int kMaxTensorsByBytes =
      (kKernelParamBytes - kArgsReserveBytes - kMaxChunks * 5 - 8) / (8 * (N_LISTS + 1));
  static constexpr int kMaxTensors = kMaxTensorsByBytes < 255 ? kMaxTensorsByBytes : 255;

  void* ptrs[N_LISTS][kMaxTensors];
  long long sizes[kMaxTensors];
  long long chunk_size;  // a multiple of kILP (of 8 for 16-byte 16-bit vectors in every chunk)
  int chunk_index[kMaxChunks];  // chunk number within its tensor
  unsigned char chunk_tensor[kMaxChunks];  // slot of the chunk's tensor
};

struct Chunk {
  int tensor;       // slot in the table
  long long start;  // first element of the chunk within the tensor
  long long size;   // elements in the chunk
};

template <int N>
__device__ __forceinline__ Chunk this_blocks_chunk(const TensorTable<N>& table) {
  Chunk c;
  c.tensor = table.chunk_tensor[blockIdx.x];
  c.start = static_cast<long long>(table.chunk_index[blockIdx.x]) * table.chunk_size;
  const long long left = table.sizes[c.tensor] - c.start;
  c.size = left < table.chunk_size ? left : table.chunk_size;
  return c;
}

// The chunk's elements in list `list`.
template <typename T, int N>
__device__ __forceinline__ T* chunk_data(const TensorTable<N>& table, int list, const Chunk& c) {
  return static_cast<T*>(table.ptrs[list][c.tensor]) + c.start;
}

// As chunk_data, or null for a list the host left null.
template <typename T, int N>
__device__ __forceinline__ T* optional_chunk_data(const TensorTable<N>& table, int list,
                                                  const Chunk& c) {
  return table.ptrs[list][c.tensor] ? chunk_data<T>(table, list, c) : nullptr;
}

// The single element of a per-tensor list (e.g. the step counter).
template <typename T, int N>
__device__ __forceinline__ T* tensor_scalar(const TensorTable<N>& table, int list, const Chunk& c) {
  return static_cast<T*>(table.ptrs[list][c.tensor]);
}

// Note [vector lanes]
// ~~~~~~~~~~~~~~~~~~~
// A thread handles ILP elements ("lanes") of every list per iteration. Where every list's chunk
// is aligned, the lanes are contiguous and each list moves them in 16-byte accesses (fewer when
// ILP elements are narrower): 4 fp32 = one float4, 8 fp16/bf16 = one 16-byte access, 8 fp32 = two
// float4. Elsewhere (a view at an odd storage offset, the tail after the last whole vector) the
// lanes are guarded scalars. Lanes only decide which thread touches which element, never the
// per-element math: an elementwise kernel gives the same bits at any ILP and on either path.
// update_each picks ILP so that its narrowest list moves 16 bytes (kUpdateLanes); kernels
// that sum across lanes (LAMB's norms) keep kILP, so their order of summation stays put.

// Elements of T in one vector access of ILP lanes.
template <typename T, int ILP>
constexpr int kVectorWidth = ILP * static_cast<int>(sizeof(T)) < kVectorBytes
                                 ? ILP
                                 : kVectorBytes / static_cast<int>(sizeof(T));

template <typename T, int W>
struct alignas(sizeof(T) * W) Vec {
  T x[W];
};

template <int ILP = kILP, typename T>
__device__ __forceinline__ bool is_aligned(const T* p) {
  return reinterpret_cast<so_uintptr>(p) % sizeof(Vec<T, kVectorWidth<T, ILP>>) == 0;
}

// Null pointers (lists the kernel does not read) count as aligned.
template <int ILP = kILP, typename... T>
__device__ __forceinline__ bool all_aligned(const T*... p) {
  return (is_aligned<ILP>(p) && ...);
}

// The ILP elements one thread handles in one iteration: first + k * stride for k < ILP.
// Vector lanes are contiguous and in bounds; scalar lanes are strided across the block (so the
// block's accesses stay coalesced) and only those with index < end exist.
struct Lanes {
  long long first;
  long long stride;
  long long end;
  bool vector;

  __device__ __forceinline__ bool active(int k) const { return first + k * stride < end; }
};

// Loads the lanes as fp32; inactive lanes read as 0 and are never stored.
template <int ILP, typename T>
__device__ __forceinline__ void load(float (&r)[ILP], const T* p, const Lanes& l) {
  if (l.vector) {
    constexpr int W = kVectorWidth<T, ILP>;
    const Vec<T, W>* vectors = reinterpret_cast<const Vec<T, W>*>(p + l.first);
#pragma unroll
    for (int j = 0; j < ILP / W; ++j) {
      const Vec<T, W> v = vectors[j];
#pragma unroll
      for (int k = 0; k < W; ++k) r[j * W + k] = to_float(v.x[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < ILP; ++k) r[k] = l.active(k) ? to_float(p[l.first + k * l.stride]) : 0.0f;
  }
}

// Stores the lanes, each rounded once (round-to-nearest-even) to T.
template <int ILP, typename T>
__device__ __forceinline__ void store(T* p, const float (&r)[ILP], const Lanes& l) {
  if (l.vector) {
    constexpr int W = kVectorWidth<T, ILP>;
    Vec<T, W>* vectors = reinterpret_cast<Vec<T, W>*>(p + l.first);
#pragma unroll
    for (int j = 0; j < ILP / W; ++j) {
      Vec<T, W> v;
#pragma unroll
      for (int k = 0; k < W; ++k) v.x[k] = from_float<T>(r[j * W + k]);
      vectors[j] = v;
    }
  } else {
#pragma unroll
    for (int k = 0; k < ILP; ++k) {
      if (l.active(k)) p[l.first + k * l.stride] = from_float<T>(r[k]);
    }
  }
}

// Calls body(Lanes) until this thread has covered its share of the chunk's `n` elements:
// vectors of ILP lanes while every pointer is aligned, guarded scalars for the rest
// (Note [vector lanes]).
template <int ILP = kILP, typename Body>
__device__ __forceinline__ void for_each_lanes(long long n, bool aligned, Body&& body) {
  const long long threads = blockDim.x;
  const long long vector_end = aligned ? n / ILP * ILP : 0;
  for (long long i = threadIdx.x * ILP; i < vector_end; i += threads * ILP) {
    body(Lanes{i, 1, vector_end, true});
  }
  for (long long i = vector_end + threadIdx.x; i < n; i += threads * ILP) {
    body(Lanes{i, threads, n, false});
  }
}

// Note [param rounding]
// ~~~~~~~~~~~~~~~~~~~~~
// The update kernels of the fused optimizers take two lists just before the step counters:
//  * `master_params`: an fp32 master copy per param (master_weights=True), or null pointers.
//    The update then reads and writes the master and stores the param rounded to nearest from
//    it, in the same pass (an fp32 param is passed as its own master).
//  * `sr_seeds`: per param, the bits of a 0-dim int32 seed (passed as float32), or null: the
//    param is then stored rounded stochastically (Note [stochastic rounding], bf16 only; the
//    host rejects other dtypes).
// A skipped step returns before either is read (Note [found_inf contract]).
struct ParamRounding {
  float* master;     // the chunk's master elements, or null
  bool stochastic;
  unsigned key;      // so_sr_key(seed, taken steps including this one)
  long long start;   // index of the chunk's first element in its tensor
};

// `taken_steps`: the step count including this step (*step + 1, Note [step counters]).
template <int N>
__device__ __forceinline__ ParamRounding param_rounding(const TensorTable<N>& table, int master_list,
                                                       int seed_list, const Chunk& c,
                                                       float taken_steps) {
  ParamRounding r;
  r.master = optional_chunk_data<float>(table, master_list, c);
  const float* seed = static_cast<const float*>(table.ptrs[seed_list][c.tensor]);
  r.stochastic = seed != nullptr;
  r.key = seed ? so_sr_key(so_float_bits(*seed), static_cast<unsigned>(taken_steps)) : 0u;
  r.start = c.start;
  return r;
}

// The param's lanes as fp32: from the master when there is one.
template <int ILP, typename P>
__device__ __forceinline__ void load_param(float (&r)[ILP], const P* p, const ParamRounding& pr,
                                           const Lanes& l) {
  if (pr.master) {
    load(r, pr.master, l);
  } else {
    load(r, p, l);
  }
}

// Stochastic rounding exists for bf16 only; the host never asks it of another type.
template <int ILP, typename T>
__device__ __forceinline__ void store_stochastic(T* p, const float (&r)[ILP], const Lanes& l,
                                                 const ParamRounding&) {
  store(p, r, l);
}

template <int ILP>
__device__ __forceinline__ void store_stochastic(so_bfloat16* p, const float (&r)[ILP], const Lanes& l,
                                                 const ParamRounding& pr) {
#pragma unroll
  for (int k = 0; k < ILP; ++k) {
    if (!l.active(k)) continue;
    const long long i = l.first + k * l.stride;
    p[i].bits = bfloat16_bits_from_float_sr(r[k], so_sr_noise(pr.key, pr.start + i));
  }
}

// Stores the updated fp32 lanes: into the master (if any), and into the param rounded to
// nearest or stochastically.
template <int ILP, typename P>
__device__ __forceinline__ void store_param(P* p, const float (&r)[ILP], const ParamRounding& pr,
                                            const Lanes& l) {
  if (pr.master) store(pr.master, r, l);
  if (pr.stochastic) {
    store_stochastic(p, r, l, pr);
  } else {
    store(p, r, l);
  }
}

// torch.lerp as ATen computes it on CPU (vectorised and scalar tails alike) and on CUDA: one
// fma from the nearer end (start + weight * (end - start), or end - (1 - weight) * (end - start)
// when |weight| >= 0.5), so a running average updated with lerp_ (Adam's exp_avg, RMSprop's
// grad_avg, Lion's) has torch's bits.
__device__ __forceinline__ float torch_lerp(float start, float end, float weight) {
  const float diff = end - start;
  return fabsf(weight) < 0.5f ? fmaf(weight, diff, start) : fmaf(weight - 1.0f, diff, end);
}

// Note [update kernel lists]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// An update kernel's table holds params, grads, its state lists (and any scratch lists), then
// master_params, sr_seeds (Note [param rounding]) and the step counters: the order in which the
// fused engine builds them (it finds the rounding lists at kernel.lists[-3:-1]). update_chunk
// and update_each find params, grads, rounding lists and steps there, so a kernel names only its
// state lists.
constexpr int kParamList = 0;
constexpr int kGradList = 1;

// See Note [step counters]: an update reads its tensor's counter once, before the step advances
// it.
struct StepCount {
  float taken;   // steps taken before this one: the counter as stored
  float number;  // this step's number, taken + 1: bias corrections and rounding keys count it
};

// 1 when the grads are not scaled (null inv_scale).
__device__ __forceinline__ float read_inv_scale(const float* inv_scale) {
  return inv_scale ? *inv_scale : 1.0f;
}

// What an update kernel reads once per block, after its skip check (Note [found_inf contract]).
struct UpdateChunk {
  Chunk chunk;
  float inv_scale;
  StepCount step;
  ParamRounding rounding;
};

template <int N, typename Args>
__device__ __forceinline__ UpdateChunk update_chunk(const TensorTable<N>& table, const Args& args) {
  UpdateChunk u;
  u.chunk = this_blocks_chunk(table);
  u.inv_scale = read_inv_scale(args.inv_scale);
  // See Note [update kernel lists]: the counters last, the rounding lists just before them.
  u.step.taken = *tensor_scalar<const float>(table, N - 1, u.chunk);
  u.step.number = u.step.taken + 1.0f;
  u.rounding = param_rounding(table, N - 3, N - 2, u.chunk, u.step.number);
  return u;
}

// One state list's lanes in registers; a list the host left null (an option that turns it
// off, e.g. max_exp_avg_sq without amsgrad) is neither read nor written and reads as 0.
template <int ILP>
struct StateLanes {
  float* data;
  float r[ILP];

  __device__ __forceinline__ void load(const Lanes& l) {
    if (data) ::load(r, data, l);
  }
  __device__ __forceinline__ void store(const Lanes& l) const {
    if (data) ::store(data, r, l);
  }
};

// Lanes per thread of an update with params P and grads G (Note [vector lanes]): its narrowest
// list moves 16 bytes per access (8 lanes when either is 16-bit; the fp32 lists then move two
// float4 each).
template <typename P, typename G>
constexpr int kUpdateLanes =
    kVectorBytes / static_cast<int>(sizeof(P) < sizeof(G) ? sizeof(P) : sizeof(G));

// C++ has no pack of local variables: each state list's lanes are one parameter of the pack.
template <int ILP, typename P, typename G, typename Math, typename... State>
__device__ __forceinline__ void update_lanes(P* p, const G* g, const UpdateChunk& u,
                                             const Math& math, const Lanes& l, State... state) {
  float rp[ILP], rg[ILP];
  load_param(rp, p, u.rounding, l);
  load(rg, g, l);
  (state.load(l), ...);
#pragma unroll
  for (int k = 0; k < ILP; ++k) math(rp[k], rg[k] * u.inv_scale, state.r[k]...);
  store_param(p, rp, u.rounding, l);
  (state.store(l), ...);
}

template <typename P, typename G, int N, typename Math, typename... State>
__device__ __forceinline__ void update_chunk_lanes(const TensorTable<N>& table,
                                                   const UpdateChunk& u, const Math& math,
                                                   State*... state) {
  constexpr int ILP = kUpdateLanes<P, G>;
  P* p = chunk_data<P>(table, kParamList, u.chunk);
  const G* g = chunk_data<const G>(table, kGradList, u.chunk);
  const bool aligned = all_aligned<ILP>(p, g, state..., u.rounding.master);
  for_each_lanes<ILP>(u.chunk.size, aligned, [&](const Lanes& l) {
    update_lanes<ILP>(p, g, u, math, l, StateLanes<ILP>{state, {}}...);
  });
}

// The whole block of an update kernel whose lists follow Note [update kernel lists]:
//   update_each<P, G, kStateList...>(table, args, [&](StepCount step) {
//     const Scalars s = ...;  // once per block, from the step
//     return [&, s](float& p, float g, float& state...) { ... };  // once per element
//   });
// The element math gets the param in fp32 (from its master when there is one, stored back
// rounded per Note [param rounding]), the grad multiplied by inv_scale, and one float& per
// listed state list, in order. A skipped step reads and writes nothing
// (Note [found_inf contract]). `args` needs the fields `found_inf` and `inv_scale`. A kernel
// whose blocks do more (LAMB's norm reductions) checks the skip itself, then reads the rest
// with update_chunk.
template <typename P, typename G, int... StateLists, int N, typename Args, typename PerChunk>
__device__ __forceinline__ void update_each(const TensorTable<N>& table, const Args& args,
                                            const PerChunk& per_chunk) {
  static_assert(((StateLists > kGradList && StateLists < N - 3) && ...),
                "state lists lie between grads and master_params (Note [update kernel lists])");
  if (step_is_skipped(args.found_inf)) return;  // See Note [found_inf contract]
  const UpdateChunk u = update_chunk(table, args);
  update_chunk_lanes<P, G>(table, u, per_chunk(u.step),
                           optional_chunk_data<float>(table, StateLists, u.chunk)...);
}
