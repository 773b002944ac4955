#version 450
// fp32 matmul, C[z] = op(A[z]) . op(B[z]) (see matmul_common.glsl for the layout contract).
// Defines: TA, TB (0/1: A stored K x M, B stored N x K), VARIANT_GPU (shared-memory tiles) or the
// register-blocked CPU-driver kernel (TM, TN per invocation, VEC-wide loads, SV-wide stores).
#extension GL_EXT_control_flow_attributes : require
#include "matmul_common.glsl"
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;

layout(std430, binding = 1) readonly buffer ABuf { CHUNK a_data[]; };
layout(std430, binding = 2) readonly buffer BBuf { CHUNK b_data[]; };

#ifdef VARIANT_GPU
#include "matmul_gpu.glsl"
#else
#include "matmul_lvp.glsl"
#endif
