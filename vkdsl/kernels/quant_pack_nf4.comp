#version 450
// Quantize fp32 W (N x K, K % 64 == 0) to vkdsl NF4 on the device, in two passes (PASS = 1, 2):
//   1. per block of 64: absmax -> scratch; code = index of the nearest NF4 value to w / absmax
//      (the count of midpoints below it);
//   2. per group of 256 blocks: offset = mean absmax (sequential float32 sum), scale =
//      max |absmax - offset| * float32(1/127), absmax code = clamp(roundEven((absmax - offset) / scale), -127, 127).
// The float32 operations are those of vkdsl/quant.py quantize_nf4, so both give the same bytes.
// Bindings: 0 = absmax codes, 1 = group (scale, offset), 2 = codes (the nf4 arrays), 3 = W (fp32),
// 4 = scratch (fp32 absmax per block).
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
#include "quant_push.glsl"
#include "quant_common.glsl"
layout(std430, binding = 0) writeonly buffer AOut { uint a_out[]; };
layout(std430, binding = 1) writeonly buffer GOut { vec2 g_out[]; };
layout(std430, binding = 2) writeonly buffer QOut { uvec4 q_out[]; };
layout(std430, binding = 3) readonly buffer WIn { vec4 w_in[]; };
layout(std430, binding = 4) buffer Scratch { float amax_of[]; };
#include "quant_pack_common.glsl"

const float INV127 = 0.00787401572;      // float32(1/127); see INV7 in quant_pack_int4.comp

void main() {
    const uint nblocks = qp.N * (qp.K / 64u), item = work_item();
#if PASS == 1
    if (item >= nblocks) return;
    float w[64];
    const float amax = load_group(item, w);
    const float div = amax > 0.0 ? amax : 1.0;
    uint code[64];
    [[unroll]] for (int e = 0; e < 64; e++) {
        const float v = w[e] / div;
        uint idx = 0u;
        [[unroll]] for (int m = 0; m < 15; m++) idx += v > NF4_MID[m] ? 1u : 0u;
        code[e] = idx;
    }
    uvec4 lo, hi;
    pack_ranges(code, lo, hi);
    q_out[2u * item] = lo;
    q_out[2u * item + 1u] = hi;
    amax_of[item] = amax;
#else
    const uint first = 256u * item;
    if (first >= nblocks) return;
    const uint count = min(256u, nblocks - first);
    float sum = 0.0;
    for (uint i = 0u; i < count; i++) sum += amax_of[first + i];
    const float offset = sum / float(count);
    float dev = 0.0;
    for (uint i = 0u; i < count; i++) dev = max(dev, abs(amax_of[first + i] - offset));
    const float scale = dev * INV127, div = scale > 0.0 ? scale : 1.0;
    for (uint wd = 0u; wd < (count + 3u) / 4u; wd++) {
        uint word = 0u;
        [[unroll]] for (int bb = 0; bb < 4; bb++) {
            const uint i = 4u * wd + bb;
            if (i < count) {
                const int c = int(clamp(roundEven((amax_of[first + i] - offset) / div), -127.0, 127.0));
                word |= (uint(c) & 0xFFu) << (8 * bb);
            }
        }
        a_out[64u * item + wd] = word;
    }
    g_out[item] = vec2(scale, offset);
#endif
}
