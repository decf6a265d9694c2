"""The default pack against a real Hugging Face causal LM (a tiny random-weight Llama).

One packed bin must train a model exactly as its samples would one by one: the same summed
token loss and the same parameter gradients, for the sdpa and eager attention paths. That
holds only with the pack's conventions (position ids restarting per sample, -100 at each
sample's first label, no attention mask) and with ``use_cache=False``; the tests below also
show each trap failing. The model is built from a config in code: nothing is downloaded.

Tolerances (float32): summed token loss within rtol 1e-5, every gradient element within
atol 1e-6 + rtol 1e-4; measured differences are around 1e-7.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not installed; install the test extra (pip install '.[test]')",
)

from evenflow.engine import count_loss_tokens, default_pack_fn  # noqa: E402

VOCAB = 128
IMPLEMENTATIONS = ["sdpa", "eager"]

# One bin: plain token lists, prompt-masked mappings, a mapping without labels and a
# one-token sample (nothing to predict).
_rng = torch.Generator().manual_seed(13)


def _tokens(n: int) -> list[int]:
    return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=_rng)]


def _masked(n: int, prompt: int) -> dict[str, Any]:
    tokens = _tokens(n)
    return {"input_ids": tokens, "labels": [-100] * prompt + tokens[prompt:]}


SAMPLES: list[Any] = [
    _masked(9, prompt=4),
    _tokens(5),
    {"input_ids": _tokens(7)},
    _tokens(1),
    _masked(12, prompt=7),
    _tokens(6),
]
SEQ_LEN = 48


@functools.cache
def _model(attn_implementation: str) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn_implementation,
    )
    assert config.use_cache  # the library default, which the cache test relies on
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.train()  # dropout is 0 in this config: train mode is deterministic
    return model


def _alone(sample: Any) -> dict[str, torch.Tensor]:
    """One sample as its own batch of one, the way it would train without packing."""
    if isinstance(sample, dict):
        tokens, labels = sample["input_ids"], sample.get("labels", sample["input_ids"])
    else:
        tokens, labels = sample, sample
    return {"input_ids": torch.tensor([tokens]), "labels": torch.tensor([labels])}


def _grads(model: Any) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _packed_run(model: Any, packed: dict[str, Any], divisor: int) -> tuple[float, Any]:
    model.zero_grad(set_to_none=True)
    loss = model(**packed, use_cache=False, num_items_in_batch=divisor).loss
    loss.backward()
    return loss.detach().item() * divisor, _grads(model)


def _per_sample_run(model: Any, divisor: int) -> tuple[float, Any]:
    model.zero_grad(set_to_none=True)
    total = 0.0
    for sample in SAMPLES:
        loss = model(**_alone(sample), use_cache=False, num_items_in_batch=divisor).loss
        loss.backward()
        total += loss.detach().item() * divisor
    return total, _grads(model)


def test_layout_is_the_one_of_data_collator_with_flattening() -> None:
    packed = default_pack_fn(SAMPLES, SEQ_LEN)
    features = [{k: v[0].tolist() for k, v in _alone(s).items()} for s in SAMPLES]
    theirs = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
    assert sorted(packed) == sorted(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert packed[key].dtype == value.dtype and packed[key].shape == value.shape, key
            assert torch.equal(packed[key], value), key
        else:
            assert type(packed[key]) is type(value) and packed[key] == value, key


@pytest.mark.parametrize("attn_implementation", IMPLEMENTATIONS)
def test_packed_loss_and_gradients_equal_the_per_sample_ones(attn_implementation: str) -> None:
    model = _model(attn_implementation)
    packed = default_pack_fn(SAMPLES, SEQ_LEN)
    num_loss_tokens = count_loss_tokens(packed)
    assert num_loss_tokens == sum(count_loss_tokens(s) for s in SAMPLES) == 5 + 4 + 6 + 0 + 5 + 5
    packed_loss, packed_grads = _packed_run(model, packed, num_loss_tokens)
    reference_loss, reference_grads = _per_sample_run(model, num_loss_tokens)
    assert packed_loss == pytest.approx(reference_loss, rel=1e-5)
    assert packed_grads.keys() == reference_grads.keys() and len(packed_grads) > 10
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, reference_grads[name], atol=1e-6, rtol=1e-4, msg=name)


def test_without_ignored_sample_starts_the_loss_differs() -> None:
    model = _model("sdpa")
    packed = default_pack_fn(SAMPLES, SEQ_LEN)
    num_loss_tokens = count_loss_tokens(packed)
    reference_loss, _ = _per_sample_run(model, num_loss_tokens)
    # Put each sample's first token back as its label: the model now also learns to predict
    # it from the previous sample's last token.
    starts = packed["cu_seq_lens_q"][1:-1].long()
    leaky = dict(packed, labels=packed["labels"].clone())
    leaky["labels"][0, starts] = packed["input_ids"][0, starts]
    leaky_loss, _ = _packed_run(model, leaky, num_loss_tokens)
    assert abs(leaky_loss - reference_loss) > 1e-2 * reference_loss
    correct_loss, _ = _packed_run(model, packed, num_loss_tokens)
    assert correct_loss == pytest.approx(reference_loss, rel=1e-5)


@pytest.mark.parametrize("attn_implementation", IMPLEMENTATIONS)
def test_a_cache_lets_packed_samples_attend_to_each_other(attn_implementation: str) -> None:
    model = _model(attn_implementation)
    packed = default_pack_fn(SAMPLES, SEQ_LEN)
    with torch.no_grad():
        alone = torch.cat([model(**_alone(s), use_cache=False).logits for s in SAMPLES], dim=1)
        default = model(**packed).logits  # use_cache left at the config default (True)
        uncached = model(**packed, use_cache=False).logits
    first = len(SAMPLES[0]["input_ids"])
    # The first sample has nothing before it; every later one sees its predecessors.
    torch.testing.assert_close(default[:, :first], alone[:, :first], atol=1e-5, rtol=1e-5)
    assert float((default - alone).abs().max()) > 1e-2
    torch.testing.assert_close(uncached, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn_implementation", IMPLEMENTATIONS)
def test_sdpa_and_eager_take_the_boundaries_from_position_ids(attn_implementation: str) -> None:
    """The flash-attention fields are accepted and unused here: one wrong set changes nothing,
    while position ids that do not restart merge the samples."""
    model = _model(attn_implementation)
    packed = default_pack_fn(SAMPLES, SEQ_LEN)
    total = packed["input_ids"].shape[1]
    one_span = torch.tensor([0, total], dtype=torch.int32)
    wrong = dict(packed, cu_seq_lens_q=one_span, cu_seq_lens_k=one_span)
    wrong.update(max_length_q=total, max_length_k=total)
    merged = dict(packed, position_ids=torch.arange(total)[None])
    with torch.no_grad():
        logits = model(**packed, use_cache=False).logits
        assert torch.equal(model(**wrong, use_cache=False).logits, logits)
        assert float((model(**merged, use_cache=False).logits - logits).abs().max()) > 1e-2
