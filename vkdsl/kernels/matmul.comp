#version 450
// fp32 matmul, C[z] = op(A[z]) . op(B[z]) (see matmul_common.glsl for the layout contract).
// Defines: TA, TB (0/1: A stored K x M, B stored N x K), and one variant: VARIANT_GPU (shared-memory
// tiles; with F16_TILES, fp16 inputs and fp32 accumulation), VARIANT_COOP (cooperative matrices,
// fp16 inputs and fp32 accumulation; CM, CN, CK, WT, BK) or the register-blocked CPU-driver kernel
// (TM, TN per invocation, VEC-wide loads, SV-wide stores; TEXEL: A and B read as texel buffers).
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
layout(binding = 1) uniform samplerBuffer a_tex;
layout(binding = 2) uniform samplerBuffer b_tex;
#define A_AT(i) TEXEL_AT(a_tex, i)
#define B_AT(i) TEXEL_AT(b_tex, i)
#else
layout(std430, binding = 1) readonly buffer ABuf { CHUNK a_data[]; };
layout(std430, binding = 2) readonly buffer BBuf { CHUNK b_data[]; };
#define A_AT(i) a_data[i]
#define B_AT(i) b_data[i]
#endif

// (includes are inlined once, whatever the #if around them: the loads come first, for both)
#if defined(VARIANT_COOP) || defined(VARIANT_GPU)
#include "matmul_loads.glsl"
#endif
#ifdef VARIANT_COOP
#include "matmul_coop.glsl"
#elif defined(VARIANT_GPU)
#include "matmul_gpu.glsl"
#else
#include "matmul_lvp.glsl"
#endif
