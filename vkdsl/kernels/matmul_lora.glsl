// A LoRA layer's low-rank term, added to a quantized matmul's output as it is stored (LORA):
//   form nt (TB = 1): C = X . W^T + s U V     V (rank x N) row-major: the adapter's B
//   form nn (TB = 0): C = X . W   + s U V^T   V (N x rank) row-major: the adapter's A
// N is C's column count in both forms. U (M x rank) is x A in the forward and dy B^T in the input
// gradient: narrow products the adapter's own gradients need anyway, so what the fusion saves is
// the wide one (M x rank x N, written and read back in full) and the add. rank % 4 == 0; in form
// nt N % 4 == 0 too. Bindings LORA_BIND (U) and LORA_BIND + 1 (V); the push block is MatmulPush
// with the rank and s after it (host format "<6IIf", asserted in ops/quant/kernels.py).
layout(push_constant) uniform MatmulPush {
    uint M, N, K;
    uint stride_a, stride_b, stride_c;
    uint rank;
    float scale;
} pc;
layout(std430, binding = LORA_BIND) readonly buffer LoraU { vec4 lora_u[]; };
layout(std430, binding = LORA_BIND + 1) readonly buffer LoraV { vec4 lora_v[]; };

// s (U L)[row, col] for one element, L = V (nt) or V^T (nn): the GPU kernels' stores.
float lora_at(uint row, uint col) {
    const uint r4 = pc.rank / 4u;
    vec4 t = vec4(0.0);
    for (uint j4 = 0; j4 < r4; j4++) {
        const vec4 u = lora_u[min(row, pc.M - 1u) * r4 + j4];
#if TB
        const uint c = min(col, pc.N - 1u), q = c / 4u, e = c % 4u;
        t += u * vec4(lora_v[(4u * j4) * (pc.N / 4u) + q][e],
                      lora_v[(4u * j4 + 1u) * (pc.N / 4u) + q][e],
                      lora_v[(4u * j4 + 2u) * (pc.N / 4u) + q][e],
                      lora_v[(4u * j4 + 3u) * (pc.N / 4u) + q][e]);
#else
        t += u * lora_v[min(col, pc.N - 1u) * r4 + j4];
#endif
    }
    return pc.scale * (t.x + t.y + t.z + t.w);
}
#define C_OUT(v, row, col) ((v) + lora_at(row, col))

#if !defined(VARIANT_GPU) && !defined(VARIANT_COOP)
// acc += s (U L) over a CPU kernel's TM x TN tile at (row0, col0), four ranks a step: TM + TN
// vec4 loads a step, against the TM x TN/4 tile's rank x TM x TN multiply-adds.
void lora_tile(inout vec4 acc[TM][TN / 4], uint row0, uint col0) {
    const uint r4 = pc.rank / 4u;
    for (uint j4 = 0; j4 < r4; j4++) {
        vec4 u[TM];
        for (int i = 0; i < TM; i++) u[i] = pc.scale * lora_u[min(row0 + i, pc.M - 1u) * r4 + j4];
#if TB
        // rows 4 j4 .. 4 j4 + 3 of V at the tile's columns (clamped: columns past N store nothing)
        vec4 v[4][TN / 4];
        for (int jj = 0; jj < 4; jj++)
            for (int j = 0; j < TN / 4; j++)
                v[jj][j] = lora_v[(4u * j4 + jj) * (pc.N / 4u) + min(col0 / 4u + j, pc.N / 4u - 1u)];
        for (int i = 0; i < TM; i++)
            for (int j = 0; j < TN / 4; j++)
                acc[i][j] += u[i].x * v[0][j] + u[i].y * v[1][j] + u[i].z * v[2][j]
                             + u[i].w * v[3][j];
#else
        // rows col0 .. col0 + TN - 1 of V, four ranks of each
        vec4 v[TN / 4][4];
        for (int j = 0; j < TN / 4; j++)
            for (int e = 0; e < 4; e++) v[j][e] = lora_v[min(col0 + 4 * j + e, pc.N - 1u) * r4 + j4];
        for (int i = 0; i < TM; i++)
            for (int j = 0; j < TN / 4; j++)
                acc[i][j] += vec4(dot(u[i], v[j][0]), dot(u[i], v[j][1]), dot(u[i], v[j][2]),
                                  dot(u[i], v[j][3]));
#endif
    }
}
#endif
