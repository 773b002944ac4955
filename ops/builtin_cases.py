"""vkdsl's own verify rows as cases of the public API (vkdsl.cases): every golden case of
vkdsl_golden (its inputs and float64 reference) joined with its op's device builder, limit and
reason from the registry (vkdsl.verify.REGISTRY, filled by the core and the op library). `vkdsl
verify` is `vkdsl verify --cases builtin` against the goldens installed with vkdsl."""
from __future__ import annotations

import numpy as np

from vkdsl.cases import Case
from vkdsl.verify import REGISTRY
from vkdsl_golden.cases_gpu import every_case
from vkdsl_golden.dispatch import GRAD_INPUTS, evaluate, grad_inputs


def _forward(op, gout_shape):
    def reference(*ins, **params):
        gout = np.zeros(gout_shape) if op in GRAD_INPUTS else None
        return {k: v for k, v in evaluate(op, ins, params, gout).items()
                if not k.startswith("grad_in")}
    return reference


def _gradients(op):
    def grad_reference(*ins, gout, **params):
        res = evaluate(op, ins, params, gout)
        return [res[f"grad_in{i}"] for i in grad_inputs(op, params)]
    return grad_reference


def _device(op):
    def fn(*ins, **params):
        if op not in REGISTRY:
            raise LookupError(f"no device implementation registered for {op!r}")
        return REGISTRY[op].build(list(ins), params)
    return fn


def _case(g) -> Case:
    chk = REGISTRY.get(g.op)
    return Case(g.name, _device(g.op), _forward(g.op, g.gout_shape), g.make,
                limit=chk.limit if chk else 0.0,
                reason=chk.reason if chk else "no device implementation", params=g.params,
                grads=grad_inputs(g.op, g.params),
                grad_reference=_gradients(g.op) if g.op in GRAD_INPUTS else None, op=g.op,
                unsupported=chk.unsupported if chk else None, where="builtin")


def cases() -> list[Case]:
    """Every built-in case, in the installed manifest's order."""
    return [_case(g) for g in every_case()]


CASES = cases
