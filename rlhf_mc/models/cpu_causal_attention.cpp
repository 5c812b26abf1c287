// Causal attention over packed sequences on CPU, forward only: see cpu_causal_attention.py for why and how it is
// called. Built by runtime/host.py's build_library with -O3 -march=native -ffast-math -fopenmp (-ffast-math gives
// glibc's vectorized expf); no infinities are used, so finite-math is safe here.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cmath>

namespace {

constexpr int kQueryBlock = 64, kKeyBlock = 512;

// Row-major C = alpha op(A) op(B) + beta C over MKL's GEMMs, which torch's CPU library exports: the Fortran sgemm
// (column-major: the same product with the operands swapped) and the CBLAS bf16 x bf16 -> fp32 one.
struct GemmF32 {
  using Fn = void (*)(const char *, const char *, const int *, const int *, const int *, const float *, const float *,
                      const int *, const float *, const int *, const float *, float *, const int *);
  Fn fn;
  void operator()(bool ta, bool tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                  float beta, float *c, int ldc) const {
    const char tra = ta ? 'T' : 'N', trb = tb ? 'T' : 'N';
    fn(&trb, &tra, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  }
};
struct GemmBF16 {
  using Fn = void (*)(int, int, int, int, int, int, float, const uint16_t *, int, const uint16_t *, int, float, float *,
                      int);
  Fn fn;
  void operator()(bool ta, bool tb, int m, int n, int k, float alpha, const uint16_t *a, int lda, const uint16_t *b,
                  int ldb, float beta, float *c, int ldc) const {
    fn(101 /* row-major */, ta ? 112 : 111, tb ? 112 : 111, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
};

inline uint16_t to_bf16(float f) {  // round to nearest even (inputs are finite)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
inline void store(float *dst, float x) { *dst = x; }
inline void store(uint16_t *dst, float x) { *dst = to_bf16(x); }

// T: float or bfloat16 bits. q [tokens, heads, d], k/v [tokens, groups, d] (rows strided, heads dense), out like q.
// A block is kQueryBlock positions of one sequence for every head of a KV group, stacked (row j * rows + r: head j of
// the group at position m + r): one GEMM with the group's keys and one with its values serve them all.
template <typename T, typename Gemm>
void attend(Gemm gemm, const T *q, const T *k, const T *v, T *out, const int64_t *cu, int sequences, int heads,
            int groups, int d, int64_t sq, int64_t sk, int64_t sv, int64_t so, float scale) {
  const int per_group = heads / groups, stacked = per_group * kQueryBlock;
#pragma omp parallel
  {
    // per thread: the block's queries, its scores in fp32 and probabilities in T, the output accumulator, row max/sum
    T *queries = static_cast<T *>(std::malloc(sizeof(T) * stacked * (d + kKeyBlock)));
    T *probs = queries + stacked * d;
    float *scores = static_cast<float *>(std::malloc(sizeof(float) * stacked * (kKeyBlock + d + 2)));
    float *acc = scores + stacked * kKeyBlock, *row_max = acc + stacked * d, *row_sum = row_max + stacked;
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < int64_t(sequences) * groups; item++) {
      const int s = int(item / groups), g = int(item % groups);
      const int64_t start = cu[s];
      const int len = int(cu[s + 1] - start);
      const T *qg = q + start * sq + g * per_group * d, *kg = k + start * sk + g * d, *vg = v + start * sv + g * d;
      T *og = out + start * so + g * per_group * d;
      for (int m = 0; m < len; m += kQueryBlock) {
        const int rows = len - m < kQueryBlock ? len - m : kQueryBlock, all = per_group * rows;
        const int keys = m + rows;  // causal: the block's last position sees keys [0, m + rows)
        for (int j = 0; j < per_group; j++)
          for (int r = 0; r < rows; r++)
            std::memcpy(queries + (j * rows + r) * d, qg + (m + r) * sq + j * d, sizeof(T) * d);
        std::memset(acc, 0, sizeof(float) * all * d);
        for (int n = 0; n < keys; n += kKeyBlock) {
          const int cols = keys - n < kKeyBlock ? keys - n : kKeyBlock;
          gemm(false, true, all, cols, d, scale, queries, d, kg + n * sk, int(sk), 0.f, scores, kKeyBlock);
          for (int i = 0; i < all; i++) {
            const float *row = scores + i * kKeyBlock;
            T *p = probs + i * kKeyBlock;
            int visible = m + i % rows - n + 1;  // keys n .. its position
            if (visible > cols) visible = cols;
            if (visible <= 0) {  // only in a later key block: this row has seen all its keys
              std::memset(p, 0, sizeof(T) * cols);
              continue;
            }
            float mx = n ? row_max[i] : row[0];
            for (int j = 0; j < visible; j++) mx = row[j] > mx ? row[j] : mx;
            float sum = 0.f;
            for (int j = 0; j < visible; j++) {
              const float e = std::exp(row[j] - mx);
              sum += e;
              store(p + j, e);
            }
            std::memset(p + visible, 0, sizeof(T) * (cols - visible));
            if (n) {  // rescale what earlier key blocks gave this row
              const float c = std::exp(row_max[i] - mx);
              row_sum[i] = row_sum[i] * c + sum;
              for (int e = 0; e < d; e++) acc[i * d + e] *= c;
            } else {
              row_sum[i] = sum;
            }
            row_max[i] = mx;
          }
          gemm(false, false, all, d, cols, 1.f, probs, kKeyBlock, vg + n * sv, int(sv), 1.f, acc, d);
        }
        for (int i = 0; i < all; i++) {
          const float inv = 1.f / row_sum[i];
          T *o = og + (m + i % rows) * so + (i / rows) * d;
          for (int e = 0; e < d; e++) store(o + e, acc[i * d + e] * inv);
        }
      }
    }
    std::free(queries);
    std::free(scores);
  }
}

}  // namespace

extern "C" {

void causal_attention_f32(void *gemm, const float *q, const float *k, const float *v, float *out, const int64_t *cu,
                          int sequences, int heads, int groups, int d, int64_t sq, int64_t sk, int64_t sv, int64_t so,
                          float scale) {
  attend(GemmF32{reinterpret_cast<GemmF32::Fn>(gemm)}, q, k, v, out, cu, sequences, heads, groups, d, sq, sk, sv, so,
         scale);
}

void causal_attention_bf16(void *gemm, const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                           const int64_t *cu, int sequences, int heads, int groups, int d, int64_t sq, int64_t sk,
                           int64_t sv, int64_t so, float scale) {
  attend(GemmBF16{reinterpret_cast<GemmBF16::Fn>(gemm)}, q, k, v, out, cu, sequences, heads, groups, d, sq, sk, sv, so,
         scale);
}
}
