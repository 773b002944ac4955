"""vkdsl.train: LoRA SFT with target-masked KL to the base, preflight checks, evidence and gates.

Roles: config (settings), data (JSONL -> ids/labels, batching), inject (LoRA by module
patterns), schedule (LR), step (traced gradients + host AdamW, accumulation), evidence
(held-out/preservation/spectrum/merge checks, gates), checkpoint (atomic save, resume
identity), progress (output modes), trainer (the run), cli (`vkdsl-train`)."""
