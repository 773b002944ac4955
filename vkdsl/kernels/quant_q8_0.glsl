// GGUF Q8_0: blocks of 32, w = d * q with q int8. Arrays: d (f16, two per uint), qs (32 bytes per
// block, element j = byte j).
Q_ARRAY_U1(QB0, Q80D, q_d)
Q_ARRAY_U4(QB0 + 1, Q80S, q_qs)
struct Q32 { uvec4 lo, hi; float d; };

void q32_load(uint n, uint r, uint kw, out Q32 q) {
    const uint b = n * (kw / 32u) + r;
    q.lo = Q_U4(q_qs, 2u * b);
    q.hi = Q_U4(q_qs, 2u * b + 1u);
    q.d = half_at(Q_U1(q_d, b >> 1), b);
}

float q32_get(Q32 q, const int e) {
    const uint word = e < 16 ? q.lo[(e % 16) / 4] : q.hi[(e % 16) / 4];
    return q.d * float(bitfieldExtract(int(word), 8 * (e % 4), 8));
}
