#version 450
// (I + A)^-1 for a batch of n x n matrices A that are strictly lower triangular (only the
// entries below the diagonal are read), by forward substitution: one invocation solves one
// column j of the inverse, (I + A) x = e_j, top to bottom. ops/gated_delta.py's chunk solve.
// N: the largest n (the length of the invocation's column).
layout(local_size_x = 64) in;
layout(std430, binding = 0) writeonly buffer Out { float t[]; };
layout(std430, binding = 1) readonly buffer In { float a[]; };
layout(push_constant) uniform Push { uint mats; uint n; };

void main() {
    uint id = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * 64u;
    if (id >= mats * n) return;
    uint j = id % n, base = (id / n) * n * n;
    float x[N];
    for (uint i = 0u; i < n; ++i) {
        float v = i == j ? 1.0 : 0.0;
        if (i > j) {
            uint row = base + i * n;
            for (uint s = j; s < i; ++s) v -= a[row + s] * x[s];
        }
        x[i] = v;
        t[base + i * n + j] = v;
    }
}
