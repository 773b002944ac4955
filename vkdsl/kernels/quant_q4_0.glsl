// GGUF Q4_0: blocks of 32, w = d * (q - 8). Arrays: d (f16, two per uint), qs (16 bytes per block).
Q_ARRAY_U1(QB0, Q40D, q_d)
Q_ARRAY_U4(QB0 + 1, Q40S, q_qs)
struct Q32 { uvec4 qs; float d; };

void q32_load(uint n, uint r, uint kw, out Q32 q) {
    const uint b = n * (kw / 32u) + r;
    q.qs = Q_U4(q_qs, b);
    q.d = half_at(Q_U1(q_d, b >> 1), b);
}

float q32_get(Q32 q, const int e) { return q.d * (float(nibble(q.qs, e)) - 8.0); }
