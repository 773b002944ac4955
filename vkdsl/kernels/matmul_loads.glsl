// op(A)[m, k] and op(B)[k, n] of the shared-memory kernels (matmul_gpu.glsl, matmul_coop.glsl),
// zero outside the matrix, and where each load lands in their slices (BM, BN, BK defined before);
// qmatmul.comp defines CUSTOM_LOAD_B and its own dequantizing load_b.
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

// Which element of a BK-deep slice the e-th load of a workgroup stages: consecutive e read
// consecutive addresses of the operand's stored layout. (r, kk): row of the block of C and step
// along K for op(A); (c, kk): column of the block of C and step along K for op(B).
uvec2 a_slot(uint e) { return TA == 0 ? uvec2(e / BK, e % BK) : uvec2(e % BM, e / BM); }
uvec2 b_slot(uint e) { return TB == 0 ? uvec2(e % BN, e / BN) : uvec2(e / BK, e % BK); }
