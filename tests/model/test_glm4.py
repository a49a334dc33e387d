"""GLM-4's and ERNIE 4.5's interleaved RoPE through row reordering, and on two ranks (their
single-rank greedy parity with HF runs in test_hf_parity_archs.py, from GGUFs in
test_loader.py)."""

from __future__ import annotations

import pytest
import torch

from minivllm.model.models.glm4 import halves_from_pairs


@pytest.mark.parametrize("rotary_dim", [8, 16])  # GLM-4's half of a head, ERNIE's whole
def test_reordered_rows_turned_in_halves_give_the_interleaved_scores(rotary_dim):
    """q.k after RoPE in interleaved pairs (HF's GLM-4 code) equals q.k after RoPE in halves
    (this engine's) on rows reordered by halves_from_pairs."""
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb as interleaved
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as halves

    head_dim, heads, positions = 16, 2, 7
    g = torch.Generator().manual_seed(0)
    w_q, w_k = torch.randn(heads * head_dim, 8, generator=g), torch.randn(head_dim, 8, generator=g)
    x = torch.randn(positions, 8, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(positions).float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

    def scores(w_q, w_k, rope):
        q = (x @ w_q.T).view(positions, heads, head_dim).transpose(0, 1)[None]
        k = (x @ w_k.T).view(positions, 1, head_dim).transpose(0, 1)[None]
        q_rot, k_rot = rope(q[..., :rotary_dim], k[..., :rotary_dim], cos[None], sin[None])
        q = torch.cat([q_rot, q[..., rotary_dim:]], -1)
        k = torch.cat([k_rot, k[..., rotary_dim:]], -1)
        return q @ k.transpose(-1, -2)

    reordered = dict(
        halves_from_pairs(
            [("l.q_proj.weight", w_q), ("l.k_proj.weight", w_k), ("l.v_proj.weight", w_k)],
            head_dim,
            rotary_dim,
        )
    )
    assert torch.equal(reordered["l.v_proj.weight"], w_k)  # v's rows are not turned
    assert not torch.equal(reordered["l.q_proj.weight"], w_q)
    expected = scores(w_q, w_k, interleaved)
    got = scores(reordered["l.q_proj.weight"], reordered["l.k_proj.weight"], halves)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_ernie_with_biases_on_every_projection_is_refused():
    from transformers import Ernie4_5Config

    from minivllm.model.models.ernie4_5 import Ernie4_5ForCausalLM
    from minivllm.platforms import get_platform

    config = Ernie4_5Config(hidden_size=64, num_attention_heads=4, head_dim=16, use_bias=True)
    with pytest.raises(NotImplementedError, match="use_bias"):
        Ernie4_5ForCausalLM(config, get_platform("cpu").create_attn_backend(16))


@pytest.mark.parametrize("arch", ["glm4", "ernie4_5"])
def test_two_ranks_give_hf_greedy_outputs(tmp_path, smollm2_tokenizer, arch):
    """Two worker processes, each with half of the heads: the reordered q/k rows (and GLM's
    biases) shard by heads as any others, and the greedy tokens are HF's."""
    from tests.conftest import write_tiny_checkpoint
    from tests.model.test_hf_parity_archs import assert_two_ranks_give_hf_greedy_outputs

    folder = write_tiny_checkpoint(arch, str(tmp_path / arch), smollm2_tokenizer)
    assert_two_ranks_give_hf_greedy_outputs(folder)
