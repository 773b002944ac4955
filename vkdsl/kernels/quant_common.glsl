// Quantized weight formats as the shaders see them. A weight W is N x K (rows = output features,
// as GGUF stores (out, in)), quantized along K; K is a multiple of 32 (64 for int4 / nf4).
// Every format is read in 32-element ranges, b = n * (K / 32) + k / 32 over the flattened weight:
//   q32_load(n, r, kw, q)  fetches what range r of row n needs (kw = K, W's row length),
//   q32_get(q, e)          gives W[n, 32 r + e] (e = 0..31; a constant in the unrolled CPU kernels).
// 4-bit codes of a range are 16 bytes laid out as GGUF does: byte j holds element j in its low
// nibble and element j + 16 in its high nibble. The arrays bind from QB0 on, in the order
// vkdsl/quant.py lists them (scales first, codes last).
#ifndef QB0
#define QB0 2
#endif
// Each array is declared with Q_ARRAY_U1 / U2 / U4 (32-bit words read one, two or four at a time)
// and read with Q_U1 / U2 / U4 (uint, uvec2, uvec4): storage buffers, or with QTEXEL uniform texel
// buffers (r32ui / rg32ui / rgba32ui), which lavapipe reads with vector gathers (matmul_common.glsl).
#ifdef QTEXEL
#define Q_ARRAY_U1(b, blk, name) layout(binding = b) uniform usamplerBuffer name;
#define Q_ARRAY_U2(b, blk, name) layout(binding = b) uniform usamplerBuffer name;
#define Q_ARRAY_U4(b, blk, name) layout(binding = b) uniform usamplerBuffer name;
#define Q_U1(name, i) texelFetch(name, int(i)).x
#define Q_U2(name, i) texelFetch(name, int(i)).xy
#define Q_U4(name, i) texelFetch(name, int(i))
#else
#define Q_ARRAY_U1(b, blk, name) layout(std430, binding = b) readonly buffer blk { uint name[]; };
#define Q_ARRAY_U2(b, blk, name) layout(std430, binding = b) readonly buffer blk { uvec2 name[]; };
#define Q_ARRAY_U4(b, blk, name) layout(std430, binding = b) readonly buffer blk { uvec4 name[]; };
#define Q_U1(name, i) name[i]
#define Q_U2(name, i) name[i]
#define Q_U4(name, i) name[i]
#endif

uint nibble(uvec4 qs, const int e) {
    const int j = e % 16;
    return (qs[j / 4] >> (8 * (j % 4) + 4 * (e / 16))) & 0xFu;
}

float half_at(uint word, uint i) {     // f16 i (0/1) of a word holding two
    return unpackHalf2x16(word)[i & 1u];
}

// QLoRA's NormalFloat-4 codebook and the midpoints between neighbours (float32, %.9g; the tests
// check these against vkdsl/quant.py NF4_CODEBOOK).
const float NF4[16] = float[16](-1.0, -0.696192801, -0.525073051, -0.394917488, -0.284441382, -0.18477343,
                                -0.0910500363, 0.0, 0.0795802996, 0.160930201, 0.246112302, 0.337915242,
                                0.440709829, 0.562617004, 0.722956836, 1.0);
const float NF4_MID[15] = float[15](-0.848096371, -0.610632896, -0.45999527, -0.33967942, -0.234607399,
                                    -0.137911737, -0.0455250181, 0.0397901498, 0.120255247, 0.203521252,
                                    0.292013764, 0.389312536, 0.501663446, 0.64278692, 0.861478448);

// Codebook lookup as a select tree: an array indexed by a per-lane value becomes a loop over the
// lanes on lavapipe.
float nf4_value(uint q) {
    const bool b0 = (q & 1u) != 0u, b1 = (q & 2u) != 0u, b2 = (q & 4u) != 0u, b3 = (q & 8u) != 0u;
    float p[8];
    [[unroll]] for (int i = 0; i < 8; i++) p[i] = b0 ? NF4[2 * i + 1] : NF4[2 * i];
    float h[4];
    [[unroll]] for (int i = 0; i < 4; i++) h[i] = b1 ? p[2 * i + 1] : p[2 * i];
    const float lo = b2 ? h[1] : h[0], hi = b2 ? h[3] : h[2];
    return b3 ? hi : lo;
}
