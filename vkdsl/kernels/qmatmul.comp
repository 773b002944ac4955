#version 450
// Matmul with a quantized weight W (N_w x K_w, see quant_common.glsl), dequantized in the shader:
//   form nt (TB = 1): C (M x N_w) = X (M x K_w) . W^T   (forward of a linear layer)
//   form nn (TB = 0): C (M x K_w) = X (M x N_w) . W     (its input gradient)
// Push constants are MatmulPush with M, N, K = rows of C, columns of C, reduction length.
// Bindings: 0 = C, 1 = X (fp32, VEC-wide loads), 2.. = the format's arrays.
// Defines: FMT_Q4_0 | FMT_Q4_1 | FMT_Q8_0 | FMT_INT4 (+ INT4_F16) | FMT_NF4, TB, VEC, SV, and
// VARIANT_GPU (shared-memory tiles of matmul_gpu.glsl; F16_TILES: fp16 inputs, fp32 sums),
// VARIANT_COOP (cooperative matrices, matmul_coop.glsl) or the register-blocked TM x TN kernel
// (with TEXEL and QTEXEL: X and the weight read as uniform texel buffers).
#extension GL_EXT_control_flow_attributes : require
#if defined(F16_TILES) || defined(VARIANT_COOP)
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#endif
#ifdef VARIANT_COOP
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#endif
#include "matmul_common.glsl"
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

#ifdef TEXEL
layout(binding = 1) uniform samplerBuffer a_tex;    // with QTEXEL, the weight's arrays too
#define A_AT(i) TEXEL_AT(a_tex, i)
#else
layout(std430, binding = 1) readonly buffer ABuf { CHUNK a_data[]; };
#define A_AT(i) a_data[i]
#endif

#define QB0 2
#include "quant_formats.glsl"

#define TA 0
#if defined(VARIANT_GPU) || defined(VARIANT_COOP)
// op(B)[k, n], one dequantized element at a time (staged in shared memory, so read once per block)
#define CUSTOM_LOAD_B
float load_b(uint b0, uint k, uint n) {
    if (k >= pc.K || n >= pc.N) return 0.0;
    Q32 q;
#if TB
    q32_load(n, k / 32u, pc.K, q);       // W[n, k]
    return q32_get(q, int(k % 32u));
#else
    q32_load(k, n / 32u, pc.N, q);       // W[k, n]
    return q32_get(q, int(n % 32u));
#endif
}
#include "matmul_loads.glsl"
#ifdef VARIANT_COOP
#include "matmul_coop.glsl"
#else
#include "matmul_gpu.glsl"
#endif
#else
#include "qmatmul_lvp.glsl"
#endif
