"""Seeded bugs: each one applied alone to a temporary copy of the repository, then the tests run on it. A bug
no test catches is a hole in the tests. After changing the cycle, run this to see that the tests still
watch what you changed; after adding a feature, add its likely bugs to MUTANTS.

    python scripts/mutants.py                  # every bug: the fast tier, then the slow tier if it passed; 2 jobs
    python scripts/mutants.py --only catch-up  # the bugs whose name contains this
    python scripts/mutants.py --fast_only      # the fast tier only (pytest -m "not slow")
    python scripts/mutants.py --full           # the whole suite at once for each bug

Prints, per bug, the first test that failed and its tier (or SURVIVED), and exits non-zero if any bug survived.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutant:
    name: str  # area: what is wrong
    path: str  # file, from the repository root
    old: str  # text found exactly once in the file
    new: str


M = Mutant
MUTANTS = [
    # accept and commit
    M("accept: a child compared with its own pick, not its parent's", "decode.py",
      "correct = (tree.tokens == pick.gather(-1, tree.parents))", "correct = (tree.tokens == pick)"),
    M("accept: a node accepted though an ancestor was rejected", "decode.py",
      "accepted = (tree.ancestors & ~correct[..., None, :]).sum(dim=-1) == 0", "accepted = correct"),
    M("accept: the shallowest accepted node ends the path", "decode.py",
      "best = torch.where(accepted, tree.depths, -1).argmax(dim=-1, keepdim=True)",
      "best = torch.where(accepted, -tree.depths, -99).argmax(dim=-1, keepdim=True)"),
    M("accept: the bonus is the root's pick", "decode.py",
      "pick.gather(-1, best)[..., 0]", "pick[..., :1][..., 0]"),
    M("accept: greedy acceptance when sampling", "decode.py",
      "pick = sample(penalize(logits, sampling, tree.tokens, tree.ancestors, tree.depths), sampling)  # [N]", "pick = logits.argmax(dim=-1)"),
    M("commit: the bonus one step late", "decode.py",
      "emitted = torch.where(steps == n_accepted[..., None],", "emitted = torch.where(steps == n_accepted[..., None] + 1,"),
    M("commit: emits the path's own tokens (root first)", "decode.py",
      "tree.tokens.gather(-1, path.roll(-1, -1))", "tree.tokens.gather(-1, path)"),
    M("generate: tokens after an EOS inside an accepted path are emitted", "decode.py",
      "        if t in eos_ids or len(tokens) == max_new_tokens:\n            break",
      "        if len(tokens) == max_new_tokens:\n            break"),
    M("generate: a cycle cut at EOS still counts all its tokens", "decode.py",
      "accept_lengths.append(len(tokens) - n_before)", "accept_lengths.append(len(new))"),
    # long prompts: chunked prefill, the draft window, stepping aside
    M("prefill: a chunk does not see the chunks before it", "decode.py",
      "mask = causal_mask(input_pos, start_pos + e)  # eager",
      "mask = causal_mask(input_pos, start_pos + e) & (torch.arange(start_pos + e) >= start_pos + s)  # eager"),
    M("prefill: the head pairs a chunk's features with their own tokens", "decode.py",
      "new_tokens[0, offset + 1:offset + 1 + features.shape[1]]", "new_tokens[0, offset:offset + features.shape[1]]"),
    M("window: a sink seen twice where the window reaches it", "attention.py",
      "(recent >= mask.sinks) & (recent < ctx)", "(recent >= 0) & (recent < ctx)"),
    M("window: the recent band one slot early", "attention.py",
      "recent = ctx - mask.window + torch.arange", "recent = ctx - mask.window - 1 + torch.arange"),
    M("step aside: cycles resume with the head reading only the last plain token", "step_aside.py",
      "head_reads((prompt + tokens)[:ctx], head_at, root)", "head_reads((prompt + tokens)[:ctx], ctx - 1, root)"),
    M("step aside: trials ignore their share of the time", "step_aside.py",
      "elif not self.probing and self.tokens_until_affordable() > 0:",
      "elif False:"),
    M("step aside: judged with no plain step timed", "step_aside.py",
      "if timed < self.trial_cycles or (self.step_seconds and self.pays()):",
      "if timed < self.trial_cycles or self.pays():"),
    # masks
    M("mask: the verify hides a node's grandparents", "decode.py",
      "attention_mask(ctx_len, tree.ancestors, target.max_seq_length))",
      "attention_mask(ctx_len, tree.ancestors & (tree.depths[:, None] - tree.depths[None] <= 1), "
      "target.max_seq_length))"),
    M("mask: the verify shows a node its siblings", "decode.py",
      "attention_mask(ctx_len, tree.ancestors, target.max_seq_length))",
      "attention_mask(ctx_len, tree.ancestors | (tree.parents[:, None] == tree.parents[None]), "
      "target.max_seq_length))"),
    M("mask: the last context slot is hidden", "attention.py",
      "return (cols < ctx_len) | (block", "return (cols < ctx_len - 1) | (block"),
    M("mask: prefill and catch-up see the future", "attention.py",
      "torch.ones(n, n, dtype=torch.bool, device=input_pos.device).tril()",
      "torch.ones(n, n, dtype=torch.bool, device=input_pos.device)"),
    M("mask: a draft frontier node sees its cousins", "draft_tree.py",
      "anc[..., slots] |= torch.eye(topk, dtype=torch.bool, device=device)", "anc[..., slots] = True"),
    M("mask: the frontier keeps its old ancestors after the rerank of a level", "draft_tree.py",
      "tokens, features, anc = child_tokens.flatten(-2).gather(-1, best), take(h, parent), take(anc, parent)",
      "tokens, features = child_tokens.flatten(-2).gather(-1, best), take(h, parent)"),
    # positions
    M("positions: tree tokens at their slot, not their depth", "decode.py",
      "start + tree.depths, start + torch.arange(n, device=ctx_len.device),",
      "start + torch.arange(n, device=ctx_len.device), start + torch.arange(n, device=ctx_len.device),"),
    M("positions: every draft level at the root's position", "draft_tree.py",
      "(start + i).expand_as(tokens)", "start.expand_as(tokens)"),
    M("positions: the catch-up one slot late", "draft.py",
      "pos = ctx_len[..., None] + torch.arange(tokens.shape[-1], device=ctx_len.device)\n        causal",
      "pos = ctx_len[..., None] + 1 + torch.arange(tokens.shape[-1], device=ctx_len.device)\n        causal"),
    M("positions: a reused prefix's continuation restarts at 0", "decode.py",
      "input_pos = torch.arange(start_pos + s, start_pos + e, device=tokens.device)",
      "input_pos = torch.arange(s, e, device=tokens.device)"),
    # compaction
    M("compaction: source and destination swapped", "decode.py",
      "target.compact_kv(start + path, start + steps)", "target.compact_kv(start + steps, start + path)"),
    M("compaction: only the keys moved", "model.py",
      "kv.index_copy_(4, dst_slots, kv.index_select(4, src_slots))",
      "kv[:, :1].index_copy_(4, dst_slots, kv[:, :1].index_select(4, src_slots))"),
    M("K/V write: through a view of the shared buffer (the same values; compiled, a copy of all of it per layer)",
      "model.py", "kv.index_put_((layer, k_or_v, rows, heads, slots), torch.stack([k, v]))",
      "kv[self.index].index_put_((k_or_v, rows, heads, slots), torch.stack([k, v]))"),
    M("draft top-k: scores not normalised (raw logits rank the tree)", "draft.py",
      "logp = values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)", "logp = values.float()"),
    # split attention (EAGLET_SPLIT)
    M("split attention: the block's own slots read one slot late", "attention.py",
      "slots = ctx_len[:, None] + torch.arange(mask.block.shape[-1], device=q.device)  # [B, W]",
      "slots = ctx_len[:, None] + 1 + torch.arange(mask.block.shape[-1], device=q.device)  # [B, W]"),
    M("split attention: the two parts merged with equal weight", "attention.py",
      "weight_a, weight_b = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]",
      "weight_a, weight_b = torch.ones_like(lse_a)[..., None], torch.ones_like(lse_b)[..., None]"),
    M("split attention: the context's mask_mod sees its last slot too", "attention.py",
      "return kv_idx < (ctx_len if ctx_len.ndim == 0 else ctx_len[b])",
      "return kv_idx <= (ctx_len if ctx_len.ndim == 0 else ctx_len[b])"),
    # running ahead
    M("run ahead: the queued call's context not advanced (eager attention misses the newest slot)", "decode.py",
      "queued = call(state, ctx + widest)", "queued = call(state, ctx)"),
    M("run ahead: never (every call waits for the host)", "decode.py",
      "ahead = (device.type == \"cuda\" and RUN_AHEAD if run_ahead is None else run_ahead) and inputs.history is None",
      "ahead = False"),
    # sampling
    M("sampling: top-p drops the token that crosses it", "sampling.py",
      "drop = (sorted_probs.cumsum(-1) - sorted_probs >= top_p)", "drop = (sorted_probs.cumsum(-1) >= top_p)"),
    M("sampling: temperature ignored", "sampling.py",
      "logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature",
      "logits = logits - logits.amax(dim=-1, keepdim=True)"),
    M("sampling: top-k keeps one too many", "sampling.py",
      "kth = sorted_logits.gather(-1, (k - 1).expand(", "kth = sorted_logits.gather(-1, k.clamp(max=vocab - 1).expand("),
    M("sampling: the exponential race multiplies", "sampling.py",
      "torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)",
      "torch.argmax(probs * torch.empty_like(probs).exponential_(1), dim=-1)"),
    # rerank and the tree
    M("rerank: keeps the worst nodes", "draft_tree.py",
      "torch.sort(scores, dim=-1, descending=True, stable=True)",
      "torch.sort(scores, dim=-1, descending=False, stable=True)"),
    M("rerank: the best candidate dropped, its children kept", "draft_tree.py",
      "order[..., :total_tokens - 1].sort(dim=-1).values", "order[..., 1:total_tokens].sort(dim=-1).values"),
    M("rerank: ancestors two generations short", "draft_tree.py",
      "for _ in range(levels):  # each pass", "for _ in range(levels - 2):  # each pass"),
    M("tree: scores not cumulative", "draft_tree.py",
      "child_scores = (scores[..., None] + child_logp).flatten(-2)", "child_scores = child_logp.flatten(-2)"),
    M("tree: a level's parents point into the wrong level", "draft_tree.py",
      "frontier = base + best", "frontier = best"),
    # catch-up
    M("catch-up: the parents' features", "decode.py",
      "catch_up(target, draft, emitted, take(features, path), ctx_len, n_accepted)",
      "catch_up(target, draft, emitted, take(features, tree.parents.gather(-1, path)), ctx_len, n_accepted)"),
    M("catch-up: the first tree nodes' features", "decode.py",
      "catch_up(target, draft, emitted, take(features, path), ctx_len, n_accepted)",
      "catch_up(target, draft, emitted, features[..., :tree_config.levels, :], ctx_len, n_accepted)"),
    M("catch-up: hands on the first pair's output", "draft.py",
      "return take(h, n_accepted[..., None])[..., 0, :]", "return take(h, (n_accepted * 0)[..., None])[..., 0, :]"),
    M("catch-up: the token before start_pos not re-run in a later turn", "decode.py",
      "first = max(start_pos - 1, 0) if draft else start_pos", "first = start_pos"),
    M("catch-up: the prompt's last pair skipped", "decode.py",
      "at(first + s), at(e - s - 1))", "at(first + s), at(max(e - s - 2, 0)))"),
    # EAGLE-3 features and d2t
    M("eagle3: feature layer ids read as layer inputs", "head_formats.py",
      "layers = tuple(k + 1 for k in ids) if ids", "layers = tuple(k for k in ids) if ids"),
    M("eagle3: features taken after the layer", "model.py",
      "            if i in self.feature_layers:\n                layer_inputs[i] = x\n"
      "            x = layer(x, cos, sin, cache_slots, mask)",
      "            x = layer(x, cos, sin, cache_slots, mask)\n"
      "            if i in self.feature_layers:\n                layer_inputs[i] = x"),
    M("eagle3: draft ids not mapped to target ids", "draft.py",
      "return logp, ids if self.draft_to_target is None else self.draft_to_target[ids]", "return logp, ids"),
    M("eagle3: d2t subtracted", "head_formats.py",
      "ids = torch.arange(draft_vocab) + d2t", "ids = torch.arange(draft_vocab) - d2t.abs()"),
    M("eagle3: attention input halves swapped", "draft.py",
      "torch.cat([self.embed_norm(embeds), self.hidden_norm(x)], dim=-1)",
      "torch.cat([self.hidden_norm(x), self.embed_norm(embeds)], dim=-1)"),
    M("eagle3: no residual around the attention", "draft.py",
      "h = x + self.attention(attn_in, cos, sin, cache_slots, mask)", "h = self.attention(attn_in, cos, sin, cache_slots, mask)"),
    # conversion
    M("conversion: q and k swapped", "convert_common.py",
      '("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")',
      '("self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj")'),
    M("conversion: k and v biases swapped", "convert_common.py",
      'torch.cat([weights.pop(f"{src}{t}.{part}") for t in theirs])',
      'torch.cat([weights.pop(f"{src}{t}.{part}") for t in (theirs[:1] + theirs[:0:-1] if part == "bias" '
      'else theirs)])'),
    M("conversion: gate and up swapped", "convert_common.py",
      '("mlp.gate_proj", "mlp.up_proj")', '("mlp.up_proj", "mlp.gate_proj")'),
    M("conversion: EAGLE-3 norms swapped", "convert_hf_checkpoint.py",
      '"layer.hidden_norm.weight": weights.pop("midlayer.hidden_norm.weight"),\n'
      '               "layer.embed_norm.weight": weights.pop("midlayer.input_layernorm.weight")}',
      '"layer.hidden_norm.weight": weights.pop("midlayer.input_layernorm.weight"),\n'
      '               "layer.embed_norm.weight": weights.pop("midlayer.hidden_norm.weight")}'),
    M("hub int4: AWQ's interleaved columns read in storage order", "convert_hub_int4.py",
      "slot = [AWQ_ORDER.index(c) for c in range(8)]", "slot = list(range(8))"),
    M("hub int4: gptq's stored z - 1 read as z", "convert_hub_int4.py",
      'zero_offset=1 if fmt == "gptq" else 0', "zero_offset=0"),
    M("hub int4: 4-bit values read from the highest bits first", "convert_hub_int4.py",
      "out[..., j] = (packed >> 4 * j) & 15", "out[..., j] = (packed >> 4 * (7 - j)) & 15"),
    M("hub int4: act-order groups taken as contiguous", "convert_hub_int4.py",
      "if g_idx is not None and not torch.equal(", "if False and not torch.equal("),
    M("conversion: the head's fc bias dropped", "convert_hf_checkpoint.py",
      'out["fc.bias"] = weights.pop("fc.bias")', 'weights.pop("fc.bias")'),
    # several prompts at once
    M("batch: a finished row's context still advanced", "batch.py",
      "ctx_len = torch.where(live, next_ctx, ctx_len)", "ctx_len = next_ctx"),
    M("batch: every row's K/V written to the first row", "model.py",
      "rows = torch.arange(bsz, device=device).view(1, bsz, 1, 1)",
      "rows = torch.zeros(1, bsz, 1, 1, dtype=torch.long, device=device)"),
    M("batch: every row sees the first row's context length", "attention.py",
      "return (cols < ctx_len[:, None])[:, None] | seen", "return (cols < ctx_len[:1, None])[:, None] | seen"),
    M("batch: a row's root paired one place too late in the catch-up", "batch.py",
      ".scatter(1, (lengths - 1)[:, None], token[:, None])", ".scatter(1, lengths.clamp(max=padded.shape[1] - 1)[:, None], token[:, None])"),
    # tensor parallel
    M("tp: a row-parallel bias added on every rank", "tp.py",
      "t = t if rank == 0 else torch.zeros_like(t)", "t = t"),
    M("tp: k and v rows split as one part", "tp.py",
      '"attention.wqkv": [q, kv, kv]', '"attention.wqkv": [q, 2 * kv]'),
    M("tp: no all-reduce after the MLP", "model.py",
      "return all_reduce(self.w2(F.silu(gate) * up), self.tp_group)", "return self.w2(F.silu(gate) * up)"),
    M("tp: int4 scales and zeros of a row-parallel Linear left whole", "tp.py",
      "elif linear in ROW_PARALLEL and t.ndim == 2:", 'elif linear in ROW_PARALLEL and t.ndim == 2 and kind == "weight":'),
    M("tp: one rank's load error kept to itself", "tp.py",
      "dist.all_gather_object(errors, error, group=group)", "errors[dist.get_rank(group)] = error"),
    M("tp: every rank prints its error", "generate.py",
      'status = f"error: {e}" if not torchrun_rank() else 1', 'status = f"error: {e}"'),
    # validation: each check removed
    M("validation: a config that is not a JSON object", "checkpoint.py",
      "    if not isinstance(config, dict):\n        raise", "    if False:\n        raise"),
    M("validation: config sizes missing", "checkpoint.py", "    if missing:\n        raise EagletError(f\"config is missing",
      "    if False:\n        raise EagletError(f\"config is missing"),
    M("validation: config sizes below 1", "checkpoint.py", "(type(value) is not int or value < 1)", "(type(value) is not int)"),
    M("validation: rms_norm_eps and rope_theta values", "checkpoint.py",
      "if type(value) not in (int, float) or not 0 < value < math.inf:", "if False:"),
    M("validation: heads not a multiple of K/V heads", "checkpoint.py", "if heads % kv_heads or (", "if ("),
    M("validation: a head with more than one layer (not speculators' EAGLE-3)", "head_formats.py",
      'if "fc.weight" not in keys or (config.get("num_hidden_layers", 1) != 1 and not stacked):',
      'if "fc.weight" not in keys:'),
    M("logprobs: each emitted token scored by the logits after it, not the ones that chose it", "decode.py",
      "token_scores(take(logits, path), emitted, sampling.logprobs)",
      "token_scores(take(logits, path.roll(-1, -1)), emitted, sampling.logprobs)"),
    M("P-EAGLE: the mask positions do not see the one before them", "block_draft.py",
      "causal = torch.ones(n, n, dtype=torch.bool, device=root.device).tril()",
      "causal = torch.eye(n, dtype=torch.bool, device=root.device)"),
    M("EAGLE-3: the decoder layers after the first are skipped", "draft.py",
      "        for block in self.decoder_layers:\n            h = block(h, cos, sin, slots, mask)\n", ""),
    M("validation: a head for another target", "head_formats.py",
      "if args.dim != target.dim or config.get(\"vocab_size\", target.vocab_size) != target.vocab_size:",
      "if args.dim != target.dim:"),
    M("validation: d2t maps two draft tokens to one (loading)", "head_formats.py",
      "ids.unique().numel() != draft_vocab", "False"),
    M("validation: d2t maps two draft tokens to one (conversion)", "convert_hf_checkpoint.py",
      "if target_ids.unique().numel() != draft_vocab:", "if False:"),
    M("validation: a head's bias flag disagrees with its weights", "convert_hf_checkpoint.py",
      "if config.get(\"bias\", True) != (\"fc.bias\" in out):", "if False:"),
    M("validation: unexpected weights in a target dropped", "convert_hf_checkpoint.py",
      "tie_word_embeddings is false\")\n    if weights:", "tie_word_embeddings is false\")\n    if False:"),
    M("validation: negative temperature", "sampling.py", "if self.temperature < 0:", "if False:"),
    M("validation: total_tokens above what the tree can hold", "draft_tree.py",
      "if not 2 <= self.total_tokens <= self.max_total_tokens:", "if not 2 <= self.total_tokens:"),
    M("validation: a prompt that does not fit the cache", "decode.py", "if need > model.max_seq_length:", "if False:"),
    # EAGLE-3 head formats
    M("eagle3: speculators' aux ids read as layer outputs", "head_formats.py",
      '"eagle_aux_hidden_state_layer_ids": [k - 1 for k in ids]}', '"eagle_aux_hidden_state_layer_ids": [k for k in ids]}'),
    M("eagle3: norm_before_residual ignored", "draft.py", "        if self.norm_before_residual:\n", "        if False:\n"),
    M("eagle3: norm_output not fed back", "draft.py", "return self.norm(h) if self.flags.norm_output else h", "return h"),
    # the user's hour
    M("stop: the tokens past the stop string are kept", "decode.py", "        del tokens[start + keep:]\n", ""),
    M("json_out: only the last sample is written", "chat.py",
      '"samples": samples,', '"samples": samples[-1:],'),
    M("interactive: Ctrl-C keeps trusting the cache", "chat.py",
      "            cached = []\n            continue", "            continue"),
    M("self-distill: the record ignores max_new_tokens", "train_data.py",
      '"seq_len": seq_len, "max_new_tokens": max_new_tokens,', '"seq_len": seq_len,'),
    M("self-distill: a partial file is never resumed", "train_data.py",
      "            done = found.replies\n", "            done = {}\n"),
    # the rest
    M("streamer: prints half a character", "chat.py", 'if not self.text.endswith("\\ufffd"):', "if True:"),
    M("quantize: int8 scale off by one step", "quantize.py",
      "scales = (w.abs().amax(dim=1) / 127)", "scales = (w.abs().amax(dim=1) / 128)"),
    M("quantize: int8 in bf16 on a CPU dequantizes the weight again", "quantize.py",
      "        if cpu_kernel_takes(x, self.in_features):", "        if False:"),
    M("quantize: the CPU int8 kernel gets a misaligned row", "quantize.py",
      "    return x2d.clone()\n", "    return x2d\n"),
    # GGUF files
    M("gguf: query / key rows left in llama.cpp's order", "convert_gguf.py",
      "    return t.reshape(n_head, -1, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)", "    return t"),
    M("gguf: Q4_1's minimum dropped", "convert_gguf.py",
      "minimum = halves(blocks, 2).reshape(-1) if", "minimum = 0 * scale if"),
    # DFlash heads
    M("dflash: the block attends causally, not to the whole block", "block_draft.py",
      "every = torch.ones(n, n, dtype=torch.bool, device=root.device)",
      "every = torch.ones(n, n, dtype=torch.bool, device=root.device).tril()"),
    M("dflash: the features taken one layer early", "head_formats.py",
      "tuple(k if lowest == 0 else k + 1 for k in ids)", "tuple(k for k in ids)"),
    M("dflash: the block's K/V left as context (catch-up writes the first position only)", "block_draft.py",
      "layer.attention.kv_cache.update(pos, k, v)",
      "layer.attention.kv_cache.update(pos[..., :1], k[:, :, :1], v[:, :, :1])"),
    M("dflash: the mask token embedded with the wrong id", "block_draft.py",
      "masks = torch.full((*root.shape, n - 1), self.mask_token_id,",
      "masks = torch.full((*root.shape, n - 1), self.mask_token_id + 1,"),
    M("dflash: drafts read from block positions 0..n-2", "block_draft.py",
      "return self.block_rows(target, root, ctx_len, self.first_row + levels)[..., self.first_row:, :]",
      "return self.block_rows(target, root, ctx_len, self.first_row + levels)[..., :levels, :]"),
    M("dflash: the context not normed after fc", "block_draft.py",
      "context = self.hidden_norm(self.fc(features))", "context = self.fc(features)"),
    M("dflash: a tree node scored by its own marginal, not its path's", "draft_tree.py",
      "child_scores = scores.repeat_interleave(k, dim=-1) + child_logp", "child_scores = child_logp"),
    M("dflash training: a block sees its own anchor's context too", "train_draft.py",
      "sees_context = ctx_pos < anchors.repeat_interleave(size, dim=1)[..., None]",
      "sees_context = ctx_pos <= anchors.repeat_interleave(size, dim=1)[..., None]"),
    M("dflash training: block position k learns the pick for a + k + 1", "train_draft.py",
      "where = anchors[..., None] + torch.arange(levels, device=picks.device)",
      "where = anchors[..., None] + 1 + torch.arange(levels, device=picks.device)"),
    # DSpark heads and the layouts of block drafters
    M("dspark: the block one position early (the known engine bug)", "block_draft.py",
      "pos = ctx_len[..., None] + torch.arange(n, device=ctx_len.device)\n        x = target.tok_embeddings(",
      "pos = ctx_len[..., None] - 1 + torch.arange(n, device=ctx_len.device)\n        x = target.tok_embeddings("),
    M("dspark: the anchor row's output dropped (DFlash's layout read into DSpark)", "head_formats.py",
      "        anchor, ids, dspark, lowest, name = True, config.get(\"target_layer_ids\"), True, -1, \"target_layer_ids\"",
      "        anchor, ids, dspark, lowest, name = False, config.get(\"target_layer_ids\"), True, -1, \"target_layer_ids\""),
    M("dspark: speculators' sample_from_anchor read inverted", "head_formats.py",
      "anchor, ids, dspark = config[\"sample_from_anchor\"],", "anchor, ids, dspark = not config[\"sample_from_anchor\"],"),
    M("dspark: the Markov state from the root instead of the previous pick", "draft_tree.py",
      "child_logp, child_ids = (t.flatten(-2) for t in children(i, tokens))",
      "child_logp, child_ids = (t.flatten(-2) for t in children(i, root[..., None].expand_as(tokens)))"),
    M("dspark: a tree child scored with its parent's parent's Markov state", "draft_tree.py",
      "        tokens, frontier = child_ids.gather(-1, best), k + (i - 1) * k * k + best",
      "        tokens, frontier = tokens.repeat_interleave(k, dim=-1).gather(-1, best), k + (i - 1) * k * k + best"),
    M("dspark: the confidence cut one draft late", "draft_tree.py",
      "        cut = head.cut(states[..., i, None, :], prev)",
      "        cut = head.cut(states[..., i - 1, None, :], prev) if i else None"),
    M("dspark: the Markov bias left out of the chain", "block_draft.py",
      "return row_logits + self.markov_head.markov_w2(self.markov_head.markov_w1(prev))",
      "return row_logits.expand(*prev.shape, row_logits.shape[-1])"),
    # DFlash2 and XPress heads
    M("dflash2: the convolution reads the rows ahead, not behind", "block_draft.py",
      "back = F.pad(x, (0, 0, tap, 0))[..., :n, :]", "back = F.pad(x, (0, 0, 0, tap))[..., tap:, :]"),
    M("dflash2: a group's kernel delta spread over the wrong channels", "block_draft.py",
      "deltas[..., side, tap, :].repeat_interleave(self.group_size, -1)",
      "deltas[..., side, tap, :].tile((self.group_size,))"),
    M("dflash2: the attention's output convolved with the input side's kernel", "block_draft.py",
      "x = x + self.attention_conv(attended, deltas, 1)", "x = x + self.attention_conv(attended, deltas, 0)"),
    M("dflash2: the selector's transition score left out", "block_draft.py",
      "return row_logits.gather(-1, candidates) + transition.to(row_logits.dtype)",
      "return row_logits.gather(-1, candidates)"),
    M("dflash2: tokens outside the candidates keep their logits", "block_draft.py",
      "out = row_logits.new_full((*scores.shape[:-1], row_logits.shape[-1]), float(\"-inf\"))",
      "out = row_logits.expand(*scores.shape[:-1], row_logits.shape[-1])"),
    M("xpress: the token before the root read one position early", "block_draft.py",
      "before = (ctx_len - 1).view(-1, 1)", "before = (ctx_len - 2).view(-1, 1)"),
    M("xpress: catch-up files each token at its pair's feature position", "block_draft.py",
      "pos = ctx_len[..., None] + 1 + torch.arange(tokens.shape[-1], device=ctx_len.device)",
      "pos = ctx_len[..., None] + torch.arange(tokens.shape[-1], device=ctx_len.device)"),
    M("xpress: one Jacobi pass fewer", "block_draft.py",
      "for _ in range(self.jacobi_passes):", "for _ in range(self.jacobi_passes - 1):"),
    M("xpress: each row refined after its own pick, not the row's before it", "block_draft.py",
      "picks[..., first.shape[-1] - 1:base.shape[-2] - 1]", "picks[..., first.shape[-1]:base.shape[-2]]"),
    M("xpress: the block's mean state left out of the refiner", "block_draft.py",
      "self.down_g(h.mean(-2, keepdim=True))", "self.down_g(h)"),
    M("xpress: the refiner's mix not causal", "block_draft.py",
      "torch.ones(n, n, device=x.device, dtype=x.dtype).tril()", "torch.ones(n, n, device=x.device, dtype=x.dtype)"),
    M("xpress training: the anchor row's token before is the anchor itself", "train_draft.py",
      "torch.where(anchors > 0, tokens.gather(1, (anchors - 1).clamp(min=0)), tokens.gather(1, anchors))",
      "tokens.gather(1, anchors)"),
    M("dflash2 training: the selector's label is the first candidate", "train_draft.py",
      "label = (candidates == want[..., None]).float().argmax(-1)", "label = torch.zeros_like(want)"),
    M("xpress: num_jacobi_passes read as the default", "head_formats.py",
      "b[\"xpress_mlp_ratio\"], b[\"num_jacobi_passes\"]", "b[\"xpress_mlp_ratio\"], 6"),
    M("dspark: speculators' d2t ignored (draft ids taken for target ids)", "head_formats.py",
      "        model.draft_to_target = draft_to_target(d2t, b[\"draft_vocab_size\"], target.vocab_size, where)",
      "        model.draft_to_target = torch.arange(b[\"draft_vocab_size\"])"),
    M("dspark: the target-copy check passes anything", "head_formats.py",
      "        if not bool((corr >= 0.99).all()):", "        if False:"),
    M("dspark training: the Markov state is the draft's own target, not the token before it", "train_draft.py",
      "prev = torch.cat([tokens.gather(1, anchors)[..., None], want[..., :-1]], dim=-1)", "prev = want"),
    M("inflate: a DFlash head's q/k norms without their constant channel", "scripts/inflate_demo.py",
      "c = math.sqrt(c_squared)", "c = 0.0"),
    M("gguf: Q4_K's sub-blocks low and high nibbles swapped", "convert_gguf.py",
      "q = torch.stack([qs & 15, qs >> 4], dim=2)", "q = torch.stack([qs >> 4, qs & 15], dim=2)"),
    M("gguf: sentencepiece merges ranked lowest score first", "convert_gguf.py", "    merges.sort()\n",
      "    merges.sort(reverse=True)\n"),
    M("checkpoint folder: of two checkpoints, the first taken instead of both refused", "checkpoint.py",
      "        if len(found) == 1:\n", "        if found:\n"),
    M("serve: a stream's held-back text never sent (the last chunk dropped)", "server/engine.py",
      "        streamer.flush()\n        if state", "        if state"),
    M("reasoning: a grammar constrains the thinking too", "server/requests.py",
      "grammar if thinking is None else after_thinking(", "grammar if True else after_thinking("),
    M("reasoning: the page's reasoning starts before the newlines the split strips", "reasoning.py",
      "at, text = at + len(text) - len(stripped), stripped", "text = stripped"),
    M("reasoning: a user's <think> opens the reply's thinking (the whole prompt read, not its generation prompt)",
      "server/requests.py", "opening = text[len(before):] if text.startswith(before) else text", "opening = text"),
    M("reasoning: a streamed reply's calls read from the whole text, thinking included", "server/replies.py",
      'calls_of(job, reply_parts(job, value["text"])[1])', 'calls_of(job, value["text"])'),
    M("serve: a stop string ends the generation one token late", "chat.py",
      "                    self.flush()\n                    return keep",
      "                    self.flush()\n                    return min(keep + 1, len(new_tokens))"),
    M("serve: a full queue drops the oldest waiting request", "server/engine.py",
      "                self.jobs.put_nowait(job)\n", "                self.jobs.put_nowait(job)\n"
      "            except queue.Full:\n                self.jobs.get_nowait()\n                self.jobs.put_nowait(job)\n"),
    M("serve: prefix reuse counts the last token as cached, though it never was fed back", "server/engine.py",
      "self.cached = (job.prompt + result.tokens)[:len(job.prompt) + len(result.tokens) - result.uncached]",
      "self.cached = job.prompt + result.tokens"),
    M("structured output: a reply ending in a forced run says only its last token is not cached", "decode.py",
      "logprobs, len(run) + 1 if segment.tokens else len(run), plain_tokens, prompt_rows)",
      "logprobs, 1, plain_tokens, prompt_rows)"),
    M("validation: an MLP activation other than silu read as silu", "checkpoint.py",
      'if config.get("hidden_act", "silu") not in ("silu", "swish"):', 'if False:'),
    M("validation: a rope_scaling beside rope_parameters ignored", "checkpoint.py",
      "    if read(params) != read(scaling):", "    if False:"),
    M("validation: a string taken for a true / false config flag", "checkpoint.py",
      "if config.get(key) is not None and type(config[key]) is not bool:", "if False:"),
    M("structured output: a reply's plain steps counted in its last segment only", "decode.py",
      "plain_tokens += segment.plain_tokens", "plain_tokens = segment.plain_tokens"),
    M("serve: a whole reply's request never asks whether its client left while events come", "server/app.py",
      "        if request is not None and time.monotonic() - asked >= DISCONNECT_CHECK_S:",
      "        if request is not None and event is None and time.monotonic() - asked >= DISCONNECT_CHECK_S:"),
    M("logits: an EAGLE head scores with the lm_head directly, not through Transformer.logits", "draft.py",
      "        return target.logits(h, self.vocab_lm_head)",
      "        return (target.output if self.vocab_lm_head is None else self.vocab_lm_head)(h)"),
    M("static tree: the root left out of every node's ancestors", "draft_tree.py",
      "            ancestors[:, 0] = True  # the root is everyone's\n", ""),
    M("static tree: a level's drafts taken from the first node above, not each node's parent", "draft_tree.py",
      "                tokens[..., level[\"tree\"]] = child_ids[..., level[\"parent\"], level[\"rank\"]]",
      "                tokens[..., level[\"tree\"]] = child_ids[..., 0, level[\"rank\"]]"),
    M("int4 in fp32 on a CPU: dequantized around 7, not 8", "quantize.py",
      "return (values.to(scales.dtype) - 8) * scales + zeros", "return (values.to(scales.dtype) - 7) * scales + zeros"),
    # drafting without a head: a draft model, n-gram lookup
    M("draft model: its calls at a head's positions, not one after", "draft_model.py",
      "logits, _ = self.model(tokens, input_pos + 1, slots + 1, mask)", "logits, _ = self.model(tokens, input_pos, slots, mask)"),
    M("draft model: the context's first token never read", "decode.py",
      "        draft.catch_up_first(model, new_tokens[0, :1])\n", "        pass\n"),
    M("draft model: the root not seen as context", "draft_model.py",
      "return super().context_mask(ctx_len + 1, block)", "return super().context_mask(ctx_len, block)"),
    M("draft model: the root not seen as context, unwindowed", "draft_model.py",
      "return super().context_mask(ctx_len, torch.cat([root, block], dim=-1))",
      "return super().context_mask(ctx_len, torch.cat([~root, block], dim=-1))"),
    M("lookup: a continuation starts inside the matched n-gram", "lookup.py",
      "run = tuple(self.context[end:end + self.config.depth])", "run = tuple(self.context[end - 1:end - 1 + self.config.depth])"),
    M("lookup: the padding nodes may be accepted", "lookup.py", "    logp[real:] = float(\"-inf\")\n", ""),
    M("lookup: a node's ancestors are only its parent", "lookup.py",
      "        ancestors[i] |= ancestors[parents[i]]", "        ancestors[i, parents[i]] = True"),
    M("lookup: the index misses the tokens each cycle emits", "lookup.py", "        index.extend(tokens[n_before:])\n", ""),
    # penalties and the bias under speculation
    M("penalties: a node's own path not counted, only the reply before the root", "sampling.py",
      "        counts = counts + torch.zeros(len(tokens), history.shape[1], device=tokens.device).scatter_add_(",
      "        counts = counts + 0 * torch.zeros(len(tokens), history.shape[1], device=tokens.device).scatter_add_("),
    M("penalties: the root counted twice at every node", "sampling.py",
      "path = ancestors.float() * (torch.arange(len(tokens), device=tokens.device) > 0)",
      "path = ancestors.float()"),
    M("penalties: the reply not counted as it grows", "decode.py", "    inputs.count(tokens[n:])\n", ""),
    M("min_tokens: a node's depth ignored", "sampling.py",
      "position = counts.sum() + (0 if depths is None else depths[:, None])", "position = counts.sum()"),
    # --exact: each operation put back on the default path
    M("exact: a one-row forward not padded", "model.py",
      "if idx.shape[0] * idx.shape[1] < self.exact_rows:", "if False:"),
    M("exact: a one-row lm_head call not padded", "model.py",
      "if hidden.ndim > 1 and hidden.numel() < self.exact_rows * hidden.shape[-1]:", "if False:"),
    M("exact: attention on the default path", "attention.py", "    if EXACT:\n        return exact_attention(q, k, v, mask)\n", ""),
]


def repository_files() -> list:
    """What a fork holds: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"error: {ROOT} is not a git checkout ({out.stderr.strip()})")
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file()]


def copy_repository(files: list, dst: Path):
    for f in files:
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dst / f)
    shared = ROOT.parent / "shared"  # tests that read the shared data find it beside the copy
    if shared.is_dir() and not (dst.parent / "shared").exists():
        (dst.parent / "shared").symlink_to(shared)


def run_tests(repo: Path, pytest_args: list, timeout: int):
    """(passed, first failing test or why, seconds)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    try:
        # --ignore: test_mutants.py checks that each bug's text is in the code, which a seeded copy fails by design;
        # --deselect: the README's line counts, which a bug that adds or drops a line changes without being caught
        out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                              "--ignore=tests/test_mutants.py",
                              "--deselect=tests/test_layout.py::test_the_readme_line_counts_are_the_files", *pytest_args],
                             cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timeout after {timeout} s", time.perf_counter() - t0
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", out.stdout, re.M)
    why = failed.group(1) if failed else (out.stdout.strip().splitlines() or ["no output"])[-1]
    return out.returncode == 0, why, time.perf_counter() - t0


def check_mutants(mutants: list):
    for m in mutants:
        text = (ROOT / m.path).read_text()
        if text.count(m.old) != 1:
            sys.exit(f"error: mutant {m.name!r}: its text occurs {text.count(m.old)} times in {m.path} (expected once); "
                     "update MUTANTS after changing the code")


# The test files that catch most bugs: run after those named after the changed file, before the rest.
CATCH_MOST = ("tests/test_lossless.py", "tests/test_tree.py", "tests/test_model.py", "tests/test_errors.py")


def test_files_for(path: str) -> list:
    """Every test file, those named after the changed file first (tp.py: test_tp.py; train_draft.py:
    test_train_*.py), then CATCH_MOST: with -x a bug they catch stops the run early. Given as files, in this
    order (pytest collects a folder in its own order)."""
    stem, tests = Path(path).stem, sorted(f for f in (ROOT / "tests").glob("test_*.py") if f.name != "test_mutants.py")
    named = [f for f in tests if any(f.name.startswith(f"test_{part}") for part in
                                     {stem, stem.split("_")[0], stem.split("_")[-1]})]
    ordered = [f"tests/{f.name}" for f in named] + list(CATCH_MOST) + [f"tests/{f.name}" for f in tests]
    return [f for f in dict.fromkeys(ordered) if (ROOT / f).is_file()]


def worker(files: list, mutants: list, tiers: list, report) -> list:
    """Each bug against the tiers in turn (name, pytest arguments, timeout) until one fails: (bug, caught by,
    why, seconds). A run past its tier's timeout counts as a hang: caught, the why saying so."""
    results = []
    with tempfile.TemporaryDirectory(prefix="eaglet-mutants-") as tmp:
        repo = Path(tmp) / "repo"
        copy_repository(files, repo)
        for m in mutants:
            path = repo / m.path
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new))
            caught_by, why, seconds = None, "", 0.0
            for tier, pytest_args, timeout in tiers:
                tests = [f for f in test_files_for(m.path) if (repo / f).is_file()]  # git-ignored ones are not there
                passed, why, spent = run_tests(repo, pytest_args + tests, timeout)
                seconds += spent
                if not passed:
                    caught_by = tier
                    break
            path.write_text(original)
            results.append((m, caught_by, why, seconds))
            report(m, caught_by, why, seconds)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="run the bugs whose name contains this text")
    p.add_argument("--full", action="store_true", help="the whole suite at once for each bug")
    p.add_argument("--fast_only", action="store_true", help="the fast tier only: no slow-tier run for a bug it misses")
    p.add_argument("--jobs", type=int, default=2, help="bugs tested at once, each in its own copy (default: 2)")
    p.add_argument("--timeout", type=int, default=900, help="seconds before a fast-tier run counts as a hang (caught)")
    p.add_argument("--slow_timeout", type=int, default=3600,
                   help="the same for a slow-tier or --full run (the slow tier takes ~15 min in one process)")
    p.add_argument("--no_baseline", action="store_true", help="skip the check that the unchanged tests pass")
    args = p.parse_args(argv)
    if min(args.jobs, args.timeout, args.slow_timeout) < 1:
        p.error("--jobs, --timeout and --slow_timeout must be at least 1")
    mutants = [m for m in MUTANTS if args.only in m.name]
    if not mutants:
        p.error(f"no bug's name contains {args.only!r}")
    check_mutants(mutants)
    tiers = [("full suite", [], args.slow_timeout)] if args.full else \
        [("fast tier", ["-m", "not slow"], args.timeout), ("slow tier", ["-m", "slow"], args.slow_timeout)]
    tiers = tiers[:1] if args.fast_only else tiers
    files = repository_files()
    t0 = time.perf_counter()

    def baseline(tier, pytest_args, timeout):
        with tempfile.TemporaryDirectory(prefix="eaglet-mutants-") as tmp:
            copy_repository(files, Path(tmp) / "repo")
            passed, why, seconds = run_tests(Path(tmp) / "repo", pytest_args + ["tests"], timeout)
        if not passed:
            sys.exit(f"error: the unchanged tests fail in the {tier} ({why}): fix them before seeding bugs")
        print(f"baseline: the unchanged {tier} passes ({seconds:.0f} s)", flush=True)
    if not args.no_baseline:
        baseline(*tiers[0])

    def report(m, caught_by, why, seconds):
        print(f"{'caught  ' if caught_by else 'SURVIVED'} {m.name}  [{caught_by or 'every tier'}: {why}, "
              f"{seconds:.0f} s]", flush=True)
    shares = [mutants[i::args.jobs] for i in range(args.jobs)]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = [r for rs in pool.map(lambda share: worker(files, share, tiers, report), shares)
                   for r in rs]
    by_slow = [m.name for m, caught_by, _, _ in results if caught_by == "slow tier"]
    if by_slow and not args.no_baseline:  # a bug the slow tier caught counts only if the slow tier passes unchanged
        baseline(*tiers[1])
    survivors = [m.name for m, caught_by, _, _ in results if not caught_by]
    print(f"\n{len(results) - len(survivors)} of {len(results)} seeded bugs caught, {len(by_slow)} of them only by "
          f"the slow tier ({' then '.join(t for t, *_ in tiers)}, {(time.perf_counter() - t0) / 60:.1f} min)")
    if by_slow:
        print("caught only by the slow tier:\n  " + "\n  ".join(by_slow))
    if survivors:
        sys.exit("survived:\n  " + "\n  ".join(survivors))


if __name__ == "__main__":
    main()
