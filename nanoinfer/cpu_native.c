/* The CPU's fused layer pieces: what lies between a packed model's matmuls, one call each.
 *
 * On the CPU a torch op costs microseconds whatever its size, and a 135M model's layer is
 * ~60 of them around four matmuls. These functions do the element-wise work of a layer in
 * plain loops over contiguous rows: fp32 activations, bf16 where torch's packed matmuls read
 * or write, an fp32 KV pool. nanoinfer/cpu_native.py builds and binds them; its reference
 * (the torch ops they replace) is tested against them. Single-threaded: at a decode step's
 * sizes a thread hand-off costs more than the work.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's cast does (NaN stays a quiet NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* e^x to about 1 ulp (Cephes' expf polynomial), in plain arithmetic so loops of it vectorize
 * (libm's expf is a call per element). x is clamped to [-87, 88]: e^-87 stands in for 0. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (round-to-nearest, no libm call) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln 2 in two parts: r exact to fp32 */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

static float sum_squares(const float *x, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    return s;
}

/* out = bf16(w * (x * rsqrt(mean(x^2) + eps))) for each row: the norm before a matmul. */
void rms_norm_bf16(const float *x, const float *w, uint16_t *out, int rows, int dim, float eps) {
    for (int r = 0; r < rows; r++, x += dim, out += dim) {
        float inv = 1.0f / sqrtf(sum_squares(x, dim) / dim + eps);
        for (int i = 0; i < dim; i++) out[i] = f32_to_bf16(w[i] * (x[i] * inv));
    }
}

/* x_out = x + y (y the bf16 output of a matmul); h = bf16 rms_norm(x_out): residual and norm. */
void add_rms_norm_bf16(const float *x, const uint16_t *y, const float *w, float *x_out, uint16_t *h, int rows,
                       int dim, float eps) {
    for (int r = 0; r < rows; r++, x += dim, y += dim, x_out += dim, h += dim) {
        for (int i = 0; i < dim; i++) x_out[i] = x[i] + bf16_to_f32(y[i]);
        float inv = 1.0f / sqrtf(sum_squares(x_out, dim) / dim + eps);
        for (int i = 0; i < dim; i++) h[i] = f32_to_bf16(w[i] * (x_out[i] * inv));
    }
}

/* out = bf16(silu(gate) * up) for gate_up rows [gate (inter) | up (inter)], bf16. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter) {
    for (int r = 0; r < rows; r++, gate_up += 2 * inter, out += inter) {
#pragma omp simd
        for (int i = 0; i < inter; i++) {
            float g = bf16_to_f32(gate_up[i]);
            out[i] = f32_to_bf16(g / (1.0f + exp_approx(-g)) * bf16_to_f32(gate_up[inter + i]));
        }
    }
}

/* Per-head RMSNorm (Qwen3's q/k norm) in place. */
static void head_norm(float *x, const float *w, int d, float eps) {
    float inv = 1.0f / sqrtf(sum_squares(x, d) / d + eps);
    for (int i = 0; i < d; i++) x[i] = w[i] * (x[i] * inv);
}

/* Rotate-half RoPE of one head in place: (x1 cos - x2 sin, x2 cos + x1 sin). */
static void rope(float *x, const float *cos, const float *sin, int half) {
    for (int i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* From qkv rows [tokens, (heads + 2 kv_heads) d], bf16 or fp32 (qkv_bf16 0): q and k
 * normed per head (q_norm, k_norm, or NULL) and rotated by the token's cos/sin
 * [tokens, d / 2]; q to q_out [tokens, heads, d], k and v into the pool's flat slots
 * (k_pool, v_pool [slots, kv_heads, d]) at slots[t], -1 skipping the token. */
void rope_write(const void *qkv, int qkv_bf16, const float *q_norm, const float *k_norm, float eps,
                const float *cos, const float *sin, const int64_t *slots, int tokens, int heads, int kv_heads, int d,
                float *k_pool, float *v_pool, float *q_out) {
    int width = (heads + 2 * kv_heads) * d, half = d / 2;
    float row[width];
    for (int t = 0; t < tokens; t++, q_out += heads * d) {
        if (qkv_bf16)
            for (int i = 0; i < width; i++) row[i] = bf16_to_f32(((const uint16_t *)qkv)[(int64_t)t * width + i]);
        else
            memcpy(row, (const float *)qkv + (int64_t)t * width, sizeof(float) * width);
        for (int h = 0; h < heads + kv_heads; h++) {
            float *x = row + h * d;
            const float *norm = h < heads ? q_norm : k_norm;
            if (norm) head_norm(x, norm, d, eps);
            rope(x, cos + (int64_t)t * half, sin + (int64_t)t * half, half);
        }
        memcpy(q_out, row, sizeof(float) * heads * d);
        if (slots[t] >= 0) {
            memcpy(k_pool + slots[t] * kv_heads * d, row + heads * d, sizeof(float) * kv_heads * d);
            memcpy(v_pool + slots[t] * kv_heads * d, row + (heads + kv_heads) * d, sizeof(float) * kv_heads * d);
        }
    }
}

static inline float dot_n(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The common head sizes as constants: the loop unrolls into a few vector FMAs and one reduce. */
static inline float dot(const float *a, const float *b, int n) {
    if (n == 64) return dot_n(a, b, 64);
    if (n == 128) return dot_n(a, b, 128);
    return dot_n(a, b, n);
}

/* One query row q [heads, d] attends to the `keys` pool slots s (k_pool, v_pool
 * [slots, kv_heads, d]); out [heads, d]. The heads sharing a KV head go together, so each
 * key and value row is read once. scores: scratch of (heads / kv_heads) * keys floats. */
static void attend(const float *q, const float *k_pool, const float *v_pool, const int64_t *s, int64_t keys,
                   int heads, int kv_heads, int d, float scale, float *scores, float *out) {
    int group = heads / kv_heads;
    float inv[group];
    for (int kvh = 0; kvh < kv_heads; kvh++) {
        const float *qg = q + (int64_t)kvh * group * d;
        float *og = out + (int64_t)kvh * group * d;
        for (int64_t j = 0; j < keys; j++) {
            const float *k = k_pool + (s[j] * kv_heads + kvh) * d;
            for (int g = 0; g < group; g++) scores[g * keys + j] = dot(qg + g * d, k, d) * scale;
        }
        for (int g = 0; g < group; g++) {
            float *sc = scores + g * keys, m = -INFINITY, total = 0.0f;
            for (int64_t j = 0; j < keys; j++) m = sc[j] > m ? sc[j] : m;
#pragma omp simd reduction(+ : total)
            for (int64_t j = 0; j < keys; j++) total += sc[j] = exp_approx(sc[j] - m);
            inv[g] = 1.0f / total;
        }
        memset(og, 0, sizeof(float) * group * d);
        for (int64_t j = 0; j < keys; j++) {
            const float *v = v_pool + (s[j] * kv_heads + kvh) * d;
            for (int g = 0; g < group; g++) {
                float p = scores[g * keys + j] * inv[g], *o = og + g * d;
#pragma omp simd
                for (int c = 0; c < d; c++) o[c] += p * v[c];
            }
        }
    }
}

/* Decode rows among other rows: query row rows[i] (rows NULL: row i) of q [*, heads, d]
 * attends to the counts[i] slots at slots[i, 0..counts[i]); out like q. */
void decode_attention(const float *q, const float *k_pool, const float *v_pool, const int64_t *slots,
                      const int64_t *counts, const int64_t *rows, int n, int keys_stride, int heads, int kv_heads,
                      int d, float scale, float *scores, float *out) {
    for (int i = 0; i < n; i++) {
        int64_t row = rows ? rows[i] : i;
        attend(q + row * heads * d, k_pool, v_pool, slots + (int64_t)i * keys_stride, counts[i], heads, kv_heads, d,
               scale, scores, out + row * heads * d);
    }
}

/* A step of decodes only: row i is sequence i's last token, at position lens[i] - 1; it
 * attends to positions [max(0, lens[i] - window), lens[i]) (window 0: all), found through its
 * block table (row i of tables, int32, rows table_stride apart). slot_scratch: as many int64 as the longest context. */
void decode_attention_paged(const float *q, const float *k_pool, const float *v_pool, const int32_t *tables,
                            int64_t table_stride, const int32_t *lens, int n, int block_size, int window, int heads,
                            int kv_heads, int d, float scale, int64_t *slot_scratch, float *scores, float *out) {
    for (int i = 0; i < n; i++) {
        int64_t len = lens[i], lo = window > 0 && len > window ? len - window : 0;
        const int32_t *table = tables + i * table_stride;
        for (int64_t p = lo; p < len; p++)
            slot_scratch[p - lo] = (int64_t)table[p / block_size] * block_size + p % block_size;
        attend(q + (int64_t)i * heads * d, k_pool, v_pool, slot_scratch, len - lo, heads, kv_heads, d, scale, scores,
               out + (int64_t)i * heads * d);
    }
}
