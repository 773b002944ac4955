#version 450
// Few-row quantized matmul (decode: M <= MV_ROWS): C (M x N) = X (M x K) . W^T. One invocation
// per output column n walks W's row n in 32-element ranges; the X values it multiplies are the
// same for every lane, so a whole row of W streams through once for all M rows.
// Bindings: 0 = C, 1 = X, 2.. = the format's arrays. MatmulPush: M, N, K (rest unused).
// QTEXEL (CPU drivers): X and W read as uniform texel buffers. llvmpipe 22.3 proves no storage
// load inside the loop uniform, and turns each into a loop over the SIMD lanes; a texel fetch is
// one vector gather (SmolLM2's decode products, X through storage loads: 1.2-2.5x the time).
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
#include "matmul_common.glsl"
layout(std430, binding = 0) writeonly buffer C_ { float c_out[]; };
#ifdef QTEXEL
layout(binding = 1) uniform samplerBuffer x_tex;
#define X_AT(i) texelFetch(x_tex, int(i))
#else
layout(std430, binding = 1) readonly buffer X_ { vec4 x_in[]; };
#define X_AT(i) x_in[i]
#endif
#define QB0 2
#include "quant_formats.glsl"

// Each invocation owns NR columns, so every X load feeds NR rows of W.
const int NR = 4;

void main() {
    const uint n0 = NR * (gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x);
    const uint M = pc.M, N = pc.N, K = pc.K;
    float acc[MV_ROWS][NR];
    [[unroll]] for (int m = 0; m < MV_ROWS; m++)
        [[unroll]] for (int c = 0; c < NR; c++) acc[m][c] = 0.0;
    for (uint r = 0u; r < K / 32u; r++) {
        [[unroll]] for (int m = 0; m < MV_ROWS; m++) {
            if (uint(m) < M) {
                const uint xb = (uint(m) * K + 32u * r) / 4u;
                vec4 x[8];
                [[unroll]] for (int v = 0; v < 8; v++) x[v] = X_AT(xb + v);
                [[unroll]] for (int c = 0; c < NR; c++) {
                    Q32 q;
                    q32_load(min(n0 + c, N - 1u), r, K, q);   // clamp: spare columns read a valid row
                    vec4 s = vec4(0.0);
                    [[unroll]] for (int v = 0; v < 8; v++)
                        s += x[v] * vec4(q32_get(q, 4 * v), q32_get(q, 4 * v + 1), q32_get(q, 4 * v + 2), q32_get(q, 4 * v + 3));
                    acc[m][c] += s.x + s.y + s.z + s.w;
                }
            }
        }
    }
    [[unroll]] for (int c = 0; c < NR; c++) {
        if (n0 + c < N) {
            [[unroll]] for (int m = 0; m < MV_ROWS; m++)
                if (uint(m) < M) c_out[m * N + n0 + c] = acc[m][c];
        }
    }
}
