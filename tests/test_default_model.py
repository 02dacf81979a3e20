"""The built-in model `make run` serves (models/windserve-tiny, written by scripts/train_tiny.py): its weights
load over the tiny model and reach the quality its training.json states, far below the unigram baseline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from libs.model import load_model
from libs.model.loader import CheckpointError
from scripts.train_tiny import CORPUS_COMMIT, SEQ, corpus, evaluate, has_commit, split, windows

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "models" / "windserve-tiny"


@pytest.mark.skipif(not has_commit(ROOT, CORPUS_COMMIT), reason="the corpus commit is not in this clone's history")
def test_the_shipped_weights_reach_their_stated_quality():
    facts = json.loads((DEFAULT / "training.json").read_text())
    model, _ = load_model(None, tiny_weights=str(DEFAULT / "weights.safetensors"))
    random_model, _ = load_model(None)
    _, held = split(corpus(ROOT, CORPUS_COMMIT)[0])
    batch = windows(held, 32, SEQ + 1, torch.Generator().manual_seed(11))  # training's held-out batch
    bits = evaluate(model, batch)["loss"] / math.log(2)
    assert bits == pytest.approx(facts["held_bits_per_byte"], abs=0.01)
    assert bits < 0.6 * facts["unigram_bits_per_byte"]
    assert evaluate(random_model, batch)["loss"] / math.log(2) > facts["unigram_bits_per_byte"]


def test_weights_of_another_model_are_refused_naming_the_file(tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, bad)
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        load_model(None, tiny_weights=str(bad))
