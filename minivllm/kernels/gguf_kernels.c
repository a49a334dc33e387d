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
#if defined(__x86_64__) || defined(__i386__)
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

// ------------------------------------------------------------------ packed weights
// Q4_0, Q4_1, Q4_K and Q8_0 weights are repacked once after loading into a layout made for
// integer dot products, at the same size as the file's blocks (Q4_K: +11%): TILE = 16
// weight rows interleaved, in blocks of 32 weights along k. One packed block holds, for
// the 16 rows, their unsigned values u = q + off and a float16 scale s per row (and a
// float16 minimum m per row for the types that have one), so that
//   weight = s * (u - off)          or          weight = s * u + m.
// Values, in chunks of 64 bytes, each 4 consecutive values of each of the 16 rows:
//   4-bit: chunk c (0..3), row j, p (0..3): byte c*64 + 4j + p holds value 8c + p in its low
//          nibble and value 8c + 4 + p in its high nibble;
//   8-bit: chunk c (0..7), row j, p (0..3): byte c*64 + 4j + p is value 4c + p;
// then s[16] and (with a minimum) m[16]. A 32-bit lane of a 64-byte vector is thus one
// row's 4 values: a single vpdpbusd against 4 activation values broadcast to every lane
// gives 16 rows' partial dot products, and the float scales of the 16 rows sit in one
// vector. Scales are rounded to float16 (exact for Q4_0, Q4_1, Q8_0, whose files store
// them so; Q4_K's products of a scale and a 6-bit factor round at 2^-11).
//
// With activations quantized per 32 values (scale dx, sum of the int8 values sx):
//   sum_b s * dx * dot(u, xq) + m * dx * sx          (with a minimum)
//   sum_b s * (dx * dot(u, xq) - off * dx * sx)      (without)
// The second factor of each (e = dx * sx, or -off * dx * sx) is computed once per
// activation block.
#define TILE 16

static int pack_info(int type, int *bits, int *off, int *has_min) {
  switch (type) {
    case T_Q4_0: *bits = 4, *off = 8, *has_min = 0; return 1;
    case T_Q4_1: *bits = 4, *off = 0, *has_min = 1; return 1;
    case T_Q4_K: *bits = 4, *off = 0, *has_min = 1; return 1;
    case T_Q8_0: *bits = 8, *off = 128, *has_min = 0; return 1;
  }
  return 0;
}

static int64_t packed_block_bytes(int bits, int has_min) {
  return TILE * 32 * bits / 8 + TILE * 2 * (1 + has_min);
}

// Bytes of the packed form of an [n, k] weight, or 0 when the type is not packed.
int64_t gguf_packed_size(int type, int64_t n, int64_t k) {
  int bits, off, has_min;
  if (!pack_info(type, &bits, &off, &has_min) || k % 32) return 0;
  return (n + TILE - 1) / TILE * (k / 32) * packed_block_bytes(bits, has_min);
}

// raw [n, row bytes] GGUF blocks -> out [gguf_packed_size] (rows past n padded with zeros).
int gguf_pack(int type, const uint8_t *raw, int64_t n, int64_t k, uint8_t *out) {
  int block, bytes, off, has_min, bits, unused;
  if (!type_info(type, &block, &bytes, &unused, &unused)) return 0;
  if (!pack_info(type, &bits, &off, &has_min) || k % block) return 0;
  const int64_t row_bytes = k / block * bytes, nb = k / 32;
  const int64_t bb = packed_block_bytes(bits, has_min), tiles = (n + TILE - 1) / TILE;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    int8_t q[256];
    float s[16], mn[16];
    uint8_t *tile = out + t * nb * bb;
    memset(tile, 0, (size_t)(nb * bb));
    for (int j = 0; j < TILE && t * TILE + j < n; ++j) {
      const uint8_t *src = raw + (t * TILE + j) * row_bytes;
      for (int64_t blk = 0; blk < k / block; ++blk) {
        unpack_block(type, src + blk * bytes, q, s, mn);
        for (int sub = 0; sub < block / 32; ++sub) {
          uint8_t *dst = tile + (blk * block / 32 + sub) * bb;
          uint8_t u[32];
          for (int v = 0; v < 32; ++v) u[v] = (uint8_t)(q[sub * 32 + v] + off);
          if (bits == 4) {
            for (int c = 0; c < 4; ++c)
              for (int p = 0; p < 4; ++p)
                dst[c * 64 + 4 * j + p] = (uint8_t)(u[8 * c + p] | (u[8 * c + 4 + p] << 4));
          } else {
            for (int c = 0; c < 8; ++c)
              for (int p = 0; p < 4; ++p) dst[c * 64 + 4 * j + p] = u[4 * c + p];
          }
          _Float16 sc[2] = {(_Float16)s[2 * sub], (_Float16)mn[2 * sub]};
          memcpy(dst + TILE * 4 * bits + 2 * j, &sc[0], 2);
          if (has_min) memcpy(dst + TILE * 4 * bits + 2 * (TILE + j), &sc[1], 2);
        }
      }
    }
  }
  return 1;
}

static inline int packed_value(const uint8_t *blk, int bits, int j, int v) {
  if (bits == 8) return blk[(v / 4) * 64 + 4 * j + v % 4];
  const uint8_t byte = blk[(v / 8) * 64 + 4 * j + v % 4];
  return v % 8 < 4 ? byte & 0xF : byte >> 4;
}

// Rows of a packed [n, k] weight to float32, as gguf_dequantize_rows.
int gguf_packed_dequantize_rows(int type, const uint8_t *packed, const int64_t *rows,
                                int64_t n_rows, int64_t k, float *out) {
  int bits, off, has_min;
  if (!pack_info(type, &bits, &off, &has_min) || k % 32) return 0;
  const int64_t nb = k / 32, bb = packed_block_bytes(bits, has_min);
#pragma omp parallel for schedule(static) if (n_rows * k > 65536)
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t row = rows ? rows[r] : r;
    const int j = (int)(row % TILE);
    const uint8_t *tile = packed + row / TILE * nb * bb;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t *blk = tile + b * bb;
      const float s = f16(blk + TILE * 4 * bits + 2 * j);
      const float m = has_min ? f16(blk + TILE * 4 * bits + 2 * (TILE + j)) : 0.f;
      for (int v = 0; v < 32; ++v) {
        const float w = s * (float)(packed_value(blk, bits, j, v) - off);
        out[r * k + b * 32 + v] = has_min ? w + m : w;
      }
    }
  }
  return 1;
}

// x [m, k] -> xq int8, dx (the scale of each block of 32) and e = emul * dx * sum(xq).
static void quantize_blocks(const float *x, int64_t m, int64_t k, float emul, int8_t *xq,
                            float *dx, float *e) {
  const int64_t nb = k / 32;
#pragma omp parallel for schedule(static) if (m * k > 65536)
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float *xb = x + i * k + b * 32;
      int8_t *qb = xq + i * k + b * 32;
      int sum = 0;
#ifdef __AVX512F__
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      // cvtps rounds to nearest even, as nearbyintf in the default rounding mode
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
      _mm_storeu_si128((__m128i *)qb, _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtepi32_epi8(qhi));
      sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(xb[j]));
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      for (int j = 0; j < 32; ++j) {
        qb[j] = (int8_t)nearbyintf(xb[j] * id);
        sum += qb[j];
      }
#endif
      dx[i * nb + b] = d;
      e[i * nb + b] = emul * d * (float)sum;
    }
  }
}

static inline int32_t load_i32(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

#define KERNEL static inline __attribute__((always_inline)) void
#define KERNEL_ARGS                                                                          \
  const uint8_t *tile, int64_t nb, int64_t bb, const int8_t *xq, int64_t k, const float *dx, \
      const float *e, float *y, int64_t ldy, int valid

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PACKED_PATH "avx512-vnni"
#define SIGNED_8BIT 0  // 8-bit values are used unsigned: off stays in the sum
// MR activation rows against one tile of 16 weight rows: y[r][0..valid).
KERNEL tile_kernel(const int bits, const int has_min, const int MR, KERNEL_ARGS) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *w = tile + b * bb;
    const int8_t *xb = xq + b * 32;
    __m512i a0[MR], a1[MR];  // two chains of dot products, summed at the end of the block
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
    if (bits == 4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(w + 64 * c);
        const __m512i lo = _mm512_and_si512(v, m4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        for (int r = 0; r < MR; ++r) {
          a0[r] = _mm512_dpbusd_epi32(a0[r], lo, _mm512_set1_epi32(load_i32(xb + r * k + 8 * c)));
          a1[r] = _mm512_dpbusd_epi32(a1[r], hi,
                                      _mm512_set1_epi32(load_i32(xb + r * k + 8 * c + 4)));
        }
      }
    } else {
      for (int c = 0; c < 8; c += 2) {
        const __m512i v0 = _mm512_loadu_si512(w + 64 * c);
        const __m512i v1 = _mm512_loadu_si512(w + 64 * c + 64);
        for (int r = 0; r < MR; ++r) {
          a0[r] = _mm512_dpbusd_epi32(a0[r], v0, _mm512_set1_epi32(load_i32(xb + r * k + 4 * c)));
          a1[r] = _mm512_dpbusd_epi32(a1[r], v1,
                                      _mm512_set1_epi32(load_i32(xb + r * k + 4 * c + 4)));
        }
      }
    }
    const uint8_t *sc = w + TILE * 4 * bits;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
    const __m512 mv = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)))
                              : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a0[r], a1[r]));
      const __m512 dxv = _mm512_set1_ps(dx[r * (k / 32) + b]);
      const __m512 ev = _mm512_set1_ps(e[r * (k / 32) + b]);
      if (has_min) {
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, dxv), s, acc[r]);
        acc[r] = _mm512_fmadd_ps(mv, ev, acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(dot, dxv, ev), s, acc[r]);
      }
    }
  }
  const __mmask16 mask = (__mmask16)((1u << valid) - 1);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PACKED_PATH "avx2"
#define SIGNED_8BIT 1  // 8-bit values are made signed again (maddubs would saturate): off = 0
// As the AVX-512 kernel, one half tile (8 rows) per 256-bit vector; maddubs (u8 x s8 pairs
// to int16) and madd (pairs to int32) in place of vpdpbusd.
KERNEL tile_kernel(const int bits, const int has_min, const int MR, KERNEL_ARGS) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i bias = _mm256_set1_epi8((char)0x80);
  float out[MR][TILE];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t *w = tile + b * bb + 32 * h;
      const int8_t *xb = xq + b * 32;
      __m256i a[MR];
      for (int r = 0; r < MR; ++r) a[r] = _mm256_setzero_si256();
      if (bits == 4) {  // 8 products of at most 2 * 15 * 127 fit in int16
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * c));
          const __m256i lo = _mm256_and_si256(v, m4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
          for (int r = 0; r < MR; ++r) {
            const __m256i x0 = _mm256_set1_epi32(load_i32(xb + r * k + 8 * c));
            const __m256i x1 = _mm256_set1_epi32(load_i32(xb + r * k + 8 * c + 4));
            a[r] = _mm256_add_epi16(a[r], _mm256_maddubs_epi16(lo, x0));
            a[r] = _mm256_add_epi16(a[r], _mm256_maddubs_epi16(hi, x1));
          }
        }
        for (int r = 0; r < MR; ++r) a[r] = _mm256_madd_epi16(a[r], ones);
      } else {  // q = u - 128 signed; |q| * sign(x, q) keeps each pair within int16
        for (int c = 0; c < 8; ++c) {
          const __m256i q = _mm256_xor_si256(
              _mm256_loadu_si256((const __m256i *)(w + 64 * c)), bias);
          const __m256i aq = _mm256_abs_epi8(q);
          for (int r = 0; r < MR; ++r) {
            const __m256i xs =
                _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xb + r * k + 4 * c)), q);
            a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, xs), ones));
          }
        }
      }
      const uint8_t *sc = tile + b * bb + TILE * 4 * bits;
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 16 * h)));
      const __m256 mv = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32 + 16 * h)))
                                : _mm256_setzero_ps();
      for (int r = 0; r < MR; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(a[r]);
        const __m256 dxv = _mm256_set1_ps(dx[r * (k / 32) + b]);
        const __m256 ev = _mm256_set1_ps(e[r * (k / 32) + b]);
        if (has_min) {
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dot, dxv), s, acc[r]);
          acc[r] = _mm256_fmadd_ps(mv, ev, acc[r]);
        } else {
          acc[r] = _mm256_fmadd_ps(_mm256_fmadd_ps(dot, dxv, ev), s, acc[r]);
        }
      }
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
  }
  for (int r = 0; r < MR; ++r) memcpy(y + r * ldy, out[r], sizeof(float) * (size_t)valid);
}
#else
#define PACKED_PATH "portable"
#define SIGNED_8BIT 0
KERNEL tile_kernel(const int bits, const int has_min, const int MR, KERNEL_ARGS) {
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < valid; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = tile + b * bb;
        const int8_t *xb = xq + r * k + b * 32;
        int32_t dot = 0;
        for (int v = 0; v < 32; ++v) dot += packed_value(blk, bits, j, v) * xb[v];
        const float s = f16(blk + TILE * 4 * bits + 2 * j);
        const float d = dx[r * (k / 32) + b], ev = e[r * (k / 32) + b];
        if (has_min) {
          acc += (float)dot * d * s + f16(blk + TILE * 4 * bits + 2 * (TILE + j)) * ev;
        } else {
          acc += ((float)dot * d + ev) * s;
        }
      }
      y[r * ldy + j] = acc;
    }
  }
}
#endif

#define TILE_FN(NAME, BITS, HAS_MIN, MR) \
  static void NAME(KERNEL_ARGS) { tile_kernel(BITS, HAS_MIN, MR, tile, nb, bb, xq, k, dx, e, y, ldy, valid); }
TILE_FN(tile_4_0_4, 4, 0, 4)
TILE_FN(tile_4_0_1, 4, 0, 1)
TILE_FN(tile_4_1_4, 4, 1, 4)
TILE_FN(tile_4_1_1, 4, 1, 1)
TILE_FN(tile_8_0_4, 8, 0, 4)
TILE_FN(tile_8_0_1, 8, 0, 1)

typedef void (*tile_fn)(KERNEL_ARGS);

// Which integer path the library was built with: "avx512-vnni", "avx2" or "portable".
const char *gguf_packed_path(void) { return PACKED_PATH; }

// y [m, n] = x [m, k] @ W^T with W packed (gguf_pack), the activations quantized to int8.
int gguf_packed_matmul(int type, const uint8_t *packed, int64_t n, int64_t k, const float *x,
                       int64_t m, float *y) {
  int bits, off, has_min;
  if (!pack_info(type, &bits, &off, &has_min) || k % 32) return 0;
  tile_fn wide = bits == 8 ? tile_8_0_4 : has_min ? tile_4_1_4 : tile_4_0_4;
  tile_fn one = bits == 8 ? tile_8_0_1 : has_min ? tile_4_1_1 : tile_4_0_1;
  const int64_t nb = k / 32, bb = packed_block_bytes(bits, has_min);
  const int64_t tiles = (n + TILE - 1) / TILE;
  const float emul = has_min ? 1.f : (bits == 8 && SIGNED_8BIT) ? 0.f : -(float)off;
  int8_t *xq = malloc((size_t)(m * k));
  float *dx = malloc(sizeof(float) * (size_t)(m * nb));
  float *e = malloc(sizeof(float) * (size_t)(m * nb));
  quantize_blocks(x, m, k, emul, xq, dx, e);
  // Activation rows in passes whose int8 copy stays in L2 while the weight tiles go by;
  // within a pass each tile serves 4 rows per load of its values.
  int64_t pass = (1 << 19) / k / 4 * 4;
  if (pass < 4) pass = 4;
  for (int64_t i0 = 0; i0 < m; i0 += pass) {
    const int64_t i1 = i0 + pass < m ? i0 + pass : m;
#pragma omp parallel for schedule(static) if ((i1 - i0) * n * k > 32768)
    for (int64_t t = 0; t < tiles; ++t) {
      const int valid = n - t * TILE < TILE ? (int)(n - t * TILE) : TILE;
      const uint8_t *tile = packed + t * nb * bb;
      int64_t i = i0;
      for (; i + 4 <= i1; i += 4)
        wide(tile, nb, bb, xq + i * k, k, dx + i * nb, e + i * nb, y + i * n + t * TILE, n, valid);
      for (; i < i1; ++i)
        one(tile, nb, bb, xq + i * k, k, dx + i * nb, e + i * nb, y + i * n + t * TILE, n, valid);
    }
  }
  free(xq);
  free(dx);
  free(e);
  return 1;
}
