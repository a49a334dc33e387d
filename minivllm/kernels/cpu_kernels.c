// Paged decode attention for the CPU, float32: each query token attends over its request's
// KV blocks read in place from the paged cache (no gathered copy). Called through ctypes;
// the batch is split over OpenMP threads. Built with -fopenmp, the library names
// libgomp.so.1, which resolves to the copy torch has already loaded: one thread pool, the
// one torch's GEMMs use, so its threads never spin against ours.
//
// Layouts (see cpu.py): a key block is stored transposed, [Hkv, D, block_size], so a
// block's scores are block_size-wide vector FMAs with no horizontal sums; a value block is
// [block_size, Hkv, D], so the weighted sum is D-wide vector FMAs.
//
// The common shapes (block_size 16, head_dim 64 or 128) have a path written with GCC/Clang
// vector types, whose accumulators stay in registers; other shapes take a plain loop.
//
// Sliding-window layers pass each sequence's first attended position (`starts`): blocks
// wholly before it are skipped, and the softmax and the weighted sum begin at it.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // any float address

static inline v16 load16(const float *p) { return *(const v16u *)p; }
static inline void store16(float *p, v16 x) { *(v16u *)p = x; }

// Softmax in place over the first len scores of a head.
static void softmax(float *s, int64_t len) {
  float m = s[0];
  for (int64_t t = 1; t < len; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    s[t] = expf(s[t] - m);  // vectorized by glibc's libmvec under -ffast-math
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

// Weighted sum of values token by token, all heads at once: each value row is read whole
// and in order (the H x D accumulators stay in L1). Reading it one KV head at a time
// instead was ~20% slower on block tables like the engine's.
#define PV_ROWS(D)                                                                          \
  for (int64_t i = 0; i < H * D; ++i) out[i] = 0.f;                                         \
  for (int64_t t = first; t < len; ++t) {                                                   \
    const float *vt = v_cache + table[t / 16] * block_stride + (t % 16) * Hkv * D;          \
    for (int64_t h = 0; h < H; ++h) {                                                       \
      const float p = scores[h * row + t];                                                  \
      const float *vh = vt + (h / group) * D;                                               \
      for (int64_t j = 0; j < D / 16; ++j)                                                  \
        store16(out + h * D + 16 * j, load16(out + h * D + 16 * j) + p * load16(vh + 16 * j)); \
    }                                                                                       \
  }

// One sequence, block_size 16 and head_dim D. q: [H, D], already scaled; scores: [H, row].
#define DECODE_SEQ_16(D)                                                                  \
  static void decode_seq_16_##D(const float *q, const float *k_cache, const float *v_cache, \
                                const int64_t *table, int64_t first, int64_t len,          \
                                int64_t H, int64_t Hkv, float *scores, int64_t row,         \
                                float *out) {                                               \
    const int64_t group = H / Hkv, block_stride = Hkv * D * 16;                            \
    const int64_t num_blocks = (len + 15) / 16;                                             \
    for (int64_t n = first / 16; n < num_blocks; ++n) {                                     \
      const float *kb = k_cache + table[n] * block_stride;                                  \
      const float *next = k_cache + table[n + 1 < num_blocks ? n + 1 : n] * block_stride;   \
      for (int64_t h = 0; h < H; ++h) {                                                     \
        const float *kt = kb + (h / group) * D * 16, *qh = q + h * D;                       \
        const float *kn = next + (h / group) * D * 16;                                      \
        v16 acc = {0};                                                                      \
        for (int64_t d = 0; d < D; ++d) {                                                   \
          __builtin_prefetch(kn + d * 16); /* the next block: a line per step */          \
          acc += qh[d] * load16(kt + d * 16);                                               \
        }                                                                                   \
        store16(scores + h * row + n * 16, acc);                                            \
      }                                                                                     \
    }                                                                                       \
    for (int64_t h = 0; h < H; ++h) softmax(scores + h * row + first, len - first);         \
    PV_ROWS(D)                                                                              \
  }
DECODE_SEQ_16(64)
DECODE_SEQ_16(128)

// Any block_size and head_dim.
static void decode_seq_any(const float *q, const float *k_cache, const float *v_cache,
                           const int64_t *table, int64_t first, int64_t len, int64_t H,
                           int64_t Hkv, int64_t D, int64_t bs, float *scores, int64_t row,
                           float *out) {
  const int64_t group = H / Hkv, block_stride = Hkv * D * bs;
  for (int64_t h = 0; h < H; ++h) {
    const float *qh = q + h * D;
    float *s = scores + h * row;
    for (int64_t t = first; t < len; ++t) {
      const float *kt = k_cache + table[t / bs] * block_stride + (h / group) * D * bs + t % bs;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * kt[d * bs];
      s[t] = dot;
    }
    softmax(s + first, len - first);
    float *oh = out + h * D;
    for (int64_t d = 0; d < D; ++d) oh[d] = 0.f;
    for (int64_t t = first; t < len; ++t) {
      const float *vh = v_cache + table[t / bs] * block_stride + (t % bs) * Hkv * D + (h / group) * D;
      for (int64_t d = 0; d < D; ++d) oh[d] += s[t] * vh[d];
    }
  }
}

void paged_decode_attention_f32(
    const float *q,             // [B rows of q_stride floats, H, D]
    int64_t q_stride,
    const float *k_cache,       // [num_blocks, Hkv, D, block_size]
    const float *v_cache,       // [num_blocks, block_size, Hkv, D]
    const int64_t *block_table, // [B, max_blocks]
    const int64_t *seq_lens,    // [B]
    const int64_t *starts,      // [B] first attended position, or NULL for 0
    float *out,                 // [B, H, D]
    int64_t batch, int64_t H, int64_t Hkv, int64_t D,
    int64_t block_size, int64_t max_blocks, float scale) {
  int64_t max_len = 1;
  for (int64_t b = 0; b < batch; ++b)
    if (seq_lens[b] > max_len) max_len = seq_lens[b];
  // A head's scores span whole blocks (the last one partly past the sequence's end).
  const int64_t row = (max_len + block_size - 1) / block_size * block_size;
  // Threads take whole sequences: one sequence is one thread's work, and a team would only
  // cost its fork and join (and a wait on a descheduled thread when the cores are busy).
#pragma omp parallel if (batch > 1)
  {
    float *scores = malloc(sizeof(float) * H * row);
    float *qs = malloc(sizeof(float) * H * D);
    // Sequences differ in length: hand them out a few at a time.
#pragma omp for schedule(dynamic, 4)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t *table = block_table + b * max_blocks;
      for (int64_t i = 0; i < H * D; ++i) qs[i] = q[b * q_stride + i] * scale;
      float *ob = out + b * H * D;
      const int64_t first = starts ? starts[b] : 0, len = seq_lens[b];
      if (block_size == 16 && D == 64)
        decode_seq_16_64(qs, k_cache, v_cache, table, first, len, H, Hkv, scores, row, ob);
      else if (block_size == 16 && D == 128)
        decode_seq_16_128(qs, k_cache, v_cache, table, first, len, H, Hkv, scores, row, ob);
      else
        decode_seq_any(qs, k_cache, v_cache, table, first, len, H, Hkv, D, block_size, scores,
                       row, ob);
    }
    free(scores);
    free(qs);
  }
}

// y[m, :] = x[m, :] W^T (+ bias) for a few rows of x (decode of one or a few sequences):
// each weight row streams from memory once and is dotted with every row of x. Rows of W
// are split over the OpenMP threads. oneDNN's GEMM reaches ~20 GB/s on these shapes here;
// this reaches ~29.
static inline float hsum16(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

void small_m_linear_f32(const float *x,    // [M, K]
                        const float *w,    // [N, K]
                        const float *bias, // [N] or NULL
                        float *y,          // [M, N]
                        int64_t M, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float *wn = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float *xm = x + m * K;
      v16 a0 = {0}, a1 = {0};
      int64_t k = 0;
      for (; k + 32 <= K; k += 32) {
        a0 += load16(xm + k) * load16(wn + k);
        a1 += load16(xm + k + 16) * load16(wn + k + 16);
      }
      float s = hsum16(a0 + a1);
      for (; k < K; ++k) s += xm[k] * wn[k];
      y[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
  }
}

// ---- A layer's elementwise work, one call each instead of several torch ops ----
// At one decoding sequence every torch op costs a few microseconds of dispatch, against
// nanoseconds of arithmetic: a Llama layer's norms, activation, RoPE and cache write were
// ~25 ops (~150 us a layer under the profiler), which these four calls replace. Rows are
// split over OpenMP threads only when there are enough of them to pay for the fork.

// RMSNorm of rows of n: out = w * (x / sqrt(mean(x^2) + eps)), the reference's order
// (normalize, then weight). With residual != NULL, residual += x first and the norm is of
// the sum, left in residual (vLLM's fused_add_rms_norm); x is only read.
void rms_norm_f32(const float *x, float *residual, const float *w, float *out, int64_t m,
                  int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (m >= 16)
  for (int64_t i = 0; i < m; ++i) {
    const float *src = x + i * n;
    if (residual) {
      float *r = residual + i * n;
      for (int64_t j = 0; j < n; ++j) r[j] += src[j];
      src = r;
    }
    float ss = 0.f;
    for (int64_t j = 0; j < n; ++j) ss += src[j] * src[j];
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    float *o = out + i * n;
    for (int64_t j = 0; j < n; ++j) o[j] = w[j] * (src[j] * inv);
  }
}

// out[i, j] = silu(x[i, j]) * x[i, d + j]: x holds [gate | up] side by side, [m, 2d].
void silu_and_mul_f32(const float *x, float *out, int64_t m, int64_t d) {
#pragma omp parallel for schedule(static) if (m >= 16)
  for (int64_t i = 0; i < m; ++i) {
    const float *g = x + i * 2 * d, *u = g + d;
    float *o = out + i * d;
    for (int64_t j = 0; j < d; ++j) o[j] = g[j] / (1.f + expf(-g[j])) * u[j];
  }
}

// RoPE in place, rotate-half layout, on the heads of q [m rows of q_stride, H heads of D]
// and k [m rows of k_stride, Hkv heads of D]; cos/sin: [positions, D] tables. No fused
// multiply-add, so each value is rounded as torch's x * cos + rotate_half(x) * sin rounds
// it: the result is bit for bit the torch path's.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static void rotate_heads(float *x, int64_t heads, int64_t D, const float *c, const float *s) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float *xh = x + h * D;
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = xh[j], x2 = xh[j + half];
      const float a = x1 * c[j], b = -x2 * s[j];
      const float e = x2 * c[j + half], f = x1 * s[j + half];
      xh[j] = a + b;
      xh[j + half] = e + f;
    }
  }
}
#pragma GCC pop_options

void rotary_embedding_f32(const int64_t *positions, float *q, int64_t q_stride, int64_t H,
                          float *k, int64_t k_stride, int64_t Hkv, const float *cos,
                          const float *sin, int64_t D, int64_t m) {
#pragma omp parallel for schedule(static) if (m >= 16)
  for (int64_t t = 0; t < m; ++t) {
    const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
    rotate_heads(q + t * q_stride, H, D, c, s);
    rotate_heads(k + t * k_stride, Hkv, D, c, s);
  }
}

// Each token's K and V ([m rows of k_stride / v_stride, Hkv heads of D]) stored at its flat
// slot (block * block_size + offset) of the layer's cache: the key transposed into
// [Hkv, D, block_size] blocks, the value as is into [block_size, Hkv, D] blocks. A negative
// slot (a padding token) is skipped.
void write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                  float *k_cache, float *v_cache, const int64_t *slots, int64_t m,
                  int64_t Hkv, int64_t D, int64_t block_size) {
#pragma omp parallel for schedule(static) if (m >= 64)
  for (int64_t t = 0; t < m; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / block_size, offset = slot % block_size;
    float *kb = k_cache + block * Hkv * D * block_size + offset;
    const float *kt = k + t * k_stride;
    for (int64_t i = 0; i < Hkv * D; ++i) kb[i * block_size] = kt[i];
    memcpy(v_cache + slot * Hkv * D, v + t * v_stride, sizeof(float) * Hkv * D);
  }
}
