// Causal short convolutions with a per-request state (LFM2's gated short conv), float32.
//
// A request's conv state holds the last K - 1 inputs of its convolution, per channel:
// state[slot][c][j] is the input K - 1 - j positions before the next one. A chunk of a
// prompt starts from the state its previous chunk left and leaves its own last inputs
// there, so chunked prefill gives the same numbers as one pass. conv_kernels.py holds the
// torch reference these are tested against.
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_K 16

// A decode step (one token per request): channels [c0, c1) of one request's token, the
// channel the inner loop so that it runs in vectors (K a constant where it is called: the
// taps unrolled). gated: LFM2's form, v = B * x and y = C * conv(v) (x the row's third
// part); else conv(x) + bias, then SiLU where asked. The same arithmetic as
// conv_prompt_block's, in the same order.
static inline __attribute__((always_inline)) void conv_decode_row(
    const float *row, int64_t dim, const float *weight, const float *bias, float *st,
    float *out, int64_t c0, int64_t c1, const int64_t k, int gated, int64_t silu) {
  const int64_t w = k - 1;
#pragma omp simd
  for (int64_t c = c0; c < c1; ++c) {
    const float v = gated ? row[c] * row[2 * dim + c] : row[c];
    const float *wc = weight + c * k;
    float *s = st + c * w;
    float acc = (bias ? bias[c] : 0.0f) + wc[w] * v;
    for (int64_t j = 0; j < w; ++j) acc += wc[j] * s[j];
    for (int64_t j = 0; j + 1 < w; ++j) s[j] = s[j + 1];
    if (w > 0) s[w - 1] = v;
    if (gated) out[c] = row[dim + c] * acc;
    else out[c] = silu ? acc / (1.0f + expf(-acc)) : acc;
  }
}

// Prompts: rows [start, end) of one request on channels [c0, c0 + nc) (nc <= PROMPT_BLOCK),
// token by token with the channels in vectors: the block's taps transposed and its window
// (the last K - 1 inputs, from the state first) held channel-contiguous, then the window
// written back to the state.
#define PROMPT_BLOCK 256

static inline __attribute__((always_inline)) void conv_prompt_block(
    const float *x, int64_t row_stride, int64_t dim, const float *weight, const float *bias,
    float *st, float *out, int64_t start, int64_t end, int64_t c0, int64_t nc, const int64_t k,
    int gated, int64_t silu) {
  const int64_t w = k - 1;
  float taps[MAX_K][PROMPT_BLOCK], win[MAX_K][PROMPT_BLOCK], b[PROMPT_BLOCK];
  for (int64_t c = 0; c < nc; ++c) {
    for (int64_t j = 0; j < k; ++j) taps[j][c] = weight[(c0 + c) * k + j];
    for (int64_t j = 0; j < w; ++j) win[j][c] = st[(c0 + c) * w + j];
    b[c] = bias ? bias[c0 + c] : 0.0f;
  }
  for (int64_t t = start; t < end; ++t) {
    const float *row = x + t * row_stride + c0;
    float *o = out + t * dim + c0;
#pragma omp simd
    for (int64_t c = 0; c < nc; ++c) {
      const float v = gated ? row[c] * row[2 * dim + c] : row[c];
      float acc = b[c] + taps[w][c] * v;
      for (int64_t j = 0; j < w; ++j) acc += taps[j][c] * win[j][c];
      for (int64_t j = 0; j + 1 < w; ++j) win[j][c] = win[j + 1][c];
      if (w > 0) win[w - 1][c] = v;
      if (gated) o[c] = row[dim + c] * acc;
      else o[c] = silu ? acc / (1.0f + expf(-acc)) : acc;
    }
  }
  for (int64_t c = 0; c < nc; ++c)
    for (int64_t j = 0; j < w; ++j) st[(c0 + c) * w + j] = win[j][c];
}

// Every request's rows of a prompt step, in blocks of channels over the threads.
static void conv_prompt(const float *x, int64_t row_stride, const float *weight,
                        const float *bias, float *state, const int64_t *slots,
                        const int32_t *qsl, int64_t num_reqs, int64_t dim, int64_t k,
                        int gated, int64_t silu, float *out) {
  const int64_t blocks = (dim + PROMPT_BLOCK - 1) / PROMPT_BLOCK, w = k - 1;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < num_reqs * blocks; ++i) {
    const int64_t r = i / blocks, c0 = i % blocks * PROMPT_BLOCK;
    const int64_t nc = c0 + PROMPT_BLOCK < dim ? PROMPT_BLOCK : dim - c0;
    float *st = state + slots[r] * dim * w;
    const int64_t start = qsl[r], end = qsl[r + 1];
    if (end <= start) continue;
    switch (k) {
      case 3:
        conv_prompt_block(x, row_stride, dim, weight, bias, st, out, start, end, c0, nc, 3,
                          gated, silu);
        break;
      case 4:
        conv_prompt_block(x, row_stride, dim, weight, bias, st, out, start, end, c0, nc, 4,
                          gated, silu);
        break;
      default:
        conv_prompt_block(x, row_stride, dim, weight, bias, st, out, start, end, c0, nc, k,
                          gated, silu);
    }
  }
}

// Every request's token of a decode step, in blocks of channels over the threads.
static void conv_decode(const float *x, int64_t row_stride, const float *weight,
                        const float *bias, float *state, const int64_t *slots,
                        int64_t num_reqs, int64_t dim, int64_t k, int gated, int64_t silu,
                        float *out) {
  const int64_t block = 512, blocks = (dim + block - 1) / block, w = k - 1;
#pragma omp parallel for schedule(static) if (num_reqs * dim > 4096)
  for (int64_t i = 0; i < num_reqs * blocks; ++i) {
    const int64_t r = i / blocks, c0 = i % blocks * block;
    const int64_t c1 = c0 + block < dim ? c0 + block : dim;
    const float *row = x + r * row_stride;
    float *st = state + slots[r] * dim * w;
    float *o = out + r * dim;
    switch (k) {  // the usual tap counts unrolled (LFM2: 3, Qwen3.5 and Mamba-2: 4)
      case 2: conv_decode_row(row, dim, weight, bias, st, o, c0, c1, 2, gated, silu); break;
      case 3: conv_decode_row(row, dim, weight, bias, st, o, c0, c1, 3, gated, silu); break;
      case 4: conv_decode_row(row, dim, weight, bias, st, o, c0, c1, 4, gated, silu); break;
      default: conv_decode_row(row, dim, weight, bias, st, o, c0, c1, k, gated, silu);
    }
  }
}

// LFM2: bcx [T, 3D] (rows row_stride apart) holds B | C | x; the convolution runs over
// v = B * x, and y = C * conv(v). Request r's rows are [qsl[r], qsl[r + 1]) (qsl NULL: a
// decode step, request r is row r: conv_decode); its state is state + slots[r] * D * (K - 1).
// weight [D, K]; out [T, D].
void gated_short_conv_f32(const float *bcx, int64_t row_stride, const float *weight,
                          float *state, const int64_t *slots, const int32_t *qsl,
                          int64_t num_reqs, int64_t dim, int64_t k, float *out) {
  if (k < 1 || k > MAX_K) return;
  if (qsl)
    conv_prompt(bcx, row_stride, weight, NULL, state, slots, qsl, num_reqs, dim, k, 1, 0, out);
  else
    conv_decode(bcx, row_stride, weight, NULL, state, slots, num_reqs, dim, k, 1, 0, out);
}

// Mamba-2's: a causal conv over x [T, D] (rows row_stride apart) itself, plus a bias
// (may be NULL), then SiLU if silu; rows, slots and state as above. out [T, D].
void causal_conv1d_f32(const float *x, int64_t row_stride, const float *weight,
                       const float *bias, float *state, const int64_t *slots,
                       const int32_t *qsl, int64_t num_reqs, int64_t dim, int64_t k,
                       int64_t silu, float *out) {
  if (k < 1 || k > MAX_K) return;
  if (qsl)
    conv_prompt(x, row_stride, weight, bias, state, slots, qsl, num_reqs, dim, k, 0, silu, out);
  else
    conv_decode(x, row_stride, weight, bias, state, slots, num_reqs, dim, k, 0, silu, out);
}

#define PTR(T, slot) ((T)(intptr_t)(slot))

void causal_conv1d_f32_slots(const int64_t *a) {
  causal_conv1d_f32(PTR(const float *, a[0]), a[1], PTR(const float *, a[2]),
                    PTR(const float *, a[3]), PTR(float *, a[4]), PTR(const int64_t *, a[5]),
                    PTR(const int32_t *, a[6]), a[7], a[8], a[9], a[10], PTR(float *, a[11]));
}

// The twin a replayed decode step calls (see run_calls in cpu_kernels.c).
void gated_short_conv_f32_slots(const int64_t *a) {
  gated_short_conv_f32(PTR(const float *, a[0]), a[1], PTR(const float *, a[2]),
                       PTR(float *, a[3]), PTR(const int64_t *, a[4]),
                       PTR(const int32_t *, a[5]), a[6], a[7], a[8], PTR(float *, a[9]));
}
