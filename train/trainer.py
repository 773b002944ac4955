"""The training run: load, inject, preflight, train, evidence, gates, checkpoints, resume."""
from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path

import numpy as np

from vkdsl.models import identity, load_model_files
from vkdsl.models.build import build_model
from vkdsl.ops.losses import check_labels
from vkdsl.precision import current as matmul_precision_now
from vkdsl.realize import deferred_uploads

from . import checkpoint, dpo, evidence, loop, memplan
from .data import IGNORE, DataError, check_batches, collate, load_run_rows, sampler
from .distributed import Single
from .evidence import Evidence
from .heldout import Heldout
from .loop import TrainingStopped  # noqa: F401  (re-exported: the CLI's user error)
from .inject import count_report, inject, params_of
from .packing import efficiency_line
from .prefix import FrozenPrefix, first_adapted_layer
from .progress import Records, Reporter, evidence_table
from .schedule import checkpoints as lr_points, sft_lr
from .scoring import Scorer
from .step import Stepper


class Run:
    def __init__(self, cfg, run_dir, reporter: Reporter, reuse: "Run | None" = None, files=None,
                 group=None):
        """reuse: an earlier Run of this process on the same base (same file and quant): its loaded
        model (adapters replaced), frozen-prefix rows and cached base logits are taken over, since
        they depend only on the base and the rows (a probe's seeds and arms). files: the
        (checkpoint, tokenizer) of cfg.model already read (load_model_files), else read here.
        group: train.distributed's process group (None: one process); a step's global batch is
        batch_size x grad_accum x P rows, the same rows one process would take with that batch."""
        self.group = group or Single()
        self.devices = None  # under MPI: every rank's device, one line each (the manifest's)
        self.cfg, self.dir, self.r = cfg, Path(run_dir), reporter
        self.records = Records(self.dir)
        from vkdsl.models.default import default_model_path
        self.model_path = path = cfg.model or default_model_path()
        t0 = time.perf_counter()
        if reuse is not None and (reuse.model_path, reuse.cfg.quant) != (path, cfg.quant):
            reuse = None
        self.pending = []
        if reuse is not None:
            self.ckpt, self.tok, self.model = reuse.ckpt, reuse.tok, reuse.model
            self.model.lora = {}
        else:
            self.ckpt, self.tok = files if files is not None else load_model_files(path)
            # the weights stay on the host until the memory plan has passed (upload_weights)
            with deferred_uploads() as self.pending:
                self.model = build_model(self.ckpt, quant=cfg.quant)
        # what a resume and the caches must find unchanged: the base, tokenizer, settings and rows
        data = {"train_file": cfg.train_file,
                "dpo_train_file": cfg.dpo_train_file if "dpo" in cfg.objective else ""}
        self.identity = identity.of_run(path, self.tok, cfg.quant, cfg.precision, data)
        if cfg.max_len > self.model.cfg.context_length:
            raise ValueError(f"max_len {cfg.max_len} is beyond the model's context of "
                             f"{self.model.cfg.context_length} tokens ({path})")
        self.names = inject(self.model, cfg)
        self.params = params_of(self.model, self.names)
        self.r.say(f"model {path} loaded in {time.perf_counter() - t0:.1f}s")
        self.r.say(count_report(self.model, self.names)[2])
        self.pad = self.tok.pad_id if self.tok.pad_id is not None else self.tok.eos_id
        self.train, self.heldout, self.passages, self.rehearsal = load_run_rows(cfg, self.tok,
                                                                                self.r.say)
        self.pairs = dpo.stage_pairs(cfg, self.tok) if "dpo" in cfg.objective else None
        # window mode (long data): no frozen-prefix cache, whose rows are kept in the padded layout
        start = 0 if cfg.window else first_adapted_layer(self.names)
        if (reuse is not None and reuse.prefix.start == start
            and cfg.prefix_cache_bytes == reuse.cfg.prefix_cache_bytes):
            self.prefix = reuse.prefix
        else:
            self.prefix = FrozenPrefix(self.model, start, cfg.prefix_cache_bytes)
        if self.prefix.start:
            self.r.say(f"layers 0-{self.prefix.start - 1} carry no adapter: their output is "
                       f"computed once per row and reused (prefix cache, up to "
                       f"{cfg.prefix_cache_bytes / 2**20:.0f} MiB)")
        cache = (reuse.stepper.base_cache if reuse is not None and reuse.prefix is self.prefix
                 else None)
        self.stepper = Stepper(self.model, self.params, cfg, self.prefix, base_cache=cache)
        self.rows_per_step = cfg.batch_size * cfg.grad_accum * self.group.size
        self.sampler = sampler(self.train, self.rows_per_step, self.cfg)
        if cfg.window:
            self.stepper.head_rows = memplan.head_rows(self.train, cfg)
            self.r.say(f"packing: {len(self.train)} rows first-fit into windows of "
                       f"{cfg.window} tokens, {100 * self.sampler.utilization():.1f}% of their "
                       f"positions real tokens")
        self.scorer = Scorer(self.model, self.pad, cfg.bucket, cfg.max_len, cfg.eval_batch,
                             self.prefix, self.group, keep=1 if cfg.window else 0)
        self.held = Heldout(cfg, self.model, self.ckpt, self.tok, self.pad, self.scorer,
                            self.heldout, self.passages)
        self.init_sum = evidence.checksum([p.numpy() for p in self.params])
        self.step, self.first_loss, self.last_loss = 0, None, None
        self.decisions_seen = []  # (step, held-out label decisions) of each evaluation, base first
        # over the steps this process ran; micro-batches, and those packed (train.packing)
        self.tokens = {"computed": 0, "real": 0, "supervised": 0, "micro": 0, "packed": 0}

    # ---- preflight ----
    def preflight(self):
        cfg = self.cfg
        for label, s, lr in lr_points(cfg):
            self.r.say(f"preflight: lr at {label} (step {s}) = {lr:.3e}")
            if not lr > 0:
                raise ValueError(f"preflight: the schedule applies lr {lr} at {label} (step {s}); "
                                 f"training would not move (check lr, min_lr_ratio, warmup)")
        check_batches(self.train)
        for r in self.train:
            check_labels(np.array(r.labels), self.model.cfg.vocab_size, what=r.where)
        if not self.params:
            raise ValueError("preflight: no trainable parameters")
        self.r.say(f"preflight: all {len(self.train)} training rows have supervised tokens; OK")

    def after_first_step(self, raw):
        dead = [n for k, n in enumerate(self.names) if not np.any(raw[2 * k + 1])]
        if dead:
            raise ValueError(f"preflight: after step 1 the B gradient is zero for "
                             f"{', '.join(dead[:6])}: these adapters do not reach the loss")
        zero_a = sum(not np.any(raw[2 * k]) for k in range(len(self.names)))
        self.r.say(f"preflight: step 1 gradients reach every adapter's B ({len(self.names)} "
                   f"modules). dA = 0 in {zero_a}/{len(self.names)} modules, as expected: dA = x^T "
                   f"(dY B^T) s contains B, which starts at 0; A moves from step 2 on")

    # ---- batches ----
    def micro_batches(self, idx):
        """idx: the step's rows (or windows: lists of rows) -> batch_size rows (windows) per
        micro-batch."""
        bs = self.cfg.batch_size
        out = []
        for s in range(0, len(idx), bs):
            rows = [self.train[i] for w in idx[s:s + bs] for i in (w if self.cfg.window else [w])]
            ids, lab = collate(rows, self.pad, self.cfg.bucket, self.cfg.max_len)
            if not (lab != IGNORE).any():
                raise DataError(f"batch at step {self.step + 1} has no supervised token: rows "
                                f"{', '.join(r.where for r in rows)}")
            lengths = np.array([min(len(r.ids), ids.shape[1]) for r in rows])
            out.append((ids, lab, lengths))
            self.tokens["real"] += int(lengths.sum())
            self.tokens["supervised"] += int((lab != IGNORE).sum())
        return out

    def rehearsal_batch(self, step):
        """The general-text micro-batch of an optimizer step: passages in file order, cycling (a
        function of the step alone, so a resumed run sees the same ones)."""
        if not self.rehearsal or self.cfg.rehearsal_weight <= 0:
            return None
        n, b = len(self.rehearsal), self.cfg.rehearsal_batch
        rows = [self.rehearsal[(step * b + j) % n] for j in range(b)]
        ids, lab = collate(rows, self.pad, self.cfg.bucket, self.cfg.max_len)
        return ([(ids, lab, np.array([min(len(r.ids), ids.shape[1]) for r in rows]))],
                self.cfg.rehearsal_weight)

    # ---- evidence ----
    def base_evidence(self):
        t0 = time.perf_counter()
        if self.held.extra is not None:
            self.r.say("labels are single tokens after the prompt: each held-out row is "
                       "scored once, comparing the label tokens' log-probs at the answer position")
        key, cache = self._base_key(), self.dir / checkpoint.BASE_EVAL
        # only rank 0 writes (and reads) the run folder: every rank must take the same branch
        self.base = self.group.from_root(checkpoint.cached_base, cache, key)
        if self.base is not None:
            self.r.say(f"base evaluation reused from {cache.name} (same base, tokenizer, data and "
                       f"settings)")
        else:
            sc = self.held.scores(adapters_on=False)
            losses = {"held-out loss": sc.heldout_loss, "preservation loss": sc.pres}
            bad = [k for k, v in losses.items() if not math.isfinite(v)]
            if bad:
                raise ValueError(f"{self.cfg.model or 'the default model'}: the base model's "
                                 f"{' and '.join(bad)} is not finite before any training: its "
                                 f"weights hold NaN or Inf (a damaged file?)")
            self.base = Evidence.of(sc, self.held.surfaces(sc, adapters_on=False), step="base",
                                    preservation_delta=0.0)
            checkpoint.atomic_write(cache, json.dumps({"key": key,
                                                       "base": self.base.json()}).encode())
        b = self.base
        self.decisions_seen = [("base", b.decisions)]
        self.r.say(f"base evaluation in {time.perf_counter() - t0:.1f}s: held-out loss "
                   f"{b.heldout_loss:.4f}"
                   + (f", label accuracy {b.heldout_acc:.3f}" if b.heldout_acc is not None else "")
                   + f", preservation loss {b.preservation_loss:.4f}"
                   + (f", calibration ECE {b.calibration['ece']:.3f}" if b.calibration else "")
                   + (f", format {b.format_valid:.3f}" if b.format_valid is not None else ""))
        for f in b.format_failures:
            self.r.say(f"  base format failure {f['row']}: expected {f['expected']!r}, generated "
                       f"{f['generated']!r}")

    def _base_key(self) -> str:
        """What the base model's evaluation depends on: base, tokenizer, data files and the settings
        that shape the scored rows."""
        c = self.cfg
        scored = {"heldout": c.heldout_file, "preservation": c.preservation_file}
        shas = {k: identity.file_sha256(f) if f else "" for k, f in scored.items()}
        return identity.digest({**self.identity, "layout": "Evidence", **shas,
                                "settings": [c.labels, c.label_eval, c.chat_template, c.max_len,
                                             c.truncation_side, c.bucket, c.eval_batch,
                                             c.format_tokens, c.format_examples]})

    def evaluate(self, final=False):
        """The evidence at this step; final: also the fp32-dequantized base's decisions
        (stability)."""
        t0 = time.perf_counter()
        sc = self.held.scores(adapters_on=True)
        b = self.base
        ev = Evidence.of(sc, self.held.surfaces(sc, adapters_on=True), step=self.step,
                         train_loss=self.last_loss, heldout_loss_base=b.heldout_loss,
                         heldout_acc_base=b.heldout_acc, preservation_loss_base=b.preservation_loss,
                         preservation_delta=sc.pres - b.preservation_loss,
                         category_loss=evidence.per_category(self.heldout, sc.held),
                         checksum=evidence.checksum([p.numpy() for p in self.params]))
        if self.decisions_seen:  # stability over training: the last evaluation's decisions
            step, before = self.decisions_seen[-1]
            ev.stability_checkpoint = {"step": step,
                                       "agreement": evidence.agreement(ev.decisions, before)}
        self.decisions_seen.append((self.step, ev.decisions))
        if final and self.cfg.stability_rows:
            fp = self.held.fp32_decisions(self.cfg.stability_rows)
            if fp is not None:
                ev.stability_fp32 = {"rows": len(fp),
                                     "agreement": evidence.agreement(ev.decisions[:len(fp)], fp)}
        ev.checksum_changed = ev.checksum != self.init_sum
        ev.spectrum = evidence.spectrum(self.model, self.names, top=self.cfg.rank)
        self._merge_check(ev)
        ev.eval_seconds = time.perf_counter() - t0
        self.r.say(evidence_table(ev))
        self.r.event("eval", **ev.json())
        self.records.append("eval", **ev.json())
        return ev

    def _merge_check(self, ev):
        """On the first few held-out rows (unpadded lengths cut to the shortest), for the first
        adapted module."""
        n = self.cfg.merge_check_rows
        rows = (self.heldout or self.train)[:n]
        if n and rows:
            T = min(len(r.ids) for r in rows)
            ids = np.array([r.ids[:T] for r in rows], np.int32)
            ev.merge_module = self.names[0]
            ev.merge_max_diff, ev.merge_argmax = evidence.merged_check(
                self.model, self.ckpt, ev.merge_module, ids, self.prefix)

    # ---- the loop ----
    def restore(self, run_dir):
        meta, params, opt = checkpoint.load(run_dir)
        path = Path(run_dir) / checkpoint.NAME
        checkpoint.check_identity(meta, self.identity)
        if meta["modules"] != self.names:
            raise checkpoint.CheckpointError(f"{path}: adapted modules {meta['modules']} differ "
                                             f"from the config's {self.names}")
        for p, a in zip(self.params, params):
            if p.shape != a.shape:
                raise checkpoint.CheckpointError(f"{path}: an adapter tensor of shape {a.shape}, "
                                                 f"the model's is {p.shape}")
        checkpoint.check_order(path, meta, sampler(self.train, self.rows_per_step, self.cfg),
                               f"data_seed {self.cfg.data_seed}, {self.rows_per_step} "
                               f"{'windows' if self.cfg.window else 'rows'} per step "
                               f"(batch_size x grad_accum x processes) over this training file")
        import vkdsl
        for p, a in zip(self.params, params):
            p.assign(vkdsl.tensor(a))
        self.stepper.opt.load(opt)
        self.sampler.set_state(meta["sampler"])
        self.step, self.first_loss = meta["step"], meta.get("first_loss")
        self.last_loss = meta.get("last_loss")
        self.init_sum = meta.get("init_checksum", self.init_sum)
        self.r.say(f"resumed from {path} at step {self.step}")

    def save(self):
        ps = [p.numpy() for p in self.params]
        checkpoint.save(self.dir, self.step, self.names, ps, self.stepper.opt.state(),
                        self.sampler.state(),
                        {**self.identity, "first_loss": self.first_loss,
                         "last_loss": self.last_loss, "init_checksum": self.init_sum})

    def train_loop(self, stop_after=None, at_step=None):
        """The SFT stage through the one loop (train.loop). at_step(run) is called after each
        optimizer step (a probe's checkpoints)."""
        cfg = self.cfg

        def evaluate(step, rec):
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                self.evaluate()
        hooks = [evaluate] + ([lambda step, rec: at_step(self)] if at_step is not None else [])
        _, finished = loop.train(SftObjective(self), self.params, self.stepper.opt, self.group,
                                 self.step, lambda step: self.save(), cfg.checkpoint_every, hooks,
                                 stop_after, self._ckpt_step)
        return finished

    def _ckpt_step(self):
        return checkpoint.saved_step(self.dir) or "none"


class SftObjective:
    """SFT (CE + TMKL + rehearsal, packing) as the loop's objective, over a Run's rows."""
    stage, finite = "sft", ("loss", "tmkl")

    def __init__(self, run):
        self.r, self.steps, self.order, self.clip = run, run.cfg.steps, run.sampler, run.cfg.clip

    def lr(self, step):
        return sft_lr(step, self.r.cfg)

    def gradient(self, idx, step):
        r = self.r
        r.step = step - 1  # micro_batches and rehearsal_batch name the step being built
        return r.stepper.gradient(r.micro_batches(idx), r.rehearsal_batch(step - 1), group=r.group)

    def record(self, step, rec):
        r = self.r
        r.step = step
        for k in ("computed", "micro", "packed"):
            r.tokens[k] += rec[k]
        rec["seq_tokens"] = rec["computed"]
        if step == 1 and r.first_loss is None:
            r.first_loss = rec["loss"]
        if step == 1:
            r.after_first_step(rec["raw_grads"])
        r.last_loss = rec["loss"]
        r.r.progress(step, self.steps, rec)
        r.records.append("step", step=step, **{k: v for k, v in rec.items() if k != "raw_grads"})


def run(cfg, run_dir, resume=None, stop_after=None, evidence_at_end=True, at_step=None, reuse=None,
        final=True, files=None, group=None, plan_only=False, before_training=None):
    """Returns the Run (its final evidence in .final, gates in .gates). at_step: see Run.train_loop.
    final=False: the base evidence but no final evaluation or gates (a probe measuring at its own
    steps). reuse, files, group: see Run. plan_only: stop after the device-memory plan
    (train.memplan). before_training(reporter): after the base evaluation, before any step (the
    verify pass's verdict). Runs under vkdsl.matmul_precision(cfg.precision) like vkdsl-train."""
    if cfg.precision != matmul_precision_now():
        raise ValueError(f"precision {cfg.precision} asked for, but matmuls trace at "
                         f"{matmul_precision_now()}: call run() under "
                         f"vkdsl.matmul_precision({cfg.precision!r})")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rep = Reporter(run_dir / "train.log", cfg.quiet, cfg.jsonl)
    for stale in checkpoint.remove_stale_temps(run_dir):
        rep.say(f"removed {stale.name}, left by an interrupted write")
    rep.say("configuration:\n" + cfg.pretty())
    if not resume:
        checkpoint.atomic_write(run_dir / "config.json", cfg.dumps().encode())
    r = Run(cfg, run_dir, rep, reuse, files, group)
    r.plan = memplan.check(r, rep.say)
    if plan_only:
        return r
    memplan.upload_weights(r)
    r.preflight()
    r.dpo_saved = None  # (meta, params, optimizer) of the DPO stage's checkpoint to resume
    if (resume and not any((Path(resume) / n).exists()
                           for n in (checkpoint.NAME, checkpoint.LEGACY))):
        rep.say(f"no checkpoint in {resume} yet: starting from step 0 with its config")
    elif resume:
        r.restore(resume)
    if resume and "dpo" in cfg.objective and (Path(resume) / checkpoint.DPO).is_file():
        r.dpo_saved = checkpoint.load(resume, checkpoint.DPO)
        checkpoint.check_identity(r.dpo_saved[0], r.identity)
    if resume:                          # the records of steps after the resumed ones run again
        at = cfg.steps + r.dpo_saved[0]["step"] if r.dpo_saved else r.step
        r.records.mark_resume(at)
    if evidence_at_end:
        r.base_evidence()
    if before_training:
        before_training(rep)
    t0 = time.perf_counter()
    finished = True if cfg.objective == "dpo" else r.train_loop(stop_after, at_step)
    r.train_seconds = time.perf_counter() - t0
    r.stepper.release()             # its buffers are not needed again (train.memplan)
    if r.tokens["computed"]:
        rep.say(efficiency_line(r.tokens, cfg.pack))
        rep.say(memplan.peak_line(r.plan))
    if finished and cfg.checkpoint_every and r.step % cfg.checkpoint_every:
        r.save()
    r.final, r.gates = None, []
    if finished:
        buf = io.BytesIO()
        np.savez(buf, **{f"{n}.lora_A": r.model.lora[n].A.numpy() for n in r.names},
                 **{f"{n}.lora_B": r.model.lora[n].B.numpy() for n in r.names})
        checkpoint.atomic_write(run_dir / "adapter.npz", buf.getvalue())
        # DPO alone: its stage has evidence and gates
        if evidence_at_end and final and cfg.objective != "dpo":
            kept = r.dpo_saved[0].get("sft_final") if r.dpo_saved else None
            # resumed inside DPO: the SFT stage's evaluation was taken before it
            if kept is not None:
                r.final = Evidence.from_json(kept)
                rep.say(f"SFT evidence at step {r.step} as the DPO checkpoint recorded it")
            else:
                r.final = r.evaluate(final=True)
            r.gates = evidence.gates(r.final, r.first_loss, cfg)
            rep.outcome("gates:")
            evidence.publish_gates(rep, run_dir, r.gates, r.gates)
    return r
