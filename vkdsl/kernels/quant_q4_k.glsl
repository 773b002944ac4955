// GGUF Q4_K and Q5_K (FMT_Q5_K): super-blocks of 256 weights = 8 ranges of 32, each range with a
// 6-bit scale code and a 6-bit min code: w = d * sc_j * q - dmin * m_j. Arrays per super-block:
// dm (f16 d low, f16 dmin high: one uint), sc (the 12 packed code bytes: 3 uints: range j < 4 has
// sc = byte j & 63, m = byte j+4 & 63; j >= 4 takes its low 4 bits from byte j+4 and its top 2
// from bits 6-7 of byte j-4 (sc) or byte j (m)), [Q5_K: qh (32 bytes: bit j of byte e is bit 4 of
// element e of range j)], qs (128 bytes: range j's 32 nibbles are the low (j even) or high (j odd)
// halves of bytes 32 (j / 2) ... 32 (j / 2) + 31).
Q_ARRAY_U1(QB0, QKD, q_dm)
Q_ARRAY_U1(QB0 + 1, QKS, q_sc)
#ifdef FMT_Q5_K
Q_ARRAY_U4(QB0 + 2, QKH, q_qh)
Q_ARRAY_U4(QB0 + 3, QKQ, q_qs)
#else
Q_ARRAY_U4(QB0 + 2, QKQ, q_qs)
#endif
struct Q32 {
    uvec4 lo, hi;
#ifdef FMT_Q5_K
    uvec4 hlo, hhi;
#endif
    uint shift, bit;
    float scale, offset;
};

uint sc_byte(uint sb, uint k) { return (Q_U1(q_sc, 3u * sb + k / 4u) >> (8u * (k % 4u))) & 0xFFu; }

void q32_load(uint n, uint r, uint kw, out Q32 q) {
    const uint b = n * (kw / 32u) + r, sb = b / 8u, j = b % 8u;
    uint sc, m;
    if (j < 4u) {
        sc = sc_byte(sb, j) & 63u;
        m = sc_byte(sb, j + 4u) & 63u;
    } else {
        sc = (sc_byte(sb, j + 4u) & 15u) | ((sc_byte(sb, j - 4u) >> 6) << 4);
        m = (sc_byte(sb, j + 4u) >> 4) | ((sc_byte(sb, j) >> 6) << 4);
    }
    const vec2 dm = unpackHalf2x16(Q_U1(q_dm, sb));
    q.scale = dm.x * float(sc);
    q.offset = dm.y * float(m);
    const uint c = 8u * sb + 2u * (j / 2u);      // the 32 code bytes: two uvec4
    q.lo = Q_U4(q_qs, c);
    q.hi = Q_U4(q_qs, c + 1u);
    q.shift = 4u * (j % 2u);
    q.bit = j;
#ifdef FMT_Q5_K
    q.hlo = Q_U4(q_qh, 2u * sb);
    q.hhi = Q_U4(q_qh, 2u * sb + 1u);
#endif
}

float q32_get(Q32 q, const int e) {
    const uint word = e < 16 ? q.lo[(e % 16) / 4] : q.hi[(e % 16) / 4];
    uint v = (word >> (8u * uint(e % 4) + q.shift)) & 15u;
#ifdef FMT_Q5_K
    const uint hw = e < 16 ? q.hlo[(e % 16) / 4] : q.hhi[(e % 16) / 4];
    v |= ((hw >> (8u * uint(e % 4) + q.bit)) & 1u) << 4;
#endif
    return q.scale * float(v) - q.offset;
}
