// The format selected by a FMT_* define (QB0 = first binding of its arrays).
#include "quant_common.glsl"
#if defined(FMT_Q4_0)
#include "quant_q4_0.glsl"
#elif defined(FMT_Q4_1)
#include "quant_q4_1.glsl"
#elif defined(FMT_Q8_0)
#include "quant_q8_0.glsl"
#elif defined(FMT_INT4)
#include "quant_int4.glsl"
#elif defined(FMT_NF4)
#include "quant_nf4.glsl"
#elif defined(FMT_F16)
#include "quant_f16.glsl"
#elif defined(FMT_Q4_K) || defined(FMT_Q5_K)
#include "quant_q4_k.glsl"
#elif defined(FMT_Q6_K)
#include "quant_q6_k.glsl"
#else
#error no FMT_* define
#endif
