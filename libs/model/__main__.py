"""Debug CLI: greedy token ids and their logprobs as JSON.

    python -m libs.model [--model DIR] --prompt-ids 1,2,3 --max-new-tokens N
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from libs.model.generate import greedy_generate
from libs.model.loader import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers: {e}") from e
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids must not be empty")
    return ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m libs.model", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: built-in tiny model)")
    ap.add_argument("--prompt-ids", type=_ids, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--stop-at-eos", action="store_true")
    a = ap.parse_args(argv)
    model, cfg = load_model(a.model, DTYPES[a.dtype], a.device, progress=a.model is not None)
    if max(a.prompt_ids) >= cfg.vocab_size:
        ap.error(f"prompt id {max(a.prompt_ids)} is outside the vocabulary (size {cfg.vocab_size})")
    eos = cfg.eos_token_ids if a.stop_at_eos else ()
    ids, logprobs = greedy_generate(model, a.prompt_ids, a.max_new_tokens, a.page_size, eos)
    json.dump({"token_ids": ids, "logprobs": logprobs}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
