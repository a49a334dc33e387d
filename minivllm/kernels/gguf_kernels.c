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
// The int8 product (gguf_packed_matmul) works on the weights repacked once after loading
// (gguf_pack, layout below): it quantizes each row of activations per 32 values to int8
// (scale max|x| / 127, as llama.cpp's Q8 activations) and takes integer dot products of 4
// values at a time (vpdpbusd: unsigned 8-bit weights by signed 8-bit activations into
// 32-bit lanes; AVX2: maddubs + madd; plain C otherwise), applying the float scales per block.
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

// ------------------------------------------------------------------ packed weights
// Every supported type is repacked once after loading into a layout made for integer dot
// products: Q4_0, Q4_1, Q4_K and Q8_0 at the same size as the file's blocks (Q4_K: +11%);
// the 2-, 3-, 5- and 6-bit types one byte per value (see "group 16" below). TILE = 16
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
//
// Group 16 (Q2_K, Q3_K, Q5_0, Q5_1, Q5_K, Q6_K): 8-bit values, and per block two scales and
// two minimums per row, s[2][16] then m[2][16], m = mn - off * s rounded to float16 (so not
// bit-exact), each for 16 values: chunks 0-3 and 4-7. These types take 1.25 bytes a weight
// (the file: 0.56-0.82) but run as fast as the others.
#define TILE 16

// bits per stored value, the offset added to q, whether m is stored, and the weights per
// scale (32, or 16 for the types whose sub-blocks are 16 weights, and the 5-bit ones).
static int pack_info(int type, int *bits, int *off, int *has_min, int *group) {
  int block, bytes, type_off, type_min;
  if (!type_info(type, &block, &bytes, &type_off, &type_min)) return 0;
  switch (type) {
    case T_Q4_0: *bits = 4, *off = 8, *has_min = 0, *group = 32; return 1;
    case T_Q4_1:
    case T_Q4_K: *bits = 4, *off = 0, *has_min = 1, *group = 32; return 1;
    case T_Q8_0: *bits = 8, *off = 128, *has_min = 0, *group = 32; return 1;
    default:  // 2, 3, 5, 6 bits: one byte per value, s and m' = mn - off * s per 16
      *bits = 8, *off = type_off, *has_min = 1, *group = 16; return 1;
  }
}

static int64_t packed_block_bytes(int bits, int has_min, int group) {
  return TILE * 32 * bits / 8 + TILE * 2 * (1 + has_min) * (32 / group);
}

// Bytes of the packed form of an [n, k] weight, or 0 when the type is not packed.
int64_t gguf_packed_size(int type, int64_t n, int64_t k) {
  int bits, off, has_min, group;
  if (!pack_info(type, &bits, &off, &has_min, &group) || k % 32) return 0;
  return (n + TILE - 1) / TILE * (k / 32) * packed_block_bytes(bits, has_min, group);
}

// raw [n, row bytes] GGUF blocks -> out [gguf_packed_size] (rows past n padded with zeros).
int gguf_pack(int type, const uint8_t *raw, int64_t n, int64_t k, uint8_t *out) {
  int block, bytes, off, has_min, bits, group, unused;
  if (!type_info(type, &block, &bytes, &unused, &unused)) return 0;
  if (!pack_info(type, &bits, &off, &has_min, &group) || k % block) return 0;
  const int64_t row_bytes = k / block * bytes, nb = k / 32;
  const int64_t bb = packed_block_bytes(bits, has_min, group), tiles = (n + TILE - 1) / TILE;
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
          uint8_t *sc = dst + TILE * 4 * bits;
          if (group == 16) {
            for (int h = 0; h < 2; ++h) {
              const float sh = s[2 * sub + h], mh = mn[2 * sub + h] - sh * (float)off;
              const _Float16 pair[2] = {(_Float16)sh, (_Float16)mh};
              memcpy(sc + 2 * (TILE * h + j), &pair[0], 2);
              memcpy(sc + 2 * (TILE * (2 + h) + j), &pair[1], 2);
            }
          } else {
            const _Float16 pair[2] = {(_Float16)s[2 * sub], (_Float16)mn[2 * sub]};
            memcpy(sc + 2 * j, &pair[0], 2);
            if (has_min) memcpy(sc + 2 * (TILE + j), &pair[1], 2);
          }
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
  int bits, off, has_min, group;
  if (!pack_info(type, &bits, &off, &has_min, &group) || k % 32) return 0;
  const int64_t nb = k / 32, bb = packed_block_bytes(bits, has_min, group);
#pragma omp parallel for schedule(static) if (n_rows * k > 65536)
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t row = rows ? rows[r] : r;
    const int j = (int)(row % TILE);
    const uint8_t *tile = packed + row / TILE * nb * bb;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t *blk = tile + b * bb, *sc = blk + TILE * 4 * bits;
      if (group == 16) {
        for (int v = 0; v < 32; ++v) {
          const int h = v / 16;
          const float s = f16(sc + 2 * (TILE * h + j)), m = f16(sc + 2 * (TILE * (2 + h) + j));
          out[r * k + b * 32 + v] = s * (float)packed_value(blk, bits, j, v) + m;
        }
        continue;
      }
      const float s = f16(sc + 2 * j);
      const float m = has_min ? f16(sc + 2 * (TILE + j)) : 0.f;
      for (int v = 0; v < 32; ++v) {
        const float w = s * (float)(packed_value(blk, bits, j, v) - off);
        out[r * k + b * 32 + v] = has_min ? w + m : w;
      }
    }
  }
  return 1;
}

// x [m, k] -> xq int8, dx (the scale of each block of 32) and e = emul * dx * sum(xq), per
// group of 16 or 32 values.
static void quantize_blocks(const float *x, int64_t m, int64_t k, float emul, int group,
                            int8_t *xq, float *dx, float *e) {
  const int64_t nb = k / 32;
#pragma omp parallel for schedule(static) if (m * k > 65536)
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float *xb = x + i * k + b * 32;
      int8_t *qb = xq + i * k + b * 32;
      int sum0 = 0, sum1 = 0;  // of the two halves
#ifdef __AVX512F__
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      // cvtps rounds to nearest even, as nearbyintf in the default rounding mode
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
      _mm_storeu_si128((__m128i *)qb, _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtepi32_epi8(qhi));
      sum0 = _mm512_reduce_add_epi32(qlo);
      sum1 = _mm512_reduce_add_epi32(qhi);
#else
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(xb[j]));
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      for (int j = 0; j < 32; ++j) {
        qb[j] = (int8_t)nearbyintf(xb[j] * id);
        *(j < 16 ? &sum0 : &sum1) += qb[j];
      }
#endif
      dx[i * nb + b] = d;
      if (group == 16) {
        e[i * 2 * nb + 2 * b] = emul * d * (float)sum0;
        e[i * 2 * nb + 2 * b + 1] = emul * d * (float)sum1;
      } else {
        e[i * nb + b] = emul * d * (float)(sum0 + sum1);
      }
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
KERNEL tile_kernel(const int bits, const int has_min, const int G, const int MR, KERNEL_ARGS) {
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
    } else {  // group 32: chunks alternate between the chains; group 16: one per half
      for (int c = 0; c < 4; ++c) {
        const int c0 = G == 16 ? c : 2 * c, c1 = G == 16 ? c + 4 : 2 * c + 1;
        const __m512i v0 = _mm512_loadu_si512(w + 64 * c0);
        const __m512i v1 = _mm512_loadu_si512(w + 64 * c1);
        for (int r = 0; r < MR; ++r) {
          a0[r] = _mm512_dpbusd_epi32(a0[r], v0, _mm512_set1_epi32(load_i32(xb + r * k + 4 * c0)));
          a1[r] = _mm512_dpbusd_epi32(a1[r], v1,
                                      _mm512_set1_epi32(load_i32(xb + r * k + 4 * c1)));
        }
      }
    }
    const uint8_t *sc = w + TILE * 4 * bits;
    if (G == 16) {
      const __m256i *sh = (const __m256i *)sc;
      const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256(sh)), s1 = _mm512_cvtph_ps(_mm256_loadu_si256(sh + 1));
      const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256(sh + 2)), m1 = _mm512_cvtph_ps(_mm256_loadu_si256(sh + 3));
      for (int r = 0; r < MR; ++r) {
        const __m512 dxv = _mm512_set1_ps(dx[r * (k / 32) + b]);
        const float *er = e + r * (k / 16) + 2 * b;
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a0[r]), dxv), s0, acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a1[r]), dxv), s1, acc[r]);
        acc[r] = _mm512_fmadd_ps(m0, _mm512_set1_ps(er[0]), acc[r]);
        acc[r] = _mm512_fmadd_ps(m1, _mm512_set1_ps(er[1]), acc[r]);
      }
      continue;
    }
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
KERNEL tile_kernel(const int bits, const int has_min, const int G, const int MR, KERNEL_ARGS) {
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
      } else if (G == 16) {  // u <= 63: pairs of products fit in int16; one sum per half
        __m256i a1[MR];
        for (int r = 0; r < MR; ++r) a1[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * c));
          for (int r = 0; r < MR; ++r) {
            const __m256i x0 = _mm256_set1_epi32(load_i32(xb + r * k + 4 * c));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(v, x0), ones);
            if (c < 4) a[r] = _mm256_add_epi32(a[r], p);
            else a1[r] = _mm256_add_epi32(a1[r], p);
          }
        }
        const uint8_t *sc = tile + b * bb + TILE * 4 * bits + 16 * h;
        const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
        const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32)));
        const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 64)));
        const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 96)));
        for (int r = 0; r < MR; ++r) {
          const __m256 dxv = _mm256_set1_ps(dx[r * (k / 32) + b]);
          const float *er = e + r * (k / 16) + 2 * b;
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a[r]), dxv), s0, acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a1[r]), dxv), s1, acc[r]);
          acc[r] = _mm256_fmadd_ps(m0, _mm256_set1_ps(er[0]), acc[r]);
          acc[r] = _mm256_fmadd_ps(m1, _mm256_set1_ps(er[1]), acc[r]);
        }
        continue;
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
KERNEL tile_kernel(const int bits, const int has_min, const int G, const int MR, KERNEL_ARGS) {
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < valid; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = tile + b * bb;
        const int8_t *xb = xq + r * k + b * 32;
        if (G == 16) {
          const uint8_t *sc = blk + TILE * 4 * bits;
          for (int h = 0; h < 2; ++h) {
            int32_t dot = 0;
            for (int v = 16 * h; v < 16 * h + 16; ++v) dot += packed_value(blk, bits, j, v) * xb[v];
            acc += (float)dot * dx[r * (k / 32) + b] * f16(sc + 2 * (TILE * h + j)) +
                   f16(sc + 2 * (TILE * (2 + h) + j)) * e[r * (k / 16) + 2 * b + h];
          }
          continue;
        }
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

#define TILE_FN(NAME, BITS, HAS_MIN, G, MR)                                           \
  static void NAME(KERNEL_ARGS) {                                                     \
    tile_kernel(BITS, HAS_MIN, G, MR, tile, nb, bb, xq, k, dx, e, y, ldy, valid);     \
  }
TILE_FN(tile_4_0_4, 4, 0, 32, 4)
TILE_FN(tile_4_0_1, 4, 0, 32, 1)
TILE_FN(tile_4_1_4, 4, 1, 32, 4)
TILE_FN(tile_4_1_1, 4, 1, 32, 1)
TILE_FN(tile_8_0_4, 8, 0, 32, 4)
TILE_FN(tile_8_0_1, 8, 0, 32, 1)
TILE_FN(tile_g16_4, 8, 1, 16, 4)
TILE_FN(tile_g16_1, 8, 1, 16, 1)

typedef void (*tile_fn)(KERNEL_ARGS);

// Which integer path the library was built with: "avx512-vnni", "avx2" or "portable".
const char *gguf_packed_path(void) { return PACKED_PATH; }

// y [m, n] = x [m, k] @ W^T with W packed (gguf_pack), the activations quantized to int8.
// Row i of y starts at y + i * ldy (a fused layer's segments write into one output).
int gguf_packed_matmul(int type, const uint8_t *packed, int64_t n, int64_t k, const float *x,
                       int64_t m, float *y, int64_t ldy) {
  int bits, off, has_min, group;
  if (!pack_info(type, &bits, &off, &has_min, &group) || k % 32) return 0;
  tile_fn wide = group == 16 ? tile_g16_4 : bits == 8 ? tile_8_0_4 : has_min ? tile_4_1_4 : tile_4_0_4;
  tile_fn one = group == 16 ? tile_g16_1 : bits == 8 ? tile_8_0_1 : has_min ? tile_4_1_1 : tile_4_0_1;
  const int64_t nb = k / 32, bb = packed_block_bytes(bits, has_min, group);
  const int64_t tiles = (n + TILE - 1) / TILE;
  const float emul = has_min ? 1.f : (bits == 8 && SIGNED_8BIT) ? 0.f : -(float)off;
  int8_t *xq = malloc((size_t)(m * k));
  float *dx = malloc(sizeof(float) * (size_t)(m * nb));
  float *e = malloc(sizeof(float) * (size_t)(m * k / group));
  quantize_blocks(x, m, k, emul, group, xq, dx, e);
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
        wide(tile, nb, bb, xq + i * k, k, dx + i * nb, e + i * (k / group), y + i * ldy + t * TILE,
             ldy, valid);
      for (; i < i1; ++i)
        one(tile, nb, bb, xq + i * k, k, dx + i * nb, e + i * (k / group), y + i * ldy + t * TILE,
            ldy, valid);
    }
  }
  free(xq);
  free(dx);
  free(e);
  return 1;
}
