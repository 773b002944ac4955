"""Table-driven GLSL for generated kernels: fused elementwise chains, reductions with a fused
elementwise prologue, and row gathers. Shapes are baked in (these kernels are small and
cheap to compile); hand-written kernels (matmul, ...) take shapes as push constants."""
from __future__ import annotations

import math
from typing import NamedTuple

CODE_FOR_OP = {
    "neg": "(-{0})", "exp": "exp({0})", "log": "log({0})", "sqrt": "sqrt({0})",
               "rsqrt": "inversesqrt({0})",
    "tanh": "vk_tanh({0})", "recip": "(1.0 / {0})", "sin": "sin({0})", "cos": "cos({0})",
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    "max": "vk_max({0}, {1})", "cmplt": "float({0} < {1})", "cmpeq": "float({0} == {1})",
    "where": "(({0} != 0.0) ? {1} : {2})", "contiguous": "{0}",
}
GLSL_TYPE = {"float32": "float", "int32": "int", "float16": "float16_t"}
VEC_TYPE = {"float32": "vec4", "int32": "ivec4", "float16": "f16vec4"}
# a value read from a buffer of this dtype, as the fp32 every expression computes in
WIDEN = {"float32": "{0}", "int32": "float({0})", "float16": "float({0})"}
# fp32 -> fp16, round to nearest even, in core GLSL (no fp16 arithmetic needed)
TO_HALF = "vk_half({0})"
# GLSL's tanh overflows to NaN for |x| > ~44 on some drivers; max must propagate NaN like numpy.
# Overflow spelled out: llvmpipe's vectorized packHalf2x16 saturates at 65504 where IEEE rounds
# |x| >= 65520 to infinity (its per-lane path, taken behind storage loads, does not).
PRELUDE = ("float vk_tanh(float x) { float e = exp(-2.0 * abs(x)); "
           "return sign(x) * (1.0 - e) / (1.0 + e); }\n"
           "float vk_half(float x) { return abs(x) >= 65520.0 ? x * (1.0/0.0) : "
           "unpackHalf2x16(packHalf2x16(vec2(x, 0.0))).x; }\n"
           "float vk_max(float a, float b) { "
           "return (isnan(a) || isnan(b)) ? a + b : max(a, b); }\n")
REDUCE = {"sum": ("0.0", "{acc} + {x}"), "max": ("-1.0/0.0", "vk_max({acc}, {x})")}


def _strides(shape):
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(reversed(st))


class Emitter:
    """Writes the statements for one fused expression; shared subexpressions become temporaries."""

    def __init__(self, leaf_index, direct=None, texel=()):
        self.leaf_index = leaf_index     # id(tensor) -> binding number, for materialized inputs
        # bindings that may be read as texel buffers: read through LD{k}(index) / LV{k}(index),
        # macros _texel_forms defines once it knows how each was read (scalar_reads, used_direct)
        self.texel, self.scalar_reads = set(texel), set()
        self.lines, self.memo, self.n = [], {}, 0
        # vector elementwise kernels: leaves shaped like the output's trailing axes (the output
        # itself or a broadcast row such as a norm weight), read at the output's index: from a vec4
        # loaded once (v{binding}[e]) while element e of the invocation is emitted
        self.direct, self.used_direct, self.e, self.out_idx = direct or {}, set(), None, None

    def element(self, e, idx):
        self.e, self.out_idx = e, list(idx)

    def tmp(self, expr, ty="float"):
        self.n += 1
        self.lines.append(f"  {ty} t{self.n} = {expr};")
        return f"t{self.n}"

    def index(self, expr):
        """Name a non-trivial index expression, so nested views cannot blow up the source."""
        if expr.isidentifier() or expr.endswith("u") and expr[:-1].isdigit():
            return expr
        self.n += 1
        self.lines.append(f"  uint t{self.n} = {expr};")
        return f"t{self.n}"

    def emit(self, t, idx):
        key = (id(t), tuple(idx))
        if key in self.memo:
            return self.memo[key]
        v = self._emit(t, idx)
        self.memo[key] = v
        return v

    def _emit(self, t, idx):
        if id(t) in self.direct and list(idx) == self.out_idx[len(self.out_idx) - t.ndim:]:
            k = self.direct[id(t)]
            self.used_direct.add(k)
            return f"float(v{k}[{self.e}])" if t.dtype == "int32" else f"v{k}[{self.e}]"
        if id(t) in self.leaf_index:
            off = (" + ".join(f"{i} * {s}u" for i, s in zip(idx, _strides(t.shape)) if s
                              and i != "0u") or "0u")
            k = self.leaf_index[id(t)]
            self.scalar_reads.add(k)
            load = f"LD{k}({off})" if k in self.texel else f"b{k}[{off}]"
            return self.tmp(WIDEN[t.dtype].format(load))
        op = t.op
        if op == "iota":
            return f"float({idx[0]})"
        if op == "const":
            v = t.arg
            return "(1.0/0.0)" if v == math.inf else "(-1.0/0.0)" if v == -math.inf else \
                "(0.0/0.0)" if v != v else repr(float(v))
        if op == "cast":  # a value of float16 dtype is the fp16-rounded value, stored or not
            v = self.emit(t.src[0], idx)
            return self.tmp(TO_HALF.format(v)) if t.dtype == "float16" else v
        if op in CODE_FOR_OP:
            args = [self.emit(s, idx) for s in t.src]
            return self.tmp(CODE_FOR_OP[op].format(*args))
        src = t.src[0]
        if op == "expand":
            return self.emit(src, [("0u" if s == 1 and d != 1 else i)
                                   for i, s, d in zip(idx, src.shape, t.shape)])
        if op == "permute":
            inv = [None] * len(idx)
            for i, a in enumerate(t.arg):
                inv[a] = idx[i]
            return self.emit(src, inv)
        if op == "slice":
            return self.emit(src, [i if a == 0 else self.index(f"{i} + {a}u")
                                   for i, a in zip(idx, t.arg)])
        if op == "reshape":
            return self.emit(src, [self.index(e) for e in reshape_index(idx, t.shape, src.shape)])
        if op == "pad":
            # Clamp the index so the load stays in bounds, then select zero outside the source.
            inside, cidx = [], []
            for i, (a, _), s in zip(idx, t.arg, src.shape):
                if a == 0 and s == t.shape[len(cidx)]:
                    cidx.append(i)
                    continue
                inside.append(f"({i} >= {a}u && {i} < {a + s}u)")
                cidx.append(self.index(f"min(uint(max(int({i}) - {a}, 0)), {max(s - 1, 0)}u)"))
            v = self.emit(src, cidx)
            return self.tmp(f"({' && '.join(inside) or 'true'}) ? {v} : 0.0")
        raise NotImplementedError(f"cannot fuse op {op} into an elementwise kernel")


def reshape_index(idx, new, old):
    """Map an index of the new shape onto the old one through the flat position."""
    if [s for s in new if s != 1] == [s for s in old if s != 1]:      # only unit axes move
        it = iter([i for i, s in zip(idx, new) if s != 1])
        return ["0u" if s == 1 else next(it) for s in old]
    flat = " + ".join(f"{i} * {s}u" for i, s in zip(idx, _strides(new)) if s) or "0u"
    return [f"(({flat}) / {st}u % {s}u)" if s != 1 else "0u" for s, st in zip(old, _strides(old))]


# texel format -> (GLSL sampler type, the read LD{k}(i) or LV{k}(i) stands for)
TEXEL_READ = {"r32f": ("samplerBuffer", "texelFetch(tx{k}, int(i)).x"),
              "r32ui": ("usamplerBuffer", "int(texelFetch(tx{k}, int(i)).x)"),
              "rgba32f": ("samplerBuffer", "texelFetch(tx{k}, int(i))"),
              "rgba32ui": ("usamplerBuffer", "ivec4(texelFetch(tx{k}, int(i)))")}


def _texel_forms(em, leaves) -> tuple[dict, str]:
    """(binding -> texel format, macro definitions) for the texel-eligible leaves: one read only as
    scalars is an r32 view, only as vec4s an rgba32 view; one read both ways stays a storage buffer
    (a binding has one view), its macros the storage reads."""
    forms, macros = {}, []
    for k in sorted(em.texel):
        scalar, vector = k in em.scalar_reads, k in em.used_direct
        if scalar == vector:
            macros += [f"#define LD{k}(i) b{k}[i]", f"#define LV{k}(i) b{k}v[i]"]
            continue
        forms[k] = ("r32" if scalar else "rgba32") + ("f" if leaves[k - 1].dtype == "float32"
                                                      else "ui")
        macros.append(f"#define {'LD' if scalar else 'LV'}{k}(i) "
                      + TEXEL_READ[forms[k]][1].format(k=k))
    return forms, "".join(m + "\n" for m in macros)


def _header(bindings, texels=None, macros=""):
    """bindings: [(glsl type, writeonly?)] by binding; texels: binding -> format of those read as
    uniform texel buffers (tx{k}) instead; macros: their reads (_texel_forms)."""
    texels = texels or {}
    out = ["#version 450",
           "layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;"]
    if any(ty == "float16_t" for ty, _ in bindings):
        # 16-bit storage alone: float16_t in buffers, converted to and from fp32 (no fp16
        # arithmetic)
        out.insert(1, "#extension GL_EXT_shader_16bit_storage : require")
    for i, (ty, wo) in enumerate(bindings):
        out.append(f"layout(binding = {i}) uniform {TEXEL_READ[texels[i]][0]} tx{i};" if i in texels
                   else f"layout(std430, binding = {i}) {'writeonly ' if wo else 'readonly '}"
                        f"buffer B{i} {{ {ty} b{i}[]; }};")
    return "\n".join(out) + "\n" + macros + PRELUDE


def _unflatten(var, shape):
    return [f"({var} / {st}u % {s}u)" if s != 1 else "0u" for s, st in zip(shape, _strides(shape))]


GID = "gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x"


LOCAL = 64                 # invocations per workgroup of an elementwise or per-output kernel
REDUCE_GROUP = 64          # workgroup of a reduction that gives each output a workgroup
SERIAL_OUTPUTS = 64        # outputs a serial (per-invocation) tree needs to fill a workgroup
# llvmpipe ends an invocation after 65,535 loop iterations in all, every loop counted together
# (gallivm's loop limiter): a serial tree's R iterations must stay well inside that
SERIAL_MAX_R = 32768


class Rendered(NamedTuple):
    """A generated kernel: GLSL source, its geometry (workgroup size, 1-d workgroup count) and the
    bindings it reads as uniform texel buffers ((binding, format), ...)."""
    name: str
    source: str
    local: tuple
    n_groups: int
    texels: tuple = ()


def kernel_name(step) -> str:
    """The systematic name of a generated step's kernel: kind and output shape."""
    return f"{step.kind}_{'x'.join(map(str, step.node.shape)) or 'scalar'}"


def render_step(step, subgroups: bool = False, texel_limit: int = 0,
                serial: bool = False) -> Rendered:
    """The kernel of one scheduled step (elementwise, reduce or gather): out is binding 0,
    step.inputs follow in order. subgroups: the device has subgroup arithmetic (a reduction with
    a workgroup per output then combines within subgroups first). texel_limit > 0: float32 and
    int32 inputs of at most that many elements are read as uniform texel buffers
    (handwritten.texel_limit). serial: a reduction with a workgroup per output runs the same
    tree inside one invocation per output where there are outputs enough to fill the lanes (CPU
    drivers: a barrier costs more there than the whole sum)."""
    t = step.node
    name = kernel_name(step)
    n = math.prod(t.shape)
    texel = [i + 1 for i, l in enumerate(step.inputs) if l.dtype in ("float32", "int32")
             and 0 < math.prod(l.shape) <= texel_limit]
    if step.kind == "reduce":
        R = t.src[0].shape[t.arg[1]]
        group = REDUCE_GROUP if R >= 128 else 1
        tree = serial and group > 1 and n >= SERIAL_OUTPUTS and R <= SERIAL_MAX_R
        src, forms = reduction(t, step.inputs, group, subgroups, texel, tree)
        local, groups = ((group, 1, 1), n) if group > 1 and not tree else \
            ((LOCAL, 1, 1), -(-n // LOCAL))
        return Rendered(name, src, local, groups, tuple(sorted(forms.items())))
    if step.kind == "gather":
        table, idx = t.src
        return Rendered(name, gather(table.shape, math.prod(idx.shape), *(t.arg or ())),
                        (LOCAL, 1, 1), -(-n // LOCAL))
    per = VEC_EW if vector_elementwise(t) else 1
    src, forms = elementwise(t, step.inputs, texel)
    return Rendered(name, src, (LOCAL, 1, 1), -(-n // (LOCAL * per)), tuple(sorted(forms.items())))


def elementwise(node, leaves, texel=()) -> tuple[str, dict]:
    """out[i] = expr(node) for every element; leaves are bound at 1.. in order. When the last axis
    is a multiple of VEC_EW, each invocation computes VEC_EW consecutive elements and every leaf
    read at exactly the output's index (same shape, no view between) is one vec4 load: on CPU
    drivers each load whose address differs between lanes is a loop over the lanes, so 4 floats per
    load instead of 1 is most of an elementwise kernel's time. texel: bindings that may be read as
    texel buffers (render_step). Returns (source, binding -> texel format)."""
    n = math.prod(node.shape)
    if not vector_elementwise(node):
        em = Emitter({id(l): i + 1 for i, l in enumerate(leaves)}, texel=texel)
        idx = [f"i{d}" for d in range(len(node.shape))]
        v = em.emit(node, idx)
        decl = "".join(f"  uint {name} = {expr};\n"
                       for name, expr in zip(idx, _unflatten("gid", node.shape)))
        body = "\n".join(em.lines)
        store = {"int32": "int({0})", "float16": "float16_t({0})"}.get(node.dtype, "{0}").format(v)
        forms, macros = _texel_forms(em, leaves)
        return (_header([(GLSL_TYPE[node.dtype], True)]
                        + [(GLSL_TYPE[l.dtype], False) for l in leaves], forms, macros) +
                f"void main() {{\n  uint gid = {GID};\n  if (gid >= {n}u) return;\n{decl}{body}\n  "
                f"b0[gid] = {store};\n}}\n"), forms
    nd = len(node.shape)
    direct = {id(l): i + 1 for i, l in enumerate(leaves) if 0 < l.ndim <= nd
              and l.shape == node.shape[nd - l.ndim:]}
    em = Emitter({id(l): i + 1 for i, l in enumerate(leaves)}, direct, texel)
    lines, vals = [], []
    for e in range(VEC_EW):
        idx = [f"i{d}_{e}" for d in range(len(node.shape))]
        lines += [f"  uint {name} = {expr};"
                  for name, expr in zip(idx, _unflatten(f"(g * {VEC_EW}u + {e}u)", node.shape))]
        em.element(e, idx)
        vals.append(em.emit(node, idx))
    def first(k):  # the vec4 holding elements 0..3 of this invocation, in leaf k's own layout
        t = leaves[k - 1]
        idx0 = [f"i{d}_0" for d in range(nd)][nd - t.ndim:]
        return (" + ".join(f"{i} * {st}u" for i, st in zip(idx0, _strides(t.shape)))
                + f") / {VEC_EW}u")
    # float16 is widened as it is read; int32 stays ivec4 (its loads widen each lane)
    def vec_load(k):
        t = leaves[k - 1]
        ty, src = ("vec4", f"vec4(b{k}v[({first(k)}])") if t.dtype == "float16" else \
            (VEC_TYPE[t.dtype], f"LV{k}(({first(k)})" if k in em.texel else f"b{k}v[({first(k)}]")
        return f"  {ty} v{k} = {src};"
    loads = [vec_load(k) for k in sorted(em.used_direct)]
    forms, macros = _texel_forms(em, leaves)
    vec = VEC_TYPE[node.dtype]
    store = (f"{vec}(vec4({', '.join(vals)}))" if node.dtype == "float16"
             else f"{vec}({', '.join(vals)})")
    aliases = "".join(f"layout(std430, binding = {k}) {'writeonly' if k == 0 else 'readonly'} "
                      f"buffer B{k}v {{ {VEC_TYPE[(node if k == 0 else leaves[k - 1]).dtype]} "
                      f"b{k}v[]; }};\n" for k in [0] + sorted(em.used_direct) if k not in forms)
    return (_header([(GLSL_TYPE[node.dtype], True)] + [(GLSL_TYPE[l.dtype], False) for l in leaves],
                    forms, macros)
            + aliases +
            f"void main() {{\n  uint g = {GID};\n  if (g >= {n // VEC_EW}u) return;\n"
            + "\n".join(lines) + "\n" +
            "\n".join(loads) + "\n" + "\n".join(em.lines) + f"\n  b0v[g] = {store};\n}}\n"), forms


VEC_EW = 4


def vector_elementwise(node) -> bool:
    """Whether an elementwise node is rendered VEC_EW elements per invocation (see elementwise)."""
    return len(node.shape) > 0 and node.shape[-1] % VEC_EW == 0 and math.prod(node.shape) > 0


SUBGROUP_OP = {"sum": "subgroupAdd", "max": "subgroupMax"}


def reduction(node, leaves, group: int, subgroups: bool = False, texel=(),
              tree: bool = False) -> tuple[str, dict]:
    """Reduce node.src[0] (a fused expression) along one axis. group == 1: one invocation per
    output; group > 1: one workgroup per output, strided loop, then a shared-memory tree -- or,
    with subgroup arithmetic, each subgroup's own combine, one barrier, and lane 0 combining the
    subgroups' partials (written for any subgroup size: no lane count is assumed) -- or, with
    tree, one invocation per output keeping the workgroup's `group` partials in an array: the
    same additions in the same order as the shared-memory tree, so the same bits. texel: bindings
    that may be read as texel buffers. Returns (source, binding -> texel format)."""
    kind, axis = node.arg
    src = node.src[0]
    init, comb = REDUCE[kind]
    em = Emitter({id(l): i + 1 for i, l in enumerate(leaves)}, texel=texel)
    n_out, R = math.prod(node.shape), src.shape[axis]
    idx = [f"i{d}" for d in range(len(node.shape))]
    decl = "".join(f"  uint {name} = {expr};\n"
                   for name, expr in zip(idx, _unflatten("o", node.shape)))
    idx[axis] = "r"
    v = em.emit(src, idx)
    body = "\n".join("  " + l for l in em.lines)
    forms, macros = _texel_forms(em, leaves)
    head = _header([("float", True)] + [(GLSL_TYPE[l.dtype], False) for l in leaves], forms, macros)
    if group == 1:
        return head + (f"void main() {{\n  uint o = {GID};\n  if (o >= {n_out}u) return;\n{decl}"
                       f"  float acc = {init};\n  for (uint r = 0u; r < {R}u; r++) {{\n{body}\n"
                       f"    acc = {comb.format(acc='acc', x=v)};\n  }}\n  b0[o] = acc;\n}}\n"
                       ), forms
    if tree:    # part[l] sums rows l, l + group, ... as lane l would, then the tree over part
        body = "\n".join("    " + l for l in em.lines)
        return head + (
            f"void main() {{\n  uint o = {GID};\n  if (o >= {n_out}u) return;\n{decl}"
            f"  float part[{group}];\n  for (uint l = 0u; l < {group}u; l++) part[l] = {init};\n"
            f"  for (uint r0 = 0u; r0 < {R}u; r0 += {group}u) {{\n"
            f"    for (uint l = 0u; l < {group}u && r0 + l < {R}u; l++) {{\n"
            f"      uint r = r0 + l;\n{body}\n"
            f"      part[l] = {comb.format(acc='part[l]', x=v)};\n    }}\n  }}\n"
            f"  for (uint s = {group // 2}u; s > 0u; s >>= 1)\n"
            f"    for (uint l = 0u; l < s; l++) part[l] = "
            f"{comb.format(acc='part[l]', x='part[l + s]')};\n  b0[o] = part[0];\n}}\n"), forms
    start = (f"shared float part[{group}];\n"
             f"void main() {{\n  uint o = gl_WorkGroupID.x + gl_WorkGroupID.y * "
             f"gl_NumWorkGroups.x;\n  uint lane = gl_LocalInvocationID.x;\n  bool live = o < "
             f"{n_out}u;\n  if (!live) o = 0u;\n{decl}  float acc = {init};\n  for (uint r = lane; "
             f"r < {R}u; r += {group}u) {{\n{body}\n    acc = "
             f"{comb.format(acc='acc', x=v)};\n  }}\n")
    if subgroups:
        op = SUBGROUP_OP[kind]
        if kind == "max":       # subgroupMax need not propagate NaN as numpy does: carry it beside
            combine = (f"  float bad = {op}(isnan(acc) ? 1.0 : 0.0);\n"
                       f"  acc = bad > 0.0 ? (0.0/0.0) : {op}(acc);\n")
        else:
            combine = f"  acc = {op}(acc);\n"
        ext = "#version 450\n#extension GL_KHR_shader_subgroup_arithmetic : require\n"
        return (head.replace("#version 450\n", ext, 1) + start + combine
                + "  if (gl_SubgroupInvocationID == 0u) part[gl_SubgroupID] = acc;\n  barrier();\n"
                + "  if (lane == 0u && live) {\n    float t = part[0];\n"
                + f"    for (uint s = 1u; s < gl_NumSubgroups; s++) t = "
                  f"{comb.format(acc='t', x='part[s]')};\n"
                + "    b0[o] = t;\n  }\n}\n"), forms
    return head + start + (f"  part[lane] = acc;\n  barrier();\n"
                   f"  for (uint s = {group // 2}u; s > 0u; s >>= 1) {{\n"
                   f"    if (lane < s) part[lane] = "
                   f"{comb.format(acc='part[lane]', x='part[lane + s]')};\n    barrier();\n  }}\n  "
                   f"if (lane == 0u && live) b0[o] = part[0];\n}}\n"), forms


def gather(table_shape, n_rows: int, base: int = 0, total: int | None = None) -> str:
    """out[i, :] = table[idx[i], :]; an index outside the table yields NaN rows, never a stray read.
    base, total: the table is rows [base, base + V) of one of total rows: other rows give 0."""
    V, D = table_shape
    head = (_header([("float", True), ("float", False), ("int", False)]) +
            f"void main() {{\n  uint gid = {GID};\n  if (gid >= {n_rows * D}u) return;\n"
            f"  uint i = gid / {D}u, d = gid % {D}u;\n  int row = b2[i];\n")
    if not base and (total is None or total == V):
        return (head + f"  b0[gid] = (row >= 0 && row < {V}) ? b1[uint(row) * {D}u + d] : "
                       f"(0.0/0.0);\n}}\n")
    return head + (f"  int r = row - {base};\n  b0[gid] = (row < 0 || row >= {total}) ? "
                   f"(0.0/0.0) : (r >= 0 && r < {V}) ? b1[uint(r) * {D}u + d] : 0.0;\n}}\n")
