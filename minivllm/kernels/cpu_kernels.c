// Paged attention for the CPU, float32: each query token attends over its request's KV
// blocks read in place from the paged cache (no gathered copy); a prompt's tokens go in
// tiles that share each block's loads. Called through ctypes;
// the batch is split over OpenMP threads. Built with -fopenmp, the library names
// libgomp.so.1, which resolves to the copy torch has already loaded: one thread pool, the
// one torch's GEMMs use, so its threads never spin against ours.
//
// Layouts (see cpu.py): a key block is stored transposed, [Hkv, D, block_size], so a
// block's scores are block_size-wide vector FMAs with no horizontal sums; a value block is
// [Hkv, block_size, D], so the weighted sum is D-wide vector FMAs and a KV head's rows of a
// block are one run of memory (int8's rows of D + 4 bytes, [block_size, Hkv, D + 4] before,
// each straddled two cache lines, shared with the next head's row, which the other thread
// read: LFM2's 4k int8 decode call, 32/8 heads of 64, took 164 us against 150 now).
//
// The common shapes (block_size 16, head_dim 64, 128 or 256, Gemma 3's) have a path written
// with GCC/Clang vector types, whose accumulators stay in registers; other shapes take a
// plain loop.
//
// Sliding-window layers pass each sequence's first attended position (`starts`): blocks
// wholly before it are skipped, and the softmax and the weighted sum begin at it.
// Soft-capped layers (Gemma 2) pass their cap c: scores become c * tanh(s / c) first.
// gpt-oss passes each head's attention sink, a logit that joins the softmax's denominator.
//
// The cache may be 8-bit (--kv-cache-dtype; attention/kv_quant.py): its values are widened
// to floats as they are loaded, in registers, never into a copy of a block. int8 keeps a
// float32 scale after each (token, KV head)'s D values, so a head row is D + 4 bytes (a key
// block's head: [D, block_size] bytes, then block_size scales; a value row: D bytes, then
// its scale): a block's scores are the integers' dot products times the keys' scales, and each
// value's scale is folded into its softmax weight before the weighted sum. fp8 (e4m3fn,
// e5m2) keys and values are read with scale 1 (KV_E4M3, KV_E5M2). fp16k_int8v keeps keys in
// float16 and values as int8's rows, a block's keys and values side by side (its keys
// [Hkv, D, block_size] halves, then its values [Hkv, block_size, D + 4] bytes; the caller
// passes the first block's keys and values, each block_stride bytes apart, see
// kv_block_stride); fp16k_e4m3v and fp16k_e5m2v are the same with fp8 values in place of
// int8, scaled per row as int8's (the scale after the row's D bytes).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// The kernels' accumulators are vectors of the CPU's own width, VL floats: GCC lowers a
// wider vector type to pieces through the stack, and 64-byte accumulators on an AVX2 CPU
// (16 registers of 8 floats) ran attention at 2 Gflop/s. A tile's shape is picked per width
// so its accumulators fit the registers: 32 on AVX-512, 16 on AVX2.
#ifndef VL  // (a build may set it: the tests run the other width's shapes too)
#ifdef __AVX512F__
#define VL 16
#else
#define VL 8
#endif
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
typedef float vfu __attribute__((vector_size(4 * VL), aligned(4)));  // any float address

static inline vf loadv(const float *p) { return *(const vfu *)p; }
static inline void storev(float *p, vf x) { *(vfu *)p = x; }

// Every query row is computed by the same sequence of operations whether it is alone (a
// decode), in a tile of a prompt's rows or in a tile of a differently chunked prompt: a score
// is one FMA chain over d, the softmax sees the same 64-byte-aligned row, a value sum is one
// FMA chain over t in order. Tiles only interleave rows, so a token's result never depends
// on how its prompt was split into steps. Reassociation is off so the compiler cannot
// reorder one chain differently in two places.
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")
// Macros, not the functions above: GCC inlines no function across differing optimize
// options, and a call per vector load costs more than the arithmetic.
#define LOADV(p) (*(const vfu *)(p))
#define STOREV(p, x) (*(vfu *)(p) = (x))

// Softmax in place over the first len scores of a head, soft-capped first if cap > 0;
// sink: the head's attention sink (gpt-oss), a logit in the denominator with no value, or
// -INFINITY for none (its exp is then 0, and the sum the same bit for bit).
static void softmax(float *s, int64_t len, float cap, float sink) {
  if (cap > 0.f)
    for (int64_t t = 0; t < len; ++t) s[t] = tanhf(s[t] / cap) * cap;
  float m = sink;
  for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
  for (int64_t t = 0; t < len; ++t) s[t] = expf(s[t] - m);  // libmvec's vector expf
  vf acc = {0};
  int64_t t = 0;
  for (; t + VL <= len; t += VL) acc += LOADV(s + t);
  float sum = 0.f;
  for (int i = 0; i < VL; ++i) sum += acc[i];
  for (; t < len; ++t) sum += s[t];
  sum += expf(sink - m);
  const float inv = 1.f / sum;
  for (t = 0; t < len; ++t) s[t] *= inv;
}

// What a cache holds (attention/kv_quant.py's codes, KV_F32 to KV_F16_E5M2): the type of its
// keys and of its values (KEY_EL, VAL_EL: the same but for the float16-key caches' keys,
// element type KV_F16, and their fp8 values, scaled per row: KV_E4M3S, KV_E5M2S; these three
// are no cache's code). The functions below that take `kt` (a cache type) or an element
// type are always inlined, into one copy per type (the wrappers made by DEFINE_FOR_TYPES),
// where it is a constant and its branches fold away.
enum {
  KV_F32 = 0, KV_I8 = 1, KV_E4M3 = 2, KV_E5M2 = 3, KV_F16_I8 = 4, KV_F16_E4M3 = 5,
  KV_F16_E5M2 = 6, KV_NUM_TYPES = 7, KV_F16 = 8, KV_E4M3S = 9, KV_E5M2S = 10
};
#define KV_F16_KEYS(kt) ((kt) >= KV_F16_I8 && (kt) <= KV_F16_E5M2)
#define KEY_EL(kt) (KV_F16_KEYS(kt) ? KV_F16 : (kt))
#define VAL_EL(kt)                  \
  ((kt) == KV_F16_I8     ? KV_I8    \
   : (kt) == KV_F16_E4M3 ? KV_E4M3S \
   : (kt) == KV_F16_E5M2 ? KV_E5M2S \
                         : (kt))
#define KV_IS_E4M3(el) ((el) == KV_E4M3 || (el) == KV_E4M3S)
// a float32 scale per (token, KV head)
#define KV_SCALED(el) ((el) == KV_I8 || (el) == KV_E4M3S || (el) == KV_E5M2S)
#define KV_EXTRA(el) (KV_SCALED(el) ? 4 : 0)  // bytes after a head row's D values
// Float16 keys: bytes of a (token, KV head)'s key and value, 2 D + D + 4, even.
#define KV_PAIR_BYTES(D) ((3 * (D) + 5) / 2 * 2)
#define INLINE static inline __attribute__((always_inline))
typedef int32_t vi32 __attribute__((vector_size(4 * VL)));
typedef uint32_t vu32 __attribute__((vector_size(4 * VL)));

// VL 8-bit elements at p widened to 32-bit lanes, signed (int8) or not (fp8 bits). GCC 12
// turns __builtin_convertvector of an 8-bit vector into a scalar load and insert per lane
// (the int8 cache's decode read took twice the float32 cache's time at 8k tokens), so the
// x86 paths name the widening instruction; other CPUs and the plain C build take the loop.
#if VL == 16 && defined(__AVX512F__)
#define WIDEN8(p, ext) ((vi32)_mm512_##ext##_epi32(_mm_loadu_si128((const __m128i *)(p))))
#elif VL == 8 && defined(__AVX2__)
#define WIDEN8(p, ext) ((vi32)_mm256_##ext##_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif
INLINE vi32 widen_i8(const int8_t *p) {
#ifdef WIDEN8
  return WIDEN8(p, cvtepi8);
#else
  vi32 r;
  for (int i = 0; i < VL; ++i) r[i] = p[i];
  return r;
#endif
}
INLINE vu32 widen_u8(const uint8_t *p) {
#ifdef WIDEN8
  return (vu32)WIDEN8(p, cvtepu8);
#else
  vu32 r;
  for (int i = 0; i < VL; ++i) r[i] = p[i];
  return r;
#endif
}
// float16 to float: the sign, exponent and mantissa put in a float32's fields, times
// 2^(127 - 15) (which makes float16's subnormals normal too); exact, as vcvtph2ps, which the
// x86 paths use (AVX-512, or F16C with AVX2).
#define F16_BITS(x) ((((x) & 0x8000u) << 16) | (((x) & 0x7FFFu) << 13))
INLINE vf widen_f16(const uint16_t *p) {
#if VL == 16 && defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif VL == 8 && defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
  vu32 x;
  for (int i = 0; i < VL; ++i) x[i] = p[i];
  return (vf)F16_BITS(x) * 0x1p112f;
#endif
}

// Element i of a cache's keys or values (el: their element type: floats, halves or bytes),
// as an address.
INLINE const void *kv_at(const void *base, int64_t i, int el) {
  return el == KV_F32   ? (const void *)((const float *)base + i)
         : el == KV_F16 ? (const void *)((const uint16_t *)base + i)
                        : (const void *)((const uint8_t *)base + i);
}
// Elements (of KEY_EL or VAL_EL) from a block's keys or values to the next block's: a block
// is block_size tokens of Hkv head rows of D values (and int8's scale), or for
// the float16-key caches KV_PAIR_BYTES(D) bytes a (token, KV head), its keys and values
// together.
INLINE int64_t kv_block_stride(int kt, int keys, int64_t Hkv, int64_t D, int64_t bs) {
  if (KV_F16_KEYS(kt)) return Hkv * bs * KV_PAIR_BYTES(D) / (keys ? 2 : 1);
  return Hkv * bs * (D + KV_EXTRA(kt));
}
// The float32 at byte i of a quantized cache (a row's scale).
#define KV_SCALE(base, i) ((const float *)((const uint8_t *)(base) + (i)))
// fp8 to float: the sign, exponent and mantissa bits put in a float32's fields (a float with
// the fp8's exponent bias), then scaled by 2^(127 - bias), which also makes the fp8's
// subnormals normal. No lookup table: the vector version is four integer ops and a multiply.
#define E4M3_BITS(x) ((((x) & 0x80u) << 24) | (((x) & 0x7Fu) << 20))
#define E5M2_BITS(x) ((((x) & 0x80u) << 24) | (((x) & 0x7Fu) << 21))
// VL elements of type el from element i, as floats (a row's scale not applied).
INLINE vf load_kv(const void *base, int64_t i, int el) {
  if (el == KV_F32) return LOADV((const float *)base + i);
  if (el == KV_F16) return widen_f16((const uint16_t *)base + i);
  if (el == KV_I8) return __builtin_convertvector(widen_i8((const int8_t *)base + i), vf);
  const vu32 x = widen_u8((const uint8_t *)base + i);
  if (KV_IS_E4M3(el)) return (vf)E4M3_BITS(x) * 0x1p120f;
  return (vf)E5M2_BITS(x) * 0x1p112f;
}
INLINE float load_kv1(const void *base, int64_t i, int el) {
  if (el == KV_F32) return ((const float *)base)[i];
  if (el == KV_I8) return ((const int8_t *)base)[i];
  const uint32_t x = el == KV_F16 ? ((const uint16_t *)base)[i] : ((const uint8_t *)base)[i];
  const uint32_t bits = el == KV_F16 ? F16_BITS(x) : KV_IS_E4M3(el) ? E4M3_BITS(x) : E5M2_BITS(x);
  float f;
  memcpy(&f, &bits, sizeof f);
  return f * (KV_IS_E4M3(el) ? 0x1p120f : 0x1p112f);
}

// A prompt's rows are attended in tiles of up to TILE rows of one request (consecutive
// positions), one KV head at a time: a key block is loaded once for every row and query
// head of the tile, a value row once for up to PV_PAIRS (row, head) pairs. Enough
// independent FMA chains are in flight to keep both FMA units busy; a lone decode row gets
// its chains from several blocks and from its query heads that share the KV head. On the
// prompt-heavy workload (128 prompts of 256-1024 tokens, SmolLM2-135M) the run went from
// 66.9 s to 54.8 s, attention from ~30% of it to ~20%; value passes of 6 pairs instead of
// 4 (head_dim 64) took another ~3% off it.
#define TILE 8

// Scores of N query vectors against NB key blocks ([D, 16] each, transposed):
// s[i * s_step + 16 * j + 0..15] = q_i . k_j, for blocks at kb[j]; pre: the block after.
// A block's 16 scores are BV vectors; vector j of the accumulators is block j / BV's.
// int8: the dot products of the integers, times each key's scale (after the D * 16 bytes).
// pre: the NB blocks after, prefetched a line of each as the loop enters a line of its own
// blocks, so the next call's keys are on their way during the whole of this one (a 4k int8
// decode's key pass reads 4 blocks' 16 bytes a step of d: prefetching one block of the 4
// left three quarters of the keys to the hardware's prefetch across block boundaries).
#define BV (16 / VL)
#define LINE_EL(el) ((el) == KV_F32 ? 16 : (el) == KV_F16 ? 32 : 64)  // elements a 64-byte line
#define DEFINE_QK(NAME, N, NB)                                                                \
  INLINE void NAME(const float *q, int64_t q_step, const void *const *kb,                     \
                   const void *const *pre, int64_t D, float *s, int64_t s_step, int kt) {     \
    vf acc[N][NB * BV];                                                                       \
    for (int i = 0; i < N; ++i)                                                               \
      for (int j = 0; j < NB * BV; ++j) acc[i][j] = (vf){0};                                  \
    if (KV_SCALED(kt))                                                                        \
      for (int j = 0; j < NB; ++j) __builtin_prefetch(kv_at(pre[j], D * 16, kt));             \
    for (int64_t d = 0; d < D; ++d) {                                                         \
      if (d * 16 % LINE_EL(kt) == 0)                                                          \
        for (int j = 0; j < NB; ++j) __builtin_prefetch(kv_at(pre[j], d * 16, kt));          \
      for (int j = 0; j < NB * BV; ++j) {                                                     \
        const vf kv = load_kv(kb[j / BV], d * 16 + j % BV * VL, kt);                          \
        for (int i = 0; i < N; ++i) acc[i][j] += q[i * q_step + d] * kv;                      \
      }                                                                                       \
    }                                                                                         \
    for (int i = 0; i < N; ++i)                                                               \
      for (int j = 0; j < NB * BV; ++j) {                                                     \
        vf r = acc[i][j];                                                                     \
        if (KV_SCALED(kt)) r *= LOADV(KV_SCALE(kb[j / BV], D * 16) + j % BV * VL);            \
        STOREV(s + i * s_step + VL * j, r);                                                   \
      }                                                                                       \
  }
// The tile shapes (N rows, NB blocks at a time): qk_N_wide, and its one-block twin qk_N_one
// for the table's last blocks; a call takes up to QK_ROWS rows.
#if VL == 16
#define QK_SHAPES(X) X(1, 8) X(2, 4) X(3, 4) X(4, 4) X(5, 2) X(6, 2) X(7, 2) X(8, 2)
#define QK_ROWS 8
#else
#define QK_SHAPES(X) X(1, 4) X(2, 2) X(3, 2) X(4, 1) X(5, 1) X(6, 1)
#define QK_ROWS 6
#endif
#define DEFINE_QK_PAIR(N, NB) DEFINE_QK(qk_##N##_wide, N, NB) DEFINE_QK(qk_##N##_one, N, 1)
QK_SHAPES(DEFINE_QK_PAIR)

// Blocks [b, end) of the table for n query vectors (n <= QK_ROWS): NB blocks at a time,
// then one at a time. k and block_stride count elements (floats, or bytes when quantized).
// The blocks after each call's are prefetched up to `last` (the table's end, past this
// span of blocks: the next span's first blocks are read next; past the end, the last one).
#define QK_BLOCKS(N, NB)                                                                      \
  case N:                                                                                     \
    for (; b + NB <= end; b += NB) {                                                          \
      for (int j = 0; j < NB; ++j) {                                                          \
        kb[j] = kv_at(k, table[b + j] * block_stride, kt);                                    \
        const int64_t a = b + NB + j < last ? b + NB + j : last - 1;                          \
        pre[j] = kv_at(k, table[a] * block_stride, kt);                                       \
      }                                                                                       \
      qk_##N##_wide(q, q_step, kb, pre, D, s + b * 16, s_step, kt);                           \
    }                                                                                         \
    for (; b < end; ++b) {                                                                    \
      kb[0] = kv_at(k, table[b] * block_stride, kt);                                          \
      pre[0] = kv_at(k, table[b + 1 < last ? b + 1 : last - 1] * block_stride, kt);           \
      qk_##N##_one(q, q_step, kb, pre, D, s + b * 16, s_step, kt);                            \
    }                                                                                         \
    break;
INLINE void qk_rows(int64_t n, const float *q, int64_t q_step, const void *k,
                    const int64_t *table, int64_t block_stride, int64_t b, int64_t end,
                    int64_t last, int64_t D, float *s, int64_t s_step, int kt) {
  const void *kb[8], *pre[8];
  switch (n) { QK_SHAPES(QK_BLOCKS) }
}

// Any n rows, QK_ROWS at a time (each row's scores are the same FMA chains in any group),
// over spans of 8 blocks that stay in the cache while every group of rows reads them.
INLINE void qk_blocks(int64_t n, const float *q, int64_t q_step, const void *k,
                      const int64_t *table, int64_t block_stride, int64_t b, int64_t end,
                      int64_t D, float *s, int64_t s_step, int kt) {
  for (int64_t b0 = b; b0 < end; b0 += 8)
    for (int64_t r = 0; r < n; r += QK_ROWS)
      qk_rows(n - r < QK_ROWS ? n - r : QK_ROWS, q + r * q_step, q_step, k, table,
              block_stride, b0, end - b0 < 8 ? end : b0 + 8, end, D, s + r * s_step, s_step,
              kt);
}
// One copy per cache type, shared by every head_dim's tile (compile time: the score shapes
// are most of the code).
#define DEFINE_QK_FOR_TYPE(SUF, KT)                                                          \
  static void qk_blocks_##SUF(int64_t n, const float *q, int64_t q_step, const void *k,      \
                              const int64_t *table, int64_t block_stride, int64_t b,         \
                              int64_t end, int64_t D, float *s, int64_t s_step) {            \
    qk_blocks(n, q, q_step, k, table, block_stride, b, end, D, s, s_step, KT);              \
  }
DEFINE_QK_FOR_TYPE(f32, KV_F32)
DEFINE_QK_FOR_TYPE(i8, KV_I8)
DEFINE_QK_FOR_TYPE(e4m3, KV_E4M3)
DEFINE_QK_FOR_TYPE(e5m2, KV_E5M2)
DEFINE_QK_FOR_TYPE(f16, KV_F16)
#define QK_BLOCKS_FOR(el)                                           \
  ((el) == KV_F32    ? qk_blocks_f32                                \
   : (el) == KV_I8   ? qk_blocks_i8                                 \
   : (el) == KV_E4M3 ? qk_blocks_e4m3                               \
   : (el) == KV_F16  ? qk_blocks_f16                                \
                     : qk_blocks_e5m2)

// o[i] += sum over t in [lo, hi) of p[i][t] * v_t, in the order of t, for N (row, head)
// pairs of one KV head; v: that head's values (the cache offset to its rows of the first
// block; a block's 16 rows of the head are consecutive), block_size 16. The
// head's D values go in chunks of PV_CHUNK, whose N x PV_CHUNK / VL accumulators stay in
// registers; a value row is loaded once per chunk for every pair, the chunks of a span of 64
// positions one after the other while its values stay in the cache. int8 values: each
// weight times the value's scale (the float after its D bytes) as the row is read, so the
// weighted sum of the integers is the weighted sum of the values (scaled fp8 values too).
// (A pass over the weights before, reading each scale once per pair, was half the int8
// decode's attention time: its scattered loads missed the cache, once for every query head
// of the group.)
// AVX-512, head_dim 256: a pair's whole row is 16 accumulators, so more pairs take the row in
// chunks (4 pairs x 64 values: 16 again) and a value row is widened once for 4 query heads,
// not once per head (one stream's int8 decode at 4k positions, Qwen3.5's 8 heads over 2:
// each KV head's values were read and widened 4 times).
#if VL == 16
#define PV_CHUNK(N, D) ((D) < 256 || (N) == 1 ? (D) : (N) == 2 ? 128 : 64)
#define PV_PAIRS_64 6
#define PV_PAIRS_128 2
#define PV_PAIRS_256 4
#else
#define PV_CHUNK(N, D) ((N) == 1 ? 64 : (N) <= 3 ? 32 : 16)
#define PV_PAIRS_64 6
#define PV_PAIRS_128 6
#define PV_PAIRS_256 6
#endif
// The rows of the next span of 64 positions are prefetched as this span's are read, each
// chunk the lines of its own part of the rows: a block's last row of a KV head is far from
// the next block's first (and the rows were Hkv rows apart before the head-major value
// blocks), jumps the hardware's prefetch left to wait on memory (a 4k-token int8 decode
// spent most of its value pass waiting for value rows). Only the first chunk prefetched
// before (16 rows on): the span's later chunks, three quarters of a 4-head pass at head_dim
// 256, read the cache with nothing on its way.
// Byte values 128 positions ahead, not 64: 64 positions of a 64-wide head are ~1k FMAs of a
// 4-pair pass, less time than memory takes to answer (one stream's fp16k_int8v decode at 4k
// positions, Zen 5, 2 threads, loaded machine, attention_kernel.py 5 times alternated,
// medians: LFM2's 32/8 heads of 64 397 -> 324 us, 16.2 -> 19.8 GB/s; Qwen3.5's 8/2 of 256
// 271 -> 253 us; its int8k_int8v 213 -> 201 us). 96 gained less, 192 as much, 256 less; the
// key pass's distance (the next call's blocks) at 2 or 4 calls ahead gained nothing. Float
// values stay at 64 (as many lines ahead as 128 byte rows): at 128, 64 float32 rows at 512
// positions with head_dim 64 took x1.06 the time (4 alternated runs).
#define PV_AHEAD(kt) (LINE_EL(kt) == 64 ? 128 : 64)
#define DEFINE_PV(N, D)                                                                       \
  INLINE void pv_##N##_##D(float *const *p, float *const *o, const void *v,                  \
                           const int64_t *table, int64_t block_stride, int64_t lo,            \
                           int64_t hi, int kt) {                                              \
    enum { C = PV_CHUNK(N, D) };                                                              \
    const int64_t token_stride = D + KV_EXTRA(kt); /* a head's rows of a block: one run */    \
    for (int64_t a = lo; a < hi && a < lo + PV_AHEAD(kt); ++a) { /* the first span's rows */  \
      const int64_t row = table[a / 16] * block_stride + (a % 16) * token_stride;             \
      for (int64_t e = 0; e < D + KV_EXTRA(kt); e += LINE_EL(kt))                             \
        __builtin_prefetch(kv_at(v, row + e, kt));                                            \
      __builtin_prefetch(kv_at(v, row + D + KV_EXTRA(kt) - 1, kt));                           \
    }                                                                                         \
    for (int64_t t0 = lo; t0 < hi; t0 += 64) {                                                \
      const int64_t t1 = hi - t0 < 64 ? hi : t0 + 64;                                         \
      /* The span's weights (times each row's scale) once, not once per chunk: the chunks' \
         FMAs then take them from memory as broadcasts, with no scalar work between. */    \
      float ws[N][64];                                                                        \
      for (int64_t t = t0; t < t1; ++t) {                                                     \
        const int64_t row = table[t / 16] * block_stride + (t % 16) * token_stride;           \
        const float scale = KV_SCALED(kt) ? *KV_SCALE(v, row + D) : 1.f;                      \
        for (int i = 0; i < N; ++i) ws[i][t - t0] = KV_SCALED(kt) ? p[i][t] * scale : p[i][t]; \
      }                                                                                       \
      for (int c = 0; c < D; c += C) {                                                        \
        vf acc[N][C / VL];                                                                    \
        for (int i = 0; i < N; ++i)                                                           \
          for (int j = 0; j < C / VL; ++j) acc[i][j] = LOADV(o[i] + c + VL * j);              \
        for (int64_t t = t0; t < t1; ++t) {                                                   \
          const int64_t row = table[t / 16] * block_stride + (t % 16) * token_stride;         \
          if (t + PV_AHEAD(kt) < hi) {                                                            \
            /* the lines that start in this chunk, and with the last chunk the row's tail \
               (its scale; any row of D + 4 bytes spans at most one more line) */          \
            const int64_t a = t + PV_AHEAD(kt), L = LINE_EL(kt);                                  \
            const int64_t next = table[a / 16] * block_stride + (a % 16) * token_stride;      \
            for (int64_t e = (c + L - 1) / L * L; e < c + C; e += L)                          \
              __builtin_prefetch(kv_at(v, next + e, kt));                                     \
            if (c + C == D) __builtin_prefetch(kv_at(v, next + D + KV_EXTRA(kt) - 1, kt));    \
          }                                                                                   \
          for (int j = 0; j < C / VL; ++j) {                                                  \
            const vf vj = load_kv(v, row + c + VL * j, kt);                                   \
            for (int i = 0; i < N; ++i) acc[i][j] += ws[i][t - t0] * vj;                      \
          }                                                                                   \
        }                                                                                     \
        for (int i = 0; i < N; ++i)                                                           \
          for (int j = 0; j < C / VL; ++j) STOREV(o[i] + c + VL * j, acc[i][j]);              \
      }                                                                                       \
    }                                                                                         \
  }
#define DEFINE_PV_HEAD(D) \
  DEFINE_PV(1, D) DEFINE_PV(2, D) DEFINE_PV(3, D) DEFINE_PV(4, D) DEFINE_PV(5, D) DEFINE_PV(6, D)
DEFINE_PV_HEAD(64)
DEFINE_PV_HEAD(128)
DEFINE_PV_HEAD(256)
// m <= PV_PAIRS_D pairs at once (the kernels for more pairs are never built).
#define PV_PASS(D, m, ...)                                             \
  switch (m) {                                                         \
    case 1: pv_1_##D(__VA_ARGS__); break;                              \
    case 2: if (PV_PAIRS_##D >= 2) pv_2_##D(__VA_ARGS__); break;       \
    case 3: if (PV_PAIRS_##D >= 3) pv_3_##D(__VA_ARGS__); break;       \
    case 4: if (PV_PAIRS_##D >= 4) pv_4_##D(__VA_ARGS__); break;       \
    case 5: if (PV_PAIRS_##D >= 5) pv_5_##D(__VA_ARGS__); break;       \
    default: if (PV_PAIRS_##D >= 6) pv_6_##D(__VA_ARGS__); break;      \
  }

// A tile's arguments, the same for every head_dim and cache type.
#define TILE_PARAMS                                                                          \
  const float *qs, int64_t n, const void *k_cache, const void *v_cache, const int64_t *table, \
      const int64_t *first, const int64_t *len, int64_t H, int64_t Hkv, int64_t g0,           \
      int64_t g1, int64_t h0, int64_t h1, float *scores, int64_t row, float cap,              \
      const float *sinks, float *out
#define TILE_ARGS \
  qs, n, k_cache, v_cache, table, first, len, H, Hkv, g0, g1, h0, h1, scores, row, cap, sinks, out

// A tile of n rows (n <= TILE), block_size 16, head_dim D: query heads [h0, h1) of each
// KV head's group, for KV heads [g0, g1) (a whole tile: 0, Hkv, 0, H / Hkv). qs: [n, H, D],
// scaled; first/len: each row's attended positions [first, len); scores:
// [H / Hkv * TILE, row] (64-byte-aligned rows); out: the tile's first output row, rows H * D
// apart. A head row of the cache's keys is KW = D + KV_EXTRA(KEY_EL(kt)) elements, of its
// values VW, and blocks are kbs and vbs elements apart (kv_block_stride).
#define DEFINE_TILE_16(D)                                                                     \
  INLINE void tile_16_##D(TILE_PARAMS, int kt) {                                              \
    const int ke = KEY_EL(kt), ve = VAL_EL(kt);                                               \
    const int64_t KW = D + KV_EXTRA(ke), VW = D + KV_EXTRA(ve);                               \
    const int64_t kbs = kv_block_stride(kt, 1, Hkv, D, 16);                                   \
    const int64_t vbs = kv_block_stride(kt, 0, Hkv, D, 16);                                   \
    const int64_t group = H / Hkv, HD = H * D;                                                \
    int64_t min_first = first[0], max_len = len[0];                                           \
    for (int64_t i = 1; i < n; ++i) {                                                         \
      min_first = first[i] < min_first ? first[i] : min_first;                                \
      max_len = len[i] > max_len ? len[i] : max_len;                                          \
    }                                                                                         \
    const int64_t num_blocks = (max_len + 15) / 16, pairs = (h1 - h0) * n;                    \
    for (int64_t g = g0; g < g1; ++g) {                                                       \
      /* Scores of pair k = (query head g * group + h0 + k / n, row k % n): scores row k. A \
         lone row's query heads of the group are D apart: they go through one pass as rows. \
         Every score is one FMA chain over d however many rows a pass takes. */              \
      const int64_t head0 = g * group + h0;                                                   \
      const void *kg = kv_at(k_cache, g * KW * 16, ke);                                       \
      if (n == 1)                                                                             \
        QK_BLOCKS_FOR(ke)(h1 - h0, qs + head0 * D, D, kg, table, kbs, min_first / 16,         \
                          num_blocks, D, scores, row);                                        \
      else                                                                                    \
        for (int64_t hg = 0; hg < h1 - h0; ++hg)                                              \
          QK_BLOCKS_FOR(ke)(n, qs + (head0 + hg) * D, HD, kg, table, kbs, min_first / 16,     \
                            num_blocks, D, scores + hg * n * row, row);                       \
      const void *vg = kv_at(v_cache, g * VW * 16, ve);                                       \
      for (int64_t k = 0; k < pairs; ++k) {                                                   \
        const int64_t i = k % n;                                                              \
        const float sink = sinks ? sinks[head0 + k / n] : -INFINITY;                          \
        softmax(scores + k * row + first[i], len[i] - first[i], cap, sink);                   \
        memset(out + i * HD + (head0 + k / n) * D, 0, sizeof(float) * D);                     \
      }                                                                                       \
      for (int64_t k0 = 0; k0 < pairs; k0 += PV_PAIRS_##D) {                                  \
        const int64_t m = pairs - k0 < PV_PAIRS_##D ? pairs - k0 : PV_PAIRS_##D;              \
        float *p[PV_PAIRS_##D], *o[PV_PAIRS_##D];                                             \
        int64_t lo = 0, hi = INT64_MAX;                                                       \
        for (int64_t j = 0; j < m; ++j) {                                                     \
          const int64_t k = k0 + j, i = k % n;                                                \
          p[j] = scores + k * row;                                                            \
          o[j] = out + i * HD + (head0 + k / n) * D;                                          \
          lo = first[i] > lo ? first[i] : lo;                                                 \
          hi = len[i] < hi ? len[i] : hi;                                                     \
        }                                                                                     \
        if (hi < lo) hi = lo;                                                                 \
        /* The positions every pair attends go through the registers together; each pair's \
           own ones before and after, alone: every sum still runs in the order of t. */    \
        for (int64_t j = 0; j < m; ++j) {                                                     \
          const int64_t i = (k0 + j) % n;                                                     \
          pv_1_##D(p + j, o + j, vg, table, vbs, first[i],                                    \
                   lo < len[i] ? lo : len[i], ve);                                            \
        }                                                                                     \
        PV_PASS(D, m, p, o, vg, table, vbs, lo, hi, ve);                                      \
        for (int64_t j = 0; j < m; ++j) {                                                     \
          const int64_t i = (k0 + j) % n;                                                     \
          pv_1_##D(p + j, o + j, vg, table, vbs, hi > first[i] ? hi : first[i],               \
                   len[i], ve);                                                               \
        }                                                                                     \
      }                                                                                       \
    }                                                                                         \
  }
DEFINE_TILE_16(64)
DEFINE_TILE_16(128)
DEFINE_TILE_16(256)

// One row, any block_size and head_dim: its query heads [ha, hb). q: [H, D], scaled;
// scores: [H, row].
#define ROW_PARAMS                                                                            \
  const float *q, const void *k_cache, const void *v_cache, const int64_t *table,            \
      int64_t first, int64_t len, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t ha, \
      int64_t hb, float *scores, int64_t row, float cap, const float *sinks, float *out
#define ROW_ARGS \
  q, k_cache, v_cache, table, first, len, H, Hkv, D, bs, ha, hb, scores, row, cap, sinks, out
INLINE void row_any(ROW_PARAMS, int kt) {
  const int ke = KEY_EL(kt), ve = VAL_EL(kt);
  const int64_t KW = D + KV_EXTRA(ke), VW = D + KV_EXTRA(ve);
  const int64_t kbs = kv_block_stride(kt, 1, Hkv, D, bs), vbs = kv_block_stride(kt, 0, Hkv, D, bs);
  const int64_t group = H / Hkv;
  for (int64_t h = ha; h < hb; ++h) {
    const float *qh = q + h * D;
    float *s = scores + h * row;
    for (int64_t t = first; t < len; ++t) {
      const int64_t head = table[t / bs] * kbs + (h / group) * KW * bs;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qh[d] * load_kv1(k_cache, head + d * bs + t % bs, ke);
      s[t] = KV_SCALED(ke) ? dot * KV_SCALE(k_cache, head + D * bs)[t % bs] : dot;
    }
    softmax(s + first, len - first, cap, sinks ? sinks[h] : -INFINITY);
    float *oh = out + h * D;
    for (int64_t d = 0; d < D; ++d) oh[d] = 0.f;
    for (int64_t t = first; t < len; ++t) {
      const int64_t vh = table[t / bs] * vbs + ((h / group) * bs + t % bs) * VW;
      const float w = KV_SCALED(ve) ? s[t] * *KV_SCALE(v_cache, vh + D) : s[t];
      for (int64_t d = 0; d < D; ++d) oh[d] += w * load_kv1(v_cache, vh + d, ve);
    }
  }
}

// One copy of each per cache type, where kt is a constant.
typedef void (*tile_fn)(TILE_PARAMS);
typedef void (*row_fn)(ROW_PARAMS);
#define DEFINE_FOR_TYPE(SUF, KT)                                                             \
  static void tile_16_64_##SUF(TILE_PARAMS) { tile_16_64(TILE_ARGS, KT); }                   \
  static void tile_16_128_##SUF(TILE_PARAMS) { tile_16_128(TILE_ARGS, KT); }                 \
  static void tile_16_256_##SUF(TILE_PARAMS) { tile_16_256(TILE_ARGS, KT); }                 \
  static void row_any_##SUF(ROW_PARAMS) { row_any(ROW_ARGS, KT); }
DEFINE_FOR_TYPE(f32, KV_F32)
DEFINE_FOR_TYPE(i8, KV_I8)
DEFINE_FOR_TYPE(e4m3, KV_E4M3)
DEFINE_FOR_TYPE(e5m2, KV_E5M2)
DEFINE_FOR_TYPE(f16i8, KV_F16_I8)
DEFINE_FOR_TYPE(f16e4m3, KV_F16_E4M3)
DEFINE_FOR_TYPE(f16e5m2, KV_F16_E5M2)
// [cache type][head_dim 64, 128, 256]
static const tile_fn TILES[KV_NUM_TYPES][3] = {
    {tile_16_64_f32, tile_16_128_f32, tile_16_256_f32},
    {tile_16_64_i8, tile_16_128_i8, tile_16_256_i8},
    {tile_16_64_e4m3, tile_16_128_e4m3, tile_16_256_e4m3},
    {tile_16_64_e5m2, tile_16_128_e5m2, tile_16_256_e5m2},
    {tile_16_64_f16i8, tile_16_128_f16i8, tile_16_256_f16i8},
    {tile_16_64_f16e4m3, tile_16_128_f16e4m3, tile_16_256_f16e4m3},
    {tile_16_64_f16e5m2, tile_16_128_f16e5m2, tile_16_256_f16e5m2},
};
static const row_fn ROWS[KV_NUM_TYPES] = {row_any_f32,   row_any_i8,      row_any_e4m3,
                                          row_any_e5m2,  row_any_f16i8,   row_any_f16e4m3,
                                          row_any_f16e5m2};

static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

// kv_type: what the cache holds (KV_F32 to KV_F16_E5M2; see the top for the layouts).
// Returns 0 (and computes nothing) for an unknown type.
int paged_attention(
    const float *q,             // [B rows of q_stride floats, H, D]
    int64_t q_stride,
    const void *k_cache,        // [num_blocks, Hkv, D, block_size] (+ scales, see the top)
    const void *v_cache,        // [num_blocks, Hkv, block_size, D] (+ scales)
    const int64_t *block_table, // [B, max_blocks]
    const int64_t *seq_lens,    // [B] positions row b attends: [0, seq_lens[b])
    const int64_t *starts,      // [B] first attended position (sliding window), or NULL for 0
    float *out,                 // [B, H, D]
    int64_t batch, int64_t H, int64_t Hkv, int64_t D,
    int64_t block_size, int64_t max_blocks, float scale,
    const int64_t *tiles,       // [num_tiles + 1] row bounds of tiles, or NULL: a row each
    int64_t num_tiles,
    float soft_cap,             // scores become soft_cap * tanh(s / soft_cap); 0: none
    const float *sinks,         // [H] each head's attention sink (a logit), or NULL
    int64_t kv_type) {
  if (kv_type < KV_F32 || kv_type >= KV_NUM_TYPES) return 0;
  int64_t max_len = 1;
  for (int64_t b = 0; b < batch; ++b)
    if (seq_lens[b] > max_len) max_len = seq_lens[b];
  // A head's scores span whole blocks (the last one partly past the sequence's end), and
  // every row of them starts 64-byte-aligned, so a row's softmax never depends on the batch.
  int64_t row = (max_len + block_size - 1) / block_size * block_size;
  row = (row + 15) / 16 * 16;
  const int fast = block_size == 16 && (D == 64 || D == 128 || D == 256);
  const tile_fn tile = fast ? TILES[kv_type][D == 64 ? 0 : D == 128 ? 1 : 2] : NULL;
  const row_fn row_any_kt = ROWS[kv_type];
  // Threads take whole tiles; with fewer tiles than threads (one decode row: a third of
  // a small model's decode step was one thread's attention while the other waited), they
  // take a tile's query heads in pieces: a KV head's group in `parts` runs of heads, two
  // pieces a thread or more. A head's result is the same operations in either case.
  const int64_t group = H / Hkv;
  int64_t parts = 1, pieces = 1;  // per KV head; per tile
#ifdef _OPENMP
  const int64_t threads = omp_get_max_threads();
  if (num_tiles < threads) {
    // Whole groups where the KV heads already share the threads evenly (one stream of
    // Qwen3.5: 2 KV heads on 2 threads): each thread then reads its KV head's keys and
    // values once for all of the group's query heads, where split groups read them twice.
    const int64_t kv_items = num_tiles * Hkv;
    parts = kv_items % threads == 0 ? 1 : (2 * threads + kv_items - 1) / kv_items;
    parts = parts < group ? parts : group;
    pieces = Hkv * parts;
  }
#endif
#pragma omp parallel if (num_tiles * pieces > 1)
  {
    const int64_t score_rows = group * TILE > H ? group * TILE : H;
    float *scores = alloc64(sizeof(float) * score_rows * row);
    float *qs = alloc64(sizeof(float) * TILE * H * D);
    int64_t first[TILE];
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_tiles * pieces; ++item) {
      const int64_t t = item / pieces, piece = item % pieces;
      const int64_t g0 = pieces > 1 ? piece / parts : 0, g1 = pieces > 1 ? g0 + 1 : Hkv;
      const int64_t h0 = piece % parts * group / parts, h1 = (piece % parts + 1) * group / parts;
      const int64_t lo = tiles ? tiles[t] : t, hi = tiles ? tiles[t + 1] : t + 1;
      // Longer tiles (a caller's mistake) go in TILE-row pieces.
      for (int64_t r0 = lo; r0 < hi; r0 += TILE) {
        const int64_t n = hi - r0 < TILE ? hi - r0 : TILE;
        // Rows of one tile are one request's: they share its block table.
        const int64_t *table = block_table + (r0 + n - 1) * max_blocks;
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t j = 0; j < H * D; ++j)
            qs[i * H * D + j] = q[(r0 + i) * q_stride + j] * scale;
          first[i] = starts ? starts[r0 + i] : 0;
        }
        if (tile)
          tile(qs, n, k_cache, v_cache, table, first, seq_lens + r0, H, Hkv, g0, g1, h0, h1,
               scores, row, soft_cap, sinks, out + r0 * H * D);
        else
          for (int64_t g = g0; g < g1; ++g)
            for (int64_t i = 0; i < n; ++i)
              row_any_kt(qs + i * H * D, k_cache, v_cache, block_table + (r0 + i) * max_blocks,
                         first[i], seq_lens[r0 + i], H, Hkv, D, block_size, g * group + h0,
                         g * group + h1, scores, row, soft_cap, sinks, out + (r0 + i) * H * D);
      }
    }
    free(scores);
    free(qs);
  }
  return 1;
}
#pragma GCC pop_options

// y[m, :] = x[m, :] W^T (+ bias) for a batch of up to SMALL_BATCH_ROWS rows (decoding one
// or many sequences): W is packed in panels of 16 outputs, [N / 16, K, 16] (N rounded up:
// the last panel's missing outputs are zero weights, computed and dropped), so a step of k
// loads a panel's 16 weights as one vector (AVX-512; two on AVX2); 8 rows by 2 panels are 16
// accumulators, fed by 2 weight loads and 8 broadcasts of x per 16 FMAs (AVX2: 3 rows by 2
// panels, 12). Threads split the panels; a panel pair (72-196 KB) stays in L2 while every
// row tile passes over it. Each output is one FMA chain over k, so a row's result does not
// depend on the rows beside it. Against oneDNN's GEMM on the
// bundled model's shapes: 1.2-1.3x at 5-16 rows, 1.05-1.2x at 32-64, even at 128-256 (both
// near the FMA peak there); against the plain-layout kernel this replaced, 1.1-1.2x at 1-4.
#define DEFINE_GEMM(MR, NP)                                                                  \
  static inline void gemm_##MR##x##NP(const float *x, int64_t K, const float *wp,            \
                                      int64_t panel_stride, const float *bias, float *y,     \
                                      int64_t N) {                                           \
    vf acc[MR][NP * BV];                                                                     \
    for (int m = 0; m < MR; ++m)                                                             \
      for (int j = 0; j < NP * BV; ++j) acc[m][j] = (vf){0};                                 \
    for (int64_t k = 0; k < K; ++k) {                                                        \
      vf w[NP * BV];                                                                         \
      for (int j = 0; j < NP * BV; ++j)                                                      \
        w[j] = loadv(wp + j / BV * panel_stride + k * 16 + j % BV * VL);                     \
      for (int m = 0; m < MR; ++m) {                                                         \
        const float xm = x[m * K + k];                                                       \
        for (int j = 0; j < NP * BV; ++j) acc[m][j] += xm * w[j];                            \
      }                                                                                      \
    }                                                                                        \
    for (int m = 0; m < MR; ++m)                                                             \
      for (int j = 0; j < NP * BV; ++j)                                                      \
        storev(y + m * N + VL * j, bias ? acc[m][j] + loadv(bias + VL * j) : acc[m][j]);    \
  }
// Rows per tile: 8 by 2 panels are 16 accumulators of 16 floats (AVX-512); with 8 floats
// (AVX2), 3 rows by 2 panels are 12. The kernels for more rows are never built.
#define GEMM_ROWS (VL == 16 ? 8 : 3)
#define DEFINE_GEMM_ROWS(NP) \
  DEFINE_GEMM(1, NP)         \
  DEFINE_GEMM(2, NP)         \
  DEFINE_GEMM(3, NP)         \
  DEFINE_GEMM(4, NP)         \
  DEFINE_GEMM(5, NP)         \
  DEFINE_GEMM(6, NP)         \
  DEFINE_GEMM(7, NP)         \
  DEFINE_GEMM(8, NP)
// mr <= GEMM_ROWS rows at once.
#define GEMM_TILE(NP, mr, ...)                                           \
  switch (mr) {                                                          \
    case 1: gemm_1x##NP(__VA_ARGS__); break;                             \
    case 2: gemm_2x##NP(__VA_ARGS__); break;                             \
    case 3: gemm_3x##NP(__VA_ARGS__); break;                             \
    case 4: if (GEMM_ROWS >= 4) gemm_4x##NP(__VA_ARGS__); break;         \
    case 5: if (GEMM_ROWS >= 5) gemm_5x##NP(__VA_ARGS__); break;         \
    case 6: if (GEMM_ROWS >= 6) gemm_6x##NP(__VA_ARGS__); break;         \
    case 7: if (GEMM_ROWS >= 7) gemm_7x##NP(__VA_ARGS__); break;         \
    default: if (GEMM_ROWS >= 8) gemm_8x##NP(__VA_ARGS__); break;        \
  }
DEFINE_GEMM_ROWS(1)
DEFINE_GEMM_ROWS(2)

void panel_linear_f32(const float *x,      // [M, K]
                      const float *panels, // [ceil(N / 16), K, 16], the last padded with zeros
                      const float *bias,   // [N] or NULL
                      float *y,            // [M, N]
                      int64_t M, int64_t N, int64_t K) {
  const int64_t panel_stride = K * 16, full = N / 16, rest = N % 16;
  const int64_t num_pairs = (full + 1) / 2, items = num_pairs + (rest > 0);
  // One item (a DeltaNet layer's b/a projection, 32 outputs) is one thread's: no team.
#pragma omp parallel for schedule(static) if (items > 1)
  for (int64_t pair = 0; pair < items; ++pair) {
    if (pair == num_pairs) {  // the partial last panel (a router's 8 or 60 outputs): a
                              // panel's 16 into a scratch tile, its first `rest` kept
      float tile[GEMM_ROWS * 16];
      for (int64_t m0 = 0; m0 < M; m0 += GEMM_ROWS) {
        const int64_t mr = M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS;
        GEMM_TILE(1, mr, x + m0 * K, K, panels + full * panel_stride, panel_stride, NULL, tile, 16)
        for (int64_t m = 0; m < mr; ++m)
          for (int64_t j = 0; j < rest; ++j)
            y[(m0 + m) * N + full * 16 + j] = tile[m * 16 + j] + (bias ? bias[full * 16 + j] : 0.f);
      }
      continue;
    }
    const int64_t p = 2 * pair, np = full - p < 2 ? 1 : 2;
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_ROWS) {
      const int64_t mr = M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS;
      const float *xt = x + m0 * K, *wp = panels + p * panel_stride;
      const float *b = bias ? bias + p * 16 : NULL;
      float *yt = y + m0 * N + p * 16;
      if (np == 2) {
        GEMM_TILE(2, mr, xt, K, wp, panel_stride, b, yt, N)
      } else {
        GEMM_TILE(1, mr, xt, K, wp, panel_stride, b, yt, N)
      }
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

// A LoRA's delta added to a linear layer's output: out[i, :] += B (A x[i, :]). A:
// [slices * rank, k], B: [n, slices * rank], row-major. A fused layer (q/k/v, gate/up)
// stacks one LoRA per projection: output rows below slice_ends[s] (and from the slice
// before's end) read only columns s * rank .. + rank of B, the others being zero, so a row
// reads rank values of B, not slices * rank. Each row's sums run in the same order whatever
// the other rows: a row's delta does not depend on the batch it is in.
void lora_add_f32(const float *x, const float *a, const float *b, float *out, int64_t m,
                  int64_t k, int64_t n, int64_t slices, int64_t rank,
                  const int64_t *slice_ends) {
  const int64_t width = slices * rank;
#pragma omp parallel for schedule(static) if (m >= 16)
  for (int64_t i = 0; i < m; ++i) {
    float t[width];
    const float *xi = x + i * k;
    for (int64_t j = 0; j < width; ++j) {
      const float *aj = a + j * k;
      float s = 0.f;
      for (int64_t p = 0; p < k; ++p) s += aj[p] * xi[p];
      t[j] = s;
    }
    float *oi = out + i * n;
    int64_t q = 0;
    for (int64_t sl = 0; sl < slices; ++sl) {
      const float *ts = t + sl * rank;
      for (; q < slice_ends[sl]; ++q) {
        const float *bq = b + q * width + sl * rank;
        float s = 0.f;
        for (int64_t j = 0; j < rank; ++j) s += bq[j] * ts[j];
        oi[q] += s;
      }
    }
  }
}

// RoPE in place, rotate-half layout, on the heads of q [m rows of q_stride, H heads of D]
// and k [m rows of k_stride, Hkv heads of D]; cos/sin: [positions, D] tables. No fused
// multiply-add, so each value is rounded as torch's x * cos + rotate_half(x) * sin rounds
// it: the result is bit for bit the torch path's.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static void rotate_heads(float *x, int64_t heads, int64_t stride, int64_t D, const float *c,
                         const float *s) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float *xh = x + h * stride;
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

// D: the rotated dimensions of each head, its first D of head_dim (partial RoPE: the rest
// pass through); cos, sin: [positions, D].
void rotary_embedding_f32(const int64_t *positions, float *q, int64_t q_stride, int64_t H,
                          float *k, int64_t k_stride, int64_t Hkv, const float *cos,
                          const float *sin, int64_t D, int64_t m, int64_t head_dim) {
#pragma omp parallel for schedule(static) if (m >= 16)
  for (int64_t t = 0; t < m; ++t) {
    const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
    rotate_heads(q + t * q_stride, H, head_dim, D, c, s);
    rotate_heads(k + t * k_stride, Hkv, head_dim, D, c, s);
  }
}

// Each token's K and V ([m rows of k_stride / v_stride, Hkv heads of D]) stored at its flat
// slot (block * block_size + offset) of the layer's cache: the key transposed into
// [Hkv, D, block_size] blocks, the value into [Hkv, block_size, D] blocks, a row a head. A
// negative slot (a padding token) is skipped.
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
    float *vb = v_cache + block * Hkv * D * block_size + offset * D;
    for (int64_t h = 0; h < Hkv; ++h)
      memcpy(vb + h * block_size * D, v + t * v_stride + h * D, sizeof(float) * D);
  }
}

// float to fp8 (kt: KV_E4M3 or KV_E5M2), rounded to nearest even, saturated at the largest
// finite value (e4m3fn: 448; e5m2: 57344), as vLLM's cache write saturates.
#define FP8_MAX(e4m3) ((e4m3) ? 448.f : 57344.f)
static uint8_t float_to_fp8(float x, int kt) {
  const int e4m3 = KV_IS_E4M3(kt), mant = e4m3 ? 3 : 2, shift = 23 - mant;
  const float max = FP8_MAX(e4m3);
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  const uint8_t sign = (bits >> 24) & 0x80;
  float a = fabsf(x);
  if (!(a < max)) a = max;
  if (a < (e4m3 ? 0x1p-6f : 0x1p-14f))  // a subnormal: a whole number of the smallest step
    return sign | (uint8_t)lrintf(a * (e4m3 ? 0x1p9f : 0x1p16f));
  memcpy(&bits, &a, sizeof bits);
  bits += (1u << (shift - 1)) - 1 + ((bits >> shift) & 1);
  const uint32_t exponent = (bits >> 23) - 127 + (e4m3 ? 7 : 15);
  uint32_t code = exponent << mant | ((bits >> shift) & ((1u << mant) - 1));
  const uint32_t max_code = e4m3 ? 0x7E : 0x7B;
  return sign | (code > max_code ? max_code : code);
}

// int8: q = round(x * (127 / amax)), the head row's scale amax * (1 / 127) (0 for a zero
// row), written so that -ffast-math computes what torch does (quantize_rows).
static float quantize_i8(const float *x, int64_t D, int8_t *q, int64_t q_step) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < D; ++d) q[d * q_step] = (int8_t)lrintf(x[d] * inv);
  return amax * (1.f / 127.f);
}

// Scaled fp8 (el: KV_E4M3S or KV_E5M2S): q = fp8(x * (top / amax)) (top: the format's
// largest value), the head row's scale amax * (1 / top), written as quantize_i8 is.
static float quantize_fp8(const float *x, int64_t D, uint8_t *q, int el) {
  const float top = FP8_MAX(KV_IS_E4M3(el));
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
  const float inv = amax > 0.f ? top / amax : 0.f;
  for (int64_t d = 0; d < D; ++d) q[d] = float_to_fp8(x[d] * inv, el);
  return amax * (1.f / top);
}

// float to float16, rounded to nearest even, saturated at the largest finite value (65504;
// torch's conversion would give inf), subnormals rounded to whole steps of 2^-24.
static uint16_t float_to_f16(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  const uint16_t sign = (bits >> 16) & 0x8000;
  float a = fabsf(x);
  if (!(a < 65504.f)) a = 65504.f;
  if (a < 0x1p-14f) return sign | (uint16_t)lrintf(a * 0x1p24f);
  memcpy(&bits, &a, sizeof bits);
  bits += 0xFFFu + ((bits >> 13) & 1);
  return sign | (uint16_t)((((bits >> 23) - 112) << 10) | ((bits >> 13) & 0x3FF));
}

// write_kv_f32 into a quantized cache (kv_type KV_I8 to KV_F16_E5M2; see the top of this
// file for the layouts). Returns 0 (writing nothing) for another type.
int write_kv_quantized(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                       uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, int64_t m,
                       int64_t Hkv, int64_t D, int64_t block_size, int64_t kv_type) {
  if (kv_type < KV_I8 || kv_type >= KV_NUM_TYPES) return 0;
  const int ke = KEY_EL(kv_type), ve = VAL_EL(kv_type);
  const int64_t KW = D + KV_EXTRA(ke), VW = D + KV_EXTRA(ve);  // elements a head row
  const int64_t kbs = kv_block_stride(kv_type, 1, Hkv, D, block_size);
  const int64_t vbs = kv_block_stride(kv_type, 0, Hkv, D, block_size);
#pragma omp parallel for schedule(static) if (m >= 64)
  for (int64_t t = 0; t < m; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int64_t h = 0; h < Hkv; ++h) {
      const float *kt = k + t * k_stride + h * D, *vt = v + t * v_stride + h * D;
      // Keys [D, block_size] (elements of ke), values [D] bytes.
      uint8_t *kh = (uint8_t *)kv_at(k_cache, block * kbs + h * KW * block_size, ke);
      uint8_t *vh = v_cache + block * vbs + (h * block_size + offset) * VW;
      if (KV_F16_KEYS(kv_type)) {
        uint16_t *kf = (uint16_t *)kh;
        for (int64_t d = 0; d < D; ++d) kf[d * block_size + offset] = float_to_f16(kt[d]);
        const float vs = kv_type == KV_F16_I8 ? quantize_i8(vt, D, (int8_t *)vh, 1)
                                              : quantize_fp8(vt, D, vh, ve);
        memcpy(vh + D, &vs, sizeof vs);
      } else if (kv_type == KV_I8) {
        const float ks = quantize_i8(kt, D, (int8_t *)kh + offset, block_size);
        const float vs = quantize_i8(vt, D, (int8_t *)vh, 1);
        memcpy(kh + D * block_size + offset * sizeof(float), &ks, sizeof ks);
        memcpy(vh + D, &vs, sizeof vs);
      } else {
        for (int64_t d = 0; d < D; ++d) {
          kh[d * block_size + offset] = float_to_fp8(kt[d], kv_type);
          vh[d] = float_to_fp8(vt[d], kv_type);
        }
      }
    }
  }
  return 1;
}

// ------------------------------------------------------------------ replayed decode steps
// A CPU graph (worker/cpu_graph.py) makes a captured step's kernel calls in one call from
// Python, run_calls: each kernel has a twin, NAME_slots, that takes its arguments as one
// array of 64-bit slots (a pointer or an integer as it is, a float as a double's bits).
// A call through ctypes costs ~3 us, and a decode step of SmolLM2 makes 300 of them.
static inline float f32_slot(int64_t slot) {
  double d;
  memcpy(&d, &slot, sizeof d);
  return (float)d;
}
#define PTR(T, slot) ((T)(intptr_t)(slot))

void paged_attention_slots(const int64_t *a) {
  paged_attention(PTR(const float *, a[0]), a[1], PTR(const void *, a[2]),
                  PTR(const void *, a[3]), PTR(const int64_t *, a[4]),
                  PTR(const int64_t *, a[5]), PTR(const int64_t *, a[6]), PTR(float *, a[7]),
                  a[8], a[9], a[10], a[11], a[12], a[13], f32_slot(a[14]),
                  PTR(const int64_t *, a[15]), a[16], f32_slot(a[17]),
                  PTR(const float *, a[18]), a[19]);
}

void panel_linear_f32_slots(const int64_t *a) {
  panel_linear_f32(PTR(const float *, a[0]), PTR(const float *, a[1]),
                   PTR(const float *, a[2]), PTR(float *, a[3]), a[4], a[5], a[6]);
}

void rms_norm_f32_slots(const int64_t *a) {
  rms_norm_f32(PTR(const float *, a[0]), PTR(float *, a[1]), PTR(const float *, a[2]),
               PTR(float *, a[3]), a[4], a[5], f32_slot(a[6]));
}

void silu_and_mul_f32_slots(const int64_t *a) {
  silu_and_mul_f32(PTR(const float *, a[0]), PTR(float *, a[1]), a[2], a[3]);
}

void rotary_embedding_f32_slots(const int64_t *a) {
  rotary_embedding_f32(PTR(const int64_t *, a[0]), PTR(float *, a[1]), a[2], a[3],
                       PTR(float *, a[4]), a[5], a[6], PTR(const float *, a[7]),
                       PTR(const float *, a[8]), a[9], a[10], a[11]);
}

void lora_add_f32_slots(const int64_t *a) {
  lora_add_f32(PTR(const float *, a[0]), PTR(const float *, a[1]), PTR(const float *, a[2]),
               PTR(float *, a[3]), a[4], a[5], a[6], a[7], a[8], PTR(const int64_t *, a[9]));
}

void write_kv_quantized_slots(const int64_t *a) {
  write_kv_quantized(PTR(const float *, a[0]), a[1], PTR(const float *, a[2]), a[3],
                     PTR(uint8_t *, a[4]), PTR(uint8_t *, a[5]), PTR(const int64_t *, a[6]),
                     a[7], a[8], a[9], a[10], a[11]);
}

void write_kv_f32_slots(const int64_t *a) {
  write_kv_f32(PTR(const float *, a[0]), a[1], PTR(const float *, a[2]), a[3],
               PTR(float *, a[4]), PTR(float *, a[5]), PTR(const int64_t *, a[6]), a[7], a[8],
               a[9], a[10]);
}

// Call i: the twin at fns[i] on the slots from args + starts[i].
void run_calls(int64_t n, const int64_t *fns, const int64_t *args, const int64_t *starts) {
  for (int64_t i = 0; i < n; ++i) PTR(void (*)(const int64_t *), fns[i])(args + starts[i]);
}
