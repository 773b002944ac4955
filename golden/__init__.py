"""Golden data for vkdsl: float64 numpy references and the stored cases devices are checked against.

    from vkdsl_golden import store
    for case in store.iter_cases(match="softmax"):       # manifest entries (+ "path")
        arrays = store.load_case(case)                   # sha256-checked: in0.., [gout], out, ...

Modules: reference (core DSL ops), reference_train (training ops + closed-form gradients),
elementary (platform-independent exp/log/...), dispatch.evaluate (op, inputs, params, gout ->
every stored output), store (manifest + loading), generate (the one generator:
`python -m vkdsl_golden.generate`). Nothing here imports vkdsl's core, by design.
"""
