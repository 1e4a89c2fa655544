"""train_draft.py --head dflash, dspark, dflash2 and xpress: the training forward is the decode-time block pass (each anchor's block sees
only the context before its anchor), training raises agreement, the CLI writes the published layout, resumes,
and the head it makes decodes losslessly; its mistakes are refused."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tokenizer import Tokenizer
import train_draft
import train_data
from conftest import cli_plain_and_speculative, expect_error
from convert_hf_checkpoint import convert
from decode import catch_up
from block_draft import DFlash2Draft, DFlashDraft, XPressDraft
from load import load_draft, load_target
from test_train_eagle3 import corpus


def fresh_head(target, block_size=4, draft_layers=2, feature_layers=(2, 5), kind="dflash"):
    cfg = train_draft.TrainConfig(block_size=block_size, draft_layers=draft_layers, seed=3, markov_rank=8)
    head, loss_fn, config = train_draft.make_head(kind, target, [], cfg, feature_layers)
    with torch.no_grad():  # norms away from one, so that a norm applied in the wrong place shows
        for name, p in head.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.15)
    target.set_feature_layers(head.feature_layers)
    return head, cfg


@pytest.mark.parametrize("block_size, kind", [(4, "dflash"), (7, "dflash"), (4, "dspark"), (4, "dflash2"),
                                              (4, "xpress")])
def test_training_forward_is_the_decode_time_block(checkpoints, block_size, kind):
    """dflash_blocks over a whole sequence, anchors anywhere (also 0 and the last position), gives for each anchor a
    what block_states gives at decode time after catch_up wrote the context of positions 0..a-1."""
    target_dir, _ = checkpoints("llama8")
    target = load_target(target_dir / "model.pth", "cpu", "fp32")
    head, cfg = fresh_head(target, block_size, kind=kind)
    tokens = torch.randint(4, 96, (2, 21), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[0, 5, 12, 20], [3, 9, 1, 17]])
    seq = tokens.shape[1]
    target.setup_rope(64)
    head.setup_rope(64)
    with torch.no_grad():  # training: no caches
        _, features = target(tokens, torch.arange(seq), None, train_draft.causal(seq, "cpu"))
        trained = train_draft.dflash_blocks(head, target, tokens, features, anchors)
    head.setup_caches(64)  # decode time: the head's cache
    with torch.no_grad():
        for row in range(2):
            for j, a in enumerate(anchors[row].tolist()):
                if a:
                    catch_up(target, head, tokens[row, 1:a + 1], features[row, :a], torch.tensor(0), torch.tensor(a - 1))
                decoded = head.block_states(target, tokens[row, a], torch.tensor(a), head.max_levels)
                torch.testing.assert_close(trained[row, j, head.first_row:], decoded, atol=1e-5, rtol=1e-5)


def test_block_position_k_learns_the_target_s_pick_for_anchor_plus_k():
    picks = torch.arange(20)[None] * 10  # picks[t]: the target's next token after t, here 10 t
    mask = torch.ones(1, 20)
    mask[0, 8] = 0  # a position the loss does not count
    want, counts = train_draft.dflash_labels(picks, mask, torch.tensor([[0, 5, 17]]), torch.tensor([[True, True, False]]), 3)
    assert want[0].tolist() == [[0, 10, 20], [50, 60, 70], [170, 180, 180]]  # the last clamped: past the end
    assert counts[0].tolist() == [[True, True, True], [True, True, False], [False, False, False]]


def train_a_head(checkpoints, tmp_path, kind: str, **settings):
    """A head of this kind trained 60 steps on llama8 over a small corpus: (target, cfg, untrained, trained, a
    held-out batch)."""
    target_dir, _ = checkpoints("llama8")
    target = load_target(target_dir / "model.pth", "cpu", "fp32")
    tokenizer = Tokenizer(target_dir)
    text = tokenizer.encode(corpus(tmp_path / "corpus.txt", n_words=3000).read_text(), bos=False)
    examples = [(text[i:i + 48], [1] * 48) for i in range(0, len(text) - 48, 48)]
    for layer in target.layers:
        layer.attention.kv_cache = None
    cfg = train_draft.TrainConfig(steps=60, batch_size=8, seq_len=48, lr=3e-3, warmup=5, block_size=4, draft_layers=1,
                                  anchors=8, **settings)
    untrained, _, _ = train_draft.make_head(kind, target, examples, cfg)
    untrained.setup_rope(64)
    trained = train_draft.train(target, examples, tmp_path / "head", cfg, kind=kind, log=lambda *_: None)
    return target, cfg, untrained, trained, next(train_data.batches(examples, 16, cfg.seq_len, 0, seed=5))


def losses(target, cfg, heads, batch) -> list:
    """dflash_loss of each head on the same batch and anchors: [(loss, top-1 agreement per draft)]."""
    out = []
    with torch.no_grad():
        for head in heads:
            torch.manual_seed(0)
            out.append(train_draft.dflash_loss(head, target, *batch, cfg))
    return out


def test_training_raises_agreement_at_every_block_position(checkpoints, tmp_path):
    target, cfg, untrained, trained, batch = train_a_head(checkpoints, tmp_path, "dflash")
    (before, agree_before), (after, agree_after) = losses(target, cfg, [untrained, trained], batch)
    print(f"loss {before:.3f} -> {after:.3f}; top-1 {agree_before.tolist()} -> {agree_after.tolist()}")
    assert after < before - 0.5 and (agree_after > agree_before + 0.1).all()


@pytest.mark.slow
def test_cli_trains_resumes_converts_and_decodes_losslessly(checkpoints, tmp_path, capsys):
    target_dir, _ = checkpoints("llama8")
    text, out = corpus(tmp_path / "corpus.txt"), tmp_path / "dflash"
    argv = ["--checkpoint_path", str(target_dir / "model.pth"), "--data", str(text), "--out_dir", str(out),
            "--head", "dflash", "--feature_layers", "2", "5", "7", "--draft_layers", "2", "--block_size", "5",
            "--mask_token_id", "3", "--device", "cpu", "--batch_size", "4", "--seq_len", "32", "--anchors", "6",
            "--save_every", "4", "--lr", "3e-3"]
    train_draft.main(argv + ["--steps", "4"])
    train_draft.main(argv + ["--steps", "12"])
    printed = capsys.readouterr().out
    assert "resuming at step 4" in printed and "top-1 agreement at drafts 1-4 " in printed
    weights, config = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.1.mlp.down_proj.weight"} <= set(weights) and not any(k.startswith("model.") for k in weights)
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 5
    assert config["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 4, 6]}  # ids: layer outputs
    assert weights["fc.weight"].shape == (64, 3 * 64)
    convert(out)
    plain, spec = cli_plain_and_speculative(target_dir, out / "draft.pth", tmp_path)
    assert spec["tokens"] == plain["tokens"] and spec["cycles"] > 0
    assert "tree 5 tokens, depth 3, top-k 1" in capsys.readouterr().out  # the chain of the head's own block
    draft = load_draft(out / "draft.pth", load_target(target_dir / "model.pth", "cpu", "fp32", 64))
    assert isinstance(draft, DFlashDraft) and draft.feature_layers == (2, 5, 7) and draft.mask_token_id == 3


def test_errors(checkpoints, tmp_path):
    target_dir, _ = checkpoints("llama8")
    text = corpus(tmp_path / "corpus.txt", n_words=200)
    base = ["--checkpoint_path", str(target_dir / "model.pth"), "--data", str(text), "--device", "cpu",
            "--steps", "1", "--batch_size", "2", "--seq_len", "16", "--out_dir", str(tmp_path / "h")]
    dflash = base + ["--head", "dflash"]
    expect_error(dflash + ["--feature_layers", "2", "8"], "a DFlash head reads the inputs of layers 1..7",
                 main=train_draft.main)
    expect_error(dflash + ["--mask_token_id", "96"], "--mask_token_id 96 is not below the target's vocabulary (96)",
                 main=train_draft.main)
    expect_error(dflash + ["--block_size", "1"], "block_size must be at least 2", main=train_draft.main)
    expect_error(dflash + ["--draft_vocab_size", "32"], "a block drafter scores the whole", main=train_draft.main)
    expect_error(base + ["--block_size", "8"], "--block_size is for block drafters", main=train_draft.main)
    expect_error(dflash + ["--markov_rank", "8"], "--markov_rank is for DSpark heads (--head dspark)",
                 main=train_draft.main)
    expect_error(base + ["--head", "dspark", "--markov_rank", "0"], "markov_rank must be at least 1",
                 main=train_draft.main)


def test_dspark_training_raises_agreement_and_its_markov_loss_sees_the_token_before(checkpoints, tmp_path):
    """A DSpark head's loss: row j's logits plus the Markov bias of the token before draft j (the anchor, then the
    target's own picks); training lowers it and raises the top-1 agreement at every row, the anchor's included."""
    target, cfg, untrained, trained, batch = train_a_head(checkpoints, tmp_path, "dspark", markov_rank=16)
    (before, agree_before), (after, agree_after) = losses(target, cfg, [untrained, trained], batch)
    assert len(agree_after) == 4  # every row drafts: block_size drafts
    with torch.no_grad():
        trained.markov_head.markov_w2.weight.zero_()
    (blind, _), = losses(target, cfg, [trained], batch)
    print(f"loss {before:.3f} -> {after:.3f} (without the Markov bias {blind:.3f}); top-1 {agree_before.tolist()} -> "
          f"{agree_after.tolist()}")
    assert after < before - 0.5 and (agree_after > agree_before + 0.1).all()
    assert blind > after + 0.01  # the Markov head carries some of what it learned


@pytest.mark.slow
def test_cli_trains_a_dspark_head_in_deepspec_s_layout_that_decodes_losslessly(checkpoints, tmp_path, capsys):
    target_dir, hf = checkpoints("llama8")
    text, out = corpus(tmp_path / "corpus.txt"), tmp_path / "dspark"
    train_draft.main(["--checkpoint_path", str(target_dir / "model.pth"), "--data", str(text), "--out_dir", str(out),
                      "--head", "dspark", "--draft_layers", "1", "--block_size", "4", "--markov_rank", "8",
                      "--mask_token_id", "3", "--device", "cpu", "--batch_size", "4", "--seq_len", "32",
                      "--anchors", "6", "--steps", "6", "--lr", "3e-3"])
    assert "top-1 agreement at drafts 1-4 " in capsys.readouterr().out
    weights, config = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 4
    assert config["markov_rank"] == 8 and config["mask_token_id"] == 3 and "dflash_config" not in config
    assert weights["markov_head.markov_w1.weight"].shape == (96, 8) and weights["confidence_head.proj.weight"].shape == (1, 72)
    assert torch.equal(weights["lm_head.weight"], hf.lm_head.weight.detach())  # the frozen copies, as published
    assert torch.equal(weights["embed_tokens.weight"], hf.model.embed_tokens.weight.detach())
    convert(out)
    plain, spec = cli_plain_and_speculative(target_dir, out / "draft.pth", tmp_path)
    assert spec["tokens"] == plain["tokens"] and spec["cycles"] > 0
    assert "tree 5 tokens, depth 3, top-k 1" in capsys.readouterr().out  # the chain of its block: 4 drafts


def test_dspark_loss_scores_each_draft_after_the_token_before_it(checkpoints):
    """In the DSpark loss, draft j's Markov state is the token at anchor + j: the anchor itself for j = 0, then the
    target's own pick for that position (what an accepted prefix holds), never the token draft j is to learn."""
    target_dir, _ = checkpoints("llama8")
    target = load_target(target_dir / "model.pth", "cpu", "fp32")
    for layer in target.layers:
        layer.attention.kv_cache = None
    head, cfg = fresh_head(target, 4, kind="dspark")
    target.setup_rope(64)
    head.setup_rope(64)
    tokens, mask = torch.randint(4, 96, (2, 24), generator=torch.Generator().manual_seed(1)), torch.ones(2, 24)
    seen, next_logits = [], head.next_logits
    head.next_logits = lambda rows, prev, state: seen.append(prev.clone()) or next_logits(rows, prev, state)
    with torch.no_grad():
        torch.manual_seed(0)
        train_draft.dflash_loss(head, target, tokens, mask, cfg)
        torch.manual_seed(0)
        anchors, _ = train_draft.dflash_anchors(mask, cfg.anchors)
        picks = target(tokens, torch.arange(24), None, train_draft.causal(24, "cpu"))[0].argmax(-1)
    prev = seen[0]  # [B, anchors, 4]
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            want = [int(tokens[b, a])] + [int(picks[b, min(a + j - 1, 22)]) for j in range(1, 4)]
            assert prev[b, i].tolist() == want


def test_dflash2_training_raises_agreement_and_its_selector_learns(checkpoints, tmp_path):
    """A DFlash2 head's loss: DFlash's, plus the selector's cross-entropy over each draft's top-k after the token
    before it; training lowers it and raises the top-1 agreement (the selector's pick) at every draft; the
    convolutions leave the identity."""
    target, cfg, untrained, trained, batch = train_a_head(checkpoints, tmp_path, "dflash2", selector_rank=16,
                                                          selector_top_k=8)
    assert isinstance(trained, DFlash2Draft) and trained.candidate_selector.top_k == 8
    (before, agree_before), (after, agree_after) = losses(target, cfg, [untrained, trained], batch)
    print(f"loss {before:.3f} -> {after:.3f}; top-1 {agree_before.tolist()} -> {agree_after.tolist()}")
    assert after < before - 0.5 and (agree_after > agree_before + 0.1).all()
    assert trained.layers[0].attention_conv.kernel_projection.weight.abs().max() > 0
    with torch.no_grad():  # the selector's part of the loss: scored after the token before each draft
        trained.candidate_selector.successor_codebook.zero_()
    (blind, _), = losses(target, cfg, [trained], batch)
    assert blind > after  # the selector's score carries something it learned (a little, in 60 steps)


@pytest.mark.slow
def test_cli_trains_a_dflash2_head_in_speculators_layout_that_decodes_losslessly(checkpoints, tmp_path, capsys):
    target_dir, _ = checkpoints("llama8")
    text, out = corpus(tmp_path / "corpus.txt"), tmp_path / "dflash2"
    train_draft.main(["--checkpoint_path", str(target_dir / "model.pth"), "--data", str(text), "--out_dir", str(out),
                      "--head", "dflash2", "--draft_layers", "1", "--block_size", "4", "--selector_rank", "8",
                      "--selector_top_k", "6", "--mask_token_id", "3", "--device", "cpu", "--batch_size", "4",
                      "--seq_len", "32", "--anchors", "6", "--steps", "6", "--lr", "3e-3"])
    assert "top-1 agreement at drafts 1-3 " in capsys.readouterr().out
    weights, config = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["sample_from_anchor"] is False
    assert config["selector_top_k"] == 6 and config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert weights["candidate_selector.predecessor_codebook"].shape == (96, 8)
    assert weights["layers.0.mlp_conv.base_kernel"].shape == (2, 2, 64)
    speculators = pytest.importorskip("speculators", reason="speculators (the layout's own reader) is not installed")
    from speculators.models.dflash2 import DFlash2DraftModel  # speculators reads what was written, every weight
    missing = DFlash2DraftModel.from_pretrained(str(out), output_loading_info=True)[1]["missing_keys"]
    assert not [k for k in missing if not k.startswith(("embed_tokens", "lm_head", "verifier"))], speculators
    convert(out)
    plain, spec = cli_plain_and_speculative(target_dir, out / "draft.pth", tmp_path)
    assert spec["tokens"] == plain["tokens"] and spec["cycles"] > 0
    assert "tree 4 tokens, depth 2, top-k 1" in capsys.readouterr().out  # the chain of its block: 3 drafts


def test_xpress_training_raises_agreement_and_its_refiner_learns(checkpoints, tmp_path):
    """An XPress head's loss: the refined logits teacher-forced (the target's picks before each row), the block's
    own logits and a Jacobi round beside them; training lowers it and raises the agreement of the drafts decoding
    would make (the last round's) at every draft, and the refiner carries some of it."""
    target, cfg, untrained, trained, batch = train_a_head(checkpoints, tmp_path, "xpress", xpress_rank=16)
    assert isinstance(trained, XPressDraft) and trained.jacobi_passes == 6
    (before, agree_before), (after, agree_after) = losses(target, cfg, [untrained, trained], batch)
    print(f"loss {before:.3f} -> {after:.3f}; top-1 {agree_before.tolist()} -> {agree_after.tolist()}")
    assert after < before - 0.5 and (agree_after > agree_before + 0.1).all()
    with torch.no_grad():
        trained.refiner_head.readout.weight.zero_()
    (blind, _), = losses(target, cfg, [trained], batch)
    assert blind > after


def test_xpress_teacher_tokens_are_the_ones_before_each_row(checkpoints):
    """In the XPress loss the token before row k is the token before the anchor (the anchor itself at position 0)
    for the anchor row, the anchor for row 1, then the target's own picks; a Jacobi round after the block's picks."""
    target_dir, _ = checkpoints("llama8")
    target = load_target(target_dir / "model.pth", "cpu", "fp32")
    for layer in target.layers:
        layer.attention.kv_cache = None
    head, cfg = fresh_head(target, 4, kind="xpress")
    target.setup_rope(64)
    head.setup_rope(64)
    tokens, mask = torch.randint(4, 96, (2, 24), generator=torch.Generator().manual_seed(1)), torch.ones(2, 24)
    seen, refiner = [], head.refiner_head.forward
    head.refiner_head.forward = lambda prev, states: seen.append(prev.clone()) or refiner(prev, states)
    with torch.no_grad():
        torch.manual_seed(0)
        train_draft.dflash_loss(head, target, tokens, mask, cfg)
        torch.manual_seed(0)
        anchors, _ = train_draft.dflash_anchors(mask, cfg.anchors)
        picks = target(tokens, torch.arange(24), None, train_draft.causal(24, "cpu"))[0].argmax(-1)
    teacher = seen[0]
    for row in range(2):
        for j, a in enumerate(anchors[row].tolist()):
            want = [int(tokens[row, a - 1]) if a else int(tokens[row, a]), int(tokens[row, a])] + \
                [int(picks[row, min(a + k, 22)]) for k in range(2)]
            assert teacher[row, j].tolist() == want
    assert len(seen) == 4 and all(torch.equal(s[..., :2], teacher[..., :2]) for s in seen[1:])


@pytest.mark.slow
def test_cli_trains_an_xpress_head_in_speculators_layout_that_decodes_losslessly(checkpoints, tmp_path, capsys):
    target_dir, _ = checkpoints("llama8")
    text, out = corpus(tmp_path / "corpus.txt"), tmp_path / "xpress"
    train_draft.main(["--checkpoint_path", str(target_dir / "model.pth"), "--data", str(text), "--out_dir", str(out),
                      "--head", "xpress", "--draft_layers", "1", "--block_size", "4", "--xpress_rank", "8",
                      "--mask_token_id", "3", "--device", "cpu", "--batch_size", "4", "--seq_len", "32",
                      "--anchors", "6", "--steps", "6", "--lr", "3e-3"])
    assert "top-1 agreement at drafts 1-3 " in capsys.readouterr().out
    weights, config = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "xpress" and config["num_jacobi_passes"] == 6
    assert weights["refiner_head.mix_l"].shape == (8, 4, 4) and weights["refiner_head.readout.weight"].shape == (96, 8)
    pytest.importorskip("speculators", reason="speculators (the layout's own reader) is not installed")
    from speculators.models.xpress import XPressDraftModel  # speculators reads what was written, every weight
    missing = XPressDraftModel.from_pretrained(str(out), output_loading_info=True)[1]["missing_keys"]
    assert not [k for k in missing if not k.startswith(("embed_tokens", "lm_head", "verifier"))]
    convert(out)
    plain, spec = cli_plain_and_speculative(target_dir, out / "draft.pth", tmp_path)
    assert spec["tokens"] == plain["tokens"] and spec["cycles"] > 0


def test_dflash2_selector_loss_labels_the_target_s_pick_among_the_top_k(checkpoints):
    """The selector's cross-entropy is over the head's top-k by its own logits, labelled where the target's pick
    sits among them; a pick outside them takes the last place."""
    target_dir, _ = checkpoints("llama8")
    target = load_target(target_dir / "model.pth", "cpu", "fp32")
    head, _ = fresh_head(target, 4, kind="dflash2")
    g = torch.Generator().manual_seed(2)
    logits, h = torch.randn(1, 2, 96, generator=g), torch.randn(1, 2, 64, generator=g)
    prev, order = torch.tensor([[5, 9]]), logits.argsort(-1, descending=True)
    want = torch.stack([order[0, 0, 3], order[0, 1, 50]])[None]  # rank 3 of row 0; outside row 1's top 16
    with torch.no_grad():
        ce, _ = train_draft.selector_loss(head, logits, prev, h, want)
        top = order[..., :16].clone()
        top[0, 1, -1] = want[0, 1]
        scores = head.candidate_selector.score(logits, prev, h, top)
    expected = [-torch.log_softmax(scores[0, 0], -1)[3], -torch.log_softmax(scores[0, 1], -1)[15]]
    torch.testing.assert_close(ce[0], torch.stack(expected))
