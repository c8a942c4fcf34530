"""The MTP module's math: DeepSeek-V3 step 0 and the unrolled steps a drafter with a KV cache runs."""

import torch

from specsplit.training.joint_model import ModelShape, TargetWithMTP, demo_config

SHAPE = ModelShape(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    max_position_embeddings=128,
)


def tiny_model(seed: int = 0) -> TargetWithMTP:
    torch.manual_seed(seed)
    return TargetWithMTP(demo_config(vocab_size=97, shape=SHAPE)).eval()


def test_hf_last_hidden_state_is_after_the_final_norm():
    model = tiny_model()
    ids = torch.randint(2, 97, (1, 9))
    out = model.target(ids, output_hidden_states=True)
    pre_norm = model.target.model.layers[-1](
        model.target.model.layers[0](
            model.target.model.embed_tokens(ids),
            position_embeddings=model.target.model.rotary_emb(out.hidden_states[0], torch.arange(9)[None]),
            position_ids=torch.arange(9)[None],
        ),
        position_embeddings=model.target.model.rotary_emb(out.hidden_states[0], torch.arange(9)[None]),
        position_ids=torch.arange(9)[None],
    )
    hidden, logits = model.target_forward(ids)
    torch.testing.assert_close(out.hidden_states[-1], model.target.model.norm(pre_norm))
    torch.testing.assert_close(out.hidden_states[-1], hidden)
    torch.testing.assert_close(out.logits, logits)


def test_mtp_step0_is_the_deepseek_formula_at_position_p_plus_1():
    model = tiny_model()
    mtp, embed, rotary = model.mtp, model.target.model.embed_tokens, model.target.model.rotary_emb
    ids = torch.randint(2, 97, (2, 8))
    hidden, _ = model.target_forward(ids)
    got = model.mtp_unroll(hidden[:, :-1]).step(ids[:, 1:])  # [2, 7, 32]
    x = mtp.eh_proj(torch.cat([mtp.enorm(embed(ids[:, 1:])), mtp.hnorm(hidden[:, :-1])], dim=-1))
    positions = torch.arange(1, 8)[None]
    mask = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    want = mtp(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, positions))
    torch.testing.assert_close(got, want)
    logits = mtp.shared_head.head(mtp.shared_head.norm(want))
    torch.testing.assert_close(model.mtp.logits(got), logits)


def test_unrolled_step_equals_appending_to_the_step0_kv_cache():
    """Step j at pair p must see the step-0 entries of pairs 0..p, then steps 1..j at p: exactly the
    causal sequence a drafter's KV cache holds when it drafts position j + 1 after pair p."""
    model = tiny_model()
    mtp, embed, rotary = model.mtp, model.target.model.embed_tokens, model.target.model.rotary_emb
    ids = torch.randint(2, 97, (1, 12))
    hidden, _ = model.target_forward(ids[:, :9])
    num_pairs = 8
    unroll = model.mtp_unroll(hidden[:, :num_pairs])
    outs = [unroll.step(ids[:, 1 + j : 1 + j + num_pairs]) for j in range(3)]
    for p in (0, 3, 7):
        x0 = mtp.combine(embed(ids[:, 1 : p + 2]), hidden[:, : p + 1])  # step-0 entries of pairs 0..p
        rows, prev = [x0], outs[0][:, p : p + 1]
        for j in (1, 2):
            rows.append(mtp.combine(embed(ids[:, p + 1 + j : p + 2 + j]), prev))
            seq = torch.cat(rows, dim=1)
            positions = torch.arange(1, seq.shape[1] + 1)[None]
            out = mtp(seq, position_ids=positions, position_embeddings=rotary(seq, positions))
            torch.testing.assert_close(out[:, -1], outs[j][:, p], rtol=1e-5, atol=1e-5)
            prev = out[:, -1:]
