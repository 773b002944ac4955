#version 450
// Fused attention forward: one invocation per (batch, query, query head) streams over the keys
// with an online softmax (running max m, running sum l), so the T x T score matrix never exists.
// q (B, Tq, Hq, D), k and v (B, Tk, Hkv, D), mask (B, Tq, Tk) additive (read when HAS_MASK),
// out (B, Tq, Hq, D). Query head h reads kv head h / (Hq / Hkv). CAUSAL: key j visible iff
// j <= i + (Tk - Tq). D is a define (a multiple of 4) so q and o live in registers.
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(std430, binding = 0) writeonly buffer O_ { vec4 o_out[]; };
layout(std430, binding = 1) readonly buffer Q_ { vec4 q_in[]; };
layout(std430, binding = 2) readonly buffer K_ { vec4 k_in[]; };
layout(std430, binding = 3) readonly buffer V_ { vec4 v_in[]; };
layout(std430, binding = 4) readonly buffer M_ { float mask[]; };
layout(push_constant) uniform AttnPush { uint B, Tq, Tk, Hq, Hkv, causal, has_mask; float scale; } ap;

const int D4 = D / 4;

void main() {
    const uint item = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (item >= ap.B * ap.Tq * ap.Hq) return;
    const uint h = item % ap.Hq, i = (item / ap.Hq) % ap.Tq, b = item / (ap.Hq * ap.Tq);
    const uint kvh = h / (ap.Hq / ap.Hkv);
    vec4 q[D4], o[D4];
    [[unroll]] for (int d = 0; d < D4; d++) {
        q[d] = q_in[item * D4 + d] * ap.scale;
        o[d] = vec4(0.0);
    }
    const uint last = ap.causal != 0u ? min(ap.Tk, i + (ap.Tk - ap.Tq) + 1u) : ap.Tk;
    float m = -1.0 / 0.0, l = 0.0;
    for (uint j = 0u; j < last; j++) {
        const uint kbase = ((b * ap.Tk + j) * ap.Hkv + kvh) * D4;
        vec4 acc = vec4(0.0);
        [[unroll]] for (int d = 0; d < D4; d++) acc += q[d] * k_in[kbase + d];
        float s = acc.x + acc.y + acc.z + acc.w;
        if (ap.has_mask != 0u) s += mask[(b * ap.Tq + i) * ap.Tk + j];
        if (s == -1.0 / 0.0) continue;                 // a masked key adds nothing
        const float m_new = max(m, s);
        const float corr = exp(m - m_new), p = exp(s - m_new);
        l = l * corr + p;
        [[unroll]] for (int d = 0; d < D4; d++) o[d] = o[d] * corr + p * v_in[kbase + d];
        m = m_new;
    }
    const float inv = l > 0.0 ? 1.0 / l : 0.0;         // a row with every key masked gives zeros
    [[unroll]] for (int d = 0; d < D4; d++) o_out[item * D4 + d] = o[d] * inv;
}
