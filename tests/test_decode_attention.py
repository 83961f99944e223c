"""The decode attention kernel against its torch reference (Triton's interpreter on the CPU, the real kernel on
CUDA), and the reference against SDPA over the gathered entries of each (row, KV head)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from dms_runtime.decode_attention import (
    INTERPRETER_PROGRAMS,
    choose_split,
    decode_attention,
    decode_attention_reference,
    decode_attention_triton,
    interpreted_triton,
)

GARBAGE_SLOT = 2**30  # what a table holds past a head's length: out of the pool, so reading it would fault


def make_case(lengths: list[list[int]], groups: int, dim: int = 16, dtype: torch.dtype = torch.float32,
              shared: int = 0, spare: int = 37, seed: int = 0, width_extra: int = 5):
    """A pool whose unused slots hold NaN, and tables of distinct scattered slots for each (row, KV head); with
    ``shared``, every row's first ``shared`` entries per head are row 0's slots (a prompt shared by its threads).
    Table entries past a head's length name slots outside the pool."""
    generator = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths, dtype=torch.int32)
    rows, kv_heads = lengths_t.shape
    slots = sum(map(sum, lengths)) + spare
    order = torch.randperm(slots, generator=generator)
    k_pool = torch.full((slots, dim), float("nan"))
    v_pool = torch.full((slots, dim), float("nan"))
    width = max(max(line) for line in lengths) + width_extra
    table = torch.full((rows, kv_heads, width), GARBAGE_SLOT, dtype=torch.int32)
    table[..., 1::2] = -1
    taken = 0
    for r in range(rows):
        for h in range(kv_heads):
            n = lengths[r][h]
            first = 0
            if r and shared:
                first = min(shared, n, lengths[0][h])
                table[r, h, :first] = table[0, h, :first]
            fresh = order[taken : taken + n - first]
            taken += n - first
            table[r, h, first:n] = fresh.int()
            k_pool[fresh] = torch.randn(len(fresh), dim, generator=generator)
            v_pool[fresh] = torch.randn(len(fresh), dim, generator=generator)
    q = torch.randn(rows, kv_heads * groups, dim, generator=generator)
    return q.to(dtype), k_pool.to(dtype), v_pool.to(dtype), table, lengths_t


def dense_oracle(q, k_pool, v_pool, table, lengths, scale):
    """Per (row, KV head): gather its entries and run SDPA for its query heads; zeros for an empty head."""
    rows, q_heads, dim = q.shape
    kv_heads = table.shape[1]
    groups = q_heads // kv_heads
    out = torch.zeros(rows, q_heads, dim)
    for r in range(rows):
        for h in range(kv_heads):
            n = int(lengths[r, h])
            if n == 0:
                continue
            slots = table[r, h, :n].long()
            keys, values = k_pool[slots].float(), v_pool[slots].float()
            query = q[r, h * groups : (h + 1) * groups].float()
            out[r, h * groups : (h + 1) * groups] = F.scaled_dot_product_attention(query[None], keys[None], values[None], scale=scale)[0]
    return out.to(q.dtype)


TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=1e-2),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def test_reference_matches_dense_sdpa():
    case = make_case([[0, 7, 40], [13, 1, 64], [33, 0, 2]], groups=2, shared=5)
    q, k_pool, v_pool, table, lengths = case
    out = decode_attention_reference(*case, scale=0.25)
    assert not out.isnan().any()
    assert torch.equal(out[0, :2], torch.zeros(2, 16)) and torch.equal(out[2, 2:4], torch.zeros(2, 16))
    torch.testing.assert_close(out, dense_oracle(*case, scale=0.25), **TOLERANCE[torch.float32])
    half = make_case([[9, 30], [0, 17]], groups=4, dtype=torch.float16, seed=3)
    torch.testing.assert_close(decode_attention_reference(*half, scale=0.3), dense_oracle(*half, scale=0.3), **TOLERANCE[torch.float16])


def test_dispatch_and_split_choice(monkeypatch):
    case = make_case([[3, 0]], groups=2)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.testing.assert_close(decode_attention(*case, scale=0.5), decode_attention_reference(*case, scale=0.5))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        decode_attention(*case, scale=0.5, use_triton=True)
    # 8 sequences of 8K entries on 132 SMs: 64 splits of 128 entries each (66 wanted, capped at 4 blocks a split)
    assert choose_split(8, 8192, 32, 528) == (128, 64)
    assert choose_split(2048, 8192, 32, 528) == (8192, 1)  # many threads fill the device alone
    assert choose_split(1, 40, 32, 528) == (64, 1)  # a short head is never cut under MIN_SPLIT_BLOCKS blocks
    assert choose_split(4, 0, 32, 528) == (32, 1)
    split_size, splits = choose_split(1, 10**6, 32, 10**6)
    assert splits <= 128 and split_size * splits >= 10**6


def test_imports_without_triton():
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from dms_runtime.decode_attention import decode_attention, triton_available\n"
        "assert not triton_available()\n"
        "out = decode_attention(torch.ones(1, 2, 4), torch.ones(3, 4), torch.ones(3, 4),"
        " torch.tensor([[[0, 2]]], dtype=torch.int32), torch.tensor([[2]], dtype=torch.int32), 0.5)\n"
        "assert torch.allclose(out, torch.ones(1, 2, 4))\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


@pytest.fixture
def interpreter(monkeypatch):
    """TRITON_INTERPRET=1, set before triton's first import: triton.language's own jitted helpers (tl.sum, tl.zeros)
    are made interpreted or compiled when it is imported, and an interpreted kernel cannot call compiled ones."""
    if torch.cuda.is_available():
        pytest.skip("CUDA here: the compiled kernel is tested instead (an interpreted triton would break it)")
    if "triton" in sys.modules and not interpreted_triton():
        pytest.skip("triton was imported before TRITON_INTERPRET was set (run this file on its own)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
@pytest.mark.parametrize("use_dot", [False, True])
def test_kernel_matches_reference(interpreter, dtype, groups, use_dot):
    """Empty heads, lengths off the block, a shared prompt, NaN in free slots, garbage past the lengths; one split
    (the choice for these 9 sequences: the kernel writes the output itself) and splits of 32 (partials, combined)."""
    lengths = [[0, 45, 1], [70, 0, 33], [31, 96, 2]]
    case = make_case(lengths, groups=groups, dtype=dtype, shared=9, seed=groups)
    expected = decode_attention_reference(*case, scale=0.3)
    for split_size in (None, 32):
        out = decode_attention_triton(*case, scale=0.3, use_dot=use_dot, split_size=split_size)
        assert out.dtype == dtype and not out.isnan().any()
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert torch.equal(out[0, :groups], torch.zeros(groups, 16, dtype=dtype))  # an empty head gives 0


def test_bfloat16_sum_path(interpreter):
    """bf16 through the broadcast-and-sum products (the interpreter's tl.dot multiplies bf16's raw bits, so the
    tl.dot path in bf16 is tested on CUDA only)."""
    case = make_case([[0, 45, 1], [70, 9, 33]], groups=2, dtype=torch.bfloat16, shared=9, seed=2)
    expected = decode_attention_reference(*case, scale=0.3)
    for split_size in (None, 32):
        torch.testing.assert_close(decode_attention_triton(*case, scale=0.3, use_dot=False, split_size=split_size), expected,
                                   **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("use_dot", [False, True])
def test_split_boundaries(interpreter, use_dot):
    """Lengths at, just under and just over split sizes (and block sizes): every split walks a masked tail or
    none, and splits past a head's length contribute nothing."""
    split = 48  # not a multiple of the 32-slot block: a split's last block is cut by the split's end
    lengths = [[split - 1, split, split + 1], [2 * split, 2 * split + 1, 0], [1, 32, 33]]
    case = make_case(lengths, groups=2, seed=7)
    expected = decode_attention_reference(*case, scale=0.2)
    for size in (split, 32, 16, 3 * split):
        torch.testing.assert_close(decode_attention_triton(*case, scale=0.2, use_dot=use_dot, split_size=size), expected,
                                   **TOLERANCE[torch.float32])
    # the automatic choice (9 sequences fill the interpreter's 8 programs: one split), with the bound cut to what is held
    assert choose_split(9, 2 * split + 1, 32, INTERPRETER_PROGRAMS)[1] == 1
    torch.testing.assert_close(decode_attention_triton(*case, scale=0.2, max_length=2 * split + 1), expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(decode_attention(*case, scale=0.2, use_triton=True), expected, **TOLERANCE[torch.float32])


def test_long_head_few_rows_splits(interpreter):
    """One long thread: the automatic choice splits it; all heads empty: zeros, no NaN."""
    case = make_case([[300, 257]], groups=4, dtype=torch.float16, seed=11)
    assert choose_split(2, case[3].shape[2], 32, INTERPRETER_PROGRAMS)[1] >= 2
    torch.testing.assert_close(decode_attention_triton(*case, scale=0.125), decode_attention_reference(*case, scale=0.125),
                               **TOLERANCE[torch.float16])
    q, k_pool, v_pool, table, lengths = case
    empty = decode_attention_triton(q, k_pool, v_pool, table, torch.zeros_like(lengths), scale=0.125)
    assert torch.equal(empty, torch.zeros_like(q))


def test_non_power_of_two_head_dim_and_strided_table(interpreter):
    """head_dim 24 (padded to 32 inside), and a table that is a strided view of a wider one."""
    q, k_pool, v_pool, table, lengths = make_case([[5, 40], [17, 0]], groups=3, dim=24, seed=5)
    wide = torch.full((table.shape[0], table.shape[1], table.shape[2] * 2), -1, dtype=torch.int32)
    wide[..., ::2] = table
    view = wide[..., ::2]
    expected = decode_attention_reference(q, k_pool, v_pool, table, lengths, 0.4)
    for use_dot in (False, True):
        torch.testing.assert_close(decode_attention_triton(q, k_pool, v_pool, view, lengths, 0.4, use_dot=use_dot, split_size=32),
                                   expected, **TOLERANCE[torch.float32])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_matches_reference(monkeypatch, dtype):
    """The compiled kernel at a Qwen3-8B-like shape (GQA 4, head_dim 128), split and unsplit."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 3000, (6, 8), generator=generator, dtype=torch.int32)
    lengths[0, 0], lengths[1, :] = 0, 4096
    case = make_case(lengths.tolist(), groups=4, dim=128, dtype=dtype, shared=500)
    q, k_pool, v_pool, table, lengths = (t.cuda() for t in case)
    expected = decode_attention_reference(q, k_pool, v_pool, table, lengths, 128**-0.5)
    for use_dot in (False, True):
        for split_size in (None, 1 << 20):
            out = decode_attention_triton(q, k_pool, v_pool, table, lengths, 128**-0.5, use_dot=use_dot, split_size=split_size)
            assert not out.isnan().any()
            torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_the_engine_decodes_through_the_kernel(interpreter, monkeypatch):
    """The engine with the Triton kernel (interpreted) in its decode steps gives the tokens of its CPU path: the
    kernel reads the engine's own tables (int32 lines, per-head counts, the host's bound) over evicting DMS rows, a
    vanilla row and a shared prompt."""
    from dms_runtime.paged_cache import PagedDMSCache
    from tests.test_dms import tiny
    from tests.test_engine import PROMPTS, engine_for, ids, random_gates
    from tasks.chain_tokenizer import build_tokenizer
    from workers.thread import SamplingParams

    tokenizer = build_tokenizer()
    model = tiny("qwen3", seed=1)
    adapters = {4: random_gates(model, window=3, seed=2)}

    def run() -> dict:
        engine = engine_for(model, tokenizer, adapters)
        greedy = SamplingParams(max_new_tokens=20)
        engine.submit("dms", ids(PROMPTS[1]), [0, 1], greedy, cr=4)
        engine.submit("vanilla", ids(PROMPTS[2]), [0], greedy)
        results = {(r.problem_id, r.sample): (r.text, r.realized_cr) for r in engine.run()}
        assert engine.pool.used == 0
        engine.close()
        return results

    expected = run()
    calls = []

    def kernel(*args, max_length=None):  # splits of 16 entries: lines past 16 are combined from partials
        calls.append(max_length)
        return decode_attention_triton(*args, max_length=max_length, split_size=16)

    monkeypatch.setattr(PagedDMSCache, "use_triton", True)
    monkeypatch.setattr(sys.modules[decode_attention.__module__], "decode_attention_triton", kernel)
    assert run() == expected
    assert calls and all(bound is not None for bound in calls) and max(calls) > 16
    assert expected[("dms", 0)][1] > 1.2  # the gates evicted
