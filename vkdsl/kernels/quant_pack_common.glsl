// Packing 4-bit codes of a 64-element group into two 32-element ranges of 16 bytes each, in the
// GGUF nibble order of quant_common.glsl (byte j: element j low, element j + 16 high).
void pack_ranges(uint code[64], out uvec4 lo, out uvec4 hi) {
    uvec4 r[2];
    [[unroll]] for (int h = 0; h < 2; h++) {
        [[unroll]] for (int c = 0; c < 4; c++) {
            uint word = 0u;
            [[unroll]] for (int bb = 0; bb < 4; bb++) {
                const int e = 32 * h + 4 * c + bb;
                word |= (code[e] | (code[e + 16] << 4)) << (8 * bb);
            }
            r[h][c] = word;
        }
    }
    lo = r[0];
    hi = r[1];
}

// the 64 weights of group g of the flattened weight, and their absmax
float load_group(uint g, out float w[64]) {
    float amax = 0.0;
    [[unroll]] for (int v = 0; v < 16; v++) {
        const vec4 x = w_in[16u * g + v];
        [[unroll]] for (int c = 0; c < 4; c++) {
            w[4 * v + c] = x[c];
            amax = max(amax, abs(x[c]));
        }
    }
    return amax;
}
