// hybridserve CUDA kernels: launcher declarations shared by the .cu files and ops.cpp.
//
// This header is torch-free on purpose: the .cu files include only the CUDA headers, so each
// compiles in seconds (the CI compile check builds every .cu for sm_90 without a GPU). ops.cpp
// (torch side) validates tensors, builds the parameter structs below and calls the launchers.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace hs {

// Element type of an activation / state tensor.
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// ------------------------------------------------------------------------------------------------
// Selective state update (decode / verify). Strides are in elements; the innermost dim of x, B, C
// has stride 1. ssm_state is contiguous [num_slots, H, P, N] float32.
struct SsuParams {
  const void* x;  // [T, H, P]
  int64_t x_st, x_sh;
  const void* dt;  // [T, H] raw
  int64_t dt_st, dt_sh;
  const void* B;  // [T, G, N]
  int64_t b_st, b_sg;
  const void* C;  // [T, G, N]
  int64_t c_st, c_sg;
  const float* A;        // [H]
  const float* D;        // [H]
  const float* dt_bias;  // [H]
  float* state;          // [S, H, P, N]
  const int64_t* qsl;    // [R + 1] (device)
  const int64_t* read_slot;    // [R]
  const int64_t* write_slots;  // [R, W] row stride ws_sr
  int64_t ws_sr, ws_w;
  void* out;  // [T, H, P] contiguous
  int T, H, P, N, G, R;
  float dt_min, dt_max;
  DType x_dtype;  // dtype of x / B / C / out (and dt unless dt_f32)
  bool dt_f32;    // dt is float32 (whatever x_dtype is)
};
void launch_ssu(const SsuParams& p, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------
// Chunked SSD scan (prefill). Chunk metadata is built on the host (ops.cpp).
struct SsdParams {
  const void* x;  // [T, H, P]
  int64_t x_st, x_sh;
  const void* dt;  // [T, H] raw
  int64_t dt_st, dt_sh;
  const void* B;  // [T, G, N]
  int64_t b_st, b_sg;
  const void* C;
  int64_t c_st, c_sg;
  const float* A;
  const float* D;
  const float* dt_bias;
  float* state;  // [S, H, P, N]
  void* out;     // [T, H, P] contiguous
  // chunk metadata (device): chunk_start[c] (flat token), chunk_len[c], row_chunk_off[R + 1]
  const int64_t* chunk_start;
  const int64_t* chunk_len;
  const int64_t* row_chunk_off;
  const int64_t* read_slot;          // [R] (device)
  const int64_t* has_init;           // [R] 0/1 (device)
  // scratch (device, float32)
  float* dtp;     // [T, H] processed dt
  float* lam;     // [T, H] inclusive cumsum of dt * A inside the chunk
  float* cb;      // [NC, G, Q, Q]
  float* states;  // [NC + R, H, P, N]: chunk states, then (after passing) states entering each
                  // chunk; the last R entries hold each row's final state
  int T, H, P, N, G, R, NC, Q;
  float dt_min, dt_max;
  DType x_dtype;
  bool dt_f32;  // dt is float32 (whatever x_dtype is)
};
void launch_ssd(const SsdParams& p, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------
// The Mamba1 selective scan (Jamba): every tensor float32; x, dt, B, C with unit inner stride;
// A [Dc, N], D [Dc] and ssm_state [S, Dc, N] contiguous; writes as CSR per row (device).
struct Mamba1Params {
  const float* x;  // [T, Dc]
  int64_t x_st;
  const float* dt;  // [T, Dc] processed
  int64_t dt_st;
  const float* B;  // [T, N]
  int64_t b_st;
  const float* C;  // [T, N]
  int64_t c_st;
  const float* A;  // [Dc, N]
  const float* D;  // [Dc]
  float* state;    // [S, Dc, N]
  const int64_t* qsl;            // [R + 1]
  const int64_t* read_slot;      // [R]
  const int64_t* has_init;       // [R] 0/1, or nullptr: every row reads its slot
  const int64_t* write_offsets;  // [R + 1]
  const int64_t* write_token;    // [E]
  const int64_t* write_slot;     // [E]
  float* out;                    // [T, Dc] contiguous
  int T, Dc, N, R;
};
void launch_mamba1(const Mamba1Params& p, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------
// Gather/scatter of whole state slots: dst_state[dst_slot[i]] = src_buf[src_index[i]] for every
// i with dst_slot[i] > 0 (bytes per slot = slot_bytes). Used for slot copies (src_buf == dst_state)
// and for writing gathered final / boundary states.
struct SlotCopyParams {
  const char* src;
  char* dst;
  const int64_t* src_index;  // [n] (device)
  const int64_t* dst_slot;   // [n] (device)
  int64_t n;
  int64_t slot_bytes;
};
void launch_slot_copy(const SlotCopyParams& p, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------
// Causal conv1d. conv_state is contiguous [S, Dc, W - 1] ("DS" layout) in state_dtype.
struct ConvParams {
  const void* x;  // [T, Dc], channel stride 1
  int64_t x_st;
  const void* weight;  // [Dc, W] contiguous (float32)
  const void* bias;    // [Dc] float32 or nullptr
  void* conv_state;    // [S, Dc, W - 1]
  const int64_t* qsl;        // [R + 1] (device)
  const int64_t* read_slot;  // [R]
  const int64_t* has_init;   // [R] 0/1 (prefill only)
  const int64_t* write_slots;  // update: [R, Wslots] (row stride ws_sr); unused by prefill
  int64_t ws_sr, ws_w;
  void* out;  // [T, Dc] contiguous
  int T, Dc, W, R;
  bool silu;
  DType x_dtype, state_dtype;
  // prefill only: windows to gather into `gather_out` ([n_gather, Dc, W - 1], state dtype): the
  // W - 1 inputs ending at token gather_tok[i] (index within row gather_row[i]).
  const int64_t* gather_row;
  const int64_t* gather_tok;
  void* gather_out;
  int n_gather;
};
void launch_conv_prefill(const ConvParams& p, cudaStream_t stream);
void launch_conv_update(const ConvParams& p, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------
// Rejection sampling (two launches for the batch: one CTA per request and vocabulary tile, then
// one warp per request). Row r owns the k_r + 1 consecutive target rows starting at
// sum_{q<r} (k_q + 1) and the drafts starting at sum_{q<r} k_q; the kernels compute both sums.
struct RejectionParams {
  const float* probs;  // [M, V] target probabilities p (after every logits processor)
  int64_t probs_stride;
  const float* logits;  // [M, V] greedy argmax source, or nullptr (argmax of probs)
  int64_t logits_stride;
  const float* draft_probs;  // [sum k, V] q, or nullptr (q = one-hot at the draft)
  int64_t dp_stride;
  const int64_t* draft_ids;   // [sum k]
  const int64_t* num_drafts;  // [R]
  const bool* is_greedy;      // [R]
  const float* uniforms;  // [sum k] U[0,1) per draft, or nullptr (Philox)
  const float* noise;     // [R, V] Exp(1), or nullptr (Philox)
  int64_t noise_stride;
  const int64_t* seeds;    // [R]
  const int64_t* offsets;  // [R]
  void* partials;          // rejection_workspace_bytes(M, V) of scratch: each tile's partial result
  int64_t* out_tokens;     // [M]: row r's emitted tokens from its first row on, -1 elsewhere
  int64_t* out_accepted;   // [R]
  int R, V;
};
int64_t rejection_workspace_bytes(int64_t M, int V);
void launch_rejection(const RejectionParams& p, cudaStream_t stream);

}  // namespace hs
