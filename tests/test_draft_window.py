"""A draft head's context window (--draft_window): the head attends to its first sinks and last W context positions,
held to a reference that masks the whole cache by the same rule; the K/V it reads stay that band whatever the
context's length; and decoding stays exact (greedy equals plain, sampling follows the target's law)."""
import pytest
import torch

from attention import boolean_mask
from measure import random_models
from conftest import make_context_pair
from convert_hf_checkpoint import convert
from decode import TreeConfig, catch_up_prompt, generate, prefill
from sampling import SamplingConfig
from load import load_draft, load_target
from model import EagletError, ModelArgs
from block_draft import DFlashDraft

GREEDY = SamplingConfig()
SINKS, WINDOW = 4, 40


def reference_mask(ctx_len, block, sinks, window, n_kv):
    """The whole cache's boolean mask with the context outside the sinks and the last window slots hidden."""
    cols = torch.arange(n_kv)
    hidden = (cols < ctx_len) & (cols >= sinks) & (cols < ctx_len - window)
    return boolean_mask(ctx_len, block, n_kv) & ~hidden


def cycle_outputs(target, draft, prompt, tree):
    """What a head gives a cycle after reading prompt: h_last, then the tree it expands from the root."""
    root, ctx = torch.tensor(7), torch.tensor(len(prompt))
    with torch.no_grad():
        _, features = prefill(target, torch.tensor([prompt]), 0)
        h_last = catch_up_prompt(target, draft, prompt, 0, features, root)
        expanded = tree.expand(target, draft, root, ctx, h_last)
    return h_last, expanded.tokens, expanded.draft_logp


@pytest.mark.parametrize("n", [300, 30])  # a context past the window, and one the window and sinks overlap in
@pytest.mark.parametrize("head, tree", [("eagle", TreeConfig(depth=3, topk=3, total_tokens=12)),
                                        ("dflash", TreeConfig(depth=3, topk=2, total_tokens=8)),
                                        ("peagle", TreeConfig(depth=3, topk=1, total_tokens=5))])
def test_the_window_attends_as_the_whole_cache_masked_to_the_band(head, tree, n):
    """h_last and the drafted tree with the window equal those of the head over the whole cache under the reference
    mask, and, past the window, differ from full attention's (the window did something)."""
    target, draft = random_models("tiny", "cpu", torch.float32, 512, head=head)
    prompt = torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    full = cycle_outputs(target, draft, prompt, tree)
    draft.set_window(WINDOW, SINKS)
    windowed = cycle_outputs(target, draft, prompt, tree)
    draft.window = None
    draft.context_mask = lambda ctx, block: reference_mask(ctx, block, SINKS, WINDOW, draft.max_seq_length)
    reference = cycle_outputs(target, draft, prompt, tree)
    for got, want in zip(windowed, reference):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (n < SINKS + WINDOW) == torch.allclose(windowed[2], full[2], atol=1e-4)


def test_the_head_reads_only_the_band_of_its_cache():
    """An EAGLE head's K/V at a position come from that position's pair alone: overwrite every slot outside the
    band with noise and the windowed head's next outputs do not change (the full head's do)."""
    target, draft = random_models("tiny", "cpu", torch.float32, 512, head="eagle")
    prompt = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    tree = TreeConfig(depth=2, topk=2, total_tokens=6)
    root, ctx = torch.tensor(7), torch.tensor(len(prompt))
    with torch.no_grad():
        _, features = prefill(target, torch.tensor([prompt]), 0)
        draft.set_window(WINDOW, SINKS)
        h_last = catch_up_prompt(target, draft, prompt, 0, features, root)
        before = tree.expand(target, draft, root, ctx, h_last).draft_logp
        draft.kv_cache.kv[..., SINKS:len(prompt) - WINDOW, :] = torch.randn_like(
            draft.kv_cache.kv[..., SINKS:len(prompt) - WINDOW, :])
        after = tree.expand(target, draft, root, ctx, h_last).draft_logp
        draft.window = None
        full = tree.expand(target, draft, root, ctx, h_last).draft_logp
    torch.testing.assert_close(after, before)
    assert not torch.allclose(full, before, atol=1e-4)


def test_a_windowed_call_reads_the_same_keys_at_any_context_length():
    """The head's attention takes sinks + window + its own slots of K/V, at a context of 100 or of 3,000."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class KeyLengths(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.lengths = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in str(func):
                self.lengths.add(args[1].shape[-2])
            return func(*args, **(kwargs or {}))

    target, draft = random_models("tiny", "cpu", torch.float32, 4096, head="eagle")
    draft.set_window(WINDOW, SINKS)
    tree = TreeConfig(depth=2, topk=2, total_tokens=6)
    seen = {}
    for n in (100, 3000):
        prompt = torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        with torch.no_grad():
            _, features = prefill(target, torch.tensor([prompt]), 0)
            h_last = catch_up_prompt(target, draft, prompt, 0, features, torch.tensor(7))
            with KeyLengths() as keys:
                tree.expand(target, draft, torch.tensor(7), torch.tensor(n), h_last)
        seen[n] = keys.lengths
    assert seen[100] == seen[3000] == {SINKS + WINDOW + tree.depth * tree.topk}


@pytest.fixture(scope="module")
def context_heads(tmp_path_factory):
    """A target whose next token depends on the tokens before it, and EAGLE-1/2 and EAGLE-3 heads that follow it."""
    target, head, head3 = make_context_pair(tmp_path_factory.mktemp("window"), noise=0.3)
    for folder in (target, head, head3):
        convert(folder, log=lambda *_: None)
    return target, head, head3


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_with_a_window_equals_plain(context_heads, kind):
    target_dir, head, head3 = context_heads
    model = load_target(target_dir / "model.pth", "cpu", "fp32", 400)
    draft = load_draft((head if kind == "eagle" else head3) / "draft.pth", model)
    prompt = [1] + torch.randint(3, 60, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    plain = generate(model, prompt, 40, GREEDY)
    tree = TreeConfig(depth=3, topk=3, total_tokens=10)
    for window in (None, 8, 64):
        draft.set_window(window, 2)
        run = generate(model, prompt, 40, GREEDY, draft=draft, tree=tree, prefill_chunk=32)
        assert run.tokens == plain.tokens, window


@pytest.mark.stat
def test_sampling_with_a_window_follows_the_target_distribution(tmp_path):
    """The window covers one sink and one recent position of the 3-token prompt: the drafts change, the law does not."""
    from conftest import sampling_pair
    from test_sampling import TREE, VOCAB, check_sampled_sequences
    target, model, draft = sampling_pair(tmp_path, VOCAB)
    draft.set_window(1, 1)
    check_sampled_sequences(target, model, draft, TREE)


@pytest.mark.parametrize("window, sinks, match", [(0, 4, "positive whole number"), (-2, 4, "positive whole number"),
                                                  (2.5, 4, "positive whole number"), ("64", 4, "positive whole number"),
                                                  (True, 4, "positive whole number"), (8, -1, "non-negative"),
                                                  (600, 4, "larger than the cache")])
def test_a_bad_window_is_one_error(window, sinks, match):
    _, draft = random_models("tiny", "cpu", torch.float32, 512, head="eagle")
    with pytest.raises(EagletError, match=match):
        draft.set_window(window, sinks)


def test_a_head_trained_with_a_sliding_window_drafts_with_it():
    args = ModelArgs(vocab_size=64, dim=32, n_layer=1, n_head=2, intermediate_size=64, sliding_window=256)
    assert DFlashDraft(args, n_features=2, block_size=4, mask_token_id=3).window == (0, 256)


def test_auto_is_the_head_s_own_window_else_2048_where_the_cache_is_longer():
    from load import set_window
    _, draft = random_models("tiny", "cpu", torch.float32, 4096, head="eagle")
    for flag, sinks, want in (("auto", 4, (4, 2048)), ("full", 4, None), (100, 2, (2, 100)), ("auto", 0, (2, 100))):
        set_window(draft, flag, sinks)  # auto keeps a window already set (a head's own, from its config)
        assert draft.window == want, flag
    _, short = random_models("tiny", "cpu", torch.float32, 1024, head="eagle")
    set_window(short, "auto", 4)
    assert short.window is None  # the whole cache is within the window
