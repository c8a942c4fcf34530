"""README.md of a trained demo checkpoint, rendered from the training report (metrics.json)."""

from __future__ import annotations

from pathlib import Path


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def render_model_card(report: dict) -> str:
    args, split, tokens = report["args"], report["split"], report["tokens"]
    lines = [
        "# specsplit demo checkpoint",
        "",
        "A small Llama-style target with one DeepSeek-V3 style MTP module, trained from scratch by this",
        "repository's own script on the Python standard library's source, so that speculative decoding shows",
        "real acceptance rates on any machine without downloads. It writes Python-looking code; it is not a",
        "useful assistant.",
        "",
        "## How it was made",
        "",
        f"- Command: `{report['command']}` on {report['device']}.",
        (
            f"- Data: `python -m specsplit.training.train_demo --prepare-only --data-dir {args['data_dir']}` builds the"
            " tokenizer and the token files from the local standard library; training reads only that folder, so"
            " it can be carried to a machine with another Python."
        ),
        f"- Corpus: the `.py` files of Python {split['python_version']}'s standard library (`{split['root']}`),",
        "  without site-packages, pydoc_data, non-UTF-8 files, files over 400 kB and generated tables;",
        f"  split by file with `random.Random({split['seed']})`: {split['train']} train, {split['valid']} validation,",
        (
            f"  {split['heldout']} held-out files (listed in `heldout_files.txt`);"
            f" {tokens['train']:,} / {tokens['valid']:,} / {tokens['heldout']:,} tokens."
        ),
        (
            f"- Tokenizer: byte-level BPE, {args['vocab_size']} tokens, trained on the train files with `tokenizers`;"
            " `<|endoftext|>` (id 0) is bos and eos and starts every file, `<|pad|>` is id 1."
        ),
        (
            f"- Model: {report['num_parameters']:,} parameters; hidden {args['hidden_size']}, {args['layers']} layers,"
            f" {args['heads']} heads ({args['kv_heads']} KV), MLP {args['intermediate_size']}, tied embeddings;"
            f" MTP module at `model.layers.{args['layers']}.*` (shared_head.head is a copy of the embedding)."
        ),
        (
            f"- Objective: next-token CE + {args['mtp_weight']} x MTP CE for each of {args['mtp_steps']} unrolled MTP"
            " steps (step j reads the previous step's output and predicts x_{p+2+j}, attending as a drafter with"
            " an MTP KV cache does); step 0 alone is DeepSeek-V3's MTP loss, steps 1.. train draft positions"
            " 2..k. The MTP gradient flows into the trunk."
        ),
        (
            f"- Training: {report['steps']} steps of {args['batch_size']} x {args['seq_len']} tokens"
            f" ({report['tokens_seen']:,} tokens, {report['epochs']:.1f} epochs) in {report['train_seconds']:.0f} s;"
            f" AdamW lr {args['lr']} (warmup {args['warmup']}, cosine to {args['min_lr_ratio']}x),"
            f" weight decay {args['weight_decay']}, dropout {args['dropout']}, seed {args['seed']}; weights of step"
            f" {report['best_step']} kept (best validation loss); saved in bf16."
        ),
        (
            f"- Final training losses: next {report['final_train_next_loss']:.3f},"
            f" MTP per step {_fmt(report['final_train_mtp_loss'])}; validation at the kept step: next"
            f" {report['best_valid_next_loss']:.3f}, MTP {_fmt(report['best_valid_mtp_loss'])}."
        ),
        "",
    ]
    if "--steps" not in report["command"]:
        lines += [
            f"The time budget fixed the step count at {report['steps']}; add `--steps {report['steps']}` to the"
            " command to repeat the run (same seed and device type give the same weights on CPU; GPU kernels"
            " may differ bit-wise).",
            "",
        ]
    if "heldout" in report:
        tf = report["heldout"]["teacher_forced"]
        spec = report["heldout"]["speculative_greedy"]
        lines += [
            "## Held-out numbers",
            "",
            f"The saved bf16 weights, computed in fp32 on {report['heldout'].get('measured_on', report['device'])}.",
            "",
            f"Teacher-forced over {tf['tokens']:,} held-out tokens:",
            "",
            "| | value |",
            "|---|---|",
            f"| next-token loss / accuracy | {tf['next_token_loss']:.3f} / {tf['next_token_accuracy']:.3f} |",
            f"| MTP top-1 == target's greedy token, per step | {_fmt(tf['mtp_agreement'])} |",
            f"| MTP top-1 == true token, per step | {_fmt(tf['mtp_accuracy'])} |",
            f"| MTP loss per step | {_fmt(tf['mtp_loss'])} |",
            "",
            (
                f"Greedy speculative decoding, k = {spec['num_drafts']}, {args['spec_prompts']} held-out prompts of"
                f" {args['spec_prompt_len']} tokens, {args['spec_new_tokens']} new tokens each ({spec['iterations']}"
                " verify iterations):"
            ),
            "",
            f"- acceptance at draft positions 1..{spec['num_drafts']}: {_fmt(spec['acceptance'])}",
            f"- tokens per verify iteration (accepted + 1): {spec['tokens_per_iteration']:.2f}",
            "",
            "Acceptance at position j counts the iterations in which drafts 1..j were all accepted. Greedy text of a"
            " model this small repeats itself, which makes it easier to draft than the held-out text itself: the"
            " teacher-forced agreement above is the stricter number.",
            "",
            *_training_time_numbers(report),
            "Re-measure with `python -m specsplit.training.evaluate checkpoints/demo --data-dir DIR` (DIR prepared by",
            (
                "`python -m specsplit.training.train_demo --prepare-only --data-dir DIR` on Python "
                f"{split['python_version']})."
            ),
            "",
        ]
    if "sample" in report:
        lines += ["## Sample (greedy)", "", "```python", report["sample"].rstrip(), "```", ""]
    return "\n".join(lines)


def _training_time_numbers(report: dict) -> list[str]:
    earlier = report.get("heldout_at_training")
    if not earlier or earlier == report["heldout"]:
        return []
    tf, spec = earlier["teacher_forced"], earlier["speculative_greedy"]
    return [
        f"The same measurement on {earlier.get('measured_on', report['device'])}: next-token accuracy"
        f" {tf['next_token_accuracy']:.3f}, MTP agreement {_fmt(tf['mtp_agreement'])}, acceptance"
        f" {_fmt(spec['acceptance'])}, {spec['tokens_per_iteration']:.2f} tokens per iteration.",
        "",
    ]


def write_model_card(out_dir: Path, report: dict) -> None:
    (out_dir / "README.md").write_text(render_model_card(report))
