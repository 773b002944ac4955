"""After the SFT loop: the DPO stage (when the objective asks for it), the adapter export
(PEFT folder, GGUF LoRA, provenance manifest) and report.html."""
from __future__ import annotations

import json
import time

import vkdsl
from vkdsl.models.identity import file_sha256

from . import checkpoint, dpo, evidence, loop, memplan
from .report import build_report


def _dpo_loop(r, obj, opt, stop_after=None):
    """The DPO stage through the one loop, with its own checkpoint (checkpoint.DPO): it records the
    adapter DPO started from and the SFT stage's evidence, so a resume inside DPO continues from
    its last saved step on the same start, bit for bit."""
    cfg, path = r.cfg, r.dir / checkpoint.DPO
    start_sum = evidence.checksum([p.numpy() for p in r.params])
    step = 0
    if getattr(r, "dpo_saved", None) is not None:
        meta, params, state = r.dpo_saved
        if meta.get("start_adapter") != start_sum or meta["modules"] != r.names:
            raise checkpoint.CheckpointError(f"{path}: DPO was checkpointed from another adapter "
                                             f"than the one this run reaches before DPO (adapter "
                                             f"{meta.get('start_adapter')} vs {start_sum}, or "
                                             f"other modules): refusing to resume inside DPO")
        checkpoint.check_order(path, meta,
                               dpo.PairOrder(len(obj.order.ex), obj.order.n, cfg.data_seed),
                               f"data_seed {cfg.data_seed}, {obj.order.n} pairs per step")
        for p, a in zip(r.params, params):
            p.assign(vkdsl.tensor(a))
        opt.load(state)
        obj.order.set_state(meta["sampler"])
        step = meta["step"]
        r.r.say(f"resumed DPO from {path} at DPO step {step}")
    identity = {**r.identity, "start_adapter": start_sum,
                "sft_final": r.final.json() if r.final else None, "first_loss": r.first_loss}

    def save(at):
        checkpoint.save(r.dir, at, r.names, [p.numpy() for p in r.params], opt.state(),
                        obj.order.state(), identity, name=checkpoint.DPO)
    def saved_step():
        return checkpoint.saved_step(r.dir, checkpoint.DPO) or "none"
    step, finished = loop.train(obj, r.params, opt, r.group, step, save, cfg.checkpoint_every, (),
                                stop_after, saved_step)
    if not finished:
        raise loop.Interrupted(f"DPO stopped after step {step} (stop_after)")
    if not cfg.checkpoint_every or step % cfg.checkpoint_every:
        save(step)


def dpo_stage(r, stop_after=None):
    """Train the same adapters with DPO; record evidence; returns its DpoEvidence. stop_after:
    end the stage after that DPO step with loop.Interrupted (a simulated kill)."""
    cfg, rep = r.cfg, r.r
    pairs, held, same = r.pairs
    if same:
        rep.say(f"warning: {same} preference pair(s) have identical chosen and rejected "
                f"responses; skipped")
    reference = (cfg.reference if cfg.reference != "auto"
                 else ("sft" if cfg.objective == "sft+dpo" else "base"))
    said = {"sft": "the SFT adapter, frozen", "base": "the base (adapter off)",
            "none": "none (control)"}[reference]
    rep.say(f"DPO: {len(pairs)} training pairs, {len(held)} held-out pairs, beta {cfg.dpo_beta}, "
            f"reference = {said}")
    base = getattr(r, "base", None)

    def event(kind, **rec):
        rep.event(kind, **rec)
        r.records.append(kind, **{**rec, "step": cfg.steps + rec.get("step", 0)})
    t0 = time.perf_counter()
    history, ev = dpo.train_dpo(r.model, r.params, cfg, r.pad, pairs, held, r.dir, rep.say, event,
                                reference, r.identity, r.prefix, r.group,
                                lambda obj, opt: _dpo_loop(r, obj, opt, stop_after), r.scorer)
    r.dpo_history = history
    after = r.held.scores(adapters_on=True)  # every surface again, after DPO (one scoring pass)
    surf = r.held.surfaces(after, adapters_on=True)
    ev.after = evidence.Evidence.of(after, surf, decision_agreement_with_sft=evidence.agreement(
        surf.decisions, r.final.decisions if r.final else []))
    ev.sft_acc = r.final.heldout_acc if r.final else None
    if base is not None and r.passages:
        ev.preservation_delta = after.pres - base.preservation_loss
    if getattr(r, "plan", None):
        rep.say(memplan.peak_line(r.plan))
    rep.say(f"DPO evidence ({time.perf_counter() - t0:.0f}s):")
    for split in ("train", "heldout"):
        e = getattr(ev, split)
        if e:
            rep.say(f"  {split}: pair accuracy {e.pair_accuracy:.3f} | improvement accuracy "
                    f"{e.improvement_accuracy:.3f} | mean margin improvement "
                    f"{e.margin_improvement:+.3f} nats | chosen drift {e.chosen_drift:+.3f} | "
                    f"rejected drift {e.rejected_drift:+.3f}")
    if ev.preservation_delta is not None:
        rep.say(f"  preservation change vs base: {ev.preservation_delta:+.4f} nats/token")
    rep.say("  " + dpo.margin_story(ev.heldout or ev.train))
    a = ev.after
    if a.heldout_acc is not None:
        rep.say(f"  after DPO: held-out label accuracy {a.heldout_acc:.3f} Wilson 95% "
                f"[{a.heldout_acc_ci[0]:.3f}, {a.heldout_acc_ci[1]:.3f}], ECE "
                f"{a.calibration['ece']:.3f}, format {a.format_valid or 0:.3f}, worst slice "
                f"{a.slices['worst']}"
                + (f", decisions equal to after SFT on {a.decision_agreement_with_sft:.3f}"
                   if a.decision_agreement_with_sft is not None else ""))
    r.records.append("dpo_evidence", step=cfg.steps + cfg.dpo_steps,
                     **{f"dpo_{k}": v for k, v in ev.json().items() if v is not None})
    more = evidence.dpo_gates(ev, cfg, base.heldout_acc if base is not None else None)
    r.gates = list(r.gates) + more
    evidence.publish_gates(rep, r.dir, r.gates, more)
    return ev


def export(r, dpo_ev=None):
    """PEFT folder + GGUF adapter + manifest in the run folder, then report.html."""
    from vkdsl.models.adapters import save_adapter_bundle
    from vkdsl.runtime import default_device
    cfg = r.cfg
    dev = default_device().info
    summary = {"objective": cfg.objective, "sft_steps": r.step,
               "dpo_steps": cfg.dpo_steps if "dpo" in cfg.objective else 0,
               "final": r.final.json() if r.final else None,
               "gates": [g.record() for g in r.gates], "dpo": dpo_ev.json() if dpo_ev else None}
    extra = {"data": {k: {"file": getattr(cfg, k), "sha256": file_sha256(getattr(cfg, k))}
                      for k in ("train_file", "heldout_file", "preservation_file", "dpo_train_file",
                                "dpo_heldout_file")
                      if getattr(cfg, k)},
             "rows": {"train": len(r.train), "heldout": len(r.heldout),
                      "preservation": len(r.passages)},
             "seeds": {"adapter": cfg.seed, "data": cfg.data_seed}, "objective": cfg.objective,
             "hyper_parameters": {k: getattr(cfg, k)
                                  for k in ("lr", "steps", "tmkl", "dpo_beta", "dpo_lr",
                                            "dpo_steps",
                                            "dpo_nll_weight", "reference",
                                            "batch_size",
                                            "grad_accum", "clip",
                                            "weight_decay")},
             "max_len": cfg.max_len, "truncation_side": cfg.truncation_side,
             "masking": "loss on assistant/completion tokens incl. end-of-turn; prompt and "
                        "padding = -100",
             "device": f"{dev.name} ({dev.driver} {dev.driver_info})",
             "profile": dev.profile or None, "vkdsl": vkdsl.__version__,
             "processes": {"ranks": r.group.size, "devices": r.devices
                           or [f"rank 0: [{dev.index}] {dev.name} ({dev.driver} "
                               f"{dev.driver_info})"]},
             "final_metrics": summary["final"], "gates": summary["gates"]}
    save_adapter_bundle(r.model, r.dir, model_path=r.model_path, tokenizer=r.tok, r=cfg.rank,
                        alpha=cfg.alpha, rslora=cfg.rslora,
                        base_name=str(r.model_path).rsplit("/", 1)[-1], extra=extra)
    checkpoint.atomic_write(r.dir / "summary.json",
                            json.dumps(summary, indent=1, default=str).encode())
    r.r.say(f"adapter: {r.dir / 'adapter'} (PEFT) and {r.dir / 'adapter.gguf'} (llama.cpp --lora), "
            f"with manifest")
    r.r.say(f"report: {build_report(r.dir)}")
