// GGUF Q4_0: blocks of 32, w = d * (q - 8). Arrays: d (f16, two per uint), qs (16 bytes per block).
layout(std430, binding = QB0) readonly buffer Q40D { uint q_d[]; };
layout(std430, binding = QB0 + 1) readonly buffer Q40S { uvec4 q_qs[]; };
struct Q32 { uvec4 qs; float d; };

void q32_load(uint n, uint r, uint kw, out Q32 q) {
    const uint b = n * (kw / 32u) + r;
    q.qs = q_qs[b];
    q.d = half_at(q_d[b >> 1], b);
}

float q32_get(Q32 q, const int e) { return q.d * (float(nibble(q.qs, e)) - 8.0); }
