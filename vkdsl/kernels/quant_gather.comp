#version 450
// Embedding lookup from a quantized table (N x K, see quant_common.glsl): out[i, :] = W[ids[i], :].
// One 32-element range per invocation. An id outside the table gives a NaN row, never a stray read.
// A table that is rows [BASE, BASE + N) of one of TOTAL rows (a weight split over bindings) gives 0
// for the other parts' rows. Bindings: 0 = out (fp32 n x K), 1 = ids (int32 n), 2.. = the format's
// arrays. Push (host "<5I", ops/quant/gather.py): N, K, BASE, TOTAL, IDS (how many ids: never the
// binding's length, which is rounded up to 16 bytes or is a larger buffer's).
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(push_constant) uniform GatherPush {
    uint N, K, BASE, TOTAL, IDS;
} qp;

uint work_item() {
    return gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
}
layout(std430, binding = 0) writeonly buffer Out { vec4 o[]; };
layout(std430, binding = 1) readonly buffer Ids { int ids[]; };
#define QB0 2
#include "quant_formats.glsl"

void main() {
    const uint nr = qp.K / 32u, item = work_item();
    const uint i = item / nr, r = item % nr;
    if (i >= qp.IDS) return;
    const int id = ids[i];
    if (id < 0 || uint(id) >= qp.TOTAL) {
        [[unroll]] for (int v = 0; v < 8; v++) o[8u * item + v] = vec4(0.0 / 0.0);
        return;
    }
    const int row = id - int(qp.BASE);
    if (row < 0 || uint(row) >= qp.N) {
        [[unroll]] for (int v = 0; v < 8; v++) o[8u * item + v] = vec4(0.0);
        return;
    }
    Q32 q;
    q32_load(uint(row), r, qp.K, q);
    [[unroll]] for (int v = 0; v < 8; v++)
        o[8u * item + v] = vec4(q32_get(q, 4 * v), q32_get(q, 4 * v + 1), q32_get(q, 4 * v + 2), q32_get(q, 4 * v + 3));
}
