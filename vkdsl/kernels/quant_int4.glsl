// vkdsl int4: symmetric groups of 64 along K, s = absmax / 7, w = s * (q - 8) with codes q - 8 in
// -8..7. Arrays: s (f32 per group, or with INT4_F16 two f16 per uint), qs (16 bytes per 32 elements,
// two ranges per group).
#if INT4_F16
Q_ARRAY_U1(QB0, I4S, q_s)
float int4_scale(uint g) { return half_at(Q_U1(q_s, g >> 1), g); }
#else
Q_ARRAY_U1(QB0, I4S, q_s)
float int4_scale(uint g) { return uintBitsToFloat(Q_U1(q_s, g)); }
#endif
Q_ARRAY_U4(QB0 + 1, I4Q, q_qs)
struct Q32 { uvec4 qs; float d; };

void q32_load(uint n, uint r, uint kw, out Q32 q) {
    const uint b = n * (kw / 32u) + r;
    q.qs = Q_U4(q_qs, b);
    q.d = int4_scale(b >> 1);
}

float q32_get(Q32 q, const int e) { return q.d * (float(nibble(q.qs, e)) - 8.0); }
