// Paged decode attention for the CPU, float32: each query token attends over its request's
// KV blocks read in place from the paged cache (no gathered copy). Called through ctypes on
// a slice of the batch, so several Python threads can share one batch (ctypes drops the GIL).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void paged_decode_attention_f32(
    const float *q,             // [B, H, D]
    const float *k_cache,       // [num_blocks, block_size, Hkv, D]
    const float *v_cache,       // [num_blocks, block_size, Hkv, D]
    const int64_t *block_table, // [B, max_blocks]
    const int64_t *seq_lens,    // [B]
    float *out,                 // [B, H, D]
    int64_t b_start, int64_t b_end, int64_t H, int64_t Hkv, int64_t D,
    int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = H / Hkv;
  const int64_t token_stride = Hkv * D;
  int64_t max_len = 0;
  for (int64_t b = b_start; b < b_end; ++b)
    if (seq_lens[b] > max_len) max_len = seq_lens[b];
  float *scores = malloc(sizeof(float) * H * (max_len > 0 ? max_len : 1));
  float *acc = malloc(sizeof(float) * H * D);

  for (int64_t b = b_start; b < b_end; ++b) {
    const int64_t len = seq_lens[b];
    const float *qb = q + b * H * D;
    const int64_t *table = block_table + b * max_blocks;
    // Scores: one pass over the keys, all heads of a token at once (contiguous reads).
    for (int64_t t = 0; t < len; ++t) {
      const float *kt = k_cache + (table[t / block_size] * block_size + t % block_size) * token_stride;
      for (int64_t h = 0; h < H; ++h) {
        const float *qh = qb + h * D;
        const float *kh = kt + (h / group) * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
        scores[h * len + t] = dot * scale;
      }
    }
    // Softmax per head.
    for (int64_t h = 0; h < H; ++h) {
      float *s = scores + h * len;
      float m = -INFINITY;
      for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
      float sum = 0.f;
      for (int64_t t = 0; t < len; ++t) {
        s[t] = expf(s[t] - m);
        sum += s[t];
      }
      const float inv = 1.f / sum;
      for (int64_t t = 0; t < len; ++t) s[t] *= inv;
    }
    // Weighted sum of values: again one pass over the tokens.
    for (int64_t i = 0; i < H * D; ++i) acc[i] = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      const float *vt = v_cache + (table[t / block_size] * block_size + t % block_size) * token_stride;
      for (int64_t h = 0; h < H; ++h) {
        const float p = scores[h * len + t];
        const float *vh = vt + (h / group) * D;
        float *ah = acc + h * D;
        for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
      }
    }
    float *ob = out + b * H * D;
    for (int64_t i = 0; i < H * D; ++i) ob[i] = acc[i];
  }
  free(scores);
  free(acc);
}
