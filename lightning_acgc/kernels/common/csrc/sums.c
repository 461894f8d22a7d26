/* sums: the squared norms of gradient tables (acgc's calibration statistics). */
#include "fastcpu.h"

/* Σ (a[i] - b[i])² over n float32 values, each difference taken in float32 and squared
 * and summed in float64 (b NULL: Σ a[i]²): 64 fixed slices, each with 8 running sums
 * (lanes the compiler vectorizes), added in slice order, so the sum is the same for any
 * number of threads and from run to run. */
double acgc_squared_sum_f32(const float *a, const float *b, int64_t n, int nthreads) {
    double slice[64];
    int64_t rows = n / 8;
#pragma omp parallel for schedule(static) num_threads(THREADS(n))
    for (int64_t t = 0; t < 64; t++) { /* 64 fixed slices: the same sums for any team */
        int64_t r0 = rows * t / 64, r1 = rows * (t + 1) / 64;
        double lane[8] = {0};
        for (int64_t r = r0; r < r1; r++) {
            const float *p = a + 8 * r;
            if (b) {
                const float *q = b + 8 * r;
                for (int k = 0; k < 8; k++) {
                    double d = (double)(p[k] - q[k]);
                    lane[k] += d * d;
                }
            } else {
                for (int k = 0; k < 8; k++) lane[k] += (double)p[k] * (double)p[k];
            }
        }
        double s = 0.0;
        for (int k = 0; k < 8; k++) s += lane[k];
        slice[t] = s;
    }
    double total = 0.0;
    for (int t = 0; t < 64; t++) total += slice[t];
    for (int64_t i = 8 * rows; i < n; i++) {
        double d = b ? (double)(a[i] - b[i]) : (double)a[i];
        total += d * d;
    }
    return total;
}
