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
