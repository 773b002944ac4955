// Register-blocked matmul for CPU drivers (lavapipe runs 8 invocations as one 8-wide SIMD program;
// shared memory and barriers are slow there, so none are used). Each invocation owns a TM x TN tile
// of C (TM rows and TN columns, contiguous) and walks K in blocks of KB = 8:
//   1. load TM x 8 values of op(A) and 8 x TN of op(B) in VEC-wide chunks along the stored
//      contiguous dimension: loads are the expensive part on lavapipe (a loop over lanes each);
//   2. give each accumulator its 8 FMAs in a row (k innermost), so it stays in a register.
// Loops over register arrays index them directly by the loop variable: that is what makes
// lavapipe's NIR unroll them fully (see matmul_tile.glsl), so the arrays stay in registers.
// Edges: indices are clamped into the tensor, so nothing is read out of bounds (VEC divides the
// contiguous dimensions, so a chunk is wholly inside or clamped to the last one); k >= K is zeroed
// in A so clamped values add nothing; stores are masked.
#include "matmul_tile.glsl"

void main() {
    const uint M = pc.M, N = pc.N, K = pc.K;
    uint row0, col0;
    tile_origin(row0, col0);
    const uint z = gl_WorkGroupID.z;
    const uint a0 = z * pc.stride_a, b0 = z * pc.stride_b;

    vec4 acc[TM][TN / 4];
    for (int i = 0; i < TM; i++)
        for (int j = 0; j < TN / 4; j++) acc[i][j] = vec4(0.0);

    const uint nblk = (K + KB - 1) / KB;
    for (uint kb = 0; kb < nblk; kb++) {
        const uint k0 = kb * KB;
        float a[TM][KB];       // op(A)[row0 + i, k0 + kk]
        vec4 b[KB][TN / 4];    // op(B)[k0 + kk, col0 + 4j .. 4j+3]
        float t[VEC];
#if TA == 0
        // A stored M x K: chunks along k, one row at a time
        for (int i = 0; i < TM; i++) {
            const uint base = a0 + min(row0 + i, M - 1) * K;
            for (int c = 0; c < KB / VEC; c++) {
                unpack_chunk(A_AT((base + min(k0 + c * VEC, K - VEC)) / VEC), t);
                for (int v = 0; v < VEC; v++) a[i][c * VEC + v] = t[v];
            }
        }
#else
        // A stored K x M: chunks along m, one k at a time
        for (int kk = 0; kk < KB; kk++) {
            const uint base = a0 + min(k0 + kk, K - 1) * M;
            for (int c = 0; c < TM / VEC; c++) {
                unpack_chunk(A_AT((base + min(row0 + c * VEC, M - VEC)) / VEC), t);
                for (int v = 0; v < VEC; v++) a[c * VEC + v][kk] = t[v];
            }
        }
#endif
#if TB == 0
        // B stored K x N: chunks along n, one k at a time
        for (int kk = 0; kk < KB; kk++) {
            const uint base = b0 + min(k0 + kk, K - 1) * N;
            for (int c = 0; c < TN / VEC; c++) {
                unpack_chunk(B_AT((base + min(col0 + c * VEC, N - VEC)) / VEC), t);
                for (int v = 0; v < VEC; v++) b[kk][(c * VEC + v) / 4][(c * VEC + v) % 4] = t[v];
            }
        }
#else
        // B stored N x K: chunks along k, one column (j4, jj) at a time
        for (int j4 = 0; j4 < TN / 4; j4++) {
            for (int jj = 0; jj < 4; jj++) {
                const uint base = b0 + min(col0 + 4 * j4 + jj, N - 1) * K;
                for (int c = 0; c < KB / VEC; c++) {
                    unpack_chunk(B_AT((base + min(k0 + c * VEC, K - VEC)) / VEC), t);
                    for (int v = 0; v < VEC; v++) b[c * VEC + v][j4][jj] = t[v];
                }
            }
        }
#endif
        for (int kk = 0; kk < KB; kk++) {
            const bool live = k0 + kk < K;
            for (int i = 0; i < TM; i++) a[i][kk] = live ? a[i][kk] : 0.0;
        }
        tile_fma(acc, a, b);
    }

    tile_store(acc, row0, col0, z * pc.stride_c);
}
