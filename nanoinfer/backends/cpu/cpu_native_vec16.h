/* The vector type the interleaved-row kernels run on: 16 rows' lanes in one AVX-512 register, 8 in an AVX2 one, 4 in
 * a NEON one.
 *
 * A matrix's rows interleaved 16 at a time at load (kquants.interleave, BlockWeight.interleave) store each
 * 4-byte unit of the 16 rows together, 64 bytes. With AVX-512 VNNI (and BW, VL) a kv_i holds the whole unit;
 * otherwise (AVX2, AVX-VNNI) it holds 8 rows' half of it, `half` 0 or 1 choosing which, and on ARM NEON 4 rows'
 * quarter (V16_LANES rows a vector); the kernels run each group in 16 / V16_LANES passes. cpu_native_kquants_rows16.h and
 * cpu_native_groups_rows16.h are written once against these: the integer sums and the fp32 operations of each
 * row's lane are the same on both widths, so are its bits.
 */

#ifndef CPU_NATIVE_VEC16_H
#define CPU_NATIVE_VEC16_H

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define V16_LANES 16
typedef __m512i kv_i;
typedef __m512 kv_f;
static inline kv_i kv_load(const uint8_t *g, int unit, int half) {
    (void)half;
    return _mm512_loadu_si512((const void *)(g + 64 * unit));
}
static inline kv_i kv_set1_8(int c) { return _mm512_set1_epi8((char)c); }
static inline kv_i kv_set1_32(int v) { return _mm512_set1_epi32(v); }
static inline kv_i kv_zero(void) { return _mm512_setzero_si512(); }
static inline kv_i kv_and(kv_i a, kv_i b) { return _mm512_and_si512(a, b); }
static inline kv_i kv_or(kv_i a, kv_i b) { return _mm512_or_si512(a, b); }
static inline kv_i kv_add(kv_i a, kv_i b) { return _mm512_add_epi32(a, b); }
static inline kv_i kv_sub(kv_i a, kv_i b) { return _mm512_sub_epi32(a, b); }
static inline kv_i kv_mullo(kv_i a, kv_i b) { return _mm512_mullo_epi32(a, b); }
static inline kv_i kv_srli16(kv_i a, int n) { return _mm512_srli_epi16(a, n); }
static inline kv_i kv_slli16(kv_i a, int n) { return _mm512_slli_epi16(a, n); }
static inline kv_i kv_srli32(kv_i a, int n) { return _mm512_srli_epi32(a, n); }
static inline kv_i kv_slli32(kv_i a, int n) { return _mm512_slli_epi32(a, n); }
static inline kv_i kv_srai32(kv_i a, int n) { return _mm512_srai_epi32(a, n); }
static inline kv_i kv_dpbusd(kv_i acc, kv_i u, kv_i s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline kv_i kv_dpbusd8(kv_i acc, kv_i u, kv_i s) { return _mm512_dpbusd_epi32(acc, u, s); }
/* int16 pairs: each int32 lane plus a[2i] b[2i] + a[2i + 1] b[2i + 1] */
static inline kv_i kv_dpwssd(kv_i acc, kv_i a, kv_i b) { return _mm512_dpwssd_epi32(acc, a, b); }
static inline kv_f kv_fmadd_ps(kv_f a, kv_f b, kv_f c) { return _mm512_fmadd_ps(a, b, c); }
static inline kv_f kv_cvt(kv_i a) { return _mm512_cvtepi32_ps(a); }
static inline kv_f kv_set1_ps(float v) { return _mm512_set1_ps(v); }
static inline kv_f kv_zero_ps(void) { return _mm512_setzero_ps(); }
static inline kv_f kv_mul_ps(kv_f a, kv_f b) { return _mm512_mul_ps(a, b); }
static inline kv_f kv_add_ps(kv_f a, kv_f b) { return _mm512_add_ps(a, b); }
static inline kv_f kv_sub_ps(kv_f a, kv_f b) { return _mm512_sub_ps(a, b); }
static inline void kv_store_ps(float *p, kv_f a) { _mm512_storeu_ps(p, a); }
static inline kv_f kv_load_ps(const float *p, int half) {
    (void)half;
    return _mm512_loadu_ps(p);
}
/* the fp16 in each lane's low (which 0) or high (1) half, as fp32 */
static inline kv_f kv_half_f16(kv_i a, int which) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(a, 16 * which)));
}
/* 16 fp16 at p (this half's lanes) */
static inline kv_f kv_load_f16(const uint16_t *p, int half) {
    (void)half;
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define V16_LANES 8
typedef __m256i kv_i;
typedef __m256 kv_f;
static inline kv_i kv_load(const uint8_t *g, int unit, int half) {
    return _mm256_loadu_si256((const __m256i *)(g + 64 * unit + 32 * half));
}
static inline kv_i kv_set1_8(int c) { return _mm256_set1_epi8((char)c); }
static inline kv_i kv_set1_32(int v) { return _mm256_set1_epi32(v); }
static inline kv_i kv_zero(void) { return _mm256_setzero_si256(); }
static inline kv_i kv_and(kv_i a, kv_i b) { return _mm256_and_si256(a, b); }
static inline kv_i kv_or(kv_i a, kv_i b) { return _mm256_or_si256(a, b); }
static inline kv_i kv_add(kv_i a, kv_i b) { return _mm256_add_epi32(a, b); }
static inline kv_i kv_sub(kv_i a, kv_i b) { return _mm256_sub_epi32(a, b); }
static inline kv_i kv_mullo(kv_i a, kv_i b) { return _mm256_mullo_epi32(a, b); }
static inline kv_i kv_srli16(kv_i a, int n) { return _mm256_srli_epi16(a, n); }
static inline kv_i kv_slli16(kv_i a, int n) { return _mm256_slli_epi16(a, n); }
static inline kv_i kv_srli32(kv_i a, int n) { return _mm256_srli_epi32(a, n); }
static inline kv_i kv_slli32(kv_i a, int n) { return _mm256_slli_epi32(a, n); }
static inline kv_i kv_srai32(kv_i a, int n) { return _mm256_srai_epi32(a, n); }
/* 4 unsigned x signed byte products into each int32 lane: AVX-VNNI's vpdpbusd, or AVX2's vpmaddubsw (exact here:
 * values < 64, |x| <= 127, a pair within 2 * 63 * 127 < 32767) and a vpmaddwd by ones */
static inline kv_i kv_dpbusd(kv_i acc, kv_i u, kv_i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
/* the same for bytes of 8 bits: whole on AVX-VNNI; on AVX2 (a pair of 255 x 127 products would saturate int16) its
 * high nibbles' sums times 16 plus its low ones' */
static inline kv_i kv_dpbusd8(kv_i acc, kv_i u, kv_i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    kv_i low = _mm256_set1_epi8(0x0f);
    kv_i hi = kv_dpbusd(_mm256_setzero_si256(), _mm256_and_si256(_mm256_srli_epi16(u, 4), low), s);
    return kv_dpbusd(_mm256_add_epi32(acc, _mm256_slli_epi32(hi, 4)), _mm256_and_si256(u, low), s);
#endif
}
static inline kv_i kv_dpwssd(kv_i acc, kv_i a, kv_i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#if !defined(__AVXVNNI__)
/* Q4_K's/Q5_K's pair sums kept in int16 over 4 units, widened once (kq16_dot): a unit's vpmaddubsw and a vpaddw
 * in place of kv_dpbusd's three instructions (exact: |4 units' pair sums| <= 4 * 2 * 31 * 127 < 32767) */
#define KV_PAIRS16 1
#endif
static inline kv_f kv_cvt(kv_i a) { return _mm256_cvtepi32_ps(a); }
static inline kv_f kv_fmadd_ps(kv_f a, kv_f b, kv_f c) { return _mm256_fmadd_ps(a, b, c); }
static inline kv_f kv_set1_ps(float v) { return _mm256_set1_ps(v); }
static inline kv_f kv_zero_ps(void) { return _mm256_setzero_ps(); }
static inline kv_f kv_mul_ps(kv_f a, kv_f b) { return _mm256_mul_ps(a, b); }
static inline kv_f kv_add_ps(kv_f a, kv_f b) { return _mm256_add_ps(a, b); }
static inline kv_f kv_sub_ps(kv_f a, kv_f b) { return _mm256_sub_ps(a, b); }
static inline void kv_store_ps(float *p, kv_f a) { _mm256_storeu_ps(p, a); }
static inline kv_f kv_load_ps(const float *p, int half) { return _mm256_loadu_ps(p + 8 * half); }
static inline kv_f kv_half_f16(kv_i a, int which) {
    kv_i v = _mm256_and_si256(_mm256_srli_epi32(a, 16 * which), _mm256_set1_epi32(0xffff));
    kv_i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08); /* lanes 0-7's words in the low 128 bits */
    return _mm256_cvtph_ps(_mm256_castsi256_si128(words));
}
static inline kv_f kv_load_f16(const uint16_t *p, int half) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8 * half)));
}
#endif

#if defined(__aarch64__) && defined(__ARM_NEON) /* (4 rows a 128-bit register: each group in 4 passes) */
#define V16_LANES 4
typedef int32x4_t kv_i;
typedef float32x4_t kv_f;
static inline kv_i kv_load(const uint8_t *g, int unit, int quarter) {
    return vreinterpretq_s32_u8(vld1q_u8(g + 64 * unit + 16 * quarter));
}
static inline kv_i kv_set1_8(int c) { return vreinterpretq_s32_u8(vdupq_n_u8((uint8_t)c)); }
static inline kv_i kv_set1_32(int v) { return vdupq_n_s32(v); }
static inline kv_i kv_zero(void) { return vdupq_n_s32(0); }
static inline kv_i kv_and(kv_i a, kv_i b) { return vandq_s32(a, b); }
static inline kv_i kv_or(kv_i a, kv_i b) { return vorrq_s32(a, b); }
static inline kv_i kv_add(kv_i a, kv_i b) { return vaddq_s32(a, b); }
static inline kv_i kv_sub(kv_i a, kv_i b) { return vsubq_s32(a, b); }
static inline kv_i kv_mullo(kv_i a, kv_i b) { return vmulq_s32(a, b); }
static inline kv_i kv_srli16(kv_i a, int n) {
    return vreinterpretq_s32_u16(vshlq_u16(vreinterpretq_u16_s32(a), vdupq_n_s16((int16_t)-n)));
}
static inline kv_i kv_slli16(kv_i a, int n) {
    return vreinterpretq_s32_u16(vshlq_u16(vreinterpretq_u16_s32(a), vdupq_n_s16((int16_t)n)));
}
static inline kv_i kv_srli32(kv_i a, int n) {
    return vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a), vdupq_n_s32(-n)));
}
static inline kv_i kv_slli32(kv_i a, int n) { return vshlq_s32(a, vdupq_n_s32(n)); }
static inline kv_i kv_srai32(kv_i a, int n) { return vshlq_s32(a, vdupq_n_s32(-n)); }
/* 4 unsigned x signed byte products into each int32 lane: cpu_native_arm.h's dot16 (USDOT, SDOT, or SMULL and
 * pairwise adds; bytes below 128, as the K-quants' and 4-bit groups' values are) */
static inline kv_i kv_dpbusd(kv_i acc, kv_i u, kv_i s) {
    return dot16(acc, vreinterpretq_u8_s32(u), vreinterpretq_s8_s32(s));
}
/* bytes of 8 bits: the high nibbles' sums times 16 plus the low ones' (as the file layout's chunk_dot) */
static inline kv_i kv_dpbusd8(kv_i acc, kv_i u, kv_i s) {
    kv_i low = kv_set1_8(0x0f);
    kv_i hi = kv_dpbusd(kv_zero(), kv_and(kv_srli16(u, 4), low), s);
    return kv_dpbusd(kv_add(acc, kv_slli32(hi, 4)), kv_and(u, low), s);
}
static inline kv_f kv_cvt(kv_i a) { return vcvtq_f32_s32(a); }
static inline kv_f kv_fmadd_ps(kv_f a, kv_f b, kv_f c) { return vfmaq_f32(c, a, b); } /* (one rounding, as FMA) */
static inline kv_f kv_set1_ps(float v) { return vdupq_n_f32(v); }
static inline kv_f kv_zero_ps(void) { return vdupq_n_f32(0.0f); }
static inline kv_f kv_mul_ps(kv_f a, kv_f b) { return vmulq_f32(a, b); }
static inline kv_f kv_add_ps(kv_f a, kv_f b) { return vaddq_f32(a, b); }
static inline kv_f kv_sub_ps(kv_f a, kv_f b) { return vsubq_f32(a, b); }
static inline void kv_store_ps(float *p, kv_f a) { vst1q_f32(p, a); }
static inline kv_f kv_half_f16(kv_i a, int which) {
    uint16x4_t words = vmovn_u32(vshlq_u32(vreinterpretq_u32_s32(a), vdupq_n_s32(-16 * which)));
    return vcvt_f32_f16(vreinterpret_f16_u16(words));
}
static inline kv_f kv_load_f16(const uint16_t *p, int quarter) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * quarter)));
}
#endif

#endif /* CPU_NATIVE_VEC16_H */
