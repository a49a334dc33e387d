// The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) for the CPU, float32, for a
// flat batch of sequences: prompts, prompt chunks and one-token decodes in one call. See
// gated_delta_torch.py for the rule and the layouts; this is its recurrent form, fused
// with the gating (g, beta from the raw a/b projections) and the q/k L2 norms.
//
// Each (sequence, value head) is one task for an OpenMP thread (the library names libgomp,
// the pool torch's GEMMs use: see cpu_kernels.c): its [Dk, Dv] state (64 KB at Qwen3.5's
// 128 x 128) stays in the core's L2 cache for the whole sequence, and each token passes
// over it once, a block of columns at a time (rule_columns). On a
// CPU the chunked form of the GPU (a few matrix products a chunk) does more arithmetic
// than this for the same result; the state is read and written in place.
#include <math.h>
#include <stdint.h>
#include <string.h>

#define L2_EPS 1e-6f
// 0 builds the decode step's tasks dealt as a prompt's are (one at a time, to the first
// thread free), instead of in consecutive shares (gated_delta_rule_f32).
#ifndef DECODE_SHARES
#define DECODE_SHARES 1
#endif

static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Writes x / sqrt(|x|^2 + eps) * scale to out (n floats).
static inline void l2_normalize(const float *x, float *out, int64_t n, float scale) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float r = scale / sqrtf(sum + L2_EPS);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r;
}

// Columns of a value head's state [Dk, Dv] taken together by rule_columns: 32 floats a
// row, 128 rows at Qwen3.5's Dk (16 KB, in L1 between the block's two passes).
#define COLS 32

// One token's step on columns [j0, j0 + nj) of S (nj <= COLS; a constant where called
// with COLS, so the block's sums stay in registers). Column j's new values need only
// column j: delta_j = beta (v_j - decay (S^T k)_j), S_ij = decay S_ij + k_i delta_j, and
// o_j = (S_new^T q)_j = decay (S^T q)_j + (k . q) delta_j. So a block's rows are read
// once for both sums, then updated while still in L1: the state passes through memory
// once each way per token (it is ~1 MB a layer at Qwen3.5's sizes, read from L3 or DRAM).
static inline __attribute__((always_inline)) void rule_columns(
    float *S, const float *qn, const float *kn, const float *vt, float decay, float beta,
    float kq, float *o, int64_t Dk, int64_t Dv, int64_t j0, const int64_t nj) {
  float sk0[COLS], sk1[COLS], sq0[COLS], sq1[COLS];  // even and odd rows: two chains each
  for (int64_t j = 0; j < nj; ++j) sk0[j] = sk1[j] = sq0[j] = sq1[j] = 0.f;
  int64_t i = 0;
  for (; i + 2 <= Dk; i += 2) {
    const float *r0 = S + i * Dv + j0, *r1 = r0 + Dv;
    const float k0 = kn[i], k1 = kn[i + 1], q0 = qn[i], q1 = qn[i + 1];
#pragma omp simd
    for (int64_t j = 0; j < nj; ++j) {
      sk0[j] += k0 * r0[j];
      sq0[j] += q0 * r0[j];
      sk1[j] += k1 * r1[j];
      sq1[j] += q1 * r1[j];
    }
  }
  if (i < Dk) {
    const float *r0 = S + i * Dv + j0;
    for (int64_t j = 0; j < nj; ++j) {
      sk0[j] += kn[i] * r0[j];
      sq0[j] += qn[i] * r0[j];
    }
  }
  float delta[COLS];
#pragma omp simd
  for (int64_t j = 0; j < nj; ++j) {
    delta[j] = beta * (vt[j0 + j] - decay * (sk0[j] + sk1[j]));
    o[j0 + j] = decay * (sq0[j] + sq1[j]) + kq * delta[j];
  }
  for (i = 0; i < Dk; ++i) {
    float *row = S + i * Dv + j0;
    const float ki = kn[i];
#pragma omp simd
    for (int64_t j = 0; j < nj; ++j) row[j] = decay * row[j] + ki * delta[j];
  }
}

// One head of the gated output norm (gated_rms_norm_f32): out = weight * x / rms(x) *
// silu(gate) over D values (out may be x).
static inline void gated_norm_head(const float *x, const float *gate, const float *weight,
                                   float eps, float *out, int64_t D) {
  float sum = 0.f;
  for (int64_t j = 0; j < D; ++j) sum += x[j] * x[j];
  const float r = 1.f / sqrtf(sum / (float)D + eps);
  for (int64_t j = 0; j < D; ++j) {
    const float g = gate[j];
    out[j] = weight[j] * (x[j] * r) * (g / (1.f + expf(-g)));
  }
}

// One gated_delta_rule_f32 call's arguments (see it for each), shared by its tasks.
struct rule_call {
  const float *q, *k, *v, *a, *b, *A_log, *dt_bias, *z, *norm_weight;
  int64_t q_stride, k_stride, v_stride, ab_stride, z_stride;
  float *state, *out;
  const int32_t *query_start_loc;
  const int64_t *state_slots, *has_initial;
  int64_t Hk, Hv, Dk, Dv, tiled, group;
  float eps, q_scale;
};

// Sequence s's value head h.
static inline __attribute__((always_inline)) void rule_task(const struct rule_call *c,
                                                            int64_t s, int64_t h) {
  const int64_t Hk = c->Hk, Hv = c->Hv, Dk = c->Dk, Dv = c->Dv;
  const int32_t *query_start_loc = c->query_start_loc;
  const float *a = c->a, *b = c->b;
  const int64_t ab_stride = c->ab_stride;
  const int64_t slot = c->state_slots[s];
  if (slot < 0) return;
  float *S = c->state + (slot * Hv + h) * Dk * Dv;
  if (c->has_initial != NULL && !c->has_initial[s]) memset(S, 0, sizeof(float) * Dk * Dv);
  const float A = -expf(c->A_log[h]), bias = c->dt_bias[h];
  const int64_t kh = c->tiled ? h % Hk : h / c->group;
  const int64_t first = query_start_loc ? query_start_loc[s] : s;
  const int64_t end = query_start_loc ? query_start_loc[s + 1] : s + 1;
  float qn[Dk], kn[Dk];
  for (int64_t t = first; t < end; ++t) {
    l2_normalize(c->q + t * c->q_stride + kh * Dk, qn, Dk, c->q_scale);
    l2_normalize(c->k + t * c->k_stride + kh * Dk, kn, Dk, 1.f);
    const float decay = expf(A * softplus(a[t * ab_stride + h] + bias));
    const float beta = 1.f / (1.f + expf(-b[t * ab_stride + h]));
    float kq = 0.f;
    for (int64_t i = 0; i < Dk; ++i) kq += kn[i] * qn[i];
    // S = decay S + k delta^T with delta = beta (v - decay S^T k); o = S^T q
    const float *vt = c->v + t * c->v_stride + h * Dv;
    float *o = c->out + (t * Hv + h) * Dv;
    int64_t j0 = 0;
    for (; j0 + COLS <= Dv; j0 += COLS)
      rule_columns(S, qn, kn, vt, decay, beta, kq, o, Dk, Dv, j0, COLS);
    if (j0 < Dv) rule_columns(S, qn, kn, vt, decay, beta, kq, o, Dk, Dv, j0, Dv - j0);
    if (c->z != NULL)
      gated_norm_head(o, c->z + t * c->z_stride + h * Dv, c->norm_weight, c->eps, o, Dv);
  }
}

// q, k: [T, Hk, Dk] rows q_stride / k_stride floats apart (views of the conv's output);
// v: [T, Hv, Dv] rows v_stride apart; a, b: [T, Hv] rows ab_stride apart (raw projections);
// A_log, dt_bias: [Hv]; state: [num_slots, Hv, Dk, Dv]; query_start_loc: [B + 1] int32, or
// NULL for a decode step (sequence s is row s); state_slots: [B] (a negative slot: a padded
// row, skipped); has_initial: [B] or NULL (0: the sequence starts from a zero state);
// out: [T, Hv, Dv] contiguous. Value head h reads key head h / (Hv / Hk) ("grouped", HF's
// order), or with tiled set h % Hk (llama.cpp's GGUF order). With z not NULL each head's
// output is then normed in place, gated by z [T, Hv, Dv] (rows z_stride floats apart, heads
// contiguous) as gated_rms_norm_f32 does, while it is still in the cache: one pass and one
// parallel region fewer a layer.
void gated_delta_rule_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                          const float *v, int64_t v_stride, const float *a, const float *b,
                          int64_t ab_stride, const float *A_log, const float *dt_bias,
                          float *state, const int32_t *query_start_loc,
                          const int64_t *state_slots, const int64_t *has_initial, float *out,
                          int64_t num_seqs, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                          int64_t tiled, const float *z, int64_t z_stride,
                          const float *norm_weight, float eps) {
  const struct rule_call c = {
      .q = q, .k = k, .v = v, .a = a, .b = b, .A_log = A_log, .dt_bias = dt_bias, .z = z,
      .norm_weight = norm_weight, .q_stride = q_stride, .k_stride = k_stride,
      .v_stride = v_stride, .ab_stride = ab_stride, .z_stride = z_stride, .state = state,
      .out = out, .query_start_loc = query_start_loc, .state_slots = state_slots,
      .has_initial = has_initial, .Hk = Hk, .Hv = Hv, .Dk = Dk, .Dv = Dv, .tiled = tiled,
      .group = Hv / Hk, .eps = eps, .q_scale = 1.f / sqrtf((float)Dk)};
  if (DECODE_SHARES && query_start_loc == NULL) {
    // A decode step: one token a task, each a pass over a state that comes from DRAM. In
    // consecutive shares a thread's states are one run of memory (its heads' 64 KB states
    // side by side), which the hardware prefetchers follow from one task into the next;
    // dealt one at a time (as a prompt's tasks of unequal lengths are), the threads took
    // turns and each task started cold: 18 layers' calls 0.56 ms against ~0.70 a step.
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t s = 0; s < num_seqs; ++s)
      for (int64_t h = 0; h < Hv; ++h)
        rule_task(&c, s, h);
  } else {
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; ++s)
      for (int64_t h = 0; h < Hv; ++h)
        rule_task(&c, s, h);
  }
}

// The DeltaNet's output norm, gated: out = weight * x / rms(x) * silu(gate), per head of D
// (HF's Qwen3NextRMSNormGated). x [rows, H, D] contiguous (out may be x); gate's rows are
// gate_stride floats apart, its heads contiguous (a view of the input projection).
void gated_rms_norm_f32(const float *x, const float *gate, int64_t gate_stride,
                        const float *weight, float eps, float *out, int64_t rows, int64_t H,
                        int64_t D) {
#pragma omp parallel for schedule(static) if (rows * H >= 64)
  for (int64_t i = 0; i < rows * H; ++i)
    gated_norm_head(x + i * D, gate + (i / H) * gate_stride + (i % H) * D, weight, eps,
                    out + i * D, D);
}

// The gated attention's output gate, in place: x[t, h, :] *= sigmoid(gate[t, h, :]). x
// [rows, H, D] contiguous; gate's rows gate_stride floats apart, its heads head_stride
// apart (Qwen3-Next's q_proj holds [q_h | gate_h] per head).
void sigmoid_gate_f32(float *x, const float *gate, int64_t gate_stride, int64_t head_stride,
                      int64_t rows, int64_t H, int64_t D) {
#pragma omp parallel for schedule(static) if (rows * H >= 64)
  for (int64_t i = 0; i < rows * H; ++i) {
    float *xh = x + i * D;
    const float *gh = gate + (i / H) * gate_stride + (i % H) * head_stride;
    for (int64_t j = 0; j < D; ++j) xh[j] *= 1.f / (1.f + expf(-gh[j]));
  }
}

// The twins a replayed CPU graph calls (see run_calls in cpu_kernels.c).
#define PTR(T, slot) ((T)(intptr_t)(slot))

static inline float slot_float(int64_t slot) {  // a float argument: its double's bits
  double d;
  memcpy(&d, &slot, sizeof d);
  return (float)d;
}

void gated_delta_rule_f32_slots(const int64_t *x) {
  gated_delta_rule_f32(PTR(const float *, x[0]), x[1], PTR(const float *, x[2]), x[3],
                       PTR(const float *, x[4]), x[5], PTR(const float *, x[6]),
                       PTR(const float *, x[7]), x[8], PTR(const float *, x[9]),
                       PTR(const float *, x[10]), PTR(float *, x[11]),
                       PTR(const int32_t *, x[12]), PTR(const int64_t *, x[13]),
                       PTR(const int64_t *, x[14]), PTR(float *, x[15]), x[16], x[17], x[18],
                       x[19], x[20], x[21], PTR(const float *, x[22]), x[23],
                       PTR(const float *, x[24]), slot_float(x[25]));
}

void gated_rms_norm_f32_slots(const int64_t *x) {
  gated_rms_norm_f32(PTR(const float *, x[0]), PTR(const float *, x[1]), x[2],
                     PTR(const float *, x[3]), slot_float(x[4]), PTR(float *, x[5]), x[6], x[7],
                     x[8]);
}

void sigmoid_gate_f32_slots(const int64_t *x) {
  sigmoid_gate_f32(PTR(float *, x[0]), PTR(const float *, x[1]), x[2], x[3], x[4], x[5], x[6]);
}
