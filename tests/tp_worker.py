"""Runs decoding cases for test_tp.py: `torchrun --nproc_per_node=N tests/tp_worker.py CASES.json OUT.json` shards
each target over the ranks (tensor parallel, gloo); test_tp.py calls run_cases() in its own process for the
single-process reference. A case: {"target", "head" (or null), "prompts" (lists of ids), "max_new_tokens",
"temperature", "seed", "batch" (optional: the prompts decoded together), "perturb" (optional: rank 1 scales its own copy of the replicated weights of
`perturb`, lm_head or head, with noise, as a rank whose kernels differ would compute)}. Rank 0 writes
[{"tokens": [...], "accept_lengths": [...]} per prompt] per case, or {"error": ...} for a case that failed."""
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tp  # noqa: E402
from decode import TreeConfig, generate  # noqa: E402
from sampling import SamplingConfig  # noqa: E402
from batch import generate_batch  # noqa: E402
from load import load_draft, load_target  # noqa: E402


def run_cases(cases: list, group=None) -> list:
    results = []
    for case in cases:
        model = load_target(case["target"], "cpu", "fp32", max_seq_length=256, group=group)
        draft = load_draft(case["head"], model) if case["head"] else None
        rows = len(case["prompts"]) if case.get("batch") else 1
        model.setup_caches(rows, 256)
        if draft is not None:
            draft.setup_caches(256, rows)
        if case.get("perturb") and tp.torchrun_rank() == 1:
            module = model.output if case["perturb"] == "lm_head" else draft.fc
            noise = torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(1))
            module.weight.data = module.weight.data + 0.5 * noise * module.weight.data.std()
        tree = TreeConfig(depth=draft.default_depth if draft else 6, topk=4, total_tokens=24)
        sampling = SamplingConfig(temperature=case.get("temperature", 0.0))
        runs = []
        try:
            if case.get("batch"):
                runs = [{"tokens": r.tokens, "accept_lengths": r.accept_lengths} for r in
                        generate_batch(model, case["prompts"], case["max_new_tokens"], sampling, draft=draft, tree=tree)]
            for prompt in case["prompts"] if not case.get("batch") else []:
                torch.manual_seed(case.get("seed", 0))
                result = generate(model, prompt, case["max_new_tokens"], sampling, draft=draft, tree=tree)
                runs.append({"tokens": result.tokens, "accept_lengths": result.accept_lengths})
        except tp.RanksDisagree as e:
            runs = {"error": str(e)}
        results.append(runs)
    return results


if __name__ == "__main__":
    group = tp.start("cpu")
    results = run_cases(json.loads(Path(sys.argv[1]).read_text()), group)
    if tp.torchrun_rank() == 0:
        Path(sys.argv[2]).write_text(json.dumps(results))
    tp.finish(group)
