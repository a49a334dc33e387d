// GGUF weights kept in their quantized blocks on the CPU: unpacking to float32 and a matrix
// product with int8 activations. Called through ctypes (gguf_kernels.py); OpenMP threads come
// from libgomp.so.1, the pool torch has already loaded (see cpu_kernels.c).
//
// Every supported type is first unpacked, block by block, into one common form: an integer
// q per weight and, per sub-block of 16 weights, a float scale s and an offset mn, so that
//   weight = s * q + mn          (mn = 0 for the types without a minimum).
// The scales are computed with the same float32 operations, in the same order, as gguf's
// numpy dequantization, and the library is built with -ffp-contract=off, so the float32
// unpacking is bit-exact against it.
//
// The int8 product quantizes each row of activations per 32 values to int8 (scale
// max|x| / 127, as llama.cpp's Q8 activations), and takes integer dot products of 4 values
// at a time (vpdpbusd: unsigned 8-bit by signed 8-bit into 32-bit lanes) against the
// weights made unsigned (u = q + off). Each 32-bit lane then gets its float scales:
//   sum_lane  s * dx * dot4(u, xq)  +  (mn - s * off) * dx * sum4(xq)
// which is the product with the dequantized int8 activations. Weight rows are unpacked 8
// at a time into that lane form once, then reused for every activation row, so a batch
// pays for the unpacking once.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512VNNI__
#include <immintrin.h>
#endif

enum {
  T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
  T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
};

static inline float f16(const uint8_t *p) {
  _Float16 h;
  memcpy(&h, p, 2);
  return (float)h;
}

// Weights per block, bytes per block, the offset that makes q non-negative, whether the
// type has a minimum. Returns 0 for an unsupported type.
static int type_info(int type, int *block, int *bytes, int *off, int *has_min) {
  static const int table[][5] = {
      {T_Q4_0, 32, 18, 8, 0},    {T_Q4_1, 32, 20, 0, 1},   {T_Q5_0, 32, 22, 16, 0},
      {T_Q5_1, 32, 24, 0, 1},    {T_Q8_0, 32, 34, 128, 0}, {T_Q2_K, 256, 84, 0, 1},
      {T_Q3_K, 256, 110, 4, 0},  {T_Q4_K, 256, 144, 0, 1}, {T_Q5_K, 256, 176, 0, 1},
      {T_Q6_K, 256, 210, 32, 0},
  };
  for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); ++i) {
    if (table[i][0] == type) {
      *block = table[i][1], *bytes = table[i][2], *off = table[i][3], *has_min = table[i][4];
      return 1;
    }
  }
  return 0;
}

int gguf_type_supported(int type) {
  int a, b, c, d;
  return type_info(type, &a, &b, &c, &d);
}

// One block -> q[block], s[block / 16], mn[block / 16]. Layouts follow gguf.quants.
static void unpack_block(int type, const uint8_t *b, int8_t *q, float *s, float *mn) {
  switch (type) {
    case T_Q4_0:
    case T_Q4_1: {
      const int hdr = type == T_Q4_0 ? 2 : 4;
      const float d = f16(b), m = type == T_Q4_1 ? f16(b + 2) : 0.f;
      uint8_t packed[16];
      memcpy(packed, b + hdr, 16);
      const int8_t shift = type == T_Q4_0 ? 8 : 0;
      for (int j = 0; j < 16; ++j) {
        q[j] = (int8_t)(packed[j] & 0xF) - shift;
        q[j + 16] = (int8_t)(packed[j] >> 4) - shift;
      }
      s[0] = s[1] = d;
      mn[0] = mn[1] = m;
      return;
    }
    case T_Q5_0:
    case T_Q5_1: {
      const int hdr = type == T_Q5_0 ? 2 : 4;
      const float d = f16(b), m = type == T_Q5_1 ? f16(b + 2) : 0.f;
      uint32_t qh;
      memcpy(&qh, b + hdr, 4);
      const uint8_t *qs = b + hdr + 4;
      for (int j = 0; j < 32; ++j) {
        const int lo = j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
        q[j] = lo | (((qh >> j) & 1) << 4);
        if (type == T_Q5_0) q[j] -= 16;
      }
      s[0] = s[1] = d;
      mn[0] = mn[1] = m;
      return;
    }
    case T_Q8_0: {
      const float d = f16(b);
      memcpy(q, b + 2, 32);
      s[0] = s[1] = d;
      mn[0] = mn[1] = 0.f;
      return;
    }
    case T_Q2_K: {
      const uint8_t *scales = b, *qs = b + 16;
      const float d = f16(b + 80), dmin = f16(b + 82);
      for (int g = 0; g < 2; ++g)
        for (int k = 0; k < 4; ++k)
          for (int l = 0; l < 32; ++l) q[g * 128 + k * 32 + l] = (qs[g * 32 + l] >> (2 * k)) & 3;
      for (int i = 0; i < 16; ++i) {
        s[i] = d * (float)(scales[i] & 0xF);
        mn[i] = -(dmin * (float)(scales[i] >> 4));
      }
      return;
    }
    case T_Q3_K: {
      const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
      const float d = f16(b + 108);
      for (int g = 0; g < 2; ++g)
        for (int k = 0; k < 4; ++k)
          for (int l = 0; l < 32; ++l) q[g * 128 + k * 32 + l] = (qs[g * 32 + l] >> (2 * k)) & 3;
      for (int k = 0; k < 8; ++k)
        for (int l = 0; l < 32; ++l)
          if (!((hmask[l] >> k) & 1)) q[k * 32 + l] -= 4;
      for (int i = 0; i < 16; ++i) {
        const int lo = (i < 8 ? sc[i] : sc[i - 8] >> 4) & 0xF;
        const int hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        s[i] = d * (float)((lo | (hi << 4)) - 32);
        mn[i] = 0.f;
      }
      return;
    }
    case T_Q4_K:
    case T_Q5_K: {
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t *sc = b + 4;
      const uint8_t *qh = b + 16, *qs = b + (type == T_Q4_K ? 16 : 48);
      for (int g = 0; g < 4; ++g)
        for (int k = 0; k < 2; ++k)
          for (int l = 0; l < 32; ++l) q[g * 64 + k * 32 + l] = (qs[g * 32 + l] >> (4 * k)) & 0xF;
      if (type == T_Q5_K)
        for (int k = 0; k < 8; ++k)
          for (int l = 0; l < 32; ++l) q[k * 32 + l] |= ((qh[l] >> k) & 1) << 4;
      for (int i = 0; i < 8; ++i) {
        int scale, min;
        if (i < 4) {
          scale = sc[i] & 0x3F;
          min = sc[4 + i] & 0x3F;
        } else {
          scale = (sc[4 + i] & 0xF) | ((sc[i - 4] >> 2) & 0x30);
          min = (sc[4 + i] >> 4) | ((sc[i] >> 2) & 0x30);
        }
        s[2 * i] = s[2 * i + 1] = d * (float)scale;
        mn[2 * i] = mn[2 * i + 1] = -(dmin * (float)min);
      }
      return;
    }
    case T_Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t *sc = (const int8_t *)(b + 192);
      const float d = f16(b + 208);
      for (int g = 0; g < 2; ++g) {
        for (int k = 0; k < 2; ++k)
          for (int l = 0; l < 64; ++l) q[g * 128 + k * 64 + l] = (ql[g * 64 + l] >> (4 * k)) & 0xF;
        for (int k = 0; k < 4; ++k)
          for (int l = 0; l < 32; ++l)
            q[g * 128 + k * 32 + l] |= ((qh[g * 32 + l] >> (2 * k)) & 3) << 4;
      }
      for (int j = 0; j < 256; ++j) q[j] -= 32;
      for (int i = 0; i < 16; ++i) {
        s[i] = d * (float)sc[i];
        mn[i] = 0.f;
      }
      return;
    }
  }
}

// Rows of a quantized matrix to float32: out[r] = dequantized row rows[r] (or row r when
// rows is NULL). k weights per row. Returns 0 for an unsupported type.
int gguf_dequantize_rows(int type, const uint8_t *data, const int64_t *rows, int64_t n_rows,
                         int64_t k, float *out) {
  int block, bytes, off, has_min;
  if (!type_info(type, &block, &bytes, &off, &has_min)) return 0;
  const int64_t row_bytes = k / block * bytes;
#pragma omp parallel for schedule(static) if (n_rows * k > 65536)
  for (int64_t r = 0; r < n_rows; ++r) {
    int8_t q[256];
    float s[16], mn[16];
    const uint8_t *src = data + (rows ? rows[r] : r) * row_bytes;
    float *dst = out + r * k;
    for (int64_t blk = 0; blk < k / block; ++blk) {
      unpack_block(type, src + blk * bytes, q, s, mn);
      for (int j = 0; j < block; ++j) {
        const float w = s[j / 16] * (float)q[j];  // two roundings, as numpy: no fma here
        dst[blk * block + j] = has_min ? w + mn[j / 16] : w;
      }
    }
  }
  return 1;
}

// ------------------------------------------------------------------ int8 activations

// x [m, k] float32 -> xq [m, k] int8 and dx [m, k / 32], each block's scale.
// k must be a multiple of 32.
static void quantize_activations(const float *x, int64_t m, int64_t k, int8_t *xq, float *dx) {
#pragma omp parallel for schedule(static) if (m * k > 65536)
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < k; b += 32) {
      const float *xb = x + i * k + b;
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(xb[j]));
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      int8_t *qb = xq + i * k + b;
      for (int j = 0; j < 32; ++j) qb[j] = (int8_t)nearbyintf(xb[j] * id);
      dx[(i * k + b) / 32] = d;
    }
  }
}

// One weight row unpacked: u [k] unsigned (q + off), and per sub-block of 16 weights sl (its
// scale) and ml (mn - s * off), k / 16 each.
static void unpack_row(int type, const uint8_t *src, int64_t k, uint8_t *u, float *sl,
                       float *ml) {
  int block, bytes, off, has_min;
  type_info(type, &block, &bytes, &off, &has_min);
  int8_t q[256];
  for (int64_t blk = 0; blk < k / block; ++blk) {
    float *s = sl + blk * block / 16, *mn = ml + blk * block / 16;
    unpack_block(type, src + blk * bytes, q, s, mn);
    uint8_t *ub = u + blk * block;
    for (int j = 0; j < block; ++j) ub[j] = (uint8_t)(q[j] + off);
    for (int i = 0; i < block / 16; ++i) mn[i] -= s[i] * (float)off;
  }
}

#define ROWS 8  // weight rows unpacked together; each activation load serves all of them

// Dot products of one activation row with the ROWS unpacked weight rows.
// sle / mle: the same scales spread over the 4-value lanes (k / 4 per row), or NULL.
static inline void dot_rows(const uint8_t *u, const float *sl, const float *ml,
                            const float *sle, const float *mle, int64_t k, const int8_t *xq,
                            const float *dx, float *out) {
  const int64_t lanes = k / 4, subs = k / 16;
  int64_t lane = 0;
#ifdef __AVX512VNNI__
  // Lane l of a 64-value chunk belongs to sub-block l / 4 and activation block l / 8.
  const __m512i spread4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i spread8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (; lane + 16 <= lanes; lane += 16) {
    const __m512i xv = _mm512_loadu_si512(xq + 4 * lane);
    const __m512 d2 = _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64(
        (const __m128i *)(dx + lane / 8))));
    const __m512 dxv = _mm512_permutexvar_ps(spread8, d2);
    // dx * (sum of the 4 int8 activations of the lane), for the offsets
    const __m512 xs = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, xv)), dxv);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i uv = _mm512_loadu_si512(u + r * k + 4 * lane);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), uv, xv);
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), dxv);
      __m512 sv, mv;
      if (sle != NULL) {  // scales already spread over the lanes (batches)
        sv = _mm512_loadu_ps(sle + r * lanes + lane);
        mv = _mm512_loadu_ps(mle + r * lanes + lane);
      } else {
        sv = _mm512_permutexvar_ps(
            spread4, _mm512_castps128_ps512(_mm_loadu_ps(sl + r * subs + lane / 4)));
        mv = _mm512_permutexvar_ps(
            spread4, _mm512_castps128_ps512(_mm_loadu_ps(ml + r * subs + lane / 4)));
      }
      acc[r] = _mm512_fmadd_ps(scaled, sv, acc[r]);
      acc[r] = _mm512_fmadd_ps(mv, xs, acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
#else
  for (int r = 0; r < ROWS; ++r) out[r] = 0.f;
#endif
  for (; lane < lanes; ++lane) {  // portable path, and the tail of the vector one
    const int8_t *xl = xq + 4 * lane;
    const float d = dx[lane / 8], xs = d * (float)(xl[0] + xl[1] + xl[2] + xl[3]);
    for (int r = 0; r < ROWS; ++r) {
      const uint8_t *ul = u + r * k + 4 * lane;
      const int dot = ul[0] * xl[0] + ul[1] * xl[1] + ul[2] * xl[2] + ul[3] * xl[3];
      const int64_t sub = r * subs + lane / 4;
      out[r] += (float)dot * d * sl[sub] + ml[sub] * xs;
    }
  }
}

// y [m, n] = x [m, k] @ W^T with W [n, k] in GGUF blocks, the activations quantized to int8.
// k must be a multiple of 32 and of the type's block. Returns 0 on an unsupported type.
int gguf_matmul_q8(int type, const uint8_t *weight, int64_t n, int64_t k, const float *x,
                   int64_t m, float *y) {
  int block, bytes, off, has_min;
  if (!type_info(type, &block, &bytes, &off, &has_min) || k % 32 || k % block) return 0;
  const int64_t row_bytes = k / block * bytes;
  int8_t *xq = aligned_alloc(64, (size_t)((m * k + 63) / 64 * 64));
  float *dx = malloc(sizeof(float) * (size_t)(m * k / 32));
  quantize_activations(x, m, k, xq, dx);
  const int64_t tiles = (n + ROWS - 1) / ROWS;
#pragma omp parallel
  {
    uint8_t *u = aligned_alloc(64, (size_t)(ROWS * k));
    float *sl = malloc(sizeof(float) * (size_t)(ROWS * k / 16));
    float *ml = malloc(sizeof(float) * (size_t)(ROWS * k / 16));
    // A batch reuses the tile for every row: spreading its scales once saves two shuffles
    // per vector for each of them.
    float *sle = m >= 4 ? malloc(sizeof(float) * (size_t)(ROWS * k / 4)) : NULL;
    float *mle = m >= 4 ? malloc(sizeof(float) * (size_t)(ROWS * k / 4)) : NULL;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n0 = t * ROWS;
      const int valid = n - n0 < ROWS ? (int)(n - n0) : ROWS;
      for (int r = 0; r < ROWS; ++r) {  // a partial tile repeats its last row
        const int64_t row = n0 + (r < valid ? r : valid - 1);
        unpack_row(type, weight + row * row_bytes, k, u + r * k, sl + r * k / 16,
                   ml + r * k / 16);
      }
      if (sle != NULL) {
        for (int64_t j = 0; j < ROWS * k / 4; ++j) {
          sle[j] = sl[j / 4];
          mle[j] = ml[j / 4];
        }
      }
      for (int64_t i = 0; i < m; ++i) {
        float out[ROWS];
        if (sle != NULL) {
          dot_rows(u, sl, ml, sle, mle, k, xq + i * k, dx + i * k / 32, out);
        } else {
          dot_rows(u, sl, ml, NULL, NULL, k, xq + i * k, dx + i * k / 32, out);
        }
        for (int r = 0; r < valid; ++r) y[i * n + n0 + r] = out[r];
      }
    }
    free(u);
    free(sl);
    free(ml);
    free(sle);
    free(mle);
  }
  free(xq);
  free(dx);
  return 1;
}
