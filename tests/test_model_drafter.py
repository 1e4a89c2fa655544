"""A draft model (draft_model.py): a model of the target's vocabulary drafting as a head does. Greedy output equals
plain decoding through the Python API, the command line, batches, stepping aside and a compiled cycle; with the
target itself as its draft model every draft is accepted (its positions line up with the target's)."""
import json

import pytest
import torch

from batch import generate_batch
from conftest import check_compiled_cycle, expect_error, run_cli
from decode import TreeConfig, generate
from load import load_draft_model, load_target
from sampling import SamplingConfig
from step_aside import StepAside

GREEDY = SamplingConfig()
PROMPTS = ([1, 5, 9, 11, 30], [1, 7, 8, 9, 10, 11, 12, 40, 41, 42])


@pytest.fixture(scope="module")
def target(checkpoints):
    folder, _ = checkpoints("llama2")
    return folder, load_target(folder / "model.pth", "cpu", "fp32", 256)


@pytest.mark.parametrize("tree", [TreeConfig(4, 1, 6), TreeConfig(3, 3, 12)], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["llama2", "qwen2"])
def test_a_draft_model_decodes_as_plain_decoding(checkpoints, target, kind, tree):
    """The target drafted for by itself (every draft the target's own pick: a chain's cycles emit depth + 2 tokens
    but where the generation ends) and by another model of its vocabulary (Qwen2's biases and tied embeddings)."""
    folder, model = target
    draft = load_draft_model(checkpoints(kind)[0], model)
    for prompt in PROMPTS:
        plain = generate(model, prompt, 40, GREEDY)
        spec = generate(model, prompt, 40, GREEDY, draft=draft, tree=tree)
        assert spec.tokens == plain.tokens
        if kind == "llama2" and tree.topk == 1:
            assert set(spec.accept_lengths[:-1]) == {tree.levels}  # depth + 1 drafts and the bonus


def test_a_draft_model_in_a_batch_and_stepping_aside(checkpoints, target):
    folder, model = target
    model.setup_caches(2, 256)
    draft = load_draft_model(checkpoints("qwen2")[0], model)
    draft.setup_caches(256, 2)
    tree = TreeConfig(3, 2, 8)
    alone = [generate(model, p, 30, GREEDY, draft=draft, tree=tree) for p in PROMPTS]
    together = generate_batch(model, list(PROMPTS), 30, GREEDY, draft=draft, tree=tree)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.accept_lengths for r in together] == [r.accept_lengths for r in alone]
    gate = StepAside(retry_after=4, trial_cycles=1, clock=iter(range(0, 10 ** 6, 7)).__next__)
    aside = generate(model, PROMPTS[1], 40, GREEDY, draft=draft, tree=tree, step_aside=gate)
    assert aside.tokens == generate(model, PROMPTS[1], 40, GREEDY).tokens and gate.switches >= 2
    model.setup_caches(1, 256)


@pytest.mark.slow
def test_a_draft_model_compiles_into_one_cycle(target):
    folder, model = target
    assert check_compiled_cycle(model, load_draft_model(folder, model), TreeConfig(4, 1, 6)) == {6}


def test_the_command_line_takes_a_draft_model_and_refuses_another_vocabulary(tmp_path, checkpoints, target):
    folder, _ = target
    base = ["--checkpoint_path", str(folder), "--device", "cpu", "--prompt", "w3 w4 w5 w6", "--max_new_tokens", "30",
            "--step_aside", "off"]
    plain = run_cli(tmp_path, base)
    drafted = run_cli(tmp_path, base + ["--draft_model", str(folder), "--tree_topk", "1"])
    assert drafted["tokens"] == plain["tokens"] and drafted["tau"] > 4
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((checkpoints("qwen2")[0] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    state = torch.load(checkpoints("qwen2")[0] / "model.pth", weights_only=True)
    state = {k: torch.cat([v, v[:4]]) if k in ("tok_embeddings.weight", "output.weight") else v for k, v in state.items()}
    torch.save(state, other / "model.pth")
    expect_error(base + ["--draft_model", str(other)], "must share the target's vocabulary")
    expect_error(base + ["--draft_model", str(folder), "--ngram"], "give one drafter")


def test_a_draft_model_under_split_attention_builds_its_masks_on_the_cycles_ctx_len(target, monkeypatch):
    """Split attention on (EAGLET_SPLIT; forced into eager CPU code here): a draft model's masks are SplitMasks on the
    very ctx_len the cycle passes, a graph input under torch.compile (flex's mask_mod on CUDA can read no tensor made
    inside the graph), standing for the boolean mask of its calls one slot on; decoding stays plain decoding's."""
    import attention
    folder, model = target
    monkeypatch.setattr(attention, "SPLIT_ATTENTION", True)
    monkeypatch.setattr(attention, "SPLIT_EAGER", True)
    draft = load_draft_model(folder, model)
    ctx_len, block = torch.tensor(7), torch.ones(3, 3, dtype=torch.bool).tril()
    mask = draft.context_mask(ctx_len, block)
    assert isinstance(mask, attention.SplitMask) and mask.ctx_len is ctx_len
    assert torch.equal(attention.boolean_mask(mask.ctx_len, mask.block, mask.n_kv),
                       attention.boolean_mask(ctx_len + 1, block, draft.max_seq_length))
    for prompt in PROMPTS:
        spec = generate(model, prompt, 30, GREEDY, draft=draft, tree=TreeConfig(3, 2, 8))
        assert spec.tokens == generate(model, prompt, 30, GREEDY).tokens
