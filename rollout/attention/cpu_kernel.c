/* Decode attention on CPU in one call per layer: every decode row's query heads over its group's shared
 * prefix and its own suffix, with one softmax over both (no partial results to merge).
 *
 * Built at first use by rollout/attention/cpu_kernel.py with the system C compiler and called through ctypes.
 * Keys are stored transposed, [dim][positions], so that a query's scores vectorize over positions (a dot
 * product over a short head dimension would need a horizontal sum per score); values stay [positions][dim],
 * so that the weighted sum vectorizes over the head dimension. A group's prefix is read by each of its rows in
 * turn while it sits in the cache. Accumulation is in float32, as in the CPU flash-attention kernel.
 */

#include <math.h>
#include <stdint.h>

#define BLOCK 16 /* positions scored together (one vector); capacities are multiples of it */

/* 16 floats: GCC lowers these to whatever vector width the machine has (-march=native). */
typedef float vec __attribute__((vector_size(64)));
typedef float vec_unaligned __attribute__((vector_size(64), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(64)));

static inline vec load(const float *p) { return *(const vec_unaligned *)p; }
static inline void store(float *p, vec v) { *(vec_unaligned *)p = v; }
static inline vec splat(float x) { return (vec){0} + x; }
/* Where `mask` (all ones or zeros per lane), a; elsewhere b. */
static inline vec select(ivec mask, vec a, vec b) { return (vec)(((ivec)a & mask) | ((ivec)b & ~mask)); }

/* exp(x) for x <= 0 (scores minus their maximum): 2^n e^r with |r| <= ln2/2, a degree-6 polynomial for e^r
 * (relative error ~2e-7) and the power of two built in the exponent bits. Below -87 (under float32's
 * smallest normal number) it returns 0. */
static inline vec exp_nonpositive(vec x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float round = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    const ivec under = x >= -87.0f;   /* all ones where x is in range */
    x = select(under, x, splat(-87.0f));
    const vec n = (x * log2e + round) - round;
    const vec r = x - n * ln2_hi - n * ln2_lo;
    vec p = splat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    return (vec)((ivec)(p * (vec)bits) & under);
}

/* Scores of G queries `qs` [G][D] against `len` keys `kt` [D][cap] into s[g * stride + ...], UNROLL blocks of
 * BLOCK positions at a time while they last, then one (the last block's extra scores land in the scratch's
 * room and are never read). The unrolled blocks give the FMA units independent sums to work on. */
#define UNROLL 4
static inline __attribute__((always_inline)) void score(
    const float *restrict qs, const float *restrict kt, int32_t len, int64_t cap, const int G, const int D,
    float *restrict s, int64_t stride)
{
    int32_t l0 = 0;
    for (; l0 + UNROLL * BLOCK <= len; l0 += UNROLL * BLOCK) {
        vec acc[G][UNROLL];
        for (int g = 0; g < G; g++)
            for (int u = 0; u < UNROLL; u++) acc[g][u] = (vec){0};
        for (int d = 0; d < D; d++) {
            vec k[UNROLL];
            for (int u = 0; u < UNROLL; u++) k[u] = load(kt + d * cap + l0 + u * BLOCK);
            for (int g = 0; g < G; g++)
                for (int u = 0; u < UNROLL; u++) acc[g][u] += qs[g * D + d] * k[u];
        }
        for (int g = 0; g < G; g++)
            for (int u = 0; u < UNROLL; u++) store(s + g * stride + l0 + u * BLOCK, acc[g][u]);
    }
    for (; l0 < len; l0 += BLOCK) {
        vec acc[G];
        for (int g = 0; g < G; g++) acc[g] = (vec){0};
        for (int d = 0; d < D; d++) {
            const vec k = load(kt + d * cap + l0);
            for (int g = 0; g < G; g++) acc[g] += qs[g * D + d] * k;
        }
        for (int g = 0; g < G; g++) store(s + g * stride + l0, acc[g]);
    }
}

/* Softmax numerators in place over s[0 .. len) (padded with -inf to the block): returns their sum, or NaN
 * where a score is NaN or +inf. */
static inline __attribute__((always_inline)) float exponentiate(float *restrict s, int32_t len) {
    const int32_t padded = (len + BLOCK - 1) / BLOCK * BLOCK;
    for (int32_t l = len; l < padded; l++) s[l] = -INFINITY;
    /* The max lets a NaN in, so that a NaN or +inf score makes the row NaN, as SDPA's softmax does, instead
     * of a finite result that hides it (exp(x - max) is masked to 0 below -87, and for NaN). */
    vec top = splat(-INFINITY);
    for (int32_t l = 0; l < padded; l += BLOCK) {
        const vec x = load(s + l);
        top = select((x > top) | (x != x), x, top);
    }
    float m = top[0];
    for (int i = 1; i < BLOCK; i++) m = top[i] > m || top[i] != top[i] ? top[i] : m;
    if (m != m || m > 3.40282347e38f) return NAN;
    vec sum = (vec){0};
    for (int32_t l = 0; l < padded; l += BLOCK) {
        const vec e = exp_nonpositive(load(s + l) - m);
        store(s + l, e);
        sum += e;
    }
    float total = 0.0f;
    for (int i = 0; i < BLOCK; i++) total += sum[i];
    return total;
}

/* acc[g][:] += sum over l < len of p[g * stride + l] * v[l][:] (D / BLOCK vectors per query), UNROLL
 * positions at a time into UNROLL separate sums. */
static inline __attribute__((always_inline)) void weigh(
    const float *restrict p, int64_t stride, const float *restrict v, int32_t len, const int G, const int D,
    vec *restrict acc)
{
    const int W = D / BLOCK;
    int32_t l = 0;
    for (; l + UNROLL <= len; l += UNROLL) {
        const float *restrict vl = v + (int64_t)l * D;
        for (int w = 0; w < W; w++) {
            vec x[UNROLL];
            for (int u = 0; u < UNROLL; u++) x[u] = load(vl + u * D + w * BLOCK);
            for (int g = 0; g < G; g++)
                for (int u = 0; u < UNROLL; u++) acc[(g * W + w) * UNROLL + u] += p[g * stride + l + u] * x[u];
        }
    }
    for (; l < len; l++) {
        const float *restrict vl = v + (int64_t)l * D;
        for (int w = 0; w < W; w++) {
            const vec x = load(vl + w * BLOCK);
            for (int g = 0; g < G; g++) acc[(g * W + w) * UNROLL] += p[g * stride + l] * x;
        }
    }
}

/* One decode row and KV head: its G query heads q (head stride q_head) over `plen` prefix positions and
 * `slen` suffix positions -> out [G][D]. `s` is scratch of G * (pcap + scap + BLOCK) floats. */
static inline __attribute__((always_inline)) void attend(
    const float *restrict q, int64_t q_head, float scale,
    const float *restrict pkt, const float *restrict pv, int32_t plen, int64_t pcap,
    const float *restrict skt, const float *restrict sv, int32_t slen, int64_t scap,
    const int G, const int D, float *restrict out, float *restrict s)
{
    const int W = D / BLOCK;
    float qs[G * D];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) qs[g * D + d] = q[g * q_head + d] * scale;
    const int64_t stride = pcap + scap + BLOCK;
    if (plen > 0) score(qs, pkt, plen, pcap, G, D, s, stride);
    score(qs, skt, slen, scap, G, D, s + plen, stride); /* after the prefix: it overwrites its padding */
    float total[G];
    for (int g = 0; g < G; g++) total[g] = exponentiate(s + g * stride, plen + slen);
    vec acc[G * W * UNROLL];
    for (int i = 0; i < G * W * UNROLL; i++) acc[i] = (vec){0};
    if (plen > 0) weigh(s, stride, pv, plen, G, D, acc);
    weigh(s + plen, stride, sv, slen, G, D, acc);
    for (int g = 0; g < G; g++) {
        /* NaN stays NaN (a poisoned row); a row of no positions gives zeros. */
        const float inv = total[g] != total[g] ? NAN : total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
        for (int w = 0; w < W; w++) {
            const vec *sums = acc + (g * W + w) * UNROLL;
            vec sum = sums[0];
            for (int u = 1; u < UNROLL; u++) sum += sums[u];
            store(out + g * D + w * BLOCK, sum * inv);
        }
    }
}

typedef struct {
    const float *q;
    int64_t q_row, q_head;
    const float *pkt, *pv; /* prefix keys [groups, kv heads, D, pcap] and values [groups, kv heads, pcap, D] */
    int64_t pkt_group, pkt_head, pv_group, pv_head;
    const int32_t *prefix_len; /* [groups] */
    const int32_t *row_group;  /* [rows]: the row's group, or -1 for no prefix */
    const float *skt, *sv;     /* suffix keys [rows, kv heads, D, scap] and values [rows, kv heads, scap, D] */
    int64_t skt_row, skt_head, sv_row, sv_head;
    const int32_t *suffix_len; /* [rows] */
    float *out;                /* [rows, kv heads * G, D], contiguous */
    float *scratch;
    int64_t pcap, scap;
    int32_t rows, kv_heads;
    float scale;
} Args;

#define DEFINE(G, D)                                                                                             \
    static void rows_##G##_##D(const Args *a) {                                                                  \
        /* Head by head, so that the rows of a group read one head's prefix in turn while it is in L1. */   \
        for (int32_t h = 0; h < a->kv_heads; h++) {                                                              \
            for (int32_t b = 0; b < a->rows; b++) {                                                              \
                const int32_t group = a->row_group ? a->row_group[b] : -1;                                       \
                const int32_t plen = group >= 0 ? a->prefix_len[group] : 0;                                      \
                const float *pkt = plen ? a->pkt + group * a->pkt_group + h * a->pkt_head : 0;                   \
                const float *pv = plen ? a->pv + group * a->pv_group + h * a->pv_head : 0;                       \
                attend(a->q + b * a->q_row + (int64_t)h * G * a->q_head, a->q_head, a->scale, pkt, pv, plen,     \
                       a->pcap, a->skt + b * a->skt_row + h * a->skt_head, a->sv + b * a->sv_row + h * a->sv_head, \
                       a->suffix_len[b], a->scap, G, D, a->out + ((int64_t)b * a->kv_heads + h) * G * D,         \
                       a->scratch);                                                                              \
            }                                                                                                    \
        }                                                                                                        \
    }
#define DEFINE_DIMS(G) DEFINE(G, 16) DEFINE(G, 32) DEFINE(G, 64) DEFINE(G, 128)
DEFINE_DIMS(1)
DEFINE_DIMS(2)
DEFINE_DIMS(4)
DEFINE_DIMS(8)

/* Returns 0, or 1 for a (query heads per KV head, head dim) pair it has no code for. */
int cascade_decode(
    const float *q, int64_t q_row, int64_t q_head,
    const float *pkt, const float *pv, int64_t pkt_group, int64_t pkt_head, int64_t pv_group, int64_t pv_head,
    const int32_t *prefix_len, const int32_t *row_group,
    const float *skt, const float *sv, int64_t skt_row, int64_t skt_head, int64_t sv_row, int64_t sv_head,
    const int32_t *suffix_len, float *out, float *scratch, int64_t pcap, int64_t scap,
    int32_t rows, int32_t kv_heads, int32_t q_per_kv, int32_t dim, float scale)
{
    const Args a = {q, q_row, q_head, pkt, pv, pkt_group, pkt_head, pv_group, pv_head, prefix_len, row_group,
                    skt, sv, skt_row, skt_head, sv_row, sv_head, suffix_len, out, scratch, pcap, scap, rows,
                    kv_heads, scale};
#define CASE(G, D)                     \
    if (q_per_kv == G && dim == D) {   \
        rows_##G##_##D(&a);            \
        return 0;                      \
    }
#define CASE_DIMS(G) CASE(G, 16) CASE(G, 32) CASE(G, 64) CASE(G, 128)
    CASE_DIMS(1)
    CASE_DIMS(2)
    CASE_DIMS(4)
    CASE_DIMS(8)
    return 1;
}
