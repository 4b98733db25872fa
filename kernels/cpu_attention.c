/* Paged K/V store and decode attention for CPU ranks, bf16 caches, one thread per call.
 *
 * Built and loaded by kernels/cpu_attention.py (the host's C compiler, -O3 -march=native); the
 * same contracts as store_kv_ref and paged_decode_attention in kernels/paged_attention.py, for a
 * decode step of few sequences, where each torch op of those paths costs more host time than the
 * arithmetic (a batch-1 SmolLM2 layer spent ~35 us in them, for ~1 us of math).
 *
 * bf16 is the upper half of an IEEE float32: widening is a shift; narrowing rounds to nearest even.
 * Scores, softmax and the weighted sum are float32 (torch's CPU flash attention does the same), the
 * output is rounded to bf16 once.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define MAX_GROUP 8        /* query heads per KV head; kernels/cpu_attention.py checks both limits */
#define MAX_HEAD_DIM 256

static inline float widen(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline uint16_t narrow(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);   /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* e^x for x <= 0 (softmax terms), branch-free so that the loop over a row vectorizes:
 * 2^(x log2 e) = 2^n 2^f, n = round, |f| <= 1/2, 2^f by its degree-6 Taylor polynomial
 * (relative error < 3e-7, below float32's 6e-8 x the 5 roundings of the sum that follows). */
static inline float exp_nonpositive(float x) {
    float t = x * 1.44269504088896341f;
    t = t < -126.0f ? -126.0f : t;
    const float n = __builtin_roundf(t);
    const float f = (t - n) * 0.69314718055994531f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The rows of block start / block_size of one sequence (its block table `table`) for KV head kvh: row
 * i of the block is at the result + i * num_kv * head_dim. */
static inline const uint16_t *block_rows(const uint16_t *cache, const int32_t *table, int64_t start,
                                         int64_t block_size, int64_t num_kv, int64_t kvh, int64_t head_dim) {
    return cache + ((int64_t)table[start / block_size] * block_size * num_kv + kvh) * head_dim;
}

/* attention of decode_attention (below), head_dim a constant where the caller passes one */
static inline __attribute__((always_inline)) void attend(
        const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
        const int32_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, uint16_t *out, int64_t batch,
        int64_t num_heads, int64_t num_kv, const int64_t head_dim, int64_t block_size, float scale, float *scratch) {
    const int64_t group = num_heads / num_kv;
    const int64_t row = num_kv * head_dim;               /* elements between two positions of a block */
    float qf[MAX_GROUP][MAX_HEAD_DIM];                   /* a KV head's query heads, widened and scaled */
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float kf[MAX_HEAD_DIM];
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t length = seq_lens[b];
        const int32_t *table = block_tables + b * max_blocks;
        for (int64_t kvh = 0; kvh < num_kv; ++kvh) {
            float maxes[MAX_GROUP], sums[MAX_GROUP];
            for (int64_t g = 0; g < group; ++g) {
                const uint16_t *src = q + b * q_stride + (kvh * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) qf[g][d] = widen(src[d]) * scale;
                maxes[g] = -INFINITY;
                memset(acc[g], 0, sizeof(float) * (size_t)head_dim);
            }
            /* scores: one pass over the keys, block by block, for all G query heads */
            for (int64_t start = 0; start < length; start += block_size) {
                const uint16_t *keys = block_rows(k_cache, table, start, block_size, num_kv, kvh, head_dim);
                const int64_t count = length - start < block_size ? length - start : block_size;
                for (int64_t i = 0; i < count; ++i) {
                    const uint16_t *key = keys + i * row;
                    for (int64_t d = 0; d < head_dim; ++d) kf[d] = widen(key[d]);
                    for (int64_t g = 0; g < group; ++g) {
                        float lanes[LANES] = {0};
                        int64_t d = 0;
                        for (; d + LANES <= head_dim; d += LANES)
                            for (int j = 0; j < LANES; ++j) lanes[j] += qf[g][d + j] * kf[d + j];
                        float score = 0.0f;
                        for (int j = 0; j < LANES; ++j) score += lanes[j];
                        for (; d < head_dim; ++d) score += qf[g][d] * kf[d];
                        scratch[g * length + start + i] = score;
                        maxes[g] = score > maxes[g] ? score : maxes[g];
                    }
                }
            }
            for (int64_t g = 0; g < group; ++g) {
                float *scores = scratch + g * length, sum = 0.0f;
                for (int64_t t = 0; t < length; ++t) scores[t] = exp_nonpositive(scores[t] - maxes[g]);
                for (int64_t t = 0; t < length; ++t) sum += scores[t];
                sums[g] = sum;
            }
            /* weighted sum of the values, block by block */
            for (int64_t start = 0; start < length; start += block_size) {
                const uint16_t *values = block_rows(v_cache, table, start, block_size, num_kv, kvh, head_dim);
                const int64_t count = length - start < block_size ? length - start : block_size;
                for (int64_t i = 0; i < count; ++i) {
                    const uint16_t *value = values + i * row;
                    for (int64_t d = 0; d < head_dim; ++d) kf[d] = widen(value[d]);
                    for (int64_t g = 0; g < group; ++g) {
                        const float p = scratch[g * length + start + i];
                        for (int64_t d = 0; d < head_dim; ++d) acc[g][d] += p * kf[d];
                    }
                }
            }
            for (int64_t g = 0; g < group; ++g) {
                uint16_t *dst = out + (b * num_heads + kvh * group + g) * head_dim;
                const float inv = sums[g] > 0.0f ? 1.0f / sums[g] : 0.0f;   /* no keys: zeros, as torch's */
                for (int64_t d = 0; d < head_dim; ++d) dst[d] = narrow(acc[g][d] * inv);
            }
        }
    }
}

/* One query token per sequence over its paged K/V.
 * q [B, H, D] (token stride q_stride, heads contiguous), caches [num_blocks, block_size, Hkv, D],
 * block_tables [B, max_blocks] int32, seq_lens [B] int64 (keys per sequence, this step's included),
 * out [B, H, D] contiguous, scratch >= G * max(seq_lens) floats. Query head h reads KV head h / G.
 * With slots (else NULL), this step's K/V rows k_new, v_new [B, Hkv, D] (token strides k_stride,
 * v_stride) are first stored at cache slots[b] (negative: skipped), as store_kv_ref does.
 * Returns 0, or -1 without touching anything when an index is out of range (a slot past the cache,
 * a sequence longer than max_seq_len or than its block table, a block id outside the cache): the
 * torch path raises there, and a raw read or write past the buffers would corrupt memory. */
int decode_attention(const uint16_t *q, int64_t q_stride, uint16_t *k_cache, uint16_t *v_cache, int64_t num_blocks,
                     const int32_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int64_t max_seq_len,
                     uint16_t *out, int64_t batch, int64_t num_heads, int64_t num_kv, int64_t head_dim,
                     int64_t block_size, float scale, float *scratch, const uint16_t *k_new, int64_t k_stride,
                     const uint16_t *v_new, int64_t v_stride, const int64_t *slots) {
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t length = seq_lens[b];
        if (length < 0 || length > max_seq_len || length > max_blocks * block_size) return -1;
        for (int64_t i = 0; i * block_size < length; ++i) {
            const int32_t block = block_tables[b * max_blocks + i];
            if (block < 0 || block >= num_blocks) return -1;
        }
        if (slots && slots[b] >= num_blocks * block_size) return -1;
    }
    if (slots) {
        const size_t bytes = (size_t)(num_kv * head_dim) * sizeof(uint16_t);
        for (int64_t b = 0; b < batch; ++b) {
            if (slots[b] < 0) continue;
            memcpy(k_cache + slots[b] * num_kv * head_dim, k_new + b * k_stride, bytes);
            memcpy(v_cache + slots[b] * num_kv * head_dim, v_new + b * v_stride, bytes);
        }
    }
    /* the common head sizes as constants: fixed trip counts, no remainder loops per key */
    if (head_dim == 64)
        attend(q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, out, batch, num_heads, num_kv, 64,
               block_size, scale, scratch);
    else if (head_dim == 128)
        attend(q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, out, batch, num_heads, num_kv, 128,
               block_size, scale, scratch);
    else
        attend(q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, out, batch, num_heads, num_kv,
               head_dim, block_size, scale, scratch);
    return 0;
}
