// The per-invocation C tile of the register-blocked CPU kernels (matmul_lvp.glsl, qmatmul_lvp.glsl):
// TM rows x TN columns, both contiguous, as TM x TN/4 vec4 accumulators.
//
// The CPU kernels carry no [[unroll]] hints: spirv-opt's unroller (glslc -O) took 65 s and 22 GB
// on qmatmul and 4 s on matmul, while lavapipe's NIR unrolls these constant-trip loops itself
// (same speed, 0.1 s in glslc). NIR force-unrolls a loop (<= 32 trips) whose loop variable directly
// indexes a local array; any loop left rolled would turn its arrays into per-lane memory loops. So
// register arrays are indexed by loop variables (or constants), never by expressions of them.
#define KB 8

#if SV == 4
layout(std430, binding = 0) writeonly buffer CBuf { vec4 c_data[]; };
#else
layout(std430, binding = 0) writeonly buffer CBuf { float c_data[]; };
#endif

// The tile this invocation computes, at C[row0.., col0..]: tiles are numbered row by row over the
// whole of C, one per invocation in the order of the (x, then folded y) grid, so only the last
// workgroup has idle lanes. lavapipe runs a workgroup's x invocations as its SIMD lanes, so a 2-D
// grid of 8-invocation rows kept every lane past the last column busy on nothing: a quarter of
// the work of a 576-column product at TN = 32. Tiles past the end clamp their loads and store
// nothing.
void tile_origin(out uint row0, out uint col0) {
    const uint tiles_n = (pc.N + TN - 1) / TN;
    const uint t = gl_GlobalInvocationID.x
                   + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    row0 = (t / tiles_n) * TM;
    col0 = (t % tiles_n) * TN;
}

// acc[i][j] += sum over kk of a[i][kk] * b[kk][j]: k innermost, so each accumulator takes its KB
// multiply-adds in a row and stays in a register.
void tile_fma(inout vec4 acc[TM][TN / 4], float a[TM][KB], vec4 b[KB][TN / 4]) {
    for (int i = 0; i < TM; i++) {
        for (int j = 0; j < TN / 4; j++) {
            vec4 s = acc[i][j];
            for (int kk = 0; kk < KB; kk++) s += a[i][kk] * b[kk][j];
            acc[i][j] = s;
        }
    }
}

// C[z][row0 + i, col0 + j] = acc, masked to M x N; vec4 stores when SV == 4 (N % 4 == 0).
void tile_store(vec4 acc[TM][TN / 4], uint row0, uint col0, uint c0) {
    for (int i = 0; i < TM; i++) {
        const uint row = row0 + i;
        for (int j = 0; j < TN / 4; j++) {
            const uint col = col0 + 4 * j;
#if SV == 4
            if (row < pc.M && col < pc.N) c_data[(c0 + row * pc.N + col) / 4] = acc[i][j];
#else
            for (int v = 0; v < 4; v++)
                if (row < pc.M && col + v < pc.N) c_data[c0 + row * pc.N + col + v] = acc[i][j][v];
#endif
        }
    }
}
