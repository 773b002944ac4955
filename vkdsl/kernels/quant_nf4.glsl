// vkdsl NF4 (QLoRA): blocks of 64 along K, w = NF4[q] * absmax; the block absmax is double-quantized
// to int8 in groups of 256 blocks: absmax = code * scale + offset. Arrays: codes of the absmaxes
// (int8, four per uint), group (scale, offset) pairs, qs (16 bytes per 32 elements).
Q_ARRAY_U1(QB0, NF4A, q_amax)
Q_ARRAY_U2(QB0 + 1, NF4G, q_group)
Q_ARRAY_U4(QB0 + 2, NF4Q, q_qs)
struct Q32 { uvec4 qs; float d; };

void q32_load(uint n, uint r, uint kw, out Q32 q) {
    const uint b = n * (kw / 32u) + r, blk = b >> 1;
    q.qs = Q_U4(q_qs, b);
    const float code = float(bitfieldExtract(int(Q_U1(q_amax, blk >> 2)), int(8u * (blk & 3u)), 8));
    const vec2 g = uintBitsToFloat(Q_U2(q_group, blk >> 8));
    q.d = code * g.x + g.y;
}

float q32_get(Q32 q, const int e) { return nf4_value(nibble(q.qs, e)) * q.d; }
