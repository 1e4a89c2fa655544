"""The target's logits are made in one place, Transformer.logits: a final transform added there (Gemma-2's
soft-capping, in this test only) reaches the target's own logits, a head's draft scores over the whole or a
draft vocabulary, a DFlash block's scores, and head training's losses."""
import torch

from attention import causal_mask
import model as model_module
import train_draft
from conftest import ROOT
from load import load_draft, load_target

CAP = 2.0
DEMO = ROOT / "demo"


def soft_capped(monkeypatch) -> list:
    """Transformer.logits with a soft-cap at CAP after the lm_head; returns the list of hidden shapes it saw."""
    plain, seen = model_module.Transformer.logits, []

    def capped(self, hidden, rows=None):
        seen.append(tuple(hidden.shape))
        return CAP * torch.tanh(plain(self, hidden, rows) / CAP)
    monkeypatch.setattr(model_module.Transformer, "logits", capped)
    return seen


@torch.no_grad()
def test_a_transform_in_transformer_logits_reaches_the_target_and_the_heads(monkeypatch):
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32", 64)
    head, dflash = load_draft(DEMO / "head" / "draft.pth", target), load_draft(DEMO / "dflash" / "draft.pth", target)
    tokens, pos = torch.tensor([[1, 300, 400, 500, 600]]), torch.arange(5)
    raw, _ = target(tokens, pos, pos, causal_mask(pos, 64))
    h = torch.randn(3, target.args.dim)
    raw_head, raw_rows = head.logits(target, h), None
    seen = soft_capped(monkeypatch)
    logits, _ = target(tokens, pos, pos, causal_mask(pos, 64))
    assert torch.allclose(logits, CAP * torch.tanh(raw / CAP)) and logits.abs().max() <= CAP
    assert raw.abs().max() > 3 * CAP  # the cap changed something
    assert torch.allclose(head.logits(target, h), CAP * torch.tanh(raw_head / CAP))  # EAGLE's draft scores
    logp, _ = head.topk(target, h, 4)
    assert torch.allclose(logp, torch.log_softmax(CAP * torch.tanh(raw_head / CAP), -1).topk(4).values, atol=1e-6)
    assert dflash.logits(target, h).abs().max() <= CAP  # a DFlash block's scores
    head.restrict_vocab(target, torch.arange(100))  # a draft vocabulary's rows of the lm_head
    assert torch.allclose(head.logits(target, h), CAP * torch.tanh(raw_head[:, :100] / CAP), atol=1e-6)
    assert (3, target.args.dim) in seen


def test_head_training_losses_see_it(monkeypatch):
    target = load_target(DEMO / "target" / "model.pth", "cpu", "fp32")
    head, dflash = load_draft(DEMO / "head" / "draft.pth", target), load_draft(DEMO / "dflash" / "draft.pth", target)
    target.setup_rope(64)
    head.setup_rope(64)
    dflash.setup_rope(64)
    torch.manual_seed(0)
    tokens, mask = torch.randint(3, 4000, (2, 48)), torch.ones(2, 48)
    cfg = train_draft.TrainConfig(noise=0.0, anchors=4)

    def losses():
        out = []
        for drafter, loss in ((head, train_draft.head_loss), (dflash, train_draft.dflash_loss)):
            target.set_feature_layers(drafter.feature_layers)  # as training sets them for its head
            torch.manual_seed(0)
            out.append(loss(drafter, target, tokens, mask, cfg)[0])
        return out
    before = losses()
    seen = soft_capped(monkeypatch)
    after = losses()
    assert all(abs(a.item() - b.item()) > 1e-3 for a, b in zip(before, after))
    assert (2, 47, target.args.dim) in seen  # the EAGLE head's outputs scored through it, not only the target's
