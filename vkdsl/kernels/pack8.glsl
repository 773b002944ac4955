// Eight consecutive floats as one load (pack8) and their two vec4 halves (unpack8). With shaderInt64
// a u64vec4: CPU drivers turn a uniform 256-bit load into one instruction. Without it (NO_INT64:
// Mali-class GPUs, SwiftShader, the minimal profile) a struct of two vec4: the same 32 bytes in std430.
#ifdef NO_INT64
struct pack8 { vec4 lo; vec4 hi; };
void unpack8(pack8 c, out vec4 lo, out vec4 hi) {
    lo = c.lo;
    hi = c.hi;
}
#else
#extension GL_ARB_gpu_shader_int64 : require
#define pack8 u64vec4
void unpack8(u64vec4 c, out vec4 lo, out vec4 hi) {
    lo = vec4(uintBitsToFloat(unpackUint2x32(c.x)), uintBitsToFloat(unpackUint2x32(c.y)));
    hi = vec4(uintBitsToFloat(unpackUint2x32(c.z)), uintBitsToFloat(unpackUint2x32(c.w)));
}
#endif

// A read-only float operand, declared (F_BUFFER) and read 8 floats at a time (LOAD8, index in
// 8-float units) or 4 (LOAD4, in vec4 units). TEXEL (CPU drivers): a uniform texel buffer (rgba32f)
// whose texelFetch llvmpipe turns into one vector gather, where a storage-buffer load at an address it
// cannot prove uniform is a loop over the SIMD lanes (BENCHMARKS.md, issue 28). Else storage buffers.
#ifdef TEXEL
#define F_BUFFER(b, name) layout(binding = b) uniform samplerBuffer name;
#define LOAD8(name, i, lo, hi) { lo = texelFetch(name, int(2u * (i))); hi = texelFetch(name, int(2u * (i) + 1u)); }
#define LOAD4(name, i) texelFetch(name, int(i))
#else
#define F_BUFFER(b, name) \
    layout(std430, binding = b) readonly buffer name##_8 { pack8 name[]; }; \
    layout(std430, binding = b) readonly buffer name##_4 { vec4 name##4[]; };
#define LOAD8(name, i, lo, hi) unpack8(name[i], lo, hi)
#define LOAD4(name, i) name##4[i]
#endif
