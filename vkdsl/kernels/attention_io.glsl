// The operands of the fused attention kernels (attention.comp, attention_backward.comp): q, k, v and
// dO as F_BUFFERs (pack8.glsl: texel or storage), the backward's per-query (lse, delta) pairs, and
// binding MB, which holds the additive mask (B, Tq, Tk) floats or the packed rows' spans (B, T, 2)
// uints as the push constant's has_mask says. TEXEL: stats an r32f texel buffer, MB an r32ui one.
#include "pack8.glsl"
#ifdef TEXEL
layout(binding = MB) uniform usamplerBuffer mask_tex;
#define MASK(i) uintBitsToFloat(texelFetch(mask_tex, int(i)).x)
#define SPANS(i) uvec2(texelFetch(mask_tex, int(2u * (i))).x, texelFetch(mask_tex, int(2u * (i) + 1u)).x)
#ifdef SB
layout(binding = SB) uniform samplerBuffer stats_tex;
#define STATS(i) vec2(texelFetch(stats_tex, int(2u * (i))).x, texelFetch(stats_tex, int(2u * (i) + 1u)).x)
#endif
#else
layout(std430, binding = MB) readonly buffer M_ { float mask_in[]; };
layout(std430, binding = MB) readonly buffer R_ { uvec2 spans_in[]; };
#define MASK(i) mask_in[i]
#define SPANS(i) spans_in[i]
#ifdef SB
layout(std430, binding = SB) readonly buffer S_ { vec2 stats_in[]; };
#define STATS(i) stats_in[i]
#endif
#endif
