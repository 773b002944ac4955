// Half-precision weights (GGUF F16): w = the f16 value, widened exactly to fp32 as it is read.
// Array: w (two f16 per uint, row-major); a 32-element range is 16 words = 4 uvec4. unpackHalf2x16
// is core GLSL, so this needs no 16-bit storage feature: every Vulkan device can hold weights at
// half the bytes of fp32.
Q_ARRAY_U4(QB0, F16W, q_w)
struct Q32 { uvec4 a, b, c, d; };

void q32_load(uint n, uint r, uint kw, out Q32 q) {
    const uint b = 4u * (n * (kw / 32u) + r);
    q.a = Q_U4(q_w, b);
    q.b = Q_U4(q_w, b + 1u);
    q.c = Q_U4(q_w, b + 2u);
    q.d = Q_U4(q_w, b + 3u);
}

float q32_get(Q32 q, const int e) {
    const uvec4 u = e < 8 ? q.a : e < 16 ? q.b : e < 24 ? q.c : q.d;
    return unpackHalf2x16(u[(e % 8) / 2])[e % 2];
}
