// GGUF Q4_1: blocks of 32, w = d * q + m. Arrays: dm (f16 d low, f16 m high: one uint per block),
// qs (16 bytes per block).
Q_ARRAY_U1(QB0, Q41D, q_dm)
Q_ARRAY_U4(QB0 + 1, Q41S, q_qs)
struct Q32 { uvec4 qs; vec2 dm; };

void q32_load(uint n, uint r, uint kw, out Q32 q) {
    const uint b = n * (kw / 32u) + r;
    q.qs = Q_U4(q_qs, b);
    q.dm = unpackHalf2x16(Q_U1(q_dm, b));
}

float q32_get(Q32 q, const int e) { return q.dm.x * float(nibble(q.qs, e)) + q.dm.y; }
