#version 450
// Fused attention forward: one invocation per (batch, query, query head) streams over the keys
// with an online softmax (running max m, running sum l), so the T x T score matrix never exists.
// A workgroup holds 64 queries of one (batch, head): the key/value addresses are then the same
// for every lane (uniform loads, which CPU drivers turn into one load instead of a loop over lanes).
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
    const uint h = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    const uint i0 = gl_WorkGroupID.x * gl_WorkGroupSize.x, i = i0 + gl_LocalInvocationID.x;
    const bool live = i < ap.Tq;
    const uint item = ((b * ap.Tq + min(i, ap.Tq - 1u)) * ap.Hq + h);
    const uint kvh = h / (ap.Hq / ap.Hkv);
    vec4 q[D4], o[D4];
    [[unroll]] for (int d = 0; d < D4; d++) {
        q[d] = q_in[item * D4 + d] * ap.scale;
        o[d] = vec4(0.0);
    }
    // Loop bound shared by the workgroup (uniform); each lane masks the keys it may not see.
    const uint i_last = min(i0 + gl_WorkGroupSize.x, ap.Tq) - 1u;
    const uint last = ap.causal != 0u ? min(ap.Tk, i_last + (ap.Tk - ap.Tq) + 1u) : ap.Tk;
    const uint mine = ap.causal != 0u ? i + (ap.Tk - ap.Tq) : ap.Tk;
    float m = -1.0 / 0.0, l = 0.0;
    for (uint j = 0u; j < last; j++) {
        const uint kbase = ((b * ap.Tk + j) * ap.Hkv + kvh) * D4;
        vec4 acc = vec4(0.0);
        [[unroll]] for (int d = 0; d < D4; d++) acc += q[d] * k_in[kbase + d];
        float s = acc.x + acc.y + acc.z + acc.w;
        if (ap.has_mask != 0u) s += mask[(b * ap.Tq + min(i, ap.Tq - 1u)) * ap.Tk + j];
        if (j > mine) s = -1.0 / 0.0;
        if (s == -1.0 / 0.0) continue;                 // a masked key adds nothing
        const float m_new = max(m, s);
        const float corr = exp(m - m_new), p = exp(s - m_new);
        l = l * corr + p;
        [[unroll]] for (int d = 0; d < D4; d++) o[d] = o[d] * corr + p * v_in[kbase + d];
        m = m_new;
    }
    const float inv = l > 0.0 ? 1.0 / l : 0.0;         // a row with every key masked gives zeros
    if (live) {
        [[unroll]] for (int d = 0; d < D4; d++) o_out[item * D4 + d] = o[d] * inv;
    }
}
