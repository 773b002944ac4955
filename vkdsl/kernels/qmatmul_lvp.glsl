// Register-blocked quantized matmul for CPU drivers: the scheme of matmul_lvp.glsl (a TM x TN tile
// per invocation, k-blocks of 8 with k innermost), with op(B) dequantized from W in registers.
// A 4-bit range of 32 weights costs one 16-byte load plus its scale(s), against four 32-byte loads
// for the same weights in fp32, so the quantized kernel loads less than the fp32 one; the extra
// work is ~3 vector ops per weight per invocation, spread over TM rows of X. Measured on lavapipe
// (python -m vkdsl.quant): Q4_1 nt at M=256, K=576, N=1536 in 0.93x the fp32 nt kernel's time.
#include "matmul_tile.glsl"

void main() {
    const uint M = pc.M, N = pc.N, K = pc.K;
    uint row0, col0;
    tile_origin(row0, col0);
    const uint a0 = gl_WorkGroupID.z * pc.stride_a;

    vec4 acc[TM][TN / 4];
    for (int i = 0; i < TM; i++)
        for (int j = 0; j < TN / 4; j++) acc[i][j] = vec4(0.0);
    float t[VEC];

#if TB
    // nt: C = X . W^T, W is N x K. Walk K in 32-element ranges (K % 32 == 0); each column's
    // quantized range is loaded once and dequantized 8 weights at a time.
    const uint nr = K / 32u;
    for (uint r = 0; r < nr; r++) {
        Q32 q[TN / 4][4];
        for (int j4 = 0; j4 < TN / 4; j4++)
            for (int jj = 0; jj < 4; jj++) q32_load(min(col0 + 4 * j4 + jj, N - 1), r, K, q[j4][jj]);
        // a rolled loop (its body is large): e = KB * s + kk is a uniform, not a constant, here
        for (int s = 0; s < 32 / KB; s++) {
            float a[TM][KB];
            vec4 b[KB][TN / 4];
            for (int i = 0; i < TM; i++) {
                const uint base = a0 + min(row0 + i, M - 1) * K + 32u * r + KB * s;
                for (int c = 0; c < KB / VEC; c++) {
                    unpack_chunk(A_AT((base + c * VEC) / VEC), t);
                    for (int v = 0; v < VEC; v++) a[i][c * VEC + v] = t[v];
                }
            }
            for (int kk = 0; kk < KB; kk++)
                for (int j4 = 0; j4 < TN / 4; j4++)
                    for (int jj = 0; jj < 4; jj++) b[kk][j4][jj] = q32_get(q[j4][jj], KB * s + kk);
            tile_fma(acc, a, b);
        }
    }
#else
    // nn: C = X . W, W is K x N here (K = W's rows, the reduction; N = its row length, N % 32 == 0).
    // The TN = 32 columns of an invocation are one range of each row of W.
#if TN != 32
#error qmatmul nn needs TN == 32
#endif
    const uint r = min(col0 / 32u, N / 32u - 1u);
    const uint nblk = (K + KB - 1) / KB;
    for (uint kb = 0; kb < nblk; kb++) {
        const uint k0 = kb * KB;
        float a[TM][KB];
        vec4 b[KB][TN / 4];
        for (int i = 0; i < TM; i++) {
            const uint base = a0 + min(row0 + i, M - 1) * K;
            for (int c = 0; c < KB / VEC; c++) {
                unpack_chunk(A_AT((base + min(k0 + c * VEC, K - VEC)) / VEC), t);
                for (int v = 0; v < VEC; v++) a[i][c * VEC + v] = t[v];
            }
        }
        for (int kk = 0; kk < KB; kk++) {
            const bool live = k0 + kk < K;
            for (int i = 0; i < TM; i++) a[i][kk] = live ? a[i][kk] : 0.0;
            Q32 q;
            q32_load(min(k0 + kk, K - 1), r, N, q);
            for (int e4 = 0; e4 < 8; e4++)
                for (int ee = 0; ee < 4; ee++) b[kk][e4][ee] = q32_get(q, 4 * e4 + ee);
        }
        tile_fma(acc, a, b);
    }
#endif
#ifdef LORA
    lora_tile(acc, row0, col0);
#endif
    tile_store(acc, row0, col0, gl_WorkGroupID.z * pc.stride_c);
}
