"""The effect roles: a task-agnostic long-lived set for the role labels, found by what evicting each kind of token
costs the frozen model (``training.effect_roles``), and the planned eviction it is measured with."""

import random

import torch

from dms_runtime.attach import attach_dms
from dms_runtime.config import DMSConfig
from dms_runtime.gates import build_gates
from tests.test_dms import VOCAB, tiny
from training.effect_roles import (EffectRoles, choose_long_lived, completion_kl, in_completion, kmeans,
                                   plan_effect_roles)


def test_an_eviction_hides_its_keys_only_from_queries_beyond_the_window():
    model = tiny("qwen3")
    config = DMSConfig(window=4)
    handle = attach_dms(model, build_gates(model, config), config)
    ids = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    evicted = torch.zeros(2, 24, dtype=torch.bool)
    evicted[0, 3] = True  # row 0 loses key 3; row 1 loses nothing
    with torch.no_grad():
        with handle.mode("off"):
            vanilla = model(input_ids=ids).logits
        with handle.evicting(evicted):
            planned = model(input_ids=ids).logits
    assert torch.allclose(planned[1], vanilla[1], atol=1e-5)  # nothing evicted: the vanilla model
    assert torch.allclose(planned[0, :8], vanilla[0, :8], atol=1e-5)  # queries 4..7 still see key 3 (the window)
    assert (planned[0, 8:] - vanilla[0, 8:]).abs().amax(-1).min() > 1e-4  # every later query has lost it
    assert handle.modules[0].dms.mode == "infer" and handle.modules[0].dms.alpha is None  # restored


def test_kmeans_separates_clusters_and_the_long_lived_kinds_carry_the_cost_mass():
    generator = torch.Generator().manual_seed(0)
    points = torch.cat([torch.randn(50, 2, generator=generator) * 0.1 + centre for centre in (-5.0, 0.0, 5.0)])
    centroids = kmeans(points, 3)
    assert sorted(round(c) for c in centroids[:, 0].tolist()) == [-5, 0, 5]
    cost, counts = torch.tensor([4.0, 0.01, 1.0, -0.2]), torch.tensor([10.0, 1000.0, 10.0, 50.0])
    # 40 + 10 + 10 of 60: the costliest per token first, until the share asked for is carried; a negative cost never
    assert choose_long_lived(cost, counts, 0.6).tolist() == [True, False, False, False]
    assert choose_long_lived(cost, counts, 0.8).tolist() == [True, False, True, False]
    assert choose_long_lived(cost, counts, 1.0).tolist() == [True, True, True, False]


def test_the_kl_cost_counts_only_the_positions_that_predict_the_completion():
    from training.chain_data import pad_examples

    batch = pad_examples([([5, 6, 7, 8, 9], 2), ([5, 6, 7], 1)], pad_id=0)  # prompts of 2 and 1 tokens
    reference = torch.log_softmax(torch.randn(2, 5, VOCAB, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.allclose(completion_kl(reference.clone(), reference, batch), torch.zeros(2), atol=1e-6)
    shifted = reference.clone()
    shifted[:, 0] += torch.randn(2, VOCAB)  # position 0 predicts row 0's prompt and row 1's completion
    kl = completion_kl(shifted, reference, batch)
    assert kl[0].abs() < 1e-6 and kl[1] > 0
    shifted[0, 1] += torch.randn(VOCAB)  # row 0's first completion token
    assert completion_kl(shifted, reference, batch)[0] > 0


def test_effect_roles_find_the_chain_models_long_lived_tokens_without_the_tasks_labels():
    """On the shipped base model, the kinds whose eviction costs most hold the prompt and the register lines (what
    the chain task's own labels call long-lived), and little of the scratch arithmetic."""
    from dms_runtime.loading import load_model
    from tasks.chain import generate_problem
    from training.chain_data import LONG_LIVED, encode_example, pad_examples, token_regions
    from training.gate_labels import left_window_mask

    model, tokenizer = load_model("checkpoints/chain-qwen3-base", dtype=torch.float32)
    config = DMSConfig(window=16)
    handle = attach_dms(model, build_gates(model, config), config)
    rng = random.Random(1)
    examples = [encode_example(tokenizer, generate_problem(rng, rng.randint(6, 9))) for _ in range(12)]
    batches = [pad_examples(examples[i:i + 4], tokenizer.pad_token_id) for i in range(0, 8, 4)]
    roles = plan_effect_roles(model, handle, batches, config.window, layer=3, kinds=24)
    assert roles.long_lived.any() and not roles.long_lived.all()
    restored = EffectRoles.from_state(roles.state())
    held_out = pad_examples(examples[8:], tokenizer.pad_token_id)
    with torch.no_grad(), handle.mode("off"):
        hidden = model(input_ids=held_out.input_ids, output_hidden_states=True).hidden_states
    kept = restored.mask(hidden, held_out)
    assert torch.equal(kept, roles.mask(hidden, held_out))
    assert torch.equal(restored.kinds(hidden[4], in_completion(held_out)), roles.kinds(hidden[4], in_completion(held_out)))
    old = left_window_mask(held_out.lengths, held_out.input_ids.shape[1], config.window)
    regions = [token_regions(tokenizer, row[:n].tolist(), labels[:n].tolist())
               for row, labels, n in zip(held_out.input_ids, held_out.labels, held_out.lengths.tolist())]
    share = {}
    for wanted in ("long-lived", "facts"):
        marks = torch.zeros_like(old)
        for row, found in enumerate(regions):
            marks[row, :len(found)] = torch.tensor([(r in LONG_LIVED) if wanted == "long-lived" else r == "facts"
                                                    for r in found])
        share[wanted] = kept[old & marks].float().mean().item()
    assert share["long-lived"] > 0.6 and share["long-lived"] > share["facts"] + 0.4, share
