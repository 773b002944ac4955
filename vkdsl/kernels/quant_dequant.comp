#version 450
// Dequantize a weight (N x K, see quant_common.glsl) to fp32, one 32-element range per invocation.
// Bindings: 0 = W out (fp32 N x K), 1.. = the format's arrays. Defines: FMT_* (as qmatmul.comp).
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
#include "quant_push.glsl"
layout(std430, binding = 0) writeonly buffer WOut { vec4 w_out[]; };
#define QB0 1
#include "quant_formats.glsl"

void main() {
    const uint nr = qp.K / 32u, b = work_item();
    if (b >= qp.N * nr) return;
    Q32 q;
    q32_load(b / nr, b % nr, qp.K, q);
    [[unroll]] for (int v = 0; v < 8; v++)
        w_out[8u * b + v] = vec4(q32_get(q, 4 * v), q32_get(q, 4 * v + 1), q32_get(q, 4 * v + 2), q32_get(q, 4 * v + 3));
}
