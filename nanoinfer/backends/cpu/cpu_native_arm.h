/* ARM NEON versions of cpu_native.c's hot loops: block_matmul's group dot product and the int8
 * rounding of its activations, and attention's dot products and weighted sums.
 *
 * cpu_native.c includes this on aarch64, after its bf16 helpers. Each function computes what
 * the x86 path computes bit for bit: the same integer sum in each of x86's eight lanes, then
 * the same fp32 operations in the same order, fused where x86 fuses them (vfmaq_f32 for
 * _mm256_fmadd_ps), so a token does not depend on the CPU that computed it. Where the x86 code
 * holds a 256-bit vector, this holds two 128-bit halves, lo (x86 lanes 0-3) and hi (4-7).
 * tests/test_cpu_native_arm.py runs it under qemu-aarch64 against the x86 build.
 *
 * The tier follows the compiler's target (cpu_native.py builds with -mcpu=native):
 *   6 neon-i8mm   USDOT, u8 x s8 summed in fours (i8mm's vusdotq_s32): x86 VNNI's vpdpbusd;
 *   5 neon-dotprod SDOT, s8 x s8: 4-bit weights as they are, 8-bit ones as two nibbles;
 *   4 neon        widening multiplies (SMULL) and pairwise adds.
 * i8mm's matrix instruction (SMMLA/USMMLA: a 2x8 by 8x2 int8 tile) is not used: it sums 8
 * consecutive bytes of a row, and block_matmul's chunk order interleaves the groups every 4
 * bytes (a group's 8 bytes would take a shuffle of every weight load), and it only pays with
 * two or more activation rows, not at decode.
 */
#include <arm_neon.h>

/* ---- attention (see attend in cpu_native.c) ---- */

#define KEYS_AT_ONCE 8

/* scores[i] = scale * (q . k_i) for 8 keys (d a multiple of 8), summed as x86's dot8 sums
 * them: an FMA chain per lane of 8, then ((l0 + l1) + (l2 + l3)) + ((h0 + h1) + (h2 + h3)). */
static inline void dot8(const float *q, const float *const k[8], int d, float scale, float *scores) {
    float32x4_t lo[8], hi[8];
    for (int i = 0; i < 8; i++) lo[i] = hi[i] = vdupq_n_f32(0.0f);
    for (int c = 0; c < d; c += 8) {
        float32x4_t x0 = vld1q_f32(q + c), x1 = vld1q_f32(q + c + 4);
        for (int i = 0; i < 8; i++) {
            lo[i] = vfmaq_f32(lo[i], x0, vld1q_f32(k[i] + c));
            hi[i] = vfmaq_f32(hi[i], x1, vld1q_f32(k[i] + c + 4));
        }
    }
    float32x4_t half[8]; /* key i: (l0 + l1, l2 + l3, h0 + h1, h2 + h3) */
    for (int i = 0; i < 8; i++) half[i] = vpaddq_f32(lo[i], hi[i]);
    float32x4_t s[4]; /* keys 2i, 2i + 1: (L, H, L, H) */
    for (int i = 0; i < 4; i++) s[i] = vpaddq_f32(half[2 * i], half[2 * i + 1]);
    vst1q_f32(scores, vmulq_f32(vpaddq_f32(s[0], s[1]), vdupq_n_f32(scale)));
    vst1q_f32(scores + 4, vmulq_f32(vpaddq_f32(s[2], s[3]), vdupq_n_f32(scale)));
}

/* o[0 .. W) += sum over j, in order, of p[j] * ig * v_j (W a multiple of 8, at most 64):
 * element by element x86's FMA chain. */
static inline void weighted_sum(const float *p, float ig, const float *v_pool, const int64_t *s, int64_t keys,
                                int64_t stride, int64_t offset, int W, float *o) {
    float32x4_t a[16];
    for (int i = 0; i < W / 4; i++) a[i] = vld1q_f32(o + 4 * i);
    for (int64_t j = 0; j < keys; j++) {
        const float *v = v_pool + s[j] * stride + offset;
        float32x4_t pj = vdupq_n_f32(p[j] * ig);
        for (int i = 0; i < W / 4; i++) a[i] = vfmaq_f32(a[i], pj, vld1q_f32(v + 4 * i));
    }
    for (int i = 0; i < W / 4; i++) vst1q_f32(o + 4 * i, a[i]);
}

/* ---- block matmul (the layout: cpu_native.c, above block_matmul; quantized.BlockWeight) ----
 *
 * In a chunk of G groups the values come in units of 4 (unit u: bytes 4u .. 4u + 3 of the
 * 8-bit order), unit u of group u % G. x86 sums unit u in int32 lane u % 8; so does this, lane
 * u % 8 being element u % 4 of half (u / 4) % 2. For G = 8 a lane is one group; for G < 8 a
 * group's units fall in 8 / G lanes, each converted and scaled on its own as on x86. */

#define BLOCK_DOT 1
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define DOT_ISA 6
#elif defined(__ARM_FEATURE_DOTPROD)
#define DOT_ISA 5
#else
#define DOT_ISA 4
#endif

/* acc[u] += the dot product of unit u (bytes 4u .. 4u + 3) of w and x; w below 128 but with
 * i8mm. (x is in [-127, 127]: products and pairs of them fit int16.) */
static inline int32x4_t dot16(int32x4_t acc, uint8x16_t w, int8x16_t x) {
#if DOT_ISA == 6
    return vusdotq_s32(acc, w, x);
#elif DOT_ISA == 5
    return vdotq_s32(acc, vreinterpretq_s8_u8(w), x);
#else
    int8x16_t ws = vreinterpretq_s8_u8(w);
    int16x8_t pairs = vpaddq_s16(vmull_s8(vget_low_s8(ws), vget_low_s8(x)), vmull_high_s8(ws, x));
    return vpadalq_s16(acc, pairs);
#endif
}

/* A chunk's eight lane sums (G a constant where it is inlined). 8 bits: 16 bytes at 16 m are
 * units 4m .. 4m + 3; without i8mm's USDOT (u8 x s8) a byte goes as 16 high nibble + low
 * nibble, the high nibbles' sums kept apart until the end. 4 bits: byte b holds value b of the 8-bit order in
 * its low nibble and value 16 G + b in its high one, so 16 bytes at 16 m are units 4m ..
 * (low nibbles) and 4G + 4m .. (high). */
static inline int32x4x2_t chunk_dot(const uint8_t *q, const int8_t *x, int bits, int G) {
    int32x4x2_t s = {{vdupq_n_s32(0), vdupq_n_s32(0)}};
    if (bits == 8) {
#if DOT_ISA == 6
        for (int m = 0; m < 2 * G; m++)
            s.val[m % 2] = dot16(s.val[m % 2], vld1q_u8(q + 16 * m), vld1q_s8(x + 16 * m));
#else
        int32x4x2_t high = s;
        for (int m = 0; m < 2 * G; m++) {
            uint8x16_t w = vld1q_u8(q + 16 * m);
            int8x16_t xm = vld1q_s8(x + 16 * m);
            high.val[m % 2] = dot16(high.val[m % 2], vshrq_n_u8(w, 4), xm);
            s.val[m % 2] = dot16(s.val[m % 2], vandq_u8(w, vdupq_n_u8(15)), xm);
        }
        for (int h = 0; h < 2; h++) s.val[h] = vaddq_s32(s.val[h], vshlq_n_s32(high.val[h], 4));
#endif
    } else
        for (int m = 0; m < G; m++) {
            uint8x16_t w = vld1q_u8(q + 16 * m);
            s.val[m % 2] = dot16(s.val[m % 2], vandq_u8(w, vdupq_n_u8(15)), vld1q_s8(x + 16 * m));
            s.val[(G + m) % 2] = dot16(s.val[(G + m) % 2], vshrq_n_u8(w, 4), vld1q_s8(x + 16 * G + 16 * m));
        }
    return s;
}

static inline float f16_to_f32(uint16_t h) {
    __fp16 f;
    memcpy(&f, &h, 2);
    return f;
}

/* d[j] * xd[j] for the chunk's G groups, lane l holding group l % G's. */
static inline float32x4x2_t chunk_scales(const uint16_t *d, const float *xd, int G) {
    if (G == 8) {
        float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(d));
        return (float32x4x2_t){{vmulq_f32(vcvt_f32_f16(vget_low_f16(h)), vld1q_f32(xd)),
                                vmulq_f32(vcvt_high_f32_f16(h), vld1q_f32(xd + 4))}};
    }
    float s[4];
    for (int l = 0; l < 4; l++) s[l] = f16_to_f32(d[l % G]) * xd[l % G];
    return (float32x4x2_t){{vld1q_f32(s), vld1q_f32(s)}};
}

/* One weight row against one quantized activation row. */
static float row_dot(const uint8_t *q, const uint16_t *d, const uint16_t *m, const int8_t *xq, const float *xd,
                     const float *xs, int groups, int bits) {
#ifdef __clang__ /* (clang would fuse rest's multiply-add, which x86 rounds twice; gcc's -std=c11 does not) */
#pragma STDC FP_CONTRACT OFF
#endif
    float32x4x2_t acc = {{vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}}, mins = acc;
    int g = 0;
    for (; g + 8 <= groups; g += 8, q += 32 * bits, xq += 256) {
        int32x4x2_t sums = chunk_dot(q, xq, bits, 8);
        float32x4x2_t scales = chunk_scales(d + g, xd + g, 8);
        /* (m NULL: a symmetric format's rows left in the file's layout after interleaved ones, -2^(bits - 1) d) */
        float16x8_t mh = vreinterpretq_f16_u16(vld1q_u16(m ? m + g : d + g));
        float32x4_t m0 = vcvt_f32_f16(vget_low_f16(mh)), m1 = vcvt_high_f32_f16(mh);
        if (!m) m0 = vmulq_n_f32(m0, -(float)(1 << (bits - 1))), m1 = vmulq_n_f32(m1, -(float)(1 << (bits - 1)));
        acc.val[0] = vfmaq_f32(acc.val[0], vcvtq_f32_s32(sums.val[0]), scales.val[0]);
        acc.val[1] = vfmaq_f32(acc.val[1], vcvtq_f32_s32(sums.val[1]), scales.val[1]);
        mins.val[0] = vfmaq_f32(mins.val[0], m0, vld1q_f32(xs + g));
        mins.val[1] = vfmaq_f32(mins.val[1], m1, vld1q_f32(xs + g + 4));
    }
    float rest = 0.0f;
    for (int G = 4; G >= 1; G /= 2) /* unrolled by the compiler: each G a constant */
        if ((groups - g) & G) {
            int32x4x2_t sums = chunk_dot(q, xq, bits, G);
            float32x4x2_t scales = chunk_scales(d + g, xd + g, G);
            acc.val[0] = vfmaq_f32(acc.val[0], vcvtq_f32_s32(sums.val[0]), scales.val[0]);
            acc.val[1] = vfmaq_f32(acc.val[1], vcvtq_f32_s32(sums.val[1]), scales.val[1]);
            for (int j = g; j < g + G; j++) rest += f16_to_f32(m[j]) * xs[j];
            g += G, q += 4 * bits * G, xq += 32 * G;
        }
    /* x86's hsum8 of v = acc + mins: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)) */
    float32x4_t v = vaddq_f32(vaddq_f32(acc.val[0], mins.val[0]), vaddq_f32(acc.val[1], mins.val[1]));
    float32x2_t pairs = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return (vget_lane_f32(pairs, 0) + vget_lane_f32(pairs, 1)) + rest;
}

/* cpu_native.c's plain quantize_groups_q8, a group of 32 at a time in vectors: the same max,
 * the same fp32 product rounded half to even (vcvtnq_s32_f32, nearbyintf's default mode), the
 * same scales. */
void quantize_groups_q8(const uint16_t *x, int rows, int k, int8_t *xq, float *xd, float *xs) {
    int groups = k / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int start = 0, G = 8; start < groups; start += G) {
            while (start + G > groups) G /= 2;
            int8_t *chunk = xq + r * k + start * 32;
            for (int j = 0; j < G; j++) {
                int g = start + j;
                const uint16_t *xg = x + r * k + g * 32;
                float32x4_t v[8], top = vdupq_n_f32(0.0f);
                for (int i = 0; i < 8; i++) { /* bf16 to fp32: the bits shifted up */
                    v[i] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(xg + 4 * i), 16));
                    top = vmaxnmq_f32(top, vabsq_f32(v[i])); /* (maxnm: a NaN skipped, as the C compare does) */
                }
                float amax = vmaxnmvq_f32(top), inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                int32x4_t sum = vdupq_n_s32(0);
                int8_t values[32];
                for (int i = 0; i < 8; i += 2) {
                    int32x4_t a = vcvtnq_s32_f32(vmulq_f32(v[i], vdupq_n_f32(inv)));
                    int32x4_t b = vcvtnq_s32_f32(vmulq_f32(v[i + 1], vdupq_n_f32(inv)));
                    sum = vaddq_s32(sum, vaddq_s32(a, b));
                    vst1_s8(values + 4 * i, vmovn_s16(vcombine_s16(vmovn_s32(a), vmovn_s32(b))));
                }
                for (int u = 0; u < 8; u++) memcpy(chunk + 4 * (G * u + j), values + 4 * u, 4); /* unit u, step u */
                xd[r * groups + g] = amax / 127.0f;
                xs[r * groups + g] = amax / 127.0f * (float)vaddvq_s32(sum);
            }
        }
}
