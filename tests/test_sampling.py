"""Sampling and stop conditions (unit): compared against independently computed distributions."""

import math

import pytest
import torch

from libs.engine.request import FinishReason, SamplingParams
from libs.engine.sampling import filter_logits, make_generator, sample
from libs.engine.stopping import check_stop

pytestmark = pytest.mark.unit

N_DRAWS = 20000


def _draw(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> torch.Tensor:
    """Empirical distribution of N_DRAWS samples from one logits row."""
    gen = make_generator(seed)
    rows = logits.unsqueeze(0).expand(N_DRAWS, -1)
    ids = sample(rows, [params] * N_DRAWS, [gen] * N_DRAWS).token_ids
    return torch.bincount(torch.tensor(ids), minlength=logits.numel()).float() / N_DRAWS


def _probs(ps: list[float]) -> torch.Tensor:
    return torch.tensor(ps).log()


def test_greedy_is_argmax_and_ignores_generator():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=0.0)] * 5
    out = sample(logits, params, [make_generator(i) for i in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_top_k_one_is_greedy_even_with_temperature():
    logits = torch.tensor([[0.1, 3.0, 0.2, 2.9]])
    out = sample(logits, [SamplingParams(temperature=1.5, top_k=1)], [make_generator(0)])
    assert out.token_ids == [1]


def test_temperature_distribution_matches_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    emp = _draw(logits, SamplingParams(temperature=2.0))
    ref = [math.exp(x / 2.0) for x in logits.tolist()]
    ref = torch.tensor([r / sum(ref) for r in ref])
    assert torch.allclose(emp, ref, atol=0.015)


def test_top_k_keeps_only_k_best_renormalised():
    logits = _probs([0.4, 0.1, 0.3, 0.05, 0.15])
    emp = _draw(logits, SamplingParams(temperature=1.0, top_k=2))
    ref = torch.tensor([0.4, 0.0, 0.3, 0.0, 0.0]) / 0.7
    assert emp[1] == emp[3] == emp[4] == 0.0
    assert torch.allclose(emp, ref, atol=0.015)


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = _probs([0.15, 0.5, 0.05, 0.3])
    # sorted: 0.5, 0.3 | 0.15, 0.05 -> mass before 0.15 is 0.8 >= 0.7, so only {1, 3} survive
    emp = _draw(logits, SamplingParams(temperature=1.0, top_p=0.7))
    ref = torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8
    assert emp[0] == emp[2] == 0.0
    assert torch.allclose(emp, ref, atol=0.015)


def test_top_p_always_keeps_the_top_token():
    logits = _probs([0.9, 0.1])
    filtered = filter_logits(logits.unsqueeze(0), torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isfinite(filtered[0, 0]) and filtered[0, 1] == float("-inf")


def test_top_k_and_top_p_combine():
    logits = _probs([0.35, 0.3, 0.2, 0.15])
    # top_k=3 renormalises to .35/.85, .3/.85, .2/.85 = .41, .35, .24; top_p=0.7 keeps the first two
    emp = _draw(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    ref = torch.tensor([0.35, 0.3, 0.0, 0.0]) / 0.65
    assert torch.allclose(emp, ref, atol=0.015)


def test_seeded_rows_are_reproducible_and_independent_of_batch_mates():
    torch.manual_seed(1)
    logits = torch.randn(3, 64)
    p = SamplingParams(temperature=1.0, seed=7)

    def run(batch_logits, n_other):
        gens = [make_generator(7)] + [make_generator(100 + i) for i in range(n_other)]
        params = [p] + [SamplingParams(temperature=0.8)] * n_other
        seq = []
        for _ in range(20):
            seq.append(sample(batch_logits, params, gens).token_ids[0])
        return seq

    alone = run(logits[:1], 0)
    mixed = run(logits, 2)
    assert alone == mixed
    other_seed = [sample(logits[:1], [p], [make_generator(8)]).token_ids[0] for _ in range(20)]
    assert len(set(alone)) > 1  # actually random
    assert alone != other_seed or len(set(other_seed)) == 1


def test_logprobs_are_raw_log_softmax_with_sorted_top():
    torch.manual_seed(2)
    logits = torch.randn(2, 30)
    params = [SamplingParams(logprobs=3), SamplingParams(temperature=0.7, logprobs=0, seed=1)]
    out = sample(logits, params, [make_generator(0), make_generator(1)])
    ref = torch.log_softmax(logits.double(), -1)
    for row, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert lp is not None and lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[row, tok]), abs=1e-5)
    top = out.logprobs[0].top
    assert [t for t, _ in top] == ref[0].topk(3).indices.tolist()
    assert out.logprobs[1].top == ()


def test_sample_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="must match"):
        sample(torch.zeros(2, 4), [SamplingParams()], [make_generator(0)])


@pytest.mark.parametrize("kwargs, msg", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"logprobs": -1}, "logprobs"), ({"stop": [""]}, "empty"),
])
def test_params_validation_names_the_field(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def _bytes_decode(ids):
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_stop_token_eos_and_ignore_eos():
    p = SamplingParams(max_tokens=10, stop_token_ids=[5])
    assert check_stop([1, 5], 0, p, eos_token_ids=[9], decode=None) is FinishReason.STOP
    assert check_stop([1, 9], 0, p, eos_token_ids=[9], decode=None) is FinishReason.STOP
    ignore = SamplingParams(max_tokens=10, ignore_eos=True)
    assert check_stop([1, 9], 0, ignore, eos_token_ids=[9], decode=None) is None
    assert check_stop([1, 2], 0, p, eos_token_ids=[9], decode=None) is None


def test_max_tokens_gives_length():
    p = SamplingParams(max_tokens=3)
    assert check_stop([1, 2], 0, p, (), None) is None
    assert check_stop([1, 2, 3], 0, p, (), None) is FinishReason.LENGTH


def test_stop_string_across_tokens_and_long_outputs():
    p = SamplingParams(max_tokens=1000, stop=["END"])
    out = [ord(c) for c in "x" * 300 + "EN"]
    assert check_stop(out, 0, p, (), _bytes_decode) is None
    out.append(ord("D"))
    assert check_stop(out, 0, p, (), _bytes_decode) is FinishReason.STOP


def test_prompt_tokens_count_neither_for_max_tokens_nor_for_stop_strings():
    prompt = [ord(c) for c in "say END"]
    p = SamplingParams(max_tokens=2, stop=["END"])
    assert check_stop([*prompt, ord("x")], len(prompt), p, (), _bytes_decode) is None  # "END" is the prompt's
    assert check_stop([*prompt, ord("x"), ord("y")], len(prompt), p, (), _bytes_decode) is FinishReason.LENGTH


def test_stop_string_needs_decoder():
    with pytest.raises(ValueError, match="tokenizer"):
        check_stop([65], 0, SamplingParams(stop=["A"]), (), None)
