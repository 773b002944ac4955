// op(A)[m, k] and op(B)[k, n] of the shared-memory kernels (matmul_gpu.glsl, matmul_coop.glsl),
// zero outside the matrix; qmatmul.comp defines CUSTOM_LOAD_B and its own dequantizing load_b.
float load_a(uint a0, uint m, uint k) {      // op(A)[m, k]
    if (m >= pc.M || k >= pc.K) return 0.0;
#if TA == 0
    return a_data[a0 + m * pc.K + k];
#else
    return a_data[a0 + k * pc.M + m];
#endif
}

#ifndef CUSTOM_LOAD_B
float load_b(uint b0, uint k, uint n) {      // op(B)[k, n]
    if (k >= pc.K || n >= pc.N) return 0.0;
#if TB == 0
    return b_data[b0 + k * pc.N + n];
#else
    return b_data[b0 + n * pc.K + k];
#endif
}
#endif
