// vkdsl int4: symmetric groups of 64 along K, s = absmax / 7, w = s * (q - 8) with codes q - 8 in
// -8..7. Arrays: s (f32 per group, or with INT4_F16 two f16 per uint), qs (16 bytes per 32 elements,
// two ranges per group).
#if INT4_F16
layout(std430, binding = QB0) readonly buffer I4S { uint q_s[]; };
float int4_scale(uint g) { return half_at(q_s[g >> 1], g); }
#else
layout(std430, binding = QB0) readonly buffer I4S { float q_s[]; };
float int4_scale(uint g) { return q_s[g]; }
#endif
layout(std430, binding = QB0 + 1) readonly buffer I4Q { uvec4 q_qs[]; };
struct Q32 { uvec4 qs; float d; };

void q32_load(uint n, uint r, uint kw, out Q32 q) {
    const uint b = n * (kw / 32u) + r;
    q.qs = q_qs[b];
    q.d = int4_scale(b >> 1);
}

float q32_get(Q32 q, const int e) { return q.d * (float(nibble(q.qs, e)) - 8.0); }
