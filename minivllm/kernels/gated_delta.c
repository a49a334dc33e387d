// The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) for the CPU, float32, for a
// flat batch of sequences: prompts, prompt chunks and one-token decodes in one call. See
// gated_delta_torch.py for the rule and the layouts; this is its recurrent form, fused
// with the gating (g, beta from the raw a/b projections) and the q/k L2 norms.
//
// Each (sequence, value head) is one task for an OpenMP thread (the library names libgomp,
// the pool torch's GEMMs use: see cpu_kernels.c): its [Dk, Dv] state (64 KB at Qwen3.5's
// 128 x 128) stays in the core's L2 cache for the whole sequence, and each token takes
// two passes over it: S^T k, then the decayed update fused with the read S^T q. On a
// CPU the chunked form of the GPU (a few matrix products a chunk) does more arithmetic
// than this for the same result; the state is read and written in place.
#include <math.h>
#include <stdint.h>
#include <string.h>

#define L2_EPS 1e-6f

static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Writes x / sqrt(|x|^2 + eps) * scale to out (n floats).
static inline void l2_normalize(const float *x, float *out, int64_t n, float scale) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float r = scale / sqrtf(sum + L2_EPS);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r;
}

// q, k: [T, Hk, Dk] rows q_stride / k_stride floats apart (views of the conv's output);
// v: [T, Hv, Dv] rows v_stride apart; a, b: [T, Hv] rows ab_stride apart (raw projections);
// A_log, dt_bias: [Hv]; state: [num_slots, Hv, Dk, Dv]; query_start_loc: [B + 1] int32;
// state_slots: [B] (a negative slot: a padded row, skipped); has_initial: [B] or NULL
// (0: the sequence starts from a zero state); out: [T, Hv, Dv] contiguous.
void gated_delta_rule_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                          const float *v, int64_t v_stride, const float *a, const float *b,
                          int64_t ab_stride, const float *A_log, const float *dt_bias,
                          float *state, const int32_t *query_start_loc,
                          const int64_t *state_slots, const int64_t *has_initial, float *out,
                          int64_t num_seqs, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
  const int64_t group = Hv / Hk;
  const float q_scale = 1.f / sqrtf((float)Dk);
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t h = 0; h < Hv; ++h) {
      const int64_t slot = state_slots[s];
      if (slot < 0) continue;
      float *S = state + (slot * Hv + h) * Dk * Dv;
      if (has_initial != NULL && !has_initial[s]) memset(S, 0, sizeof(float) * Dk * Dv);
      const float A = -expf(A_log[h]), bias = dt_bias[h];
      const int64_t kh = h / group;
      float qn[Dk], kn[Dk], delta[Dv];
      for (int64_t t = query_start_loc[s]; t < query_start_loc[s + 1]; ++t) {
        l2_normalize(q + t * q_stride + kh * Dk, qn, Dk, q_scale);
        l2_normalize(k + t * k_stride + kh * Dk, kn, Dk, 1.f);
        const float decay = expf(A * softplus(a[t * ab_stride + h] + bias));
        const float beta = 1.f / (1.f + expf(-b[t * ab_stride + h]));
        // delta = beta (v - decay S^T k)
        for (int64_t j = 0; j < Dv; ++j) delta[j] = 0.f;
        for (int64_t i = 0; i < Dk; ++i) {
          const float *row = S + i * Dv;
          const float ki = kn[i];
          for (int64_t j = 0; j < Dv; ++j) delta[j] += ki * row[j];
        }
        const float *vt = v + t * v_stride + h * Dv;
        for (int64_t j = 0; j < Dv; ++j) delta[j] = beta * (vt[j] - decay * delta[j]);
        // S = decay S + k delta^T; o = S^T q
        float *o = out + (t * Hv + h) * Dv;
        for (int64_t j = 0; j < Dv; ++j) o[j] = 0.f;
        for (int64_t i = 0; i < Dk; ++i) {
          float *row = S + i * Dv;
          const float ki = kn[i], qi = qn[i];
          for (int64_t j = 0; j < Dv; ++j) {
            row[j] = decay * row[j] + ki * delta[j];
            o[j] += qi * row[j];
          }
        }
      }
    }
  }
}

// The twin a replayed CPU graph calls (see run_calls in cpu_kernels.c).
#define PTR(T, slot) ((T)(intptr_t)(slot))

void gated_delta_rule_f32_slots(const int64_t *x) {
  gated_delta_rule_f32(PTR(const float *, x[0]), x[1], PTR(const float *, x[2]), x[3],
                       PTR(const float *, x[4]), x[5], PTR(const float *, x[6]),
                       PTR(const float *, x[7]), x[8], PTR(const float *, x[9]),
                       PTR(const float *, x[10]), PTR(float *, x[11]),
                       PTR(const int32_t *, x[12]), PTR(const int64_t *, x[13]),
                       PTR(const int64_t *, x[14]), PTR(float *, x[15]), x[16], x[17], x[18],
                       x[19], x[20]);
}
