// Push constants of the dequantize / quantize kernels (host format "<2I", asserted in
// vkdsl/quant.py): the weight is N x K. Work items are numbered over a grid folded into y past
// 65535 workgroups: item = x + y * (workgroups in x) * (invocations per workgroup).
layout(push_constant) uniform QuantPush {
    uint N, K;
} qp;

uint work_item() {
    return gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
}
