// Mamba-2's selective state-space scan over a flat batch with per-request states, float32.
//
// Per head h (with its group g = h / (heads / groups)) and token t:
//   dt = clamp(softplus(dt_raw[t, h] + dt_bias[h]), dt_min, dt_max)
//   state[h] = exp(dt * A[h]) * state[h] + dt * x[t, h] (outer) B[t, g]     [P, N]
//   y[t, h] = state[h] C[t, g] + D[h] * x[t, h]                              [P]
// One pass over the tokens: a prompt chunk starts from its request's state and leaves its
// own there, so chunked prefill is exact; a decode row is the same step once. The chunked
// (SSD) form of ssm_kernels.py does the same sums in another order.
#include <math.h>
#include <stdint.h>

static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

// Request r's rows are [qsl[r], qsl[r + 1]) (qsl NULL: row r), its state
// state + slots[r] * heads * P * N. x, B, C and dt rows are *_stride floats apart.
void mamba2_scan_f32(const float *x, int64_t x_stride, const float *dt, int64_t dt_stride,
                     const float *A, const float *B, const float *C, int64_t bc_stride,
                     const float *D, const float *dt_bias, float dt_min, float dt_max,
                     float *state, const int64_t *slots, const int32_t *qsl, int64_t num_reqs,
                     int64_t heads, int64_t head_dim, int64_t groups, int64_t n, float *out) {
  const int64_t per_group = heads / groups;
#pragma omp parallel for collapse(2) schedule(static) if (num_reqs * heads > 1)
  for (int64_t r = 0; r < num_reqs; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t start = qsl ? qsl[r] : r;
      const int64_t end = qsl ? qsl[r + 1] : r + 1;
      const int64_t g = h / per_group;
      float *st = state + (slots[r] * heads + h) * head_dim * n;
      for (int64_t t = start; t < end; ++t) {
        float d = softplus(dt[t * dt_stride + h] + dt_bias[h]);
        d = d < dt_min ? dt_min : (d > dt_max ? dt_max : d);
        const float decay = expf(d * A[h]);
        const float *xt = x + t * x_stride + h * head_dim;
        const float *bt = B + t * bc_stride + g * n;
        const float *ct = C + t * bc_stride + g * n;
        float *yt = out + t * heads * head_dim + h * head_dim;
        for (int64_t p = 0; p < head_dim; ++p) {
          float *s = st + p * n;
          const float dx = d * xt[p];
          float acc = 0.0f;
          for (int64_t k = 0; k < n; ++k) {
            s[k] = s[k] * decay + dx * bt[k];
            acc += s[k] * ct[k];
          }
          yt[p] = acc + D[h] * xt[p];
        }
      }
    }
  }
}

// Mamba-2's gated RMSNorm (HF's RMSNormGated, norm_before_gate=False): v = y * silu(z),
// normalised over each group of group_size values, times weight. y [rows, dim] contiguous,
// z rows z_stride apart (a view of the projection), out [rows, dim].
void gated_rms_norm_f32(const float *y, const float *z, int64_t z_stride, const float *weight,
                        int64_t rows, int64_t dim, int64_t group_size, float eps, float *out) {
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const float *yr = y + r * dim;
    const float *zr = z + r * z_stride;
    float *o = out + r * dim;
    for (int64_t g0 = 0; g0 < dim; g0 += group_size) {
      float sum = 0.0f;
      for (int64_t i = g0; i < g0 + group_size; ++i) {
        const float v = yr[i] * (zr[i] / (1.0f + expf(-zr[i])));
        o[i] = v;
        sum += v * v;
      }
      const float scale = 1.0f / sqrtf(sum / (float)group_size + eps);
      for (int64_t i = g0; i < g0 + group_size; ++i) o[i] = weight[i] * (o[i] * scale);
    }
  }
}

static inline float f32_slot(int64_t slot) {
  union {
    int64_t i;
    double d;
  } u = {slot};
  return (float)u.d;
}
#define PTR(T, slot) ((T)(intptr_t)(slot))

// The twin a replayed decode step calls (see run_calls in cpu_kernels.c).
void mamba2_scan_f32_slots(const int64_t *a) {
  mamba2_scan_f32(PTR(const float *, a[0]), a[1], PTR(const float *, a[2]), a[3],
                  PTR(const float *, a[4]), PTR(const float *, a[5]), PTR(const float *, a[6]),
                  a[7], PTR(const float *, a[8]), PTR(const float *, a[9]), f32_slot(a[10]),
                  f32_slot(a[11]), PTR(float *, a[12]), PTR(const int64_t *, a[13]),
                  PTR(const int32_t *, a[14]), a[15], a[16], a[17], a[18], a[19],
                  PTR(float *, a[20]));
}

void gated_rms_norm_f32_slots(const int64_t *a) {
  gated_rms_norm_f32(PTR(const float *, a[0]), PTR(const float *, a[1]), a[2],
                     PTR(const float *, a[3]), a[4], a[5], a[6], f32_slot(a[7]),
                     PTR(float *, a[8]));
}
