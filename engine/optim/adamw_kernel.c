/* torch's single-tensor AdamW arithmetic on float32, in one pass over memory.
 *
 * Per element, the IEEE operations torch.optim.AdamW(foreach=False, fused=False) runs on CPU, in
 * its order and with its roundings (engine/optim/adamw_kernel.py, [Note: One-pass AdamW]):
 *
 *   m = fma(coeff, g - m, small ? m : g)     exp_avg.lerp_(grad, 1 - beta1)
 *   v = fma(c2 * g, g, v * beta2)             exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
 *   r = root(v)                               exp_avg_sq.sqrt(): torch's own routine, a block at a time
 *   p = p * decay                             param.mul_(1 - lr * weight_decay), when weight_decay != 0
 *   p = p + neg_step * m / (r / bc2_sqrt + eps)   param.addcdiv_(exp_avg, denom, value=-step_size)
 *
 * Built with -ffp-contract=off: the compiler must not fuse any other multiply and add.
 */
#include <math.h>
#include <stdint.h>

/* MKL's vector square root (Fortran calling convention, as torch's build exports it): the length is
 * read as a 32- or 64-bit integer depending on MKL's interface, hence an int64 holding a small
 * value on a little-endian machine serves both. */
typedef void (*root_fn)(const int64_t *n, const float *a, float *r, const int64_t *mode);

#define BLOCK 256

void tiered_adamw_f32(float *restrict param, const float *restrict grad, float *restrict exp_avg,
                      float *restrict exp_avg_sq, int64_t n, int decay_on, float decay, float coeff,
                      int weight_small, float beta2, float c2, float bc2_sqrt, float eps, float neg_step,
                      void *root_routine, int64_t root_mode)
{
    root_fn root_of = (root_fn)root_routine;
    float root[BLOCK];
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        int64_t k = n - lo < BLOCK ? n - lo : BLOCK;
        float *p = param + lo, *m = exp_avg + lo, *v = exp_avg_sq + lo;
        const float *g = grad + lo;
        for (int64_t i = 0; i < k; i++) {
            float gi = g[i], mi = m[i];
            m[i] = fmaf(coeff, gi - mi, weight_small ? mi : gi);
            v[i] = fmaf(c2 * gi, gi, v[i] * beta2);
        }
        root_of(&k, v, root, &root_mode);
        for (int64_t i = 0; i < k; i++) {
            float pi = decay_on ? p[i] * decay : p[i];
            p[i] = pi + neg_step * m[i] / (root[i] / bc2_sqrt + eps);
        }
    }
}
