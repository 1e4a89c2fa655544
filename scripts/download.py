"""Download a Hugging Face checkpoint into checkpoints/<org>/<name> (set HF_TOKEN for gated models).

    python scripts/download.py --repo_id meta-llama/Llama-2-7b-chat-hf
    python convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-2-7b-chat-hf
"""
import argparse
import os
import re
import sys
from pathlib import Path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: sys.exit(f"error: {message}")
    parser.add_argument("--repo_id", required=True, help="e.g. meta-llama/Meta-Llama-3-8B-Instruct")
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"),
                        help="the folder that gets <org>/<name> (default: checkpoints)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", args.repo_id, re.ASCII) or ".." in args.repo_id:
        parser.error(f"--repo_id must look like org/name, got {args.repo_id!r}")
    return args


def main(argv=None):
    args = parse_args(argv)
    from huggingface_hub import list_repo_files, snapshot_download  # after --help and usage checks: it is slow
    local_dir = args.checkpoints / args.repo_id
    token = os.environ.get("HF_TOKEN")
    try:
        # Many repos publish the same weights twice; take safetensors when they exist.
        has_safetensors = any(f.endswith(".safetensors") for f in list_repo_files(args.repo_id, token=token))
        weights = "*.safetensors" if has_safetensors else "*.bin"
        snapshot_download(args.repo_id, local_dir=local_dir, token=token,
                          allow_patterns=["*.json", weights, "tokenizer.model", "*.txt", "*.jinja"])
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # the hub's errors (not found, gated, offline) and the disk's, as one line
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        sys.exit(f"error: cannot download {args.repo_id}: {type(e).__name__}: {first_line}")
    print(f"downloaded to {local_dir}")


if __name__ == "__main__":
    main()
