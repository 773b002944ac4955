// Shared-memory tiled matmul for GPUs. A workgroup of (BN/TN) x (BM/TM) threads computes a BM x BN
// block of C, staging BK-deep slices of op(A) and op(B) in shared memory; each thread keeps a TM x TN
// register tile on a strided grid (thread tx owns columns tx, tx + BN/TN, ...), so shared reads and
// C stores of neighbouring threads are neighbouring addresses. Loads are scalar and bounds-checked
// (zero outside), so any shape and alignment works. F16_TILES (precision fp16) stages the slices
// as fp16: the inputs are rounded once, products of two fp16 values are exact in fp32 and the sums
// stay fp32 — the numerics of the cooperative-matrix kernel, on any device with shaderFloat16.
#ifdef F16_TILES
#define TILE float16_t
#else
#define TILE float
#endif
shared TILE sa[BK][BM + 1];   // +1: column-wise stores of a transposed slice avoid bank conflicts
shared TILE sb[BK][BN + 1];
layout(std430, binding = 0) writeonly buffer CBuf { float c_data[]; };

void main() {
    const uint nthreads = gl_WorkGroupSize.x * gl_WorkGroupSize.y;
    const uint tid = gl_LocalInvocationIndex;
    const uint tx = gl_LocalInvocationID.x, ty = gl_LocalInvocationID.y;
    const uint m0 = gl_WorkGroupID.y * BM, n0 = gl_WorkGroupID.x * BN;
    const uint z = gl_WorkGroupID.z;
    const uint a0 = z * pc.stride_a, b0 = z * pc.stride_b;

    float acc[TM][TN];
    [[unroll]] for (int i = 0; i < TM; i++) [[unroll]] for (int j = 0; j < TN; j++) acc[i][j] = 0.0;

    for (uint k0 = 0; k0 < pc.K; k0 += BK) {
        for (uint e = tid; e < BM * BK; e += nthreads) {
            const uvec2 s = a_slot(e);
            sa[s.y][s.x] = TILE(load_a(a0, m0 + s.x, k0 + s.y));
        }
        for (uint e = tid; e < BN * BK; e += nthreads) {
            const uvec2 s = b_slot(e);
            sb[s.y][s.x] = TILE(load_b(b0, k0 + s.y, n0 + s.x));
        }
        barrier();
        [[unroll]] for (int kk = 0; kk < BK; kk++) {
            float a[TM], b[TN];
            [[unroll]] for (int i = 0; i < TM; i++) a[i] = float(sa[kk][ty + i * (BM / TM)]);
            [[unroll]] for (int j = 0; j < TN; j++) b[j] = float(sb[kk][tx + j * (BN / TN)]);
            [[unroll]] for (int i = 0; i < TM; i++)
                [[unroll]] for (int j = 0; j < TN; j++) acc[i][j] = fma(a[i], b[j], acc[i][j]);
        }
        barrier();
    }

    const uint c0 = z * pc.stride_c;
    [[unroll]] for (int i = 0; i < TM; i++) {
        const uint row = m0 + ty + i * (BM / TM);
        [[unroll]] for (int j = 0; j < TN; j++) {
            const uint col = n0 + tx + j * (BN / TN);
            if (row < pc.M && col < pc.N) c_data[c0 + row * pc.N + col] = C_OUT(acc[i][j], row, col);
        }
    }
}
