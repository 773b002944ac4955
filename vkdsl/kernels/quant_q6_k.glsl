// GGUF Q6_K: super-blocks of 256 weights, w = d * sc_i * (q - 32): q has 6 bits, sc_i is an int8
// per 16 weights. Arrays per super-block: d (f16, two per uint), sc (16 int8: 4 uints), ql (128
// bytes: the low 4 bits), qh (64 bytes: the high 2 bits). Element t (h = t / 128, u = t % 128) is
// the low (u < 64) or high nibble of ql byte 64 h + u % 64, and bits 2 (u / 32) of qh byte
// 32 h + u % 32; for range j of the super-block, u = 32 (j % 4) + e.
Q_ARRAY_U1(QB0, Q6D, q_d)
Q_ARRAY_U1(QB0 + 1, Q6S, q_sc)
Q_ARRAY_U4(QB0 + 2, Q6L, q_ql)
Q_ARRAY_U4(QB0 + 3, Q6H, q_qh)
struct Q32 { uvec4 llo, lhi, hlo, hhi; uint lshift, hshift; float s0, s1; };

void q32_load(uint n, uint r, uint kw, out Q32 q) {
    const uint b = n * (kw / 32u) + r, sb = b / 8u, j = b % 8u, h = j / 4u, i = j % 4u;
    const uint l = 8u * sb + 4u * h + 2u * (i % 2u);
    q.llo = Q_U4(q_ql, l);
    q.lhi = Q_U4(q_ql, l + 1u);
    q.lshift = 4u * (i / 2u);
    q.hlo = Q_U4(q_qh, 4u * sb + 2u * h);
    q.hhi = Q_U4(q_qh, 4u * sb + 2u * h + 1u);
    q.hshift = 2u * i;
    const float d = half_at(Q_U1(q_d, sb >> 1), sb);
    const int word = int(Q_U1(q_sc, 4u * sb + j / 2u));   // the range's two scales: bytes 2 (j % 2), +1
    q.s0 = d * float(bitfieldExtract(word, int(16u * (j % 2u)), 8));
    q.s1 = d * float(bitfieldExtract(word, int(16u * (j % 2u)) + 8, 8));
}

float q32_get(Q32 q, const int e) {
    const uint lw = e < 16 ? q.llo[(e % 16) / 4] : q.lhi[(e % 16) / 4];
    const uint hw = e < 16 ? q.hlo[(e % 16) / 4] : q.hhi[(e % 16) / 4];
    const uint v = ((lw >> (8u * uint(e % 4) + q.lshift)) & 15u) | (((hw >> (8u * uint(e % 4) + q.hshift)) & 3u) << 4);
    return (e < 16 ? q.s0 : q.s1) * float(int(v) - 32);
}
