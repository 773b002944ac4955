// Cooperative-matrix matmul (GL_KHR_cooperative_matrix): fp16 inputs, fp32 accumulation, on the
// matrix units of GPUs that have them. The workgroup's threads stage BK-deep slices of op(A) and
// op(B), rounded to fp16, in shared memory (bounds-checked like matmul_gpu.glsl, so any shape
// works); one subgroup multiplies them as WT x WT cooperative matrices of CM x CK by CK x CN, the
// driver's own shape (vkdsl.matmul reads it from vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR).
// The block of C goes through shared memory to bounds-checked stores. The workgroup is sized as
// one subgroup of the device's reported size; if the driver runs narrower subgroups, subgroup 0
// computes and the others only help to load, so the result does not depend on the lane count.
// BM = CM * WT and BN = CN * WT come with the defines (vkdsl.matmul), like the other variants'
shared float16_t sa[BM * BK];       // op(A) slice, row-major m x k
shared float16_t sb[BK * BN];       // op(B) slice, row-major k x n
shared float sc[BM * BN];           // the block of C
layout(std430, binding = 0) writeonly buffer CBuf { float c_data[]; };

void main() {
    const uint nthreads = gl_WorkGroupSize.x * gl_WorkGroupSize.y;
    const uint tid = gl_LocalInvocationIndex;
    const uint m0 = gl_WorkGroupID.y * BM, n0 = gl_WorkGroupID.x * BN;
    const uint z = gl_WorkGroupID.z;
    const uint a0 = z * pc.stride_a, b0 = z * pc.stride_b;
    const bool computes = gl_SubgroupID == 0u;

    coopmat<float, gl_ScopeSubgroup, CM, CN, gl_MatrixUseAccumulator> acc[WT][WT];
    [[unroll]] for (int i = 0; i < WT; i++) [[unroll]] for (int j = 0; j < WT; j++)
        acc[i][j] = coopmat<float, gl_ScopeSubgroup, CM, CN, gl_MatrixUseAccumulator>(0.0);

    for (uint k0 = 0; k0 < pc.K; k0 += BK) {
        for (uint e = tid; e < BM * BK; e += nthreads) {
            const uvec2 s = a_slot(e);
            sa[s.x * BK + s.y] = float16_t(load_a(a0, m0 + s.x, k0 + s.y));
        }
        for (uint e = tid; e < BK * BN; e += nthreads) {
            const uvec2 s = b_slot(e);
            sb[s.y * BN + s.x] = float16_t(load_b(b0, k0 + s.y, n0 + s.x));
        }
        barrier();
        if (computes) {
            [[unroll]] for (uint ks = 0; ks < BK; ks += CK) {
                coopmat<float16_t, gl_ScopeSubgroup, CM, CK, gl_MatrixUseA> fa[WT];
                coopmat<float16_t, gl_ScopeSubgroup, CK, CN, gl_MatrixUseB> fb[WT];
                [[unroll]] for (int i = 0; i < WT; i++)
                    coopMatLoad(fa[i], sa, i * CM * BK + ks, BK, gl_CooperativeMatrixLayoutRowMajor);
                [[unroll]] for (int j = 0; j < WT; j++)
                    coopMatLoad(fb[j], sb, ks * BN + j * CN, BN, gl_CooperativeMatrixLayoutRowMajor);
                [[unroll]] for (int i = 0; i < WT; i++) [[unroll]] for (int j = 0; j < WT; j++)
                    acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);
            }
        }
        barrier();
    }

    if (computes) {
        [[unroll]] for (int i = 0; i < WT; i++) [[unroll]] for (int j = 0; j < WT; j++)
            coopMatStore(acc[i][j], sc, i * CM * BN + j * CN, BN, gl_CooperativeMatrixLayoutRowMajor);
    }
    barrier();
    const uint c0 = z * pc.stride_c;
    for (uint e = tid; e < BM * BN; e += nthreads) {
        const uint row = m0 + e / BN, col = n0 + e % BN;
        if (row < pc.M && col < pc.N) c_data[c0 + row * pc.N + col] = C_OUT(sc[e], row, col);
    }
}
