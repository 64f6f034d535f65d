/* K-quant dot products on ARM NEON (plain, dotprod, i8mm): the super-blocks dotted as stored, values taken out in registers.
 *
 * cpu_native_kquants.h includes this on aarch64 with NEON, as it includes
 * cpu_native_kquants_x86.h on x86: kquant_rows_dot for its KQ_ROWS loop. Each 16 stored bytes
 * give their values by and/shift (Q4_K's nibbles, Q5_K's fifth bit, Q6_K's two high bits),
 * dotted against the int8 activations by cpu_native_arm.h's dot16 (SDOT, USDOT, or SMULL and
 * pairwise adds: the values are below 64, so signed bytes hold them); a sub-block's lane sum
 * times its scale is added in int32 (exact, as on every tier), then per super-block in order
 * acc += (xd d) sumi - (xd dmin) summ in fp32 as the plain code rounds it. The scales and mins
 * come from scale_min_k4 (a few integer operations a super-block); one row a pass. Tested
 * under qemu against the torch reference and the x86 build (tests/test_cpu_native_arm.py).
 */

#define KQ_ROWS 1
#define KQ_TOKENS 1

/* sum of one sub-block's products: n16 loads of 16 values against x */
static inline int kq_dot(const uint8x16_t *v, const int8_t *x, int n16) {
    int32x4_t a = vdupq_n_s32(0);
    for (int i = 0; i < n16; i++) a = dot16(a, v[i], vld1q_s8(x + 16 * i));
    return vaddvq_s32(a);
}

static float kq45_row(const uint8_t *w, int type, int blocks, const int8_t *xq, const float *xd, const int16_t *bs32) {
    const int bytes = type == 12 ? 144 : 176, qs_at = type == 12 ? 16 : 48;
    const uint8x16_t low4 = vdupq_n_u8(0x0f), bit = vdupq_n_u8(0x10);
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++, w += bytes) {
        const int8_t *x = xq + b * QK_K;
        int32_t sc[8], m[8];
        scale_min_k4(w + 4, sc, m);
        int summ = 0, sumi = 0;
        for (int j = 0; j < 8; j++) summ += m[j] * bs32[b * 8 + j];
        uint8x16_t qh[2] = {vld1q_u8(w + 16), vld1q_u8(w + 32)};
        for (int c = 0; c < 4; c++) { /* 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high */
            uint8x16_t lo[2], hi[2];
            for (int i = 0; i < 2; i++) {
                uint8x16_t v = vld1q_u8(w + qs_at + 32 * c + 16 * i);
                lo[i] = vandq_u8(v, low4), hi[i] = vshrq_n_u8(v, 4);
                if (type == 13) { /* bit 4 of sub-block j's value l: bit j of qh[l] */
                    lo[i] = vorrq_u8(lo[i], vandq_u8(vshlq_u8(qh[i], vdupq_n_s8((int8_t)(4 - 2 * c))), bit));
                    hi[i] = vorrq_u8(hi[i], vandq_u8(vshlq_u8(qh[i], vdupq_n_s8((int8_t)(3 - 2 * c))), bit));
                }
            }
            sumi += sc[2 * c] * kq_dot(lo, x + 64 * c, 2) + sc[2 * c + 1] * kq_dot(hi, x + 64 * c + 32, 2);
        }
        float d = half_to_float((uint16_t)(w[0] | w[1] << 8)), dmin = half_to_float((uint16_t)(w[2] | w[3] << 8));
        acc += (xd[b] * d) * (float)sumi - (xd[b] * dmin) * (float)summ;
    }
    return acc;
}

static float kq6_row(const uint8_t *w, int blocks, const int8_t *xq, const float *xd, const int16_t *bs16) {
    const uint8x16_t low4 = vdupq_n_u8(0x0f), two = vdupq_n_u8(0x30);
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++, w += 210) {
        const int8_t *x = xq + b * QK_K, *sc = (const int8_t *)w + 192;
        int offset = 0, sumi = 0;
        for (int s = 0; s < 16; s++) offset += sc[s] * bs16[b * 16 + s];
        for (int h = 0; h < 2; h++) { /* a half of 128 values: ql[64], qh[32] */
            const uint8_t *ql = w + 64 * h, *qhp = w + 128 + 32 * h;
            for (int i = 0; i < 2; i++) { /* values 16 i .. 16 i + 15 of each quarter */
                uint8x16_t l0 = vld1q_u8(ql + 16 * i), l1 = vld1q_u8(ql + 32 + 16 * i), qh = vld1q_u8(qhp + 16 * i);
                uint8x16_t v[4] = {vorrq_u8(vandq_u8(l0, low4), vandq_u8(vshlq_n_u8(qh, 4), two)),
                                   vorrq_u8(vandq_u8(l1, low4), vandq_u8(vshlq_n_u8(qh, 2), two)),
                                   vorrq_u8(vshrq_n_u8(l0, 4), vandq_u8(qh, two)),
                                   vorrq_u8(vshrq_n_u8(l1, 4), vandq_u8(vshrq_n_u8(qh, 2), two))};
                for (int g = 0; g < 4; g++) { /* quarter g: values 32 g .. 32 g + 31 of the half */
                    int s = 8 * h + 2 * g + i;
                    sumi += sc[s] * kq_dot(&v[g], x + 128 * h + 32 * g + 16 * i, 1);
                }
            }
        }
        sumi -= 32 * offset;
        acc += (xd[b] * half_to_float((uint16_t)(w[208] | w[209] << 8))) * (float)sumi;
    }
    return acc;
}

/* R rows (R <= KQ_ROWS) of `type` against T tokens (T <= KQ_TOKENS; cpu_native_kquants_x86.h's signature) */
static void kquant_rows_dot(const uint8_t *w, int64_t row_bytes, int R, int T, int type, int blocks, kq_tokens x,
                            float *out) {
    for (int t = 0; t < T && t < KQ_TOKENS; t++)
        for (int r = 0; r < R && r < KQ_ROWS; r++)
            out[t * KQ_ROWS + r] = type == 14 ? kq6_row(w + r * row_bytes, blocks, x.xq + t * x.k, x.xd + t * x.blocks,
                                                        x.bs16 + t * x.k / 16)
                                              : kq45_row(w + r * row_bytes, type, blocks, x.xq + t * x.k,
                                                         x.xd + t * x.blocks, x.bs32 + t * x.k / 32);
}
