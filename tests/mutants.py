"""The mutation check: plant, one at a time, the defects a reviewer fears most into a temporary
copy of the tree, run the tests that cover each, and require that at least one of them fails.

    python tests/mutants.py            # every mutant; a table; exit 1 if any survives
    python tests/mutants.py --list     # the mutants and their tests
    python tests/mutants.py rslora_scale_over_r int4_scale_over_8     # some of them

The copy is imported instead of the installed tree: a staging folder on PYTHONPATH lays it out
as the installed packages (vkdsl with ops/, models/, train/, cli/ inside; golden as vkdsl_golden),
and its sitecustomize drops the editable install's finder. Slow (minutes): not part of the suite, whose
tests/test_mutants.py runs one cheap mutant through the same machinery."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INSIDE_VKDSL = ("ops", "models", "train", "cli")


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str            # file, relative to the repository
    old: str             # text that must occur exactly once
    new: str
    tests: tuple         # pytest arguments that must catch it
    why: str


MUTANTS = [
    Mutant("nf4_codebook_entry", "ops/quant/formats.py", "0.7229568362236023", "0.7329568362236023",
           ("tests/test_quant_kernels.py", "-k", "nf4"), "one NF4 code's value off by 0.01"),
    Mutant("int4_scale_over_8", "ops/quant/formats.py", "INV7 = np.float32(1) / np.float32(7)",
           "INV7 = np.float32(1) / np.float32(8)", ("tests/test_ops_quant.py", "tests/test_quant_kernels.py"),
           "int4 scale absmax/8 instead of absmax/7"),
    Mutant("tmkl_keeps_target", "ops/losses.py",
           "    za = hot.where(-math.inf, adapted_logits)\n    zb = hot.where(-math.inf, base_logits)",
           "    za = adapted_logits\n    zb = base_logits",
           ("tests/test_verify_cases.py", "-k", "tmkl"), "TMKL's target left in the renormalized distribution"),
    Mutant("rslora_scale_over_r", "ops/lora.py", "return alpha / math.sqrt(r) if rslora else alpha / r",
           "return alpha / r if rslora else alpha / r", ("tests/test_ops.py", "-k", "lora_scale"),
           "rsLoRA scaled by alpha/r instead of alpha/sqrt(r)"),
    Mutant("peft_skips_qk_permutation", "models/adapters/peft.py",
           '        Bt = common.file_rows(cfg, m, Bt, "hf", to_file=True)', "        Bt = Bt",
           ("tests/test_adapters.py", "-k", "peft"), "PEFT export leaves q/k rows in GGUF's RoPE order"),
    Mutant("qwen_q_bias_unpermuted", "models/safetensors_loader.py", '("attn_q.bias", cfg.n_heads),', "",
           ("tests/test_families.py", "-k", "forward"), "Qwen2's q bias left in half-split order beside its rows"),
    Mutant("qwen_gguf_lora_pair_rows", "models/adapters/gguf_lora.py",
           'Bt = common.file_rows(model.cfg, name, Bs.T, "gguf", to_file=True)', "Bt = Bs.T",
           ("tests/test_families.py", "-k", "gguf_adapter"),
           "a Qwen GGUF adapter written in vkdsl's pair order, not the base file's"),
    Mutant("fp16_tiles_not_rounded", "vkdsl/kernels/matmul_gpu.glsl", "#define TILE float16_t", "#define TILE float",
           ("tests/test_precision.py", "-k", "rounded_inputs or gradients"),
           "precision fp16 staging fp32 values: a kernel that claims fp16 inputs but keeps fp32"),
    Mutant("fp16_backward_in_fp32", "vkdsl/autograd.py", "with matmul_precision(out.arg.precision):",
           'with matmul_precision("fp32"):', ("tests/test_precision.py", "-k", "gradients"),
           "a matmul's gradients not at its forward's precision"),
    Mutant("half_cast_not_rounded", "vkdsl/render.py", 'TO_HALF = "vk_half({0})"',
           'TO_HALF = "{0}"', ("tests/test_half.py", "-k", "fused"),
           "a cast to fp16 fused into a chain that skips the rounding"),
    Mutant("ignore_index_counted", "ops/losses.py",
           "    lp = picked - logsumexp(logits, -1)\n    mask = 1.0 - labels.eq(IGNORE)",
           "    lp = picked - logsumexp(logits, -1)\n    mask = 1.0 - labels.eq(IGNORE) * 0.0",
           ("tests/test_verify_cases.py", "-k", "cross_entropy"), "labels -100 supervised like any other"),
    Mutant("rope_half_split", "ops/nn.py",
           "    xp = x.reshape(*lead, T, H, D // 2, 2)\n    x0, x1 = xp[..., 0], xp[..., 1]",
           "    xp = x.reshape(*lead, T, H, 2, D // 2)\n    x0, x1 = xp[..., 0, :], xp[..., 1, :]",
           ("tests/test_verify_cases.py", "-k", "rope"), "RoPE pairs (i, i + D/2) instead of GGUF's (2i, 2i + 1)"),
    Mutant("adamw_no_bias_correction", "train/step.py",
           "        c1 = np.float32(1.0 / (1.0 - self.b1 ** self.t))\n        c2 = np.float32(1.0 / (1.0 - self.b2 ** self.t))",
           "        c1 = np.float32(1.0)\n        c2 = np.float32(1.0)",
           ("tests/test_train_objective.py", "-k", "plain_sft"), "AdamW without bias correction"),
    Mutant("causal_mask_hides_diagonal", "ops/nn.py", "return (q < k).where(-math.inf, 0.0)",
           "return (q <= k).where(-math.inf, 0.0)", ("tests/test_verify_cases.py", "-k", "attention"),
           "a query cannot see its own key"),
    Mutant("reduction_tree_half", "vkdsl/render.py", 'f"  for (uint s = {group // 2}u; s > 0u; s >>= 1) {{\\n"',
           'f"  for (uint s = {group // 4}u; s > 0u; s >>= 1) {{\\n"', ("tests/test_verify_cases.py", "-k", "sum["),
           "workgroup reduction tree drops half of the partial sums"),
    Mutant("texel_vec4_read_one_late", "vkdsl/render.py", '"rgba32f": ("samplerBuffer", "texelFetch(tx{k}, int(i))")',
           '"rgba32f": ("samplerBuffer", "texelFetch(tx{k}, int(i) + 1)")',
           ("tests/test_dsl.py", "-k", "cpu_driver"), "a generated kernel's vec4 texel read one texel late"),
    Mutant("serial_tree_half", "vkdsl/render.py", 'f"    for (uint l = 0u; l < s; l++) part[l] = "',
           'f"    for (uint l = 0u; l < s / 2u; l++) part[l] = "', ("tests/test_dsl.py", "-k", "cpu_driver"),
           "the per-invocation reduction tree drops partial sums"),
    Mutant("serial_tree_past_the_loop_limit", "vkdsl/render.py", " and R <= SERIAL_MAX_R", "",
           ("tests/test_big_vocab.py",), "a 150k-long row summed in one invocation: llvmpipe stops its loop at 65,535"),
    Mutant("shipped_tuning_beats_local", "vkdsl/tuning.py", "e = local_entries(dev).get(key) or shipped_entries(dev).get(key)",
           "e = shipped_entries(dev).get(key) or local_entries(dev).get(key)", ("tests/test_tuning.py", "-k", "shipped"),
           "the package's table overriding what `vkdsl tune` measured on this machine"),
    Mutant("generated_kernels_storage_only", "vkdsl/realize.py", "texel_limit=texel_limit(dev), serial=lvp)",
           "texel_limit=0, serial=lvp)", ("tests/test_dsl.py", "-k", "texels_on"),
           "the device's texel choice never reaches the generated kernels"),
    Mutant("half_overflow_left_to_the_driver", "vkdsl/render.py", 'abs(x) >= 65520.0 ? x * (1.0/0.0) : "', '"',
           ("tests/test_half.py", "-k", "numpy_does"),
           "fp16 rounding trusting packHalf2x16 with overflow: llvmpipe's vector path saturates at 65504"),
    Mutant("prefix_stops_a_layer_early", "train/prefix.py", "model.forward(ids, stop=self.start)",
           "model.forward(ids, stop=self.start - 1)", ("tests/test_prefix.py",),
           "the frozen prefix hands over the stream entering the layer below the first adapted one"),
    Mutant("fused_attention_sees_next_key", "vkdsl/kernels/attention.comp",
           "const uint mine = ap.causal != 0u ? i + (ap.Tk - ap.Tq) : ap.Tk;",
           "const uint mine = ap.causal != 0u ? i + (ap.Tk - ap.Tq) + 1u : ap.Tk;",
           ("tests/test_verify_cases.py", "-k", "attention"), "the fused forward lets a query see the next key"),
    Mutant("window_overfills", "train/data.py", "b = next((j for j, f in enumerate(free) if f >= n), None)",
           "b = next((j for j, f in enumerate(free) if f >= n // 2), None)", ("tests/test_packing.py", "-k", "window"),
           "the window packer puts a row into a window without room for it"),
    Mutant("window_sequences_vary", "train/step.py", "Packing.plan(lengths, self.window, min_seq=self.cfg.batch_size)",
           "Packing.plan(lengths, self.window)", ("tests/test_memplan.py",),
           "window mode builds a program per number of sequences instead of one"),
    Mutant("head_rows_undercounted", "train/memplan.py", "room, n = B * T if cfg.window else B, 0",
           "room, n = B * T // 4 if cfg.window else B, 0", ("tests/test_memplan.py",),
           "the head-row bound a window's supervised positions can exceed"),
    Mutant("traced_keep_ignored", "vkdsl/trace.py", "while self.keep and len(self.programs) >= self.keep:",
           "while False:", ("tests/test_trace.py", "-k", "keep"), "a traced function holds every shape's program"),
    Mutant("packed_rows_see_earlier_rows", "vkdsl/kernels/attention.comp",
           "if (j > mine || j < lo || add == NEG_INF) continue;", "if (j > mine || add == NEG_INF) continue;",
           ("tests/test_packing.py",), "the fused forward lets a packed row attend to the rows before it"),
    Mutant("packed_keys_feed_later_rows", "vkdsl/kernels/attention_backward.comp",
           "jj[c] <= i + off) && i < hi[c] && add", "jj[c] <= i + off) && add",
           ("tests/test_packing.py", "tests/test_attention.py"), "the fused dk/dv sum over queries of later packed rows"),
    Mutant("transposed_source_gradient_as_a_view", "vkdsl/autograd.py",
           "gb = (_batch_sum(g.transpose(-1, -2) @ A, b) if tb",
           "gb = (_batch_sum(A.transpose(-1, -2) @ g, B).transpose(-1, -2) if tb",
           ("tests/test_grad.py", "-k", "transposed_operand"),
           "a source stored transposed gets its gradient as a transposed view, read strided"),
    Mutant("fused_dq_counts_the_clamped_key", "vkdsl/kernels/attention_backward.comp",
           "seen[c] = j + c < last && jc <= mine", "seen[c] = jc <= mine",
           ("tests/test_verify_cases.py", "-k", "attention"),
           "the fused dq's two-key step counts the last key twice when the range is odd"),
    Mutant("fused_lora_drops_a_rank", "vkdsl/kernels/matmul_lora.glsl",
           "+ u[i].z * v[2][j]\n                             + u[i].w * v[3][j];",
           "+ u[i].z * v[2][j];", ("tests/test_verify_cases.py", "-k", "qlora"),
           "the forward's fused LoRA term leaves out every fourth rank"),
    Mutant("fused_lora_input_gradient_uses_a_row_late", "vkdsl/kernels/matmul_lora.glsl",
           "v[j][e] = lora_v[min(col0 + 4 * j + e, pc.N - 1u) * r4 + j4];",
           "v[j][e] = lora_v[min(col0 + 4 * j + e + 1u, pc.N - 1u) * r4 + j4];",
           ("tests/test_verify_cases.py", "-k", "qlora"),
           "the input gradient's fused term reads the adapter's A one row late"),
    Mutant("fused_lora_gpu_store_drops_the_term", "vkdsl/kernels/matmul_lora.glsl",
           "    return pc.scale * (t.x + t.y + t.z + t.w);", "    return pc.scale * (t.x + t.y + t.z);",
           ("tests/test_quant_kernels.py", "-k", "lora"),
           "the GPU kernels' fused LoRA term leaves out every fourth rank"),
    Mutant("fused_lora_dA_unscaled", "ops/quant/linear.py",
           "(U.T @ g) * s, (x.T @ P) * s)", "(U.T @ g) * s, x.T @ P)",
           ("tests/test_verify_cases.py", "-k", "qlora"),
           "the fused layer's A gradient misses the LoRA scale"),
    Mutant("stash_after_the_data_not_the_view", "vkdsl/schedule.py",
           "early.setdefault(id(t.src[0]), []).append(t)",
           "early.setdefault(id(base_of(t.src[0])), []).append(t)",
           ("tests/test_ops_quant.py", "-k", "fp16_saved"),
           "an fp16 stash of a view placed before the view's own copy is made"),
    Mutant("fused_attention_backward_drops_delta", "vkdsl/kernels/attention_backward.comp",
           "const float ds = p * (hsum(pa) - st.y);", "const float ds = p * hsum(pa);",
           ("tests/test_verify_cases.py", "-k", "attention"),
           "the fused dk forgets the softmax's dO.O term"),
    Mutant("q4_1_minus_m", "vkdsl/kernels/quant_q4_1.glsl", "float(nibble(q.qs, e)) + q.dm.y;",
           "float(nibble(q.qs, e)) - q.dm.y;", ("tests/test_verify_cases.py", "-k", "dequant_q4_1"),
           "GGUF Q4_1 dequantized as d*q - m"),
    Mutant("format_ignores_end_of_turn", "train/heldout.py", "fmt.append(False if not g else sc.greedy[j] if",
           "fmt.append(False if not g else True if", ("tests/test_surfaces.py", "-k", "format"),
           "the format surface passes a right first label that is not followed by end-of-turn"),
    Mutant("lora_b_starts_nonzero", "ops/lora.py", "vkdsl.tensor(np.zeros((r, d_out), np.float32), requires_grad=True",
           "vkdsl.tensor(np.full((r, d_out), 1e-3, np.float32), requires_grad=True",
           ("tests/test_probes.py", "-k", "init"), "LoRA B initialized away from zero"),
    Mutant("every_rank_takes_every_batch", "train/step.py", "share = micro if group is None else my_share(micro, group)",
           "share = micro", ("tests/test_distributed.py", "-k", "single_process"),
           "under MPI each rank computes all of a step's micro-batches (the all-reduce counts them P times)"),
    Mutant("dpo_ranks_take_the_same_pairs", "train/dpo.py", "mine = my_share(idx, g)", "mine = idx[:c.dpo_batch]",
           ("tests/test_distributed.py", "-k", "dpo"), "under MPI every rank trains DPO on the first pairs of the global batch"),
    Mutant("dpo_resume_forgets_its_order", "train/stages.py", '        obj.order.set_state(meta["sampler"])',
           "        pass", ("tests/test_train_run.py", "-k", "kill_during_dpo"),
           "a resume inside DPO restores the adapter and optimizer but draws pairs from the start of the order"),
    Mutant("nonfinite_checked_after_the_update", "train/loop.py",
           "    bad = [k for k in obj.finite if not math.isfinite(rec[k])]\n    if bad:",
           "    bad = [k for k in obj.finite if not math.isfinite(rec[k])]\n    rec['grad_norm'] = apply(params, opt, gs, "
           "lr, obj.clip)\n    if bad:", ("tests/test_train_run.py", "-k", "nan_loss"),
           "a non-finite step's update lands on the adapter before the stop"),
    Mutant("dpo_task_gate_ignores_the_drop", "train/evidence.py", "after >= before - cfg.gate_dpo_task_drop",
           "after >= 0", ("tests/test_surfaces.py", "-k", "dpo_task_gate"),
           "the gate 'DPO did not cost the task' passes whatever DPO did to the held-out accuracy"),
    Mutant("rank_reads_its_own_cache", "train/trainer.py",
           "self.base = self.group.from_root(checkpoint.cached_base, cache, key)",
           "self.base = checkpoint.cached_base(cache, key)", ("tests/test_distributed.py", "-k", "resume"),
           "on resume each rank looks for the base evaluation in its own folder (only rank 0's has it)"),
    Mutant("records_read_whatever_their_types", "train/evidence.py", "if not known or any(",
           "if True or any(", ("tests/test_report.py", "-k", "wrong_type"),
           "a gate record whose pass is the string \"no\" reads as PASS in the report"),
    Mutant("buffers_sized_to_their_bytes", "vkdsl/runtime/memory.py",
           "size = key_stable_size(self.nbytes)", "size = max(self.nbytes, 16)",
           ("tests/test_runtime.py", "-k", "compiles_once"),
           "llvmpipe compiles a kernel again for every new buffer size class (1.5 s a matmul)"),
    Mutant("weights_uploaded_before_the_plan", "vkdsl/realize.py", "    if pending is not None:\n",
           "    if False:\n", ("tests/test_memplan.py", "-k", "refused_before"),
           "a run that cannot fit allocates its weights on the device before the plan refuses it"),
    Mutant("dpo_step_planned_at_one_pair", "train/memplan.py",
           "    B = min(cfg.dpo_batch, len(pairs))\n", "    B = 1\n",
           ("tests/test_memplan.py", "-k", "dpo_step"),
           "the plan's DPO step is a one-pair batch while the stage runs dpo_batch pairs"),
    Mutant("sft_step_kept_through_dpo", "train/trainer.py", "    r.stepper.release()", "    pass",
           ("tests/test_memplan.py", "-k", "dpo_step"),
           "the SFT step's buffers stay allocated while the DPO step runs beside them"),
    Mutant("cached_programs_never_give_way", "vkdsl/runtime/context.py",
           "and any(free() for free in RECLAIM)", "and False",
           ("tests/test_trace.py", "-k", "give_way"),
           "programs of shapes not in use keep their memory while a new allocation is refused"),
    Mutant("overruns_never_checked", "vkdsl/realize.py",
           "if self.guard_bytes and (over := self.overruns()):", "if False and (over := []):",
           ("tests/test_user_cases.py", "-k", "past_its_output"),
           "a kernel writing past its output passes verify (SwiftShader's heap found the first)"),
    Mutant("shared_memory_beyond_the_device_built", "vkdsl/runtime/spirv_limits.py",
           "    if shared > limits.max_shared_memory:", "    if False:",
           ("tests/test_runtime.py", "-k", "refused"),
           "a kernel declaring more shared memory than the device has, handed to the driver"),
    Mutant("guard_checks_a_part_not_its_buffer", "vkdsl/realize.py",
           "if not np.all(buf.read(np.uint32, (nb + self.guard_bytes) // 4)[nb // 4:]",
           "if not np.all(buf.read(np.uint32, nb // 4 + 1)[nb // 4 + 1:]",
           ("tests/test_user_cases.py", "-k", "past_its_output"),
           "the sentinel words are never read (as when outputs became Parts of their slots)"),
    Mutant("split_blocks_not_moved_into_place", "models/weights.py",
           "y = y.pad(((0, 0),) * (y.ndim - 1) + ((r0, N - r0 - p.shape[0]),))",
           "y = y.pad(((0, 0),) * (y.ndim - 1) + ((0, N - p.shape[0]),))", ("tests/test_big_weights.py",),
           "a weight split over bindings puts every block's outputs in the first block's columns"),
    Mutant("split_qgather_ignores_its_base", "ops/quant/gather.py", "GATHER_PUSH.pack(V, D, self.base, self.total, n)",
           "GATHER_PUSH.pack(V, D, 0, self.total, n)", ("tests/test_big_weights.py",),
           "a packed table's later blocks look their rows up as if they started at row 0"),
    Mutant("subgroup_max_drops_nan", "vkdsl/render.py", "acc = bad > 0.0 ? (0.0/0.0) : {op}(acc);",
           "acc = {op}(acc);", ("tests/test_profiles.py", "-k", "reductions"),
           "the subgroup max reduction trusts subgroupMax with NaN (lavapipe's drops it)"),
    # the evidence's statistics and the data's masks (issue 25's list)
    Mutant("wilson_one_sided_z", "train/evidence.py", "z: float = 1.959964", "z: float = 1.644854",
           ("tests/test_train_config_data.py", "-k", "wilson"), "the Wilson interval at 90% instead of 95%"),
    Mutant("ece_unweighted_bins", "train/evidence.py", "ece += n / len(conf) * abs(a - c)",
           "ece += abs(a - c) / bins", ("tests/test_surfaces.py", "-k", "calibration"),
           "ECE averages the bins instead of weighting them by their rows"),
    Mutant("packed_positions_continue", "train/packing.py", "pos[s, o:o + n] = np.arange(n)",
           "pos[s, o:o + n] = np.arange(o, o + n)", ("tests/test_packing.py",),
           "a packed row's positions continue from the row before it instead of restarting at 0"),
    Mutant("end_of_turn_unsupervised", "train/data.py", "                lab[0] = t[0]",
           "                lab[0] = IGNORE", ("tests/test_chat_templates.py", "tests/test_train_config_data.py"),
           "the end-of-turn token after a reply is not trained (the model never learns to stop)"),
    Mutant("left_truncation_cuts_the_right", "train/data.py", "    return ids[drop:], tgt[drop:], True",
           "    return ids[:max_len], tgt[:max_len], True", ("tests/test_train_config_data.py",),
           "left truncation drops the completion's end instead of the prompt's start"),
    # issue 31's refusals: each fix has a test that goes red without it
    Mutant("labels_not_checked_against_heldout", "train/heldout.py",
           "                if ex.completion.strip() not in self.labels:", "                if False:",
           ("tests/test_hostile_input.py", "-k", "labels"), "held-out rows outside the labels drop out unseen"),
    Mutant("fresh_run_appends_to_a_run_folder", "cli/train.py", "    if not overwrite:\n", "    if False:\n",
           ("tests/test_hostile_input.py", "-k", "fresh_run"), "a new run replaces an earlier run's records"),
    Mutant("system_turn_anywhere", "train/data.py", '        if m["role"] == "system" and i == 0:',
           '        if m["role"] == "system":', ("tests/test_hostile_input.py", "-k", "turns"),
           "a system turn after the conversation trains without a word"),
    Mutant("resume_takes_other_rows", "train/checkpoint.py",
           '"train_file_sha256": "the train_file\'s content",\n            ', "", ("tests/test_hostile_input.py", "-k", "resume"),
           "a resume on another training file's content continues silently"),
    Mutant("target_modules_ignored", "models/adapters/peft.py", "        if not hit:\n", "        if False:\n",
           ("tests/test_hostile_input.py", "-k", "target_modules"),
           "an adapter PEFT would apply to fewer modules loads on all of them"),
    Mutant("nan_weights_load", "models/tensors.py", "        bad = nonfinite(rec)\n", "        bad = 0\n",
           ("tests/test_hostile_input.py", "-k", "nan_weight"), "a NaN weight loads and every logit is NaN"),
    Mutant("q6_k_scale_field_misplaced", "models/tensors.py", '"Q6_K": (208,)}', '"Q6_K": (192,)}',
           ("tests/test_hostile_input.py", "-k", "scale_fields"), "Q6_K's d read from its 8-bit scales"),
    Mutant("profile_variable_unchecked", "vkdsl/environment.py",
           "    named()                                          # $VKDSL_PROFILE", "    pass",
           ("tests/test_hostile_input.py", "-k", "environment"), "VKDSL_PROFILE=bogus passes silently"),
    Mutant("quiet_hides_the_gates", "train/progress.py", "        if not self.jsonl:\n            self._print(text)",
           "        if not (self.jsonl or self.quiet):\n            self._print(text)",
           ("tests/test_hostile_input.py", "-k", "quiet"), "--quiet prints nothing, not even the gates"),
    Mutant("assign_in_place_through_a_view", "vkdsl/schedule.py",
           "direct = (id(value) not in mat and all(l is target for l in reads)\n"
           "                  and _identity_reads(value, target))",
           "direct = (id(value) not in mat and all(l is target for l in reads))",
           ("tests/test_dsl.py", "-k", "assign"), "w <- f(view of w) written in place, reading what it overwrote"),
    Mutant("pool_frees_after_the_first_reader", "vkdsl/slots.py", "last_use[owner(x)] = i",
           "last_use.setdefault(owner(x), i)", ("tests/test_dsl.py", "tests/test_grad.py", "-x"),
           "a temporary's buffer reused while a later step still reads it"),
    Mutant("lvp_matmul_k_tail_counted", "vkdsl/kernels/matmul_lvp.glsl", "const bool live = k0 + kk < K;",
           "const bool live = k0 + kk <= K;", ("tests/test_matmul_kernels.py", "-k", "lvp"),
           "the register-blocked matmul adds a clamped value past K"),
    Mutant("barrier_skips_write_after_read", "vkdsl/runtime/commands.py",
           "if (rw & self._written) or (set(writes) & self._read):", "if rw & self._written:",
           ("tests/test_runtime.py", "-k", "barrier"), "no barrier before overwriting a buffer still being read"),
    Mutant("base_cache_key_stops_at_first_target", "train/step.py",
           "        end = int(sup[-1]) + 1 if len(sup) else 0\n        return hashlib.sha256(ids_row",
           "        end = int(sup[0]) + 1 if len(sup) else 0\n        return hashlib.sha256(ids_row",
           ("tests/test_train_objective.py", "-k", "cached_base"), "TMKL's cached base logits shared by rows "
           "that differ after their first target"),
    Mutant("template_supervises_only_the_last_reply", "train/data.py",
           'segs += [(text[pos:at], False), (m["content"], True)]',
           'segs += [(text[pos:at], False), (m["content"], k == len(msgs) - 1)]',
           ("tests/test_chat_templates.py", "-k", "supervised"), "earlier assistant turns of a conversation masked"),
    Mutant("head_rows_outlive_their_chunk", "vkdsl/autograd.py",
           "Jw = custom(_After(), [J, y, *aux], J.shape, requires_grad=False)", "Jw = J",
           ("tests/test_checkpointing.py", "-k", "chunked_head"),
           "a head chunk's logits held until a later reader of its loss rows"),
    Mutant("stash_placed_where_first_read", "vkdsl/schedule.py",
           "    order = _stashes_early(walk(roots[::-1]))", "    order = walk(roots[::-1])",
           ("tests/test_checkpointing.py", "-k", "fp16"),
           "an fp16 stash made in the backward, so the fp32 activation is kept until then anyway"),
    Mutant("stash_skips_the_output_read", "vkdsl/autograd.py",
           "            out = kept(t) if t.op in _READS_OUTPUT else t", "            out = t",
           ("tests/test_checkpointing.py", "-k", "fp16"),
           "a rule that reads its own output (tanh) reads the fp32 value, kept beside its fp16 copy"),
    Mutant("slot_shared_with_the_value_read_at_its_step", "vkdsl/slots.py",
           "            if j == 0 or ends[j - 1] < start:", "            if j == 0 or ends[j - 1] <= start:",
           ("tests/test_trace.py", "-k", "share_a_slot"),
           "a value written into the slot of one its own step still reads"),
    Mutant("slot_shared_with_a_live_value", "vkdsl/slots.py",
           "            if j == 0 or ends[j - 1] < start:", "            if True:",
           ("tests/test_trace.py", "-k", "share_a_slot"), "values alive at the same time share a buffer"),
    Mutant("mask_stored_for_every_reader", "vkdsl/schedule.py",
           "uses.get(id(t), 0) > 1 and not _is_mask(t, mat):", "uses.get(id(t), 0) > 1:",
           ("tests/test_dsl.py", "-k", "expanded_mask"),
           "an LM head chunk's one-hot labels written out and read back by each reader"),
    Mutant("mask_admits_arithmetic", "vkdsl/schedule.py",
           'MASK_OPS = ("cmpeq", "cmplt", "where", "cast")',
           'MASK_OPS = ("cmpeq", "cmplt", "where", "cast", "mul")',
           ("tests/test_dsl.py", "-k", "expanded_mask"),
           "an expansion that rounds recomputed by each reader, where kernels may round it apart"),
    Mutant("every_view_in_a_chain_counted_as_a_reader", "vkdsl/schedule.py",
           'if t.op in VIEWS and t.op != "expand" and id(t) not in out_ids:',
           'if False:', ("tests/test_dsl.py", "-k", "chain_of_views"),
           "RoPE's halves stored and read back: three kernels where one does"),
    Mutant("broadcast_recomputed_per_element", "vkdsl/schedule.py",
           'if t.op in VIEWS and t.op != "expand" and id(t) not in out_ids:',
           'if t.op in VIEWS and id(t) not in out_ids:', ("tests/test_dsl.py", "-k", "chain_of_views"),
           "a broadcast value recomputed at every element it is read at"),
    Mutant("logsumexp_differentiated_through_its_max", "ops/nn.py",
           "    out = with_gradient(lse, (x,), lambda g, x: (g * (x - lse).exp(),))\n",
           "    out = lse\n", ("tests/test_grad.py", "-k", "logsumexp"),
           "the softmax kept for the backward and the max's zero-sum term computed"),
    Mutant("profile_files_other_programs_as_host", "train/profile.py",
           "            secs[PROGRAMS.get(other, f\"program {other}\")] += s\n",
           "            pass\n", ("tests/test_train_objective.py", "-k", "profile_classes"),
           "the frozen prefix and base logits a step runs filed under host (as they were)"),
    Mutant("qmatmul_nt_reads_one_weight_per_step", "vkdsl/kernels/qmatmul_lvp.glsl",
           "b[kk][j4][jj] = q32_get(q[j4][jj], KB * s + kk);",
           "b[kk][j4][jj] = q32_get(q[j4][jj], KB * s);",
           ("tests/test_verify_cases.py", "-k", "qlinear and q4_1"),
           "the packed-weight product (no adapter) decoding one weight for a whole K step"),
    Mutant("run_verifies_the_formats_its_model_lacks", "cli/verify.py",
           "and (formats is None or packed_format(c) in (None, *formats))",
           "and (formats is None or packed_format(c) not in formats)",
           ("tests/test_train_run.py", "-k", "packed_formats"),
           "vkdsl-train's verify pass checking the other formats' kernels instead of its model's"),
    Mutant("int4_scale_read_per_range", "vkdsl/kernels/quant_int4.glsl",
           "    q.d = int4_scale(b >> 1);", "    q.d = int4_scale(b);",
           ("tests/test_verify_cases.py", "-k", "qlinear and int4"),
           "the int4 product reading a scale per 32 weights instead of per 64"),
    Mutant("nf4_absmax_codes_unsigned", "vkdsl/kernels/quant_nf4.glsl",
           "float(bitfieldExtract(int(Q_U1(q_amax, blk >> 2)),",
           "float(bitfieldExtract(Q_U1(q_amax, blk >> 2),",
           ("tests/test_verify_cases.py", "-k", "qlinear and nf4"),
           "NF4's int8 absmax codes read as unsigned"),
    Mutant("run_trains_without_the_verify_verdict", "train/trainer.py",
           "        before_training(rep)\n", "        pass\n",
           ("tests/test_train_run.py", "-k", "verify_pass_runs_beside or failing_verify_row"),
           "vkdsl-train training while its verify pass has not passed (or has failed)"),
    Mutant("shipped_table_trusted_whatever_it_names", "vkdsl/tuning.py",
           "(shipped_identity(dev) if shipped else identity(dev))",
           "(data.get(\"identity\") if shipped else identity(dev))",
           ("tests/test_tuning.py", "-k", "shipped"),
           "a table at this build's path used though it names another build or CPU vendor"),
    Mutant("logsumexp_gradient_unnormalised", "ops/nn.py", "(g * (x - lse).exp(),)",
           "(g * (x - m).exp(),)", ("tests/test_grad.py", "-k", "logsumexp or cross_entropy"),
           "the logsumexp rule's softmax not divided by its sum"),
    Mutant("fused_kernel_reads_unbounded", "vkdsl/schedule.py", "MAX_FUSED_READS = 24", "MAX_FUSED_READS = 10 ** 6",
           ("tests/test_trace.py", "-k", "many_chunks"), "a generated kernel binding more buffers than llvmpipe takes"),
    Mutant("pack8_halves_swapped", "vkdsl/kernels/pack8.glsl", "    lo = c.lo;\n    hi = c.hi;",
           "    lo = c.hi;\n    hi = c.lo;", ("tests/test_attention.py", "-k", "int64"),
           "without int64 the fused attention reads each 8-float chunk's halves swapped"),
    Mutant("texel_load8_reads_the_low_half_twice", "vkdsl/kernels/pack8.glsl",
           "hi = texelFetch(name, int(2u * (i) + 1u)); }", "hi = texelFetch(name, int(2u * (i))); }",
           ("tests/test_attention.py", "-k", "causal_matches"),
           "the texel-buffer loads of the fused attention read an 8-float chunk's first half for both"),
    Mutant("texel_spans_end_is_the_start", "vkdsl/kernels/attention_io.glsl",
           "texelFetch(mask_tex, int(2u * (i) + 1u)).x)", "texelFetch(mask_tex, int(2u * (i))).x)",
           ("tests/test_attention.py", "-k", "packed_rows"),
           "with texel loads a packed row's span ends where it starts"),
    Mutant("gelu_example_cube_squared", "examples/verify_gelu_mlp.py", "h * h * h * 0.044715", "h * h * 0.044715",
           ("tests/test_user_cases.py", "-k", "four_profiles and dsl"), "the DSL example's GELU cubic term squared"),
    Mutant("layernorm_example_unbiased_variance", "examples/verify_layernorm.py", "row_sum(q) / float(cols) + eps",
           "row_sum(q) / float(cols - 1) + eps", ("tests/test_user_cases.py", "-k", "four_profiles and glsl"),
           "the GLSL example's layer norm divides the centred squares by n - 1"),
    Mutant("case_gradient_step_doubled", "vkdsl/cases.py", "g.flat[j] = (up - down) / (2 * h)",
           "g.flat[j] = (up - down) / h", ("tests/test_user_cases.py", "-k", "closed_form"),
           "central differences of a case's reference twice the gradient"),
    Mutant("stale_golden_accepted", "vkdsl/case_goldens.py", 'return ("stale golden: its inputs',
           'return "" if True else ("stale golden: its inputs', ("tests/test_user_cases.py", "-k", "goldens_made"),
           "a golden whose inputs are not the case's generator's checked as if current"),
    Mutant("delta_rule_reads_before_write", "ops/gated_delta.py", "QK = (qs @ kT) * decay",
           "QK = (qs @ kT) * decay * _mask(C, -1)", ("tests/test_gated_delta.py", "-k", "chunked_on_the_device"),
           "a step's output reads the state before its own write"),
    Mutant("delta_rule_state_not_decayed", "ops/gated_delta.py", "keep[:, :, n].reshape(B, H, 1, 1) * S + write",
           "S + write", ("tests/test_gated_delta.py", "-k", "chunked_on_the_device"),
           "the state crosses a chunk boundary without the chunk's decay"),
    Mutant("tri_inverse_gradient_untransposed", "ops/gated_delta.py", "t = node.transpose(-1, -2)", "t = node",
           ("tests/test_gated_delta.py", "-k", "triangular"), "the solve's gradient uses T instead of T^T"),
    Mutant("qwen35_norm_not_centred", "models/qwen35_files.py", "(np.asarray(w, np.float64) + 1.0)",
           "(np.asarray(w, np.float64) + 0.0)", ("tests/test_qwen35.py", "-k", "transformers_computation"),
           "Qwen3.5's zero-centred RMSNorm weights used as gains, not 1 + w"),
    Mutant("qwen35_gate_and_query_swapped", "models/qwen35.py", "q, gate = qg[..., :D], qg[..., D:]",
           "gate, q = qg[..., :D], qg[..., D:]", ("tests/test_qwen35.py", "-k", "transformers_computation"),
           "the full-attention output gate read from the query's half of q_proj"),
    Mutant("qwen35_value_heads_tiled", "models/qwen35.py",
           "t.reshape(B, T, Hk, 1, dk).expand((B, T, Hk, Hv // Hk, dk))",
           "t.reshape(B, T, 1, Hk, dk).expand((B, T, Hv // Hk, Hk, dk))",
           ("tests/test_qwen35.py", "-k", "transformers_computation"),
           "key heads tiled over the value heads instead of each serving consecutive ones"),
    Mutant("qwen35_conv_taps_reversed", "models/qwen35.py", "term = xp[:, j:j + T] * w[:, j]",
           "term = xp[:, j:j + T] * w[:, K - 1 - j]", ("tests/test_qwen35.py", "-k", "transformers_computation"),
           "the causal convolution's taps applied in reverse time order"),
    Mutant("qwen35_adapter_value_heads_unordered", "models/adapters/common.py", "    if file_tiled == cfg.v_tiled:",
           "    if True:", ("tests/test_qwen35_files.py", "-k", "cross"),
           "adapters keep the model's value-head order in a file of the other order"),
    Mutant("qwen35_out_proj_columns_unordered", "models/adapters/common.py",
           'if cfg.arch == "qwen35" and module.split(".")[-1] == "ssm_out":',
           'if cfg.arch == "qwen35" and module.split(".")[-1] == "ssm_outx":',
           ("tests/test_qwen35_files.py", "-k", "cross"), "out_proj's adapter input columns left in the model's order"),
    Mutant("qwen35_gguf_value_heads_grouped", "models/qwen35_files.py", "v_tiled=Hk != Hv)", "v_tiled=False)",
           ("tests/test_qwen35_files.py", "-k", "transformers_logits"),
           "a converter GGUF's tiled value heads read as grouped"),
    Mutant("qwen35_conv_crosses_rows", "models/qwen35.py", "if segments is not None and back:",
           "if segments is not None and not back:", ("tests/test_qwen35.py", "-k", "packed"),
           "a packed row's convolution reads the previous row's last tokens"),
    Mutant("delta_rule_state_crosses_rows", "ops/gated_delta.py",
           "reach = eG if carry is None else eG * carry", "reach = eG",
           ("tests/test_gated_delta.py", "-k", "packed"), "a packed sequence reads the state its predecessor left"),
    Mutant("shipped_spirv_never_recompiled", "vkdsl/compiler/bundle.py",
           'elif hashlib.sha256(compile_source(entry["name"], src)).hexdigest() != entry["sha256"]:',
           "elif False:", ("tests/test_compiler.py", "-k", "swapped"),
           "the shipped-bundle check trusts each .spv without recompiling its source"),
    Mutant("tuned_tile_grid_of_the_default", "vkdsl/handwritten.py",
           'LVP_TILE["LOCAL"], tm, tn, texels or {}, linear=True)',
           'LVP_TILE["LOCAL"], tm, 32, texels or {}, linear=True)',
           ("tests/test_tuning.py", "-k", "every_tile"), "a tuned tile's grid sized for the default tile's columns"),
    Mutant("tiled_grid_rows_for_columns", "vkdsl/handwritten.py",
           "groups = (-(-cols // self.cols), -(-rows // self.rows), batch)",
           "groups = (-(-rows // self.cols), -(-cols // self.rows), batch)",
           ("tests/test_matmul_kernels.py", "tests/test_quant_kernels.py", "-k", "forms or qmatmul"),
           "a tiled product's workgroups counted over the wrong dimensions: tall or wide outputs cut short"),
    Mutant("lvp_tiles_drop_the_last_column", "vkdsl/kernels/matmul_tile.glsl",
           "const uint tiles_n = (pc.N + TN - 1) / TN;", "const uint tiles_n = pc.N / TN;",
           ("tests/test_matmul_kernels.py", "tests/test_quant_kernels.py", "-k", "forms or qmatmul"),
           "the CPU kernels' linear tile numbering rounds the columns down: the last partial tile of each row"
           " is never computed, and rows slide"),
    Mutant("gpu_block_ignores_the_shape", "vkdsl/handwritten.py",
           'return next(fills, cfgs[-1])', 'return next(fills, cfgs[0])',
           ("tests/test_profiles.py", "-k", "gpu_block_follows"),
           "narrow products back on the largest block (a rank-8 LoRA product in 8 workgroups)"),
    Mutant("forced_gpu_block_ignored", "vkdsl/handwritten.py", "    if _block.get():\n", "    if False:\n",
           ("tests/test_matmul_kernels.py", "-k", "every_gpu_block"),
           "verify's block rows run whatever block the shape picks, so some blocks are never checked"),
    Mutant("attention_rescale_skipped", "vkdsl/kernels/attention.comp", "if (corr[t] != 1.0) {", "if (corr[t] < 0.0) {",
           ("tests/test_attention.py",), "the fused forward never rescales its sums when a later key raises the max"),
    Mutant("block_row_planned_outside_its_block", "vkdsl/verify.py", "        return _matmul(i, p).numpy()",
           "        return _matmul(i, p)", ("tests/test_profiles.py", "-k", "block_rows_run"),
           "verify's block rows realized after the block's context ends: every row runs the shape's block"),
    Mutant("pipeline_cache_uuid_unchecked", "vkdsl/runtime/pipeline_cache.py",
           "head[1:] != (1, vendor, device, uuid)", "head[1:3] != (1, vendor)",
           ("tests/test_runtime.py", "-k", "pipeline_cache"),
           "another driver build's pipeline cache handed to this driver"),
    Mutant("qmatvec_texel_x_a_chunk_late", "vkdsl/kernels/qmatvec.comp",
           "#define X_AT(i) texelFetch(x_tex, int(i))", "#define X_AT(i) texelFetch(x_tex, int(i) + 1)",
           ("tests/test_qmatvec.py",), "decode's products read X through texels one vec4 off"),
    Mutant("gguf_adapter_alpha_zero_scales_zero", "models/adapters/gguf_lora.py",
           "float(alpha_cpp) / r if alpha_cpp else 1.0", "float(alpha_cpp) / r",
           ("tests/test_adapters.py", "-k", "llama_cpp_does"),
           "a llama.cpp adapter with alpha 0 loads and changes nothing (llama.cpp scales it by 1)"),
    Mutant("generate_lets_nan_top_p_through", "models/generate.py",
           "(not 0 < top_p <= 1,", "(top_p > 1 or top_p < 0,",
           ("tests/test_cli_errors.py", "-k", "sampling"),
           "a NaN or zero top_p samples from an empty or undefined nucleus"),
    Mutant("decoded_rows_blind_to_their_own_token", "models/generate.py",
           "np.arange(self.L)[None, :] <= np.asarray(pos)[:, None]",
           "np.arange(self.L)[None, :] < np.asarray(pos)[:, None]",
           ("tests/test_model_forward.py", "-k", "rows_decoded"),
           "rows decoded together attend to every earlier token but the one being decoded"),
]


def make_copy(root: Path) -> tuple[Path, Path]:
    """(copy of the tree, staging folder laid out as the installed packages)."""
    tree = root / "tree"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info",
                                                              ".pytest_cache"))
    stage = root / "stage"
    (stage / "vkdsl").mkdir(parents=True)
    for entry in (tree / "vkdsl").iterdir():
        (stage / "vkdsl" / entry.name).symlink_to(entry)
    for folder in INSIDE_VKDSL:
        (stage / "vkdsl" / folder).symlink_to(tree / folder)
    (stage / "vkdsl_golden").symlink_to(tree / "golden")
    # an editable install's finder maps vkdsl.ops & co. to the original tree whatever the path
    # says: drop it at start-up, so every vkdsl module comes from the staging folder
    (stage / "sitecustomize.py").write_text(
        "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n")
    return tree, stage


def _env(stage: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stage)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_staging(tree: Path, stage: Path):
    """The subprocesses must import the copy, not the installed tree."""
    code = "import vkdsl.ops.quant.formats as f, vkdsl_golden.store as g; print(f.__file__); print(g.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=stage, env=_env(stage), capture_output=True,
                         text=True, check=True).stdout.split()
    if not all(p.startswith(str(stage)) for p in out):
        raise SystemExit(f"mutants: the copy is not what gets imported ({out}); nothing would be measured")


def run_tests(tree: Path, stage: Path, tests) -> tuple[int, int, int, float]:
    """(exit status, tests run, failed, seconds) of pytest on the copy."""
    t0 = time.perf_counter()
    # run from the staging folder (python -m puts the working folder first on sys.path), tests by path
    args = [str(tree / a) if a.startswith("tests/") else a for a in tests]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tree),
                        *args], cwd=stage, env=_env(stage), capture_output=True, text=True)
    tail = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    count = lambda word: sum(int(n) for n in re.findall(rf"(\d+) {word}", tail))
    failed, passed = count("failed") + count("error"), count("passed")
    return p.returncode, failed + passed, failed, time.perf_counter() - t0


def apply(tree: Path, m: Mutant) -> str:
    path = tree / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutant {m.name}: {m.path} holds {text.count(m.old)} copies of the text to change "
                         f"(expected 1): the mutant is stale")
    path.write_text(text.replace(m.old, m.new))
    return text


def campaign(mutants, out=print) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="vkdsl-mutants-") as tmp:
        tree, stage = make_copy(Path(tmp))
        check_staging(tree, stage)
        for m in mutants:
            rc, n, _, secs = run_tests(tree, stage, m.tests)          # unmutated: these tests must pass
            if rc != 0:
                raise SystemExit(f"mutant {m.name}: its tests fail on the unmutated tree ({' '.join(m.tests)})")
            original = apply(tree, m)
            try:
                rc, n, failed, secs = run_tests(tree, stage, m.tests)
            finally:
                (tree / m.path).write_text(original)
            rows.append({"mutant": m.name, "tests": n, "failed": failed, "killed": rc != 0 and failed >= 1,
                         "seconds": secs, "why": m.why})
            out(f"{m.name:28s} {n:5d} {failed:6d} {secs:8.1f}  {'killed' if rows[-1]['killed'] else 'SURVIVED'}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    known = {m.name: m for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:28s} {m.path}: {m.why}  [pytest {' '.join(m.tests)}]")
        return 0
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(f"unknown mutant(s) {unknown}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    chosen = [known[n] for n in args.names] or MUTANTS
    print(f"{'mutant':28s} {'tests':>5s} {'failed':>6s} {'seconds':>8s}  result")
    rows = campaign(chosen)
    survived = [r["mutant"] for r in rows if not r["killed"]]
    print(f"{len(rows) - len(survived)}/{len(rows)} mutants killed" + (f"; SURVIVED: {survived}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
