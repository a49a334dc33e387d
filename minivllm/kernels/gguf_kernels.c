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
  T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ4_NL = 20, T_IQ3_S = 21,
  T_IQ2_S = 22, T_IQ4_XS = 23, T_IQ1_M = 29, T_MXFP4 = 39,
};

// The "non-linear" types' weights, as integers q: each takes a few values only, so the
// packed layout (below) keeps a small index per weight into its family's levels. IQ4_NL and
// IQ4_XS: a 4-bit index in the file. The grid types (IQ1-IQ3) code 4 or 8 weights at once
// as an index into a grid of magnitudes (with signs beside it); their q is the magnitude
// times the sign, in IQ1's case times 8 (its offset of +-1/8 becomes +-1), and their levels
// are few: 6 for IQ1 and IQ2 (a 3-bit index), 16 for IQ3 (4 bits). LEVEL_SCALE is the power
// of two that the scale of each family carries (see unpack_block): exact in float32.
// MXFP4 (gpt-oss): a 4-bit index into the E2M1 values, doubled (gguf's kvalues), under a
// power-of-two scale per 32.
enum { NL_NONE, NL_IQ4, NL_IQ2, NL_IQ1, NL_IQ3_XXS, NL_IQ3_S, NL_MXFP4 };
static const int8_t LEVELS[7][16] = {
    {0},
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {-43, -25, -8, 8, 25, 43},
    {-9, -7, -1, 1, 7, 9},
    {-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62},
    {-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15},
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12},
};
static const float LEVEL_SCALE[7] = {1.f, 1.f, 0.125f, 0.125f, 0.25f, 1.f, 1.f};
#define IQ4_LEVELS LEVELS[NL_IQ4]

// The grid types' codebooks, [entries][4 or 8] magnitudes (IQ1: -1, 0 or 1), handed over
// once by gguf_set_grids from gguf's own tables (gguf.quants), so that they are not copied
// here. Without them those types are not supported.
enum { GRID_IQ2_XXS, GRID_IQ2_XS, GRID_IQ2_S, GRID_IQ3_XXS, GRID_IQ3_S, GRID_IQ1_S, GRIDS };
static const int8_t *grids[GRIDS];

int gguf_set_grids(const int8_t *iq2_xxs, const int8_t *iq2_xs, const int8_t *iq2_s,
                   const int8_t *iq3_xxs, const int8_t *iq3_s, const int8_t *iq1_s) {
  const int8_t *all[GRIDS] = {iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq1_s};
  for (int i = 0; i < GRIDS; ++i) grids[i] = all[i];
  return 1;
}

static int is_grid_type(int type) {
  return type == T_IQ2_XXS || type == T_IQ2_XS || type == T_IQ2_S || type == T_IQ3_XXS ||
         type == T_IQ3_S || type == T_IQ1_S || type == T_IQ1_M;
}

// The 8 sign bits of a 7-bit sign index: the eighth makes the count of minus signs even.
static inline int ksigns(int i) { return i | (__builtin_parity(i) << 7); }

static inline uint32_t load_u32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

static inline uint16_t load_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

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
      {T_Q6_K, 256, 210, 32, 0}, {T_IQ4_NL, 32, 18, 128, 0}, {T_IQ4_XS, 256, 136, 128, 0},
      {T_IQ2_XXS, 256, 66, 128, 0}, {T_IQ2_XS, 256, 74, 128, 0}, {T_IQ2_S, 256, 82, 128, 0},
      {T_IQ3_XXS, 256, 98, 128, 0}, {T_IQ3_S, 256, 110, 128, 0}, {T_IQ1_S, 256, 50, 128, 0},
      {T_IQ1_M, 256, 56, 128, 0},   {T_MXFP4, 32, 17, 128, 0},
  };
  if (is_grid_type(type) && !grids[GRID_IQ1_S]) return 0;  // gguf_set_grids not called
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

// ------------------------------------------------------------------ the grid types
// Their block of 256 weights: a float16 d (IQ1_M: spread over its scale words), per 16 or
// 32 weights a factor f = 2 * (3- or 4-bit scale) + 1, and grid indices with signs (IQ1: a
// delta of +-1/8 per 8 or 32 weights in place of signs). Each weight is
//   d * f * LEVEL_SCALE[family] * q,
// q from unpack_grid; in float32 that is gguf's own arithmetic, exactly: d * (0.5 + s) *
// 0.25 (IQ2) is d * f / 8 without rounding (11 + 5 significant bits), and IQ1's
// d * f * (g +- 1/8) rounds once, as (d * f / 8) * (8 g +- 1) does.
static int grid_family(int type) {
  switch (type) {
    case T_IQ2_XXS: case T_IQ2_XS: case T_IQ2_S: return NL_IQ2;
    case T_IQ1_S: case T_IQ1_M: return NL_IQ1;
    case T_IQ3_XXS: return NL_IQ3_XXS;
    case T_IQ3_S: return NL_IQ3_S;
  }
  return NL_NONE;
}

// The factor f of weights 16 i .. 16 i + 15 of a block.
static int grid_factor(int type, const uint8_t *b, int i) {
  switch (type) {
    case T_IQ2_XXS: return 2 * (int)(load_u32(b + 6 + 8 * (i / 2)) >> 28) + 1;
    case T_IQ2_XS: return 2 * ((b[66 + i / 2] >> 4 * (i % 2)) & 15) + 1;
    case T_IQ2_S: return 2 * ((b[74 + i / 2] >> 4 * (i % 2)) & 15) + 1;
    case T_IQ3_XXS: return 2 * (int)(load_u32(b + 66 + 4 * (i / 2)) >> 28) + 1;
    case T_IQ3_S: return 2 * ((b[106 + i / 4] >> 4 * (i / 2 % 2)) & 15) + 1;
    case T_IQ1_S: return 2 * ((load_u16(b + 34 + 2 * (i / 2)) >> 12) & 7) + 1;
    case T_IQ1_M: return 2 * ((load_u16(b + 48 + 2 * (i / 4)) >> 3 * (i % 4)) & 7) + 1;
  }
  return 0;
}

// The float16 bytes of a block's d.
static void grid_d(int type, const uint8_t *b, uint8_t out[2]) {
  if (type != T_IQ1_M) {
    memcpy(out, b, 2);
    return;
  }
  uint16_t bits = 0;  // the top 4 bits of each of the 4 scale words, lowest first
  for (int w = 0; w < 4; ++w) bits |= (uint16_t)((load_u16(b + 48 + 2 * w) >> 12) << 4 * w);
  out[0] = (uint8_t)bits, out[1] = (uint8_t)(bits >> 8);
}

// q[0 .. n) = the grid entry's magnitudes, negated where bit j of signs is set.
static inline void signed_entry(const int8_t *entry, int signs, int n, int8_t *q) {
  for (int j = 0; j < n; ++j) q[j] = (signs >> j) & 1 ? (int8_t)-entry[j] : entry[j];
}

// IQ1: q = 8 * the entry's value (-1, 0, 1) + the delta's sign.
static inline void iq1_entry(const int8_t *entry, int delta, int8_t *q) {
  for (int j = 0; j < 8; ++j) q[j] = (int8_t)(8 * entry[j] + delta);
}

// One block's 256 values q (layouts as gguf.quants reads them).
static void unpack_grid(int type, const uint8_t *b, int8_t *q) {
  switch (type) {
    case T_IQ2_XXS:  // per 32: 4 grid bytes, then 4 7-bit sign indices and the scale
      for (int ib = 0; ib < 8; ++ib) {
        const uint32_t idx = load_u32(b + 2 + 8 * ib), aux = load_u32(b + 6 + 8 * ib);
        for (int l = 0; l < 4; ++l)
          signed_entry(grids[GRID_IQ2_XXS] + 8 * ((idx >> 8 * l) & 255),
                       ksigns((aux >> 7 * l) & 127), 8, q + 32 * ib + 8 * l);
      }
      return;
    case T_IQ2_XS:  // per 8: 9 bits of grid index, 7 of sign index
      for (int l = 0; l < 32; ++l) {
        const int v = load_u16(b + 2 + 2 * l);
        signed_entry(grids[GRID_IQ2_XS] + 8 * (v & 511), ksigns(v >> 9), 8, q + 8 * l);
      }
      return;
    case T_IQ2_S:  // qs[32] (low 8 bits), signs[32], qh[8] (2 high bits each), scales[8]
      for (int l = 0; l < 32; ++l) {
        const int idx = b[2 + l] | ((b[66 + l / 4] >> 2 * (l % 4)) & 3) << 8;
        signed_entry(grids[GRID_IQ2_S] + 8 * idx, b[34 + l], 8, q + 8 * l);
      }
      return;
    case T_IQ3_XXS:  // qs[64] (an entry of 4 per byte), per 32: sign indices and scale
      for (int ib = 0; ib < 8; ++ib) {
        const uint32_t aux = load_u32(b + 66 + 4 * ib);
        for (int l = 0; l < 4; ++l) {
          const int sg = ksigns((aux >> 7 * l) & 127);
          const uint8_t *idx = b + 2 + 8 * ib + 2 * l;
          int8_t *out = q + 32 * ib + 8 * l;
          signed_entry(grids[GRID_IQ3_XXS] + 4 * idx[0], sg, 4, out);
          signed_entry(grids[GRID_IQ3_XXS] + 4 * idx[1], sg >> 4, 4, out + 4);
        }
      }
      return;
    case T_IQ3_S:  // qs[64], qh[8] (the ninth bits), signs[32], scales[4]
      for (int i = 0; i < 64; ++i) {
        const int idx = b[2 + i] | ((b[66 + i / 8] >> (i % 8)) & 1) << 8;
        signed_entry(grids[GRID_IQ3_S] + 4 * idx, b[74 + i / 2] >> 4 * (i % 2), 4, q + 4 * i);
      }
      return;
    case T_IQ1_S:  // qs[32], per 32 a word: 4 x 3 high index bits, the scale, the delta
      for (int ib = 0; ib < 8; ++ib) {
        const int h = load_u16(b + 34 + 2 * ib), delta = h & 0x8000 ? -1 : 1;
        for (int l = 0; l < 4; ++l)
          iq1_entry(grids[GRID_IQ1_S] + 8 * (b[2 + 4 * ib + l] | ((h >> 3 * l) & 7) << 8), delta,
                    q + 32 * ib + 8 * l);
      }
      return;
    case T_IQ1_M:  // qs[32], qh[16]: a nibble per 8 (3 high index bits, the delta's sign)
      for (int l = 0; l < 32; ++l) {
        const int h = (b[32 + l / 2] >> 4 * (l % 2)) & 15;
        iq1_entry(grids[GRID_IQ1_S] + 8 * (b[l] | (h & 7) << 8), h & 8 ? -1 : 1, q + 8 * l);
      }
      return;
  }
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
    case T_IQ4_NL: {  // as Q4_0, the nibbles indexing the levels
      const float d = f16(b);
      for (int j = 0; j < 16; ++j) {
        q[j] = IQ4_LEVELS[b[2 + j] & 0xF];
        q[j + 16] = IQ4_LEVELS[b[2 + j] >> 4];
      }
      s[0] = s[1] = d;
      mn[0] = mn[1] = 0.f;
      return;
    }
    case T_MXFP4: {  // an E8M0 exponent byte e, then the nibbles as IQ4_NL's
      // d = 2^(e - 128), as ggml's e8m0_to_fp32_half (a subnormal for e < 2)
      const uint32_t bits = b[0] < 2 ? 0x00200000u << b[0] : (uint32_t)(b[0] - 1) << 23;
      float d;
      memcpy(&d, &bits, 4);
      for (int j = 0; j < 16; ++j) {
        q[j] = LEVELS[NL_MXFP4][b[1 + j] & 0xF];
        q[j + 16] = LEVELS[NL_MXFP4][b[1 + j] >> 4];
      }
      s[0] = s[1] = d;
      mn[0] = mn[1] = 0.f;
      return;
    }
    case T_IQ4_XS: {  // 8 such sub-blocks of 32 under one d, each with a 6-bit scale
      const float d = f16(b);
      const uint16_t scales_h = (uint16_t)(b[2] | b[3] << 8);
      const uint8_t *scales_l = b + 4, *qs = b + 8;
      for (int i = 0; i < 8; ++i) {
        const int ls =
            ((scales_l[i / 2] >> (4 * (i % 2))) & 0xF) | (((scales_h >> (2 * i)) & 3) << 4);
        s[2 * i] = s[2 * i + 1] = d * (float)(ls - 32);
        mn[2 * i] = mn[2 * i + 1] = 0.f;
        for (int j = 0; j < 16; ++j) {
          q[32 * i + j] = IQ4_LEVELS[qs[16 * i + j] & 0xF];
          q[32 * i + j + 16] = IQ4_LEVELS[qs[16 * i + j] >> 4];
        }
      }
      return;
    }
    case T_IQ2_XXS:
    case T_IQ2_XS:
    case T_IQ2_S:
    case T_IQ3_XXS:
    case T_IQ3_S:
    case T_IQ1_S:
    case T_IQ1_M: {
      uint8_t dh[2];
      grid_d(type, b, dh);
      const float d = f16(dh), c = LEVEL_SCALE[grid_family(type)];
      unpack_grid(type, b, q);
      for (int i = 0; i < 16; ++i) {
        s[i] = d * (float)grid_factor(type, b, i) * c;
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
// products, at about the file's size: Q2_K, Q4_0, Q4_1, Q5_0, Q5_1, Q6_K, Q8_0 and IQ4_NL at
// it, Q3_K +4%, IQ4_XS +6%, Q4_K and Q5_K +9-11% (float16 scales per row in place of their
// 6-bit factors). IQ4_NL and IQ4_XS keep their 4-bit indices (u below is the index's level
// + 128: one byte shuffle per value vector, as llama.cpp's kernels look the levels up).
// The grid types (IQ1-IQ3) are not kept at their size: their grid indices are unpacked
// into an index of their family's levels per weight (3 bits for IQ1's and IQ2's 6 levels,
// 4 for IQ3's 16), looked up as IQ4's, so the same kernels run them; 3.56 or 4.56 bits a
// weight, 1.3-2.3x the file (an IQ2_XXS 7B model in ~3 GB rather than ~1.8).
// TILE = 16 weight rows interleaved, in blocks of 32 weights
// along k. One packed block holds, for the 16 rows, their unsigned values u = q + off
// (L + H bits each) and a float16 scale s per row and group of G values (G = 32, or 16 for
// the k-quants whose sub-blocks are 16 weights), and for the types with a minimum a
// float16 m per row and group (their off is 0), so that
//   weight = s * (u - off)          or          weight = s * u + m.
// The values are stored in a low plane of L bits (2, 4 or 8) and a high plane of H bits
// (0, 1 or 2). "Value vector" g (0..7) is the values 4g .. 4g+3 of each of the 16 rows,
// a 32-bit lane per row, 64 bytes:
//   low plane, 64 * L bytes: with P = 8 / L fields per byte, byte 64 * (g / P) + 4j + p,
//     bits L * (g % P) .. +L-1, hold the low L bits of value 4g + p of row j;
//   high plane, 64 * H bytes: with P = 8 / H, byte 64 * (g / P) + 4j + p,
//     bits H * (g % P) .. +H-1, hold the high H bits of the same value;
// then s[32 / G][16] and (with a minimum) m[32 / G][16]. Value vector g is thus one load
// shared by several g, a shift and a mask (with a high plane: a second shift, mask and or),
// all in registers; a single vpdpbusd against 4 activation values broadcast to every lane
// then gives 16 rows' partial dot products, and the float scales of the 16 rows sit in one
// vector. Scales are rounded to float16: exact for the legacy types, whose files store
// them so; the k-quants' products of a float16 and a small integer factor round at 2^-11;
// MXFP4's powers of two from 2^-24 to 2^15 (smaller ones, whose weights are below 2^-20,
// flush to zero).
//
// With activations quantized per 32 values (scale dx, sum sx of the int8 values per group):
//   sum_groups s * dx * dot(u, xq) + m * dx * sx          (with a minimum)
//   sum_groups s * (dx * dot(u, xq) - off * dx * sx)      (without)
// The second term of each (e = dx * sx, or -off * dx * sx) is computed once per activation
// group.
//
// Q2_K, Q3_K and Q6_K keep the file's integer factors instead (float16 scales per 16 values
// would take a quarter to half as much again as their values): per block, in place of s and
// m, bytes f[2][16], and after the tile's blocks, per 8 blocks (the file's 256-value block),
// d[16] (Q2_K: and dmin[16]) in float16. Q2_K: f = scale | min << 4, s = d * (f & 15) and
// m = -(dmin * (f >> 4)); Q3_K, Q6_K: f = the signed scale, s = d * f; the grid types:
// f = 2 * scale + 1, s = d * f * LEVEL_SCALE. In float32, as the file's own dequantization
// computes them: bit-exact.
#define TILE 16

typedef struct {
  int L, H, off, has_min, G;
  int kq;  // the file's integer factors and per-256 d (, dmin) in place of float16 s (, m):
           // 1: Q2_K's (scale | min << 4), 2: Q3_K's and Q6_K's signed scales (below)
  int nl;  // a family of levels (NL_*): the bits are an index; u = LEVELS[nl][index] + off
} pack_t;

static int pack_info(int type, pack_t *f) {
  switch (type) {
    case T_Q4_0: *f = (pack_t){4, 0, 8, 0, 32, 0, 0}; return 1;
    case T_Q4_1:
    case T_Q4_K: *f = (pack_t){4, 0, 0, 1, 32, 0, 0}; return 1;
    case T_Q8_0: *f = (pack_t){8, 0, 128, 0, 32, 0, 0}; return 1;
    case T_Q5_0: *f = (pack_t){4, 1, 16, 0, 32, 0, 0}; return 1;
    case T_Q5_1:
    case T_Q5_K: *f = (pack_t){4, 1, 0, 1, 32, 0, 0}; return 1;
    case T_Q6_K: *f = (pack_t){4, 2, 32, 0, 16, 2, 0}; return 1;
    case T_Q3_K: *f = (pack_t){2, 1, 4, 0, 16, 2, 0}; return 1;
    case T_Q2_K: *f = (pack_t){2, 0, 0, 1, 16, 1, 0}; return 1;
    case T_IQ4_NL:
    case T_IQ4_XS: *f = (pack_t){4, 0, 128, 0, 32, 0, NL_IQ4}; return 1;
    case T_IQ2_XXS:
    case T_IQ2_XS:
    case T_IQ2_S: *f = (pack_t){2, 1, 128, 0, 16, 2, NL_IQ2}; return 1;
    case T_IQ1_S:
    case T_IQ1_M: *f = (pack_t){2, 1, 128, 0, 16, 2, NL_IQ1}; return 1;
    case T_IQ3_XXS: *f = (pack_t){4, 0, 128, 0, 16, 2, NL_IQ3_XXS}; return 1;
    case T_IQ3_S: *f = (pack_t){4, 0, 128, 0, 16, 2, NL_IQ3_S}; return 1;
    case T_MXFP4: *f = (pack_t){4, 0, 128, 0, 32, 0, NL_MXFP4}; return 1;
  }
  return 0;
}

// The multiplier of dx * sum(xq) in the activation term e (see below): the minimum's, or
// -off where the kernel's values carry the offset (unsigned), 0 where it takes them signed.
static float offset_term(const pack_t *f);

// d[16] (and dmin[16]) in float16 per 8 blocks of a kq type
#define SUPER_BYTES(has_min) (2 * TILE * (1 + (has_min)))

static int64_t packed_block_bytes(const pack_t *f) {
  if (f->kq) return 64 * (f->L + f->H) + 2 * TILE;
  return 64 * (f->L + f->H) + TILE * 2 * (1 + f->has_min) * (32 / f->G);
}

// Bytes of one tile: its nb blocks, then (kq types) d[16] (and dmin[16]) per 8 blocks.
static int64_t tile_bytes(const pack_t *f, int64_t nb) {
  return nb * packed_block_bytes(f) + (f->kq ? nb / 8 * SUPER_BYTES(f->has_min) : 0);
}

// The factor byte of sub-block i (16 values) of a k-quant block b, as the file stores it.
static uint8_t kq_factor(int type, const uint8_t *b, int i) {
  if (is_grid_type(type)) return (uint8_t)grid_factor(type, b, i);
  if (type == T_Q2_K) return b[i];
  if (type == T_Q6_K) return b[192 + i];
  const uint8_t *sc = b + 96;  // Q3_K: 6 bits in two places, less 32
  const int lo = (i < 8 ? sc[i] : sc[i - 8] >> 4) & 0xF;
  const int hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
  return (uint8_t)(int8_t)((lo | (hi << 4)) - 32);
}

// Bytes of the packed form of an [n, k] weight, or 0 when the type is not packed.
int64_t gguf_packed_size(int type, int64_t n, int64_t k) {
  pack_t f;
  if (!pack_info(type, &f) || k % 32) return 0;
  if (f.kq && k % 256) return 0;
  return (n + TILE - 1) / TILE * tile_bytes(&f, k / 32);
}

// raw [n, row bytes] GGUF blocks -> out [gguf_packed_size] (rows past n padded with zeros).
int gguf_pack(int type, const uint8_t *raw, int64_t n, int64_t k, uint8_t *out) {
  int block, bytes, unused;
  pack_t f;
  if (!type_info(type, &block, &bytes, &unused, &unused)) return 0;
  if (!pack_info(type, &f) || k % block) return 0;
  const int64_t row_bytes = k / block * bytes, nb = k / 32;
  const int64_t bb = packed_block_bytes(&f), tiles = (n + TILE - 1) / TILE;
  const int L = f.L, H = f.H, ng = 32 / f.G;
  // The non-linear types' values back to their level indices (the first index of a value
  // the levels hold twice): a table, not a search per weight (5x faster packing).
  uint8_t index_of[256];
  memset(index_of, 15, sizeof(index_of));
  for (int u = 15; f.nl && u >= 0; --u) index_of[(uint8_t)LEVELS[f.nl][u]] = (uint8_t)u;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    int8_t q[256];
    float s[16], mn[16];
    uint8_t *tile = out + t * tile_bytes(&f, nb);
    memset(tile, 0, (size_t)tile_bytes(&f, nb));
    for (int j = 0; j < TILE && t * TILE + j < n; ++j) {
      const uint8_t *src = raw + (t * TILE + j) * row_bytes;
      for (int64_t blk = 0; blk < k / block; ++blk) {
        unpack_block(type, src + blk * bytes, q, s, mn);
        for (int sub = 0; sub < block / 32; ++sub) {
          uint8_t *dst = tile + (blk * block / 32 + sub) * bb;
          for (int v = 0; v < 32; ++v) {
            int u = q[sub * 32 + v] + f.off;
            if (f.nl) u = index_of[(uint8_t)q[sub * 32 + v]];  // every q is one of its levels
            const int g = v / 4, p = v % 4;
            dst[64 * (g / (8 / L)) + 4 * j + p] |=
                (uint8_t)((u & ((1 << L) - 1)) << (L * (g % (8 / L))));
            if (H)
              dst[64 * L + 64 * (g / (8 / H)) + 4 * j + p] |=
                  (uint8_t)(((u >> L) & ((1 << H) - 1)) << (H * (g % (8 / H))));
          }
          uint8_t *sc = dst + 64 * (L + H);
          if (f.kq) {  // the file's factor bytes per 16, and its d (and dmin)
            const uint8_t *b = src + blk * bytes;
            sc[j] = kq_factor(type, b, 2 * sub), sc[TILE + j] = kq_factor(type, b, 2 * sub + 1);
            uint8_t *super = tile + nb * bb + blk * SUPER_BYTES(f.has_min);
            if (is_grid_type(type)) grid_d(type, b, super + 2 * j);
            else memcpy(super + 2 * j, b + (type == T_Q2_K ? 80 : type == T_Q3_K ? 108 : 208), 2);
            if (type == T_Q2_K) memcpy(super + 2 * (TILE + j), b + 82, 2);
            continue;
          }
          for (int h = 0; h < ng; ++h) {
            // the 16- or 32-value sub-block's scale (its first value's)
            const float sh = s[2 * sub + h], mh = mn[2 * sub + h] - sh * (float)f.off;
            const _Float16 pair[2] = {(_Float16)sh, (_Float16)mh};
            memcpy(sc + 2 * (TILE * h + j), &pair[0], 2);
            if (f.has_min) memcpy(sc + 2 * (TILE * (ng + h) + j), &pair[1], 2);
          }
        }
      }
    }
  }
  return 1;
}

static inline int packed_value(const uint8_t *blk, const pack_t *f, int j, int v) {
  const int L = f->L, H = f->H, g = v / 4, p = v % 4;
  int u = (blk[64 * (g / (8 / L)) + 4 * j + p] >> (L * (g % (8 / L)))) & ((1 << L) - 1);
  if (H)
    u |= ((blk[64 * L + 64 * (g / (8 / H)) + 4 * j + p] >> (H * (g % (8 / H)))) & ((1 << H) - 1))
         << L;
  return f->nl ? LEVELS[f->nl][u] + f->off : u;
}

// Rows of a packed [n, k] weight to float32, as gguf_dequantize_rows.
int gguf_packed_dequantize_rows(int type, const uint8_t *packed, const int64_t *rows,
                                int64_t n_rows, int64_t k, float *out) {
  pack_t f;
  if (!pack_info(type, &f) || k % 32) return 0;
  const int64_t nb = k / 32, bb = packed_block_bytes(&f);
  const int ng = 32 / f.G;
#pragma omp parallel for schedule(static) if (n_rows * k > 65536)
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t row = rows ? rows[r] : r;
    const int j = (int)(row % TILE);
    const uint8_t *tile = packed + row / TILE * tile_bytes(&f, nb);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t *blk = tile + b * bb, *sc = blk + 64 * (f.L + f.H);
      const uint8_t *super = tile + nb * bb + b / 8 * SUPER_BYTES(f.has_min);
      for (int v = 0; v < 32; ++v) {
        const int h = v / f.G;
        float s, m = 0.f;
        if (f.kq == 1) {  // as unpack_block: d * scale, -(dmin * min)
          s = f16(super + 2 * j) * (float)(sc[TILE * h + j] & 0xF);
          m = -(f16(super + 2 * (TILE + j)) * (float)(sc[TILE * h + j] >> 4));
        } else if (f.kq == 2) {
          s = f16(super + 2 * j) * (float)(int8_t)sc[TILE * h + j] * LEVEL_SCALE[f.nl];
        } else {
          s = f16(sc + 2 * (TILE * h + j));
          if (f.has_min) m = f16(sc + 2 * (TILE * (ng + h) + j));
        }
        const float w = s * (float)(packed_value(blk, &f, j, v) - f.off);
        out[r * k + b * 32 + v] = f.has_min ? w + m : w;
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
#elif defined(__AVX2__)
      __m256 v[4], amax8 = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[j]));
      }
      __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
      amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
      amax4 = _mm_max_ss(amax4, _mm_movehdup_ps(amax4));
      const float d = _mm_cvtss_f32(amax4) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      __m256i q[4];  // cvtps rounds to nearest even, as nearbyintf in the default rounding mode
      for (int j = 0; j < 4; ++j)
        q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id)));
      // packs interleave 128-bit lanes: dwords (0, 4, 1, 5, ...) put the 32 bytes in order
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                               _mm256_packs_epi32(q[2], q[3]));
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(bytes, order));
      int32_t half[8];
      _mm256_storeu_si256((__m256i *)half, _mm256_add_epi32(q[0], q[1]));
      for (int j = 0; j < 8; ++j) sum0 += half[j];
      _mm256_storeu_si256((__m256i *)half, _mm256_add_epi32(q[2], q[3]));
      for (int j = 0; j < 8; ++j) sum1 += half[j];
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
// The compile-time form of a packed type (pack_t), then the activation rows MR per call.
#define KERNEL_PARAMS                                                                 \
  const int L, const int H, const int has_min, const int G, const int KQ, const int NL, \
      const int MR

// One activation row (decode) streams each thread's tiles, front to back and contiguous, from
// memory at a few integer operations a byte: each block asks for the bytes PREFETCH_BYTES
// ahead of it while it is multiplied. The hardware prefetchers alone leave a one-row product
// short of what the memory gives (Zen 5, 2 cores, LFM2's Q4_0 layer's products from memory,
// one thread: 34-36 GB/s, where a plain read of the same bytes takes 43-45; with the hints
// 42-43, the same at 12 KiB ahead, 8% less at 4 KiB; two threads, in the moments both cores
// were free on a loaded machine: 67 GB/s without, 81 with). Past a
// thread's last tile the hints fall on the next thread's bytes or past the weight: a few KiB
// a call, and a prefetch never faults. The 4-row kernel (a few streams, a short prompt chunk)
// stalls on its tiles' first pass the same way: with the hints Q4_0 from memory at 4 / 16 /
// 64 rows x1.56 / x1.5 / x1.15, Q6_K at 4 x2.5, and from L3 no slower.
// -DPREFETCH_BYTES=0 builds the kernels without them.
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif

// Bytes of a packed block (packed_block_bytes) from a kernel's compile-time parameters.
#define BLOCK_BYTES(L, H, has_min, G, KQ) \
  ((KQ) ? 64 * ((L) + (H)) + 2 * TILE : 64 * ((L) + (H)) + TILE * 2 * (1 + (has_min)) * (32 / (G)))

// One hint per cache line of the block `bytes` ahead of w, unrolled (a count known when the
// kernel is compiled: a loop whose count the kernel reads at run time cost 5-9% with the
// weights in L3, where the hints gain nothing).
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *w,
                                                                 const int bytes) {
#pragma GCC unroll 16
  for (int at = 0; at < bytes; at += 64)
    __builtin_prefetch(w + PREFETCH_BYTES + at, 0, 3);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PACKED_PATH "avx512-vnni"
#define SIGNED_8BIT 0  // 8-bit values are used unsigned: off stays in the sum

// 64 bytes at p as two 32-byte loads: Q4_0's and Q8_0's blocks (288 and 544 bytes) sit 32
// bytes off a cache line every other block, where a 64-byte load is split across two lines;
// two halves never cross one. Zen 4, one row from memory: Q8_0 3-10% faster, Q4_0 the same
// (benchmarks/gguf_decode_products.py).
static inline __attribute__((always_inline)) __m512i load_halves(const uint8_t *p) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                            _mm256_loadu_si256((const __m256i *)(p + 32)), 1);
}

// Value vector g (see the layout) of the packed block at w: 16 rows x 4 unsigned values.
static inline __attribute__((always_inline)) __m512i values512(const uint8_t *w, const int L,
                                                                const int H, const int g) {
  const __m512i lo = load_halves(w + 64 * (g / (8 / L)));
  __m512i u = lo;
  if (L < 8) {
    const int at = L * (g % (8 / L));
    u = _mm512_and_si512(at ? _mm512_srli_epi16(lo, at) : lo,
                         _mm512_set1_epi8((char)((1 << L) - 1)));
  }
  if (H) {
    const __m512i hi = _mm512_loadu_si512(w + 64 * L + 64 * (g / (8 / H)));
    const int at = H * (g % (8 / H));  // the bits move from at to L (16-bit shifts: the
    // bits that cross into the next byte fall outside the mask)
    const __m512i moved = at < L ? _mm512_slli_epi16(hi, L - at)
                          : at > L ? _mm512_srli_epi16(hi, at - L) : hi;
    const __m512i mask = _mm512_set1_epi8((char)(((1 << H) - 1) << L));
    u = _mm512_ternarylogic_epi32(u, moved, mask, 0xF8);  // u | (moved & mask)
  }
  return u;
}

// The float scales of block b of a tile, per row: G = 16, s0 and s1 (and m0, m1) for the
// block's two halves; G = 32, s0 (and m0).
static inline __attribute__((always_inline)) void block_scales(
    const int L, const int H, const int has_min, const int G, const int KQ, const int NL,
    const uint8_t *tile, int64_t nb, int64_t bb, int64_t b, __m512 *s0, __m512 *s1, __m512 *m0,
    __m512 *m1) {
  const uint8_t *sc = tile + b * bb + 64 * (L + H);
  const __m512 zero = _mm512_setzero_ps();
  *s1 = *m0 = *m1 = zero;
  if (G == 32) {
    *s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
    if (has_min) *m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));
  } else if (KQ == 2) {  // s = d * f, f signed (the grid types: d * LEVEL_SCALE, exact)
    const __m256i *super = (const __m256i *)(tile + nb * bb + b / 8 * SUPER_BYTES(0));
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(super));
    if (NL > NL_IQ4) d = _mm512_mul_ps(d, _mm512_set1_ps(LEVEL_SCALE[NL]));
    const __m512i f0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc));
    const __m512i f1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16)));
    *s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(f0));
    *s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(f1));
  } else if (KQ) {  // s = d * (f & 15), m = -dmin * (f >> 4)
    const __m256i *super = (const __m256i *)(tile + nb * bb + b / 8 * SUPER_BYTES(1));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(super));
    const __m512 dmin = _mm512_sub_ps(zero, _mm512_cvtph_ps(_mm256_loadu_si256(super + 1)));
    const __m512i f0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc));
    const __m512i f1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16)));
    const __m512i m15 = _mm512_set1_epi32(15);
    *s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(f0, m15)));
    *s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(f1, m15)));
    *m0 = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(f0, 4)));
    *m1 = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(f1, 4)));
  } else {
    const __m256i *sh = (const __m256i *)sc;
    *s0 = _mm512_cvtph_ps(_mm256_loadu_si256(sh));
    *s1 = _mm512_cvtph_ps(_mm256_loadu_si256(sh + 1));
    if (has_min) {
      *m0 = _mm512_cvtph_ps(_mm256_loadu_si256(sh + 2));
      *m1 = _mm512_cvtph_ps(_mm256_loadu_si256(sh + 3));
    }
  }
}

// acc[r] += block b's integer dot products (a0, a1: the halves for G = 16, alternate value
// vectors for G = 32) times the scales, plus the activation term.
static inline __attribute__((always_inline)) void block_accumulate(
    const int has_min, const int G, const int MR, __m512 *acc, const __m512i *a0,
    const __m512i *a1, __m512 s0, __m512 s1, __m512 m0, __m512 m1, const float *dx,
    const float *e, int64_t k, int64_t b) {
  for (int r = 0; r < MR; ++r) {
    const __m512 dxv = _mm512_set1_ps(dx[r * (k / 32) + b]);
    if (G == 16) {
      const float *er = e + r * (k / 16) + 2 * b;
      const __m512 d0 = _mm512_cvtepi32_ps(a0[r]), d1 = _mm512_cvtepi32_ps(a1[r]);
      if (has_min) {
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d0, dxv), s0, acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d1, dxv), s1, acc[r]);
        acc[r] = _mm512_fmadd_ps(m0, _mm512_set1_ps(er[0]), acc[r]);
        acc[r] = _mm512_fmadd_ps(m1, _mm512_set1_ps(er[1]), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(d0, dxv, _mm512_set1_ps(er[0])), s0, acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(d1, dxv, _mm512_set1_ps(er[1])), s1, acc[r]);
      }
    } else {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a0[r], a1[r]));
      const __m512 ev = _mm512_set1_ps(e[r * (k / 32) + b]);
      if (has_min) {
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, dxv), s0, acc[r]);
        acc[r] = _mm512_fmadd_ps(m0, ev, acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(dot, dxv, ev), s0, acc[r]);
      }
    }
  }
}

// Family NL: index -> level + 128, unsigned (the shuffle looks up within each 128-bit lane)
static inline __attribute__((always_inline)) __m512i levels512(const int NL) {
  return _mm512_broadcast_i32x4(_mm_add_epi8(_mm_loadu_si128((const __m128i *)LEVELS[NL]),
                                             _mm_set1_epi8((char)0x80)));
}

// MR activation rows against one tile of 16 weight rows: y[r][0..valid).
KERNEL tile_kernel(KERNEL_PARAMS, KERNEL_ARGS) {
  // Plain 4-bit values (Q4_0, Q4_1, Q4_K) in groups of 32 alternate low and high nibbles
  // (g even, odd): the high ones are taken as 16 u, masked but not shifted, and their
  // chain's sum shifted back once a block: 4 shifts a block fewer (Zen 4, one row, weights
  // in L3: Q4_0 2-18%, Q4_1 4-10% faster; from memory, where one core's bandwidth bounds
  // Q4_0, the same).
  const int NIBBLES16 = L == 4 && !H && !NL && G == 32;
  const __m512i levels = levels512(NL);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *w = tile + b * bb;
    const int8_t *xb = xq + b * 32;
    if (PREFETCH_BYTES) prefetch_block(w, BLOCK_BYTES(L, H, has_min, G, KQ));
    // two chains of dot products: G = 16, one per half; G = 32, alternating, summed
    __m512i a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      __m512i u;
      if (NIBBLES16) {  // the high nibble left in place (16 u): a1 is 16 times its sum
        const __m512i v = load_halves(w + 64 * (g / 2));
        u = _mm512_and_si512(v, _mm512_set1_epi8(g % 2 ? (char)0xF0 : 0x0F));
      } else {
        u = NL ? _mm512_shuffle_epi8(levels, values512(w, L, H, g)) : values512(w, L, H, g);
      }
      const int first = G == 16 ? g < 4 : g % 2 == 0;
      for (int r = 0; r < MR; ++r) {
        const __m512i x4 = _mm512_set1_epi32(load_i32(xb + r * k + 4 * g));
        if (first) a0[r] = _mm512_dpbusd_epi32(a0[r], u, x4);
        else a1[r] = _mm512_dpbusd_epi32(a1[r], u, x4);
      }
    }
    if (NIBBLES16)  // exact: a multiple of 16 (|a1| < 2^21)
      for (int r = 0; r < MR; ++r) a1[r] = _mm512_srai_epi32(a1[r], 4);
    __m512 s0, s1, m0, m1;
    block_scales(L, H, has_min, G, KQ, NL, tile, nb, bb, b, &s0, &s1, &m0, &m1);
    block_accumulate(has_min, G, MR, acc, a0, a1, s0, s1, m0, m1, dx, e, k, b);
  }
  const __mmask16 mask = (__mmask16)((1u << valid) - 1);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}

// Prompts (many activation rows): each tile is first decoded into plain bytes, its 8 value
// vectors per block as vpdpbusd takes them, and float32 scales (s0[, s1][, m0, m1]), so
// that the rows then run through loads and dot products alone; the decoding (shifts,
// masks, high planes, level lookups, the k-quants' factors) is paid once per tile rather
// than once per 4 rows.
#define PROMPT_PATH 1
#define DECODED_BLOCK(has_min, G) (512 + 64 * (32 / (G)) * (1 + (has_min)))

KERNEL decode_tile(const int L, const int H, const int has_min, const int G, const int KQ,
                   const int NL, const uint8_t *tile, int64_t nb, int64_t bb, uint8_t *out) {
  const __m512i levels = levels512(NL);
  const int db = DECODED_BLOCK(has_min, G), ng = 32 / G;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *w = tile + b * bb;
    uint8_t *dst = out + b * db;
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i u = NL ? _mm512_shuffle_epi8(levels, values512(w, L, H, g))
                           : values512(w, L, H, g);
      _mm512_storeu_si512(dst + 64 * g, u);
    }
    __m512 s0, s1, m0, m1;
    block_scales(L, H, has_min, G, KQ, NL, tile, nb, bb, b, &s0, &s1, &m0, &m1);
    float *sc = (float *)(dst + 512);
    _mm512_storeu_ps(sc, s0);
    if (ng == 2) _mm512_storeu_ps(sc + 16, s1);
    if (has_min) {
      _mm512_storeu_ps(sc + 16 * ng, m0);
      if (ng == 2) _mm512_storeu_ps(sc + 16 * ng + 16, m1);
    }
  }
}

// As tile_kernel, on a decoded tile.
KERNEL decoded_kernel(const int L, const int H, const int has_min, const int G, const int NL,
                      const int MR, const uint8_t *dec, int64_t nb, const int8_t *xq, int64_t k,
                      const float *dx, const float *e, float *y, int64_t ldy, int valid) {
  (void)L, (void)H, (void)NL;  // the values are decoded: only the scales' form matters
  const int db = DECODED_BLOCK(has_min, G), ng = 32 / G;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *w = dec + b * db;
    const int8_t *xb = xq + b * 32;
    __m512i a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i u = _mm512_loadu_si512(w + 64 * g);
      const int first = G == 16 ? g < 4 : g % 2 == 0;
      for (int r = 0; r < MR; ++r) {
        const __m512i x4 = _mm512_set1_epi32(load_i32(xb + r * k + 4 * g));
        if (first) a0[r] = _mm512_dpbusd_epi32(a0[r], u, x4);
        else a1[r] = _mm512_dpbusd_epi32(a1[r], u, x4);
      }
    }
    const float *sc = (const float *)(w + 512);
    const __m512 zero = _mm512_setzero_ps();
    const __m512 s0 = _mm512_loadu_ps(sc), s1 = ng == 2 ? _mm512_loadu_ps(sc + 16) : zero;
    const __m512 m0 = has_min ? _mm512_loadu_ps(sc + 16 * ng) : zero;
    const __m512 m1 = has_min && ng == 2 ? _mm512_loadu_ps(sc + 16 * ng + 16) : zero;
    block_accumulate(has_min, G, MR, acc, a0, a1, s0, s1, m0, m1, dx, e, k, b);
  }
  const __mmask16 mask = (__mmask16)((1u << valid) - 1);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PACKED_PATH "avx2"
#define SIGNED_8BIT 1  // 8-bit values are made signed again (maddubs would saturate): off = 0

// Value vector g of half tile h (8 rows): as values512, on the 32 bytes at 32 * h.
static inline __attribute__((always_inline)) __m256i values256(const uint8_t *w, const int L,
                                                                const int H, const int g) {
  const __m256i lo = _mm256_loadu_si256((const __m256i *)(w + 64 * (g / (8 / L))));
  __m256i u = lo;
  if (L < 8) {
    const int at = L * (g % (8 / L));
    u = _mm256_and_si256(at ? _mm256_srli_epi16(lo, at) : lo,
                         _mm256_set1_epi8((char)((1 << L) - 1)));
  }
  if (H) {
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(w + 64 * L + 64 * (g / (8 / H))));
    const int at = H * (g % (8 / H));
    const __m256i moved = at < L ? _mm256_slli_epi16(hi, L - at)
                          : at > L ? _mm256_srli_epi16(hi, at - L) : hi;
    const __m256i mask = _mm256_set1_epi8((char)(((1 << H) - 1) << L));
    u = _mm256_or_si256(u, _mm256_and_si256(moved, mask));
  }
  return u;
}

// The float scales of half h (8 rows) of block b of a tile: as block_scales (AVX-512).
static inline __attribute__((always_inline)) void half_scales(
    const int L, const int H, const int has_min, const int G, const int KQ, const int NL,
    const uint8_t *tile, int64_t nb, int64_t bb, int64_t b, int h, __m256 *s0, __m256 *s1,
    __m256 *m0, __m256 *m1) {
  const uint8_t *sc = tile + b * bb + 64 * (L + H) + 16 * h;
  const __m256 zero = _mm256_setzero_ps();
  *s1 = *m0 = *m1 = zero;
  if (G == 32) {
    *s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
    if (has_min) *m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32)));
  } else if (KQ == 2) {  // s = d * f, f signed; this half's 8 rows
    const uint8_t *fb = tile + b * bb + 64 * (L + H) + 8 * h;
    const uint8_t *super = tile + nb * bb + b / 8 * SUPER_BYTES(0) + 16 * h;
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)super));
    if (NL > NL_IQ4) d = _mm256_mul_ps(d, _mm256_set1_ps(LEVEL_SCALE[NL]));
    const __m256i f0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)fb));
    const __m256i f1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(fb + 16)));
    *s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(f0));
    *s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(f1));
  } else if (KQ) {  // s = d * (f & 15), m = -dmin * (f >> 4); this half's 8 rows
    const uint8_t *fb = tile + b * bb + 64 * (L + H) + 8 * h;
    const uint8_t *super = tile + nb * bb + b / 8 * SUPER_BYTES(1) + 16 * h;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)super));
    const __m256 dmin =
        _mm256_sub_ps(zero, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(super + 32))));
    const __m256i f0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)fb));
    const __m256i f1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(fb + 16)));
    const __m256i m15 = _mm256_set1_epi32(15);
    *s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(f0, m15)));
    *s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(f1, m15)));
    *m0 = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(f0, 4)));
    *m1 = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(f1, 4)));
  } else {
    *s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
    *s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32)));
    if (has_min) {
      *m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 64)));
      *m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 96)));
    }
  }
}

// acc[r] += half h's integer dot products of block b times its scales (block_accumulate).
static inline __attribute__((always_inline)) void half_accumulate(
    const int has_min, const int G, const int MR, __m256 *acc, const __m256i *a0,
    const __m256i *a1, __m256 s0, __m256 s1, __m256 m0, __m256 m1, const float *dx,
    const float *e, int64_t k, int64_t b) {
  for (int r = 0; r < MR; ++r) {
    const __m256 dxv = _mm256_set1_ps(dx[r * (k / 32) + b]);
    if (G == 16) {
      const float *er = e + r * (k / 16) + 2 * b;
      const __m256 d0 = _mm256_cvtepi32_ps(a0[r]), d1 = _mm256_cvtepi32_ps(a1[r]);
      if (has_min) {
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d0, dxv), s0, acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d1, dxv), s1, acc[r]);
        acc[r] = _mm256_fmadd_ps(m0, _mm256_set1_ps(er[0]), acc[r]);
        acc[r] = _mm256_fmadd_ps(m1, _mm256_set1_ps(er[1]), acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_fmadd_ps(d0, dxv, _mm256_set1_ps(er[0])), s0, acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_fmadd_ps(d1, dxv, _mm256_set1_ps(er[1])), s1, acc[r]);
      }
    } else {
      const __m256 dot = _mm256_cvtepi32_ps(a0[r]);  // (a1: G = 16 only)
      const __m256 ev = _mm256_set1_ps(e[r * (k / 32) + b]);
      if (has_min) {
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dot, dxv), s0, acc[r]);
        acc[r] = _mm256_fmadd_ps(m0, ev, acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_fmadd_ps(dot, dxv, ev), s0, acc[r]);
      }
    }
  }
}

// As the AVX-512 kernel, one half tile (8 rows) per 256-bit vector; maddubs (u8 x s8 pairs
// to int16) and madd (pairs to int32) in place of vpdpbusd.
KERNEL tile_kernel(KERNEL_PARAMS, KERNEL_ARGS) {
  const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)LEVELS[NL]));
  // u <= 15: a block's 8 sums of pairs of products in a lane (each at most 2 * 15 * 127)
  // add up in int16 (30,480); u <= 63: one pair fits, so each goes to int32 at once. The
  // block's sums go to a0 (G = 32), or its halves' to a0 and a1 (G = 16).
  const int small = L + H <= 4;
  float out[MR][TILE];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t *w = tile + b * bb + 32 * h;
      const int8_t *xb = xq + b * 32;
      if (PREFETCH_BYTES && h == 0)  // (h = 1 reads the tile from the cache)
        prefetch_block(w, BLOCK_BYTES(L, H, has_min, G, KQ));
      __m256i a0[MR], a1[MR];
      for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const int first = G == 32 || g < 4;
        if ((L == 8 || NL) && !has_min) {  // q = u - 128 signed (IQ4: the level);
          // |q| * sign(x, q) keeps pairs in int16
          const __m256i q = NL ? _mm256_shuffle_epi8(levels, values256(w, L, H, g))
                               : _mm256_xor_si256(values256(w, L, H, g), bias);
          const __m256i aq = _mm256_abs_epi8(q);
          for (int r = 0; r < MR; ++r) {
            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xb + r * k + 4 * g)), q);
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, xs), ones);
            if (first) a0[r] = _mm256_add_epi32(a0[r], p);
            else a1[r] = _mm256_add_epi32(a1[r], p);
          }
          continue;
        }
        const __m256i u = values256(w, L, H, g);
        for (int r = 0; r < MR; ++r) {
          const __m256i x4 = _mm256_set1_epi32(load_i32(xb + r * k + 4 * g));
          __m256i p = _mm256_maddubs_epi16(u, x4);
          if (!small) p = _mm256_madd_epi16(p, ones);
          if (first) a0[r] = small ? _mm256_add_epi16(a0[r], p) : _mm256_add_epi32(a0[r], p);
          else a1[r] = small ? _mm256_add_epi16(a1[r], p) : _mm256_add_epi32(a1[r], p);
        }
      }
      if (small && !((L == 8 || NL) && !has_min))
        for (int r = 0; r < MR; ++r) {
          a0[r] = _mm256_madd_epi16(a0[r], ones);
          if (G == 16) a1[r] = _mm256_madd_epi16(a1[r], ones);
        }
      __m256 s0, s1, m0, m1;
      half_scales(L, H, has_min, G, KQ, NL, tile, nb, bb, b, h, &s0, &s1, &m0, &m1);
      half_accumulate(has_min, G, MR, acc, a0, a1, s0, s1, m0, m1, dx, e, k, b);
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
  }
  for (int r = 0; r < MR; ++r) memcpy(y + r * ldy, out[r], sizeof(float) * (size_t)valid);
}

// Prompts, as on AVX-512 (decode_tile there): each tile decoded once into the value
// vectors the dot products take (signed, or unsigned u) and float32 scales.
#define PROMPT_PATH 1
#define DECODED_BLOCK(has_min, G) (512 + 64 * (32 / (G)) * (1 + (has_min)))

KERNEL decode_tile(const int L, const int H, const int has_min, const int G, const int KQ,
                   const int NL, const uint8_t *tile, int64_t nb, int64_t bb, uint8_t *out) {
  const __m256i bias = _mm256_set1_epi8((char)0x80);
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)LEVELS[NL]));
  const int db = DECODED_BLOCK(has_min, G), ng = 32 / G;
  const int sign = (L == 8 || NL) && !has_min;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t *dst = out + b * db;
    float *sc = (float *)(dst + 512);
    for (int h = 0; h < 2; ++h) {
      const uint8_t *w = tile + b * bb + 32 * h;
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        __m256i v = values256(w, L, H, g);
        if (NL) v = _mm256_shuffle_epi8(levels, v);
        else if (sign) v = _mm256_xor_si256(v, bias);
        _mm256_storeu_si256((__m256i *)(dst + 64 * g + 32 * h), v);
      }
      __m256 s0, s1, m0, m1;
      half_scales(L, H, has_min, G, KQ, NL, tile, nb, bb, b, h, &s0, &s1, &m0, &m1);
      _mm256_storeu_ps(sc + 8 * h, s0);
      if (ng == 2) _mm256_storeu_ps(sc + 16 + 8 * h, s1);
      if (has_min) {
        _mm256_storeu_ps(sc + 16 * ng + 8 * h, m0);
        if (ng == 2) _mm256_storeu_ps(sc + 16 * ng + 16 + 8 * h, m1);
      }
    }
  }
}

// As tile_kernel, on a decoded tile.
KERNEL decoded_kernel(const int L, const int H, const int has_min, const int G, const int NL,
                      const int MR, const uint8_t *dec, int64_t nb, const int8_t *xq, int64_t k,
                      const float *dx, const float *e, float *y, int64_t ldy, int valid) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int sign = (L == 8 || NL) && !has_min, small = !sign && L + H <= 4;
  const int db = DECODED_BLOCK(has_min, G), ng = 32 / G;
  float out[MR][TILE];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t *v = dec + b * db + 32 * h;
      const int8_t *xb = xq + b * 32;
      __m256i a0[MR], a1[MR];
      for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const int first = G == 32 || g < 4;
        const __m256i val = _mm256_loadu_si256((const __m256i *)(v + 64 * g));
        if (sign) {  // |q| * sign(x, q) keeps pairs in int16
          const __m256i aq = _mm256_abs_epi8(val);
          for (int r = 0; r < MR; ++r) {
            const __m256i xs =
                _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xb + r * k + 4 * g)), val);
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, xs), ones);
            if (first) a0[r] = _mm256_add_epi32(a0[r], p);
            else a1[r] = _mm256_add_epi32(a1[r], p);
          }
          continue;
        }
        for (int r = 0; r < MR; ++r) {
          const __m256i x4 = _mm256_set1_epi32(load_i32(xb + r * k + 4 * g));
          __m256i p = _mm256_maddubs_epi16(val, x4);
          if (!small) p = _mm256_madd_epi16(p, ones);
          if (first) a0[r] = small ? _mm256_add_epi16(a0[r], p) : _mm256_add_epi32(a0[r], p);
          else a1[r] = small ? _mm256_add_epi16(a1[r], p) : _mm256_add_epi32(a1[r], p);
        }
      }
      if (small)
        for (int r = 0; r < MR; ++r) {
          a0[r] = _mm256_madd_epi16(a0[r], ones);
          if (G == 16) a1[r] = _mm256_madd_epi16(a1[r], ones);
        }
      const float *sc = (const float *)(dec + b * db + 512);
      const __m256 zero = _mm256_setzero_ps();
      const __m256 s0 = _mm256_loadu_ps(sc + 8 * h);
      const __m256 s1 = ng == 2 ? _mm256_loadu_ps(sc + 16 + 8 * h) : zero;
      const __m256 m0 = has_min ? _mm256_loadu_ps(sc + 16 * ng + 8 * h) : zero;
      const __m256 m1 = has_min && ng == 2 ? _mm256_loadu_ps(sc + 16 * ng + 16 + 8 * h) : zero;
      half_accumulate(has_min, G, MR, acc, a0, a1, s0, s1, m0, m1, dx, e, k, b);
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
  }
  for (int r = 0; r < MR; ++r) memcpy(y + r * ldy, out[r], sizeof(float) * (size_t)valid);
}
#else
#define PACKED_PATH "portable"
#define SIGNED_8BIT 0
KERNEL tile_kernel(KERNEL_PARAMS, KERNEL_ARGS) {
  const pack_t f = {L, H, 128, has_min, G, KQ, NL};  // (off: only the levels' values read it)
  const int ng = 32 / G;
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < valid; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = tile + b * bb, *sc = blk + 64 * (L + H);
        const int8_t *xb = xq + r * k + b * 32;
        const float d = dx[r * (k / 32) + b];
        for (int h = 0; h < ng; ++h) {
          int32_t dot = 0;
          for (int v = G * h; v < G * h + G; ++v) dot += packed_value(blk, &f, j, v) * xb[v];
          const float ev = e[r * (k / G) + ng * b + h];
          float s, m = 0.f;
          const uint8_t *super = tile + nb * bb + b / 8 * SUPER_BYTES(has_min);
          if (KQ == 2) {
            s = f16(super + 2 * j) * (float)(int8_t)sc[TILE * h + j] * LEVEL_SCALE[NL];
          } else if (KQ) {
            s = f16(super + 2 * j) * (float)(sc[TILE * h + j] & 0xF);
            m = -(f16(super + 2 * (TILE + j)) * (float)(sc[TILE * h + j] >> 4));
          } else {
            s = f16(sc + 2 * (TILE * h + j));
            if (has_min) m = f16(sc + 2 * (TILE * (ng + h) + j));
          }
          if (has_min) acc += (float)dot * d * s + m * ev;
          else acc += ((float)dot * d + ev) * s;
        }
      }
      y[r * ldy + j] = acc;
    }
  }
}
#endif

#ifdef PROMPT_PATH
#define DECODED_ARGS                                                                     \
  const uint8_t *dec, int64_t nb, const int8_t *xq, int64_t k, const float *dx, const float *e, \
      float *y, int64_t ldy, int valid
typedef void (*decode_fn)(const uint8_t *, int64_t, int64_t, uint8_t *);
typedef void (*decoded_fn)(DECODED_ARGS);
#define PROMPT_FNS(NAME, L, H, HAS_MIN, G, KQ, NL)                                     \
  static void NAME##_decode(const uint8_t *tile, int64_t nb, int64_t bb, uint8_t *out) { \
    decode_tile(L, H, HAS_MIN, G, KQ, NL, tile, nb, bb, out);                          \
  }                                                                                    \
  static void NAME##_d4(DECODED_ARGS) {                                                \
    decoded_kernel(L, H, HAS_MIN, G, NL, 4, dec, nb, xq, k, dx, e, y, ldy, valid);     \
  }                                                                                    \
  static void NAME##_d1(DECODED_ARGS) {                                                \
    decoded_kernel(L, H, HAS_MIN, G, NL, 1, dec, nb, xq, k, dx, e, y, ldy, valid);     \
  }
#else
#define PROMPT_FNS(NAME, L, H, HAS_MIN, G, KQ, NL)
#endif

// A type's tile kernels for 4, 3, 2 and 1 activation rows: a product of 1-3 rows (a few
// streams decoding, a request's n-gram verification rows, the tokens one expert got) reads
// each tile's values once, not once per row. A row's result is the same whatever the count.
#define TILE_MR(NAME, MR, L, H, HAS_MIN, G, KQ, NL)                                       \
  static void NAME##_##MR(KERNEL_ARGS) {                                                  \
    tile_kernel(L, H, HAS_MIN, G, KQ, NL, MR, tile, nb, bb, xq, k, dx, e, y, ldy, valid); \
  }
#define TILE_FNS(NAME, L, H, HAS_MIN, G, KQ, NL) \
  TILE_MR(NAME, 4, L, H, HAS_MIN, G, KQ, NL)     \
  TILE_MR(NAME, 3, L, H, HAS_MIN, G, KQ, NL)     \
  TILE_MR(NAME, 2, L, H, HAS_MIN, G, KQ, NL)     \
  TILE_MR(NAME, 1, L, H, HAS_MIN, G, KQ, NL)     \
  PROMPT_FNS(NAME, L, H, HAS_MIN, G, KQ, NL)
TILE_FNS(tile_q4_0, 4, 0, 0, 32, 0, 0)
TILE_FNS(tile_q4_1, 4, 0, 1, 32, 0, 0)  // and Q4_K
TILE_FNS(tile_q8_0, 8, 0, 0, 32, 0, 0)
TILE_FNS(tile_q5_0, 4, 1, 0, 32, 0, 0)
TILE_FNS(tile_q5_1, 4, 1, 1, 32, 0, 0)  // and Q5_K
TILE_FNS(tile_q6_k, 4, 2, 0, 16, 2, 0)
TILE_FNS(tile_q3_k, 2, 1, 0, 16, 2, 0)
TILE_FNS(tile_q2_k, 2, 0, 1, 16, 1, 0)
TILE_FNS(tile_iq4, 4, 0, 0, 32, 0, NL_IQ4)  // IQ4_NL and IQ4_XS
TILE_FNS(tile_iq2, 2, 1, 0, 16, 2, NL_IQ2)  // IQ2_XXS, IQ2_XS, IQ2_S
TILE_FNS(tile_iq1, 2, 1, 0, 16, 2, NL_IQ1)  // IQ1_S, IQ1_M
TILE_FNS(tile_iq3_xxs, 4, 0, 0, 16, 2, NL_IQ3_XXS)
TILE_FNS(tile_iq3_s, 4, 0, 0, 16, 2, NL_IQ3_S)
TILE_FNS(tile_mxfp4, 4, 0, 0, 32, 0, NL_MXFP4)

typedef void (*tile_fn)(KERNEL_ARGS);
// The most activation rows one tile kernel takes; rows[r] of a type's kernels takes r.
#define MR_MAX 4
typedef struct {
  tile_fn rows[MR_MAX + 1];
} tile_fns_t;
// The kernel for the next `left` rows of a pass: MR_MAX of them, or the 1-3 at its end.
static inline tile_fn rows_kernel(const tile_fns_t *fn, int64_t left) {
  return fn->rows[left < MR_MAX ? left : MR_MAX];
}
// Activation rows a pass takes: their int8 copy (512 KB of k-value rows) stays in L2 while
// the weight tiles go by; a multiple of MR_MAX, so that each tile serves MR_MAX rows per load
// of its values until the 1-3 left at the end.
static int64_t pass_rows(int64_t k) {
  const int64_t pass = (1 << 19) / k / MR_MAX * MR_MAX;
  return pass < MR_MAX ? MR_MAX : pass;
}

static float offset_term(const pack_t *f) {
  if (f->has_min) return 1.f;
  return ((f->L == 8 || f->nl) && SIGNED_8BIT) ? 0.f : -(float)f->off;
}

// A type's kernels for 1 to MR_MAX activation rows.
static int tile_fns(int type, tile_fns_t *fn) {
#define PICK(NAME) *fn = (tile_fns_t){{NULL, NAME##_1, NAME##_2, NAME##_3, NAME##_4}}; return 1
  switch (type) {
    case T_Q4_0: PICK(tile_q4_0);
    case T_Q4_1:
    case T_Q4_K: PICK(tile_q4_1);
    case T_Q8_0: PICK(tile_q8_0);
    case T_Q5_0: PICK(tile_q5_0);
    case T_Q5_1:
    case T_Q5_K: PICK(tile_q5_1);
    case T_Q6_K: PICK(tile_q6_k);
    case T_Q3_K: PICK(tile_q3_k);
    case T_Q2_K: PICK(tile_q2_k);
    case T_IQ4_NL:
    case T_IQ4_XS: PICK(tile_iq4);
    case T_IQ2_XXS:
    case T_IQ2_XS:
    case T_IQ2_S: PICK(tile_iq2);
    case T_IQ1_S:
    case T_IQ1_M: PICK(tile_iq1);
    case T_IQ3_XXS: PICK(tile_iq3_xxs);
    case T_IQ3_S: PICK(tile_iq3_s);
    case T_MXFP4: PICK(tile_mxfp4);
  }
#undef PICK
  return 0;
}

// One pass's refined blocks (gguf_packed_matmul_refined, below): their int8 rows, scales and
// offset terms, and for each entry the pass's row and the block it refines.
typedef struct {
  tile_fns_t fn;
  const int8_t *xq;
  const float *dx, *e;
  const int64_t *row_of, *block_of;
  int64_t entries;
} refined_t;

// y [m, n] (row stride ldy: y is the pass's first row) += the refined blocks' products with
// tile t, while the tile and its outputs are in the cache.
static void refine_tile(const refined_t *rf, const uint8_t *tile, int64_t t, int valid,
                        int64_t bb, float *y, int64_t ldy) {
  float part[MR_MAX * TILE];
  for (int64_t p = 0; p < rf->entries;) {
    const int64_t b = rf->block_of[p];
    int rows = 1;  // the entries of block b from p on (they are consecutive), MR_MAX at most
    while (rows < MR_MAX && p + rows < rf->entries && rf->block_of[p + rows] == b) ++rows;
    rf->fn.rows[rows](tile + b * bb, 1, bb, rf->xq + p * 32, 32, rf->dx + p, rf->e + p, part,
                      TILE, valid);
    for (int q = 0; q < rows; ++q) {
      float *yr = y + rf->row_of[p + q] * ldy + t * TILE;
      for (int j = 0; j < valid; ++j) yr[j] += part[q * TILE + j];
    }
    p += rows;
  }
}

#ifdef PROMPT_PATH
// Rows from which a product decodes each tile once (see decode_tile): below, the decoding
// costs more than it saves. Types whose values take more than a shift and a mask (a high
// plane, the k-quants' factors, IQ4's levels) gain 5-40% at 16 rows and more; Q4_0, Q4_1,
// Q4_K and Q8_0 0-10% at 128 rows, and lose up to 20% at 16-32.
static int64_t prompt_rows(const pack_t *f) {
#ifdef PROMPT_ROWS
  (void)f;
  return PROMPT_ROWS;  // a build that sets it (benchmarks)
#else
  return f->H || f->kq || f->nl ? 16 : 128;
#endif
}

// A type's decoder and kernels on decoded tiles (4 rows, 1 row).
static int prompt_fns(int type, decode_fn *decode, decoded_fn *wide, decoded_fn *one) {
#define PICK(NAME) *decode = NAME##_decode, *wide = NAME##_d4, *one = NAME##_d1; return 1
  switch (type) {
    case T_Q4_0: PICK(tile_q4_0);
    case T_Q4_1:
    case T_Q4_K: PICK(tile_q4_1);
    case T_Q8_0: PICK(tile_q8_0);
    case T_Q5_0: PICK(tile_q5_0);
    case T_Q5_1:
    case T_Q5_K: PICK(tile_q5_1);
    case T_Q6_K: PICK(tile_q6_k);
    case T_Q3_K: PICK(tile_q3_k);
    case T_Q2_K: PICK(tile_q2_k);
    case T_IQ4_NL:
    case T_IQ4_XS: PICK(tile_iq4);
    case T_IQ2_XXS:
    case T_IQ2_XS:
    case T_IQ2_S: PICK(tile_iq2);
    case T_IQ1_S:
    case T_IQ1_M: PICK(tile_iq1);
    case T_IQ3_XXS: PICK(tile_iq3_xxs);
    case T_IQ3_S: PICK(tile_iq3_s);
    case T_MXFP4: PICK(tile_mxfp4);
  }
#undef PICK
  return 0;
}

// Rows [i0, i1) against every tile, each tile decoded once into a thread's scratch.
static void decoded_pass(int type, const pack_t *f, const uint8_t *packed, int64_t n,
                         int64_t k, const int8_t *xq, const float *dx, const float *e,
                         int64_t i0, int64_t i1, float *y, int64_t ldy, const refined_t *rf) {
  const int64_t nb = k / 32, bb = packed_block_bytes(f), tb = tile_bytes(f, nb);
  const int64_t tiles = (n + TILE - 1) / TILE, group = f->G;
  decode_fn decode;
  decoded_fn wide, one;
  prompt_fns(type, &decode, &wide, &one);
  const size_t scratch = (size_t)(nb * DECODED_BLOCK(f->has_min, f->G));
#pragma omp parallel
  {
    uint8_t *dec = aligned_alloc(64, (scratch + 63) / 64 * 64);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int valid = n - t * TILE < TILE ? (int)(n - t * TILE) : TILE;
      decode(packed + t * tb, nb, bb, dec);
      int64_t i = i0;
      for (; i + 4 <= i1; i += 4)
        wide(dec, nb, xq + i * k, k, dx + i * nb, e + i * (k / group), y + i * ldy + t * TILE,
             ldy, valid);
      for (; i < i1; ++i)
        one(dec, nb, xq + i * k, k, dx + i * nb, e + i * (k / group), y + i * ldy + t * TILE,
            ldy, valid);
      if (rf) refine_tile(rf, packed + t * tb, t, valid, bb, y + i0 * ldy, ldy);
    }
    free(dec);
  }
}
#endif

// Which integer path the library was built with: "avx512-vnni", "avx2" or "portable".
const char *gguf_packed_path(void) { return PACKED_PATH; }

// ------------------------------------------------------------------ refined outlier blocks
// Issue 49: q8_0's int8 activations cost the online q8_0 model of SmolLM2 +0.41% perplexity
// against its weights' own +0.12%. A few channels of the residual stream carry values 20-40
// times the others (SmolLM2's channel 199), so the 32-value block holding one is rounded at
// a step 20-40 times its neighbours' and holds 40-76% of a layer input's rounding error.
// gguf_packed_matmul_refined is gguf_packed_matmul plus a second int8 pass over each
// activation row's REFINE_BLOCKS blocks of largest max|x|: their rounding error
// (x - dx * xq, quantized again per 32 values) times the same weights' block, added. Such
// a block's activations are then exact to ~2^-14 of its max|x|, at REFINE_BLOCKS / (k / 32)
// more integer work (1/18 on a 576-wide layer). The pass runs the tile kernels on one
// block of a tile, so it takes the types whose blocks stand alone (32-value groups, no
// per-256 factors: Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0, IQ4_NL, IQ4_XS, MXFP4).
#define REFINE_BLOCKS 1

// Row i's `refine` blocks of largest max|x| (largest scale dx; first ones on ties), their
// rounding error x - dx * xq (xq, dx: the rows as quantize_blocks rounded them) in
// r [m * refine, 32], ordered by block (entries p of one block are consecutive, so 4 of them
// share a tile kernel's call).
static void refine_residuals(const float *x, const int8_t *xq, const float *dx, int64_t m,
                             int64_t k, int refine, float *r, int64_t *row_of,
                             int64_t *block_of) {
  const int64_t nb = k / 32, entries = m * refine;
  int64_t *chosen = malloc(sizeof(int64_t) * (size_t)entries);
  int64_t *count = calloc((size_t)nb + 1, sizeof(int64_t));
  for (int64_t i = 0; i < m; ++i) {
    const float *d = dx + i * nb;
    for (int c = 0; c < refine; ++c) {
      int64_t best = -1;
      for (int64_t b = 0; b < nb; ++b) {
        int taken = 0;
        for (int q = 0; q < c; ++q) taken |= chosen[i * refine + q] == b;
        if (!taken && (best < 0 || d[b] > d[best])) best = b;
      }
      chosen[i * refine + c] = best;
      count[best + 1]++;
    }
  }
  for (int64_t b = 0; b < nb; ++b) count[b + 1] += count[b];  // first entry of each block
  for (int64_t q = 0; q < entries; ++q) {
    const int64_t i = q / refine, b = chosen[q], p = count[b]++;
    const float *xb = x + i * k + b * 32, d = dx[i * nb + b];
    const int8_t *qb = xq + i * k + b * 32;
    for (int j = 0; j < 32; ++j) r[p * 32 + j] = xb[j] - (float)qb[j] * d;
    row_of[p] = i;
    block_of[p] = b;
  }
  free(chosen);
  free(count);
}

// y [m, n] = x [m, k] @ W^T with W packed (gguf_pack), the activations quantized to int8;
// with refine > 0 also each row's `refine` refined blocks (above). Row i of y starts at
// y + i * ldy (a fused layer's segments write into one output).
static int packed_matmul(int type, const uint8_t *packed, int64_t n, int64_t k, const float *x,
                         int64_t m, float *y, int64_t ldy, int refine) {
  pack_t f;
  tile_fns_t fn;
  if (!pack_info(type, &f) || !tile_fns(type, &fn) || k % 32) return 0;
  const int group = f.G;
  if (f.kq && k % 256) return 0;
  if (refine && (f.kq || group != 32)) return 0;  // the refined blocks must stand alone
  const int64_t nb = k / 32, bb = packed_block_bytes(&f), tb = tile_bytes(&f, nb);
  const int64_t tiles = (n + TILE - 1) / TILE;
  const float emul = offset_term(&f);
  int8_t *xq = malloc((size_t)(m * k));
  float *dx = malloc(sizeof(float) * (size_t)(m * nb));
  float *e = malloc(sizeof(float) * (size_t)(m * k / group));
  quantize_blocks(x, m, k, emul, group, xq, dx, e);
  const int64_t pass = pass_rows(k);
  if (refine > nb) refine = (int)nb;
  const int64_t most = (pass < m ? pass : m) * refine;  // refined entries of a pass
  float *r = NULL;
  int64_t *row_of = NULL, *block_of = NULL;
  int8_t *rq = NULL;
  float *rdx = NULL, *re = NULL;
  if (refine) {
    r = malloc(sizeof(float) * (size_t)(most * 32));
    row_of = malloc(sizeof(int64_t) * (size_t)most);
    block_of = malloc(sizeof(int64_t) * (size_t)most);
    rq = malloc((size_t)(most * 32));
    rdx = malloc(sizeof(float) * (size_t)most);
    re = malloc(sizeof(float) * (size_t)most);
  }
  refined_t rf = {fn, rq, rdx, re, row_of, block_of, 0};
  const refined_t *refined = refine ? &rf : NULL;
  for (int64_t i0 = 0; i0 < m; i0 += pass) {
    const int64_t i1 = i0 + pass < m ? i0 + pass : m;
    if (refine) {
      refine_residuals(x + i0 * k, xq + i0 * k, dx + i0 * nb, i1 - i0, k, refine, r, row_of,
                       block_of);
      rf.entries = (i1 - i0) * refine;
      quantize_blocks(r, rf.entries, 32, emul, 32, rq, rdx, re);
    }
#ifdef PROMPT_PATH
    if (i1 - i0 >= prompt_rows(&f)) {
      decoded_pass(type, &f, packed, n, k, xq, dx, e, i0, i1, y, ldy, refined);
      continue;
    }
#endif
#pragma omp parallel for schedule(static) if ((i1 - i0) * n * k > 32768)
    for (int64_t t = 0; t < tiles; ++t) {
      const int valid = n - t * TILE < TILE ? (int)(n - t * TILE) : TILE;
      const uint8_t *tile = packed + t * tb;
      for (int64_t i = i0; i < i1; i += MR_MAX)
        rows_kernel(&fn, i1 - i)(tile, nb, bb, xq + i * k, k, dx + i * nb, e + i * (k / group),
                                 y + i * ldy + t * TILE, ldy, valid);
      if (refined) refine_tile(refined, tile, t, valid, bb, y + i0 * ldy, ldy);
    }
  }
  free(xq);
  free(dx);
  free(e);
  free(r);
  free(row_of);
  free(block_of);
  free(rq);
  free(rdx);
  free(re);
  return 1;
}

int gguf_packed_matmul(int type, const uint8_t *packed, int64_t n, int64_t k, const float *x,
                       int64_t m, float *y, int64_t ldy) {
  return packed_matmul(type, packed, n, k, x, m, y, ldy, 0);
}

// gguf_packed_matmul plus the refined blocks: the same loops, each tile's refined blocks
// multiplied right after its product, while the tile and its outputs are in the cache.
int gguf_packed_matmul_refined(int type, const uint8_t *packed, int64_t n, int64_t k,
                               const float *x, int64_t m, float *y, int64_t ldy) {
  return packed_matmul(type, packed, n, k, x, m, y, ldy, REFINE_BLOCKS);
}

// ------------------------------------------------------------------ mixtures of experts
// A layer's experts in one call (llama.cpp's mul_mat_id, with the routing, the gating and
// the weighted sum): token t goes to the top_k experts ids[t, j] its router scores
// highest, with weights w[t, j] (route below), and
//   out[t] = sum_j w[t, j] * down(silu(gate(x[t])) * up(x[t]))     (expert ids[t, j]).
// gpt-oss's experts add biases to gate_up's and down's outputs, and gate with its clamped
// SwiGLU, (up + 1) * g * sigmoid(alpha * g), g and up clamped at limit (alpha > 0).
// The (token, choice) pairs are sorted by expert, so that each expert's tokens are one run
// of rows, and each product is one parallel loop over every run's weight tiles: a decode
// step's 8 experts are 2 thread teams, not 16, and no Python runs between them.
//
// Every expert's gate_up (and down) weight is the same segments of packed rows: segment s
// has type types[s], rows[s] output rows starting at output row off[s], and expert e's
// packed bytes at ptrs[e * nseg + s]. gate_up's outputs are [gate | up], 2 * inter wide.

typedef struct {
  int nseg;
  const int64_t *types, *rows, *off;
  const uint8_t *const *ptrs;
} experts_t;

// Activations quantized for one packed type: int8 values, block scales, and the per-group
// term e (which depends on the type's offset and group: one set per distinct pair).
typedef struct {
  float emul;
  int group;
  int8_t *xq;
  float *dx, *e;
} qrows_t;

static int stage_info(const experts_t *w, int64_t k, pack_t *f, tile_fns_t *fn) {
  for (int s = 0; s < w->nseg; ++s) {
    if (!pack_info((int)w->types[s], &f[s]) || !tile_fns((int)w->types[s], &fn[s])) return 0;
    if (k % 32 || (f[s].kq && k % 256)) return 0;
  }
  return 1;
}

// The rows of x (m rows of k) quantized for each segment's type, in the order `gather`
// gives (row r of the result is x's row gather[r]; none: x's own order), p rows.
static void quantize_for_stage(const experts_t *w, const pack_t *f, const float *x, int64_t m,
                               int64_t k, const int64_t *gather, int64_t p, qrows_t *q) {
  const int64_t nb = k / 32;
  for (int s = 0; s < w->nseg; ++s) {
    const float emul = offset_term(&f[s]);
    q[s] = (qrows_t){emul, f[s].G, NULL, NULL, NULL};
    int shared = -1;
    for (int u = 0; u < s; ++u)
      if (q[u].emul == emul && q[u].group == f[s].G) shared = u;
    if (shared >= 0) {
      q[s] = q[shared];
      continue;
    }
    const int64_t ng = k / f[s].G;
    int8_t *xq = malloc((size_t)(m * k));
    float *dx = malloc(sizeof(float) * (size_t)(m * nb));
    float *e = malloc(sizeof(float) * (size_t)(m * ng));
    quantize_blocks(x, m, k, emul, f[s].G, xq, dx, e);
    if (gather) {
      q[s].xq = malloc((size_t)(p * k));
      q[s].dx = malloc(sizeof(float) * (size_t)(p * nb));
      q[s].e = malloc(sizeof(float) * (size_t)(p * ng));
      for (int64_t r = 0; r < p; ++r) {
        memcpy(q[s].xq + r * k, xq + gather[r] * k, (size_t)k);
        memcpy(q[s].dx + r * nb, dx + gather[r] * nb, sizeof(float) * (size_t)nb);
        memcpy(q[s].e + r * ng, e + gather[r] * ng, sizeof(float) * (size_t)ng);
      }
      free(xq), free(dx), free(e);
    } else {
      q[s].xq = xq, q[s].dx = dx, q[s].e = e;
    }
  }
}

static void free_stage(const experts_t *w, qrows_t *q) {
  for (int s = 0; s < w->nseg; ++s) {
    int shared = 0;
    for (int u = 0; u < s; ++u) shared |= q[u].xq == q[s].xq;
    if (!shared) free(q[s].xq), free(q[s].dx), free(q[s].e);
  }
}

// Whether the segments are the rows [0, n) in order, each once.
static int covers(const experts_t *w, int64_t n) {
  int64_t at = 0;
  for (int s = 0; s < w->nseg; ++s) {
    if (w->off[s] != at || w->rows[s] <= 0) return 0;
    at += w->rows[s];
  }
  return at == n;
}

// y [p, ldy]: rows run_start[r] .. + run_count[r] by expert run_expert[r]'s segments. A run
// of a pass long enough for a prompt (prompt_rows) decodes each of its tiles once first,
// as gguf_packed_matmul does.
static void experts_stage(const experts_t *w, const pack_t *f, const tile_fns_t *fn, int64_t k,
                          const qrows_t *q, int64_t runs, const int64_t *run_expert,
                          const int64_t *run_start, const int64_t *run_count, int64_t max_count,
                          float *y, int64_t ldy) {
  const int64_t nb = k / 32;
  int64_t first_tile[8 + 1] = {0};  // segment s's tiles are [first_tile[s], first_tile[s + 1])
  for (int s = 0; s < w->nseg; ++s)
    first_tile[s + 1] = first_tile[s] + (w->rows[s] + TILE - 1) / TILE;
  const int64_t per_run = first_tile[w->nseg], items = runs * per_run;
#ifdef PROMPT_PATH
  decode_fn decode[8];
  decoded_fn pwide[8], pone[8];
  for (int s = 0; s < w->nseg; ++s) prompt_fns((int)w->types[s], &decode[s], &pwide[s], &pone[s]);
  const size_t scratch = (size_t)(nb * DECODED_BLOCK(1, 16));  // the largest decoded block
#endif
  const int64_t pass = pass_rows(k);
  for (int64_t i0 = 0; i0 < max_count; i0 += pass) {
#pragma omp parallel if (items * k > 32768)
    {
#ifdef PROMPT_PATH
      uint8_t *dec = NULL;
#endif
#pragma omp for schedule(static)
      for (int64_t item = 0; item < items; ++item) {
        const int64_t r = item / per_run, rt = item % per_run;
        if (run_count[r] <= i0) continue;
        int s = 0;
        while (rt >= first_tile[s + 1]) ++s;
        const int64_t t = rt - first_tile[s], n = w->rows[s];
        const int valid = n - t * TILE < TILE ? (int)(n - t * TILE) : TILE;
        const uint8_t *tile = w->ptrs[run_expert[r] * w->nseg + s] + t * tile_bytes(&f[s], nb);
        const int64_t bb = packed_block_bytes(&f[s]), ge = k / q[s].group;
        const int64_t end = run_start[r] + (run_count[r] < i0 + pass ? run_count[r] : i0 + pass);
        float *ys = y + w->off[s] + t * TILE;
        int64_t i = run_start[r] + i0;
#ifdef PROMPT_PATH
        if (end - i >= prompt_rows(&f[s])) {
          if (!dec) dec = aligned_alloc(64, (scratch + 63) / 64 * 64);
          decode[s](tile, nb, bb, dec);
          for (; i + 4 <= end; i += 4)
            pwide[s](dec, nb, q[s].xq + i * k, k, q[s].dx + i * nb, q[s].e + i * ge,
                     ys + i * ldy, ldy, valid);
          for (; i < end; ++i)
            pone[s](dec, nb, q[s].xq + i * k, k, q[s].dx + i * nb, q[s].e + i * ge, ys + i * ldy,
                    ldy, valid);
          continue;
        }
#endif
        for (; i < end; i += MR_MAX)
          rows_kernel(&fn[s], end - i)(tile, nb, bb, q[s].xq + i * k, k, q[s].dx + i * nb,
                                       q[s].e + i * ge, ys + i * ldy, ldy, valid);
      }
#ifdef PROMPT_PATH
      free(dec);
#endif
    }
  }
}

// Each token's top_k experts by router probability (a softmax in float32 over all
// experts), best first (the lower id of a tie), and their probabilities, renormalised to
// sum to 1 where asked, then times each chosen expert's scale where given (Gemma 4).
static void route(const float *logits, int64_t m, int64_t n_experts, int64_t top_k,
                  int renormalize, const float *expert_scale, int64_t *ids, float *w) {
  float *p = malloc(sizeof(float) * (size_t)n_experts);
  for (int64_t t = 0; t < m; ++t) {
    const float *l = logits + t * n_experts;
    float max = l[0], sum = 0.f;
    for (int64_t e = 1; e < n_experts; ++e) max = fmaxf(max, l[e]);
    for (int64_t e = 0; e < n_experts; ++e) sum += p[e] = expf(l[e] - max);
    for (int64_t e = 0; e < n_experts; ++e) p[e] /= sum;
    float chosen = 0.f;
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < n_experts; ++e)
        if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
      if (best < 0) best = j;  // NaN scores: any valid expert (the output is NaN anyway)
      ids[t * top_k + j] = best;
      chosen += w[t * top_k + j] = p[best];
      p[best] = -1.f;  // taken
    }
    if (renormalize)
      for (int64_t j = 0; j < top_k; ++j) w[t * top_k + j] /= chosen;
    if (expert_scale)
      for (int64_t j = 0; j < top_k; ++j) w[t * top_k + j] *= expert_scale[ids[t * top_k + j]];
  }
  free(p);
}

// x [m, hidden], router logits [m, n_experts] -> out [m, hidden]. Returns 0 (and writes
// nothing) for weights of an unsupported type or shape.
// gu_bias [n_experts, 2 * inter] and dn_bias [n_experts, hidden]: each expert's biases, or
// NULL. activation: MOE_SILU, silu(gate) * up; MOE_SWIGLU_OAI, gpt-oss's gating with alpha
// and limit; MOE_GELU_TANH, gelu(gate) * up with tanh's approximation (Gemma 4's).
// expert_scale [n_experts]: each expert's weight scale (see route), or NULL.
enum { MOE_SILU = 0, MOE_SWIGLU_OAI = 1, MOE_GELU_TANH = 2 };
int gguf_moe_forward(const float *x, int64_t m, int64_t hidden, int64_t inter,
                     const float *logits, int64_t n_experts, int64_t top_k, int renormalize,
                     int gu_nseg, const int64_t *gu_types, const int64_t *gu_rows,
                     const int64_t *gu_off, const uint8_t *const *gu_ptrs, int dn_nseg,
                     const int64_t *dn_types, const int64_t *dn_rows, const int64_t *dn_off,
                     const uint8_t *const *dn_ptrs, float *out, const float *gu_bias,
                     const float *dn_bias, int activation, float alpha, float limit,
                     const float *expert_scale) {
  const experts_t gu = {gu_nseg, gu_types, gu_rows, gu_off, gu_ptrs};
  const experts_t dn = {dn_nseg, dn_types, dn_rows, dn_off, dn_ptrs};
  pack_t gf[8], df[8];
  tile_fns_t gfn[8], dfn[8];
  if (gu_nseg < 1 || gu_nseg > 8 || dn_nseg < 1 || dn_nseg > 8) return 0;
  if (!stage_info(&gu, hidden, gf, gfn) || !stage_info(&dn, inter, df, dfn)) return 0;
  if (!covers(&gu, 2 * inter) || !covers(&dn, hidden) || top_k < 1 || top_k > n_experts)
    return 0;
  const int64_t p = m * top_k;
  int64_t *ids = malloc(sizeof(int64_t) * (size_t)p);
  float *w = malloc(sizeof(float) * (size_t)p);
  route(logits, m, n_experts, top_k, renormalize, expert_scale, ids, w);
  // The pairs sorted by expert, stably (a counting sort): pair i is row row_of[i].
  const size_t e_bytes = sizeof(int64_t) * (size_t)n_experts, p_bytes = sizeof(int64_t) * (size_t)p;
  int64_t *count = calloc((size_t)n_experts, sizeof(int64_t)), *start = malloc(e_bytes);
  int64_t *row_of = malloc(p_bytes), *token = malloc(p_bytes), *expert_of = malloc(p_bytes);
  for (int64_t i = 0; i < p; ++i) ++count[ids[i]];
  int64_t runs = 0, max_count = 0;
  for (int64_t e = 0, at = 0; e < n_experts; ++e) {
    start[e] = at, at += count[e];
    runs += count[e] > 0;
    if (count[e] > max_count) max_count = count[e];
  }
  const size_t r_bytes = sizeof(int64_t) * (size_t)runs;
  int64_t *run_expert = malloc(r_bytes), *run_start = malloc(r_bytes), *run_count = malloc(r_bytes);
  for (int64_t e = 0, r = 0; e < n_experts; ++e)
    if (count[e]) run_expert[r] = e, run_start[r] = start[e], run_count[r] = count[e], ++r;
  for (int64_t i = 0; i < p; ++i) {
    const int64_t r = start[ids[i]]++;
    row_of[i] = r, token[r] = i / top_k, expert_of[r] = ids[i];
  }
  // gate_up on each pair's token (plus its expert's bias), then the gating, then down.
  qrows_t q[8];
  float *gate_up = malloc(sizeof(float) * (size_t)(p * 2 * inter));
  quantize_for_stage(&gu, gf, x, m, hidden, token, p, q);
  experts_stage(&gu, gf, gfn, hidden, q, runs, run_expert, run_start, run_count, max_count,
                gate_up, 2 * inter);
  free_stage(&gu, q);
  float *act = malloc(sizeof(float) * (size_t)(p * inter));
#pragma omp parallel for schedule(static) if (p * inter > 65536)
  for (int64_t r = 0; r < p; ++r) {
    float *g = gate_up + r * 2 * inter, *u = g + inter, *a = act + r * inter;
    if (gu_bias) {
      const float *b = gu_bias + expert_of[r] * 2 * inter;
      for (int64_t j = 0; j < 2 * inter; ++j) g[j] += b[j];
    }
    if (activation == MOE_SWIGLU_OAI) {
      for (int64_t j = 0; j < inter; ++j) {
        const float gj = fminf(g[j], limit), uj = fminf(fmaxf(u[j], -limit), limit);
        a[j] = (uj + 1.f) * (gj / (1.f + expf(-alpha * gj)));
      }
    } else if (activation == MOE_GELU_TANH) {
      for (int64_t j = 0; j < inter; ++j) {
        const float gj = g[j], inner = 0.7978845608028654f * (gj + 0.044715f * gj * gj * gj);
        a[j] = 0.5f * gj * (1.f + tanhf(inner)) * u[j];
      }
    } else {
      for (int64_t j = 0; j < inter; ++j) a[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    }
  }
  free(gate_up);
  float *down = malloc(sizeof(float) * (size_t)(p * hidden));
  quantize_for_stage(&dn, df, act, p, inter, NULL, p, q);
  experts_stage(&dn, df, dfn, inter, q, runs, run_expert, run_start, run_count, max_count,
                down, hidden);
  free_stage(&dn, q);
  free(act);
  if (dn_bias)
#pragma omp parallel for schedule(static) if (p * hidden > 65536)
    for (int64_t r = 0; r < p; ++r) {
      const float *b = dn_bias + expert_of[r] * hidden;
      for (int64_t c = 0; c < hidden; ++c) down[r * hidden + c] += b[c];
    }
  // Each token's weighted sum, its choices in order.
#pragma omp parallel for schedule(static) if (m * hidden * top_k > 65536)
  for (int64_t t = 0; t < m; ++t) {
    float *o = out + t * hidden;
    for (int64_t c = 0; c < hidden; ++c) o[c] = 0.f;
    for (int64_t j = 0; j < top_k; ++j) {
      const float wj = w[t * top_k + j], *d = down + row_of[t * top_k + j] * hidden;
      for (int64_t c = 0; c < hidden; ++c) o[c] += wj * d[c];
    }
  }
  free(down), free(count), free(start), free(row_of), free(token), free(ids), free(w);
  free(expert_of);
  free(run_expert), free(run_start), free(run_count);
  return 1;
}

// ------------------------------------------------------------------ replayed decode steps
// The twins a CPU graph calls through cpu_kernels.c's run_calls: the arguments as one array
// of 64-bit slots (a pointer or an integer as it is, a float as a double's bits).
static inline float f32_slot(int64_t slot) {
  double d;
  memcpy(&d, &slot, sizeof d);
  return (float)d;
}
#define PTR(T, slot) ((T)(intptr_t)(slot))

void gguf_packed_matmul_slots(const int64_t *a) {
  gguf_packed_matmul((int)a[0], PTR(const uint8_t *, a[1]), a[2], a[3],
                     PTR(const float *, a[4]), a[5], PTR(float *, a[6]), a[7]);
}

void gguf_moe_forward_slots(const int64_t *a) {
  gguf_moe_forward(PTR(const float *, a[0]), a[1], a[2], a[3], PTR(const float *, a[4]), a[5],
                   a[6], (int)a[7], (int)a[8], PTR(const int64_t *, a[9]),
                   PTR(const int64_t *, a[10]), PTR(const int64_t *, a[11]),
                   PTR(const uint8_t *const *, a[12]), (int)a[13], PTR(const int64_t *, a[14]),
                   PTR(const int64_t *, a[15]), PTR(const int64_t *, a[16]),
                   PTR(const uint8_t *const *, a[17]), PTR(float *, a[18]),
                   PTR(const float *, a[19]), PTR(const float *, a[20]), (int)a[21],
                   f32_slot(a[22]), f32_slot(a[23]), PTR(const float *, a[24]));
}

void gguf_packed_matmul_refined_slots(const int64_t *a) {
  gguf_packed_matmul_refined((int)a[0], PTR(const uint8_t *, a[1]), a[2], a[3],
                             PTR(const float *, a[4]), a[5], PTR(float *, a[6]), a[7]);
}
