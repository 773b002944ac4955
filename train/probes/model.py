"""Probes on a real model that train little or nothing: the zero-B initialization, the spectrum of
an unconstrained update beside a LoRA one, merged-vs-separate adapters in three precisions, and
4-bit storage of the base (packed, and the fp32 negative control)."""
from __future__ import annotations

import gc

import numpy as np

import vkdsl
from vkdsl.models.build import build_model
from vkdsl.models.quantized import PACKED_GGUF, Packed
from vkdsl.models.tensors import TensorRecord
from vkdsl.models.weights import Dense
from vkdsl.ops import quant
from vkdsl.ops.lora import LoRA

from ..data import load_passages
from ..evidence import mean_loss
from ..schedule import sft_lr
from ..scoring import Scorer
from ..step import Stepper
from .base import Expectation, Result, probe
from .common import config, open_run, spectrum_stats, train_run


def _rows_ids(r, n):
    """The first n held-out rows (else training rows), cut to the shortest: every position real."""
    rows = (r.heldout or r.train)[:n]
    T = min(len(x.ids) for x in rows)
    return np.array([x.ids[:T] for x in rows], np.int32)


def _norm(g) -> float:
    return float(np.sqrt(np.sum(np.asarray(g, np.float64) ** 2)))


@probe("init", "zero-B init: logits equal the base's exactly; first backward dA = 0, dB != 0 in "
               "every module; "
       "second backward dA != 0", needs_model=True, minutes="25 s", rows=4)
def init(ctx) -> Result:
    """The trainer's default adapters (B = 0, A random) on the model: the adapted logits against
    adapters off on held-out rows, then the trainer's own first two optimizer steps. dL/dA =
    x^T (dY B^T) s contains B, so it is exactly zero until B has moved once."""
    r = open_run(ctx, "init")
    x = vkdsl.tensor(_rows_ids(r, ctx.params["rows"]))
    diff = float(np.abs(r.model.forward(x, adapters_on=True).numpy()
                        - r.model.forward(x, adapters_on=False).numpy()).max())
    g1 = r.stepper.step(r.micro_batches(r.sampler.next()), sft_lr(1, r.cfg))["raw_grads"]
    g2 = r.stepper.step(r.micro_batches(r.sampler.next()), sft_lr(2, r.cfg))["raw_grads"]
    rows = [{"module": n, "|dA| step 1": _norm(g1[2 * k]), "|dB| step 1": _norm(g1[2 * k + 1]),
             "|dA| step 2": _norm(g2[2 * k])} for k, n in enumerate(r.names)]
    m = len(rows)
    ex = [Expectation("adapted logits == base logits (B = 0)",
                      f"max |diff| = {diff:g} over {x.shape[0]} rows", diff == 0.0),
          Expectation("first backward: dA = 0 exactly in every module",
                      f"{sum(not np.any(g1[2 * k]) for k in range(m))}/{m} modules exactly 0",
                      all(not np.any(g1[2 * k]) for k in range(m))),
          Expectation("first backward: dB != 0 in every module",
                      f"{sum(bool(np.any(g1[2 * k + 1])) for k in range(m))}/{m}; smallest |dB| "
                      f"{min(x['|dB| step 1'] for x in rows):.3g}",
                      all(np.any(g1[2 * k + 1]) for k in range(m))),
          Expectation("second backward (after one step moved B): dA != 0 in every module",
                      f"{sum(bool(np.any(g2[2 * k])) for k in range(m))}/{m}; smallest |dA| "
                      f"{min(x['|dA| step 2'] for x in rows):.3g}",
                      all(np.any(g2[2 * k]) for k in range(m)))]
    return Result(f"init: zero-B LoRA on {m} modules of {ctx.model or 'the default model'}",
                  list(rows[0]), rows, ex)


def _train(r, stepper, steps):
    """-> (training-set loss before, after): every training row scored, adapters on."""
    # same order
    r.sampler = type(r.sampler)(r.train, r.cfg.batch_size * r.cfg.grad_accum, r.cfg.data_seed)
    before = mean_loss(r.scorer.row_logprobs(r.train, True))
    for s in range(1, steps + 1):
        stepper.step(r.micro_batches(r.sampler.next()), sft_lr(s, r.cfg))
    return before, mean_loss(r.scorer.row_logprobs(r.train, True))


@probe("full-update-svd",
       "one projection trained unconstrained: its dW spectrum (50/90/95/99% directions, stable "
       "rank) beside a LoRA update of the same module", needs_model=True, minutes="2 min",
       module="blk.26.attn_v", steps=30, lr=2e-3, full_lr=1e-3, rank=8)
def full_update_svd(ctx) -> Result:
    """The module's full update dW (in x out) is trained as an adapter whose A is the identity,
    frozen, and B = dW (scale 1): exactly W + dW, every entry free. Then a rank-r LoRA on the same
    module, same rows in the same order, the trainer's own step (plain CE)."""
    p = ctx.params
    r = open_run(ctx, "full-update-svd", targets=[p["module"]], layers="", rank=p["rank"], tmkl=0.0,
                 lr=p["lr"], steps=p["steps"])
    name = r.names[0]
    lo = r.model.lora[name]
    d_in, d_out = lo.A.shape[0], lo.B.shape[1]
    full = LoRA(vkdsl.tensor(np.eye(d_in, dtype=np.float32)),
                vkdsl.tensor(np.zeros((d_in, d_out), np.float32), requires_grad=True,
                             name=f"{name}.dW"), 1.0)
    r.model.lora[name] = full
    r.cfg.lr = p["full_lr"]
    loss_full = _train(r, Stepper(r.model, [full.B], r.cfg, r.prefix), p["steps"])
    dw_full = full.B.numpy()
    r.model.lora[name] = lo
    r.cfg.lr = p["lr"]
    loss_lora = _train(r, Stepper(r.model, lo.params(), r.cfg, r.prefix), p["steps"])
    dw_lora = lo.scale * (lo.A.numpy().astype(np.float64) @ lo.B.numpy().astype(np.float64))
    rows = []
    stats = {}
    for what, dw, ls, lr in (("full dW", dw_full, loss_full, p["full_lr"]),
                             (f"LoRA r={p['rank']} s*A*B", dw_lora, loss_lora, p["lr"])):
        s = stats[what] = spectrum_stats(dw)
        rows.append({"update": what, "lr": lr, "train loss before": ls[0], "after": ls[-1],
                     "||dW||_F": s["fro"], "top 3 sv": ", ".join(f"{v:.3g}" for v in s["sv"][:3]),
                     "50%": s["n50"], "90%": s["n90"], "95%": s["n95"], "99%": s["n99"],
                     "stable rank": s["stable_rank"], "smallest sv": s["smallest"]})
    sl, sf = stats[rows[1]["update"]], stats["full dW"]
    k = p["rank"]
    ex = [Expectation(f"the LoRA update has at most r = {k} nonzero singular values (sigma_{k + 1} "
                      f"<= 1e-5 sigma_1)",
                      f"sigma_{k + 1} / sigma_1 = {sl['sv'][k] / sl['sv'][0]:.2e}",
                      sl["sv"][k] <= 1e-5 * sl["sv"][0]),
          Expectation("both trainings lower the loss over the training rows",
                      f"full {loss_full[0]:.3f} -> {loss_full[-1]:.3f}, LoRA {loss_lora[0]:.3f} -> "
                      f"{loss_lora[-1]:.3f}",
                      loss_full[-1] < loss_full[0] and loss_lora[-1] < loss_lora[0]),
          Expectation(f"the unconstrained update is not rank {k}: sigma_{k + 1} > 1e-3 sigma_1",
                      f"sigma_{k + 1} / sigma_1 = {sf['sv'][k] / sf['sv'][0]:.2e}, 99% of "
                      f"||dW||^2 needs {sf['n99']} of {len(sf['sv'])} directions",
                      sf["sv"][k] > 1e-3 * sf["sv"][0], structural=False)]
    from ..charts import line_chart
    chart = line_chart({w: (s["sv"] / s["sv"][0]).tolist() for w, s in stats.items()},
                       "singular value index", "sigma_i / sigma_1 (log)", log=True)
    return Result(f"full-update-svd: {name} ({d_in} x {d_out}), {p['steps']} steps each on the "
                  f"training rows", list(rows[0]), rows, ex, charts=[chart],
                  notes=["directions = singular values needed for that share of ||dW||_F^2; "
                         "stable rank = ||dW||_F^2 / sigma_1^2 (concentration, not a count of "
                         "directions used)"])


def _swap(model, weights: dict):
    """Replace linears (and drop their adapters); returns what to restore."""
    saved = {n: (model.linear[n], model.lora.get(n)) for n in weights}
    table = dict(model.lora)
    for n, w in weights.items():
        model.linear[n] = w
        table.pop(n, None)
    model.lora = table
    return saved


def _restore(model, saved):
    table = dict(model.lora)
    for n, (w, lo) in saved.items():
        model.linear[n] = w
        if lo is not None:
            table[n] = lo
    model.lora = table


def _requant(w: np.ndarray, ggml_type: str, name: str):
    """w (out, in) stored back into a GGUF block format by the gguf package's own quantizer."""
    from gguf import GGMLQuantizationType, quants
    raw = quants.quantize(np.ascontiguousarray(w, np.float32), GGMLQuantizationType[ggml_type])
    return TensorRecord(name, ggml_type, tuple(w.shape), raw)


def _stored_values(w, ggml_type, name) -> np.ndarray:
    """w as it reads back after being stored in the base's own format (float64)."""
    if ggml_type in PACKED_GGUF:
        return _requant(w, ggml_type, name).dequantize().astype(np.float64)
    return w.astype(np.float16 if ggml_type == "F16" else np.float32).astype(np.float64)


def _stored(w, ggml_type, name):
    """w stored in the base's own format on the device: packed blocks, or dense fp16/fp32 values."""
    if ggml_type in PACKED_GGUF:
        return Packed(_requant(w, ggml_type, name))
    return Dense(_stored_values(w, ggml_type, name).astype(np.float32), name + ".stored")


@probe("merge", "merged vs separate adapters: max |logit diff| and argmax agreement for "
                "fp32, f16 and requantized merges, with the update requantization erases",
       needs_model=True,
       minutes="1.7 min", steps=16, rows=8)
def merge(ctx) -> Result:
    """Trains the default adapters for `steps` steps, then merges every adapted module,
    W' = W + s (A B)^T, three ways: fp32, rounded to f16, and requantized into the base's own block
    format; each merged model's logits at every position of held-out rows against the separate
    path (packed W, adapter beside it)."""
    p = ctx.params
    r = open_run(ctx, "merge", steps=p["steps"], tmkl=0.0)
    r.train_loop()
    x = vkdsl.tensor(_rows_ids(r, p["rows"]))
    sep = r.model.forward(x).numpy()
    base = {n: r.ckpt[n + ".weight"].dequantize().astype(np.float64) for n in r.names}
    upd = {n: r.model.lora[n].scale * (r.model.lora[n].A.numpy().astype(np.float64)
                                       @ r.model.lora[n].B.numpy().astype(np.float64)).T
           for n in r.names}
    merged = {n: base[n] + upd[n] for n in r.names}
    fmts = sorted({r.ckpt[n + ".weight"].ggml_type for n in r.names})
    variants = {
        "fp32": {n: Dense(merged[n].astype(np.float32), n + ".merged") for n in r.names},
        "f16": {n: Dense(merged[n].astype(np.float16).astype(np.float32), n + ".merged16")
                for n in r.names},
        f"requantized "
        f"({'/'.join(fmts)})": {n: _stored(merged[n], r.ckpt[n + ".weight"].ggml_type, n)
                                             for n in r.names}}
    kept, lost, base_err = [], [], []
    for n in r.names:
        t = r.ckpt[n + ".weight"].ggml_type
        back = _stored_values(merged[n], t, n)
        u2 = float(np.sum(upd[n] ** 2))
        kept.append(float(np.sum((back - base[n]) * upd[n]) / u2))
        lost.append(float(np.linalg.norm(back - base[n] - upd[n]) / np.sqrt(u2)))
        base_err.append(float(np.linalg.norm(_stored_values(base[n], t, n) - base[n])
                              / np.sqrt(u2)))
    off = r.model.forward(x, adapters_on=False).numpy()
    rows = [{"merge": "none: the base alone (adapter off)",
             "max |logit diff|": float(np.abs(off - sep).max()),
             "argmax agreement": float((off.argmax(-1) == sep.argmax(-1)).mean()),
             "weight bytes": sum(r.model.linear[n].device_bytes for n in r.names)}]
    for what, ws in variants.items():
        saved = _swap(r.model, ws)
        try:
            mer = r.model.forward(x).numpy()
        finally:
            _restore(r.model, saved)
        rows.append({"merge": what, "max |logit diff|": float(np.abs(mer - sep).max()),
                     "argmax agreement": float((mer.argmax(-1) == sep.argmax(-1)).mean()),
                     "weight bytes": sum(w.device_bytes for w in ws.values())})
    fp32 = rows[1]
    ex = [Expectation("the fp32 merge is the separate path up to rounding: max |diff| <= 1e-2 and "
                      "argmax agreement 1",
                      f"{fp32['max |logit diff|']:.2e}, {fp32['argmax agreement']:.3f}",
                      fp32["max |logit diff|"] <= 1e-2 and fp32["argmax agreement"] == 1.0),
          Expectation("requantizing the merge keeps the update in its own direction (mean kept "
                      "share > 0.5)",
                      f"kept share mean {np.mean(kept):.3f} (min {min(kept):.3f}), residual "
                      f"{np.mean(lost):.2f} x ||update||", float(np.mean(kept)) > 0.5,
                      structural=False)]
    return Result(f"merge: {len(r.names)} adapted modules after {p['steps']} steps, logits at "
                  f"{x.shape[0]} x {x.shape[1]} positions", list(rows[0]), rows, ex,
                  notes=[f"requantization into {'/'.join(fmts)}: the update's share kept "
                         f"along itself <requant(W') - W, U> / ||U||^2 mean {np.mean(kept):.3f} "
                         f"(min {min(kept):.3f}, max {max(kept):.3f}); the residual ||requant(W') "
                         f"- W - U|| is {np.mean(lost):.2f} x ||U|| on average, while requantizing "
                         f"W alone moves it {np.mean(base_err):.2f} x ||U||"])


def _fro_errors(ck, names, fmt):
    out = []
    for n in names:
        w = ck[n].dequantize().astype(np.float32)
        q = quant.quantize_int4(w) if fmt == "int4" else quant.quantize_nf4(w)
        out.append(float(np.linalg.norm(quant.dequantize(q).astype(np.float64) - w)
                         / np.linalg.norm(w)))
    return out


def _pres(model, passages, tok, cfg):
    pad = tok.pad_id if tok.pad_id is not None else tok.eos_id
    return mean_loss(Scorer(model, pad, cfg.bucket, cfg.max_len,
                            cfg.eval_batch).row_logprobs(passages, False))


@probe("int4-storage",
       "the base in packed int4 / NF4: round-trip error per matrix, device bytes from the "
       "allocations, preservation loss, an adapter trained on it; 4-bit values in fp32 "
       "save nothing", needs_model=True, minutes="4.1 min", steps=16, train=True)
def int4_storage(ctx) -> Result:
    """Every matrix whose rows split into groups of 64 (the projections and the embedding/LM head)
    is quantized on load (quant = int4: symmetric, one scale per 64; nf4: the NormalFloat codebook
    with absmax scales) and stays packed on the device, dequantized inside the matmul shader. The
    negative control holds the same int4-rounded values in fp32 tensors."""
    ck, tok = ctx.files()
    cfg = config(ctx, "int4-storage")
    passages = load_passages(cfg.preservation_file, tok, cfg.max_len)
    names = [n for n in ck.tensors if len(ck[n].shape) == 2 and ck[n].shape[1] % 64 == 0]
    errs = {f: _fro_errors(ck, names, f) for f in ("int4", "nf4")}
    rows = []
    file_types = "/".join(sorted({ck[n].ggml_type for n in names}))
    for label, q in (("fp32 (the file dequantized)", "none"),
                     (f"the file's blocks ({file_types})", "keep"), ("int4 packed", "int4"),
                     ("NF4 packed", "nf4"), ("int4 values in fp32 (control)", "control")):
        ctx.say(f"  {label} ...")
        model = build_model(ck, quant="none" if q == "control" else q)
        if q == "control":
            tied = model.head is model.embed
            for n in names:
                w = Dense(
                    quant.dequantize(quant.quantize_int4(ck[n].dequantize().astype(np.float32))), n)
                if n == "token_embd.weight":
                    model.embed = w
                    model.head = w if tied else model.head
                elif n == "output.weight":
                    model.head = w
                else:
                    model.linear[n.removesuffix(".weight")] = w
        b = model.device_bytes()
        rows.append({"storage": label, "weight bytes on the device": b["device_bytes"],
                     "vs fp32": b["device_bytes"] / b["fp32_bytes"],
                     "preservation loss": _pres(model, passages, tok, cfg)})
        del model
        gc.collect()
    ref = rows[0]["preservation loss"]
    for row in rows:
        row["change vs fp32"] = row["preservation loss"] - ref
    for row, f in ((rows[2], "int4"), (rows[3], "nf4"), (rows[4], "int4")):
        e = errs[f]
        row["rel. Frobenius error min/mean/max"] = f"{min(e):.4f} / {np.mean(e):.4f} / {max(e):.4f}"
    other = (rows[0]["weight bytes on the device"]
             - 4 * sum(int(np.prod(ck[n].shape)) for n in names))
    packed = {f: sum(sum(quant.array_nbytes(f, *ck[n].shape)) for n in names)
              for f in ("int4", "nf4")}
    n_w = sum(int(np.prod(ck[n].shape)) for n in names)
    ex = [Expectation("the int4 and NF4 allocations are exactly their formats' size (4-bit codes + "
                      "scales) plus the fp32 norms",
                      f"int4 {rows[2]['weight bytes on the device']:,} = "
                      f"{packed['int4'] + other:,}; NF4 {rows[3]['weight bytes on the device']:,} "
                      f"= {packed['nf4'] + other:,} ({8 * packed['int4'] / n_w:.2f} / "
                      f"{8 * packed['nf4'] / n_w:.2f} bits per quantized weight)",
                      rows[2]["weight bytes on the device"] == packed["int4"] + other
                      and rows[3]["weight bytes on the device"] == packed["nf4"] + other),
          Expectation("4-bit values inside fp32 tensors save nothing (the control's bytes "
                      "= fp32's)",
                      f"{rows[4]['weight bytes on the device']:,} vs "
                      f"{rows[0]['weight bytes on the device']:,} bytes",
                      rows[4]["weight bytes on "
                              "the device"] == rows[0]["weight bytes on the device"]),
          Expectation("the packed int4 kernel computes what the fp32-held rounded weights compute "
                      "(preservation loss within 1e-3)",
                      f"{rows[2]['preservation loss']:.5f} vs {rows[4]['preservation loss']:.5f}",
                      abs(rows[2]["preservation loss"] - rows[4]["preservation loss"]) <= 1e-3)]
    notes = [f"{len(names)} matrices quantized, the embedding (tied LM head) included; norms "
             f"stay fp32"]
    if ctx.params["train"]:
        r = train_run(ctx, "adapter-on-int4", quant="int4", steps=ctx.params["steps"],
                      objective="sft")
        f = r.final
        rows.append({"storage": "int4 packed + adapter (SFT)", "weight bytes on the device": None,
                     "preservation loss": f.preservation_loss,
                     "change vs fp32": f.preservation_loss - ref})
        ex.append(Expectation("an fp32 adapter trains on the int4 base: the training loss falls",
                              f"{r.first_loss:.3f} -> {f.train_loss:.3f}",
                              f.train_loss < r.first_loss))
        if f.heldout_acc is not None:
            notes.append(f"adapter on the int4 base: held-out accuracy {f.heldout_acc:.3f} "
                         f"Wilson 95% [{f.heldout_acc_ci[0]:.3f}, {f.heldout_acc_ci[1]:.3f}] (the "
                         f"int4 base alone {f.heldout_acc_base:.3f}); preservation "
                         f"{f.preservation_delta:+.4f} vs the int4 base itself")
    return Result(f"int4-storage: {ctx.model or 'the default model'} stored five ways",
                  ["storage", "weight bytes on the device", "vs fp32",
                   "rel. Frobenius error min/mean/max", "preservation loss", "change vs fp32"],
                  rows, ex, notes=notes)
