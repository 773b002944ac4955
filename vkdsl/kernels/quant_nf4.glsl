// vkdsl NF4 (QLoRA): blocks of 64 along K, w = NF4[q] * absmax; the block absmax is double-quantized
// to int8 in groups of 256 blocks: absmax = code * scale + offset. Arrays: codes of the absmaxes
// (int8, four per uint), group (scale, offset) pairs, qs (16 bytes per 32 elements).
layout(std430, binding = QB0) readonly buffer NF4A { uint q_amax[]; };
layout(std430, binding = QB0 + 1) readonly buffer NF4G { vec2 q_group[]; };
layout(std430, binding = QB0 + 2) readonly buffer NF4Q { uvec4 q_qs[]; };
struct Q32 { uvec4 qs; float d; };

void q32_load(uint n, uint r, uint kw, out Q32 q) {
    const uint b = n * (kw / 32u) + r, blk = b >> 1;
    q.qs = q_qs[b];
    const float code = float(bitfieldExtract(int(q_amax[blk >> 2]), int(8u * (blk & 3u)), 8));
    const vec2 g = q_group[blk >> 8];
    q.d = code * g.x + g.y;
}

float q32_get(Q32 q, const int e) { return nf4_value(nibble(q.qs, e)) * q.d; }
