#version 450
// Reference-simple matmul, one output per invocation: the fallback when no tuned variant applies.
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(std430, binding = 0) writeonly buffer C_ { float C[]; };
layout(std430, binding = 1) readonly buffer A_ { float A[]; };
layout(std430, binding = 2) readonly buffer B_ { float B[]; };
layout(push_constant) uniform P { uint M, N, K, ta, tb, sa, sb, sc; };
void main() {
  uint n = gl_GlobalInvocationID.x, m = gl_GlobalInvocationID.y, b = gl_GlobalInvocationID.z;
  if (m >= M || n >= N) return;
  float acc = 0.0;
  for (uint k = 0u; k < K; k++) {
    float a = A[b * sa + (ta != 0u ? k * M + m : m * K + k)];
    float w = B[b * sb + (tb != 0u ? n * K + k : k * N + n)];
    acc += a * w;
  }
  C[b * sc + m * N + n] = acc;
}
