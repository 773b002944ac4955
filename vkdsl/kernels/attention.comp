#version 450
// Fused attention forward: one invocation per (batch, query, kv head) streams over the keys with an
// online softmax (running max m, running sum l) for each of the G query heads that share that kv
// head, so the T x T score matrix never exists and each key/value load serves G heads.
// A workgroup holds 64 queries of one (batch, kv head): the key/value addresses are then the same
// for every lane. Loads go 8 floats at a time through attention_io.glsl: texel buffers with TEXEL
// (llvmpipe proves no loop-carried address uniform, so its storage loads loop over the lanes; a
// texelFetch is one gather: 1.6x this kernel), storage buffers otherwise.
// q (B, Tq, Hq, D), k and v (B, Tk, Hkv, D), out (B, Tq, Hq, D). has_mask 1: mask (B, Tq, Tk)
// additive; 2: spans (B, T, 2) uint, each token's row [start, end) in a packed sequence (causal, rows
// contiguous, so starts and ends never decrease along T): query i sees keys start_i..i only, and the
// workgroup's loop starts at its first query's start instead of 0 (O(row length), not O(T)). Query head h reads kv head h / G, G = Hq / Hkv (a define, with D, so the
// per-head arrays live in registers). CAUSAL: key j visible iff j <= i + (Tk - Tq).
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(std430, binding = 0) writeonly buffer O_ { vec4 o_out[]; };
#define MB 4
#include "attention_io.glsl"
F_BUFFER(1, q_in)
F_BUFFER(2, k_in)
F_BUFFER(3, v_in)
layout(push_constant) uniform AttnPush { uint B, Tq, Tk, Hq, Hkv, causal, has_mask; float scale; } ap;

const int D4 = D / 4;
const float NEG_INF = -1.0 / 0.0;

void main() {
    const uint kvh = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    const uint i0 = gl_WorkGroupID.x * gl_WorkGroupSize.x, i = i0 + gl_LocalInvocationID.x;
    const bool live = i < ap.Tq;
    const uint ic = min(i, ap.Tq - 1u);
    const uint item = (b * ap.Tq + ic) * ap.Hq + kvh * G;     // first of this query's G heads
    vec4 q[G][D4], o[G][D4];
    float m[G], l[G];
    [[unroll]] for (int t = 0; t < G; t++) {
        [[unroll]] for (int d = 0; d < D4; d++) {
            q[t][d] = LOAD4(q_in, (item + t) * D4 + d) * ap.scale;
            o[t][d] = vec4(0.0);
        }
        m[t] = NEG_INF;
        l[t] = 0.0;
    }
    // Loop bound shared by the workgroup (uniform); each lane masks the keys it may not see.
    const uint i_last = min(i0 + gl_WorkGroupSize.x, ap.Tq) - 1u;
    const uint last = ap.causal != 0u ? min(ap.Tk, i_last + (ap.Tk - ap.Tq) + 1u) : ap.Tk;
    const uint mine = ap.causal != 0u ? i + (ap.Tk - ap.Tq) : ap.Tk;
    const uint lo = ap.has_mask == 2u ? SPANS(b * ap.Tq + ic).x : 0u;
    const uint first = ap.has_mask == 2u ? SPANS(b * ap.Tq + i0).x : 0u;
    for (uint j = first; j < last; j++) {
        const uint kbase = ((b * ap.Tk + j) * ap.Hkv + kvh) * D4;
        const float add = ap.has_mask == 1u ? MASK((b * ap.Tq + ic) * ap.Tk + j) : 0.0;
        if (j > mine || j < lo || add == NEG_INF) continue;      // a masked key adds nothing
        vec4 kj[D4];
        [[unroll]] for (int d = 0; d < D4 / 2; d++) LOAD8(k_in, kbase / 2 + d, kj[2 * d], kj[2 * d + 1]);
        float p[G], corr[G];
        [[unroll]] for (int t = 0; t < G; t++) {
            vec4 acc = vec4(0.0);
            [[unroll]] for (int d = 0; d < D4; d++) acc += q[t][d] * kj[d];
            const float s = acc.x + acc.y + acc.z + acc.w + add;
            const float m_new = max(m[t], s);
            corr[t] = exp(m[t] - m_new);
            p[t] = exp(s - m_new);
            l[t] = l[t] * corr[t] + p[t];
            m[t] = m_new;
        }
        vec4 vj[D4];
        [[unroll]] for (int d = 0; d < D4 / 2; d++) LOAD8(v_in, kbase / 2 + d, vj[2 * d], vj[2 * d + 1]);
        // rescale only when the running max moved (corr != 1): after the first keys that is rare,
        // and a branch no lane of a SIMD group takes is skipped; o * 1 is exact, so this is bit for
        // bit the unconditional o * corr + p * v
        [[unroll]] for (int t = 0; t < G; t++) {
            if (corr[t] != 1.0) {
                [[unroll]] for (int d = 0; d < D4; d++) o[t][d] *= corr[t];
            }
            [[unroll]] for (int d = 0; d < D4; d++) o[t][d] += p[t] * vj[d];
        }
    }
    if (live) {
        [[unroll]] for (int t = 0; t < G; t++) {
            const float inv = l[t] > 0.0 ? 1.0 / l[t] : 0.0;    // a row with every key masked gives zeros
            [[unroll]] for (int d = 0; d < D4; d++) o_out[(item + t) * D4 + d] = o[t][d] * inv;
        }
    }
}
