"""`vkdsl bench train`: the trainer's own optimizer step, timed — train.loop.one_step over the
objectives vkdsl-train builds (trainer.SftObjective / the Stepper, dpo.DpoObjective), with the host
AdamW, clipping and write-back included. Rows: SFT on SmolLM2-135M at batch 4 x 256 (every position
supervised, adapters on q,v and on all seven projections of every layer, TMKL off), one step of the
default job as vkdsl-train runs it (its rows, adapters, TMKL, frozen prefix; default model only),
and with `--objective dpo` a DPO step of 4 pairs x 64 response tokens (reference precomputed).
Beside them, in the same process, the numpy float32 forward of the same tokens (no numpy backward
exists)."""
from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

import numpy as np

import vkdsl
from vkdsl.models import load_model_files
from vkdsl.models.bench import numpy_forward
from vkdsl.models.default import default_model_path
from vkdsl.models.build import build_model
from vkdsl.models.llama import Llama
from vkdsl.realize import deferred_uploads, upload_all
from vkdsl.runtime import default_device
from vkdsl.runtime.errors import DeviceMemoryError

from . import loop
from .config import TrainConfig
from .distributed import Single
from .inject import inject, params_of
from .prefix import FrozenPrefix
from .step import Stepper

ALL = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
BENCH = dict(layers="", rank=8, alpha=16.0, tmkl=0.0, pack=False, verify=False, quiet=True)


class FixedBatch:
    """An order that serves the same batch every step (the bench shapes' random tokens)."""

    def next(self):
        return [0]


class StepperObjective:
    """The SFT objective's gradient (Stepper.gradient, as trainer.SftObjective calls it) on one
    fixed micro-batch, so loop.one_step times exactly the trainer's step at the bench shapes."""
    stage, finite, steps = "sft", ("loss", "tmkl"), 1 << 30

    def __init__(self, stepper, micro, lr=1e-4):
        self.stepper, self.micro, self.lr_value = stepper, micro, lr
        self.order, self.clip = FixedBatch(), stepper.cfg.clip

    def lr(self, step):
        return self.lr_value

    def gradient(self, idx, step):
        return self.stepper.gradient(self.micro)


def _time(fn, reps=2):
    fn()                                # compiles
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _free(model, *traced):
    """Drop a case's programs and adapters before the next case is built (their buffers go with the
    last reference): two alive at once exceed a 2 GiB heap such as lavapipe's."""
    for t in traced:
        t.programs.clear()
    model.lora.clear()
    gc.collect()


def random_batch(model, B, T):
    """B x T random tokens with every position supervised (the next token): the bench shapes."""
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (B, T)).astype(np.int32)
    return ids, np.roll(ids, -1, axis=1)


def numpy_forward_s(w, cfg, ids) -> float:
    """Seconds of the numpy float32 forward of each row of ids (models.bench.numpy_forward)."""
    t0 = time.perf_counter()
    for row in ids:
        numpy_forward(w, cfg, row)
    return time.perf_counter() - t0


def default_llama(path=None) -> Llama:
    return Llama(load_model_files(path or default_model_path())[0])


def sft_stepper(model, targets, **kw):
    cfg = TrainConfig(**{**BENCH, "targets": list(targets), **kw}).validate()
    names = inject(model, cfg)
    params = params_of(model, names)
    return Stepper(model, params, cfg, FrozenPrefix(model, 0, 0)), params


def time_stepper(model, stepper, params, micro, reps=2, lr=1e-4):
    """(best seconds, records) of loop.one_step on the Stepper's objective: a warm-up step (which
    compiles), then reps timed steps, all on the same batch."""
    obj, recs = StepperObjective(stepper, micro, lr), []
    t = _time(lambda: recs.append(loop.one_step(obj, params, stepper.opt, 0)), reps)
    return t, recs


TARGETS = {"q,v": ("attn_q", "attn_v"), "all seven": ALL}


def bench_sft(model, w, B=4, T=256, checkpoint="none", plan_only=False, targets=tuple(TARGETS),
              steps=0, lr=1e-4, modules=TARGETS, activations="fp32"):
    T = min(T, model.cfg.context_length)
    ids, labels = random_batch(model, B, T)
    rows = []
    for name, mods in ((n, modules[n]) for n in targets):
        dev = default_device()
        dev.peak_bytes = dev.allocated_bytes            # each case reports its own peak
        st, params = sft_stepper(model, mods, checkpoint=checkpoint, activations=activations)
        case = (f"sft {B}x{T}, adapters on {name} (trainer step" + ("" if checkpoint == "none" else
                                                                    f", checkpoint {checkpoint}")
                + ("" if activations == "fp32" else f", activations {activations}") + ")")
        args = (ids, *_select_args(labels))
        planned = st.fn.plan(*args)         # traced and scheduled, nothing allocated
        if plan_only:
            rows.append({"case": case, "weights_bytes": model.device_bytes()["device_bytes"],
                         **{f"plan_{k}_bytes": v for k, v in planned.items()}})
            _free(model, st.fn, st.fn_packed)
            continue
        against = {} if activations == "fp32" else fp32_gradients_vs(model, params, st, args)
        dev.peak_bytes = dev.allocated_bytes  # the comparison's fp32 program is not this case's
        error = ""
        try:
            t, recs = time_stepper(model, st, params, [(ids, labels)],
                                   reps=steps or (2 if B * T <= 2048 else 1), lr=lr)
        except DeviceMemoryError as e:             # said as a row: the other cases still run
            error = f"does not fit: {e}"
        if error:   # freed after the except: its traceback holds the half-built program's buffers
            rows.append({"case": case, "error": error})
            _free(model, st.fn, st.fn_packed)
            continue
        prog = st.fn.program(*args)
        prog_bytes = prog.device_bytes
        plan_bytes = planned["total"] - planned["staging"]
        rows.append({"case": case, "trainable": sum(p.size for p in params), "step_s": t,
                     "tokens_per_s": B * T / t, "loss_first": recs[0]["loss"],
                     "loss_last": recs[-1]["loss"],
                     "losses": " ".join(f"{r['loss']:.4f}" for r in recs),
                     "program_bytes": prog_bytes, "plan_bytes": plan_bytes,
                     "plan_vs_program": plan_bytes / prog_bytes,
                     "device_peak_bytes": dev.peak_bytes, **against})
        prog.release()
        del prog
        _free(model, st.fn, st.fn_packed)
    if plan_only or w is None:  # long rows: the numpy forward's (T, T) scores would dominate
        return rows
    npt = numpy_forward_s(w, model.cfg, ids)
    rows.append({"case": f"numpy fp32 forward only, {B}x{T}", "step_s": npt,
                 "tokens_per_s": B * T / npt})
    return rows


def fp32_gradients_vs(model, params, st, args) -> dict:
    """The step's loss and adapter gradients at the initial adapters (B perturbed off zero, so every
    path carries a gradient), from st's program and from the same step keeping fp32 activations:
    the relative L2 distance of the whole gradient, the largest of any one tensor, the losses."""
    from .step import build_grad_fn
    rng = np.random.default_rng(1)
    for p in params:
        if not np.any(p.numpy()):
            p.assign(vkdsl.tensor(rng.normal(0, 0.02, p.shape).astype(np.float32)))
    ref = build_grad_fn(model, params, st.cfg.tmkl, checkpoint=st.cfg.checkpoint_layers)
    outs = {}
    for name, fn in (("fp32", ref), ("kept", st.fn)):
        outs[name] = [np.asarray(o, np.float64) for o in fn(*args)]
        if fn is ref:
            fn.programs.clear()
            gc.collect()
    a, b = outs["fp32"][2:], outs["kept"][2:]
    def dist(x, y):
        return float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30))
    return {"loss_fp32_activations": float(outs["fp32"][0]), "loss_this": float(outs["kept"][0]),
            "grad_rel_l2_vs_fp32": dist(np.concatenate([g.ravel() for g in a]),
                                        np.concatenate([g.ravel() for g in b])),
            "grad_worst_tensor_vs_fp32": max(dist(x, y) for x, y in zip(a, b))}


def _select_args(labels):
    from .step import select
    pos, lab = select(labels)
    return pos, lab, np.ones(1, np.float32)


def default_job_run(path=None):
    """The Run vkdsl-train builds for its default job (no training), in a scratch folder."""
    from .progress import Reporter
    from .trainer import Run
    cfg = TrainConfig(verify=False, quiet=True, model=path or "").validate()
    return Run(cfg, Path(tempfile.mkdtemp(prefix="vkdsl-bench-")), Reporter(None, quiet=True))


def bench_default_job(path=None, steps=3):
    """Steps 1..steps of the default job through loop.one_step on its SftObjective; step 1 compiles,
    the best of the others is reported (each takes the next batch, as training does)."""
    from .trainer import SftObjective
    r = default_job_run(path)
    obj = SftObjective(r)
    times, tokens = [], []
    for s in range(steps):
        t = time.perf_counter()
        rec = loop.one_step(obj, r.params, r.stepper.opt, s)
        times.append(time.perf_counter() - t)
        tokens.append(rec["computed"])
    k = int(np.argmin(times[1:])) + 1
    return [{"case": f"default job: one step ({r.cfg.batch_size} rows, TMKL {r.cfg.tmkl}, layers "
                     f"{r.cfg.layers}, best of steps 2-{steps})", "step_s": times[k],
             "tokens_per_s": tokens[k] / times[k], "first_step_s": times[0]}]


def quick_sft(B=1, T=64, path=None) -> dict:
    """A short SFT-step benchmark for `vkdsl doctor`: the trainer's step on the default model,
    adapters on q,v, B x T tokens, best of 2 after a warm-up step, beside the numpy fp32 forward."""
    ck, _ = load_model_files(path or default_model_path())
    model = Llama(ck)
    ids, labels = random_batch(model, B, T)
    st, params = sft_stepper(model, ("attn_q", "attn_v"))
    t, _ = time_stepper(model, st, params, [(ids, labels)])
    _free(model, st.fn, st.fn_packed)
    w = {k: v.astype(np.float32) for k, v in ck.dequantized().items()}
    npt = numpy_forward_s(w, model.cfg, ids)
    return {"case": f"{B}x{T}, adapters on q,v", "step_s": t, "tokens_per_s": B * T / t,
            "numpy_tokens_per_s": B * T / npt}


def dpo_objective(model, P=4, T_prompt=32, T_resp=64):
    """The trainer's DPO objective (adapters on q,v of every layer) over P random pairs, the
    reference log-probs zero (precomputed in a real run), and its optimizer."""
    from . import dpo
    from .data import Example
    from .step import HostAdamW
    cfg = TrainConfig(**{**BENCH, "targets": ["attn_q", "attn_v"], "dpo_batch": P, "bucket": 32,
                         "max_len": T_prompt + T_resp}).validate()
    params = params_of(model, inject(model, cfg))
    rng = np.random.default_rng(1)
    V = model.cfg.vocab_size

    def ex():
        ids = rng.integers(0, V, T_prompt + T_resp).tolist()
        return Example(ids, [-100] * (T_prompt - 1) + ids[T_prompt:] + [-100], "", "")
    pairs = [dpo.Pair(ex(), ex(), "bench") for _ in range(P)]
    zero = np.zeros(P)
    obj = dpo.DpoObjective(model, params, cfg, 0, pairs, zero, zero, FrozenPrefix(model, 0, 0),
                           Single(), lambda s: None, lambda *a, **k: None, "base")
    return obj, params, HostAdamW([p.shape for p in params], cfg.betas, cfg.eps, cfg.weight_decay)


def bench_dpo(model, P=4, T_prompt=32, T_resp=64):
    obj, params, opt = dpo_objective(model, P, T_prompt, T_resp)
    t = _time(lambda: loop.one_step(obj, params, opt, 0))
    tokens = 2 * P * (T_prompt + T_resp)
    return [{"case": f"dpo {P} pairs x {T_resp} response tokens (+{T_prompt} prompt), adapters on "
                     f"q,v (trainer step)",
             "step_s": t, "pairs_per_s": P / t, "tokens_per_s": tokens / t,
             "reference": "precomputed once (adapter off), cached"}]


def parse_shape(shape: str) -> tuple[int, int]:
    """'BxT' -> (B, T), both positive, or one line naming what was expected."""
    b, sep, t = shape.lower().partition("x")
    if not (sep and b.isdigit() and t.isdigit() and int(b) > 0 and int(t) > 0):
        raise ValueError(f"--shape {shape!r}: expected ROWSxTOKENS, e.g. 4x256 or 1x4096")
    return int(b), int(t)


def parse_targets(targets: str) -> tuple[str, ...]:
    names = {"qv": "q,v", "all": "all seven"}
    picked = tuple(names.get(t.strip()) for t in targets.split(","))
    if None in picked:
        raise ValueError(f"--targets {targets!r}: expected qv, all or qv,all")
    return picked


def bench_train(objective="sft", path=None, checkpoint="none", plan_only=False, shape="4x256",
                targets="qv,all", steps=0, lr=1e-4, activations="fp32"):
    """The rows of `vkdsl bench train`; plan_only: each SFT case's planned device bytes (weights,
    the step program's inputs, outputs, temporaries after reuse, staging), nothing run or
    allocated."""
    # a bad value: one line, no work
    TrainConfig(checkpoint=checkpoint, activations=activations).validate()
    (B, T), picked = parse_shape(shape), parse_targets(targets)
    ck, tok = load_model_files(path or default_model_path())
    with deferred_uploads() as pending:   # --plan: the weights never reach the device
        model = build_model(ck)
    if not plan_only:
        upload_all(pending)
    hybrid = model.cfg.arch == "qwen35"  # no Llama numpy forward beside it; "all": every projection
    modules = {**TARGETS, "all seven": ("all-linear",)} if hybrid else TARGETS
    if objective == "dpo":
        return bench_dpo(model)
    if plan_only:
        return bench_sft(model, None, B, T, checkpoint, plan_only=True, targets=picked,
                         modules=modules, activations=activations)
    w = ({k: v.astype(np.float32) for k, v in ck.dequantized().items()} if T <= 512 and not hybrid
         else None)
    rows = bench_sft(model, w, B, T, checkpoint, targets=picked, steps=steps, lr=lr,
                     modules=modules, activations=activations)
    if (path or checkpoint != "none" or activations != "fp32" or (B, T) != (4, 256)
        or picked != tuple(TARGETS) or steps):
        return rows                     # the default job: its own model, settings and shapes
    del model
    gc.collect()
    return rows + bench_default_job()

