#version 450
// Quantize fp32 W (N x K, K % 64 == 0) to vkdsl int4 on the device: per group of 64 along K,
// s = absmax * float32(1/7) (rounded to f16 with INT4_F16), code = clamp(roundEven(w / s), -8, 7) + 8.
// The float32 operations are those of vkdsl/quant.py quantize_int4, so both give the same bytes.
// Bindings: 0 = scales, 1 = codes (the int4 arrays), 2 = W (fp32).
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
#include "quant_push.glsl"
#if INT4_F16
layout(std430, binding = 0) writeonly buffer SOut { uint s_out[]; };
#else
layout(std430, binding = 0) writeonly buffer SOut { float s_out[]; };
#endif
layout(std430, binding = 1) writeonly buffer QOut { uvec4 q_out[]; };
layout(std430, binding = 2) readonly buffer WIn { vec4 w_in[]; };
#include "quant_pack_common.glsl"

// absmax / 7 as a multiply by the float32 reciprocal: compilers turn division by a constant into
// that multiply anyway (NIR does), so the host reference (quant.py) multiplies too.
const float INV7 = 0.142857149;

float quantize_group(uint g) {
    float w[64];
    float s = load_group(g, w) * INV7;
#if INT4_F16
    s = unpackHalf2x16(packHalf2x16(vec2(s, 0.0))).x;
#endif
    const float div = s > 0.0 ? s : 1.0;
    uint code[64];
    [[unroll]] for (int e = 0; e < 64; e++) code[e] = uint(clamp(roundEven(w[e] / div), -8.0, 7.0) + 8.0);
    uvec4 lo, hi;
    pack_ranges(code, lo, hi);
    q_out[2u * g] = lo;
    q_out[2u * g + 1u] = hi;
    return s;
}

void main() {
    const uint ngroups = qp.N * (qp.K / 64u), item = work_item();
#if INT4_F16
    // one invocation per pair of groups: their f16 scales share a word
    const uint g = 2u * item;
    if (g >= ngroups) return;
    const float s0 = quantize_group(g);
    float s1 = 0.0;
    if (g + 1u < ngroups) s1 = quantize_group(g + 1u);
    s_out[item] = packHalf2x16(vec2(s0, s1));
#else
    if (item >= ngroups) return;
    s_out[item] = quantize_group(item);
#endif
}
