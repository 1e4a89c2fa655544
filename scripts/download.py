"""Download a Hugging Face checkpoint into checkpoints/<org>/<name> (set HF_TOKEN for gated models).

    python scripts/download.py --repo_id meta-llama/Llama-2-7b-chat-hf
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-chat-hf
"""
import argparse
import os
from pathlib import Path

from huggingface_hub import list_repo_files, snapshot_download


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo_id", required=True, help="e.g. meta-llama/Meta-Llama-3-8B-Instruct")
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    args = parser.parse_args()
    local_dir = args.checkpoints / args.repo_id
    token = os.environ.get("HF_TOKEN")
    # Many repos publish the same weights twice; take safetensors when they exist.
    has_safetensors = any(f.endswith(".safetensors") for f in list_repo_files(args.repo_id, token=token))
    weights = "*.safetensors" if has_safetensors else "*.bin"
    snapshot_download(args.repo_id, local_dir=local_dir, token=token,
                      allow_patterns=["*.json", weights, "tokenizer.model", "*.txt"])
    print(f"downloaded to {local_dir}")


if __name__ == "__main__":
    main()
