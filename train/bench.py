"""`vkdsl bench train`: SFT-step (forward + backward + optimizer) tokens/s on SmolLM2-135M at
batch 4 x 256, adapters on q and v and on all seven projections, and peak device memory;
`--objective dpo`: pairs/s and tokens/s of a DPO step (4 pairs x 64 response tokens), the
reference precomputed once. Beside it, in the same process, the numpy float32 forward of the
same model on the same tokens (no numpy backward exists to compare with)."""
from __future__ import annotations

import gc
import time

import numpy as np

import vkdsl
from vkdsl.autograd import grad
from vkdsl.models import load_model_files
from vkdsl.models.bench import numpy_forward
from vkdsl.models.default import default_model_path
from vkdsl.models.llama import Llama
from vkdsl.ops import losses
from vkdsl.ops.lora import LoRA
from vkdsl.ops.optim import AdamW
from vkdsl.runtime import default_device
from vkdsl.runtime.errors import DeviceMemoryError

from .step import head_rows

ALL = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _inject(model, modules, r=8, alpha=16.0):
    model.lora.clear()
    c = model.cfg
    for i in range(c.n_layers):
        for mod in modules:
            out_f, in_f = model.linear[f"blk.{i}.{mod}"].shape
            model.lora[f"blk.{i}.{mod}"] = LoRA.init(in_f, out_f, r, alpha, seed=i, name=mod)
    return [p for lo in model.lora.values() for p in lo.params()]


def _sft_step(model, params):
    opt = AdamW(params)

    @vkdsl.trace
    def step(ids, labels, scalars):
        B, T = ids.shape
        h = model.forward(ids, hidden_only=True).reshape(B * T, model.cfg.dim)
        # the head fused with the loss in row chunks, as the trainer's step (train.step.head_rows)
        lp, = head_rows(model, h, lambda lg, lab: losses.token_logprobs(lg, lab)[0], labels.reshape(B * T))
        loss = -lp.sum() * (1.0 / (B * T))
        opt.step(grad(loss, params), scalars)
        return loss
    return step, opt


def _free(model, step):
    """Drop a case's programs and adapters before the next case is built (their buffers go with the
    last reference): two alive at once exceed a 2 GiB heap such as lavapipe's."""
    step.programs.clear()
    model.lora.clear()
    gc.collect()


def _time(fn, reps=2):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_sft(model, w, B=4, T=256):
    T = min(T, model.cfg.context_length)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.cfg.vocab_size, (B, T)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    rows = []
    for name, mods in (("q,v", ("attn_q", "attn_v")), ("all seven", ALL)):
        dev = default_device()
        dev.peak_bytes = dev.allocated_bytes            # each case reports its own peak
        params = _inject(model, mods)
        step, opt = _sft_step(model, params)
        losses_seen = []
        try:
            t = _time(lambda: losses_seen.append(float(step(ids, labels, opt.scalars(1e-4)))))
        except DeviceMemoryError as e:             # said as a row: the other cases still run
            rows.append({"case": f"sft {B}x{T}, adapters on {name}", "error": f"does not fit: {e}"})
            _free(model, step)
            continue
        prog = step.program(ids, labels, opt.scalars(1e-4))
        prog_bytes = sum(b.nbytes for b in {id(b): b for b in prog.bufs.values()}.values())
        rows.append({"case": f"sft {B}x{T}, adapters on {name}", "trainable": sum(p.size for p in params),
                     "step_s": t, "tokens_per_s": B * T / t, "loss_first": losses_seen[0], "loss_last": losses_seen[-1],
                     "program_bytes": prog_bytes, "device_peak_bytes": dev.peak_bytes})
        prog.release()
        del prog
        _free(model, step)
    t0 = time.perf_counter()
    for b in range(B):
        numpy_forward(w, model.cfg, ids[b])
    npt = time.perf_counter() - t0
    rows.append({"case": f"numpy fp32 forward only, {B}x{T}", "step_s": npt, "tokens_per_s": B * T / npt})
    return rows


def quick_sft(B=1, T=64, path=None) -> dict:
    """A short SFT-step benchmark for `vkdsl doctor`: the default model, adapters on q,v, B x T
    tokens, best of 2 after a warm-up step, beside the numpy fp32 forward of the same tokens."""
    ck, _ = load_model_files(path or default_model_path())
    model = Llama(ck)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.cfg.vocab_size, (B, T)).astype(np.int32)
    params = _inject(model, ("attn_q", "attn_v"))
    step, opt = _sft_step(model, params)
    t = _time(lambda: float(step(ids, np.roll(ids, -1, axis=1), opt.scalars(1e-4))))
    _free(model, step)
    w = {k: v.astype(np.float32) for k, v in ck.dequantized().items()}
    t0 = time.perf_counter()
    for b in range(B):
        numpy_forward(w, model.cfg, ids[b])
    npt = time.perf_counter() - t0
    return {"case": f"{B}x{T}, adapters on q,v", "step_s": t, "tokens_per_s": B * T / t,
            "numpy_tokens_per_s": B * T / npt}


def dpo_step_and_inputs(model, P=4, T_prompt=32, T_resp=64):
    """The traced DPO step (adapters on q,v) and one batch of random pairs for it."""
    from . import dpo
    from .data import Example
    params = _inject(model, ("attn_q", "attn_v"))
    rng = np.random.default_rng(1)
    V = model.cfg.vocab_size

    def ex():
        ids = list(rng.integers(0, V, T_prompt + T_resp))
        lab = [-100] * (T_prompt - 1) + ids[T_prompt:] + [-100]
        return Example(ids, lab, "", "")
    pairs = [dpo.Pair(ex(), ex(), "bench") for _ in range(P)]
    step = dpo.build_dpo_step(model, params, 0.1, 0.0)
    ic, pc, lc, sc = dpo._pack([p.chosen for p in pairs], 0, 32, T_prompt + T_resp)
    ir, pr, lr, sr = dpo._pack([p.rejected for p in pairs], 0, 32, T_prompt + T_resp)
    return step, (ic, pc, lc, sc, ir, pr, lr, sr, np.zeros(P, np.float32), np.ones(1, np.float32))


def bench_dpo(model, P=4, T_prompt=32, T_resp=64):
    step, args = dpo_step_and_inputs(model, P, T_prompt, T_resp)
    t = _time(lambda: step(*args))
    tokens = 2 * P * (T_prompt + T_resp)
    return [{"case": f"dpo {P} pairs x {T_resp} response tokens (+{T_prompt} prompt), adapters on q,v",
             "step_s": t, "pairs_per_s": P / t, "tokens_per_s": tokens / t,
             "reference": "precomputed once (adapter off), cached"}]


def bench_train(objective="sft", path=None):
    ck, tok = load_model_files(path or default_model_path())
    model = Llama(ck)
    if objective == "dpo":
        return bench_dpo(model)
    w = {k: v.astype(np.float32) for k, v in ck.dequantized().items()}
    return bench_sft(model, w)
