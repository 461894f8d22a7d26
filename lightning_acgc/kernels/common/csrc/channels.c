/* Per-channel normalization in front of a codec (kernels/channels). */
#include "fastcpu.h"

/* Per-channel normalization in front of a codec (kernels/channels/reference.py): x is
 * [n][c][plane] float32. Per channel its lo and hi over n and plane, m = lo/2 + hi/2 and
 * s = hi/2 - lo/2 (m = 0, s = 1 where a value is NaN or +-inf, or 0 < s < tiny), then
 * y = (x - m) * (s > 0 ? 1/s : 0). Row (n, c) statistics in parallel into rlo/rhi/rbad
 * (n * c each, scratch), the per-channel reduction serial, the output rows in parallel. */
void acgc_channel_normalize(const float *x, int64_t n, int64_t c, int64_t plane, float tiny,
                            float *rlo, float *rhi, uint8_t *rbad, float *m, float *s,
                            float *y, int nthreads) {
    int64_t rows = n * c;
#pragma omp parallel for schedule(static) num_threads(THREADS(rows * plane))
    for (int64_t r = 0; r < rows; r++) {
        float unused;
        rbad[r] = (uint8_t)lane_stats(x + r * plane, plane, STAT_MIN | STAT_MAX | STAT_FINITE,
                                      rlo + r, rhi + r, &unused);
    }
    for (int64_t ch = 0; ch < c; ch++) {
        float lo = INFINITY, hi = -INFINITY;
        int bad = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t r = i * c + ch;
            lo = rlo[r] < lo ? rlo[r] : lo;
            hi = rhi[r] > hi ? rhi[r] : hi;
            bad |= rbad[r];
        }
        float mid = lo / 2.0f + hi / 2.0f, half = hi / 2.0f - lo / 2.0f;
        if (bad || (half > 0.0f && half < tiny)) mid = 0.0f, half = 1.0f;
        m[ch] = mid;
        s[ch] = half;
    }
#pragma omp parallel for schedule(static) num_threads(THREADS(rows * plane))
    for (int64_t r = 0; r < rows; r++) {
        float mid = m[r % c], half = s[r % c];
        float inv = half > 0.0f ? 1.0f / half : 0.0f;
        const float *p = x + r * plane;
        float *q = y + r * plane;
        for (int64_t j = 0; j < plane; j++) q[j] = (p[j] - mid) * inv;
    }
}
