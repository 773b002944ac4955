#version 450
// Fused attention backward (recompute-based, FlashAttention-2 style): the (Hq, T, T) probabilities
// are never stored; each pass recomputes the scores it needs from q and k. Three passes (PASS):
//   0 stats: per (batch, query, head) lse_i = log sum_j exp(s_ij) and delta_i = dO_i . O_i;
//   1 dq:    dq_i = scale * sum_j p_ij (dO_i . v_j - delta_i) k_j;
//   2 dkv:   dv_j = sum_(i, h) p_ij dO_i and dk_j = scale * sum_(i, h) p_ij (dO_i . v_j - delta_i) q_i,
//            summed over the G = Hq / Hkv query heads that share kv head j's.
// with s_ij = scale * q_i . k_j + mask_ij (visible keys only) and p_ij = exp(s_ij - lse_i).
// Passes 0 and 1: one invocation per (batch, query, kv head) for all G of its query heads, a
// workgroup = 64 queries, so each k_j / v_j load serves G heads. Pass 2: one invocation per
// (batch, key, kv head), a workgroup = 64 keys. Either way the operand streamed over the loop is at
// a workgroup-uniform address, loaded 8 floats at a time, from texel buffers with TEXEL (CPU
// drivers: a gather, where a storage load at an address llvmpipe cannot prove uniform is a loop over
// the SIMD lanes) or storage buffers (attention_io.glsl).
// Shapes and has_mask (1 an additive mask, 2 packed rows' spans) as attention.comp; with spans,
// passes 0 and 1 start at the workgroup's first query's row start, pass 2 stops at its last key's
// row end. A query that sees no key gets lse = +inf, so its p is 0 (zero gradients).
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
#if PASS == 0
layout(std430, binding = 0) writeonly buffer Out_ { vec2 stats_out[]; };  // (B, Tq, Hq, 2)
#else
layout(std430, binding = 0) writeonly buffer Out_ { vec4 out4[]; };
#endif
#define MB 7
#define JB 2                                        // keys a step of pass 1
#define SB 5                                        // (lse, delta): passes 1, 2
#include "attention_io.glsl"
F_BUFFER(1, q_in)
F_BUFFER(2, k_in)
F_BUFFER(3, v_in)
F_BUFFER(4, g_in)                                   // dO
F_BUFFER(6, o_in)                                   // the forward's output: pass 0
layout(push_constant) uniform AttnPush { uint B, Tq, Tk, Hq, Hkv, causal, has_mask; float scale; } ap;

const int D4 = D / 4, D8 = D / 8;
const float NEG_INF = -1.0 / 0.0;

float hsum(vec4 a) { return a.x + a.y + a.z + a.w; }

#if PASS < 2
void main() {
    const uint kvh = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    const uint i0 = gl_WorkGroupID.x * gl_WorkGroupSize.x, i = i0 + gl_LocalInvocationID.x;
    const bool live = i < ap.Tq;
    const uint ic = min(i, ap.Tq - 1u);
    const uint item = (b * ap.Tq + ic) * ap.Hq + kvh * G;     // first of this query's G heads
    vec4 q[G][D4];
    [[unroll]] for (int t = 0; t < G; t++)
        [[unroll]] for (int d = 0; d < D4; d++) q[t][d] = LOAD4(q_in, (item + t) * D4 + d) * ap.scale;
    const uint i_last = min(i0 + gl_WorkGroupSize.x, ap.Tq) - 1u;
    const uint last = ap.causal != 0u ? min(ap.Tk, i_last + (ap.Tk - ap.Tq) + 1u) : ap.Tk;
    const uint mine = ap.causal != 0u ? i + (ap.Tk - ap.Tq) : ap.Tk;
    const uint lo = ap.has_mask == 2u ? SPANS(b * ap.Tq + ic).x : 0u;
    const uint first = ap.has_mask == 2u ? SPANS(b * ap.Tq + i0).x : 0u;
#if PASS == 0
    float m[G], l[G];
    [[unroll]] for (int t = 0; t < G; t++) { m[t] = NEG_INF; l[t] = 0.0; }
    for (uint j = first; j < last; j++) {
        const uint kb = ((b * ap.Tk + j) * ap.Hkv + kvh) * D8;
        const float add = ap.has_mask == 1u ? MASK((b * ap.Tq + ic) * ap.Tk + j) : 0.0;
        if (j > mine || j < lo || add == NEG_INF) continue;
        vec4 kj[D4];
        [[unroll]] for (int d = 0; d < D8; d++) LOAD8(k_in, kb + d, kj[2 * d], kj[2 * d + 1]);
        [[unroll]] for (int t = 0; t < G; t++) {
            vec4 acc = vec4(0.0);
            [[unroll]] for (int d = 0; d < D4; d++) acc += q[t][d] * kj[d];
            const float s = hsum(acc) + add, m_new = max(m[t], s);
            l[t] = l[t] * exp(m[t] - m_new) + exp(s - m_new);
            m[t] = m_new;
        }
    }
    if (live) {
        [[unroll]] for (int t = 0; t < G; t++) {
            vec4 acc = vec4(0.0);
            [[unroll]] for (int d = 0; d < D4; d++) acc += LOAD4(g_in, (item + t) * D4 + d) * LOAD4(o_in, (item + t) * D4 + d);
            stats_out[item + t] = vec2(l[t] > 0.0 ? m[t] + log(l[t]) : 1.0 / 0.0, hsum(acc));
        }
    }
#else
    vec4 g[G][D4], dq[G][D4];
    float lse[G], delta[G];
    [[unroll]] for (int t = 0; t < G; t++) {
        [[unroll]] for (int d = 0; d < D4; d++) {
            g[t][d] = LOAD4(g_in, (item + t) * D4 + d);
            dq[t][d] = vec4(0.0);
        }
        lse[t] = STATS(item + t).x;
        delta[t] = STATS(item + t).y;
    }
    // JB keys a step: each pass over q, dO and dq (more than the registers hold on a CPU driver)
    // serves JB keys (1.6x on lavapipe at JB 2; 4 spills more). A key this query may not see gets
    // ds = 0 instead of a branch; dq still takes the keys one at a time, in order, so the sums are
    // bit for bit those of one key a step.
    for (uint j = first; j < last; j += JB) {
        vec4 kj[JB][D4], vj[JB][D4];
        float add[JB];
        bool seen[JB];
        [[unroll]] for (int c = 0; c < JB; c++) {
            const uint jc = min(j + c, last - 1u);
            const uint kb = ((b * ap.Tk + jc) * ap.Hkv + kvh) * D8;
            add[c] = ap.has_mask == 1u ? MASK((b * ap.Tq + ic) * ap.Tk + jc) : 0.0;
            seen[c] = j + c < last && jc <= mine && jc >= lo && add[c] != NEG_INF;
            [[unroll]] for (int d = 0; d < D8; d++) {
                LOAD8(k_in, kb + d, kj[c][2 * d], kj[c][2 * d + 1]);
                LOAD8(v_in, kb + d, vj[c][2 * d], vj[c][2 * d + 1]);
            }
        }
        [[unroll]] for (int t = 0; t < G; t++) {
            vec4 sa[JB], pa[JB];
            float ds[JB];
            [[unroll]] for (int c = 0; c < JB; c++) {
                sa[c] = vec4(0.0);
                pa[c] = vec4(0.0);
            }
            [[unroll]] for (int d = 0; d < D4; d++) {
                [[unroll]] for (int c = 0; c < JB; c++) {
                    sa[c] += q[t][d] * kj[c][d];
                    pa[c] += g[t][d] * vj[c][d];
                }
            }
            [[unroll]] for (int c = 0; c < JB; c++) {
                const float p = exp(hsum(sa[c]) + add[c] - lse[t]);
                ds[c] = seen[c] ? p * (hsum(pa[c]) - delta[t]) : 0.0;
            }
            [[unroll]] for (int d = 0; d < D4; d++)
                [[unroll]] for (int c = 0; c < JB; c++) dq[t][d] += ds[c] * kj[c][d];
        }
    }
    if (live) {
        [[unroll]] for (int t = 0; t < G; t++)
            [[unroll]] for (int d = 0; d < D4; d++) out4[(item + t) * D4 + d] = dq[t][d] * ap.scale;
    }
#endif
}
#else
// pass 2: output (2, B, Tk, Hkv, D) = (dk, dv). Each invocation owns KPL keys (lane, lane + 64, ...)
// so every q_i / dO_i load serves KPL keys.
#define KPL 2
void main() {
    const uint kvh = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    const uint j0 = gl_WorkGroupID.x * gl_WorkGroupSize.x * KPL;
    uint jj[KPL], item[KPL], hi[KPL];
    vec4 k[KPL][D4], v[KPL][D4], dk[KPL][D4], dv[KPL][D4];
    [[unroll]] for (int c = 0; c < KPL; c++) {
        jj[c] = j0 + c * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
        item[c] = (b * ap.Tk + min(jj[c], ap.Tk - 1u)) * ap.Hkv + kvh;
        hi[c] = ap.has_mask == 2u ? SPANS(b * ap.Tk + min(jj[c], ap.Tk - 1u)).y : ap.Tq;   // queries < hi see j
        [[unroll]] for (int d = 0; d < D8; d++) {
            LOAD8(k_in, item[c] * D8 + d, k[c][2 * d], k[c][2 * d + 1]);
            LOAD8(v_in, item[c] * D8 + d, v[c][2 * d], v[c][2 * d + 1]);
        }
        [[unroll]] for (int d = 0; d < D4; d++) {
            k[c][d] *= ap.scale;
            dk[c][d] = vec4(0.0);
            dv[c][d] = vec4(0.0);
        }
    }
    // causal: query i sees key j iff j <= i + off; the workgroup starts at its first key's first query
    const uint off = ap.Tk - ap.Tq;
    const uint first = ap.causal != 0u ? (j0 > off ? j0 - off : 0u) : 0u;
    // the row end of the workgroup's last key (a uniform address; ends never decrease along T)
    const uint stop = ap.has_mask == 2u ? SPANS(b * ap.Tk + min(j0 + gl_WorkGroupSize.x * KPL, ap.Tk) - 1u).y : ap.Tq;
    for (uint t = 0u; t < uint(G); t++) {
        const uint h = kvh * uint(G) + t;
        for (uint i = first; i < stop; i++) {
            const uint qi = (b * ap.Tq + i) * ap.Hq + h;
            vec4 qv[D4], gv[D4];
            [[unroll]] for (int d = 0; d < D8; d++) {
                LOAD8(q_in, qi * D8 + d, qv[2 * d], qv[2 * d + 1]);
                LOAD8(g_in, qi * D8 + d, gv[2 * d], gv[2 * d + 1]);
            }
            const vec2 st = STATS(qi);
            [[unroll]] for (int c = 0; c < KPL; c++) {
                const float add = ap.has_mask == 1u ? MASK((b * ap.Tq + i) * ap.Tk + min(jj[c], ap.Tk - 1u)) : 0.0;
                const bool seen = (ap.causal == 0u || jj[c] <= i + off) && i < hi[c] && add != NEG_INF;
                vec4 sa = vec4(0.0), pa = vec4(0.0);
                [[unroll]] for (int d = 0; d < D4; d++) {
                    sa += k[c][d] * qv[d];
                    pa += gv[d] * v[c][d];
                }
                const float p = seen ? exp(hsum(sa) + add - st.x) : 0.0;
                const float ds = p * (hsum(pa) - st.y);
                [[unroll]] for (int d = 0; d < D4; d++) {
                    dv[c][d] += p * gv[d];
                    dk[c][d] += ds * qv[d];
                }
            }
        }
    }
    const uint half_ = ap.B * ap.Tk * ap.Hkv * D4;
    [[unroll]] for (int c = 0; c < KPL; c++) {
        if (jj[c] < ap.Tk) {
            [[unroll]] for (int d = 0; d < D4; d++) {
                out4[item[c] * D4 + d] = dk[c][d] * ap.scale;
                out4[half_ + item[c] * D4 + d] = dv[c][d];
            }
        }
    }
}
#endif
