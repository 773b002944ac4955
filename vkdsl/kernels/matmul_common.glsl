// Shared by matmul.comp and qmatmul*.comp: VEC-wide chunk loads and the push-constant block
// (declared only here; the host packs it with struct format "<6I" and asserts the size). Include it
// before any declaration: it may enable an extension.
//
// C[z] (M x N) = op(A[z]) . op(B[z]), reduction over K; z = gl_WorkGroupID.z is the batch index.
// All tensors are dense row-major fp32 starting at element 0 of their buffer; batch strides are in
// elements and may be 0 (a 2-D operand broadcast over the batch).
//
// VEC = floats per storage-buffer load along an operand's contiguous dimension. On lavapipe every
// load whose address differs between lanes is a loop over the 8 SIMD lanes, so the number of load
// instructions, not bytes, bounds the speed: VEC 8 moves 32 bytes per lane per load (as four 64-bit
// components, the widest load there is), VEC 4 a vec4, VEC 1 a float for unaligned shapes.
#ifndef VEC
#define VEC 1
#endif
#ifdef TEXEL
// TEXEL: A and B (bindings 1 and 2) are uniform texel buffers (rgba32f when VEC == 4, r32f when
// VEC == 1), read with texelFetch: on lavapipe a vector gather, where a storage-buffer load is a
// loop over the lanes. Nothing else changes: CHUNK i of a texel buffer is chunk i of the buffer.
#if VEC == 4
#define CHUNK vec4
#define TEXEL_AT(t, i) texelFetch(t, int(i))
#elif VEC == 1
#define CHUNK float
#define TEXEL_AT(t, i) texelFetch(t, int(i)).x
#else
#error TEXEL loads are VEC 4 or 1
#endif
#endif
#if VEC == 8
#extension GL_ARB_gpu_shader_int64 : require
#define CHUNK u64vec4
void unpack_chunk(CHUNK t, out float v[VEC]) {
    [[unroll]] for (int c = 0; c < 4; c++) {
        vec2 f = uintBitsToFloat(unpackUint2x32(t[c]));
        v[2 * c] = f.x;
        v[2 * c + 1] = f.y;
    }
}
#elif VEC == 4
#ifndef TEXEL
#define CHUNK vec4
#endif
void unpack_chunk(CHUNK t, out float v[VEC]) { v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w; }
#else
#ifndef TEXEL
#define CHUNK float
#endif
void unpack_chunk(CHUNK t, out float v[VEC]) { v[0] = t; }
#endif

#ifdef LORA
#include "matmul_lora.glsl"
#else
layout(push_constant) uniform MatmulPush {
    uint M, N, K;
    uint stride_a, stride_b, stride_c;
} pc;
#endif
// What a tiled kernel stores for C[row, col] given its sum v: v itself, or an epilogue's value.
#ifndef C_OUT
#define C_OUT(v, row, col) (v)
#endif
